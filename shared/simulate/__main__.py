"""`python -m dynamo_lite.simulate`: replay a trace against the running services, per policy.

Without `--trace` it replays the bundled sample, the first 300 requests of the public Mooncake
conversation trace (`data/conversation_sample.jsonl`, see `data/README.md`).

Both services must already run (`python -m dynamo_lite.stack --services-only` starts them).
Each policy gets a fresh simulated fleet and its own model name, and its workers are
unregistered from both services afterwards, so runs never see each other's state.

The defaults model 8 single-rank workers with 8192 KV blocks of 64 tokens each (512k tokens,
about an 8B model on one 80 GB GPU), prefill at 8000 tokens/s and decode at 40 tokens/s per
request: on the public conversation trace an unrouted fleet cannot keep every conversation's
prefix on every rank, so where a request lands decides whether its prefix is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from dataclasses import replace
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson

from dynamo_lite.client import ServiceCallError
from dynamo_lite.routing.scheduling import COSTS, SchedulerConfig, SchedulerConfigError, dynamo_config, load_config, preset
from dynamo_lite.web.cli import HelpFormatter, add_client_arguments, client_credentials_from

from .bound import fleet_lru_bound
from .calls import LatencyRecorder, service_clients
from .engine import PolicyResult, Simulation, check_capacity
from .fleet import FleetConfig
from .policies import POLICY_NAMES, make_policy
from .progress import Progress
from .report import format_tables, run_document
from .trace import (
    MOONCAKE_BLOCK_TOKENS,
    SimRequest,
    TraceError,
    expand_trace,
    load_trace,
)

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

DEFAULTS = FleetConfig()
SAMPLE_TRACE = "conversation_sample.jsonl"
FULL_TRACE_SOURCE = "FAST25-release/traces/conversation_trace.jsonl of github.com/kvcache-ai/Mooncake"


def bundled_trace() -> Traversable:
    """The trace shipped as package data: the first 300 requests of Mooncake's public
    conversation trace."""
    return resources.files("dynamo_lite.simulate") / "data" / SAMPLE_TRACE


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def _block_size(text: str) -> int:
    value = _positive_int(text)
    if MOONCAKE_BLOCK_TOKENS % value:
        raise argparse.ArgumentTypeError(f"{value} does not divide {MOONCAKE_BLOCK_TOKENS}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_lite.simulate",
        description="Replay a Mooncake trace against the running slot tracker and indexer with a "
        "simulated fleet, and compare routing policies.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--trace", metavar="PATH", default=str(bundled_trace()),
                        help="Mooncake JSONL trace; the default is the bundled sample, the first 300 requests of "
                        "the public conversation trace. For the full trace (12,031 requests) download "
                        f"{FULL_TRACE_SOURCE} and pass its path")
    parser.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    parser.add_argument("--time-scale", type=_positive_float, default=1.0,
                        help="multiply trace timestamps by this (0.5 = twice the request rate)")
    parser.add_argument("--workers", type=_positive_int, default=DEFAULTS.workers, help="simulated workers")
    parser.add_argument("--dp-size", type=_positive_int, default=DEFAULTS.dp_size,
                        help="data-parallel ranks per worker")
    parser.add_argument("--kv-blocks", type=_positive_int, default=DEFAULTS.kv_blocks,
                        help="KV capacity per rank, in blocks")
    parser.add_argument("--block-size", type=_block_size, default=DEFAULTS.block_size,
                        help="tokens per KV block (must divide 512)")
    parser.add_argument("--prefill-tps", type=_positive_float, default=DEFAULTS.prefill_tps,
                        help="prefill speed per rank, uncached tokens/s (one prefill at a time)")
    parser.add_argument("--decode-tps", type=_positive_float, default=DEFAULTS.decode_tps,
                        help="decode speed per request, tokens/s")
    parser.add_argument("--policy", choices=(*POLICY_NAMES, "all"), default="all", help="routing policy")
    parser.add_argument("--cost", choices=COSTS, default=None,
                        help="kv policies' cost: ttft (the default, as the endpoint picker's) or dynamo (Dynamo's "
                        "overlap_weight * prefill_blocks + decode_blocks)")
    parser.add_argument("--scheduler-config", default=None, metavar="FILE",
                        help="kv policies: a scheduler YAML file (docs/routing.md), instead of --cost")
    parser.add_argument("--overlap-weight", type=_non_negative_float, default=None,
                        help="kv policies with --cost dynamo: weight of prefill blocks in the cost (default 1)")
    parser.add_argument("--temperature", type=_non_negative_float, default=None,
                        help="kv policies: softmax temperature (0, the default: the cheapest rank)")
    parser.add_argument("--worker-id-base", type=_positive_int, default=1,
                        help="the simulated workers' ids are this and the next --workers - 1; they must not be "
                        "registered with another model (an indexer instance id belongs to one model)")
    parser.add_argument("--slot-tracker", default=os.environ.get("SLOT_TRACKER_URL", "http://127.0.0.1:8091"),
                        help="slot tracker base URL [env SLOT_TRACKER_URL]")
    parser.add_argument("--indexer", default=os.environ.get("INDEXER_URL", "http://127.0.0.1:8090"),
                        help="indexer base URL [env INDEXER_URL]")
    parser.add_argument("--model-name",
                        help="model name to register the simulated workers under (default: sim-<random>-<policy>); "
                        "it must not be in use, and is unregistered after each policy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random and kv tie-breaking choices")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    add_client_arguments(parser)
    return parser


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The kv policies' scheduling cycle: --scheduler-config or --cost, then --overlap-weight and
    --temperature on top (SchedulerConfigError for a combination that means nothing)."""
    if args.scheduler_config is not None and args.cost is not None:
        raise SchedulerConfigError("--cost and --scheduler-config go one or the other")
    if args.overlap_weight is not None and (args.cost or "ttft") != "dynamo" and args.scheduler_config is None:
        raise SchedulerConfigError("--overlap-weight is a weight of Dynamo's cost: add --cost dynamo")
    if args.scheduler_config is not None:
        config = load_config(args.scheduler_config)
    elif args.cost == "dynamo":
        config = dynamo_config(1.0 if args.overlap_weight is None else args.overlap_weight)
    else:
        config = preset(args.cost or "ttft")
    if args.temperature is not None:
        config = replace(config, temperature=args.temperature)
    return config


async def simulate(requests: list[SimRequest], config: FleetConfig, args: argparse.Namespace) -> list[PolicyResult]:
    names = POLICY_NAMES if args.policy == "all" else (args.policy,)
    router_config = args.scheduler
    run_tag = os.urandom(4).hex()
    results = []
    for name in names:
        model_name = args.model_name or f"sim-{run_tag}-{name}"
        recorder = LatencyRecorder()
        async with service_clients(args.slot_tracker, args.indexer, recorder,
                                   credentials=client_credentials_from(args)) as (slot_tracker, indexer):
            await _check_reachable(slot_tracker.health(), "slot tracker", args.slot_tracker, "--slot-tracker",
                                   "SLOT_TRACKER_URL")
            await _check_reachable(indexer.health(), "indexer", args.indexer, "--indexer", "INDEXER_URL")
            policy = make_policy(
                name, slot_tracker=slot_tracker, indexer=indexer, model_name=model_name,
                ranks=config.rank_keys(), block_size=config.block_size, router_config=router_config,
                seed=args.seed,
            )
            progress = Progress(f"{name:>12}", enabled=False if args.quiet else None)
            try:
                simulation = Simulation(requests, config, policy, slot_tracker, indexer, recorder, model_name, progress)
                results.append(await simulation.run())
            finally:
                progress.close()
    return results


class Unreachable(Exception):
    pass


async def _check_reachable(call: Any, what: str, url: str, flag: str, variable: str) -> None:
    try:
        await call
    except ServiceCallError as exc:
        raise Unreachable(
            f"the {what} at {url} does not answer /health ({exc.message}); start both services with "
            f"`python -m dynamo_lite.stack --services-only`, or pass its URL ({flag} or {variable})"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.scheduler = scheduler_config(args)
    except SchedulerConfigError as exc:
        parser.error(str(exc))
    try:
        config = FleetConfig(args.workers, args.dp_size, args.kv_blocks, args.block_size,
                             args.prefill_tps, args.decode_tps, args.worker_id_base)
        records = load_trace(args.trace, args.limit)
        requests = expand_trace(records, config.block_size, args.time_scale)
        del records
        check_capacity(requests, config)
        bound = fleet_lru_bound(requests, config)
        # Millions of long-lived hashes: keep them out of the collector's full passes, whose
        # pauses would otherwise land inside timed service calls.
        gc.freeze()
        try:
            results = asyncio.run(simulate(requests, config, args))
        finally:
            gc.unfreeze()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (TraceError, OSError, ValueError, Unreachable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServiceCallError as exc:
        print(f"error: a service call failed: {exc}", file=sys.stderr)
        return 1
    settings = {
        "trace": args.trace, "limit": args.limit, "time_scale": args.time_scale, "policy": args.policy,
        "cost": args.scheduler.cost, "scorers": dict(args.scheduler.scorers), "overlap_weight": args.overlap_weight,
        "temperature": args.scheduler.temperature, "seed": args.seed,
        "slot_tracker": args.slot_tracker, "indexer": args.indexer,
    }
    if args.json:
        document = run_document(results, config, settings, bound)
        sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(format_tables(results, config, bound))
    return 0


if __name__ == "__main__":
    sys.exit(main())
