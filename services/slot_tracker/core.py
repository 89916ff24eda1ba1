"""Active-request accounting per (model_name, tenant_id) partition, with no I/O.

Per rank slot, `active_decode_blocks` is the number of distinct block hashes held by its active
requests (a hash repeated inside one request counts once), plus the output blocks its requests
hold (`/output_blocks`, never shared, so summed per slot); a hash stays counted until the last
request of that slot holding it leaves. Per partition:

* `holders` maps each hash held by an active request to its `Group`: hashes that the same slots
  hold through the same number of requests each. `Group.refs` maps each holding slot's index to
  that number, and `Group.mask` has the holding slots' bits. Every request is a union of whole
  groups, because `/add` splits a group the request covers only partly; so a prompt prefix shared
  by many requests is one group however long it is, and a request's hashes that no other request
  holds are one more.
* `held` is the same hashes as a set, for the membership passes of `/add` and `/potential_loads`
  (see `Partition.held`).
* per slot, `blocks` is the number of hashes it holds: the sizes of the groups whose refs name
  it, kept as a count because a slot gains or loses whole groups (a set of its hashes cost a
  hash-table operation per hash on every /add and /free, and most of those missed the cache).
* `ranks` lists the slots in response order (worker_id, then dp_rank).
* `requests` is an OrderedDict in `/add` order, which is also the expiry order (the TTL is the
  same for all), so expiry pops from the front and never scans.

Costs, where set operations over a request's or a query's hashes run in C:

* `/add`: the head of its hashes that is whole groups in their order (a prompt other requests
  hold: its shared prefix, then the rest of its prompt), one dict lookup and one tuple compare
  per group and no hashing (`_runs`); then for the rest, a dedupe, its groups in request order,
  one dict lookup and one set operation each (`_follow`), and one probe of `held` per hash
  those groups did not cover. A split costs two passes over the group's members (both parts
  are new tuples) and a copy of the group's refs.
* `/free` and expiry: Python steps per group of the request, and one `del` per hash that no
  request holds any more.
* `/potential_loads`: the head that is whole groups as for `/add`, then one probe of `held` per
  distinct query hash past it, Python steps per group it hits and per (distinct holder mask,
  holding slot), then one row per rank.
* `/loads`: one row per rank.
* `/output_blocks`: O(1), a difference added to the request's slot.

None of these depends on how many requests are active. Hashes shared in scattered subsets
rather than as prefixes split groups down to single hashes: the answers stay exact, but every
operation then takes Python steps per hash, as it did before groups.

Memory per distinct held hash: its int object (48 B for a 64-bit value), a `holders` entry, a
`held` entry and 8 B in its group's member tuple (none when the group is the tuple of the
request that brought its hashes); per (request, hash) 8 B of the request's tuple, whose int
objects are the groups' where it follows them (a shared prefix). Measured in docs/slot-tracker.md.

`dump()` (`/dump`, snapshots) takes O(workers + requests), sharing the requests' hash tuples;
`restore()` replays the dumped requests' `/add`s in their order, so it costs what they did.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import attrgetter
from typing import Any

from sortedcontainers import SortedDict

from dynamo_lite.base.errors import AlreadyRegistered, Conflict, InvalidArgument, NotFound, ServiceError
from dynamo_lite.base.integers import U32_MAX

from .protocols import (
    AGGREGATED,
    DUMP_VERSION,
    PREFILL,
    ROLES,
    DumpedPartition,
    DumpedRequest,
    DumpedWorker,
    PotentialLoad,
    RankLoad,
    SlotTrackerDump,
    WorkerInfo,
)

MAX_DP_SIZE = 4096
DEFAULT_REQUEST_TTL_SECS = 300.0

PartitionKey = tuple[str, str]


class RankSlot:
    """One (worker_id, dp_rank) with its own load."""

    __slots__ = (
        "worker_id", "dp_rank", "index", "bit", "blocks", "output_blocks", "prefill_tokens", "request_count",
        "tracks_blocks",
    )

    def __init__(self, worker_id: int, dp_rank: int, index: int, tracks_blocks: bool = True) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        # False on a prefill worker's ranks: Dynamo's prefill router runs with
        # track_active_blocks=false, as a prefill worker holds no blocks for decoding.
        self.tracks_blocks = tracks_blocks
        self.index = index  # its key in `Group.refs`; indexes of removed slots are reused
        self.bit = 1 << index  # its bit in `Group.mask`
        self.blocks = 0  # distinct hashes held: the sum of the sizes of the groups it holds
        # Output blocks are never shared, so a plain sum of its requests' counts.
        self.output_blocks = 0
        self.prefill_tokens = 0
        self.request_count = 0


class Group:
    """Block hashes that the same rank slots hold, each through the same number of requests."""

    __slots__ = ("members", "size", "refs", "mask")

    def __init__(self, members: tuple[int, ...], refs: dict[int, int], mask: int) -> None:
        # Distinct hashes, the same int objects as the keys of `holders` and `held`. A tuple, not
        # a set: 8 bytes per hash where a set's table took 32-64 (a 128-hash set has 512
        # slots of 16 bytes), and the set operations taking it as their argument cost about
        # what they cost with a set (they hash each int again, but find the same objects).
        self.members = members
        # len(members), read without touching the tuple: fragmented groups are mostly cache misses
        self.size = len(members)
        self.refs = refs  # slot index -> active requests of that slot holding the group
        # The bits of the slots in `refs`: groups with the same holders have equal masks.
        self.mask = mask


class ActiveRequest:
    __slots__ = (
        "request_id", "slot", "hashes", "block_count", "groups", "prefill_tokens", "output_blocks", "added_at",
        "expected_output_tokens", "output_load",
    )

    def __init__(
        self,
        request_id: str,
        slot: RankSlot,
        hashes: tuple[int, ...],
        block_count: int,
        groups: list[Group],
        prefill_tokens: int,
        added_at: float,
        expected_output_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.slot = slot
        # As sent, repeats included: a tuple is a quarter of the memory of their set.
        self.hashes = hashes
        self.block_count = block_count  # distinct hashes
        self.groups = groups  # exactly covered `hashes` at /add; later splits may have cut them
        self.prefill_tokens = prefill_tokens  # 0 once prefill completed
        self.output_blocks = 0  # as last set by /output_blocks
        self.added_at = added_at
        self.expected_output_tokens = expected_output_tokens  # the output length its gateway expects
        self.output_load = 0  # what its output blocks weigh in its slot's decode blocks (`decayed_output`)


@dataclass(slots=True)
class Worker:
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int
    slots: list[RankSlot]
    role: str = AGGREGATED


@dataclass(slots=True)
class Partition:
    model_name: str
    tenant_id: str
    block_size: int
    workers: SortedDict = field(default_factory=SortedDict)  # worker_id -> Worker
    slots: dict[tuple[int, int], RankSlot] = field(default_factory=dict)
    # Iterating the SortedDict's values runs Python per worker: 12 us of a 256-rank /loads.
    ranks: list[RankSlot] = field(default_factory=list)
    requests: OrderedDict[str, ActiveRequest] = field(default_factory=OrderedDict)
    holders: dict[int, Group] = field(default_factory=dict)  # hash -> the group holding it
    # The same hashes as a set, for the queries' membership passes: a set keeps each hash's hash
    # value beside the key and probes neighbouring slots first, where a dict lookup goes through
    # its index table, then its entry, then the key object, so set & set takes 4.4 us for a
    # 512-hash query where dict_keys & set took 11.
    held: set[int] = field(default_factory=set)
    free_indexes: list[int] = field(default_factory=list)
    next_index: int = 0
    untracked_ranks: bool = False  # a prefill worker's ranks are here (`potential_load_rows` asks)

    def describe(self) -> str:
        return f"model={self.model_name} tenant_id={self.tenant_id}"

    def take_index(self) -> int:
        # Reusing indexes keeps the per-query hit list as short as the most ranks ever alive.
        if self.free_indexes:
            return self.free_indexes.pop()
        self.next_index += 1
        return self.next_index - 1

    def order_ranks(self) -> None:
        self.ranks = [slot for worker in self.workers.values() for slot in worker.slots]
        self.untracked_ranks = any(not slot.tracks_blocks for slot in self.ranks)


@dataclass
class RestoreReport:
    workers: int
    requests: int
    expired: int  # requests left out because their TTL ran out before the restore


class SlotTracker:
    """All partitions of one process. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(
        self,
        *,
        request_ttl_secs: float = DEFAULT_REQUEST_TTL_SECS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request_ttl_secs = request_ttl_secs
        self.clock = clock
        self.partitions: dict[PartitionKey, Partition] = {}
        self.expired_total = 0
        # Bumped by every call that may change a load (failed ones too): answers built from
        # the state, such as `/loads`, stay valid while it is unchanged.
        self.version = 0

    def size(self) -> tuple[int, int]:
        """(workers, active requests) over every partition."""
        partitions = self.partitions.values()
        return sum(len(p.workers) for p in partitions), sum(len(p.requests) for p in partitions)

    # --- topology -------------------------------------------------------------------------

    def register(
        self,
        worker_id: int,
        model_name: str,
        tenant_id: str,
        block_size: int,
        dp_start: int,
        dp_size: int,
        role: str = AGGREGATED,
    ) -> None:
        """Register a worker's ranks `dp_start .. dp_start + dp_size - 1`. A `prefill` worker's
        ranks count prefill tokens only: no active blocks, no output blocks (it hands each
        request to a decode worker at its first token)."""
        self.version += 1
        if role not in ROLES:
            raise InvalidArgument(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if block_size == 0:
            raise InvalidArgument("block_size must be greater than 0")
        if dp_size == 0:
            raise InvalidArgument("dp_size must be greater than 0")
        if dp_size > MAX_DP_SIZE:
            raise InvalidArgument(f"dp_size {dp_size} exceeds the maximum {MAX_DP_SIZE}")
        if dp_start + dp_size > U32_MAX:
            raise InvalidArgument(f"dp range overflows u32: start={dp_start} size={dp_size}")
        key = (model_name, tenant_id)
        partition = self.partitions.get(key)
        if partition is not None:
            if partition.block_size != block_size:
                raise Conflict(
                    f"block_size mismatch for {partition.describe()}: "
                    f"existing={partition.block_size}, requested={block_size}"
                )
            if worker_id in partition.workers:
                raise AlreadyRegistered(f"worker {worker_id} already registered for {partition.describe()}")
        else:
            partition = Partition(model_name, tenant_id, block_size)
            self.partitions[key] = partition
        slots = []
        for dp_rank in range(dp_start, dp_start + dp_size):
            slot = RankSlot(worker_id, dp_rank, partition.take_index(), role != PREFILL)
            partition.slots[(worker_id, dp_rank)] = slot
            slots.append(slot)
        partition.workers[worker_id] = Worker(worker_id, block_size, dp_start, dp_size, slots, role)
        partition.order_ranks()

    def unregister(self, worker_id: int, model_name: str, tenant_id: str) -> None:
        """Drop the worker's ranks and their requests; the partition goes with its last worker."""
        self.version += 1
        key = (model_name, tenant_id)
        partition = self.partitions.get(key)
        worker = partition.workers.get(worker_id) if partition is not None else None
        if partition is None or worker is None:
            raise NotFound(f"worker {worker_id} not found for model={model_name} tenant_id={tenant_id}")
        del partition.workers[worker_id]
        if not partition.workers:
            del self.partitions[key]
            return
        doomed = [request for request in partition.requests.values() if request.slot.worker_id == worker_id]
        for request in doomed:
            del partition.requests[request.request_id]
            _release(partition, request)  # every hash a slot holds is held through a request
        for slot in worker.slots:
            del partition.slots[(worker_id, slot.dp_rank)]
            partition.free_indexes.append(slot.index)
        partition.order_ranks()

    def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerInfo]:
        return [
            WorkerInfo(w.worker_id, p.model_name, p.tenant_id, w.block_size, w.dp_start, w.dp_size, w.role)
            for p in self._matching(model_name, tenant_id)
            for w in p.workers.values()
        ]

    # --- lifecycle ------------------------------------------------------------------------

    def add(
        self,
        model_name: str,
        tenant_id: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        expected_output_tokens: int | None = None,
    ) -> None:
        """Book a request. With `expected_output_tokens` its output blocks weigh less as its
        output nears that length (`decayed_output`)."""
        self.version += 1
        partition = self._partition(model_name, tenant_id)
        now = self.clock()
        self._expire_partition(partition, now)
        slot = partition.slots.get((worker_id, dp_rank))
        if slot is None:
            raise NotFound(
                f"worker {worker_id} dp_rank {dp_rank} is not registered for this model and tenant"
            )
        existing = partition.requests.get(request_id)
        if existing is not None:
            owner = existing.slot
            raise Conflict(
                f"request {request_id} already exists (assigned to worker {owner.worker_id} "
                f"dp_rank {owner.dp_rank})"
            )
        hashes = tuple(sequence_hashes) if slot.tracks_blocks else ()
        holders = partition.holders
        groups: list[Group] = []
        # The head that is whole groups in their order (a held prompt) costs a dict lookup and a
        # tuple compare per group, and no hash of its own: see `_runs`.
        position = _runs(holders, hashes, groups)
        walked = len(groups)
        # How many leading hashes are groups' members in the groups' order.
        covered = position
        new: set[int] = set()
        if position == len(hashes):
            block_count = position
            if walked:
                # The groups' int objects: the decoder made new ones, 48 bytes each per request.
                hashes = _joined(groups)
        else:
            tail = hashes[position:] if walked else hashes
            # A hash repeated inside one request is held once by it: refcounts count requests.
            rest = set(tail)
            block_count = position + len(rest)
            # What the groups did not cover: mostly new hashes, whose probes miss at the stored
            # hash values without reading a key.
            new = rest.difference(partition.held)
            if len(new) != len(rest):
                rest -= new  # the tail's held hashes
                if walked:
                    block_count -= _drop_repeats(holders, rest, groups, position)
                followed = _follow(holders, tail, rest, groups)
                if followed:
                    # As for the head, where the tail follows held groups in their order but
                    # not as whole groups (its last one split off).
                    head = _joined(groups[walked:])
                    if head == tail[:followed]:
                        tail = head + tail[followed:]
                        covered += followed
                if rest:
                    _cover(holders, rest, groups)
            hashes = _joined(groups[:walked]) + tail if walked else tail
        if groups:
            index = slot.index
            for group in groups:
                refs = group.refs
                count = refs.get(index)
                if count is None:
                    refs[index] = 1
                    group.mask |= slot.bit
                    slot.blocks += group.size
                else:
                    refs[index] = count + 1
        if new:
            # A request sharing nothing has distinct hashes, all new: its tuple is the group's.
            # So is a tail of distinct new hashes after held groups, in request order, so that
            # the next request with the same prompt is whole groups (`_runs`).
            members = hashes[covered:] if len(new) == len(hashes) - covered else tuple(new)
            group = Group(members, {slot.index: 1}, slot.bit)
            # A plain loop: `holders.update(dict.fromkeys(new, group))` fills a second dict first.
            for block_hash in members:
                holders[block_hash] = group
            partition.held |= new
            groups.append(group)
            slot.blocks += len(new)
        slot.prefill_tokens += new_isl_tokens
        slot.request_count += 1
        partition.requests[request_id] = ActiveRequest(
            request_id, slot, hashes, block_count, groups, new_isl_tokens, now, expected_output_tokens
        )

    def prefill_complete(self, model_name: str, tenant_id: str, request_id: str) -> None:
        self.version += 1
        partition = self._partition(model_name, tenant_id)
        request = partition.requests.get(request_id)
        if request is None:
            raise NotFound(f"request {request_id} not found")
        request.slot.prefill_tokens -= request.prefill_tokens
        request.prefill_tokens = 0

    def set_output_blocks(self, model_name: str, tenant_id: str, request_id: str, output_blocks: int,
                          *, may_shrink: bool = False) -> None:
        """Sets how many output blocks the request holds now: an absolute count, so a retried
        call changes nothing, and one smaller than the last is a conflict (output only grows)
        unless `may_shrink` (the selection service's decayed output load shrinks by design).
        They add to its rank's decode blocks until the request is freed or expires. O(1).

        The TTL still counts from /add, as for every request (and in Dynamo): it bounds how
        long any request holds load whatever its gateway reports, and keeps expiry in /add order."""
        self.version += 1
        partition = self._partition(model_name, tenant_id)
        request = partition.requests.get(request_id)
        if request is None:
            raise NotFound(f"request {request_id} not found")
        if output_blocks < request.output_blocks and not may_shrink:
            raise Conflict(
                f"request {request_id} already holds {request.output_blocks} output blocks; "
                f"the count cannot shrink to {output_blocks}"
            )
        expected = request.expected_output_tokens
        load = output_blocks if expected is None else decayed_output(output_blocks, partition.block_size, expected)
        if not request.slot.tracks_blocks:
            load = 0
        request.slot.output_blocks += load - request.output_load
        request.output_blocks = output_blocks
        request.output_load = load

    def free(self, model_name: str, tenant_id: str, request_id: str) -> None:
        """Idempotent: an unknown request is already free."""
        self.version += 1
        partition = self._partition(model_name, tenant_id)
        request = partition.requests.pop(request_id, None)
        if request is not None:
            _release(partition, request)

    # --- lookups (for replication: it places and replaces requests through the calls above) ---

    def request(self, model_name: str, tenant_id: str, request_id: str) -> ActiveRequest | None:
        """The request held under this id, if any. Read-only to callers."""
        partition = self.partitions.get((model_name, tenant_id))
        return partition.requests.get(request_id) if partition is not None else None

    def worker(self, model_name: str, tenant_id: str, worker_id: int) -> Worker | None:
        """The registered worker, if any. Read-only to callers."""
        partition = self.partitions.get((model_name, tenant_id))
        return partition.workers.get(worker_id) if partition is not None else None

    def active_requests(self) -> Iterator[tuple[str, str, ActiveRequest]]:
        """Every request held, as (model_name, tenant_id, request). Read-only to callers."""
        for (model_name, tenant_id), partition in self.partitions.items():
            for request in partition.requests.values():
                yield model_name, tenant_id, request

    # --- loads ----------------------------------------------------------------------------

    def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[RankLoad]:
        return [
            RankLoad(
                p.model_name,
                p.tenant_id,
                slot.worker_id,
                slot.dp_rank,
                slot.prefill_tokens,
                slot.blocks + slot.output_blocks,
            )
            for p in self._matching(model_name, tenant_id)
            for slot in p.ranks
        ]

    def potential_loads(
        self, model_name: str, tenant_id: str, sequence_hashes: list[int], new_isl_tokens: int = 0
    ) -> list[PotentialLoad]:
        """Each rank's load if the request were added there: exactly what `/loads` would report
        for that rank after the `/add` (a query hash the rank does not hold adds one block)."""
        return [PotentialLoad(**row)
                for row in self.potential_load_rows(model_name, tenant_id, sequence_hashes, new_isl_tokens)]

    def potential_load_rows(
        self, model_name: str, tenant_id: str, sequence_hashes: list[int], new_isl_tokens: int = 0
    ) -> list[dict[str, int]]:
        """`potential_loads` as the JSON objects of `/potential_loads`' answer, fields in the
        same order: a dict literal per rank costs a third of a dataclass's `__init__` (16 ranks:
        1.1 against 3.6 us, a quarter of the core's time for a 512-hash query)."""
        partition = self._partition(model_name, tenant_id)
        holders = partition.holders
        # Whole held groups in their order first, as in `add`: a dict lookup and a compare each
        # (on a tuple, which a query starting with a hash no one holds does not need).
        groups: list[Group] = []
        hashes: Sequence[int] = sequence_hashes
        position = 0
        if sequence_hashes and sequence_hashes[0] in holders:
            hashes = tuple(sequence_hashes)
            position = _runs(holders, hashes, groups)
        query_length = position
        found: set[int] = set()
        if position < len(hashes):
            rest = set(hashes[position:] if position else hashes)
            query_length += len(rest)
            found = rest & partition.held
            if found and groups:
                query_length -= _drop_repeats(holders, found, groups, position)
        held = _held_counts(partition, found, groups)
        if partition.untracked_ranks:
            return [
                {
                    "worker_id": slot.worker_id,
                    "dp_rank": slot.dp_rank,
                    "potential_prefill_tokens": slot.prefill_tokens + new_isl_tokens,
                    "potential_decode_blocks": (slot.blocks + slot.output_blocks + query_length - held[slot.index]
                                                if slot.tracks_blocks else 0),
                    "active_requests": slot.request_count,
                }
                for slot in partition.ranks
            ]
        return [
            {
                "worker_id": slot.worker_id,
                "dp_rank": slot.dp_rank,
                "potential_prefill_tokens": slot.prefill_tokens + new_isl_tokens,
                "potential_decode_blocks": slot.blocks + slot.output_blocks + query_length - held[slot.index],
                "active_requests": slot.request_count,
            }
            for slot in partition.ranks
        ]

    # --- expiry ---------------------------------------------------------------------------

    def expire(self) -> int:
        """Free every request older than the TTL; returns how many. Cost: O(expired + partitions)."""
        now = self.clock()
        expired = sum(self._expire_partition(p, now) for p in list(self.partitions.values()))
        if expired:
            self.version += 1
        return expired

    # --- dump and restore -----------------------------------------------------------------

    def dump(self, *, taken_at: float) -> SlotTrackerDump:
        """The whole state as data, partitions in (model_name, tenant_id) order: their workers,
        and their active requests in expiry order with the TTL each has left. `taken_at` is the
        caller's wall-clock time, from which a later restore measures how long ago that was.
        Requests past their TTL that no sweep has freed yet are left out (the next sweep would
        free them). O(workers + requests): the hash tuples are shared, not copied (they never
        change)."""
        now = self.clock()
        ttl = self.request_ttl_secs
        partitions = []
        for partition in self._matching(None, None):
            workers = [DumpedWorker(w.worker_id, w.block_size, w.dp_start, w.dp_size, w.role)
                       for w in partition.workers.values()]
            requests = []
            for request in partition.requests.values():
                left = request.added_at + ttl - now
                if left > 0:
                    slot = request.slot
                    requests.append(DumpedRequest(request.request_id, slot.worker_id, slot.dp_rank, request.hashes,
                                                  request.prefill_tokens, request.output_blocks, left,
                                                  request.expected_output_tokens))
            partitions.append(DumpedPartition(partition.model_name, partition.tenant_id, workers, requests))
        return SlotTrackerDump(DUMP_VERSION, taken_at, partitions)

    def restore(self, dump: SlotTrackerDump, *, elapsed_secs: float = 0.0) -> RestoreReport:
        """Replace the whole state with `dump`'s as it is `elapsed_secs` (≥ 0) after the dump:
        its workers register again and its requests are added again in order, each with the TTL
        it had left less `elapsed_secs`, cut to this tracker's TTL. So loads, potential loads and
        expiry times are the dumped tracker's; requests whose TTL ran out are left out. Costs
        what the adds cost (they rebuild the groups).

        A dump no tracker produces (a request on an unknown rank, a request id or partition
        twice, requests out of expiry order) raises the ServiceError of the first such entry,
        naming its partition, and changes nothing."""
        scratch = SlotTracker(request_ttl_secs=self.request_ttl_secs, clock=self.clock)
        now = self.clock()
        ttl = self.request_ttl_secs
        report = RestoreReport(0, 0, 0)
        seen: set[PartitionKey] = set()
        for dumped in dump.partitions:
            model_name, tenant_id = key = dumped.model_name, dumped.tenant_id
            try:
                if key in seen:
                    raise Conflict("partition listed twice")
                seen.add(key)
                for worker in dumped.workers:
                    scratch.register(worker.worker_id, model_name, tenant_id, worker.block_size, worker.dp_start,
                                     worker.dp_size, worker.role)
                report.workers += len(dumped.workers)
                previous_ttl = 0.0
                for request in dumped.requests:
                    # Expiry pops requests from the front of /add order: that order must be theirs.
                    if request.remaining_ttl_secs < previous_ttl:
                        raise InvalidArgument(f"request {request.request_id} is out of expiry order")
                    previous_ttl = request.remaining_ttl_secs
                    left = min(request.remaining_ttl_secs - elapsed_secs, ttl)
                    if left <= 0:
                        report.expired += 1
                        continue
                    scratch.add(model_name, tenant_id, request.request_id, request.worker_id, request.dp_rank,
                                request.sequence_hashes, request.new_isl_tokens, request.expected_output_tokens)
                    scratch.partitions[key].requests[request.request_id].added_at = now - ttl + left
                    if request.output_blocks:
                        scratch.set_output_blocks(model_name, tenant_id, request.request_id, request.output_blocks)
                    report.requests += 1
            except ServiceError as exc:
                raise type(exc)(f"model={model_name} tenant_id={tenant_id}: {exc.message}") from None
        self.partitions = scratch.partitions
        self.version += 1
        return report

    # --- internals ------------------------------------------------------------------------

    def _expire_partition(self, partition: Partition, now: float) -> int:
        deadline = now - self.request_ttl_secs
        requests = partition.requests
        expired = 0
        while requests:
            oldest = next(iter(requests.values()))
            if oldest.added_at > deadline:
                break
            requests.popitem(last=False)
            _release(partition, oldest)
            expired += 1
        self.expired_total += expired
        return expired

    def _partition(self, model_name: str, tenant_id: str) -> Partition:
        partition = self.partitions.get((model_name, tenant_id))
        if partition is None:
            raise NotFound(f"no slot tracker for model={model_name} tenant_id={tenant_id}")
        return partition

    def _matching(self, model_name: str | None, tenant_id: str | None) -> Iterator[Partition]:
        """Partitions passing both optional filters, in (model_name, tenant_id) order.

        Python compares str by code point, which orders like the UTF-8 bytes Dynamo sorts by.
        """
        for key in sorted(self.partitions):
            if (model_name is None or key[0] == model_name) and (tenant_id is None or key[1] == tenant_id):
                yield self.partitions[key]


# Group walks take one set operation per group, so they are cheap while the hashes fall into a
# few groups (chained prompts: a shared prefix, then new hashes). Past this many groups, counting
# all hashes per group in one C pass is cheaper, and it bounds the walk's cost to O(hashes).
_WALK_STEPS = 8


def _walk(holders: dict[int, Group], held: set[int]) -> Iterator[tuple[Group, set[int] | None]]:
    """The first groups meeting `held`, a set of held hashes, each with its members in `held`
    (removed from `held` as they are yielded), or None if all of them are, for at most
    `_WALK_STEPS` groups; whatever is left in `held` afterwards is for the caller's per-hash
    pass."""
    for _ in range(_WALK_STEPS):
        if not held:
            return
        group = holders[next(iter(held))]
        members = group.members
        if held.issuperset(members):
            held.difference_update(members)
            yield group, None
        else:
            common = held.intersection(members)
            held -= common
            yield group, common


def _runs(holders: dict[int, Group], hashes: tuple[int, ...], groups: list[Group]) -> int:
    """Appends to `groups` the groups whose members are the head of `hashes`, whole and in their
    order, one after the other, for at most `_WALK_STEPS` groups; returns the head's length.

    A prompt that other requests hold is such a head: its shared prefix, then the rest of a
    prompt sent before, each a group whose members are in request order (`/add` keeps them so).
    Checking a group is a dict lookup and a compare of two tuples, which finds the same int
    values at the same places without hashing them: the hashes of the head are distinct (the
    members of one group are, and groups are disjoint), so neither the dedupe nor the per-hash
    set operations that a head not made of whole groups needs (`_follow`) are run for it.
    """
    position, end = 0, len(hashes)
    for _ in range(_WALK_STEPS):
        if position >= end:
            break
        group = holders.get(hashes[position])
        # A group already taken: the request repeats its hashes, which count once.
        if group is None or group in groups:
            break
        size = group.size
        if hashes[position : position + size] != group.members:
            break
        groups.append(group)
        position += size
    return position


def _joined(groups: list[Group]) -> tuple[int, ...]:
    """The groups' members one after the other. Tuples added in turn: `tuple(chain(...))` grows
    its result item by item (1.9 against 0.3 us for two 128-hash groups)."""
    joined = groups[0].members
    for group in groups[1:]:
        joined += group.members
    return joined


def _drop_repeats(holders: dict[int, Group], found: set[int], head: list[Group], length: int) -> int:
    """Removes from `found`, held hashes of a request's tail, those that the groups of its head
    (`length` hashes, from `_runs`) hold: repeats of hashes the request already has. Returns how
    many. Costs a pass over the smaller of the two: unchained requests (groups split down to
    single hashes) find hundreds of held hashes past a short head."""
    before = len(found)
    if length <= before:
        for group in head:
            found.difference_update(group.members)
    else:
        groups = set(head)
        found.difference_update([block_hash for block_hash in found if holders[block_hash] in groups])
    return before - len(found)


def _follow(holders: dict[int, Group], hashes: Sequence[int], rest: set[int], groups: list[Group]) -> int:
    """Appends to `groups` the groups of `hashes` (the part of a request past the head `_runs`
    took) in request order, each cut to its part in `rest` (those of its distinct hashes that
    are held and not in that head, consumed), for at most `_WALK_STEPS` groups. Returns the
    length of the head of `hashes` that the walk took them to hold, had they been runs of it.
    `_runs` takes whole groups without hashing; this walk also takes the last group, which a
    prompt holds only in part, where it leaves the prompts it shares a prefix with.

    In a chained prompt a group is a run of consecutive hashes (the prefix it shares with other
    requests, then the rest that the same requests hold), so the hash after a group's part
    starts the next group: a held prompt costs a dict lookup per group instead of a set probe
    per hash, and once many hashes are held each such probe is a cache miss on the table and
    another on the key it compares (two fifths of an /add in the lifecycle benchmark:
    bench/ANALYSIS.md, "Figures behind the code"). The walk stops at the first hash no group holds (the new tail), after a group
    the request holds only in part (split off), at a hash already covered (the hashes are not
    a chain) or after `_WALK_STEPS` groups; the caller covers what is left in `rest` exactly.
    """
    position, end = 0, len(hashes)
    for _ in range(_WALK_STEPS):
        if position >= end:
            return position
        block_hash = hashes[position]
        if block_hash not in rest:
            return position
        group = holders.get(block_hash)
        if group is None:
            return position
        members = group.members
        # One pass over the members, which the tuple makes hash again: a check before the
        # removal cost a second one.
        before = len(rest)
        rest.difference_update(members)
        if before - len(rest) == len(members):
            groups.append(group)
            position += len(members)
            continue
        # A part of a group: where a chained prompt leaves the others (its last held group),
        # or hashes that are no chain. Either way the walk ends here. The groups covered so far
        # hold none of its members, so its part in the request is its part in `rest` before.
        piece = _split(holders, group, set(hashes).intersection(members))
        groups.append(piece)
        return position + piece.size
    return position


def _cover(holders: dict[int, Group], known: set[int], groups: list[Group]) -> None:
    """Appends to `groups` groups that exactly cover `known` (consumed), a set of held hashes,
    splitting each group that holds hashes outside `known` too."""
    for group, part in _walk(holders, known):
        groups.append(group if part is None else _split(holders, group, part))
    if not known:
        return
    counts = Counter(map(holders.__getitem__, known))
    # Distinct groups meeting `known` lie inside it iff their sizes add up to it.
    if sum(map(_SIZE, counts)) == len(known):
        groups.extend(counts)
        return
    parts: dict[Group, list[int]] = {}
    for group, count in counts.items():
        if count == group.size:
            groups.append(group)
        else:
            parts[group] = []
    if parts:
        for block_hash in known:
            members = parts.get(holders[block_hash])
            if members is not None:
                members.append(block_hash)
        for group, members in parts.items():
            groups.append(_split(holders, group, set(members)))


def _split(holders: dict[int, Group], group: Group, part: set[int]) -> Group:
    """Moves `part` out of `group` into a new group with the same holders; returns it. Two C
    passes over the group's members, which keep its int objects (`part`'s may be a request's
    equal copies)."""
    members = group.members
    group.members = tuple(filterfalse(part.__contains__, members))
    group.size = len(group.members)
    piece = Group(tuple(filter(part.__contains__, members)), group.refs.copy(), group.mask)
    holders.update(dict.fromkeys(piece.members, piece))
    return piece


def _release(partition: Partition, request: ActiveRequest) -> None:
    slot = request.slot
    holders = partition.holders
    groups: Iterable[Group] = request.groups
    # Groups only shrink, so the ones recorded at /add still cover the request iff their sizes
    # still add up; otherwise a later /add split one of them, and the request's hashes say
    # which groups hold them now.
    if sum(map(_SIZE, groups)) != request.block_count:
        groups = set(map(holders.__getitem__, request.hashes))
    index = slot.index
    for group in groups:
        refs = group.refs
        count = refs[index]
        if count > 1:
            refs[index] = count - 1
        else:
            del refs[index]
            group.mask ^= slot.bit
            slot.blocks -= group.size
            if not refs:
                _forget(partition, group)
    slot.prefill_tokens -= request.prefill_tokens
    slot.output_blocks -= request.output_load
    slot.request_count -= 1


def decayed_output(output_blocks: int, block_size: int, expected_output_tokens: int) -> int:
    """What a request's output blocks weigh when its gateway expects `expected_output_tokens` of
    output (the router guide's decay toward `nvext.agent_hints.osl`): each block weighs 1 at
    first, falling linearly to 0 as the output (`output_blocks * block_size` tokens) reaches the
    expected length, rounded half away from zero. A request near its end will soon free them."""
    if expected_output_tokens <= 0:
        return 0
    weight = 1.0 - output_blocks * block_size / expected_output_tokens
    return math.floor(output_blocks * weight + 0.5) if weight > 0 else 0


def _forget(partition: Partition, group: Group) -> None:
    holders = partition.holders
    for block_hash in group.members:
        del holders[block_hash]
    partition.held.difference_update(group.members)


def _held_counts(partition: Partition, held: set[int], whole: list[Group]) -> list[int]:
    """For each slot index, how many of the distinct held query hashes it holds: those of the
    groups `whole` (all their members), and `held` (consumed), none of which those groups hold.

    Hits are summed per holder mask first, so groups with the same holders (a prefix cut by
    splits, or unchained hashes in many small groups) cost one pass over those holders' indexes,
    read from the refs of any group with that mask: walking a 256-bit mask's bits, even via
    `bin`, cost twice as much.
    """
    holders = partition.holders
    per_mask: dict[int, list[Any]] = {}  # mask -> [hits, the refs of a group with that mask]
    for group in whole:
        entry = per_mask.get(group.mask)
        if entry is None:
            per_mask[group.mask] = [group.size, group.refs]
        else:
            entry[0] += group.size
    for _ in range(_WALK_STEPS):  # `_walk`, counting hits by what the removal took
        if not held:
            break
        group = holders[next(iter(held))]
        before = len(held)
        held.difference_update(group.members)
        hits = before - len(held)
        entry = per_mask.get(group.mask)
        if entry is None:
            per_mask[group.mask] = [hits, group.refs]
        else:
            entry[0] += hits
    if held:
        groups = list(map(holders.__getitem__, held))
        masks = list(map(_MASK, groups))
        refs_by_mask = dict(zip(masks, map(_REFS, groups)))
        for mask, hits in Counter(masks).items():
            entry = per_mask.get(mask)
            if entry is None:
                per_mask[mask] = [hits, refs_by_mask[mask]]
            else:
                entry[0] += hits
    counts = [0] * partition.next_index
    for hits, refs in per_mask.values():
        for index in refs:
            counts[index] += hits
    return counts


_SIZE = attrgetter("size")
_MASK = attrgetter("mask")
_REFS = attrgetter("refs")
