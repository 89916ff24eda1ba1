"""The pure cores' hot paths (no HTTP), for `python -m bench`'s core targets.

    python -m bench.cores          # a table
    python -m bench.cores --json   # what `python -m bench` reads (it runs this on the server CPU)

Each figure is the worst, over 10 / 1k / 10k active requests, of the best of five timings
(`bench.slot_tracker_core`), and for the indexer the slower of the i64 and u64 query variants
(`bench.indexer_core`): a target is met only if it holds in every state measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import indexer_core, scheduling_core, slot_tracker_core
from .runner import Results, progress
from .servers import SERVER_CPU

ACTIVE_COUNTS = (10, 1_000, 10_000)


def measure() -> dict[str, float]:
    rows = {ranks: [slot_tracker_core.measure(ranks, active) for active in ACTIVE_COUNTS] for ranks in (16, 256)}
    return {
        "potential_loads, 512 hashes, 16 ranks": max(row["potential_loads(512)"] for row in rows[16]),
        "potential_loads, 512 hashes, 256 ranks": max(row["potential_loads(512)"] for row in rows[256]),
        "add + prefill_complete + free, 256 hashes": max(row["add+prefill+free(256)"] for row in rows[16]),
        "loads, 16 ranks": max(row["loads"] for row in rows[16]),
        "query_by_hash, 512 hashes, 16 workers": max(indexer_core.query_time(signed=True),
                                                    indexer_core.query_time(signed=False)),
        **scheduling_core.measure(),
    }


def run(results: Results, selected: set[str]) -> None:
    if "cores" not in selected:
        return
    progress(f"cores: pure hot paths on CPU {SERVER_CPU}")
    results.cores.extend({"name": name, "us": us} for name, us in on_server_cpu("bench.cores").items())


def on_server_cpu(module: str) -> dict[str, Any]:
    """`python -m <module> --json` pinned to the server CPU: its {name: microseconds}."""
    done = subprocess.run(["taskset", "-c", str(SERVER_CPU), sys.executable, "-m", module, "--json"],
                          capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def print_measured(measured: dict[str, float], width: int = 45, digits: int = 1) -> None:
    """{name: microseconds} as JSON with `--json` on the command line, else as a table."""
    if "--json" in sys.argv[1:]:
        print(json.dumps(measured))
        return
    for name, us in measured.items():
        print(f"{name:<{width}} {us:8.{digits}f} us")


def main() -> None:
    print_measured(measure())


if __name__ == "__main__":
    main()
