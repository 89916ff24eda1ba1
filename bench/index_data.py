"""Indexer state and request bodies: a KV-cache tree built from a Mooncake trace, and an
ingest stream, each as 64-block `BlockStored` events for both kinds of indexer.

The trace gives one hash id per 512-token block of each prompt; equal ids at the same position
are a shared prefix. With 16-token blocks each id becomes 32 blocks whose tokens are derived
from (id, position), so the local hash (XXH3 of the tokens, what queries carry) and the chained
external hash are real Dynamo hashes and prefix sharing is kept. Requests go round-robin to 16
workers (every worker ends up with the common prefixes, as in a fleet), and each worker stores
the part of the prompt it does not hold yet, as vLLM would after serving it. No eviction: the
fill stops at the wanted number of (block, worker) pairs.

The same event goes to ours as a RouterEvent in a `POST /events` document and to the reference
as a vLLM msgpack batch over ZMQ (which carries token ids: the reference hashes them itself).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import orjson

from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed

BLOCK_SIZE = 16
TRACE_BLOCK_TOKENS = 512  # tokens per Mooncake hash id
BLOCKS_PER_ID = TRACE_BLOCK_TOKENS // BLOCK_SIZE
EVENT_BLOCKS = 64
WORKERS = 16
QUERY_BLOCKS = 512
DEFAULT_TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
U32 = 0xFFFF_FFFF


@dataclass(frozen=True)
class StoredEvent:
    """`exts` stored by `worker` (dp rank 0) as a chain under `parent` (None: the root)."""

    worker: int
    parent: int | None
    exts: list[int]
    locals: list[int]
    tokens: list[int]

    def router_event(self, event_id: int) -> dict[str, Any]:
        """Ours: one RouterEvent, as `/dump` writes it."""
        return {"worker_id": self.worker, "storage_tier": "device", "event": {
            "event_id": event_id, "dp_rank": 0, "data": {"stored": {
                "parent_hash": self.parent,
                "blocks": [{"block_hash": e, "tokens_hash": h} for e, h in zip(self.exts, self.locals)],
            }}}}

    def zmq_payload(self) -> bytes:
        """The reference: one vLLM KVEventBatch `[ts, [BlockStored], dp_rank]`, msgpack."""
        event = ["BlockStored", self.exts, self.parent, self.tokens, BLOCK_SIZE, None, None, None]
        return msgpack.packb([time.time(), [event], 0], use_bin_type=True)


def block_tokens(hash_id: int, position: int) -> list[int]:
    """The 16 token ids of block `position` of trace hash id `hash_id` (distinct per block)."""
    base = (hash_id * BLOCKS_PER_ID + position) * BLOCK_SIZE
    return [(base + t) & U32 for t in range(BLOCK_SIZE)]


def _chain(parent: int | None, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Local and external hashes of consecutive full blocks of `tokens` under `parent`."""
    locals_ = local_block_hashes(tokens, BLOCK_SIZE)
    exts = sequence_hashes(([parent] if parent is not None else []) + locals_)
    return (exts[1:] if parent is not None else exts), locals_


def load_trace(path: Path = DEFAULT_TRACE) -> list[list[int]]:
    with path.open("rb") as handle:
        return [orjson.loads(line)["hash_ids"] for line in handle if line.strip()]


def query_locals(trace: list[list[int]]) -> list[int]:
    """The first 512 local hashes of the trace's first prompt of at least 16 ids (request 6 of
    the conversation trace: stored by one worker, its first id shared by many)."""
    ids = next(ids for ids in trace if len(ids) * BLOCKS_PER_ID >= QUERY_BLOCKS)
    tokens = [t for hash_id in ids[: QUERY_BLOCKS // BLOCKS_PER_ID] for p in range(BLOCKS_PER_ID)
              for t in block_tokens(hash_id, p)]
    return local_block_hashes(tokens, BLOCK_SIZE)


def query_body(model: str, locals_: list[int]) -> bytes:
    return orjson.dumps({"model_name": model, "block_hashes": [to_signed(h) for h in locals_]})


BlockTokens = Callable[[int, int], list[int]]  # (hash id, position) -> the block's token ids


class TraceFill:
    """Yields the events that build the trace's tree, resumable: `events(target)` continues
    until `pairs` (indexed (block, worker) pairs) reaches `target`. `tokens` derives each
    block's token ids (`block_tokens` unless said)."""

    def __init__(self, trace: list[list[int]], workers: int = WORKERS, tokens: BlockTokens | None = None) -> None:
        self.trace = trace
        self.workers = workers
        self.tokens = tokens or block_tokens
        self.pairs = 0
        self._next_request = 0
        self._held: list[set[int]] = [set() for _ in range(workers)]  # hash ids, always whole
        self._last_ext: dict[int, int] = {}  # hash id -> external hash of its last block

    @property
    def requests_used(self) -> int:
        return self._next_request

    def events(self, target_pairs: int) -> Iterator[StoredEvent]:
        while self.pairs < target_pairs:
            if self._next_request >= len(self.trace):
                raise RuntimeError(f"the trace holds only {self.pairs} (block, worker) pairs")
            ids = self.trace[self._next_request]
            worker_index = self._next_request % self.workers
            self._next_request += 1
            held = self._held[worker_index]
            start = 0
            while start < len(ids) and ids[start] in held:
                start += 1
            parent = self._last_ext[ids[start - 1]] if start else None
            pending: list[int] = []  # hash ids of the current event
            for hash_id in ids[start:]:
                pending.append(hash_id)
                if len(pending) * BLOCKS_PER_ID >= EVENT_BLOCKS:
                    parent = yield from self._store(worker_index, parent, pending)
                    pending = []
            if pending:
                yield from self._store(worker_index, parent, pending)
            held.update(ids)

    def _store(self, worker_index: int, parent: int | None, ids: list[int]) -> Iterator[StoredEvent]:
        tokens = [t for hash_id in ids for p in range(BLOCKS_PER_ID) for t in self.tokens(hash_id, p)]
        exts, locals_ = _chain(parent, tokens)
        for index, hash_id in enumerate(ids):
            self._last_ext[hash_id] = exts[(index + 1) * BLOCKS_PER_ID - 1]
        self.pairs += len(exts)
        yield StoredEvent(worker_index + 1, parent, exts, locals_, tokens)
        return exts[-1]


class IngestStream:
    """Synthetic ingest: per worker, prompts of 1-4 events of 64 fresh blocks (a chain that
    continues the worker's last prompt, or starts a new one at the root), round-robin over
    the workers. Tokens never repeat, so every block is new to the index."""

    # Token ranges per stream: above the trace's (< 10^8) and 1.25M blocks wide each.
    TOKENS_BASE = 200_000_000
    TOKENS_PER_STREAM = 20_000_000

    def __init__(self, worker_ids: list[int], stream: int) -> None:
        self.worker_ids = worker_ids
        self._token = itertools.count(self.TOKENS_BASE + stream * self.TOKENS_PER_STREAM)
        self._tail: dict[int, int | None] = {w: None for w in worker_ids}
        self._depth: dict[int, int] = {w: 0 for w in worker_ids}

    def events(self, blocks: int) -> Iterator[StoredEvent]:
        made = 0
        for worker in itertools.cycle(self.worker_ids):
            if made >= blocks:
                return
            if self._depth[worker] >= 4:
                self._tail[worker], self._depth[worker] = None, 0
            tokens = [next(self._token) & U32 for _ in range(EVENT_BLOCKS * BLOCK_SIZE)]
            parent = self._tail[worker]
            exts, locals_ = _chain(parent, tokens)
            self._tail[worker], self._depth[worker] = exts[-1], self._depth[worker] + 1
            made += EVENT_BLOCKS
            yield StoredEvent(worker, parent, exts, locals_, tokens)


def sentinel_event(worker: int, salt: int) -> StoredEvent:
    """One root block with the same content on every worker: when a query for it scores a
    worker, every event that worker published before it has been applied (ZMQ keeps order)."""
    tokens = [(U32 - salt * BLOCK_SIZE - t) & U32 for t in range(BLOCK_SIZE)]
    exts, locals_ = _chain(None, tokens)
    return StoredEvent(worker, None, exts, locals_, tokens)


class EventIds:
    """Ours: RouterEvent ids count from 0 per (worker, dp_rank)."""

    def __init__(self) -> None:
        self._next: dict[int, int] = {}

    def take(self, worker: int) -> int:
        value = self._next.get(worker, 0)
        self._next[worker] = value + 1
        return value


def events_document(model: str, events: list[StoredEvent], ids: EventIds) -> bytes:
    return orjson.dumps({f"{model}:default": {
        "block_size": BLOCK_SIZE,
        "events": [event.router_event(ids.take(event.worker)) for event in events],
    }})
