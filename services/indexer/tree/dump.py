"""The `/dump` of a tree: stored events that rebuild it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dynamo_lite.indexer.protocols import DEVICE, LOWER_TIERS, RouterEvent, Stored
from dynamo_lite.indexer.tree.names import stop_ext
from dynamo_lite.indexer.tree.nodes import Chain, Node, children

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
    from dynamo_lite.indexer.tree.slots import WorkerKey


def dump(tree: PrefixTree, include: Callable[[WorkerKey], bool] | None = None) -> list[RouterEvent]:
    """Stored events that rebuild the index, parents before children: the device tier as
    chains (one event per run of single-child nodes and slot holding it), then one
    single-block event per lower-tier block. event_id counts from 0 in each tier section.
    `include`: only the slots it accepts (all when None).

    Dormant blocks (held below a removed block) are left out: no stored event can
    express them, and leaving them out changes no query answer.
    """
    events: list[RouterEvent] = []
    by_bit = tree.by_bit
    root = tree.root
    pending = children(root)
    pending.reverse()
    while pending:
        start = pending.pop()
        run = [start]
        node = start
        while node.child is not None and node.child.__class__ is not dict:
            node = node.child
            run.append(node)
        further = children(node)
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
        assert parent is not None  # `start` is a child of a node in the tree
        for slot in sorted((by_bit[bit] for bit in lengths), key=lambda s: s.key):
            if include is not None and not include(slot.key):
                continue
            overrides = slot.overrides
            parent_hash = None if parent is root else stop_ext(parent, overrides)
            exts, locals_ = _blocks_of(run, lengths[slot.bit], overrides)
            events.append(
                RouterEvent(slot.key[0], slot.key[1], len(events), DEVICE, Stored(parent_hash, exts, locals_))
            )
    for tier in LOWER_TIERS:
        event_id = 0
        for key in sorted(tree.slots):
            if include is not None and not include(key):
                continue
            slot = tree.slots[key]
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


def _settle_lengths(lengths: dict[int, int], mask: int, length: int) -> None:
    while mask:
        low = mask & -mask
        if length:
            lengths[low] = length
        mask ^= low
