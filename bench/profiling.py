"""Where our server spends its time under load: py-spy samples it during one extra wrk run.

The profiled run is not one of the measured ones (py-spy shares the client CPU with wrk, so
throughput drops a little); it records a flamegraph (SVG) and the collapsed stacks, from which
the report lists the functions with the most samples, by own time and including callees.
`--nonblocking` samples without pausing the server.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from .runner import Load, Results, progress
from .servers import CLIENT_CPU, Server
from .wrk import WrkError, WrkResult, run_wrk

PROFILE_RATE_HZ = 200
TOP = 15
PROFILE_DIR_NAME = "profiles"
# Frames every sample passes through (start-up, the event loop): left out of the inclusive
# ranking, where they would fill the top rows at ~100 %.
OUTER_FRAMES = ("<frozen runpy>", "__main__.py", "shared/web/cli.py", "run (shared/web/server.py", "serve_app (shared/web/server.py",
                "asyncio/runners.py", "asyncio/base_events.py", "asyncio/events.py")


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile_ours(results: Results, scenario: str, server: Server, load: Load, connections: int,
                 duration_s: float) -> WrkResult | None:
    """Profile `server` during one wrk run of `load`; that run's result (None when it did not
    run: no py-spy, or wrk failed)."""
    binary = py_spy()
    if binary is None:
        results.note(f"profile of {scenario} skipped: py-spy is not installed (pip install py-spy)")
        return None
    out_dir = Path(results.meta["output_dir"]) / PROFILE_DIR_NAME
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds = max(1, round(duration_s))
    outputs = {"raw": out_dir / f"{scenario}.collapsed.txt", "flamegraph": out_dir / f"{scenario}.svg"}
    recorders = [
        subprocess.Popen(
            ["taskset", "-c", str(CLIENT_CPU), binary, "record", "--pid", str(server.pid), "--duration",
             str(seconds), "--rate", str(PROFILE_RATE_HZ), "--nonblocking", "--format", fmt,
             "--output", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for fmt, path in outputs.items()
    ]
    progress(f"profiling ours on {scenario} (c={connections}, {seconds} s, py-spy)")
    try:
        result = run_wrk(server.url, load.script, load.args, connections=connections, duration_s=seconds + 1,
                         cpu=CLIENT_CPU)
    except WrkError as exc:
        result = None
        results.note(f"profile of {scenario}: wrk failed: {exc}")
    problems = []
    for recorder in recorders:
        try:
            _, stderr = recorder.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            recorder.kill()
            _, stderr = recorder.communicate()
        if recorder.returncode != 0:
            problems.append(stderr.strip()[-500:])
    raw = outputs["raw"]
    if problems or not raw.exists():
        results.note(f"profile of {scenario} failed: {' | '.join(problems) or 'no output'}")
        return result
    entry: dict[str, Any] = {
        "scenario": scenario,
        "connections": connections,
        "rps_while_profiled": result.rps if result else None,
        "collapsed": str(raw.relative_to(out_dir.parent)),
        "flamegraph": str(outputs["flamegraph"].relative_to(out_dir.parent)),
        **top_functions(raw.read_text()),
    }
    results.profiles.append(entry)
    return result


def _function(frame: str) -> str:
    """`handle (starlette/routing.py:73)` -> `handle (starlette/routing.py)`: lines of one function merge."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})" if path else name


def top_functions(collapsed: str, top: int = TOP) -> dict[str, Any]:
    """Samples by function: own (the innermost frame) and inclusive (anywhere on the stack,
    OUTER_FRAMES left out). Native code shows as the Python frame that called it."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(frame) for frame in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for function in set(frames):
            if not any(outer in function for outer in OUTER_FRAMES):
                inclusive[function] += count
    def share(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, 100.0 * count / total) for name, count in counter.most_common(top)] if total else []
    return {"samples": total, "top_own": share(own), "top_inclusive": share(inclusive)}
