"""The Mooncake trace sample as `/v1/completions` requests for `python -m bench.gateway`.

A Mooncake record names its prompt only by hash ids, one per 512-token block; equal ids at
equal positions mean a shared prefix. Here each hash id becomes a fixed pseudo-random block of
`tokens_per_hash_id` token ids in [0, 4000), derived from the id alone (SHAKE-128 of it, so the
same on every machine and Python version): requests sharing hash ids share prompt prefixes
token for token, which is what the engines' prefix caches and the picker's indexer see.

Prompts and answers are scaled by the same factor, `tokens_per_hash_id / 512`: a CPU-only
stand-in cannot stream Mooncake's full lengths through Python for hundreds of requests within
the benchmark's few minutes. The prompt is the record's `input_length` scaled (its last hash id
only partly used, as in the trace); `max_tokens` is the `output_length` scaled, at least 1 and
at most `max_tokens_cap`.

The sample's timestamps come in 3 s steps (several requests share each one). Releasing a whole
step at one instant would measure a burst the trace does not describe, so each step's requests
are spread evenly over the time to the next step, in trace order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from dynamo_lite.simulate.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace

from .gateway_load import Planned
from .gateway_stack import MODEL

SAMPLE = Path(__file__).resolve().parent.parent / "shared" / "simulate" / "data" / "conversation_sample.jsonl"
VOCABULARY = 4000  # token ids in [0, VOCABULARY): inside the engine stand-in's tokenizer


def hash_id_tokens(hash_id: int, count: int) -> list[int]:
    """The fixed token ids standing for one Mooncake hash id."""
    digest = hashlib.shake_128(b"mooncake-hash-id:%d" % hash_id).digest(2 * count)
    return [int.from_bytes(digest[i:i + 2], "little") % VOCABULARY for i in range(0, 2 * count, 2)]


@dataclass(frozen=True)
class TraceRequests:
    """The scaled requests, with what the plan is made of (for the report)."""

    plan: list[Planned]
    prompt_tokens: int
    max_tokens: int
    span_s: float  # the trace's own span, before compression


def build(records: Sequence[TraceRecord], *, tokens_per_hash_id: int, max_tokens_cap: int,
          compression: float, path: str = "/v1/completions", output_scale: float | None = None) -> TraceRequests:
    """The records as open-loop requests; arrival times divided by `compression`; answers scaled
    by `output_scale` (default: as the prompts)."""
    scale = tokens_per_hash_id / MOONCAKE_BLOCK_TOKENS
    answer_scale = scale if output_scale is None else output_scale
    arrivals = _spread(records)
    plan: list[Planned] = []
    prompt_total = max_total = 0
    for record, arrival in zip(records, arrivals):
        tokens: list[int] = []
        for hash_id in record.hash_ids:
            tokens += hash_id_tokens(hash_id, tokens_per_hash_id)
        prompt = tokens[:max(1, math.ceil(record.input_length * scale))]
        max_tokens = min(max_tokens_cap, max(1, math.ceil(record.output_length * answer_scale)))
        body = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                             "stream_options": {"include_usage": True}})
        plan.append(Planned(arrival / compression, path, body))
        prompt_total += len(prompt)
        max_total += max_tokens
    plan.sort(key=lambda item: item.at)  # stable: trace order within one instant
    span = max(arrivals, default=0.0) - min(arrivals, default=0.0)
    return TraceRequests(plan, prompt_total, max_total, span)


def _spread(records: Sequence[TraceRecord]) -> list[float]:
    """Arrival seconds: the requests of one timestamp evenly over the gap to the next one (the
    last timestamp's over the trace's typical gap)."""
    stamps = sorted({record.timestamp_ms for record in records})
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    typical = sorted(gaps)[len(gaps) // 2] if gaps else 0
    following = {stamp: (stamps[i + 1] if i + 1 < len(stamps) else stamp + typical) for i, stamp in enumerate(stamps)}
    groups: dict[int, list[int]] = {}
    for index, record in enumerate(records):
        groups.setdefault(record.timestamp_ms, []).append(index)
    arrivals = [0.0] * len(records)
    for stamp, members in groups.items():
        step = (following[stamp] - stamp) / len(members)
        for position, index in enumerate(members):
            arrivals[index] = (stamp + position * step) / 1000
    return arrivals


def load_sample(limit: int | None = None) -> list[TraceRecord]:
    """The first `limit` requests (all 300 when None) of the bundled sample."""
    records: list[TraceRecord] = load_trace(SAMPLE, limit)
    return records
