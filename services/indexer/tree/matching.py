"""Matching a query: the device walk (runs and chains compared a slice at a time, see
`runs`), recency for a limited tree, and each slot's continuation on the lower tiers."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dynamo_lite.base.integers import U64_MODULUS
from dynamo_lite.hashing import to_unsigned_list
from dynamo_lite.indexer.tree.lower import match_lower
from dynamo_lite.indexer.tree.nodes import Chain, Node, consume
from dynamo_lite.indexer.tree.runs import Run, Stop, common, settle_run

if TYPE_CHECKING:
    from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
    from dynamo_lite.indexer.tree.slots import WorkerKey


@dataclass(slots=True)
class MatchResult:
    """Per slot, in blocks, zero entries left out: `device` is the leading run of query blocks
    held on the device tier; `host_pinned` the blocks the host tier adds after it; `disk` the
    blocks the disk and external tiers add after that."""

    device: dict[WorkerKey, int] = field(default_factory=dict)
    host_pinned: dict[WorkerKey, int] = field(default_factory=dict)
    disk: dict[WorkerKey, int] = field(default_factory=dict)


def match(tree: PrefixTree, local_hashes: Sequence[int]) -> MatchResult:
    """Device score and lower-tier continuation of every slot; hashes may be u64 or i64."""
    by_bit = tree.by_bit
    stops = tree._match_device(local_hashes)
    recent = tree.recent
    if recent is not None and stops:
        # Deepest first, so every prefix ends up more recent than what lies below it; a
        # run's part of the path in one C-level pass.
        _, depth, last = stops[-1]
        # Any: a limited tree has nodes only (no chain, so no stop inside one), each with a
        # parent up to the root, which mypy cannot tell from `Piece | None`.
        node: Any = last
        index = depth - 1  # the query position of `node`
        root = tree.root
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
            consume(map(move, reversed(nodes[: index - top + 1])))
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
    lower = tree.lower
    if local_hashes and (lower["host_pinned"] or lower["disk"] or lower["external"]):
        match_lower(tree, to_unsigned_list(local_hashes), stops, result)
    return result


def match_device(tree: PrefixTree, local_hashes: Sequence[int]) -> list[Stop]:
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
    node: Any = tree.root
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
                    settle_run(pending, depth, marks, pending_stops, extend)
                    pending = []
                    marks = []
                    pending_stops = []
                extend = None
                matched, signed = common(query, depth, end, child, signed)
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
            settle_run(pending, depth, marks, pending_stops, extend)
            pending = []
            marks = []
            pending_stops = []
        # `child` heads its run: a run's other nodes can only be reached through it.
        matched, signed = common(query, depth, end, run, signed)
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
        settle_run(pending, depth, marks, pending_stops, extend)
    if depth and alive:
        stops.append((alive, depth, node))
    return stops
