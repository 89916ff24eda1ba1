"""Runs: the query's fast path.

Walking a 512-block query node by node costs ~50 ns of bytecode per block. A match therefore
leaves `Run`s behind on the paths it walked: a run is a list of consecutive nodes of one path
(through branch points too), with their local hashes as a list (u64 and/or i64, each made when
a query first needs it) and the holders changes along it (`marks`, and the stops a match
records there, which never change while the run stands). A later match that reaches a run's
first node compares the query with the run's hashes in one C-level list comparison, takes the
run's stops, and goes on from its last node; where the query differs inside the run, a binary
search of slice comparisons finds the first difference and the walk continues node by node
from there (into another branch, if there is one). The answer is the node-by-node walk's, stop
for stop, whatever the mix of u64 and i64 forms in the query (`matching`).

A run is only true while the holders of its nodes stay as they were: every change of a node's
holders first cuts the node's run just above it (`cut`, which pops the nodes from the end, so
a tail-first removal costs O(1)); new children and pruned side branches do not change a path.
So `node.run is run` exactly when `node in run.nodes`. Runs cost a slot per node, and per node
in a run a list entry per form made (plus an int object for each i64 hash that is negative).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Union

from dynamo_lite.base.integers import I64_MAX, U64_MODULUS
from dynamo_lite.indexer.tree.nodes import Chain, Node

# Queries make runs of at least this many nodes (shorter stretches are walked node by node).
MIN_RUN = 8

# Where a stop's slots stop: the last block they hold, a node, a chain (its last block) or a
# (chain, index) point inside one.
StopAt = Union[Node, Chain, tuple[Chain, int]]
Stop = tuple[int, int, StopAt]  # (slots that stop here, depth, last block they hold)


class Run:
    """A path of nodes that a match walked: a later match that reaches its first node compares
    the query against the run's local hashes in one C-level list comparison instead of node by
    node, and takes the holders changes along it from `stops`.

    Holders changes cut the run just above the node (`cut`), so `node.run is run` exactly
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


def cut(node: Node) -> None:
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


def settle_run(pending: list[Node], end: int, marks: list[int], stops: list[Stop], extend: Run | None) -> None:
    """Nodes a match walked one by one, up to query position `end`: a run of their own, or
    the continuation of `extend`, the run walked whole just before them."""
    if extend is not None:
        extend.extend(pending, marks, stops)
    elif len(pending) >= MIN_RUN:
        Run(pending, end - len(pending), marks, stops)


def common(query: list[int], start: int, end: int, run: Run | Chain, signed: bool) -> tuple[int, bool]:
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
