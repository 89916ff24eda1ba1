"""What every scenario shares: the settings of a run, the collected numbers, and the loop that
measures one point with wrk, the servers interleaved within each repetition.

A point is one (scenario, label, connections). Each repetition runs every server in turn, so a
slow drift of the machine (another process, thermal throttling) spreads over all of them
instead of favouring whichever ran first; the report takes medians over repetitions.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .servers import CLIENT_CPU, Server
from .wrk import WrkError, WrkResult, run_wrk

CONNECTIONS = (1, 64)
HEAVY_CONNECTIONS = 64


@dataclass(frozen=True)
class Settings:
    duration_s: float = 10.0
    warmup_s: float = 2.0
    repetitions: int = 3
    scaling_repetitions: int = 3
    ingest_blocks: int = 640_000  # per repetition and server
    small_index_pairs: int = 10_000
    large_index_pairs: int = 1_000_000
    profile: bool = True
    quick: bool = False

    @classmethod
    def quick_run(cls, profile: bool) -> Settings:
        """A smoke run of every code path: short points, one repetition, same state sizes."""
        return cls(duration_s=2.0, warmup_s=1.0, repetitions=1, scaling_repetitions=1,
                   ingest_blocks=64_000, profile=profile, quick=True)


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def progress(text: str) -> None:
    print(f"[{stamp()}] {text}", flush=True)


@dataclass
class Results:
    """Everything a run measured, in plain JSON-able rows (see report.py for their use)."""

    settings: Settings
    meta: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    ingest: list[dict[str, Any]] = field(default_factory=list)
    index_memory: list[dict[str, Any]] = field(default_factory=list)  # bench/memory.py, per fill and role
    tracker_memory: list[dict[str, Any]] = field(default_factory=list)  # per role and active requests
    pauses: list[dict[str, Any]] = field(default_factory=list)  # query latency idle / while ingesting
    profiles: list[dict[str, Any]] = field(default_factory=list)
    cores: list[dict[str, Any]] = field(default_factory=list)  # {"name", "us"}: bench/cores.py
    security: list[dict[str, Any]] = field(default_factory=list)  # TLS runs: bench/security.py
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        progress(f"NOTE: {text}")
        self.notes.append(text)

    def add_run(self, scenario: str, label: str, role: str, connections: int, rep: int, result: WrkResult) -> None:
        self.runs.append({"scenario": scenario, "label": label, "role": role, "connections": connections,
                          "rep": rep, **result.as_dict()})

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings.__dict__, "meta": self.meta, "runs": self.runs, "ingest": self.ingest,
                "index_memory": self.index_memory,
                "tracker_memory": self.tracker_memory, "pauses": self.pauses, "profiles": self.profiles,
                "cores": self.cores, "security": self.security, "notes": self.notes}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")


@dataclass(frozen=True)
class Load:
    """What wrk sends to one server: a script from lua/ and its arguments."""

    script: str
    args: list[str]


# (role, run id) -> the load; a run id is unique per wrk run, warm-ups included.
LoadFor = Callable[[str, str], Load]
Prepare = Callable[[str, float], None]  # (role, seconds the next warm-up + run will take)
Finished = Callable[[str, str, WrkResult], None]  # (role, run id, result) after each wrk run, warm-ups too


def measure_point(
    results: Results,
    scenario: str,
    label: str,
    servers: dict[str, Server],
    roles: Sequence[str],
    connections: Sequence[int],
    repetitions: int,
    load_for: LoadFor,
    prepare: Prepare | None = None,
    finished: Finished | None = None,
) -> None:
    """Warm-up, then one measured wrk run, for every repetition x connections x role.
    `finished` sees every run's result, a warm-up's too (e.g. to clear the state it left)."""
    settings = results.settings
    for rep in range(1, repetitions + 1):
        for conns in connections:
            for role in roles:
                server = servers[role]
                if prepare is not None:
                    prepare(role, settings.warmup_s + settings.duration_s)
                run_id = f"{scenario}-{role}-r{rep}-c{conns}-{time.monotonic_ns()}"
                try:
                    if settings.warmup_s > 0:
                        warm = _wrk(server, load_for(role, run_id + "-warm"), conns, settings.warmup_s)
                        if finished is not None:
                            finished(role, run_id + "-warm", warm)
                    result = _wrk(server, load_for(role, run_id), conns, settings.duration_s)
                    if finished is not None:
                        finished(role, run_id, result)
                except WrkError as exc:
                    results.note(f"{scenario} [{label}] c={conns} rep {rep} {role}: wrk failed: {exc}")
                    continue
                results.add_run(scenario, label, role, conns, rep, result)
                errors = f"  ERRORS {result.errors}" if result.errors else ""
                progress(f"{scenario:<22} {label:<24} c={conns:<3} rep {rep}/{repetitions} {role:<9} "
                         f"{result.rps:>10,.0f} req/s  p50 {result.p50_us / 1000:7.2f} ms{errors}")
                if result.errors:
                    results.note(f"{scenario} [{label}] c={conns} rep {rep} {role}: {result.errors} errors "
                                 f"(status {result.status_errors}, timeouts {result.timeouts}, "
                                 f"read {result.read_errors}, connect {result.connect_errors})")


def _wrk(server: Server, load: Load, connections: int, duration_s: float) -> WrkResult:
    return run_wrk(server.url, load.script, load.args, connections=connections, duration_s=duration_s,
                   cpu=CLIENT_CPU)


def machine_facts() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        wrk_version = "unknown"
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "wrk": wrk_version.split(" Copyright")[0]}
