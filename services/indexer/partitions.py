"""The partitions of one index, their ranks, and which partition owns each instance id.

A partition is a (model_name, tenant_id) pair with one block size, one `PrefixTree` and, while
some rank of it has approximations (`/routed`), one `Approximations`. An instance id belongs to
one partition; each of its dp ranks is a worker slot of that partition's tree. `Partitions`
creates partitions and ranks and refuses an instance that another partition owns
(`AlreadyRegistered`); `Watermarks` decides, per rank, which event batches of a document are
new. Pure, like `Indexer`, which is built on them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Literal

from dynamo_lite.base.errors import AlreadyRegistered, Conflict, InvalidArgument, NotFound
from dynamo_lite.indexer.approx import Approximations, ApproxTotals
from dynamo_lite.indexer.tree import PrefixTree, WorkerKey

PartitionId = tuple[str, str]  # (model_name, tenant_id)
Source = Literal["events", "approximate", "none"]
EVENTS: Final = "events"
APPROXIMATE: Final = "approximate"
NONE: Final = "none"

MAX_LISTED: Final = 100  # rejections / gaps itemised in one report; the counts stay exact


@dataclass(slots=True)
class Rank:
    source: Source
    registered: bool = False  # by /register (or --workers), not only seen in events or /routed
    endpoint: str | None = None
    last_event_id: int | None = None
    replay_endpoint: str | None = None


@dataclass(slots=True)
class Partition:
    model_name: str
    tenant_id: str
    block_size: int
    tree: PrefixTree = field(default_factory=PrefixTree)
    ranks: dict[WorkerKey, Rank] = field(default_factory=dict)
    approx: Approximations | None = None  # while some rank has approximations

    def describe(self) -> str:
        return f"model={self.model_name} tenant_id={self.tenant_id}"

    # --- approximation lifecycle: created by the first approximation, released with the last --

    def approximations(self, ttl_secs: float, max_blocks: int, totals: ApproxTotals) -> Approximations:
        approx = self.approx
        if approx is None:
            approx = self.approx = Approximations(ttl_secs, max_blocks, totals)
        return approx

    def forget_approximations(self, key: WorkerKey) -> None:
        if self.approx is not None:
            self.approx.forget_rank(self.tree, key)
            self.settle()

    def settle(self) -> None:
        """Once no approximation is left, the partition goes back to exact matching only."""
        approx = self.approx
        if approx is not None and not approx.timers:
            approx.release(self.tree)
            self.approx = None


@dataclass(slots=True)
class Gap:
    worker_id: int
    dp_rank: int
    expected: int
    got: int


class Partitions:
    """Every partition by id, and the owner partition of every instance id."""

    def __init__(self, max_blocks: int = 0) -> None:
        """`max_blocks`: the `PrefixTree` limit of each new partition (0: unlimited)."""
        self.by_id: dict[PartitionId, Partition] = {}
        self._owner: dict[int, Partition] = {}
        self.max_blocks = max_blocks
        self.evicted_in_dropped = 0  # evictions of partitions that have since disappeared

    def existing(self, model_name: str, tenant_id: str) -> Partition:
        partition = self.by_id.get((model_name, tenant_id))
        if partition is None:
            raise NotFound(f"no indexer for model={model_name} tenant_id={tenant_id}")
        return partition

    def get_or_add(self, model_name: str, tenant_id: str, block_size: int) -> Partition:
        """The partition, created with this block size if there is none."""
        partition = self.by_id.get((model_name, tenant_id))
        if partition is None:
            check_block_size(block_size)
            partition = self.by_id[(model_name, tenant_id)] = Partition(
                model_name, tenant_id, block_size, PrefixTree(self.max_blocks))
        elif partition.block_size != block_size:
            raise Conflict(
                f"block_size mismatch for {partition.describe()}: "
                f"existing={partition.block_size}, requested={block_size}"
            )
        return partition

    def matching(self, model_name: str | None, tenant_id: str | None) -> Iterator[Partition]:
        """Sorted by (model_name, tenant_id); None matches any."""
        for pid in sorted(self.by_id):
            if (model_name is None or pid[0] == model_name) and (tenant_id is None or pid[1] == tenant_id):
                yield self.by_id[pid]

    def owner(self, instance_id: int) -> Partition | None:
        return self._owner.get(instance_id)

    def check_owner(self, instance_id: int, pid: PartitionId) -> None:
        """Raise unless the instance is unknown or belongs to partition `pid`."""
        owner = self._owner.get(instance_id)
        if owner is not None and (owner.model_name, owner.tenant_id) != pid:
            raise owned_elsewhere(instance_id, (owner.model_name, owner.tenant_id))

    def add_rank(self, partition: Partition, key: WorkerKey, source: Source) -> Rank:
        """A new rank of `partition` (its instance now owned by it), a worker of its tree."""
        rank = partition.ranks[key] = Rank(source)
        partition.tree.add_worker(key)
        self._owner[key[0]] = partition
        return rank

    def drop_ranks(self, partition: Partition, keys: list[WorkerKey]) -> None:
        """Drop ranks with all their blocks; an instance without ranks left is unowned, a
        partition without ranks left disappears."""
        for key in keys:
            del partition.ranks[key]
            partition.forget_approximations(key)
            partition.tree.drop_worker(key)
        for instance_id in {key[0] for key in keys}:
            if not any(key[0] == instance_id for key in partition.ranks):
                del self._owner[instance_id]
        if not partition.ranks:
            del self.by_id[(partition.model_name, partition.tenant_id)]
            self.evicted_in_dropped += partition.tree.evicted_blocks


def owned_elsewhere(instance_id: int, pid: PartitionId) -> AlreadyRegistered:
    return AlreadyRegistered(f"instance {instance_id} is already registered for model={pid[0]} tenant_id={pid[1]}")


def check_block_size(block_size: int) -> None:
    if block_size == 0:
        raise InvalidArgument("block_size must be greater than 0")


class Watermarks:
    """Per rank, the event id of the last batch applied is its watermark. While a document is
    applied, the events of one engine batch share its id: the first event of a batch decides
    (`open`) whether the batch is new; the events after it with the same id follow it."""

    __slots__ = ("_open", "skipped", "gap_count", "gaps")

    def __init__(self) -> None:
        self._open: dict[WorkerKey, int] = {}  # per rank, the id of the batch being applied
        self.skipped = 0
        self.gap_count = 0
        self.gaps: list[Gap] = []  # the first MAX_LISTED

    def admits(self, key: WorkerKey, rank: Rank, event_id: int) -> bool:
        """False: the event belongs to a batch at or below the rank's watermark, a re-delivery
        (counted as skipped). A jump past watermark + 1 (or a first id other than 0) is applied
        and counted as a gap."""
        if self._open.get(key) == event_id:
            return True
        last = rank.last_event_id
        if last is not None and event_id <= last:
            self.skipped += 1
            self._open.pop(key, None)
            return False
        expected = 0 if last is None else last + 1
        if event_id != expected:
            self.gap_count += 1
            if len(self.gaps) < MAX_LISTED:
                self.gaps.append(Gap(key[0], key[1], expected, event_id))
        rank.last_event_id = event_id
        self._open[key] = event_id
        return True
