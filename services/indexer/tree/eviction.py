"""Bounded size (`max_blocks`): which device blocks go when a tree is full.

With a limit, the tree keeps at most `max_blocks` device (slot, block) pairs and at most
`max_blocks` blocks on each lower tier. Device recency is per node, in an OrderedDict (C-level
O(1) moves): a store touches the nodes it walked, deepest first, then its parent; a match
touches the path of the deepest match, deepest first, so a prefix is always more recent than
the blocks below it that queries reached through it. Past the limit the least recent node goes
with its whole subtree, for every slot holding it: blocks below it can only match through it,
and dropping them leaves no dormant garbage. To a slot this is exactly a `removed` event for
those blocks, so a later removal of an evicted block is just an unknown removal. Lower-tier
blocks are dropped oldest store first (queries do not touch them: `lower.evict_lower`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo_lite.indexer.tree.names import forget_names
from dynamo_lite.indexer.tree.nodes import Node
from dynamo_lite.indexer.tree.remove import prune
from dynamo_lite.indexer.tree.runs import cut

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree


def evict_device(tree: PrefixTree) -> None:
    """Drop least recently used nodes, each with its subtree, until the pairs fit."""
    recent = tree.recent
    assert recent is not None
    while tree.device_blocks > tree.max_blocks and recent:
        victim, _ = recent.popitem(last=False)
        assert victim.__class__ is Node  # a limited tree has no chains
        dropped = drop_subtree(tree, victim)
        tree.device_blocks -= dropped
        tree.evicted_blocks += dropped


def drop_subtree(tree: PrefixTree, top: Node) -> int:
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
    recent = tree.recent
    assert recent is not None
    dormant = tree.dormant
    by_bit = tree.by_bit
    dropped = 0
    for member in reversed(doomed):  # deepest first: each cut ends a run one node sooner
        if member.run is not None:
            cut(member)
        mask = member.holders | dormant.pop(member, 0)
        if member is not top:
            recent.pop(member, None)
            member.child = None
            member.parent = None
            forget_names(tree, member)
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
    prune(tree, top)
    return dropped
