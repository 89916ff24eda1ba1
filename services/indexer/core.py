"""All partitions of one indexer process: workers, event-id watermarks and query answers.

The partitions, their ranks, instance ownership and the watermarks are `partitions.py`; the
approximations `approx.py`; the prefix tree of each partition `tree/` (`PrefixTree`). `Indexer` is the one
API over them that the shells call. A partition is created by the first registration or events
document that names it and disappears with its last worker, so a query then gets 404 as in
Dynamo.

Events documents are validated whole (shape by `protocols`' readers, then block sizes and
instance ownership here) before anything is applied, so a document is applied completely or
not at all. Applying is per event: per (instance, dp_rank) an event-id watermark skips
re-delivered batches (the events of one engine batch share its id), reports gaps, and every
event the index refuses is counted with a reason. Engine listeners (`listeners.py`) apply one
ZMQ batch at a time through `apply_batch`, and `reset_rank` when an engine restarted.

A query returns a `QueryResult`, the blocks matched per rank and tier; shaping it into Dynamo's
JSON answer is the serving layer's job (`answers.py`).

Ranks whose engines publish nothing are approximated (`record_routed`, see `approx.py`): the
blocks of the requests routed to them count for a TTL. A partition has an `Approximations` only
while some rank of it has approximations, so exact partitions pay nothing for them. A rank's
`source` says how it is indexed: `events` (it has an engine subscription or has had an event),
`approximate` (only approximations so far), `none` (registered, nothing yet).

Errors are `dynamo_lite.base.errors` kinds only; mapping them to HTTP is the shell's job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynamo_lite.base.errors import AlreadyRegistered, Conflict, InvalidArgument, InvalidShape, NotFound
from dynamo_lite.hashing import local_block_hashes
from dynamo_lite.indexer.approx import DEFAULT_MAX_BLOCKS, DEFAULT_TTL_SECS, Approximations, ApproxTotals, RoutedReport
from dynamo_lite.indexer.partitions import (
    APPROXIMATE,
    EVENTS,
    MAX_LISTED,
    NONE,
    Gap,
    Partition,
    PartitionId,
    Partitions,
    Rank,
    Source,
    Watermarks,
    check_block_size,
    owned_elsewhere,
)
from dynamo_lite.indexer.protocols import (
    DEVICE,
    LOWER_TIERS,
    PartitionEvents,
    Removed,
    RouterEvent,
    Stored,
    events_document,
    parse_events_document,
    partition_key,
)
from dynamo_lite.indexer.tree import StoreStatus, WorkerKey


@dataclass(slots=True)
class RankInfo:
    dp_rank: int
    source: Source
    registered: bool
    endpoint: str | None
    blocks: int  # device-tier blocks held (including any held below a removed block)
    lower_tier_blocks: int  # host_pinned + disk + external
    approximate_blocks: int  # device blocks approximated by /routed (below a removed block too)
    last_event_id: int | None
    replay_endpoint: str | None = None
    listener: Any = None  # the shell fills in its ZMQ listener's state, if it has one


@dataclass(slots=True)
class WorkerInfo:
    instance_id: int
    model_name: str
    tenant_id: str
    block_size: int
    ranks: list[RankInfo]


class RankState(msgspec.Struct, array_like=True):
    """What a rank is, beyond the blocks it holds: what a replica's snapshot carries besides the
    dump, so that a replica started from it registers, listens and skips re-deliveries exactly
    as the replicas that applied the whole stream. Declared once, as its snapshot rows are
    written: a JSON array of the fields in this order (`replication.encode_snapshot`)."""

    model_name: str
    tenant_id: str
    block_size: int
    instance_id: int
    dp_rank: int
    source: Source
    registered: bool
    endpoint: str | None
    replay_endpoint: str | None
    last_event_id: int | None


@dataclass(slots=True)
class QueryResult:
    """How far a prompt matches each rank of its partition, in blocks, per (instance_id, dp_rank),
    zero counts left out: `device` is the leading run of query blocks the rank holds on the
    device tier (its approximations included); `host_pinned` the blocks the host-pinned tier
    adds right after that run; `disk` the blocks the disk and external tiers add after those.
    `block_size` (tokens per block, the partition's) turns the counts into tokens. The dicts
    are the query's own: the caller may keep or change them."""

    block_size: int
    device: dict[WorkerKey, int]
    host_pinned: dict[WorkerKey, int]
    disk: dict[WorkerKey, int]


@dataclass(slots=True)
class Rejection:
    partition: str
    index: int  # position of the event in its partition's events array
    reason: str


@dataclass(slots=True)
class ApplyReport:
    """What an events document did. `applied + skipped + rejected` = events in the document."""

    applied: int = 0
    skipped: int = 0  # in a batch at or below the rank's watermark: a re-delivery
    rejected: int = 0
    unknown_removals: int = 0  # removed block hashes the worker did not hold
    gap_count: int = 0
    rejections: list[Rejection] = field(default_factory=list)  # the first MAX_LISTED
    gaps: list[Gap] = field(default_factory=list)  # the first MAX_LISTED


class Indexer:
    """Every partition of the process. Not thread-safe: call it from one thread."""

    def __init__(
        self,
        max_blocks: int = 0,
        *,
        approx_ttl_secs: float = DEFAULT_TTL_SECS,
        approx_max_blocks: int = DEFAULT_MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`max_blocks`: per partition, at most this many device (worker, block) pairs and
        this many blocks per lower tier, least recently used evicted first; 0: unlimited.
        `approx_ttl_secs`, `approx_max_blocks` (0: unlimited): how long a routed block counts
        for its rank, and how many (rank, block) approximations a partition keeps at most.
        `clock` times the approximations; `wall_clock` dates them in dumps."""
        self.registry = Partitions(max_blocks)
        self.partitions: dict[PartitionId, Partition] = self.registry.by_id  # the same dict, read-only here
        self.max_blocks = max_blocks
        self.approx_ttl_secs = approx_ttl_secs
        self.approx_max_blocks = approx_max_blocks
        self.approx_totals = ApproxTotals()
        self.clock = clock
        self.wall_clock = wall_clock
        # Totals over every `apply_events` call since start-up, for the metrics.
        self.events_applied_total = 0
        self.events_skipped_total = 0
        self.events_rejected_total = 0
        self.event_gaps_total = 0

    # --- workers ------------------------------------------------------------------------------

    def register(
        self,
        instance_id: int,
        model_name: str,
        tenant_id: str,
        block_size: int,
        dp_rank: int = 0,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
    ) -> None:
        """Add one (instance, dp_rank). A rank first seen in events becomes registered.
        `endpoint` / `replay_endpoint` are recorded only: subscribing is the shell's job."""
        _check_partition_name(tenant_id)
        self.registry.check_owner(instance_id, (model_name, tenant_id))
        partition = self.registry.get_or_add(model_name, tenant_id, block_size)
        key = (instance_id, dp_rank)
        rank = partition.ranks.get(key)
        if rank is not None and rank.registered:
            raise AlreadyRegistered(f"instance {instance_id} dp_rank {dp_rank} already registered")
        if rank is None:
            rank = self.registry.add_rank(partition, key, NONE)
        rank.registered = True
        rank.endpoint = endpoint
        rank.replay_endpoint = replay_endpoint
        if endpoint is not None:
            rank.source = EVENTS  # its engine publishes: the subscription feeds it

    def unregister(
        self, instance_id: int, model_name: str, tenant_id: str, dp_rank: int | None = None
    ) -> list[WorkerKey]:
        """Drop one rank (or all ranks, `dp_rank` None) with all their blocks, on every tier;
        returns the (instance, dp_rank)s dropped."""
        owner = self.registry.owner(instance_id)
        if owner is None:
            raise NotFound(f"instance {instance_id} not found")
        if (owner.model_name, owner.tenant_id) != (model_name, tenant_id):
            raise NotFound(f"instance {instance_id} is registered for {owner.describe()}")
        doomed = [key for key in owner.ranks if key[0] == instance_id and (dp_rank is None or key[1] == dp_rank)]
        if not doomed:
            raise NotFound(f"instance {instance_id} dp_rank {dp_rank} not found")
        self.registry.drop_ranks(owner, doomed)
        return doomed

    def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerInfo]:
        """Instances sorted by (model_name, tenant_id, instance_id), ranks by dp_rank."""
        result: list[WorkerInfo] = []
        for partition in self.registry.matching(model_name, tenant_id):
            tree = partition.tree
            approx = partition.approx
            instances: dict[int, list[RankInfo]] = {}
            for key in sorted(partition.ranks):
                rank = partition.ranks[key]
                instances.setdefault(key[0], []).append(
                    RankInfo(
                        key[1],
                        rank.source,
                        rank.registered,
                        rank.endpoint,
                        tree.block_count(key),
                        sum(tree.block_count(key, tier) for tier in LOWER_TIERS),
                        approx.block_count(tree, key) if approx is not None else 0,
                        rank.last_event_id,
                        rank.replay_endpoint,
                    )
                )
            result.extend(
                WorkerInfo(instance_id, partition.model_name, partition.tenant_id, partition.block_size, ranks)
                for instance_id, ranks in instances.items()
            )
        return result

    def block_size(self, model_name: str, tenant_id: str) -> int:
        return self.registry.existing(model_name, tenant_id).block_size

    @property
    def evicted_blocks_total(self) -> int:
        """Blocks dropped by the `max_blocks` limit since start-up, in every partition."""
        return self.registry.evicted_in_dropped + sum(p.tree.evicted_blocks for p in self.partitions.values())

    def approximate_blocks(self) -> int:
        """(rank, block) approximations held now, in every partition."""
        return sum(
            sum(map(p.tree.block_count, p.approx.serials))
            for p in self.partitions.values()
            if p.approx is not None
        )

    # --- approximations -----------------------------------------------------------------------

    def record_routed(
        self, model_name: str, tenant_id: str, instance_id: int, dp_rank: int, local_hashes: Sequence[int]
    ) -> RoutedReport:
        """The rank was chosen for a prompt with these local block hashes (u64 or i64, from its
        first block): it is assumed to hold them for `approx_ttl_secs`, refreshed when routed
        again. An unknown rank of the partition is added (source "approximate"), as `/events`
        adds unknown ranks; an unknown partition is a NotFound (no block size is known for it),
        an instance of another partition a Conflict."""
        partition = self.registry.existing(model_name, tenant_id)
        self.registry.check_owner(instance_id, (model_name, tenant_id))
        if not local_hashes:
            return RoutedReport(0, 0, 0)
        key = (instance_id, dp_rank)
        report = self._approximations(partition).record(partition.tree, key, local_hashes, self.clock())
        if report.recorded:
            self._approximated_rank(partition, key)
        partition.settle()
        return report

    def check_routed(self, model_name: str, tenant_id: str, instance_id: int) -> None:
        """Raise what `record_routed` would raise for this rank, changing nothing."""
        self.registry.existing(model_name, tenant_id)
        self.registry.check_owner(instance_id, (model_name, tenant_id))

    def hash_tokens(
        self, model_name: str, tenant_id: str, token_ids: Sequence[int], *, lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """A prompt's local block hashes in the partition's block size, as `query_tokens` and
        `record_routed_tokens` compute them."""
        return self._hash_tokens(self.registry.existing(model_name, tenant_id), token_ids, lora_name, cache_salt)

    def check_events(self, document: Sequence[PartitionEvents]) -> None:
        """Raise what `apply_events` would raise before applying anything (a block size or
        instance that conflicts with this index), changing nothing."""
        self._validate(document)

    def record_routed_tokens(
        self,
        model_name: str,
        tenant_id: str,
        instance_id: int,
        dp_rank: int,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> RoutedReport:
        """`record_routed` for a prompt's token ids, hashed as `query_tokens` hashes them."""
        hashes = self._hash_tokens(self.registry.existing(model_name, tenant_id), token_ids, lora_name, cache_salt)
        return self.record_routed(model_name, tenant_id, instance_id, dp_rank, hashes)

    def expire_approximations(self) -> int:
        """Drop every approximation past its TTL, in every partition; returns how many.
        O(expired + partitions): writes and queries of a partition expire it too."""
        now = self.clock()
        expired = 0
        for partition in list(self.partitions.values()):
            if partition.approx is not None:
                expired += partition.approx.expire(partition.tree, now)
                partition.settle()
        return expired

    def _approximations(self, partition: Partition) -> Approximations:
        return partition.approximations(self.approx_ttl_secs, self.approx_max_blocks, self.approx_totals)

    def _approximated_rank(self, partition: Partition, key: WorkerKey) -> None:
        rank = partition.ranks.get(key)
        if rank is None:
            self.registry.add_rank(partition, key, APPROXIMATE)
        elif rank.source == NONE:
            rank.source = APPROXIMATE

    # --- events -------------------------------------------------------------------------------

    def apply_events(self, document: Sequence[PartitionEvents]) -> ApplyReport:
        """Apply a parsed events document, all of it or (on an error) none of it.

        Unknown (instance, dp_rank)s are registered implicitly with source "events".
        Event ids are batch ids: Dynamo gives every event of one engine batch the batch's
        sequence number. Per rank, consecutive events with the same id in this document are one
        batch and are applied together; a batch whose id is at or below the last one applied
        is a re-delivery and skipped whole; a jump past last+1 (or a first id other than 0) is
        applied and reported as a gap. A batch is one document's: post each batch whole.
        """
        self._validate(document)
        report = self._apply(document, watermarks=True)
        self.events_applied_total += report.applied
        self.events_skipped_total += report.skipped
        self.events_rejected_total += report.rejected
        self.event_gaps_total += report.gap_count
        return report

    def load_dump(self, document: Any) -> ApplyReport:
        """Merge a `/dump` document (e.g. a peer's) into this index, creating its partitions
        and workers. Dumps renumber event ids per tier section, so watermarks are neither
        checked nor moved: the next live event of each worker starts a fresh sequence."""
        return self.load_sections(parse_events_document(document))

    def load_sections(self, sections: Sequence[PartitionEvents]) -> ApplyReport:
        """`load_dump` of a dump already read (`protocols.decode_events_document` reads its bytes)."""
        self._validate(sections, keep_empty=True)
        return self._apply(sections, watermarks=False)

    def _validate(self, document: Sequence[PartitionEvents], *, keep_empty: bool = False) -> None:
        """`keep_empty`: sections without events create their partition too (a dump lists a
        partition whose workers hold nothing; recovery keeps it and its block size)."""
        sizes: dict[PartitionId, int] = {}
        claimed: dict[int, PartitionId] = {}
        for section in document:
            pid = (section.model_name, section.tenant_id)
            _check_partition_name(section.tenant_id)
            existing = self.partitions.get(pid)
            size = existing.block_size if existing is not None else sizes.get(pid)
            if size is not None and size != section.block_size:
                raise Conflict(
                    f"block_size mismatch for model={pid[0]} tenant_id={pid[1]}: "
                    f"existing={size}, requested={section.block_size}"
                )
            if size is None and (section.events or section.approximations or keep_empty):
                check_block_size(section.block_size)
                sizes[pid] = section.block_size
            instance_ids = {event.worker_id for event in section.events}
            instance_ids.update(entry.worker_id for entry in section.approximations)
            for instance_id in instance_ids:
                self.registry.check_owner(instance_id, pid)
                other = claimed.setdefault(instance_id, pid)
                if other != pid:
                    raise owned_elsewhere(instance_id, other)

    def _apply(self, document: Sequence[PartitionEvents], *, watermarks: bool) -> ApplyReport:
        report = ApplyReport()
        admitted = Watermarks() if watermarks else None
        for section in document:
            if not section.events and not section.approximations and watermarks:
                continue  # live ingest: an empty section changes nothing
            partition = self.registry.get_or_add(section.model_name, section.tenant_id, section.block_size)
            for index, event in enumerate(section.events):
                key = (event.worker_id, event.dp_rank)
                rank = self._rank(partition, key)
                if admitted is not None and not admitted.admits(key, rank, event.event_id):
                    continue
                self._apply_one(partition, key, event, report, section.key, index)
            if section.approximations:
                self._load_approximations(partition, section, report)
        if admitted is not None:
            report.skipped, report.gap_count, report.gaps = admitted.skipped, admitted.gap_count, admitted.gaps
        return report

    def _load_approximations(self, partition: Partition, section: PartitionEvents, report: ApplyReport) -> None:
        """A document's approximations (a dump's), with the time each has left; chains the
        index refuses count as rejected, their reason naming `approximations[i]`."""
        for entry in section.approximations:
            self._approximated_rank(partition, (entry.worker_id, entry.dp_rank))
        approx = self._approximations(partition)
        refused = approx.load(partition.tree, section.approximations, self.clock(), self.wall_clock())
        for rejection in refused:
            report.rejected += 1
            if len(report.rejections) < MAX_LISTED:
                index = rejection.index
                entry = section.approximations[index]
                reason = _reason(
                    rejection.status, entry.worker_id, entry.dp_rank, entry.parent_hash, "an approximate block"
                )
                report.rejections.append(Rejection(section.key, index, f"approximations[{index}]: {reason}"))
        partition.settle()

    def apply_batch(self, model_name: str, tenant_id: str, events: Sequence[RouterEvent]) -> ApplyReport:
        """Apply one engine batch, received by a listener of this partition, whole.

        The listener has already decided that the batch is new (sequence numbers, replay and
        restarts are transport matters); the event id of its events becomes each rank's
        watermark. A rank first seen here (a batch naming another data-parallel rank than
        its listener's) is created with source "events".
        """
        partition = self.registry.existing(model_name, tenant_id)
        report = ApplyReport()
        key_prefix = partition_key(model_name, tenant_id)
        for index, event in enumerate(events):
            key = (event.worker_id, event.dp_rank)
            rank = self._rank(partition, key)
            rank.last_event_id = event.event_id
            self._apply_one(partition, key, event, report, key_prefix, index)
        self.events_applied_total += report.applied
        self.events_rejected_total += report.rejected
        return report

    def watermark(self, model_name: str, tenant_id: str, worker_id: int, dp_rank: int) -> int | None:
        """The id of the last batch applied to the rank (None: none since it was created or reset)."""
        partition = self.partitions.get((model_name, tenant_id))
        rank = partition.ranks.get((worker_id, dp_rank)) if partition is not None else None
        return rank.last_event_id if rank is not None else None

    def skip_batch(self, events: int) -> ApplyReport:
        """Count a batch left out as a re-delivery (every event of it skipped)."""
        self.events_skipped_total += events
        return ApplyReport(skipped=events)

    def reset_rank(self, model_name: str, tenant_id: str, worker_id: int, dp_rank: int) -> int:
        """Forget everything one rank holds, and its watermark: its engine restarted, so its
        old blocks are gone and its sequence numbers start again. Returns the device blocks
        dropped."""
        partition = self.registry.existing(model_name, tenant_id)
        key = (worker_id, dp_rank)
        rank = partition.ranks.get(key)
        if rank is None:
            return 0
        dropped = partition.tree.block_count(key)
        partition.forget_approximations(key)
        partition.tree.clear(key)
        rank.last_event_id = None
        return dropped

    def _rank(self, partition: Partition, key: WorkerKey) -> Rank:
        """The rank an event is for, created if unknown; it is fed by events from now on."""
        rank = partition.ranks.get(key)
        if rank is None:
            rank = self.registry.add_rank(partition, key, EVENTS)
        elif rank.source != EVENTS:
            rank.source = EVENTS
        return rank

    def _apply_one(
        self, partition: Partition, key: WorkerKey, event: RouterEvent, report: ApplyReport, where: str, index: int
    ) -> None:
        tree = partition.tree
        data = event.data
        if type(data) is Stored:
            status = tree.store(key, data.parent_hash, data.block_hashes, data.tokens_hashes, event.storage_tier)
            if status is not StoreStatus.STORED:
                report.rejected += 1
                if len(report.rejections) < MAX_LISTED:
                    report.rejections.append(
                        Rejection(where, index, _reason(status, key[0], key[1], data.parent_hash, "a device block"))
                    )
                return
        elif type(data) is Removed:
            approx = partition.approx
            if approx is not None and event.storage_tier == DEVICE:
                approx.forget_blocks(tree, key, data.block_hashes)
                partition.settle()
            report.unknown_removals += tree.remove(key, data.block_hashes, event.storage_tier)
        else:
            partition.forget_approximations(key)
            tree.clear(key)
        report.applied += 1

    # --- queries ------------------------------------------------------------------------------

    def query(self, model_name: str, tenant_id: str, local_hashes: Sequence[int]) -> QueryResult:
        """Overlap of a prompt's local block hashes (u64, or i64 as `/query_by_hash` sends
        them) with every rank of the partition: blocks matched per rank and tier (see
        `QueryResult`). Expires the partition's due approximations first."""
        partition = self.registry.existing(model_name, tenant_id)
        approx = partition.approx
        if approx is None:
            match = partition.tree.match(local_hashes)
        else:
            approx.expire(partition.tree, self.clock())
            match = partition.tree.match(local_hashes)
            approx.fold(match)
            partition.settle()
        return QueryResult(partition.block_size, match.device, match.host_pinned, match.disk)

    def query_tokens(
        self,
        model_name: str,
        tenant_id: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> QueryResult:
        """`query` for a prompt's token ids, hashed with the partition's block size."""
        hashes = self._hash_tokens(self.registry.existing(model_name, tenant_id), token_ids, lora_name, cache_salt)
        return self.query(model_name, tenant_id, hashes)

    def dump(self) -> dict[str, Any]:
        """Every partition as `/dump` shows it: stored events that rebuild the index, device
        tier first (parents before children), event ids renumbered from 0 per tier section."""
        return events_document(self.dump_partitions())

    def dump_partitions(self) -> list[PartitionEvents]:
        """What `dump` shows, before it becomes JSON: the events reference no index state, so
        they can be encoded elsewhere (another thread) while the index changes. Approximations
        are dated in Unix time, so a snapshot loaded after a restart expires them on time."""
        self.expire_approximations()
        now, wall_now = self.clock(), self.wall_clock()
        dumped = []
        for partition in self.registry.matching(None, None):
            approx, tree = partition.approx, partition.tree
            section = PartitionEvents(partition.model_name, partition.tenant_id, partition.block_size, [])
            if approx is None:
                section.events = tree.dump()
            else:
                section.events = tree.dump(approx.is_exact)
                section.approximations = approx.dump(tree, now, wall_now)
            dumped.append(section)
        return dumped

    def rank_states(self) -> list[RankState]:
        return [
            RankState(partition.model_name, partition.tenant_id, partition.block_size, key[0], key[1], rank.source,
                      rank.registered, rank.endpoint, rank.replay_endpoint, rank.last_event_id)
            for partition in self.registry.matching(None, None)
            for key, rank in sorted(partition.ranks.items())
        ]

    def restore_rank_states(self, states: Sequence[RankState]) -> None:
        """Give ranks what `rank_states` said of them (after `load_dump`, which rebuilt their
        blocks but registers nothing and moves no watermark); ranks missing are created."""
        for state in states:
            if state.registered:
                self.register(state.instance_id, state.model_name, state.tenant_id, state.block_size, state.dp_rank,
                              state.endpoint, state.replay_endpoint)
            partition = self.registry.get_or_add(state.model_name, state.tenant_id, state.block_size)
            key = (state.instance_id, state.dp_rank)
            rank = partition.ranks.get(key) or self.registry.add_rank(partition, key, state.source)
            rank.source = state.source
            rank.last_event_id = state.last_event_id

    # --- internals ----------------------------------------------------------------------------

    @staticmethod
    def _hash_tokens(
        partition: Partition, token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None
    ) -> list[int]:
        try:
            return local_block_hashes(token_ids, partition.block_size, lora_name=lora_name, cache_salt=cache_salt)
        except ValueError as error:
            raise InvalidShape(str(error)) from None


def _check_partition_name(tenant_id: str) -> None:
    # Partition keys are split at their last colon; a colon in the tenant would misread.
    if ":" in tenant_id:
        raise InvalidArgument(f"tenant_id `{tenant_id}` must not contain `:`")


def _reason(status: StoreStatus, worker_id: int, dp_rank: int, parent_hash: int | None, kind: str) -> str:
    who = f"worker {worker_id} dp_rank {dp_rank}"
    if status is StoreStatus.UNKNOWN_PARENT:
        return f"parent_hash {parent_hash} is not {kind} of {who}"
    if status is StoreStatus.SELF_REFERENCE:
        return "a block_hash repeats within the event or equals its parent_hash"
    return f"a block_hash of the event already names a different block of {who}"
