"""A worker slot: one (worker_id, dp_rank) of a partition's tree, its bit in every mask and
the maps that name its blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo_lite.indexer.protocols import StorageTier
from dynamo_lite.indexer.tree.names import names_of
from dynamo_lite.indexer.tree.nodes import Node, Piece

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.lower import TransitionKey
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree

WorkerKey = tuple[int, int]  # (worker_id, dp_rank)


class WorkerSlot:
    __slots__ = ("key", "bit", "own", "count", "overrides", "lower", "tree")

    def __init__(self, key: WorkerKey, bit: int, tree: PrefixTree) -> None:
        self.key = key
        self.bit = bit  # one set bit, this slot's place in every mask
        # Own external hash -> device node or chain, for the blocks the slot does not find in the
        # tree's shared map (see `names`): blocks only it has held, names of its own
        # (`overrides`) and names another block took first in the shared map.
        self.own: dict[int, Piece] = {}
        self.count = 0  # device blocks held (below a gap too): len(own) plus those named shared
        self.overrides: dict[Node, int] = {}  # node -> own external hash, where != node.ext
        self.lower: dict[StorageTier, dict[int, TransitionKey]] = {}
        self.tree = tree

    @property
    def blocks(self) -> dict[int, Piece]:
        """Every device block of the slot by its own external hash (held below a gap too): a
        copy made for the asking, O(blocks held)."""
        return names_of(self.tree, self)
