"""Removing blocks from the device tier: one slot's blocks by name (`removed` events), or
all of them (`AllBlocksCleared`), and pruning what nobody holds any more.

Removing a block in the middle of a slot's chain
------------------------------------------------
The index follows this coverage model exactly (the tests' node-by-node oracle): a slot's
coverage is the set of chains it stored and did not remove; its score for a query is the
largest k such that every prefix query[0..j], j <= k, is covered. A block below a removed one
is still covered (the engine never said it dropped it) but cannot count until the gap is
filled again:

* removing block B clears the slot's bit in B and in every descendant that had it (walking
  only that slot's part of the subtree), and records the descendants in `dormant`
  (node -> mask of slots holding it below a gap);
* re-storing B sets the bit again and promotes the dormant descendants back into `holders`
  (`store.promote`);
* a store whose parent is dormant is accepted and stays dormant, as the model says.

Dynamo 1.6.1 does not (docs/differences.md, "mid-chain removal"): which deeper blocks come
back depends on where its compressed edges happened to be split. Costs: removing a block
visits its children, plus the slot's held subtree below it when that is not empty (zero for
tail-first eviction); a re-store visits the dormant subtree it revives. `dormant` is empty
unless an engine evicts mid-chain, and then costs nothing on the query path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynamo_lite.indexer.tree.chains import isolate
from dynamo_lite.indexer.tree.names import SHARD_MASK, find_shared, forget_names, pieces_of
from dynamo_lite.indexer.tree.nodes import Chain, Piece
from dynamo_lite.indexer.tree.runs import cut

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
    from dynamo_lite.indexer.tree.slots import WorkerSlot


def remove_device(tree: PrefixTree, slot: WorkerSlot, block_hashes: Sequence[int]) -> int:
    blocks = slot.own
    overrides = slot.overrides
    dormant = tree.dormant
    canonical = tree.canonical
    recent = tree.recent
    bit = slot.bit
    unknown = 0
    for ext in block_hashes:
        node = blocks.get(ext)
        private = node is not None
        if node is None:
            node = find_shared(tree, slot, ext)
            if node is None:
                unknown += 1
                continue
        slot.count -= 1
        if type(node) is Chain:  # `type()`: mypy narrows the other branch too (both classes are final)
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
                    del tree.names[ext & SHARD_MASK][ext]
                continue
            node = isolate(tree, node, node.exts.index(ext))
        if private:
            del blocks[ext]
        if overrides:
            overrides.pop(node, None)
        holders = node.holders
        if holders & bit:
            if node.run is not None:
                cut(node)
            holders ^= bit
            node.holders = canonical.get(holders, holders)
            if node.child is not None:
                demote(tree, node, bit)
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
                prune(tree, node)
    tree.device_blocks -= len(block_hashes) - unknown
    return unknown


def demote(tree: PrefixTree, node: Piece, bit: int) -> None:
    """`bit` lost `node`: its descendants held by `bit` stay held, but below a gap."""
    dormant = tree.dormant
    canonical = tree.canonical
    stack = [node]
    while stack:
        child = stack.pop().child
        if child is None:
            continue
        for candidate in child.values() if child.__class__ is dict else (child,):
            holders = candidate.holders
            if holders & bit:
                if candidate.run is not None:
                    cut(candidate)
                holders ^= bit
                candidate.holders = canonical.get(holders, holders)
                dormant[candidate] = dormant.get(candidate, 0) | bit
                stack.append(candidate)


def prune(tree: PrefixTree, node: Piece) -> None:
    """Unlink a node (or chain) nobody holds and that has no children, then its emptied
    ancestors."""
    root = tree.root
    dormant = tree.dormant
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
        forget_names(tree, node)
        if parent is root or parent.holders or parent.child is not None or parent in dormant:
            return
        node = parent


def clear_device(tree: PrefixTree, slot: WorkerSlot) -> None:
    """Drop every device block of the slot."""
    bit = slot.bit
    canonical = tree.canonical
    dormant = tree.dormant
    nodes = pieces_of(tree, slot)
    tree.device_blocks -= slot.count
    slot.own = {}
    slot.count = 0
    slot.overrides = {}
    recent = tree.recent
    for node in nodes:
        holders = node.holders
        if holders & bit:
            if node.run is not None:
                cut(node)
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
            prune(tree, node)
