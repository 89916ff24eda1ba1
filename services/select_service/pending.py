"""Pending selections: what a `/select` with a `selection_id` chose, kept until a
`POST /reservations` naming the id books it (once), it expires, or newer ones push it out.

Bounded three ways, as Dynamo bounds it: an age (`ttl_secs`, strictly older is gone), a count
and an approximate size in bytes (8 per sequence hash plus the lengths of the id, model,
routing group and LoRA name). Expired entries are swept and the oldest evicted only when one is
added, so an idle service does no work; a lookup treats an expired entry as absent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TTL_SECS = 120.0
DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

PendingKey = tuple[str, str, str]
"""(model_name, routing_group, selection_id)."""


@dataclass(frozen=True, slots=True)
class PendingSelection:
    """Everything `POST /reservations` needs to book what `/select` chose, without the prompt."""

    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]
    isl_tokens: int
    effective_prefill_tokens: int
    track_prefill_tokens: bool
    expected_output_tokens: int | None
    lora_name: str | None
    session_id: str | None
    cost: object  # the scheduler's RankCost of the pick: what the first token teaches


@dataclass(slots=True)
class _Entry:
    selection: PendingSelection
    size: int
    added_at: float


class SelectionCache:
    def __init__(self, *, ttl_secs: float = DEFAULT_TTL_SECS, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES, clock: Callable[[], float]) -> None:
        self.ttl_secs = ttl_secs
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[PendingKey, _Entry] = OrderedDict()  # oldest first
        self.bytes = 0
        self.evicted_total = 0
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def size_of(key: PendingKey, selection: PendingSelection) -> int:
        model_name, routing_group, selection_id = key
        return (8 * len(selection.sequence_hashes) + len(selection_id.encode()) + len(model_name.encode())
                + len(routing_group.encode()) + len((selection.lora_name or "").encode()))

    def put(self, key: PendingKey, selection: PendingSelection) -> None:
        """Keep `selection` under `key` (replacing an older one), then evict the oldest while
        over a bound: an entry larger than the byte budget evicts itself."""
        now = self.clock()
        self._sweep(now)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        entry = _Entry(selection, self.size_of(key, selection), now)
        self._entries[key] = entry
        self.bytes += entry.size
        while self._entries and (len(self._entries) > self.max_entries or self.bytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
            self.evicted_total += 1

    def peek(self, key: PendingKey) -> PendingSelection | None:
        entry = self._entries.get(key)
        if entry is None or self.clock() - entry.added_at > self.ttl_secs:
            return None
        return entry.selection

    def discard(self, key: PendingKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size

    def _sweep(self, now: float) -> None:
        entries = self._entries
        while entries:
            key, entry = next(iter(entries.items()))
            if now - entry.added_at <= self.ttl_secs:
                break
            del entries[key]
            self.bytes -= entry.size
            self.expired_total += 1


__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_ENTRIES", "DEFAULT_TTL_SECS", "PendingKey", "PendingSelection",
           "SelectionCache"]
