"""EvictionMachine: a bounded prefix tree driven by hypothesis against a recency model;
test_indexer_eviction runs it, test_indexer_tree_runs runs it with short runs."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynamo_lite.indexer.tree import Node, PrefixTree, StoreStatus

WORKERS = [(1, 0), (1, 1), (2, 0)]
LOCALS = [0x1111, 0x2222, 0x3333]  # local hash of content id 0, 1, 2
Chain = tuple[int, ...]


def ext(worker: tuple[int, int], chain: Chain) -> int:
    """A worker's external hash for a chain: unique per (worker, chain), like a real engine's."""
    return hash((worker, chain)) & (2**63 - 1) or 1


def locals_of(chain: Chain) -> list[int]:
    return [LOCALS[c] for c in chain]


def chain_of(node: Node) -> Chain:
    path = []
    while node.parent is not None:
        path.append(LOCALS.index(node.local))
        node = node.parent
    return tuple(reversed(path))


chains = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


class EvictionMachine(RuleBasedStateMachine):
    @initialize(limit=st.integers(1, 12))
    def start(self, limit: int) -> None:
        self.limit = limit
        self.tree = PrefixTree(max_blocks=limit)
        self.held: dict[tuple[int, int], set[Chain]] = {w: set() for w in WORKERS}
        self.recent: list[Chain] = []  # least recent first
        self.evicted = 0

    # --- model --------------------------------------------------------------------------------

    def _touch(self, chain: Chain) -> None:
        if chain in self.recent:
            self.recent.remove(chain)
        self.recent.append(chain)

    def _forget_if_unheld(self, chain: Chain) -> None:
        if chain in self.recent and not any(chain in held for held in self.held.values()):
            self.recent.remove(chain)

    def _enforce(self) -> None:
        while sum(map(len, self.held.values())) > self.limit:
            victim = self.recent.pop(0)
            for held in self.held.values():
                doomed = {c for c in held if c[: len(victim)] == victim}
                held -= doomed
                self.evicted += len(doomed)
            self.recent = [c for c in self.recent if c[: len(victim)] != victim]

    def _score(self, worker: tuple[int, int], query: Chain) -> int:
        depth = 0
        while depth < len(query) and query[: depth + 1] in self.held[worker]:
            depth += 1
        return depth

    # --- rules --------------------------------------------------------------------------------

    @rule(worker=st.sampled_from(WORKERS), chain=chains, start=st.integers(0, 5))
    def store(self, worker: tuple[int, int], chain: Chain, start: int) -> None:
        start = min(start, len(chain) - 1)
        parent = chain[:start]
        status = self.tree.store(
            worker,
            ext(worker, parent) if parent else None,
            [ext(worker, chain[:j]) for j in range(start + 1, len(chain) + 1)],
            locals_of(chain[start:]),
        )
        if parent and parent not in self.held[worker]:
            assert status is StoreStatus.UNKNOWN_PARENT
            return
        assert status is StoreStatus.STORED
        for j in range(len(chain), start, -1):
            self.held[worker].add(chain[:j])
            self._touch(chain[:j])
        if parent:
            self._touch(parent)
        self._enforce()

    @rule(worker=st.sampled_from(WORKERS), chain=chains)
    def remove(self, worker: tuple[int, int], chain: Chain) -> None:
        unknown = self.tree.remove(worker, [ext(worker, chain)])
        # A block the limit evicted (or never stored) is an unknown removal, not an error.
        assert unknown == (0 if chain in self.held[worker] else 1)
        self.held[worker].discard(chain)
        self._forget_if_unheld(chain)

    @rule(worker=st.sampled_from(WORKERS))
    def clear(self, worker: tuple[int, int]) -> None:
        self.tree.clear(worker)
        dropped, self.held[worker] = self.held[worker], set()
        for chain in dropped:
            self._forget_if_unheld(chain)

    @rule(query=chains)
    def query(self, query: Chain) -> None:
        expected = {w: self._score(w, query) for w in WORKERS}
        assert self.tree.match(locals_of(query)).device == {w: s for w, s in expected.items() if s}
        best = max(expected.values())
        for depth in range(best, 0, -1):
            self._touch(query[:depth])

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def same_pairs(self) -> None:
        assert self.tree.device_blocks == sum(map(len, self.held.values())) <= self.limit
        for worker in WORKERS:
            slot = self.tree.slots.get(worker)
            names = set(slot.blocks) if slot is not None else set()
            assert names == {ext(worker, chain) for chain in self.held[worker]}

    @invariant()
    def same_recency(self) -> None:
        assert self.tree.recent is not None
        assert [chain_of(node) for node in self.tree.recent] == self.recent

    @invariant()
    def same_evictions(self) -> None:
        assert self.tree.evicted_blocks == self.evicted

    @invariant()
    def dump_rebuilds_the_answers(self) -> None:
        copy = PrefixTree()
        for event in self.tree.dump():
            assert copy.store((event.worker_id, event.dp_rank), event.data.parent_hash,
                              event.data.block_hashes, event.data.tokens_hashes) is StoreStatus.STORED
        for query in [(0, 0, 0), (0, 1, 2), (1, 2, 0), (2, 2, 2), (0, 1, 0, 1)]:
            expected = {w: self._score(w, query) for w in WORKERS}
            assert copy.match(locals_of(query)).device == {w: s for w, s in expected.items() if s}
