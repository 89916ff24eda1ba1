"""`PrefixTree`: one partition's index, the one class the indexer core uses. It keeps the
state (the device tree, the slots, the name maps, the lower tiers, recency) and its methods
are the operations of the modules beside it: `store`, `remove` (device tier), `lower`,
`matching`, `names`, `eviction` and `dump`. The operations are functions of the tree bound
as methods here, so a call costs what a method defined in the class would."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dynamo_lite.indexer.protocols import DEVICE, LOWER_TIERS, StorageTier
from dynamo_lite.indexer.tree import dump as dumping
from dynamo_lite.indexer.tree import matching, names
from dynamo_lite.indexer.tree.lower import EdgeEntry, TransitionKey, clear_lower, remove_lower, store_lower
from dynamo_lite.indexer.tree.names import NAME_SHARDS
from dynamo_lite.indexer.tree.nodes import Node, Piece
from dynamo_lite.indexer.tree.remove import clear_device, remove_device
from dynamo_lite.indexer.tree.slots import WorkerKey, WorkerSlot
from dynamo_lite.indexer.tree.store import StoreStatus, store_device


class PrefixTree:
    """The index of one partition. Not thread-safe; all methods are synchronous and pure
    (`match` updates runs and, with a limit, recency: both invisible in answers)."""

    def __init__(self, max_blocks: int = 0, *, chains: bool | None = None) -> None:
        """`max_blocks` 0: unlimited; otherwise the limit described in `eviction`.
        `chains`: store new blocks as `Chain`s (default: when unlimited; a limited tree keeps
        recency per block, so it has a node per block)."""
        if chains and max_blocks:
            raise ValueError("chains need an unlimited tree (max_blocks 0)")
        self.root = Node(0, 0, None, 0)  # never matched: matching starts at its children
        self.slots: dict[WorkerKey, WorkerSlot] = {}
        self.dormant: dict[Piece, int] = {}
        # External hash -> the block it names for every slot that has the block and names it
        # so, once a second slot has had it (see `names`).
        self.names: list[dict[int, Piece]] = [{} for _ in range(NAME_SHARDS)]
        self.chains = not max_blocks if chains is None else chains
        self.lower: dict[StorageTier, dict[TransitionKey, EdgeEntry]] = {tier: {} for tier in LOWER_TIERS}
        self.by_bit: dict[int, WorkerSlot] = {}
        # bit -> the slot's own int object for it. A mask left with one holder is replaced by
        # that shared object rather than a fresh int (32+ bytes per node once bits pass 2**8).
        self.canonical: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self.max_blocks = max_blocks
        self.device_blocks = 0  # (slot, block) pairs on the device tier, dormant ones included
        self.evicted_blocks = 0  # pairs (device) and blocks (lower tiers) dropped by the limit
        # Every held or dormant node, least recently used first; None when unlimited.
        self.recent: OrderedDict[Piece, None] | None = OrderedDict() if max_blocks else None
        self.lower_recent: dict[StorageTier, OrderedDict[tuple[int, int], None]] | None = (
            {tier: OrderedDict() for tier in LOWER_TIERS} if max_blocks else None
        )

    def __del__(self) -> None:
        """Unlink every node: nodes are invisible to the cycle collector (see `Node`), so a
        tree dropped whole would otherwise keep its parent <-> child cycles forever."""
        pending: list[Piece] = [self.root]
        while pending:
            node = pending.pop()
            child = node.child
            if child is not None:
                if child.__class__ is dict:
                    pending.extend(child.values())
                else:
                    pending.append(child)
            node.child = node.parent = None
            if node.__class__ is Node:
                node.run = None

    # --- workers ------------------------------------------------------------------------------

    def add_worker(self, worker: WorkerKey) -> None:
        self._slot(worker)

    def drop_worker(self, worker: WorkerKey) -> None:
        """Forget the slot and everything it holds; its bit is reused by later slots."""
        slot = self.slots.get(worker)
        if slot is None:
            return
        self.clear(worker)
        del self.slots[worker]
        del self.by_bit[slot.bit]
        del self.canonical[slot.bit]
        self._free_bits.append(slot.bit)

    def _slot(self, worker: WorkerKey) -> WorkerSlot:
        slot = self.slots.get(worker)
        if slot is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = self._next_bit
                self._next_bit <<= 1
            slot = WorkerSlot(worker, bit, self)
            self.slots[worker] = slot
            self.by_bit[bit] = slot
            self.canonical[bit] = bit
        return slot

    def block_count(self, worker: WorkerKey, tier: StorageTier = DEVICE) -> int:
        slot = self.slots.get(worker)
        if slot is None:
            return 0
        if tier == DEVICE:
            return slot.count
        return len(slot.lower.get(tier, ()))

    # --- events -------------------------------------------------------------------------------

    def store(
        self,
        worker: WorkerKey,
        parent_hash: int | None,
        block_hashes: Sequence[int],
        tokens_hashes: Sequence[int],
        tier: StorageTier = DEVICE,
    ) -> StoreStatus:
        """Store a chain of blocks (external, local hash pairs) under `parent_hash`.

        All or nothing: a rejected event changes nothing. Blocks the slot already holds are
        left as they are (re-delivery and overlapping stores are no-ops; a held block keeps
        the external hash it was first stored with).
        """
        if len(block_hashes) != len(tokens_hashes):
            raise ValueError("block_hashes and tokens_hashes differ in length")
        slot = self.slots.get(worker) or self._slot(worker)
        if len(block_hashes) == 1:
            if block_hashes[0] == parent_hash:
                return StoreStatus.SELF_REFERENCE
        elif len(set(block_hashes)) != len(block_hashes) or (
            parent_hash is not None and parent_hash in block_hashes
        ):
            return StoreStatus.SELF_REFERENCE
        if tier == DEVICE:
            return store_device(self, slot, parent_hash, block_hashes, tokens_hashes)
        return store_lower(self, slot, tier, parent_hash, block_hashes, tokens_hashes)

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int], tier: StorageTier = DEVICE) -> int:
        """Drop the named blocks of this slot only; returns how many it did not hold (skipped)."""
        slot = self.slots.get(worker)
        if slot is None:
            return len(block_hashes)
        if tier == DEVICE:
            return remove_device(self, slot, block_hashes)
        return remove_lower(self, slot, tier, block_hashes)

    def clear(self, worker: WorkerKey) -> None:
        """Drop every block of the slot on every tier (AllBlocksCleared); the slot stays."""
        slot = self.slots.get(worker)
        if slot is None:
            return
        clear_device(self, slot)
        clear_lower(self, slot)

    # --- the operations of the modules beside this one ----------------------------------------

    match = matching.match
    _match_device = matching.match_device  # an attribute of its own: the tests compare it with a plain walk
    holds = names.holds
    counterparts = names.counterparts
    held_hashes = names.held_hashes
    dump = dumping.dump
