"""Chains: a run of blocks in two arrays, and how they are extended and cut.

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
`promote` and `demote` treat it whole, and a match compares the query with its hashes a slice
at a time (like a run). What needs one block of it cuts it first: `split` (a store that covers
only its head, a store that diverges inside it) keeps the head in place and moves the tail to a
new chain, re-pointing the tail's names where they are (the shared map, or each holder's own);
`isolate` gives one block a `Node` of its own (a removal, a parent in the middle of a chain, a
slot that names a block differently, whose name goes into `overrides`). A tail-first removal
cuts one block off the end: O(1). Chains are not put back together when a branch goes away.

A limited tree keeps a node per block: its recency is per block (see `eviction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynamo_lite.indexer.tree.names import repoint_chain, repoint_node
from dynamo_lite.indexer.tree.nodes import Chain, Node, Piece, adopt, first_difference, relink, u64_array

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree


def split(tree: PrefixTree, chain: Chain, size: int) -> Chain:
    """Cut `chain` after its first `size` blocks (0 < size < len): it keeps them, and the
    rest becomes a new chain below it, returned. Costs a dict update per block moved and
    holder, so cutting near the end is cheap (tail-first removals)."""
    tail = Chain(chain.locals[size:], chain.exts[size:], chain, chain.holders, chain.child, shared=chain.shared)
    adopt(tail, chain.child)
    del chain.locals[size:]
    del chain.exts[size:]
    chain.child = tail
    chain.forget_forms()
    repoint_chain(tree, chain, tail, hand_over(tree, chain, tail, keep=True))
    return tail


def isolate(tree: PrefixTree, chain: Chain, index: int) -> Node:
    """Replace block `index` of `chain` by a `Node` of its own (the chain's blocks before
    and after it stay chains), for code that works on one block; returns the node. The
    first or the last block costs O(1) map updates; one inside, those of the blocks after
    it."""
    size = len(chain)
    if size > 1:
        if index == size - 1:
            node = Node(chain.locals.pop(), chain.exts.pop(), chain, chain.holders, chain.child)
            adopt(node, chain.child)
            chain.child = node
            chain.forget_forms()
            repoint_node(tree, chain, node, hand_over(tree, chain, node, keep=True))
            return node
        if index == 0:
            parent = chain.parent
            assert parent is not None  # a chain in the tree has one
            node = Node(chain.locals[0], chain.exts[0], parent, chain.holders, chain)
            relink(parent, chain, node)
            chain.parent = node
            del chain.locals[0]
            del chain.exts[0]
            chain.forget_forms()
            repoint_node(tree, chain, node, hand_over(tree, chain, node, keep=True))
            return node
        split(tree, chain, index + 1)
        return isolate(tree, chain, index)
    parent = chain.parent
    assert parent is not None  # a chain in the tree has one
    node = Node(chain.locals[0], chain.exts[0], parent, chain.holders, chain.child)
    adopt(node, chain.child)
    relink(parent, chain, node)
    repoint_node(tree, chain, node, hand_over(tree, chain, node, keep=False))
    chain.parent = chain.child = None
    return node


def hand_over(tree: PrefixTree, chain: Chain, piece: Piece, *, keep: bool) -> int:
    """`piece` now has blocks of `chain`: it takes the chain's dormant mask (the chain keeps
    it too when `keep`); returns the slots that have them, which the caller re-points."""
    mask = piece.holders
    if tree.dormant:
        below_gap = tree.dormant.get(chain, 0) if keep else tree.dormant.pop(chain, 0)
        if below_gap:
            tree.dormant[piece] = below_gap
            mask |= below_gap
    return mask


def extend_chain(chain: Chain, exts: Sequence[int], locals_: Sequence[int]) -> None:
    chain.locals.extend(u64_array(locals_))
    chain.exts.extend(exts)
    chain.forget_forms()


def chain_prefix(chain: Chain, block_hashes: Sequence[int], tokens_hashes: Sequence[int], index: int) -> int:
    """How many of `chain`'s first blocks the store's blocks from `index` on are, by local
    hash and by name (0 when the first one's name differs: the caller matched its local)."""
    size = min(len(chain), len(block_hashes) - index)
    locals_ = u64_array(tokens_hashes[index : index + size])
    exts = block_hashes[index : index + size]
    if exts.__class__ is not list:
        exts = list(exts)
    return min(first_difference(locals_, chain.locals, size), first_difference(exts, chain.exts, size))
