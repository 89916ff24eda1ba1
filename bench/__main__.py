"""Run the whole benchmark suite and write bench/RESULTS.md (about 40 minutes).

    python -m bench                      # everything: bench/RESULTS.md, bench/results.json, bench/profiles/
    python -m bench --quick              # smoke run of every path (a few minutes), into a temp dir
    python -m bench --only potential_loads,query_by_hash
    python -m bench --list               # scenario names

Needs Linux with 2+ CPUs (server on CPU 0, load generator on CPU 1), `wrk` (installed with
apt-get when missing) and network access the first time, to install `ai-dynamo-runtime==1.6.1`
into its own venv (see tests/support/reference_server.py). Benchmarks print numbers; they never fail
a test run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from . import cores, indexer_http, memory, report, security, select_service_http, slot_tracker_http, zmq_ingest
from .runner import Results, Settings, machine_facts, progress
from .servers import CLIENT_CPU, SERVER_CPU, pin_to_client_cpu, reference_python
from .wrk import ensure_wrk

BENCH_DIR = Path(__file__).resolve().parent
SCENARIOS = {
    "health": "slot tracker GET /health",
    "loads": "slot tracker GET /loads, 16 ranks, 200 active requests",
    "potential_loads": "slot tracker POST /potential_loads, 16 ranks, 200 active requests, 512-hash query",
    "lifecycle": "slot tracker /add -> /prefill_complete -> /free, unique ids",
    "scale_potential_loads": "/potential_loads at 10 / 1k / 10k active requests x 16 / 256 ranks (c=64)",
    "query_by_hash": "indexer POST /query_by_hash, 512 hashes, 16 workers, ~1M pairs from the Mooncake trace",
    "scale_query_by_hash": "/query_by_hash at ~10k and ~1M indexed pairs (c=64)",
    "index_memory": "indexer RSS per (block, worker) pair and per distinct block, fresh servers filled "
                    "over ZMQ in 16 synced parts: 8 workers half shared, and 1 worker, ~1M pairs",
    "slot_tracker_memory": "slot tracker RSS per (request, hash) and per request at 1k and 10k active requests",
    "events": "indexer /events ingest in blocks/s, 64-block stored events",
    "zmq_ingest": "indexers subscribed to 16 vLLM engines over ZMQ: ingest in blocks/s, 64-block batches",
    "query_while_ingesting": "/query_by_hash p50 at c=1, idle and while 16 engines publish 200k blocks/s",
    "ingest_pauses": "longest /query_by_hash latency (and p99) while 16 engines publish ~1M pairs, and idle",
    "cores": "the pure cores' hot paths in microseconds (bench/cores.py), on the server CPU",
    "security": "the API key check per request (in process) and TLS on /potential_loads and /query_by_hash "
                "(bench/security.py)",
    "select_lifecycle": "selection service /select_and_reserve -> prefill_complete -> output_block -> DELETE, "
                        "16 workers fed by engines, 4,096-token prompts as token_ids; per-route p50 at c=1",
    "select_lifecycle_hashes": "the same with the prompts in hash form (block_hashes, sequence_hashes, isl_tokens)",
}
GROUPS = {
    "slot_tracker": ("health", "loads", "potential_loads", "lifecycle"),
    "indexer": ("query_by_hash", "index_memory", "events", "zmq_ingest", "query_while_ingesting", "ingest_pauses"),
    "scaling": ("scale_potential_loads", "scale_query_by_hash", "index_memory", "slot_tracker_memory"),
    "memory": ("index_memory", "slot_tracker_memory"),
    "select_service": ("select_lifecycle", "select_lifecycle_hashes"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark ours, Dynamo 1.6.1's services and a no-logic stub on our server side by side; "
                    "write RESULTS.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios (for --only; groups: " + ", ".join(f"{g} = {'+'.join(s)}" for g, s in GROUPS.items())
               + "):\n" + "\n".join(f"  {name:<22} {text}" for name, text in SCENARIOS.items()),
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 s points, 1 repetition, 64k ingest blocks; output to a temp dir")
    parser.add_argument("--only", metavar="NAMES", default="",
                        help="comma-separated scenarios or groups to run (default: all)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="record a py-spy profile of our server during one extra run of each heavy route")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where RESULTS.md, results.json and profiles/ go (default: bench/, or a temp dir "
                             "with --quick)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per measured point (default 10)")
    parser.add_argument("--repetitions", type=int, default=None, help="repetitions per point (default 3)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        parser.print_help()
        parser.exit()
    selected: set[str] = set()
    for name in filter(None, (part.strip() for part in args.only.split(","))):
        if name in GROUPS:
            selected.update(GROUPS[name])
        elif name in SCENARIOS:
            selected.add(name)
        else:
            parser.error(f"unknown scenario {name!r}; see --list")
    args.selected = selected or set(SCENARIOS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings.quick_run(args.profile) if args.quick else Settings(profile=args.profile)
    overrides = {}
    if args.duration is not None:
        overrides["duration_s"] = args.duration
    if args.repetitions is not None:
        overrides["repetitions"] = overrides["scaling_repetitions"] = args.repetitions
    if overrides:
        settings = Settings(**{**settings.__dict__, **overrides})
    output_dir = args.output_dir or (Path(tempfile.gettempdir()) / "dynamo_lite_bench" if args.quick else BENCH_DIR)
    output_dir.mkdir(parents=True, exist_ok=True)
    if (os.cpu_count() or 1) < 2:
        print(f"needs 2 CPUs (server on CPU {SERVER_CPU}, wrk on CPU {CLIENT_CPU})", file=sys.stderr)
        return 2

    started = time.monotonic()
    results = Results(settings)
    results.meta.update(machine_facts())
    results.meta.update(
        started=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        command="python -m bench" + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else ""),
        output_dir=str(output_dir),
        scenarios=sorted(args.selected),
    )
    pin_to_client_cpu()
    ensure_wrk()
    ref_python = reference_python()
    results.meta["reference"] = "ai-dynamo-runtime==1.6.1"
    progress(f"running {', '.join(sorted(args.selected))}; output in {output_dir}")
    try:
        slot_tracker_http.run(results, args.selected, ref_python)
        indexer_http.run(results, args.selected, ref_python)
        select_service_http.run(results, args.selected, ref_python)
        zmq_ingest.run(results, args.selected, ref_python)
        memory.run(results, args.selected, ref_python)
        cores.run(results, args.selected)
        security.run(results, args.selected)
    finally:
        results.meta["wall_s"] = time.monotonic() - started
        results.save(output_dir / "results.json")
        report.write(output_dir / "RESULTS.md", results.to_json())
        progress(f"wrote {output_dir / 'RESULTS.md'} and results.json in {results.meta['wall_s'] / 60:.1f} min")
    print()
    for target, measured, verdict in report.targets(results.to_json()):
        print(f"  {verdict.strip('*'):<12} {target}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
