"""The device tier's blocks: `Node` (one block at one position) and `Chain` (a run of blocks in
packed arrays), and the helpers that link them.

Device tier: a prefix tree keyed by local block hash
-------------------------------------------------
A node is one block at one position: the path from the root spells the chain of local hashes
that leads to it, so equal content under equal prefixes shares nodes whatever external ids the
engines gave it. Each worker slot owns one bit; a node keeps

* `holders`: the bitmask of slots that hold the node AND every node above it. Masks are
  therefore prefix-closed (a child's mask is a subset of its parent's), so a match walks the
  query once, compares masks, and stops as soon as nobody can extend: O(matched depth).
* `ext`: the external hash of the slot that created the node. A slot that stored the same
  content under a different external hash (inconsistent engine hash seeds) records its own in
  `WorkerSlot.overrides`, so every slot's external ids stay exact (Dynamo 1.6.1 keeps only the
  first writer's: docs/differences.md, "a worker storing known content under other external
  hashes").
* `child`: None, the only child Node (the common case: a chain), or a dict local hash -> Node
  at branch points; `parent`: for pruning.
* `run`: the `Run` this node is in, if a query made one (see `runs`).

Each slot finds its blocks by ITS OWN external hashes (see `names`), which is how stores find
their parent and removals find their block. A `Chain` stands for a stretch of nodes (see
`chains`).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Union, final

import msgspec

from dynamo_lite.hashing import to_unsigned_list

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.runs import Run

# A query converts only the head it compares of a chain longer than this (`Chain.form`).
LONG_CHAIN = 1024

# `Chain.shared`: where the holders find a chain's blocks by name (see `names`).
OWN_NAMES, SHARED_NAMES, COLLIDED_NAMES = 0, 1, 2


@final
class Node(msgspec.Struct, gc=False, eq=False):
    """One block at one position. A msgspec Struct rather than a `__slots__` class: 64 B
    instead of 80 (no cycle-collector header), built in less than half the time, and never
    scanned by the cycle collector, so a full collection does not walk the indexed blocks (1 ms
    at 1M blocks, against 142 ms for tracked nodes). The price: the collector cannot free a cycle of
    nodes, so every path that drops nodes unlinks them both ways (`remove.prune`,
    `eviction.drop_subtree`, and `PrefixTree.__del__` for a tree dropped whole). `eq=False`:
    nodes compare and hash by identity, as dict keys (`dormant`, `overrides`, recency)."""

    local: int
    ext: int
    parent: Piece | None  # None for the root and for a node unlinked from the tree
    holders: int
    child: Any = None  # None | Node | Chain | dict[int, Node | Chain]: one child is the norm
    run: Run | None = None  # the run this node is in, if a query made one


@final
class Chain(msgspec.Struct, gc=False, eq=False):
    """Consecutive blocks of one path stored as packed arrays: what a store past the end of
    the tree makes instead of a `Node` per block (unbounded trees only, see `chains`). Every
    block of a chain has the same holders and the same dormant mask (`dormant[chain]`), every
    holder names them by `exts` (no overrides), and a chain is never in a `Run`, so code that
    only reads `holders`, `child`, `parent`, `run` and `local` treats it as one node. Anything
    that needs one block of it (a removal, a store that diverges inside it) cuts it first
    (`chains.split`, `chains.isolate`)."""

    locals: array[int]  # u64 ('Q'), one per block
    # Every holder's external hash of each block, as int objects: the name maps have them as
    # keys, and a list lets the maps share one object per block (an array would make each map
    # keep a copy).
    exts: list[int]
    parent: Piece | None
    holders: int
    child: Any = None
    run: None = None  # never in a run; here so that code reading `node.run` needs no check
    unsigned: list[int] | None = None  # `locals` as a list, made when a query first needs it
    signed: list[int] | None = None  # the same as i64
    # OWN_NAMES in each holder's own map, SHARED_NAMES in the tree's shared map, COLLIDED_NAMES
    # there too except the names another block took first, which stay in each holder's own map.
    shared: int = 0

    @property
    def local(self) -> int:
        """The first block's local hash: its key among its parent's children."""
        return self.locals[0]

    def __len__(self) -> int:
        return len(self.locals)

    def form(self, signed: bool, count: int) -> list[int]:
        """At least the first `count` local hashes as u64 or as i64. A chain that an engine
        keeps extending grows to millions of blocks while a query compares a prompt's length
        of it: a long chain's form is made of the compared head only, each time, rather than
        of the whole chain again after every extension (milliseconds per query while engines
        published: `/query_by_hash` p50 rose from 0.2 to 2 ms over three 10 s runs)."""
        if count < len(self.locals) > LONG_CHAIN:
            head = self.locals[:count]
            return array("q", head.tobytes()).tolist() if signed else head.tolist()
        if signed:
            form = self.signed
            if form is None:
                form = self.signed = array("q", self.locals.tobytes()).tolist()
        else:
            form = self.unsigned
            if form is None:
                form = self.unsigned = self.locals.tolist()
        return form

    def local_at(self, index: int) -> int:
        return self.locals[index]

    def forget_forms(self) -> None:
        self.unsigned = self.signed = None


# A device block as the tree links it: what `parent`, `child` and the name maps point at.
Piece = Union[Node, Chain]

consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end in C


def u64_array(values: Sequence[int]) -> array[int]:
    """`values` (u64, or i64 read as u64) packed."""
    try:
        return array("Q", values)
    except OverflowError:
        return array("Q", to_unsigned_list(values))


def first_difference(ours: Any, theirs: Any, size: int) -> int:
    """The first index < `size` where two arrays (or two lists) differ, else `size`: slice
    comparisons."""
    if ours[:size] == theirs[:size]:
        return size
    low, high = 0, size - 1
    while low < high:
        middle = (low + high) >> 1
        if ours[low : middle + 1] == theirs[low : middle + 1]:
            low = middle + 1
        else:
            high = middle
    return low


def adopt(parent: Node | Chain, child: Any) -> None:
    """Make `parent` the parent of `child` (None, a node or chain, or a dict of them)."""
    if child is None:
        return
    if child.__class__ is dict:
        for member in child.values():
            member.parent = parent
    else:
        child.parent = parent


def relink(parent: Node | Chain, old: Node | Chain, new: Node | Chain) -> None:
    """Put `new` where `old` was among `parent`'s children (both start with the same block)."""
    siblings = parent.child
    if siblings is old:
        parent.child = new
    else:
        siblings[new.local] = new


def children(node: Piece) -> list[Piece]:
    child = node.child
    if child is None:
        return []
    if child.__class__ is dict:
        return list(child.values())
    return [child]

