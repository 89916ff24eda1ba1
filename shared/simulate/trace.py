"""Mooncake request traces: loading, validation, and expansion into Dynamo block hashes.

A Mooncake record names its prompt only by `hash_ids`, one per 512-token block; equal ids at
equal positions mean equal content. The services work on blocks of `block_size` tokens, so each
hash id is expanded into `512 / block_size` blocks. The content of block `j` of hash id `h` is
the token ids `h * 512 + j * block_size + i` (i < block_size): it depends only on the hash id
and the position inside its 512-token block, so two prompts that share their first k hash ids
share their first `k * 512 / block_size` blocks (and no others), and the local hashes are the
real Dynamo ones (`local_block_hashes` of those tokens), so `/query` with token ids would agree
with `/query_by_hash`. Token ids must fit in a u32, which bounds hash ids below 2**23 (Mooncake
ids are dense: the public traces stay under 200,000).

Only full blocks are hashed, as in Dynamo: the `input_length % block_size` trailing tokens of a
prompt are never cached.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from dynamo_lite.hashing import local_block_hashes, sequence_hashes

MOONCAKE_BLOCK_TOKENS: Final = 512
MAX_HASH_ID: Final = 2**32 // MOONCAKE_BLOCK_TOKENS - 1  # token ids h*512+i must be u32


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake record; the message names file and line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request ready to replay: arrival time in simulated seconds and its block hashes (u64).

    `local_hashes` are what the indexer's tree is keyed on (and what `/query_by_hash` takes);
    `sequence_hashes` are the chained external ids engines publish and the slot tracker counts.
    """

    index: int
    arrival: float
    input_length: int
    output_length: int
    local_hashes: tuple[int, ...]
    sequence_hashes: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return len(self.sequence_hashes)


def _int_field(record: dict[str, Any], name: str, minimum: int, where: str) -> int:
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r}")
    value = record[name]
    if type(value) is not int:
        raise TraceError(f"{where}: {name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def parse_record(line: str | bytes, where: str) -> TraceRecord:
    """One JSON line as a record, checked the way the Mooncake README defines the format:
    non-negative integer timestamp and output length, positive input length, and one hash id
    (a non-negative integer, at most `MAX_HASH_ID`) per 512 prompt tokens, rounded up."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc})") from None
    if type(record) is not dict:
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    timestamp = _int_field(record, "timestamp", 0, where)
    input_length = _int_field(record, "input_length", 1, where)
    output_length = _int_field(record, "output_length", 0, where)
    hash_ids = record.get("hash_ids")
    if type(hash_ids) is not list:
        raise TraceError(f"{where}: hash_ids must be an array of integers")
    for position, value in enumerate(hash_ids):
        if type(value) is not int or not 0 <= value <= MAX_HASH_ID:
            raise TraceError(f"{where}: hash_ids[{position}] must be an integer in 0..{MAX_HASH_ID}, got {value!r}")
    expected = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; "
            f"expected ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {expected}"
        )
    return TraceRecord(timestamp, input_length, output_length, tuple(hash_ids))


def parse_lines(lines: Iterable[str | bytes], source: str = "<trace>", limit: int | None = None) -> list[TraceRecord]:
    """Records of the non-blank lines, in order, stopping after `limit` records."""
    records: list[TraceRecord] = []
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        records.append(parse_record(line, f"{source}:{number}"))
    return records


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The first `limit` records (all when None) of a Mooncake JSONL file."""
    with open(path, "rb") as handle:
        records = parse_lines(handle, str(path), limit)
    if not records:
        raise TraceError(f"{path}: no requests")
    return records


class BlockExpander:
    """Turns hash ids into block hashes, memoised so shared prefixes are hashed once.

    Local hashes are memoised per hash id; sequence hashes per (sequence hash before the hash
    id, hash id, blocks taken from it), i.e. per node of the trace's prefix tree, so a
    conversation's turns re-use the chain computed for the previous turn.
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0 or MOONCAKE_BLOCK_TOKENS % block_size:
            raise ValueError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS}, got {block_size}")
        self.block_size = block_size
        self.per_hash_id = MOONCAKE_BLOCK_TOKENS // block_size
        self._local: dict[int, tuple[int, ...]] = {}
        self._chain: dict[tuple[int | None, int, int], tuple[int, ...]] = {}

    def tokens(self, hash_id: int) -> range:
        """The synthetic token ids of a hash id's 512-token block."""
        start = hash_id * MOONCAKE_BLOCK_TOKENS
        return range(start, start + MOONCAKE_BLOCK_TOKENS)

    def local_hashes(self, hash_id: int) -> tuple[int, ...]:
        cached = self._local.get(hash_id)
        if cached is None:
            cached = self._local[hash_id] = tuple(local_block_hashes(self.tokens(hash_id), self.block_size))
        return cached

    def expand(self, record: TraceRecord) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local hashes, sequence hashes) of the record's full blocks, u64."""
        remaining = record.input_length // self.block_size
        local: list[int] = []
        chained: list[int] = []
        previous: int | None = None
        for hash_id in record.hash_ids:
            if remaining <= 0:
                break
            take = min(self.per_hash_id, remaining)
            remaining -= take
            group = self.local_hashes(hash_id)[:take]
            key = (previous, hash_id, take)
            links = self._chain.get(key)
            if links is None:
                # sequence_hashes([p, *xs])[0] == p, and the rest continues the chain from p.
                links = tuple(sequence_hashes(group) if previous is None else sequence_hashes((previous, *group))[1:])
                self._chain[key] = links
            local.extend(group)
            chained.extend(links)
            previous = links[-1]
        return tuple(local), tuple(chained)


def expand_trace(records: Sequence[TraceRecord], block_size: int, time_scale: float = 1.0) -> list[SimRequest]:
    """Requests in arrival order (stable for equal timestamps), arrival = timestamp * time_scale,
    in seconds: a time scale of 0.5 replays the trace twice as fast (twice the request rate)."""
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    expander = BlockExpander(block_size)
    order = sorted(range(len(records)), key=lambda i: records[i].timestamp_ms)
    requests = []
    for index in order:
        record = records[index]
        local, chained = expander.expand(record)
        requests.append(
            SimRequest(index, record.timestamp_ms / 1000.0 * time_scale, record.input_length,
                       record.output_length, local, chained)
        )
    return requests

