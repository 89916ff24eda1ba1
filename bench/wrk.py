"""Running wrk (pinned to its own CPU) and reading its result.

Every script is run with `lua/report.lua` appended, whose `done()` prints one
`BENCH_RESULT {...}` JSON line with wrk's own counters (requests, errors by kind, latency
percentiles in microseconds); `parse_wrk_output` reads that line, so nothing depends on the
rounding of wrk's human-oriented text. A script that knows more (how far its request sequence
got, latencies per route) prints it as a `BENCH_EXTRA {...}` line, kept as `WrkResult.extra`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LUA_DIR = Path(__file__).with_name("lua")
RESULT_MARKER = "BENCH_RESULT "
EXTRA_MARKER = "BENCH_EXTRA "
# A point that ends this much later than asked means wrk or the server was stuck.
_TIMEOUT_MARGIN_SECS = 30.0


@dataclass(frozen=True)
class WrkResult:
    duration_s: float
    requests: int
    bytes: int
    connect_errors: int
    read_errors: int
    write_errors: int
    status_errors: int  # responses with a status >= 400: the point measured failures
    timeouts: int
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    extra: dict[str, Any] = field(default_factory=dict)  # the script's BENCH_EXTRA line, if any

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def errors(self) -> int:
        return self.connect_errors + self.read_errors + self.write_errors + self.status_errors + self.timeouts

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {**asdict(self), "rps": self.rps, "errors": self.errors}
        if not self.extra:
            del row["extra"]
        return row


class WrkError(RuntimeError):
    pass


def parse_wrk_output(text: str) -> WrkResult:
    """The result line printed by lua/report.lua (and the script's extra line); WrkError when
    wrk did not print one."""
    extra: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith(EXTRA_MARKER):
            extra = json.loads(line[len(EXTRA_MARKER):])
    for line in text.splitlines():
        if line.startswith(RESULT_MARKER):
            raw = json.loads(line[len(RESULT_MARKER):])
            return WrkResult(
                duration_s=raw["duration_us"] / 1e6,
                requests=int(raw["requests"]),
                bytes=int(raw["bytes"]),
                connect_errors=int(raw["connect_errors"]),
                read_errors=int(raw["read_errors"]),
                write_errors=int(raw["write_errors"]),
                status_errors=int(raw["status_errors"]),
                timeouts=int(raw["timeouts"]),
                p50_us=float(raw["p50_us"]),
                p90_us=float(raw["p90_us"]),
                p99_us=float(raw["p99_us"]),
                mean_us=float(raw["mean_us"]),
                extra=extra,
            )
    raise WrkError(f"no {RESULT_MARKER.strip()} line in wrk output:\n{text[-2000:]}")


def wrk_binary() -> str | None:
    return shutil.which("wrk")


def ensure_wrk() -> str:
    """The wrk executable, installing Debian's `wrk` package with apt-get when it is missing."""
    found = wrk_binary()
    if found:
        return found
    print("wrk not found: installing it with apt-get (Debian package `wrk`)...", flush=True)
    sudo = [] if _is_root() else ["sudo", "-n"]
    for argv in ([*sudo, "apt-get", "update"], [*sudo, "apt-get", "install", "-y", "wrk"]):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise WrkError(f"could not run {' '.join(argv)}: {exc}. Install wrk yourself (apt-get install wrk).") from exc
        if done.returncode != 0:
            raise WrkError(
                f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()[-1000:]}\n"
                "Install wrk yourself (Debian/Ubuntu: apt-get install wrk) and run again."
            )
    found = wrk_binary()
    if not found:
        raise WrkError("apt-get installed wrk but it is not on PATH")
    return found


def _is_root() -> bool:
    return os.geteuid() == 0


def run_wrk(
    url: str,
    script: str,
    script_args: list[str],
    *,
    connections: int,
    duration_s: float,
    cpu: int | None,
    timeout_s: float = 5.0,
) -> WrkResult:
    """One wrk run with one thread (the Lua scripts keep per-thread counters) on `cpu`."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="bench_", delete=True) as combined:
        combined.write((LUA_DIR / script).read_text())
        combined.write("\n")
        combined.write((LUA_DIR / "report.lua").read_text())
        combined.flush()
        argv = [
            wrk_binary() or "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(duration_s))}s",
            f"--timeout={timeout_s:g}s",
            "--latency",
            "-s", combined.name,
            url,
            "--",
            *script_args,
        ]
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=duration_s + _TIMEOUT_MARGIN_SECS
            )
        except subprocess.TimeoutExpired as exc:
            raise WrkError(f"wrk did not finish: {' '.join(argv)}") from exc
    if done.returncode != 0:
        raise WrkError(f"wrk exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return parse_wrk_output(done.stdout)
