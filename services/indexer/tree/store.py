"""Storing blocks on the device tier: a stored event's chain walked down from its parent,
extending a chain of the slot's own in place, making a chain (or nodes) past the end of the
tree, taking the nodes and chains it reaches and reviving what was dormant below them (see
`remove` for dormancy). All or nothing: a rejected event changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Any

from dynamo_lite.indexer.tree.chains import chain_prefix, extend_chain, isolate, split
from dynamo_lite.indexer.tree.eviction import evict_device
from dynamo_lite.indexer.tree.names import SHARD_MASK, find, find_shared, share_chain, take_node, uses_shared
from dynamo_lite.indexer.tree.nodes import COLLIDED_NAMES, OWN_NAMES, Chain, Node, Piece, u64_array
from dynamo_lite.indexer.tree.runs import cut

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
    from dynamo_lite.indexer.tree.slots import WorkerSlot


class StoreStatus(Enum):
    STORED = "stored"
    UNKNOWN_PARENT = "unknown_parent"  # parent is not a device block of this slot
    SELF_REFERENCE = "self_reference"  # a block_hash repeats in the event or equals the parent
    HASH_CONFLICT = "hash_conflict"  # a block_hash already names another block of this slot


def store_device(
    tree: PrefixTree, slot: WorkerSlot, parent_hash: int | None, block_hashes: Sequence[int], tokens_hashes: Sequence[int]
) -> StoreStatus:
    blocks = slot.own
    held_before = slot.count
    bit = slot.bit
    dormant = tree.dormant
    start: Piece
    if parent_hash is None:
        start = tree.root
        active = True
    else:
        found = blocks.get(parent_hash)
        if found is None:
            found = find_shared(tree, slot, parent_hash)
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
                and not uses_shared(tree, slot, block_hashes)
            ):
                # The slot goes on with a chain of its own (the next batch of a prompt, a
                # decode step): the common case is two array extends and one dict update.
                extend_chain(found, block_hashes, tokens_hashes)
                blocks.update(zip(block_hashes, repeat(found)))
                slot.count += len(block_hashes)
                tree.device_blocks += len(block_hashes)
                return StoreStatus.STORED
            found = isolate(tree, found, found.exts.index(parent_hash))
        start = found
        active = bool(start.holders & bit)
    if (not blocks.keys().isdisjoint(block_hashes) or uses_shared(tree, slot, block_hashes)) and not _consistent(
        partial(find, tree, slot), start, block_hashes, tokens_hashes
    ):
        return StoreStatus.HASH_CONFLICT
    # Any: the walk goes through nodes, chains and the dicts of branch points (`child`), told
    # apart by `__class__` tests, which mypy narrows in one branch only.
    node: Any = start
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
                if tree.chains:
                    exts = block_hashes[index:]
                    if (
                        node.__class__ is Chain
                        and node.holders == bit
                        and not node.shared
                        and not (dormant and node in dormant)
                    ):
                        extend_chain(node, exts, tokens_hashes[index:])
                    else:
                        node.child = node = Chain(
                            u64_array(tokens_hashes[index:]),
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
            matched = chain_prefix(child, block_hashes, tokens_hashes, index)
            if matched:
                # The store covers the chain's first `matched` blocks, which all stand alike
                # for this slot: take them as one.
                if matched < len(child):
                    split(tree, child, matched)
                take_chain(tree, slot, child, active)
                node = child
                index += matched
                continue
            # The slot names the chain's first block otherwise (an override): node by node.
            child = isolate(tree, child, 0)
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
                cut(node)
            node.holders = bit if not holders else holders | bit
            if dormant and node.child is not None:
                promote(tree, node, bit)
        else:
            dormant[node] = below | bit
        take_node(tree, slot, node, ext, holders | below)
    tree.device_blocks += slot.count - held_before
    recent = tree.recent
    if recent is not None:
        while node is not start:
            recent[node] = None
            recent.move_to_end(node)
            node = node.parent
        if start is not tree.root:
            recent.move_to_end(start)
        if tree.device_blocks > tree.max_blocks:
            evict_device(tree)
    return StoreStatus.STORED


def take_chain(tree: PrefixTree, slot: WorkerSlot, chain: Chain, active: bool) -> None:
    """The slot stores every block of `chain` (which it names as `chain.exts` does)."""
    bit = slot.bit
    holders = chain.holders
    if holders & bit:
        return
    dormant = tree.dormant
    below = dormant.get(chain, 0) if dormant else 0
    if below & bit:
        return
    if active:
        chain.holders = bit if not holders else holders | bit
        if dormant and chain.child is not None:
            promote(tree, chain, bit)
    else:
        dormant[chain] = below | bit
    slot.count += len(chain)
    if not chain.shared and (holders | below):
        share_chain(tree, chain, holders | below)
    mode = chain.shared
    if mode == OWN_NAMES:
        slot.own.update(zip(chain.exts, repeat(chain)))
    elif mode == COLLIDED_NAMES:
        own = slot.own
        shards = tree.names
        for ext in chain.exts:
            if shards[ext & SHARD_MASK].get(ext) is not chain:
                own[ext] = chain


def promote(tree: PrefixTree, node: Piece, bit: int) -> None:
    """`node` just became held for `bit` from the root: revive its dormant descendants."""
    dormant = tree.dormant
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
                    cut(candidate)
                candidate.holders = bit if not holders else holders | bit
                stack.append(candidate)


def _consistent(
    find: Callable[[int], Any], start: Piece, block_hashes: Sequence[int], tokens_hashes: Sequence[int]
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
