"""Results of a simulation as a JSON-ready document and as plain-text tables."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .bound import CacheBound
from .engine import PolicyResult
from .fleet import FleetConfig

LOAD_DEFINITION = (
    "load = per rank, time-averaged over the run (simulated time) from /add to /free: active "
    "requests (queued, prefilling, decoding) and active decode blocks (distinct prompt blocks of "
    "those requests plus their output blocks so far, the slot tracker's active_decode_blocks); "
    "mean = mean over ranks, "
    "max = busiest rank"
)
LATENCY_DEFINITION = "call latency = client-side round trip per HTTP call, body included, during the replay"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


BOUND_DEFINITION = (
    "bound = hit ratio of one LRU cache as large as the whole fleet's, fed every request in arrival "
    "order: no router beats it with these caches; of bound = a policy's hit ratio / bound"
)


def _of_bound(hit_ratio: float, bound: CacheBound) -> float | None:
    return hit_ratio / bound.hit_ratio if bound.hit_ratio else None


def result_document(result: PolicyResult, bound: CacheBound) -> dict[str, Any]:
    routed = list(result.routed_per_rank.values())
    return {
        "policy": result.policy,
        "model_name": result.model_name,
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hit_ratio": result.hit_ratio,
        "hit_ratio_of_bound": _of_bound(result.hit_ratio, bound),
        "expected_cached_tokens": result.expected_cached_tokens,
        "ttft_seconds": {
            "mean": result.ttft_mean,
            "p50": result.ttft_p50,
            "p99": result.ttft_p99,
            "queue_wait_mean": result.queue_wait_mean,
        },
        "load": {
            "active_requests": asdict(result.load_requests),
            "active_decode_blocks": asdict(result.load_blocks),
            "routed_per_rank": result.routed_per_rank,
            "routed_max_over_mean": max(routed) / (sum(routed) / len(routed)) if routed else None,
        },
        "evicted_blocks": result.evicted_blocks,
        "memory_waits": result.memory_waits,
        "simulated_seconds": result.simulated_seconds,
        "wall_seconds": result.wall_seconds,
        "calls": [
            {
                "service": item.service, "route": item.route, "calls": item.calls,
                "p50_ms": _finite(item.p50_ms), "p99_ms": _finite(item.p99_ms),
                "mean_ms": _finite(item.mean_ms), "max_ms": _finite(item.max_ms),
            }
            for item in result.latencies
        ],
        "indexer_ingest": asdict(result.ingest),
        "checks": result.checks,
    }


def run_document(
    results: Sequence[PolicyResult], config: FleetConfig, settings: dict[str, Any], bound: CacheBound
) -> dict[str, Any]:
    return {
        "fleet": asdict(config),
        "settings": settings,
        "bound": {"capacity_blocks": bound.capacity_blocks, "hit_ratio": bound.hit_ratio},
        "definitions": {"load": LOAD_DEFINITION, "latency": LATENCY_DEFINITION, "bound": BOUND_DEFINITION,
                        "hit_ratio": "cached prompt tokens / prompt tokens (cached: on the rank at prefill start)",
                        "ttft": "queue wait + prefill (uncached tokens / prefill_tps), simulated seconds"},
        "results": [result_document(result, bound) for result in results],
    }


def _format_share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        # First column (the policy) left-aligned, numbers right-aligned.
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def format_tables(results: Sequence[PolicyResult], config: FleetConfig, bound: CacheBound) -> str:
    summary = _table(
        ["policy", "hit ratio", "of bound", "TTFT mean s", "TTFT p99 s", "req/rank mean", "req/rank max",
         "blocks/rank mean", "blocks/rank max", "wall s"],
        [
            [
                r.policy, f"{r.hit_ratio:.3f}", _format_share(_of_bound(r.hit_ratio, bound)),
                f"{r.ttft_mean:.3f}", f"{r.ttft_p99:.3f}",
                f"{r.load_requests.mean:.2f}", f"{r.load_requests.max:.2f}",
                f"{r.load_blocks.mean:.0f}", f"{r.load_blocks.max:.0f}", f"{r.wall_seconds:.1f}",
            ]
            for r in results
        ],
    )
    latency_rows = [
        [r.policy, f"{item.service} {item.route}", str(item.calls), f"{item.p50_ms:.2f}", f"{item.p99_ms:.2f}"]
        for r in results
        for item in r.latencies
    ]
    latency = _table(["policy", "route", "calls", "p50 ms", "p99 ms"], latency_rows) if latency_rows else ""
    problems = []
    for r in results:
        if r.ingest.rejected or r.ingest.skipped or r.ingest.gap_count or r.ingest.unknown_removals:
            problems.append(f"warning: {r.policy}: indexer ingest {asdict(r.ingest)}")
        for name in ("slot_tracker_idle_at_end", "indexer_matches_fleet"):
            if not r.checks.get(name, True):
                problems.append(f"warning: {r.policy}: check {name} failed: {r.checks}")
    first = results[0] if results else None
    heading = (
        f"fleet: {config.workers} workers x {config.dp_size} dp ranks, {config.kv_blocks} KV blocks of "
        f"{config.block_size} tokens per rank, prefill {config.prefill_tps:g} tok/s, decode "
        f"{config.decode_tps:g} tok/s per request"
        + (f"; {first.requests} requests, {first.prompt_tokens} prompt tokens, "
           f"{first.simulated_seconds:.0f} simulated s" if first else "")
    )
    heading += f"\nbound: hit ratio {bound.hit_ratio:.3f} for one LRU of {bound.capacity_blocks} blocks"
    parts = [heading, "", summary, "", BOUND_DEFINITION + ".", LOAD_DEFINITION + ".", "",
             LATENCY_DEFINITION + ":", latency, *problems]
    return "\n".join(parts).rstrip() + "\n"
