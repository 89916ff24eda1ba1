"""Approximate indexing: the blocks of requests routed to a rank, for ranks that publish no events.

Dynamo's router without KV events (`--no-kv-events`, its `ApproxKvIndexer`) assumes that the
blocks of a request it just routed are cached on the chosen worker for a while (120 s). It
records each decision in its radix tree as a synthetic stored event (the prompt's local block
hashes from the root, named by their sequence hashes) and removes each block again when its
timer lapses; past `--router-max-tree-size` it prunes the blocks with the oldest timers first,
deepest first on ties. `Approximations` does the same for one partition, in the partition's own
`PrefixTree`:

* a rank with approximations gets a *shadow* slot in the tree, keyed `(~instance_id, dp_rank)`
  (negative, so never a real worker's key). A routed prompt is stored under it from the root,
  named by sequence hashes, so shadows share nodes with the exact slots and get everything the
  tree does (prefix closure, runs, blocks below a removed one) for free;
* a query matches shadow slots like any other, then `fold` merges each into its rank: the rank
  scores the longer of its exact and its approximate device match, and its lower tiers still
  count from where its exact match stopped;
* timers: one OrderedDict, timer key -> expiry, in expiry order. A timer key is one int,
  `serial << 64 | sequence hash`, `serial` numbering the shadows (an int hashes much faster
  than a tuple). The TTL is the same for every block, so a new or refreshed block goes to the
  end, O(1); a routed chain is entered deepest block first, so on equal expiry descendants go
  before their ancestors (removing a leaf costs O(1) in the tree, and a prefix never goes while
  blocks below it stay). Expiring and evicting pop from the front: O(expired); nothing ever
  scans the approximations.

Invariant: every block a shadow holds has a timer. A timer can outlive its block (the tree
dropped it for `--max-blocks`, or its rank's shadow went with a `cleared` event); it then
lapses without effect.

Pure: the caller passes the time (`now`, monotonic, and `wall_now`, Unix time for documents).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, islice, repeat
from operator import itemgetter, or_

from dynamo_lite.base.integers import U64_MASK
from dynamo_lite.hashing import sequence_hashes, to_unsigned_list
from dynamo_lite.indexer.protocols import Approximation, Stored
from dynamo_lite.indexer.tree import MatchResult, PrefixTree, StoreStatus, WorkerKey

DEFAULT_TTL_SECS = 120.0  # Dynamo's approximate-mode TTL
DEFAULT_MAX_BLOCKS = 2**20  # Dynamo's --router-max-tree-size default

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end in C


def shadow_of(key: WorkerKey) -> WorkerKey:
    """The tree slot of a rank's approximations; `~` maps u64 instance ids to negatives."""
    return (~key[0], key[1])


@dataclass(slots=True)
class RoutedReport:
    """What one `/routed` did."""

    recorded: int  # blocks of the chain: every one is approximated now, with a fresh TTL
    new: int  # of them, blocks the rank had no approximation of
    evicted: int  # approximations dropped (any rank of the partition) to stay within the bound


@dataclass(slots=True)
class ApproxTotals:
    """Counters over every partition since start-up, for the metrics."""

    expired: int = 0
    evicted: int = 0


@dataclass(slots=True)
class LoadRejection:
    index: int  # position in the document's approximations array
    status: StoreStatus


class Approximations:
    """The approximations of one partition. Not thread-safe."""

    def __init__(self, ttl_secs: float, max_blocks: int, totals: ApproxTotals) -> None:
        """`max_blocks`: at most this many (rank, block) approximations, 0: unlimited."""
        self.ttl_secs = ttl_secs
        self.max_blocks = max_blocks
        self.totals = totals
        self.timers: OrderedDict[int, float] = OrderedDict()
        self.serials: dict[WorkerKey, int] = {}  # shadow slot -> its serial in timer keys
        self._shadows: dict[int, WorkerKey] = {}  # the reverse
        self._next_serial = 0

    def record(self, tree: PrefixTree, key: WorkerKey, local_hashes: Sequence[int], now: float) -> RoutedReport:
        """The rank `key` will hold the prompt `local_hashes` (u64 or i64, from its first block).

        Cost per block: one sequence hash, two dict lookups, two OrderedDict operations (all
        C-level passes) and the tree's store of the blocks not held yet (a node per new block);
        plus what expires and what the bound evicts."""
        self.expire(tree, now)
        if not local_hashes:
            return RoutedReport(0, 0, 0)
        shadow = shadow_of(key)
        names = sequence_hashes(local_hashes)
        prefix, held = tree.holds(shadow, names)
        if prefix < len(names):
            # The common case, a held prefix (an earlier turn of the conversation) and a new
            # tail, stores the tail alone; anything else stores the whole chain from the root.
            start = prefix if held == prefix else 0
            status = tree.store(
                shadow, names[start - 1] if start else None, names[start:], to_unsigned_list(local_hashes[start:])
            )
            if status is not StoreStatus.STORED:
                # Only sequence hashes that collide (64 bits) can refuse a chain from the
                # root; the tree then changed nothing (but may have made the shadow's slot).
                self._discard_unused(tree, shadow)
                return RoutedReport(0, 0, 0)
        timers = self.timers
        timer_keys = list(map(or_, reversed(names), repeat(self._serial(shadow) << 64)))
        timers.update(zip(timer_keys, repeat(now + self.ttl_secs)))
        _consume(map(timers.move_to_end, timer_keys))  # deepest first, all to the end
        return RoutedReport(len(names), len(names) - held, self._evict(tree))

    def expire(self, tree: PrefixTree, now: float) -> int:
        """Drop every approximation whose time has come; returns how many. O(expired)."""
        timers = self.timers
        due: list[int] = []
        for timer_key, expires in timers.items():
            if expires > now:
                break
            due.append(timer_key)
        if not due:
            return 0
        _consume(map(timers.pop, due))
        dropped = self._drop(tree, due)
        self.totals.expired += dropped
        return dropped

    def forget_blocks(self, tree: PrefixTree, key: WorkerKey, block_hashes: Sequence[int]) -> None:
        """The rank removed these device blocks (its own external hashes): drop their
        approximations too. Call it before the tree applies the removal."""
        shadow = shadow_of(key)
        serial = self.serials.get(shadow)
        if serial is None:
            return
        names = tree.counterparts(key, block_hashes, shadow)
        if names:
            tree.remove(shadow, names)
            _consume(map(self.timers.pop, map(or_, names, repeat(serial << 64))))

    def forget_rank(self, tree: PrefixTree, key: WorkerKey) -> None:
        """Drop every approximation of the rank (cleared, restarted or unregistered)."""
        shadow = shadow_of(key)
        serial = self.serials.pop(shadow, None)
        if serial is None:
            return
        del self._shadows[serial]
        _consume(map(self.timers.pop, map(or_, tree.held_hashes(shadow), repeat(serial << 64))))
        tree.drop_worker(shadow)

    def release(self, tree: PrefixTree) -> None:
        """Drop the shadow slots, all empty once no timer runs: the partition is exact again."""
        assert not self.timers
        for shadow in self.serials:
            tree.drop_worker(shadow)
        self.serials.clear()
        self._shadows.clear()

    def is_exact(self, key: WorkerKey) -> bool:
        """Whether a slot of the tree is a rank's own (not the shadow of its approximations)."""
        return key not in self.serials

    def block_count(self, tree: PrefixTree, key: WorkerKey) -> int:
        return tree.block_count(shadow_of(key))

    def fold(self, match: MatchResult) -> None:
        """Merge each shadow's device score into its rank's: a rank matches as far as the
        longer of the two; host-pinned and disk blocks count only past that."""
        device = match.device
        host = match.host_pinned
        disk = match.disk
        for shadow in self.serials:
            approximate = device.pop(shadow, 0)
            key = (~shadow[0], shadow[1])
            exact = device.get(key, 0)
            if approximate <= exact:
                continue
            device[key] = approximate
            if host or disk:
                host_end = exact + host.get(key, 0)
                disk_end = host_end + disk.get(key, 0)
                _set(host, key, host_end - approximate)
                _set(disk, key, disk_end - max(approximate, host_end))

    def dump(self, tree: PrefixTree, now: float, wall_now: float) -> list[Approximation]:
        """The blocks the shadows hold (below a gap excluded, as in `PrefixTree.dump`), as
        chains, parents before children, with when each expires as Unix time."""
        timers = self.timers
        approximations = []
        for event in tree.dump(self.serials.__contains__):
            data = event.data
            assert isinstance(data, Stored)
            offset = self.serials[(event.worker_id, event.dp_rank)] << 64
            approximations.append(
                Approximation(
                    ~event.worker_id,
                    event.dp_rank,
                    data.parent_hash,
                    data.block_hashes,
                    data.tokens_hashes,
                    [wall_now + timers[offset | name] - now for name in data.block_hashes],
                )
            )
        return approximations

    def load(
        self, tree: PrefixTree, approximations: Sequence[Approximation], now: float, wall_now: float
    ) -> list[LoadRejection]:
        """Add approximations from a document (a dump: parents before children), each expiring
        when it says but no later than one TTL from now; a block approximated already keeps
        the later of its two expiries. Returns the chains refused (a parent the rank has no
        approximation of, a name reused). O(all timers x log) for the re-sort: meant for
        recovery and dump replays, not for the request path."""
        loaded: list[tuple[int, float]] = []
        rejections: list[LoadRejection] = []
        for index, entry in enumerate(approximations):
            shadow = shadow_of((entry.worker_id, entry.dp_rank))
            status = tree.store(shadow, entry.parent_hash, entry.block_hashes, entry.tokens_hashes)
            if status is not StoreStatus.STORED:
                rejections.append(LoadRejection(index, status))
                self._discard_unused(tree, shadow)
                continue
            offset = self._serial(shadow) << 64
            loaded.extend(
                (offset | name, now + min(expires_at - wall_now, self.ttl_secs))
                for name, expires_at in zip(entry.block_hashes, entry.expires_at)
            )
        if loaded:
            timers = self.timers
            fresh: dict[int, float] = {}
            # Reversed: descendants before ancestors, so the stable sort keeps them first on ties.
            for timer_key, expires in reversed(loaded):
                previous = fresh.get(timer_key, timers.get(timer_key))
                fresh[timer_key] = expires if previous is None else max(previous, expires)
            kept = [(timer_key, expires) for timer_key, expires in timers.items() if timer_key not in fresh]
            self.timers = OrderedDict(sorted(chain(kept, fresh.items()), key=itemgetter(1)))
            self.expire(tree, now)
            self._evict(tree)
        return rejections

    def _discard_unused(self, tree: PrefixTree, shadow: WorkerKey) -> None:
        """A refused store creates the slot it stores to: drop it unless the shadow is in use."""
        if shadow not in self.serials:
            tree.drop_worker(shadow)

    def _serial(self, shadow: WorkerKey) -> int:
        serial = self.serials.get(shadow)
        if serial is None:
            serial = self.serials[shadow] = self._next_serial
            self._shadows[serial] = shadow
            self._next_serial += 1
        return serial

    def _evict(self, tree: PrefixTree) -> int:
        """Drop the approximations that expire first until the bound holds; returns how many."""
        excess = len(self.timers) - self.max_blocks if self.max_blocks else 0
        if excess <= 0:
            return 0
        doomed = list(islice(self.timers, excess))
        _consume(map(self.timers.pop, doomed))
        evicted = self._drop(tree, doomed)
        self.totals.evicted += evicted
        return evicted

    def _drop(self, tree: PrefixTree, timer_keys: list[int]) -> int:
        """Remove the blocks of lapsed timers from their shadows, in timer order (deepest
        first); returns how many were still held."""
        names: dict[int, list[int]] = {}
        for timer_key in timer_keys:
            serial = timer_key >> 64
            batch = names.get(serial)
            if batch is None:
                batch = names[serial] = []
            batch.append(timer_key & U64_MASK)
        dropped = 0
        for serial, batch in names.items():
            shadow = self._shadows.get(serial)
            if shadow is not None:  # else its rank was forgotten: the timers outlived it
                dropped += len(batch) - tree.remove(shadow, batch)
        return dropped


def _set(counts: dict[WorkerKey, int], key: WorkerKey, value: int) -> None:
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)
