"""Simulated inference workers: per-rank KV prefix caches and the KV events they publish.

Pure bookkeeping, no HTTP and no clock: the engine decides when things happen, the fleet says
what a rank holds and which RouterEvents (in the `/events` document shape) it would publish.

Cache model (one `RankCache` per (worker, dp_rank), capacity in blocks):

* blocks are keyed by their chained sequence hash (the engine's external id), and a block is
  only ever cached together with its parent, so the cached set is prefix-closed: a tree;
* a request being served pins its whole prompt path (reference count), from admission to the
  end of its decode; pinned blocks are never evicted, and because a request pins every ancestor
  of each block it pins, the pinned set is prefix-closed too;
* unpinned blocks sit in one LRU order, ordered by when their last pin was released. A release
  appends the path's blocks deepest first, and any pin of a block pins its parent too, so a
  parent is always more recent than its children and the least recently used block is a leaf:
  evicting from the LRU front is tail-first, keeps the cache prefix-closed, and lets the
  indexer drop blocks without gaps in a worker's chains;
* admission needs room for the request's uncached blocks after pinning its cached prefix; if
  evicting every unpinned block would not make enough room, the request must wait (the engine
  keeps it queued) - the blocks of running requests are the rank's real memory floor.

Events: an admission that evicts publishes one `removed` event (leaf-first order); the blocks a
prefill computes are published as one `stored` event chained under the last cached block when
the prefill ends. Event ids count from 0 per rank, one per event.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_lite.base.timing import TimingModel

RankKey = tuple[int, int]  # (worker_id, dp_rank)
RouterEventJson = dict[str, Any]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Shape and speed of the simulated fleet. Speeds are per rank: a rank prefills one request
    at a time at `prefill_tps` uncached tokens per second, and every running request decodes
    independently at `decode_tps` tokens per second."""

    workers: int = 8
    dp_size: int = 1
    kv_blocks: int = 8192
    block_size: int = 64
    prefill_tps: float = 8000.0
    decode_tps: float = 40.0
    # Worker ids are first_worker_id .. first_worker_id + workers - 1: an indexer instance id
    # belongs to one model, so a simulation next to other users of the services needs its own ids.
    first_worker_id: int = 1

    def __post_init__(self) -> None:
        for name in ("workers", "dp_size", "kv_blocks", "block_size", "first_worker_id"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("prefill_tps", "decode_tps"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive number")

    def rank_keys(self) -> list[RankKey]:
        """Every (worker_id, dp_rank), sorted (worker ids start at 1 at least: 0 reads as unset in logs)."""
        return [(worker, rank) for worker in self.worker_ids() for rank in range(self.dp_size)]

    def worker_ids(self) -> range:
        return range(self.first_worker_id, self.first_worker_id + self.workers)

    @property
    def timing(self) -> TimingModel:
        """The engines' timing model (shared with the engine stand-in): fixed rates here, a
        decode step independent of the batch."""
        return TimingModel.from_rates(self.prefill_tps, self.decode_tps)

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return self.timing.prefill_seconds(uncached_tokens)

    def decode_seconds(self, output_tokens: int) -> float:
        return self.timing.decode_seconds(output_tokens)


class _Block:
    __slots__ = ("seq", "local", "parent", "children", "pins")

    def __init__(self, seq: int, local: int, parent: _Block | None) -> None:
        self.seq = seq
        self.local = local
        self.parent = parent
        self.children = 0
        self.pins = 0


@dataclass(frozen=True, slots=True)
class Admission:
    """What admitting a request did on its rank. `removed` is the event to publish now (None when
    nothing was evicted); the stored event comes from `RankCache.stored_event` at prefill end."""

    cached_blocks: int
    parent_hash: int | None
    new_blocks: tuple[tuple[int, int], ...]  # (sequence hash, local hash) of each computed block
    evicted: tuple[int, ...]
    removed: RouterEventJson | None


class RankCache:
    """One rank's LRU prefix cache (see the module docstring for the model)."""

    def __init__(self, worker_id: int, dp_rank: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1 block")
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.capacity = capacity
        self._blocks: dict[int, _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # unpinned blocks, least recent first
        self._next_event_id = 0
        self.prompt_blocks = 0  # blocks of every admitted prompt
        self.hit_blocks = 0  # of those, blocks found cached at admission

    # --- inspection -------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return len(self._blocks)

    @property
    def pinned(self) -> int:
        return len(self._blocks) - len(self._lru)

    def __contains__(self, seq_hash: int) -> bool:
        return seq_hash in self._blocks

    def cached_hashes(self) -> set[int]:
        return set(self._blocks)

    def lru_order(self) -> list[int]:
        """Unpinned blocks, next to be evicted first."""
        return list(self._lru)

    def parent_of(self, seq_hash: int) -> int | None:
        parent = self._blocks[seq_hash].parent
        return None if parent is None else parent.seq

    def cached_prefix(self, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of the path are cached."""
        blocks = self._blocks
        count = 0
        for seq in seq_hashes:
            if seq not in blocks:
                break
            count += 1
        return count

    def fits(self, seq_hashes: Sequence[int]) -> bool:
        """Whether `admit` would find room now: the uncached blocks must fit in the free space
        plus every unpinned block outside the request's own cached prefix."""
        cached, room = self._room(seq_hashes)
        return len(seq_hashes) - cached <= room

    def _room(self, seq_hashes: Sequence[int]) -> tuple[int, int]:
        """(cached prefix length, blocks that could be made available for the rest)."""
        cached = self.cached_prefix(seq_hashes)
        blocks = self._blocks
        unpinned_in_prefix = sum(1 for seq in seq_hashes[:cached] if blocks[seq].pins == 0)
        return cached, self.capacity - len(blocks) + len(self._lru) - unpinned_in_prefix

    # --- lifecycle --------------------------------------------------------------------------

    def admit(self, local_hashes: Sequence[int], seq_hashes: Sequence[int]) -> Admission:
        """Pin the cached prefix, evict LRU leaves to make room, insert and pin the rest.

        Raises MemoryError when the request does not fit (check `fits` first)."""
        if len(local_hashes) != len(seq_hashes):
            raise ValueError("local_hashes and seq_hashes must have the same length")
        cached, room = self._room(seq_hashes)
        if len(seq_hashes) - cached > room:
            raise MemoryError(
                f"rank {self.worker_id}/{self.dp_rank}: {len(seq_hashes)} blocks do not fit "
                f"({self.pinned} of {self.capacity} pinned)"
            )
        blocks = self._blocks
        lru = self._lru
        parent: _Block | None = None
        for seq in seq_hashes[:cached]:
            parent = blocks[seq]
            if parent.pins == 0:
                del lru[seq]
            parent.pins += 1
        missing = len(seq_hashes) - cached
        evicted: list[int] = []
        while self.capacity - len(blocks) < missing:
            seq, victim = lru.popitem(last=False)
            if victim.children:
                raise AssertionError(f"LRU front {seq} has cached children: the cache is not prefix-closed")
            del blocks[seq]
            if victim.parent is not None:
                victim.parent.children -= 1
            evicted.append(seq)
        parent_hash = None if parent is None else parent.seq
        new_blocks = []
        for index in range(cached, len(seq_hashes)):
            seq, local = seq_hashes[index], local_hashes[index]
            block = _Block(seq, local, parent)
            block.pins = 1
            if parent is not None:
                parent.children += 1
            blocks[seq] = block
            new_blocks.append((seq, local))
            parent = block
        self.prompt_blocks += len(seq_hashes)
        self.hit_blocks += cached
        removed = self._event({"removed": {"block_hashes": evicted}}) if evicted else None
        return Admission(cached, parent_hash, tuple(new_blocks), tuple(evicted), removed)

    def stored_event(self, admission: Admission) -> RouterEventJson | None:
        """The `stored` event for the blocks an admission computed (None when all were cached)."""
        if not admission.new_blocks:
            return None
        return self._event({"stored": {
            "parent_hash": admission.parent_hash,
            "blocks": [{"block_hash": seq, "tokens_hash": local} for seq, local in admission.new_blocks],
        }})

    def release(self, seq_hashes: Sequence[int]) -> None:
        """Unpin a finished request's path; blocks whose last pin goes become evictable, deepest
        first in the LRU so their parents outlive them."""
        blocks = self._blocks
        lru = self._lru
        for seq in reversed(seq_hashes):
            block = blocks[seq]
            if block.pins <= 0:
                raise ValueError(f"block {seq} of rank {self.worker_id}/{self.dp_rank} is not pinned")
            block.pins -= 1
            if block.pins == 0:
                lru[seq] = block

    def _event(self, data: dict[str, Any]) -> RouterEventJson:
        event = {
            "worker_id": self.worker_id,
            "storage_tier": "device",
            "event": {"event_id": self._next_event_id, "dp_rank": self.dp_rank, "data": data},
        }
        self._next_event_id += 1
        return event


class Fleet:
    """Every rank of the simulated fleet, by (worker_id, dp_rank)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.ranks: dict[RankKey, RankCache] = {
            key: RankCache(key[0], key[1], config.kv_blocks) for key in config.rank_keys()
        }

    def __iter__(self) -> Iterator[RankCache]:
        return iter(self.ranks.values())

    def __getitem__(self, key: RankKey) -> RankCache:
        return self.ranks[key]


def events_document(model_name: str, tenant_id: str, block_size: int, events: list[RouterEventJson]) -> dict[str, Any]:
    """The `/events` (= `/dump`) document for one partition."""
    return {f"{model_name}:{tenant_id}": {"block_size": block_size, "events": events}}
