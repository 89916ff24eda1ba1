"""One partition's KV index: which (worker, dp_rank) holds which block chains, per tier.

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
* `run`: the `Run` this node is in, if a query made one (see "Runs" below).

Each slot finds its blocks by ITS OWN external hashes (see "Names" below), which is how stores
find their parent and removals find their block.

Names: one entry per block, not per (block, slot)
-------------------------------------------------
A map entry costs ~42 B (the dict's entry and its share of the index table), as much as the
rest of a chained block. Slots mostly name shared blocks alike (the engines hash alike), so a
block has one entry wherever it is: in the slot's own map (`WorkerSlot.own`) while one slot
has had it, and in the tree's shared map (`PrefixTree.names`) from the moment a second slot
has it: that slot's store moves the name there, and every later holder adds nothing. A slot
names a block through the shared map when it has the block (holders or dormant bit) and no
override for it; its own map keeps what the shared map cannot say: blocks only it has had,
its overrides, and names that another block (another slot's content under the same engine
hash) took first in the shared map. Own entries win, so removals and conflicts stay exact per
slot. `WorkerSlot.count` counts the slot's blocks: when it equals `len(own)` the slot names
nothing through the shared map and every lookup is its own map's, as before. Measured with 8
workers sharing half their blocks (1M pairs, 562k distinct): 42.0 -> 26.0 B of maps per pair;
one worker: unchanged.

The shared map is 64 dicts picked by the hash's low bits: a dict that grows to 1M entries
stops everything for 27 ms when it resizes (58 ms at 1.4M), one of 16k-22k for well under
1 ms. The price is a bytecode shard pick per lookup: a slot that shares blocks checks a new
batch's names against the shared map one by one (+4.5 % on decode + apply of the shared fill,
0 when nothing is shared); a batch that takes another slot's shared chain is checked with one
slice comparison.

Removing a block in the middle of a slot's chain
------------------------------------------------
The index follows this coverage model exactly (the tests' node-by-node oracle): a slot's coverage is the
set of chains it stored and did not remove; its score for a query is the largest k such that
every prefix query[0..j], j <= k, is covered. A block below a removed one is still covered
(the engine never said it dropped it) but cannot count until the gap is filled again:

* removing block B clears the slot's bit in B and in every descendant that had it (walking
  only that slot's part of the subtree), and records the descendants in `dormant`
  (node -> mask of slots holding it below a gap);
* re-storing B sets the bit again and promotes the dormant descendants back into `holders`;
* a store whose parent is dormant is accepted and stays dormant, as the model says.

Dynamo 1.6.1 does not (docs/differences.md, "mid-chain removal"): which deeper blocks come back depends on where its
compressed edges happened to be split. Costs: removing a block visits its children, plus the
slot's held subtree below it when that is not empty (zero for tail-first eviction); a
re-store visits the dormant subtree it revives. `dormant` is empty unless an engine evicts
mid-chain, and then costs nothing on the query path.

Chains: a run of blocks in two arrays
-------------------------------------
Engines store blocks in runs (a batch, a request's prompt), and most blocks of an index are
in long stretches that nothing branches from and that the same workers hold. An unlimited tree
(`chains`, the default without `max_blocks`) stores such a stretch as one `Chain`: the local
hashes as a list of the int objects that the name maps use as keys, one holders mask, one
dormant mask. A store past the end of the tree makes a chain (or, when the slot goes on with a
chain only it has had, extends it in place: two extends and one dict update for the whole
batch), and the slot's own map sends every one of the chain's external hashes to the chain
(the shared map, once a second slot takes it). Memory per block: 8 B of local hash, 8 B of
list entry, the external hash's int object and one map entry, against a 64 B node and two int
objects before (`python -m bench.indexer_core`: 102 against 194 B per block, one worker).

Everything else sees a chain as one node: its blocks share holders and dormancy, so walks,
`_promote` and `_demote` treat it whole, and a match compares the query with its hashes a slice
at a time (like a run). What needs one block of it cuts it first: `_split` (a store that covers
only its head, a store that diverges inside it) keeps the head in place and moves the tail to a
new chain, re-pointing the tail's names where they are (the shared map, or each holder's own); `_isolate` gives one block a
`Node` of its own (a removal, a parent in the middle of a chain, a slot that names a block
differently, whose name goes into `overrides`). A tail-first removal cuts one block off the end:
O(1). Chains are not put back together when a branch goes away.

A limited tree keeps a node per block: its recency is per block (see "Bounded size").

Runs: the query's fast path
---------------------------
Walking a 512-block query node by node costs ~50 ns of bytecode per block. A match therefore
leaves `Run`s behind on the paths it walked: a run is a list of consecutive nodes of one path
(through branch points too), with their local hashes as a list (u64 and/or i64, each made when
a query first needs it) and the holders changes along it (`marks`, and the stops a match
records there, which never change while the run stands). A later match that reaches a run's
first node compares the query with the run's hashes in one C-level list comparison, takes the
run's stops, and goes on from its last node; where the query differs inside the run, a binary
search of slice comparisons finds the first difference and the walk continues node by node
from there (into another branch, if there is one). The answer is the node-by-node walk's, stop
for stop, whatever the mix of u64 and i64 forms in the query.

A run is only true while the holders of its nodes stay as they were: every change of a node's
holders first cuts the node's run just above it (`_cut`, which pops the nodes from the end, so
a tail-first removal costs O(1)); new children and pruned side branches do not change a path.
So `node.run is run` exactly when `node in run.nodes`. Runs cost a slot per node, and per node
in a run a list entry per form made (plus an int object for each i64 hash that is negative).

Lower tiers (host_pinned, disk, external)
-----------------------------------------
As in the reference, these are not trees: each block is a transition
(parent external hash | None, local hash) -> child external hash, owned by a mask of slots,
and a store is accepted whatever its parent. A query continues each slot from where its
device match stopped (or from the root when it has none) through host_pinned, then disk,
then external, following the slot's own external hashes. If two slots name the same
transition differently, both names are kept (`Edge` variants) and each slot follows its own.

Bounded size (`max_blocks`)
---------------------------
With a limit, the tree keeps at most `max_blocks` device (slot, block) pairs and at most
`max_blocks` blocks on each lower tier. Device recency is per node, in an OrderedDict (C-level
O(1) moves): a store touches the nodes it walked, deepest first, then its parent; a match
touches the path of the deepest match, deepest first, so a prefix is always more recent than
the blocks below it that queries reached through it. Past the limit the least recent node goes
with its whole subtree, for every slot holding it: blocks below it can only match through it,
and dropping them leaves no dormant garbage. To a slot this is exactly a `removed` event for
those blocks, so a later removal of an evicted block is just an unknown removal. Lower-tier
blocks are dropped oldest store first (queries do not touch them).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import Any, Union

import msgspec

from dynamo_lite.hashing import to_unsigned_list
from dynamo_lite.indexer.protocols import (
    DEVICE,
    LOWER_TIERS,
    RouterEvent,
    StorageTier,
    Stored,
)
from dynamo_lite.integers import I64_MAX, U64_MODULUS

WorkerKey = tuple[int, int]  # (worker_id, dp_rank)
TransitionKey = tuple[int | None, int]  # (parent external hash | None, local hash)


class Node(msgspec.Struct, gc=False, eq=False):
    """One block at one position. A msgspec Struct rather than a `__slots__` class: 64 B
    instead of 80 (no cycle-collector header), built in less than half the time, and never
    scanned by the cycle collector, so a full collection does not walk the indexed blocks (1 ms
    at 1M blocks, against 142 ms for tracked nodes). The price: the collector cannot free a cycle of
    nodes, so every path that drops nodes unlinks them both ways (`_prune`, `_drop_subtree`,
    and `PrefixTree.__del__` for a tree dropped whole). `eq=False`: nodes compare and hash by
    identity, as dict keys (`dormant`, `overrides`, recency)."""

    local: int
    ext: int
    parent: Node | None
    holders: int
    child: Any = None  # None | Node | dict[int, Node]: one child is the norm
    run: Run | None = None  # the run this node is in, if a query made one


class Chain(msgspec.Struct, gc=False, eq=False):
    """Consecutive blocks of one path stored as packed arrays: what a store past the end of
    the tree makes instead of a `Node` per block (unbounded trees only, see "Chains" in the
    module notes). Every block of a chain has the same holders and the same dormant mask
    (`dormant[chain]`), every holder names them by `exts` (no overrides), and a chain is
    never in a `Run`, so code that only reads `holders`, `child`, `parent`, `run` and `local`
    treats it as one node. Anything that needs one block of it (a removal, a store that
    diverges inside it) cuts it first (`PrefixTree._split`, `PrefixTree._isolate`)."""

    locals: array  # u64 ('Q'), one per block
    # Every holder's external hash of each block, as int objects: the name maps have them as
    # keys, and a list lets the maps share one object per block (an array would make each map
    # keep a copy).
    exts: list[int]
    parent: Any
    holders: int
    child: Any = None
    run: None = None  # never in a run; here so that code reading `node.run` needs no check
    unsigned: list[int] | None = None  # `locals` as a list, made when a query first needs it
    signed: list[int] | None = None  # the same as i64
    # Where the holders find the blocks by name (see "Names" in the module notes): OWN_NAMES in
    # each holder's own map, SHARED_NAMES in the tree's shared map, COLLIDED_NAMES there too
    # except the names another block took first, which stay in each holder's own map.
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


# Queries make runs of at least this many nodes (shorter stretches are walked node by node).
MIN_RUN = 8
# A query converts only the head it compares of a chain longer than this (`Chain.form`).
LONG_CHAIN = 1024

# `Chain.shared`
OWN_NAMES, SHARED_NAMES, COLLIDED_NAMES = 0, 1, 2
# The shared map is this many dicts, picked by an external hash's low bits: one dict of 1M
# entries stops everything for 27 ms when it grows (58 ms at 1.4M), one of 16k-31k for ~1 ms.
NAME_SHARDS = 64
_SHARD = NAME_SHARDS - 1

Stop = tuple[int, int, "Node"]  # (slots that stop here, depth, last node they hold)


class Run:
    """A path of nodes that a match walked: a later match that reaches its first node compares
    the query against the run's local hashes in one C-level list comparison instead of node by
    node, and takes the holders changes along it from `stops`.

    Holders changes cut the run just above the node (`_cut`), so `node.run is run` exactly
    when `node in run.nodes`, and `stops` stays true. New children (branches) and lost ones
    leave the path as it is, and so the run."""

    __slots__ = ("nodes", "start", "marks", "stops", "unsigned", "signed")

    def __init__(self, nodes: list[Node], start: int, marks: list[int], stops: list[Stop]) -> None:
        self.nodes = nodes
        self.start = start  # the query position of the first node (its depth in the tree - 1)
        # Indexes i >= 1 of the nodes whose holders differ from node i - 1's, and the stop a
        # match records there: (the slots that do not go on, the node's depth, node i - 1).
        self.marks = marks
        self.stops = stops
        self.unsigned: list[int] | None = None  # the nodes' local hashes, built on first use
        self.signed: list[int] | None = None  # the same as i64, built on first use
        for node in nodes:
            node.run = self

    def __len__(self) -> int:
        return len(self.nodes)

    def local_at(self, index: int) -> int:
        return self.nodes[index].local

    def form(self, signed: bool, count: int) -> list[int]:
        """The nodes' local hashes as u64 or as i64 (all of them, whatever `count`): each form
        is made when a query first needs it (a service answering `/query_by_hash` alone never
        makes the u64 one)."""
        if signed:
            form = self.signed
            if form is None:
                form = self.signed = _signed_form(self.nodes)
        else:
            form = self.unsigned
            if form is None:
                form = self.unsigned = list(map(_local_of, self.nodes))
        return form

    def extend(self, nodes: list[Node], marks: list[int], stops: list[Stop]) -> None:
        offset = len(self.nodes)
        self.nodes.extend(nodes)
        for node in nodes:
            node.run = self
        if marks:
            self.marks.extend([mark + offset for mark in marks])
            self.stops.extend(stops)
        if self.unsigned is not None:
            self.unsigned.extend(map(_local_of, nodes))
        if self.signed is not None:
            self.signed.extend(_signed_form(nodes))


_local_of = attrgetter("local")


def _signed_form(nodes: list[Node]) -> list[int]:
    return [value - U64_MODULUS if value > I64_MAX else value for value in map(_local_of, nodes)]


def _cut(node: Node) -> None:
    """`node`'s holders are about to change: end its run just above it."""
    run = node.run
    assert run is not None
    nodes = run.nodes
    while True:
        last = nodes.pop()
        last.run = None
        if last is node:
            break
    kept = len(nodes)
    marks = run.marks
    while marks and marks[-1] >= kept:
        marks.pop()
        run.stops.pop()
    if run.unsigned is not None:
        del run.unsigned[kept:]
    if run.signed is not None:
        del run.signed[kept:]


def _settle_run(pending: list[Node], end: int, marks: list[int], stops: list[Stop], extend: Run | None) -> None:
    """Nodes a match walked one by one, up to query position `end`: a run of their own, or
    the continuation of `extend`, the run walked whole just before them."""
    if extend is not None:
        extend.extend(pending, marks, stops)
    elif len(pending) >= MIN_RUN:
        Run(pending, end - len(pending), marks, stops)


_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end in C


def _common(query: list[int], start: int, end: int, run: Run | Chain, signed: bool) -> tuple[int, bool]:
    """How many of the run's (or chain's) blocks `query[start:end]` matches (at least its
    first, which the caller matched), and whether the query was last seen in i64 form.
    Compares whole slices; a hash may be u64 or i64, even mixed within one query."""
    size = len(run)
    count = end - start
    if count > size:
        count = size
    position = 0
    while True:
        form = run.form(signed, count)
        if position == 0 and count == size:
            if query[start : start + size] == form:
                return count, signed
        elif query[start + position : start + count] == form[position:count]:
            return count, signed
        # Binary search for the first literal difference at or after `position`.
        low, high = position, count - 1
        while low < high:
            middle = (low + high) >> 1
            if query[start + low : start + middle + 1] == form[low : middle + 1]:
                low = middle + 1
            else:
                high = middle
        value = query[start + low]
        if value < 0:
            value += U64_MODULUS
        if value != run.local_at(low):
            return low, signed
        signed = not signed  # the same hash in the other form: carry on in that form
        position = low + 1
        if position == count:
            return count, signed


class Edge:
    """A lower-tier transition: the child's external hash and the slots holding it."""

    __slots__ = ("child", "owners")

    def __init__(self, child: int, owners: int) -> None:
        self.child = child
        self.owners = owners


EdgeEntry = Union[Edge, list[Edge]]  # a list only when slots disagree on the child's hash


class WorkerSlot:
    __slots__ = ("key", "bit", "own", "count", "overrides", "lower", "tree")

    def __init__(self, key: WorkerKey, bit: int, tree: PrefixTree) -> None:
        self.key = key
        self.bit = bit  # one set bit, this slot's place in every mask
        # Own external hash -> device node or chain, for the blocks the slot does not find in the
        # tree's shared map (see "Names" in the module notes): blocks only it has held, names
        # of its own (`overrides`) and names another block took first in the shared map.
        self.own: dict[int, Node | Chain] = {}
        self.count = 0  # device blocks held (below a gap too): len(own) plus those named shared
        self.overrides: dict[Node, int] = {}  # node -> own external hash, where != node.ext
        self.lower: dict[StorageTier, dict[int, TransitionKey]] = {}
        self.tree = tree

    @property
    def blocks(self) -> dict[int, Node | Chain]:
        """Every device block of the slot by its own external hash (held below a gap too): a
        copy made for the asking, O(blocks held)."""
        return self.tree._names_of(self)


class StoreStatus(Enum):
    STORED = "stored"
    UNKNOWN_PARENT = "unknown_parent"  # parent is not a device block of this slot
    SELF_REFERENCE = "self_reference"  # a block_hash repeats in the event or equals the parent
    HASH_CONFLICT = "hash_conflict"  # a block_hash already names another block of this slot


@dataclass(slots=True)
class MatchResult:
    """Per slot, in blocks, zero entries left out: `device` is the leading run of query blocks
    held on the device tier; `host_pinned` the blocks the host tier adds after it; `disk` the
    blocks the disk and external tiers add after that."""

    device: dict[WorkerKey, int] = field(default_factory=dict)
    host_pinned: dict[WorkerKey, int] = field(default_factory=dict)
    disk: dict[WorkerKey, int] = field(default_factory=dict)


class PrefixTree:
    """The index of one partition. Not thread-safe; all methods are synchronous and pure
    (`match` updates runs and, with a limit, recency: both invisible in answers)."""

    def __init__(self, max_blocks: int = 0, *, chains: bool | None = None) -> None:
        """`max_blocks` 0: unlimited; otherwise the limit described in the module notes.
        `chains`: store new blocks as `Chain`s (default: when unlimited; a limited tree keeps
        recency per block, so it has a node per block)."""
        if chains and max_blocks:
            raise ValueError("chains need an unlimited tree (max_blocks 0)")
        self.root = Node(0, 0, None, 0)  # never matched: matching starts at its children
        self.slots: dict[WorkerKey, WorkerSlot] = {}
        self.dormant: dict[Node | Chain, int] = {}
        # External hash -> the block it names for every slot that has the block and names it
        # so, once a second slot has had it (see "Names" in the module notes).
        self.names: list[dict[int, Node | Chain]] = [{} for _ in range(NAME_SHARDS)]
        self.chains = not max_blocks if chains is None else chains
        self.lower: dict[StorageTier, dict[TransitionKey, EdgeEntry]] = {tier: {} for tier in LOWER_TIERS}
        self._by_bit: dict[int, WorkerSlot] = {}
        # bit -> the slot's own int object for it. A mask left with one holder is replaced by
        # that shared object rather than a fresh int (32+ bytes per node once bits pass 2**8).
        self._canonical: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self.max_blocks = max_blocks
        self.device_blocks = 0  # (slot, block) pairs on the device tier, dormant ones included
        self.evicted_blocks = 0  # pairs (device) and blocks (lower tiers) dropped by the limit
        # Every held or dormant node, least recently used first; None when unlimited.
        self._recent: OrderedDict[Node, None] | None = OrderedDict() if max_blocks else None
        self._lower_recent: dict[StorageTier, OrderedDict[tuple[int, int], None]] | None = (
            {tier: OrderedDict() for tier in LOWER_TIERS} if max_blocks else None
        )

    def __del__(self) -> None:
        """Unlink every node: nodes are invisible to the cycle collector (see `Node`), so a
        tree dropped whole would otherwise keep its parent <-> child cycles forever."""
        pending = [self.root]
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
        del self._by_bit[slot.bit]
        del self._canonical[slot.bit]
        self._free_bits.append(slot.bit)

    def block_count(self, worker: WorkerKey, tier: StorageTier = DEVICE) -> int:
        slot = self.slots.get(worker)
        if slot is None:
            return 0
        if tier == DEVICE:
            return slot.count
        return len(slot.lower.get(tier, ()))

    def held_hashes(self, worker: WorkerKey) -> list[int]:
        """The slot's own external hashes of every device block it holds (below a gap too)."""
        slot = self.slots.get(worker)
        return [] if slot is None else list(self._names_of(slot))

    def holds(self, worker: WorkerKey, block_hashes: Sequence[int]) -> tuple[int, int]:
        """How many leading `block_hashes` name device blocks the slot holds, and how many
        of them all do (below a gap too). Two C-level passes, and a lookup in the shared map
        per hash not in the slot's own map once it shares blocks."""
        slot = self.slots.get(worker)
        if slot is None:
            return 0, 0
        flags = list(map(slot.own.__contains__, block_hashes))
        if slot.count != len(slot.own):
            find = self._find_shared
            flags = [flag or find(slot, ext) is not None for flag, ext in zip(flags, block_hashes)]
        held = sum(flags)
        return (len(flags) if held == len(flags) else flags.index(False)), held

    def counterparts(self, worker: WorkerKey, block_hashes: Sequence[int], other: WorkerKey) -> list[int]:
        """`other`'s own external hashes of the device blocks that `worker` names
        `block_hashes`, for the blocks both hold: one dict lookup or two per hash."""
        slot = self.slots.get(worker)
        counterpart = self.slots.get(other)
        if slot is None or counterpart is None:
            return []
        find = self._find
        overrides = counterpart.overrides
        found = []
        for ext in block_hashes:
            node = find(slot, ext)
            if node is None:
                continue
            if node.__class__ is Chain:
                own = ext  # a chain's holders all name its blocks alike
            else:
                own = overrides.get(node, node.ext) if overrides else node.ext
            if find(counterpart, own) is node:
                found.append(own)
        return found

    # --- names --------------------------------------------------------------------------------

    def _find(self, slot: WorkerSlot, ext: int) -> Node | Chain | None:
        """The device block (node or chain) the slot names `ext`, if any."""
        piece = slot.own.get(ext)
        if piece is None:
            return self._find_shared(slot, ext)
        return piece

    def _find_shared(self, slot: WorkerSlot, ext: int) -> Node | Chain | None:
        """The block the slot names `ext` through the shared map, if any (not in its own map)."""
        if slot.count == len(slot.own):
            return None  # it names every block it has in its own map
        piece = self.names[ext & _SHARD].get(ext)
        if piece is None or not self._named_by(slot, piece):
            return None
        return piece

    def _named_by(self, slot: WorkerSlot, piece: Node | Chain) -> bool:
        """Whether the slot has `piece` (below a gap too) under its shared names."""
        bit = slot.bit
        if not piece.holders & bit and not (self.dormant and self.dormant.get(piece, 0) & bit):
            return False
        return not (slot.overrides and piece in slot.overrides)

    def _uses_shared(self, slot: WorkerSlot, names: Sequence[int]) -> bool:
        """Whether the slot names a block by any of `names` through the shared map."""
        if slot.count == len(slot.own):
            return False
        shards = self.names
        mask = _SHARD
        size = len(names)
        index = 0
        while index < size:
            ext = names[index]
            index += 1
            if ext not in shards[ext & mask]:
                continue
            piece = shards[ext & mask][ext]
            if self._named_by(slot, piece):
                return True
            if piece.__class__ is Chain and piece.shared == SHARED_NAMES:
                # Another slot's shared chain, which a store usually takes whole (a prompt's
                # prefix): the shared map sends every name of it to it, so the names that go
                # on as the chain does are not the slot's either. One slice comparison for them.
                exts = piece.exts
                start = exts.index(ext) + 1
                count = min(size - index, len(exts) - start)
                index += _first_difference(names[index : index + count], exts[start : start + count], count)
        return False

    def _pieces_of(self, slot: WorkerSlot) -> list[Any]:
        """Every node and chain the slot has (below a gap too), each once."""
        if slot.count == len(slot.own):
            return list(dict.fromkeys(slot.own.values()))
        # Masks are prefix-closed: the slot's held blocks are a subtree from the root.
        bit = slot.bit
        pieces: list[Any] = []
        stack: list[Any] = [self.root]
        while stack:
            child = stack.pop().child
            if child is None:
                continue
            for candidate in child.values() if child.__class__ is dict else (child,):
                if candidate.holders & bit:
                    pieces.append(candidate)
                    stack.append(candidate)
        if self.dormant:
            pieces.extend(piece for piece, mask in self.dormant.items() if mask & bit)
        return pieces

    def _names_of(self, slot: WorkerSlot) -> dict[int, Node | Chain]:
        """The slot's own external hash of each of its device blocks -> node or chain."""
        if slot.count == len(slot.own):
            return dict(slot.own)
        overrides = slot.overrides
        names: dict[int, Node | Chain] = {}
        for piece in self._pieces_of(slot):
            if piece.__class__ is Chain:
                names.update(zip(piece.exts, repeat(piece)))
            else:
                names[overrides.get(piece, piece.ext) if overrides else piece.ext] = piece
        return names

    def _take_node(self, slot: WorkerSlot, node: Node, ext: int, others: int) -> None:
        """The slot now has `node` (not before) under `ext`; `others`: the slots that had it."""
        slot.count += 1
        if node.ext != ext:
            slot.overrides[node] = ext
            slot.own[ext] = node
            return
        shard = self.names[ext & _SHARD]
        if shard.get(ext) is node:
            return
        if others and shard.setdefault(ext, node) is node:
            # The second slot to have the block: its name moves to the shared map.
            by_bit = self._by_bit
            while others:
                low = others & -others
                own = by_bit[low].own
                if own.get(ext) is node:
                    del own[ext]
                others ^= low
            return
        slot.own[ext] = node

    def _share_chain(self, chain: Chain, others: int) -> None:
        """A second slot takes `chain`: its names move from the own maps of the slots that had
        it (`others`) to the shared map, but for names another block has there already."""
        shards = self.names
        collided = False
        for ext in chain.exts:
            if shards[ext & _SHARD].setdefault(ext, chain) is not chain:
                collided = True
        by_bit = self._by_bit
        while others:
            low = others & -others
            own = by_bit[low].own
            if collided:
                for ext in chain.exts:
                    if shards[ext & _SHARD].get(ext) is chain:
                        del own[ext]
            else:
                _consume(map(own.__delitem__, chain.exts))
            others ^= low
        chain.shared = COLLIDED_NAMES if collided else SHARED_NAMES

    def _forget_names(self, piece: Node | Chain) -> None:
        """`piece` leaves the tree: its names leave the shared map."""
        shards = self.names
        if piece.__class__ is Chain:
            if piece.shared:
                for ext in piece.exts:
                    shard = shards[ext & _SHARD]
                    if shard.get(ext) is piece:
                        del shard[ext]
            return
        ext = piece.ext
        shard = shards[ext & _SHARD]
        if shard.get(ext) is piece:
            del shard[ext]

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
            self._by_bit[bit] = slot
            self._canonical[bit] = bit
        return slot

    # --- store --------------------------------------------------------------------------------

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
            return self._store_device(slot, parent_hash, block_hashes, tokens_hashes)
        return self._store_lower(slot, tier, parent_hash, block_hashes, tokens_hashes)

    def _store_device(
        self, slot: WorkerSlot, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]
    ) -> StoreStatus:
        blocks = slot.own
        held_before = slot.count
        bit = slot.bit
        dormant = self.dormant
        if parent_hash is None:
            start = self.root
            active = True
        else:
            found = blocks.get(parent_hash)
            if found is None:
                found = self._find_shared(slot, parent_hash)
            if found is None:
                return StoreStatus.UNKNOWN_PARENT
            if found.__class__ is Chain:
                if (
                    found.child is None
                    and found.holders == bit
                    and not found.shared
                    and found.exts[-1] == parent_hash
                    and not (dormant and found in dormant)
                    and blocks.keys().isdisjoint(block_hashes)
                    and not self._uses_shared(slot, block_hashes)
                ):
                    # The slot goes on with a chain of its own (the next batch of a prompt, a
                    # decode step): the common case is two array extends and one dict update.
                    _extend_chain(found, block_hashes, tokens_hashes)
                    blocks.update(zip(block_hashes, repeat(found)))
                    slot.count += len(block_hashes)
                    self.device_blocks += len(block_hashes)
                    return StoreStatus.STORED
                found = self._isolate(found, found.exts.index(parent_hash))
            start = found
            active = bool(start.holders & bit)
        if (not blocks.keys().isdisjoint(block_hashes) or self._uses_shared(slot, block_hashes)) and not _consistent(
            partial(self._find, slot), start, block_hashes, tokens_hashes
        ):
            return StoreStatus.HASH_CONFLICT
        node = start
        count = len(block_hashes)
        index = 0
        while index < count:
            ext = block_hashes[index]
            local = tokens_hashes[index]
            child = node.child
            if child is None:
                if active:
                    # Past the end of the tree: the rest of the chain is new blocks held by this
                    # slot alone (the common case of a prefill or a decode step), no checks needed.
                    if self.chains:
                        exts = block_hashes[index:]
                        if (
                            node.__class__ is Chain
                            and node.holders == bit
                            and not node.shared
                            and not (dormant and node in dormant)
                        ):
                            _extend_chain(node, exts, tokens_hashes[index:])
                        else:
                            node.child = node = Chain(
                                _u64_array(tokens_hashes[index:]),
                                exts if exts.__class__ is list else list(exts),
                                node,
                                bit,
                            )
                        blocks.update(zip(exts, repeat(node)))
                        slot.count += len(exts)
                        break
                    child = node.child = blocks[ext] = Node(local, ext, node, bit)
                    for ext, local in zip(block_hashes[index + 1 :], tokens_hashes[index + 1 :]):
                        child.child = child = blocks[ext] = Node(local, ext, child, bit)
                    slot.count += count - index
                    node = child
                    break
                child = node.child = Node(local, ext, node, 0)
            elif child.__class__ is Node:
                if child.local != local:
                    new = Node(local, ext, node, 0)
                    node.child = {child.local: child, local: new}
                    child = new
            elif child.__class__ is Chain:
                if child.locals[0] != local:
                    new = Node(local, ext, node, 0)
                    node.child = {child.local: child, local: new}
                    child = new
            else:
                found_child = child.get(local)
                if found_child is None:
                    found_child = child[local] = Node(local, ext, node, 0)
                child = found_child
            if child.__class__ is Chain:
                matched = _chain_prefix(child, block_hashes, tokens_hashes, index)
                if matched:
                    # The store covers the chain's first `matched` blocks, which all stand alike
                    # for this slot: take them as one.
                    if matched < len(child):
                        self._split(child, matched)
                    self._take_chain(slot, child, active)
                    node = child
                    index += matched
                    continue
                # The slot names the chain's first block otherwise (an override): node by node.
                child = self._isolate(child, 0)
            node = child
            index += 1
            holders = node.holders
            if holders & bit:
                continue
            below = dormant.get(node, 0) if dormant else 0
            if below & bit:
                continue
            if active:
                if node.run is not None:
                    _cut(node)
                node.holders = bit if not holders else holders | bit
                if dormant and node.child is not None:
                    self._promote(node, bit)
            else:
                dormant[node] = below | bit
            self._take_node(slot, node, ext, holders | below)
        self.device_blocks += slot.count - held_before
        recent = self._recent
        if recent is not None:
            while node is not start:
                recent[node] = None
                recent.move_to_end(node)
                node = node.parent
            if start is not self.root:
                recent.move_to_end(start)
            if self.device_blocks > self.max_blocks:
                self._evict_device()
        return StoreStatus.STORED

    def _take_chain(self, slot: WorkerSlot, chain: Chain, active: bool) -> None:
        """The slot stores every block of `chain` (which it names as `chain.exts` does)."""
        bit = slot.bit
        holders = chain.holders
        if holders & bit:
            return
        dormant = self.dormant
        below = dormant.get(chain, 0) if dormant else 0
        if below & bit:
            return
        if active:
            chain.holders = bit if not holders else holders | bit
            if dormant and chain.child is not None:
                self._promote(chain, bit)
        else:
            dormant[chain] = below | bit
        slot.count += len(chain)
        if not chain.shared and (holders | below):
            self._share_chain(chain, holders | below)
        mode = chain.shared
        if mode == OWN_NAMES:
            slot.own.update(zip(chain.exts, repeat(chain)))
        elif mode == COLLIDED_NAMES:
            own = slot.own
            shards = self.names
            for ext in chain.exts:
                if shards[ext & _SHARD].get(ext) is not chain:
                    own[ext] = chain

    def _split(self, chain: Chain, size: int) -> Chain:
        """Cut `chain` after its first `size` blocks (0 < size < len): it keeps them, and the
        rest becomes a new chain below it, returned. Costs a dict update per block moved and
        holder, so cutting near the end is cheap (tail-first removals)."""
        tail = Chain(chain.locals[size:], chain.exts[size:], chain, chain.holders, chain.child, shared=chain.shared)
        _adopt(tail, chain.child)
        del chain.locals[size:]
        del chain.exts[size:]
        chain.child = tail
        chain.forget_forms()
        self._hand_over(chain, tail, keep=True)
        return tail

    def _isolate(self, chain: Chain, index: int) -> Node:
        """Replace block `index` of `chain` by a `Node` of its own (the chain's blocks before
        and after it stay chains), for code that works on one block; returns the node. The
        first or the last block costs O(1) map updates; one inside, those of the blocks after
        it."""
        size = len(chain)
        if size > 1:
            if index == size - 1:
                node = Node(chain.locals.pop(), chain.exts.pop(), chain, chain.holders, chain.child)
                _adopt(node, chain.child)
                chain.child = node
                chain.forget_forms()
                self._hand_over(chain, node, keep=True)
                return node
            if index == 0:
                node = Node(chain.locals[0], chain.exts[0], chain.parent, chain.holders, chain)
                _relink(chain.parent, chain, node)
                chain.parent = node
                del chain.locals[0]
                del chain.exts[0]
                chain.forget_forms()
                self._hand_over(chain, node, keep=True)
                return node
            self._split(chain, index + 1)
            return self._isolate(chain, index)
        node = Node(chain.locals[0], chain.exts[0], chain.parent, chain.holders, chain.child)
        _adopt(node, chain.child)
        _relink(chain.parent, chain, node)
        self._hand_over(chain, node, keep=False)
        chain.parent = chain.child = None
        return node

    def _hand_over(self, chain: Chain, piece: Node | Chain, *, keep: bool) -> None:
        """`piece` now has blocks of `chain`: it takes the chain's dormant mask (the chain keeps
        it too when `keep`), and every slot holding them finds them in it."""
        mask = piece.holders
        if self.dormant:
            below_gap = self.dormant.get(chain, 0) if keep else self.dormant.pop(chain, 0)
            if below_gap:
                self.dormant[piece] = below_gap
                mask |= below_gap
        self._repoint(chain, piece, mask)

    def _repoint(self, chain: Chain, piece: Node | Chain, mask: int) -> None:
        """Make the slots of `mask` find `piece`'s blocks, which were `chain`'s, where they
        found them in `chain` (they name them alike: chains have no overrides)."""
        by_bit = self._by_bit
        shards = self.names
        mode = chain.shared
        if piece.__class__ is Chain:
            names = piece.exts
            if mode != OWN_NAMES:
                for ext in names:
                    shard = shards[ext & _SHARD]
                    if mode == SHARED_NAMES or shard.get(ext) is chain:
                        shard[ext] = piece
                if mode == SHARED_NAMES:
                    return
            while mask:
                low = mask & -mask
                own = by_bit[low].own
                if mode == OWN_NAMES:
                    own.update(zip(names, repeat(piece)))
                else:
                    for ext in names:
                        if own.get(ext) is chain:
                            own[ext] = piece
                mask ^= low
            return
        ext = piece.ext
        shard = shards[ext & _SHARD]
        if mode != OWN_NAMES and shard.get(ext) is chain:
            shard[ext] = piece
            return
        while mask:
            low = mask & -mask
            by_bit[low].own[ext] = piece
            mask ^= low

    def _store_lower(
        self,
        slot: WorkerSlot,
        tier: StorageTier,
        parent_hash: int | None,
        block_hashes: Sequence[int],
        tokens_hashes: Sequence[int],
    ) -> StoreStatus:
        edges = self.lower[tier]
        known = slot.lower.get(tier)
        if known is None:
            known = slot.lower[tier] = {}
        if not known.keys().isdisjoint(block_hashes):
            parent = parent_hash
            for ext, local in zip(block_hashes, tokens_hashes):
                previous = known.get(ext)
                if previous is not None and previous != (parent, local):
                    return StoreStatus.HASH_CONFLICT
                parent = ext
        bit = slot.bit
        recent = self._lower_recent[tier] if self._lower_recent is not None else None
        parent = parent_hash
        for ext, local in zip(block_hashes, tokens_hashes):
            key = (parent, local)
            parent = ext
            if ext in known:
                if recent is not None:
                    recent.move_to_end((bit, ext))
                continue
            entry = edges.get(key)
            if entry is None:
                edges[key] = Edge(ext, bit)
            elif entry.__class__ is Edge:
                if entry.owners & bit:
                    continue  # already held under another name: keep the first, as on device
                if entry.child == ext:
                    entry.owners |= bit
                else:
                    edges[key] = [entry, Edge(ext, bit)]
            else:
                variants: list[Edge] = entry
                if any(variant.owners & bit for variant in variants):
                    continue
                for variant in variants:
                    if variant.child == ext:
                        variant.owners |= bit
                        break
                else:
                    variants.append(Edge(ext, bit))
            known[ext] = key
            if recent is not None:
                recent[(bit, ext)] = None
        if recent is not None and len(recent) > self.max_blocks:
            self._evict_lower(tier, recent)
        return StoreStatus.STORED

    def _promote(self, node: Node, bit: int) -> None:
        """`node` just became held for `bit` from the root: revive its dormant descendants."""
        dormant = self.dormant
        stack = [node]
        while stack:
            child = stack.pop().child
            if child is None:
                continue
            for candidate in child.values() if child.__class__ is dict else (child,):
                mask = dormant.get(candidate, 0)
                if mask & bit:
                    mask ^= bit
                    if mask:
                        dormant[candidate] = mask
                    else:
                        del dormant[candidate]
                    holders = candidate.holders
                    if candidate.run is not None:
                        _cut(candidate)
                    candidate.holders = bit if not holders else holders | bit
                    stack.append(candidate)

    # --- remove / clear -----------------------------------------------------------------------

    def remove(self, worker: WorkerKey, block_hashes: Sequence[int], tier: StorageTier = DEVICE) -> int:
        """Drop the named blocks of this slot only; returns how many it did not hold (skipped)."""
        slot = self.slots.get(worker)
        if slot is None:
            return len(block_hashes)
        if tier == DEVICE:
            return self._remove_device(slot, block_hashes)
        return self._remove_lower(slot, tier, block_hashes)

    def _remove_device(self, slot: WorkerSlot, block_hashes: Sequence[int]) -> int:
        blocks = slot.own
        overrides = slot.overrides
        dormant = self.dormant
        canonical = self._canonical
        recent = self._recent
        bit = slot.bit
        unknown = 0
        for ext in block_hashes:
            node = blocks.get(ext)
            private = node is not None
            if not private:
                node = self._find_shared(slot, ext)
                if node is None:
                    unknown += 1
                    continue
            slot.count -= 1
            if node.__class__ is Chain:
                if (
                    node.holders == bit
                    and node.child is None
                    and node.exts[-1] == ext
                    and len(node) > 1
                    and not (dormant and node in dormant)
                ):
                    # The last block of a chain only this slot holds (tail-first eviction):
                    # the chain just gets shorter.
                    node.locals.pop()
                    node.exts.pop()
                    node.forget_forms()
                    if private:
                        del blocks[ext]
                    else:
                        del self.names[ext & _SHARD][ext]
                    continue
                node = self._isolate(node, node.exts.index(ext))
            if private:
                del blocks[ext]
            if overrides:
                overrides.pop(node, None)
            holders = node.holders
            if holders & bit:
                if node.run is not None:
                    _cut(node)
                holders ^= bit
                node.holders = canonical.get(holders, holders)
                if node.child is not None:
                    self._demote(node, bit)
            else:
                mask = dormant[node] ^ bit
                if mask:
                    dormant[node] = mask
                else:
                    del dormant[node]
            if not node.holders and node not in dormant:
                if recent is not None:
                    del recent[node]
                if node.child is None:
                    self._prune(node)
        self.device_blocks -= len(block_hashes) - unknown
        return unknown

    def _demote(self, node: Node, bit: int) -> None:
        """`bit` lost `node`: its descendants held by `bit` stay held, but below a gap."""
        dormant = self.dormant
        canonical = self._canonical
        stack = [node]
        while stack:
            child = stack.pop().child
            if child is None:
                continue
            for candidate in child.values() if child.__class__ is dict else (child,):
                holders = candidate.holders
                if holders & bit:
                    if candidate.run is not None:
                        _cut(candidate)
                    holders ^= bit
                    candidate.holders = canonical.get(holders, holders)
                    dormant[candidate] = dormant.get(candidate, 0) | bit
                    stack.append(candidate)

    def _prune(self, node: Node) -> None:
        """Unlink a node nobody holds and that has no children, then its emptied ancestors."""
        root = self.root
        dormant = self.dormant
        while True:
            parent = node.parent
            assert parent is not None
            siblings = parent.child
            if siblings is node:
                parent.child = None
            else:
                del siblings[node.local]
                if len(siblings) == 1:
                    (parent.child,) = siblings.values()
            node.parent = None
            self._forget_names(node)
            if parent is root or parent.holders or parent.child is not None or parent in dormant:
                return
            node = parent

    def _remove_lower(self, slot: WorkerSlot, tier: StorageTier, block_hashes: Sequence[int]) -> int:
        known = slot.lower.get(tier)
        if not known:
            return len(block_hashes)
        edges = self.lower[tier]
        recent = self._lower_recent[tier] if self._lower_recent is not None else None
        unknown = 0
        for ext in block_hashes:
            key = known.pop(ext, None)
            if key is None:
                unknown += 1
                continue
            _release_edge(edges, key, ext, slot.bit)
            if recent is not None:
                del recent[(slot.bit, ext)]
        return unknown

    def clear(self, worker: WorkerKey) -> None:
        """Drop every block of the slot on every tier (AllBlocksCleared); the slot stays."""
        slot = self.slots.get(worker)
        if slot is None:
            return
        bit = slot.bit
        canonical = self._canonical
        dormant = self.dormant
        nodes = self._pieces_of(slot)
        self.device_blocks -= slot.count
        slot.own = {}
        slot.count = 0
        slot.overrides = {}
        recent = self._recent
        for node in nodes:
            holders = node.holders
            if holders & bit:
                if node.run is not None:
                    _cut(node)
                holders ^= bit
                node.holders = canonical.get(holders, holders)
            else:
                mask = dormant[node] ^ bit
                if mask:
                    dormant[node] = mask
                else:
                    del dormant[node]
        for node in nodes:
            if node.holders or node in dormant:
                continue
            if recent is not None:
                recent.pop(node, None)
            # A node may already be gone, unlinked while pruning one of its descendants.
            if node.parent is not None and node.child is None:
                self._prune(node)
        for tier, known in slot.lower.items():
            edges = self.lower[tier]
            lower_recent = self._lower_recent[tier] if self._lower_recent is not None else None
            for ext, key in known.items():
                _release_edge(edges, key, ext, bit)
                if lower_recent is not None:
                    del lower_recent[(bit, ext)]
        slot.lower = {}

    # --- match --------------------------------------------------------------------------------

    def match(self, local_hashes: Sequence[int]) -> MatchResult:
        """Device score and lower-tier continuation of every slot; hashes may be u64 or i64."""
        by_bit = self._by_bit
        stops = self._match_device(local_hashes)
        recent = self._recent
        if recent is not None and stops:
            # Deepest first, so every prefix ends up more recent than what lies below it; a
            # run's part of the path in one C-level pass.
            _, depth, node = stops[-1]
            index = depth - 1  # the query position of `node`
            root = self.root
            move = recent.move_to_end
            while node is not root:
                run = node.run
                if run is None:
                    move(node)
                    node = node.parent
                    index -= 1
                    continue
                top = run.start
                nodes = run.nodes
                _consume(map(move, reversed(nodes[: index - top + 1])))
                node = nodes[0].parent
                index = top - 1
        device: dict[WorkerKey, int] = {}
        for mask, depth, _node in stops:
            slot = by_bit.get(mask)
            if slot is not None:  # the common case: one slot stops here
                device[slot.key] = depth
                continue
            while mask:
                low = mask & -mask
                device[by_bit[low].key] = depth
                mask ^= low
        result = MatchResult(device)
        lower = self.lower
        if local_hashes and (lower["host_pinned"] or lower["disk"] or lower["external"]):
            self._match_lower(to_unsigned_list(local_hashes), stops, result)
        return result

    def _match_device(self, local_hashes: Sequence[int]) -> list[Stop]:
        """(slots, depth, last node) for each group of slots that stopped at the same depth.
        This loop is the query's hot path. Hashes may be u64 or i64 (as `/query_by_hash`
        sends them), even mixed. Where a previous match left a `Run`, the walk compares the
        query against the run's hashes a list slice at a time (C speed) and jumps to where
        they differ; elsewhere it goes node by node, converting each hash only when it gets
        there, and leaves runs behind for the next match."""
        stops: list[Stop] = []
        query = local_hashes if local_hashes.__class__ is list else list(local_hashes)
        end = len(query)
        node_class = Node
        chain_class = Chain
        node: Any = self.root
        alive = -1  # every slot, until the first node says who holds it
        depth = 0
        signed = False  # whether the query was last seen in i64 form: the run form to try first
        # Nodes walked one by one since the last run, with the holders changes among them.
        pending: list[Node] = []
        marks: list[int] = []
        pending_stops: list[Stop] = []
        extend: Run | None = None  # the run walked whole just before `pending`
        while depth < end:
            local = query[depth]
            if local < 0:
                local += U64_MODULUS
                signed = True
            child = node.child
            if child.__class__ is node_class:
                if child.local != local:
                    break
            elif child is None:
                break
            elif child.__class__ is chain_class:
                if child.locals[0] != local:
                    break
            else:
                child = child.get(local)
                if child is None:
                    break
            holders = child.holders
            run = child.run
            if holders != alive:
                # Masks are prefix-closed, so `holders` is a subset of `alive`.
                if depth:
                    stop = (alive ^ holders, depth, node)
                    stops.append(stop)
                alive = holders
                if not holders:
                    break
                if run is None and (pending or extend is not None) and child.__class__ is not chain_class:
                    marks.append(len(pending))  # where `child` goes
                    pending_stops.append(stop)
            if run is None:
                if child.__class__ is chain_class:
                    # A chain: one slice comparison, like a run's, and no stop inside it.
                    if pending:
                        _settle_run(pending, depth, marks, pending_stops, extend)
                        pending = []
                        marks = []
                        pending_stops = []
                    extend = None
                    matched, signed = _common(query, depth, end, child, signed)
                    depth += matched
                    if matched < len(child):
                        node = (child, matched - 1)  # a point inside the chain
                        break
                    node = child
                    continue
                pending.append(child)
                depth += 1
                node = child
                continue
            if pending:
                _settle_run(pending, depth, marks, pending_stops, extend)
                pending = []
                marks = []
                pending_stops = []
            # `child` heads its run: a run's other nodes can only be reached through it.
            matched, signed = _common(query, depth, end, run, signed)
            nodes = run.nodes
            node = nodes[matched - 1]
            run_marks = run.marks
            if matched == len(nodes):
                extend = run
                if run_marks:
                    stops.extend(run.stops)
                    alive = node.holders
            else:
                extend = None
                if run_marks and run_marks[0] < matched:
                    stops.extend(run.stops[: bisect_left(run_marks, matched)])
                    alive = node.holders
            depth += matched
        if pending:
            _settle_run(pending, depth, marks, pending_stops, extend)
        if depth and alive:
            stops.append((alive, depth, node))
        return stops

    def _match_lower(
        self, local_hashes: Sequence[int], stops: list[tuple[int, int, Node]], result: MatchResult
    ) -> None:
        by_bit = self._by_bit
        position: dict[int, tuple[int, int | None]] = {}  # slot bit -> (query position, last ext)
        for mask, depth, node in stops:
            while mask:
                low = mask & -mask
                overrides = by_bit[low].overrides
                position[low] = (depth, _stop_ext(node, overrides))
                mask ^= low
        first = local_hashes[0]
        host = result.host_pinned
        disk = result.disk
        for tier in LOWER_TIERS:
            edges = self.lower[tier]
            if not edges:
                continue
            root_entry = edges.get((None, first))
            if root_entry is not None:
                for variant in (root_entry,) if root_entry.__class__ is Edge else root_entry:
                    mask = variant.owners
                    while mask:
                        low = mask & -mask
                        position.setdefault(low, (0, None))
                        mask ^= low
            totals = host if tier == "host_pinned" else disk
            for bit, hits in _continue(edges, local_hashes, position).items():
                key = by_bit[bit].key
                totals[key] = totals.get(key, 0) + hits

    # --- limit --------------------------------------------------------------------------------

    def _evict_device(self) -> None:
        """Drop least recently used nodes, each with its subtree, until the pairs fit."""
        recent = self._recent
        assert recent is not None
        while self.device_blocks > self.max_blocks and recent:
            victim, _ = recent.popitem(last=False)
            dropped = self._drop_subtree(victim)
            self.device_blocks -= dropped
            self.evicted_blocks += dropped

    def _drop_subtree(self, top: Node) -> int:
        """Forget `top` and every node below it for every slot; returns the pairs dropped.
        Children go before parents; unlinking them both ways frees them by refcount."""
        doomed = [top]
        for member in doomed:  # grows while it is walked: breadth-first
            child = member.child
            if child is None:
                continue
            if child.__class__ is Node:
                doomed.append(child)
            else:
                doomed.extend(child.values())
        recent = self._recent
        assert recent is not None
        dormant = self.dormant
        by_bit = self._by_bit
        dropped = 0
        for member in reversed(doomed):  # deepest first: each cut ends a run one node sooner
            if member.run is not None:
                _cut(member)
            mask = member.holders | dormant.pop(member, 0)
            if member is not top:
                recent.pop(member, None)
                member.child = None
                member.parent = None
                self._forget_names(member)
            while mask:
                low = mask & -mask
                slot = by_bit[low]
                overrides = slot.overrides
                name = overrides.pop(member, None) if overrides else None
                own = slot.own
                if name is not None:
                    del own[name]
                elif own.get(member.ext) is member:
                    del own[member.ext]
                slot.count -= 1
                dropped += 1
                mask ^= low
            member.holders = 0
        top.child = None
        self._prune(top)
        return dropped

    def _evict_lower(self, tier: StorageTier, recent: OrderedDict[tuple[int, int], None]) -> None:
        edges = self.lower[tier]
        by_bit = self._by_bit
        while len(recent) > self.max_blocks:
            (bit, ext), _ = recent.popitem(last=False)
            _release_edge(edges, by_bit[bit].lower[tier].pop(ext), ext, bit)
            self.evicted_blocks += 1

    # --- dump ---------------------------------------------------------------------------------

    def dump(self, include: Callable[[WorkerKey], bool] | None = None) -> list[RouterEvent]:
        """Stored events that rebuild the index, parents before children: the device tier as
        chains (one event per run of single-child nodes and slot holding it), then one
        single-block event per lower-tier block. event_id counts from 0 in each tier section.
        `include`: only the slots it accepts (all when None).

        Dormant blocks (held below a removed block) are left out: no stored event can
        express them, and leaving them out changes no query answer.
        """
        events: list[RouterEvent] = []
        by_bit = self._by_bit
        root = self.root
        pending = _children(root)
        pending.reverse()
        while pending:
            start = pending.pop()
            run = [start]
            node = start
            while node.child is not None and node.child.__class__ is not dict:
                node = node.child
                run.append(node)
            further = _children(node)
            further.reverse()
            pending.extend(further)
            lengths: dict[int, int] = {}
            mask = start.holders
            depth = 0
            for member in run:
                if member.holders != mask:
                    _settle_lengths(lengths, mask ^ member.holders, depth)
                    mask = member.holders
                depth += len(member) if member.__class__ is Chain else 1
            _settle_lengths(lengths, mask, depth)
            parent = start.parent
            for slot in sorted((by_bit[bit] for bit in lengths), key=lambda s: s.key):
                if include is not None and not include(slot.key):
                    continue
                overrides = slot.overrides
                parent_hash = None if parent is root else _stop_ext(parent, overrides)
                exts, locals_ = _blocks_of(run, lengths[slot.bit], overrides)
                events.append(
                    RouterEvent(slot.key[0], slot.key[1], len(events), DEVICE, Stored(parent_hash, exts, locals_))
                )
        for tier in LOWER_TIERS:
            event_id = 0
            for key in sorted(self.slots):
                if include is not None and not include(key):
                    continue
                slot = self.slots[key]
                for ext, (parent_hash, local) in slot.lower.get(tier, {}).items():
                    events.append(RouterEvent(key[0], key[1], event_id, tier, Stored(parent_hash, [ext], [local])))
                    event_id += 1
        return events


def _blocks_of(path: list[Any], length: int, overrides: dict[Node, int]) -> tuple[list[int], list[int]]:
    """One slot's external and local hashes of the first `length` blocks of `path`, a list of
    single-child nodes and chains."""
    exts: list[int] = []
    locals_: list[int] = []
    for member in path:
        if length <= 0:
            break
        if member.__class__ is Chain:
            exts.extend(member.exts[:length])
            locals_.extend(member.locals[:length].tolist())
            length -= len(member)
        else:
            exts.append(overrides.get(member, member.ext) if overrides else member.ext)
            locals_.append(member.local)
            length -= 1
    return exts, locals_


def _u64_array(values: Sequence[int]) -> array:
    """`values` (u64, or i64 read as u64) packed."""
    try:
        return array("Q", values)
    except OverflowError:
        return array("Q", to_unsigned_list(values))


def _extend_chain(chain: Chain, exts: Sequence[int], locals_: Sequence[int]) -> None:
    chain.locals.extend(_u64_array(locals_))
    chain.exts.extend(exts)
    chain.forget_forms()


def _chain_prefix(chain: Chain, block_hashes: Sequence[int], tokens_hashes: Sequence[int], index: int) -> int:
    """How many of `chain`'s first blocks the store's blocks from `index` on are, by local
    hash and by name (0 when the first one's name differs: the caller matched its local)."""
    size = min(len(chain), len(block_hashes) - index)
    locals_ = _u64_array(tokens_hashes[index : index + size])
    exts = block_hashes[index : index + size]
    if exts.__class__ is not list:
        exts = list(exts)
    return min(_first_difference(locals_, chain.locals, size), _first_difference(exts, chain.exts, size))


def _first_difference(ours: Any, theirs: Any, size: int) -> int:
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


def _adopt(parent: Node | Chain, child: Any) -> None:
    """Make `parent` the parent of `child` (None, a node or chain, or a dict of them)."""
    if child is None:
        return
    if child.__class__ is dict:
        for member in child.values():
            member.parent = parent
    else:
        child.parent = parent


def _relink(parent: Node | Chain, old: Node | Chain, new: Node | Chain) -> None:
    """Put `new` where `old` was among `parent`'s children (both start with the same block)."""
    siblings = parent.child
    if siblings is old:
        parent.child = new
    else:
        siblings[new.local] = new


def _stop_ext(node: Any, overrides: dict[Node, int]) -> int:
    """The external hash, for one slot, of the last block a stop's slots hold: a `Node`, a
    `Chain` (its last block) or a (chain, index) point inside one."""
    kind = node.__class__
    if kind is Node:
        return overrides.get(node, node.ext) if overrides else node.ext
    if kind is Chain:
        return node.exts[-1]
    chain, index = node
    return chain.exts[index]


def _consistent(
    find: Callable[[int], Any], start: Node, block_hashes: Sequence[int], tokens_hashes: Sequence[int]
) -> bool:
    """Whether every hash the slot already uses (`find`: the block it names so, or None)
    names the very block the store walks to."""
    piece: Any = start
    index = 0  # the block of `piece` the walk is at
    for ext, local in zip(block_hashes, tokens_hashes):
        if piece is not None:
            if piece.__class__ is Chain and index + 1 < len(piece):
                index += 1
                if piece.locals[index] != local:
                    piece = None
            else:
                child = piece.child
                index = 0
                if child is None:
                    piece = None
                elif child.__class__ is Node:
                    piece = child if child.local == local else None
                elif child.__class__ is Chain:
                    piece = child if child.locals[0] == local else None
                else:
                    piece = child.get(local)
        known = find(ext)
        if known is not None and (
            known is not piece or (piece.__class__ is Chain and piece.exts[index] != ext)
        ):
            return False
    return True


def _release_edge(edges: dict[TransitionKey, EdgeEntry], key: TransitionKey, ext: int, bit: int) -> None:
    entry = edges[key]
    if entry.__class__ is Edge:
        owners = entry.owners & ~bit
        if owners:
            entry.owners = owners
        else:
            del edges[key]
        return
    variants: list[Edge] = entry
    for variant in variants:
        if variant.child == ext:
            variant.owners &= ~bit
            if not variant.owners:
                variants.remove(variant)
            break
    if len(variants) == 1:
        edges[key] = variants[0]


def _continue(
    edges: dict[TransitionKey, EdgeEntry],
    local_hashes: Sequence[int],
    position: dict[int, tuple[int, int | None]],
) -> dict[int, int]:
    """Advance every slot through one lower tier; returns the blocks each gained and leaves
    each slot's new (position, last ext) in `position`, to seed the next tier.

    Slots at the same (position, ext) walk together, splitting as transitions lose owners."""
    groups: dict[tuple[int, int | None], int] = {}
    for bit, state in position.items():
        groups[state] = groups.get(state, 0) | bit
    gained: dict[int, int] = {}
    end = len(local_hashes)
    work = list(groups.items())
    while work:
        (depth, ext), mask = work.pop()
        while depth < end:
            entry = edges.get((ext, local_hashes[depth]))
            if entry is None:
                break
            if entry.__class__ is not Edge:
                rest = mask
                for variant in entry:
                    sub = mask & variant.owners
                    if sub:
                        work.append(((depth + 1, variant.child), sub))
                        rest ^= sub
                mask = rest
                break
            held = mask & entry.owners
            if held != mask:
                _settle(position, gained, mask ^ held, depth, ext)
                mask = held
                if not held:
                    break
            ext = entry.child
            depth += 1
        if mask:
            _settle(position, gained, mask, depth, ext)
    return gained


def _settle(
    position: dict[int, tuple[int, int | None]], gained: dict[int, int], mask: int, depth: int, ext: int | None
) -> None:
    while mask:
        low = mask & -mask
        hits = depth - position[low][0]
        if hits:
            gained[low] = hits
            position[low] = (depth, ext)
        mask ^= low


def _settle_lengths(lengths: dict[int, int], mask: int, length: int) -> None:
    while mask:
        low = mask & -mask
        if length:
            lengths[low] = length
        mask ^= low


def _children(node: Node) -> list[Node]:
    child = node.child
    if child is None:
        return []
    if child.__class__ is dict:
        return list(child.values())
    return [child]
