"""The gateway stack for `python -m bench.gateway`: the library's `dynamo_lite.stack.Stack` with
the benchmark's settings, and what only the benchmark reads from it.

    load generator ──▶ Envoy (one per variant) ──ext_proc──▶ picker ──▶ slot tracker, indexer
                         └──▶ engine stand-ins ──KV events──▶ indexer

The picker runs alone on `SERVER_CPU`; everything else (Envoy, engines, sidecars, services) on
`CLIENT_CPU` with the load generator: the picker's CPU time is then its own, and what it sustains
is not shared with what loads it. Engines hash with seed 0 and the picker draws with seed 0, so
runs repeat; the services log warnings only (an info line per request would be part of the cost).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_lite.stack import Envoy, EnvoySettings, Stack

from .servers import CLIENT_CPU, SERVER_CPU

MODEL = "mock"
BLOCK_SIZE = 16  # tokens per KV block on the engines (vLLM's default)


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


def gateway_stack(*, engines: int, engine_settings: EngineSettings, variants: Sequence[str],
                  picker_flags: Sequence[str] = (), state: str = "services", profile_path: Path | None = None) -> Stack:
    """The stack (enter it to start it) with one Envoy per variant, all in front of the same engines
    and picker (none for Envoy's own balancers alone). `state` "in-process": the picker holds the
    index and the loads itself, no slot tracker or indexer runs. `profile_path`: the picker runs
    under cProfile, which writes there when the stack stops it."""
    settings = engine_settings
    profiler = ["-m", "cProfile", "-o", str(profile_path)] if profile_path is not None else []
    return Stack(engines=engines, roles=settings.roles, model=MODEL, block_size=BLOCK_SIZE, speedup=settings.speedup,
                 num_blocks=settings.num_blocks, engine_flags=["--prefix-caching-hash-seed", "0", *settings.extra],
                 role_flags={"prefill": settings.kv_transfer, "decode": settings.kv_transfer}, first_worker_id=100,
                 state=state, picker_flags=["--seed", "0", "--shutdown-grace-secs", "2", *picker_flags],
                 picker_python_flags=profiler, envoys={envoy_name(variant): EnvoySettings(variant) for variant in variants},
                 log_level="warning", cpu=CLIENT_CPU, picker_cpu=SERVER_CPU)


def envoy_name(variant: str) -> str:
    return f"envoy_{variant}"


def envoy_of(stack: Stack, variant: str) -> Envoy:
    """The stack's Envoy in the `variant` configuration."""
    return stack.envoys[envoy_name(variant)]


def picker_cpu_seconds(stack: Stack) -> float:
    """The picker's CPU time so far (0 when the stack has no picker)."""
    return process_cpu_seconds(stack.process("picker").pid) if stack.has_picker else 0.0


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
