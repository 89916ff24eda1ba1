"""The name index: how each slot finds its device blocks by its own external hashes.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

from dynamo_lite.indexer.tree.nodes import (
    COLLIDED_NAMES,
    OWN_NAMES,
    SHARED_NAMES,
    Chain,
    Node,
    Piece,
    consume,
    first_difference,
)

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
    from dynamo_lite.indexer.tree.runs import StopAt
    from dynamo_lite.indexer.tree.slots import WorkerKey, WorkerSlot

# The shared map is this many dicts, picked by an external hash's low bits: one dict of 1M
# entries stops everything for 27 ms when it grows (58 ms at 1.4M), one of 16k-31k for ~1 ms.
NAME_SHARDS = 64
SHARD_MASK = NAME_SHARDS - 1


def holds(tree: PrefixTree, worker: WorkerKey, block_hashes: Sequence[int]) -> tuple[int, int]:
    """How many leading `block_hashes` name device blocks the slot holds, and how many
    of them all do (below a gap too). Two C-level passes, and a lookup in the shared map
    per hash not in the slot's own map once it shares blocks."""
    slot = tree.slots.get(worker)
    if slot is None:
        return 0, 0
    flags = list(map(slot.own.__contains__, block_hashes))
    if slot.count != len(slot.own):
        lookup = find_shared
        flags = [flag or lookup(tree, slot, ext) is not None for flag, ext in zip(flags, block_hashes)]
    held = sum(flags)
    return (len(flags) if held == len(flags) else flags.index(False)), held


def counterparts(tree: PrefixTree, worker: WorkerKey, block_hashes: Sequence[int], other: WorkerKey) -> list[int]:
    """`other`'s own external hashes of the device blocks that `worker` names
    `block_hashes`, for the blocks both hold: one dict lookup or two per hash."""
    slot = tree.slots.get(worker)
    counterpart = tree.slots.get(other)
    if slot is None or counterpart is None:
        return []
    lookup = find
    overrides = counterpart.overrides
    found = []
    for ext in block_hashes:
        node = lookup(tree, slot, ext)
        if node is None:
            continue
        if node.__class__ is Node:
            own = overrides.get(node, node.ext) if overrides else node.ext
        else:
            own = ext  # a chain's holders all name its blocks alike
        if lookup(tree, counterpart, own) is node:
            found.append(own)
    return found


def held_hashes(tree: PrefixTree, worker: WorkerKey) -> list[int]:
    """The slot's own external hashes of every device block it holds (below a gap too)."""
    slot = tree.slots.get(worker)
    return [] if slot is None else list(names_of(tree, slot))


def find(tree: PrefixTree, slot: WorkerSlot, ext: int) -> Piece | None:
    """The device block (node or chain) the slot names `ext`, if any."""
    piece = slot.own.get(ext)
    if piece is None:
        return find_shared(tree, slot, ext)
    return piece


def find_shared(tree: PrefixTree, slot: WorkerSlot, ext: int) -> Piece | None:
    """The block the slot names `ext` through the shared map, if any (not in its own map)."""
    if slot.count == len(slot.own):
        return None  # it names every block it has in its own map
    piece = tree.names[ext & SHARD_MASK].get(ext)
    if piece is None or not named_by(tree, slot, piece):
        return None
    return piece


def named_by(tree: PrefixTree, slot: WorkerSlot, piece: Piece) -> bool:
    """Whether the slot has `piece` (below a gap too) under its shared names."""
    bit = slot.bit
    if not piece.holders & bit and not (tree.dormant and tree.dormant.get(piece, 0) & bit):
        return False
    return not (slot.overrides and piece in slot.overrides)


def uses_shared(tree: PrefixTree, slot: WorkerSlot, names: Sequence[int]) -> bool:
    """Whether the slot names a block by any of `names` through the shared map."""
    if slot.count == len(slot.own):
        return False
    shards = tree.names
    mask = SHARD_MASK
    size = len(names)
    index = 0
    while index < size:
        ext = names[index]
        index += 1
        if ext not in shards[ext & mask]:
            continue
        piece = shards[ext & mask][ext]
        if named_by(tree, slot, piece):
            return True
        if piece.__class__ is Chain and piece.shared == SHARED_NAMES:
            # Another slot's shared chain, which a store usually takes whole (a prompt's
            # prefix): the shared map sends every name of it to it, so the names that go
            # on as the chain does are not the slot's either. One slice comparison for them.
            exts = piece.exts
            start = exts.index(ext) + 1
            count = min(size - index, len(exts) - start)
            index += first_difference(names[index : index + count], exts[start : start + count], count)
    return False


def pieces_of(tree: PrefixTree, slot: WorkerSlot) -> list[Any]:
    """Every node and chain the slot has (below a gap too), each once."""
    if slot.count == len(slot.own):
        return list(dict.fromkeys(slot.own.values()))
    # Masks are prefix-closed: the slot's held blocks are a subtree from the root.
    bit = slot.bit
    pieces: list[Any] = []
    stack: list[Any] = [tree.root]
    while stack:
        child = stack.pop().child
        if child is None:
            continue
        for candidate in child.values() if child.__class__ is dict else (child,):
            if candidate.holders & bit:
                pieces.append(candidate)
                stack.append(candidate)
    if tree.dormant:
        pieces.extend(piece for piece, mask in tree.dormant.items() if mask & bit)
    return pieces


def names_of(tree: PrefixTree, slot: WorkerSlot) -> dict[int, Piece]:
    """The slot's own external hash of each of its device blocks -> node or chain."""
    if slot.count == len(slot.own):
        return dict(slot.own)
    overrides = slot.overrides
    names: dict[int, Piece] = {}
    for piece in pieces_of(tree, slot):
        if piece.__class__ is Chain:
            names.update(zip(piece.exts, repeat(piece)))
        else:
            names[overrides.get(piece, piece.ext) if overrides else piece.ext] = piece
    return names


def take_node(tree: PrefixTree, slot: WorkerSlot, node: Node, ext: int, others: int) -> None:
    """The slot now has `node` (not before) under `ext`; `others`: the slots that had it."""
    slot.count += 1
    if node.ext != ext:
        slot.overrides[node] = ext
        slot.own[ext] = node
        return
    shard = tree.names[ext & SHARD_MASK]
    if shard.get(ext) is node:
        return
    if others and shard.setdefault(ext, node) is node:
        # The second slot to have the block: its name moves to the shared map.
        by_bit = tree.by_bit
        while others:
            low = others & -others
            own = by_bit[low].own
            if own.get(ext) is node:
                del own[ext]
            others ^= low
        return
    slot.own[ext] = node


def share_chain(tree: PrefixTree, chain: Chain, others: int) -> None:
    """A second slot takes `chain`: its names move from the own maps of the slots that had
    it (`others`) to the shared map, but for names another block has there already."""
    shards = tree.names
    collided = False
    for ext in chain.exts:
        if shards[ext & SHARD_MASK].setdefault(ext, chain) is not chain:
            collided = True
    by_bit = tree.by_bit
    while others:
        low = others & -others
        own = by_bit[low].own
        if collided:
            for ext in chain.exts:
                if shards[ext & SHARD_MASK].get(ext) is chain:
                    del own[ext]
        else:
            consume(map(own.__delitem__, chain.exts))
        others ^= low
    chain.shared = COLLIDED_NAMES if collided else SHARED_NAMES


def forget_names(tree: PrefixTree, piece: Piece) -> None:
    """`piece` leaves the tree: its names leave the shared map."""
    shards = tree.names
    if piece.__class__ is Node:
        ext = piece.ext
        shard = shards[ext & SHARD_MASK]
        if shard.get(ext) is piece:
            del shard[ext]
    elif piece.__class__ is Chain and piece.shared:
        for ext in piece.exts:
            shard = shards[ext & SHARD_MASK]
            if shard.get(ext) is piece:
                del shard[ext]


def repoint_chain(tree: PrefixTree, chain: Chain, piece: Chain, mask: int) -> None:
    """Make the slots of `mask` find `piece`'s blocks, which were `chain`'s, where they
    found them in `chain` (they name them alike: chains have no overrides)."""
    mode = chain.shared
    names = piece.exts
    if mode != OWN_NAMES:
        shards = tree.names
        for ext in names:
            shard = shards[ext & SHARD_MASK]
            if mode == SHARED_NAMES or shard.get(ext) is chain:
                shard[ext] = piece
        if mode == SHARED_NAMES:
            return
    by_bit = tree.by_bit
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


def repoint_node(tree: PrefixTree, chain: Chain, node: Node, mask: int) -> None:
    """`repoint_chain` for a block of `chain` that became a node of its own."""
    ext = node.ext
    shard = tree.names[ext & SHARD_MASK]
    if chain.shared != OWN_NAMES and shard.get(ext) is chain:
        shard[ext] = node
        return
    by_bit = tree.by_bit
    while mask:
        low = mask & -mask
        by_bit[low].own[ext] = node
        mask ^= low


def stop_ext(node: StopAt, overrides: dict[Node, int]) -> int:
    """The external hash, for one slot, of the last block a stop's slots hold: a `Node`, a
    `Chain` (its last block) or a (chain, index) point inside one."""
    if node.__class__ is Node:
        return overrides.get(node, node.ext) if overrides else node.ext
    if node.__class__ is Chain:
        return node.exts[-1]
    if TYPE_CHECKING:  # a (chain, index) point: mypy narrows no `__class__ is not`
        assert isinstance(node, tuple)
    chain, index = node
    return chain.exts[index]
