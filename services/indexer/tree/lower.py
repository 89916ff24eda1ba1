"""Lower tiers (host_pinned, disk, external): stores, removals, the query's continuation past
the device tier, and their bounded size.

As in the reference, these are not trees: each block is a transition
(parent external hash | None, local hash) -> child external hash, owned by a mask of slots,
and a store is accepted whatever its parent. A query continues each slot from where its
device match stopped (or from the root when it has none) through host_pinned, then disk,
then external, following the slot's own external hashes. If two slots name the same
transition differently, both names are kept (`Edge` variants) and each slot follows its own.
With a limit, each tier keeps at most `max_blocks` blocks, dropped oldest store first
(queries do not touch them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union, final

from dynamo_lite.indexer.protocols import LOWER_TIERS, StorageTier
from dynamo_lite.indexer.tree.names import stop_ext
from dynamo_lite.indexer.tree.store import StoreStatus

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.matching import MatchResult
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
    from dynamo_lite.indexer.tree.runs import Stop
    from dynamo_lite.indexer.tree.slots import WorkerSlot

TransitionKey = tuple[int | None, int]  # (parent external hash | None, local hash)


@final
class Edge:
    """A lower-tier transition: the child's external hash and the slots holding it."""

    __slots__ = ("child", "owners")

    def __init__(self, child: int, owners: int) -> None:
        self.child = child
        self.owners = owners


EdgeEntry = Union[Edge, list[Edge]]  # a list only when slots disagree on the child's hash


def store_lower(
    tree: PrefixTree,
    slot: WorkerSlot,
    tier: StorageTier,
    parent_hash: int | None,
    block_hashes: Sequence[int],
    tokens_hashes: Sequence[int],
) -> StoreStatus:
    edges = tree.lower[tier]
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
    recent = tree.lower_recent[tier] if tree.lower_recent is not None else None
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
        elif type(entry) is Edge:  # `type()`: mypy narrows the other branch too (Edge is final)
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
    if recent is not None and len(recent) > tree.max_blocks:
        evict_lower(tree, tier, recent)
    return StoreStatus.STORED


def remove_lower(tree: PrefixTree, slot: WorkerSlot, tier: StorageTier, block_hashes: Sequence[int]) -> int:
    known = slot.lower.get(tier)
    if not known:
        return len(block_hashes)
    edges = tree.lower[tier]
    recent = tree.lower_recent[tier] if tree.lower_recent is not None else None
    unknown = 0
    for ext in block_hashes:
        key = known.pop(ext, None)
        if key is None:
            unknown += 1
            continue
        release_edge(edges, key, ext, slot.bit)
        if recent is not None:
            del recent[(slot.bit, ext)]
    return unknown


def match_lower(
    tree: PrefixTree, local_hashes: Sequence[int], stops: list[Stop], result: MatchResult
) -> None:
    by_bit = tree.by_bit
    position: dict[int, tuple[int, int | None]] = {}  # slot bit -> (query position, last ext)
    for mask, depth, node in stops:
        while mask:
            low = mask & -mask
            overrides = by_bit[low].overrides
            position[low] = (depth, stop_ext(node, overrides))
            mask ^= low
    first = local_hashes[0]
    host = result.host_pinned
    disk = result.disk
    for tier in LOWER_TIERS:
        edges = tree.lower[tier]
        if not edges:
            continue
        root_entry = edges.get((None, first))
        if root_entry is not None:
            for variant in (root_entry,) if type(root_entry) is Edge else root_entry:
                mask = variant.owners
                while mask:
                    low = mask & -mask
                    position.setdefault(low, (0, None))
                    mask ^= low
        totals = host if tier == "host_pinned" else disk
        for bit, hits in _continue(edges, local_hashes, position).items():
            key = by_bit[bit].key
            totals[key] = totals.get(key, 0) + hits


def evict_lower(tree: PrefixTree, tier: StorageTier, recent: OrderedDict[tuple[int, int], None]) -> None:
    edges = tree.lower[tier]
    by_bit = tree.by_bit
    while len(recent) > tree.max_blocks:
        (bit, ext), _ = recent.popitem(last=False)
        release_edge(edges, by_bit[bit].lower[tier].pop(ext), ext, bit)
        tree.evicted_blocks += 1


def release_edge(edges: dict[TransitionKey, EdgeEntry], key: TransitionKey, ext: int, bit: int) -> None:
    entry = edges[key]
    if type(entry) is Edge:  # `type()`: mypy narrows the other branch too (Edge is final)
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
            if type(entry) is not Edge:  # `type()`: mypy narrows both branches (Edge is final)
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


def clear_lower(tree: PrefixTree, slot: WorkerSlot) -> None:
    """Drop every lower-tier block of the slot."""
    bit = slot.bit
    for tier, known in slot.lower.items():
        edges = tree.lower[tier]
        lower_recent = tree.lower_recent[tier] if tree.lower_recent is not None else None
        for ext, key in known.items():
            release_edge(edges, key, ext, bit)
            if lower_recent is not None:
                del lower_recent[(bit, ext)]
    slot.lower = {}
