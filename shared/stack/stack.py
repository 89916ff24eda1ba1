"""`Stack`: the whole KV-aware gateway on loopback, every part a real process.

    client ──▶ Envoy ──ext_proc──▶ picker (python -m dynamo_lite.epp)
                 │                    ├──▶ slot tracker
                 └──▶ engine stand-ins ──KV events──▶ indexer ◀┘

In start order: the slot tracker and the indexer (unless the picker holds their state itself,
`state="in-process"`), the engine stand-ins publishing KV events (each decode engine followed by
its P/D sidecar), a pool file naming them, the picker, and one Envoy per `envoys` entry, each
waited for before the next starts. Ports are free loopback ports unless `ports` fixes them (the
`python -m dynamo_lite.stack` command's). Logs and generated files go to `workdir` (default: a
new temporary folder, removed when the stack stops cleanly, kept and named when it failed).

Each part is a `Process` by name (`slot_tracker`, `indexer`, `engine0`…, `sidecar1`…, `picker`,
the `envoys` keys): `stop`, `kill` (SIGKILL), `start` and `restart` break and mend it on
purpose; `wait_ready` and `wait_idle` (no request booked) wait with a bound.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from .envoy import WITHOUT_PICKER, Envoy, EnvoySettings
from .processes import LOOPBACK, Process, StackError, free_port

# The engine stand-in's KV blocks by default, given explicitly to decode engines and in the pool
# file: a decode endpoint's /metrics are its sidecar's, which do not tell the picker.
KV_BLOCKS = 8192
# The KV connector's role of a stand-in by its pool role (vLLM's --kv-transfer-config kv_role).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROLES = ("aggregated", "prefill", "decode")


@dataclass(frozen=True)
class FixedPorts:
    """Ports fixed in advance (the command's): engine i on `engine + i` with KV events on
    `kv_events + 10 i` (replay: +1), the decode engines' sidecars on the ports after all the
    engines'; one Envoy, on `gateway`."""

    gateway: int = 8081
    envoy_admin: int = 9901
    engine: int = 8000
    kv_events: int = 5557
    slot_tracker: int = 8091
    indexer: int = 8090
    picker: int = 9002
    picker_http: int = 9003


@dataclass(frozen=True)
class Engine:
    """One engine stand-in as the stack started it."""

    index: int
    worker_id: int
    port: int
    events_port: int
    replay_port: int
    role: str = "aggregated"
    sidecar_port: int = 0  # a decode engine's P/D sidecar

    @property
    def name(self) -> str:
        return f"engine{self.index}"

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def endpoint(self) -> str:
        """Where the picker and Envoy send this engine's requests: its sidecar, if it has one."""
        return f"{LOOPBACK}:{self.sidecar_port}" if self.sidecar_port else self.address

    @property
    def sidecar_url(self) -> str:
        return f"http://{LOOPBACK}:{self.sidecar_port}"


class Stack:
    """The gateway's processes, planned at construction (ports chosen, nothing started) and
    started by `start_all` or `with`.

    `roles`: each engine's role ("aggregated", "prefill", "decode"; empty: every engine
    aggregated, and the pool file names no role); `engine_flags` go to every engine, after the
    stack's own, `role_flags` to the engines of a role after those. `num_blocks`: every engine's
    KV blocks (None: the stand-in's default). `picker=False` starts no picker; so does an Envoy
    list of picker-less variants only. `cpu` pins every process, `picker_cpu` the picker (default:
    `cpu`). `log_level`: the Python services' (None: their default)."""

    def __init__(
        self,
        *,
        engines: int = 2,
        roles: Sequence[str] = (),
        model: str = "mock",
        block_size: int = 16,
        speedup: float = 1.0,
        num_blocks: int | None = None,
        engine_flags: Sequence[str] = (),
        role_flags: Mapping[str, Sequence[str]] | None = None,
        first_worker_id: int = 1,
        state: str = "services",
        picker: bool = True,
        picker_flags: Sequence[str] = (),
        picker_python_flags: Sequence[str] = (),
        envoys: Mapping[str, EnvoySettings] | None = None,
        ports: FixedPorts | None = None,
        workdir: Path | None = None,
        log_level: str | None = None,
        cpu: int | None = None,
        picker_cpu: int | None = None,
        ready_timeout: float = 60.0,
        stop_grace: float = 5.0,
        python: str = sys.executable,
    ) -> None:
        roles = tuple(roles)
        if roles and len(roles) != engines:
            raise ValueError(f"{len(roles)} roles for {engines} engines")
        if any(role not in ROLES for role in roles):
            raise ValueError(f"roles are {', '.join(ROLES)}: not {roles}")
        envoys = {"envoy": EnvoySettings()} if envoys is None else dict(envoys)
        if ports is not None and len(envoys) > 1:
            raise ValueError("fixed ports have room for one Envoy")
        self.model, self.block_size, self.num_blocks, self.speedup = model, block_size, num_blocks, speedup
        self.state = state
        self.disaggregated = bool(roles)
        self.ready_timeout = ready_timeout
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="dynamo-lite-stack-")) if workdir is None else workdir
        self.pool_path = self.workdir / "pool.yaml"
        self.failed = False
        self._python = python
        self._log_level = log_level
        self._stop_grace = stop_grace
        self._ports = ports

        fixed = ports
        slot_tracker_port = fixed.slot_tracker if fixed else free_port()
        indexer_port = fixed.indexer if fixed else free_port()
        self.slot_tracker = f"http://{LOOPBACK}:{slot_tracker_port}"
        self.indexer = f"http://{LOOPBACK}:{indexer_port}"
        self.engines = self._plan_engines(engines, roles or ("aggregated",) * engines, first_worker_id)
        self.picker_port = fixed.picker if fixed else free_port()
        self.picker_http_port = fixed.picker_http if fixed else free_port()
        self.picker_url = f"http://{LOOPBACK}:{self.picker_http_port}"

        self.processes: dict[str, Process] = {}
        if state == "services":
            self._add("slot_tracker", self._python_module("slot_tracker", slot_tracker_port), slot_tracker_port, cpu)
            self._add("indexer", self._python_module("indexer", indexer_port), indexer_port, cpu)
        role_flags = role_flags or {}
        for engine in self.engines:
            self._add(engine.name, self._engine_argv(engine, [*engine_flags, *role_flags.get(engine.role, ())]),
                      engine.port, cpu, ready="/health", ports=(engine.port, engine.events_port, engine.replay_port))
            if engine.sidecar_port:
                self._add(f"sidecar{engine.index}", self._sidecar_argv(engine), engine.sidecar_port, cpu,
                          ready="/health")
        # Envoy's own balancers alone call no picker: none is started for them.
        self.has_picker = picker and (not envoys or any(s.variant not in WITHOUT_PICKER for s in envoys.values()))
        if self.has_picker:
            self._add("picker", self._picker_argv(picker_python_flags, picker_flags), self.picker_http_port,
                      cpu if picker_cpu is None else picker_cpu, ports=(self.picker_port, self.picker_http_port))
        # Envoy's destinations: a prefill engine never is one (the picker names it in a header to
        # the decode engine's sidecar). The cluster needs a host even with no engine: the first
        # engine's port, unanswered.
        endpoints = [engine.endpoint for engine in self.engines if engine.role != "prefill"]
        endpoints = endpoints or [f"{LOOPBACK}:{fixed.engine if fixed else free_port()}"]
        self.envoys: dict[str, Envoy] = {}
        for name, settings in envoys.items():
            if name in self.processes:
                raise ValueError(f"an Envoy named {name!r} would shadow the stack's {name}")
            envoy = Envoy(settings, picker_port=self.picker_port, engines=endpoints, name=name, workdir=self.workdir,
                          listen_port=fixed.gateway if fixed else None, admin_port=fixed.envoy_admin if fixed else None,
                          cpu=cpu)
            envoy.stop_grace = stop_grace
            self.envoys[name] = self.processes[name] = envoy

    # --- planning -----------------------------------------------------------------------------

    def _plan_engines(self, count: int, roles: Sequence[str], first_worker_id: int) -> list[Engine]:
        fixed = self._ports
        decode_numbers = iter(range(count))
        planned = []
        for index, role in enumerate(roles):
            events = fixed.kv_events + 10 * index if fixed else free_port()
            sidecar = 0
            if role == "decode":
                sidecar = fixed.engine + count + next(decode_numbers) if fixed else free_port()
            planned.append(Engine(index, first_worker_id + index, fixed.engine + index if fixed else free_port(),
                                  events, events + 1 if fixed else free_port(), role, sidecar))
        return planned

    def _add(self, name: str, argv: list[str], port: int, cpu: int | None, *, ready: str = "/ready",
             ports: tuple[int, ...] = ()) -> None:
        """One process, ready when `GET ready` on `port` answers 200; `ports`: all it listens on."""
        self.processes[name] = Process(name, argv, self.workdir / f"{name}.log", ready=f"http://{LOOPBACK}:{port}{ready}",
                                       ports=ports or (port,), cpu=cpu, stop_grace=self._stop_grace)

    def _python_module(self, module: str, port: int) -> list[str]:
        argv = [self._python, "-m", f"dynamo_lite.{module}", "--host", LOOPBACK, "--port", str(port)]
        return argv + (["--log-level", self._log_level] if self._log_level else [])

    def _engine_argv(self, engine: Engine, flags: Sequence[str]) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{LOOPBACK}:{engine.events_port}",
                  "replay_endpoint": f"tcp://{LOOPBACK}:{engine.replay_port}"}
        argv = [*self._python_module("mock_engine", engine.port), "--served-model-name", self.model,
                "--block-size", str(self.block_size), "--speedup-ratio", str(self.speedup),
                "--kv-events-config", json.dumps(events)]
        blocks = self.num_blocks if self.num_blocks is not None else KV_BLOCKS if engine.role == "decode" else None
        if blocks is not None:
            argv += ["--num-blocks", str(blocks)]
        if engine.role in KV_ROLES:
            argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": KV_ROLES[engine.role]})]
        return [*argv, *flags]

    def _sidecar_argv(self, engine: Engine) -> list[str]:
        return [*self._python_module("pd_sidecar", engine.sidecar_port), "--decode-url", engine.url]

    def _picker_argv(self, python_flags: Sequence[str], flags: Sequence[str]) -> list[str]:
        argv = [self._python, *python_flags, "-m", "dynamo_lite.epp", "--host", LOOPBACK, "--port", str(self.picker_port),
                "--metrics-port", str(self.picker_http_port), "--pool", str(self.pool_path)]
        if self._log_level:
            argv += ["--log-level", self._log_level]
        if self.state == "services":
            argv += ["--slot-tracker", self.slot_tracker, "--indexer", self.indexer]
        else:
            argv += ["--state", self.state]
        return [*argv, *flags]

    def pool(self) -> list[dict[str, Any]]:
        """The pool file's entries: one per engine, at its endpoint; with roles, each its role,
        and its KV capacity where the engine's /metrics cannot tell it."""
        entries: list[dict[str, Any]] = []
        for engine in self.engines:
            entry: dict[str, Any] = {
                "address": engine.endpoint, "worker_id": engine.worker_id, "model": self.model,
                "block_size": self.block_size, "kv_events_endpoint": f"tcp://{LOOPBACK}:{engine.events_port}",
                "replay_endpoint": f"tcp://{LOOPBACK}:{engine.replay_port}"}
            if self.disaggregated:
                entry["role"] = engine.role
                if engine.role == "decode" or self.num_blocks is not None:
                    entry["total_kv_blocks"] = self.num_blocks or KV_BLOCKS
            entries.append(entry)
        return entries

    def write_pool(self, entries: list[dict[str, Any]]) -> None:
        """Replace the pool file at once (the picker may be reading it)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        temporary = self.pool_path.with_suffix(".tmp")
        temporary.write_text(yaml.safe_dump(entries, sort_keys=False))
        temporary.replace(self.pool_path)

    # --- lifecycle ----------------------------------------------------------------------------

    def start_all(self, started: Callable[[Process], None] | None = None,
                  stopping: Callable[[], bool] = lambda: False) -> Stack:
        """Start every process in order, each ready before the next (the Envoys are launched
        together, then waited for); `started(process)` after each. Returns early, what started
        left running, once `stopping()` says so. On failure the caller closes (`with` does)."""
        if self.has_picker:
            self.write_pool(self.pool())
        for process in self.processes.values():
            if isinstance(process, Envoy):
                continue
            process.start(self.ready_timeout)
            if started is not None:
                started(process)
            if stopping():
                return self
        for envoy in self.envoys.values():
            envoy.launch()
        for envoy in self.envoys.values():
            envoy.wait_ready(self.ready_timeout)
            if started is not None:
                started(envoy)
        return self

    def close(self) -> None:
        """Stop every process, last started first (Envoy before what it sends to). The working
        folder goes with them unless it was given or something failed."""
        for process in reversed(list(self.processes.values())):
            process.stop()
        if self._own_workdir:
            if self.failed:
                print(f"the logs are kept in {self.workdir}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Stack:
        try:
            return self.start_all()
        except BaseException:
            self.failed = True
            self.close()
            raise

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.failed = self.failed or exc_type is not None
        self.close()

    def process(self, name: str) -> Process:
        try:
            return self.processes[name]
        except KeyError:
            raise StackError(f"no {name!r} in this stack (it has {', '.join(self.processes)})") from None

    def start(self, name: str) -> Process:
        """Start one part again (stopped or killed) and wait until it is ready."""
        return self.process(name).start(self.ready_timeout)

    def stop(self, name: str) -> None:
        self.process(name).stop()

    def kill(self, name: str) -> None:
        """SIGKILL one part: a crash, no goodbye to anyone."""
        self.process(name).kill()

    def restart(self, name: str) -> Process:
        return self.process(name).restart(self.ready_timeout)

    def wait_ready(self, name: str) -> Process:
        return self.process(name).wait_ready(self.ready_timeout)

    def dead(self) -> list[Process]:
        """Started processes that have exited."""
        return [process for process in self.processes.values() if process.popen is not None and not process.alive()]

    # --- reading ------------------------------------------------------------------------------

    @property
    def envoy(self) -> Envoy:
        """The first Envoy."""
        return next(iter(self.envoys.values()))

    @property
    def url(self) -> str:
        """The gateway: the first Envoy's listener."""
        return self.envoy.url

    def picker_metrics(self) -> dict[str, float]:
        """The picker's Prometheus samples, `name{labels}` → value."""
        samples: dict[str, float] = {}
        for line in httpx.get(self.picker_url + "/metrics", timeout=5.0).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    samples[key] = float(value)
                except ValueError:
                    continue
        return samples

    def picker_metric(self, name: str, **labels: str) -> float:
        """One sample of the picker's (0 when absent)."""
        wanted = name + ("{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}" if labels else "")
        return self.picker_metrics().get(wanted, 0.0)

    def active_requests(self) -> int:
        """Requests booked and not yet freed: the slot tracker's, or the picker's own."""
        if self.state != "services":
            return int(self.picker_metrics().get("dynamo_lite_slot_tracker_active_requests", 0))
        dump = httpx.get(self.slot_tracker + "/dump", timeout=5.0).json()
        return sum(len(partition.get("requests", [])) for partition in dump.get("partitions", []))

    def wait_idle(self, timeout: float = 10.0, *, check: bool = True) -> tuple[int, float]:
        """Until no request is booked, `timeout` s at most: (requests left, seconds waited);
        with `check`, requests left raise StackError."""
        started = time.monotonic()
        while True:
            active = self.active_requests()
            waited = time.monotonic() - started
            if active == 0 or waited >= timeout:
                break
            time.sleep(0.05)
        if active and check:
            raise StackError(f"{active} requests still booked after {timeout:.0f} s")
        return active, waited

