"""`--max-blocks`: the prefix tree against a model that applies the same LRU rules.

Model (device tier), per partition:

* each worker holds a set of chains (tuples of content ids), exactly as in
  `test_indexer_model`: a store is refused when its parent chain is not held, a removal deletes
  one chain (the chains below it stay held but cannot match), a clear deletes them all;
* recency is kept per chain held by anyone: a store touches the chains it stored, deepest
  first, then its parent; a query touches the chain of its best match and every prefix of it,
  deepest first;
* while more (worker, chain) pairs are held than the limit, the least recent chain goes, with
  every chain that extends it, for every worker.

After every step the tree must answer every query as the model does, hold the same pairs, keep
the same recency order and count the same evictions.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from starlette.testclient import TestClient

from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.app import IndexerConfig, create_app
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document
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
        assert self.tree._recent is not None
        assert [chain_of(node) for node in self.tree._recent] == self.recent

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


TestEviction = EvictionMachine.TestCase
TestEviction.settings = settings(
    max_examples=max(150, settings.default.max_examples),  # HYPOTHESIS_PROFILE=long: 10,000
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_unlimited_tree_keeps_no_recency() -> None:
    tree = PrefixTree()
    tree.store((1, 0), None, [11, 12], [LOCALS[0], LOCALS[1]])
    assert tree._recent is None and tree.device_blocks == 2 and tree.evicted_blocks == 0


def test_lower_tier_drops_oldest_store_first() -> None:
    tree = PrefixTree(max_blocks=2)
    tree.store((1, 0), None, [11], [LOCALS[0]], "host_pinned")
    tree.store((1, 0), 11, [12], [LOCALS[1]], "host_pinned")
    tree.store((1, 0), 11, [12], [LOCALS[1]], "host_pinned")  # re-store: 12 is now the newest
    tree.store((2, 0), None, [21], [LOCALS[0]], "host_pinned")
    assert tree.block_count((1, 0), "host_pinned") == 1
    assert tree.block_count((2, 0), "host_pinned") == 1
    assert tree.evicted_blocks == 1
    assert tree.remove((1, 0), [11], "host_pinned") == 1  # evicted: an unknown removal
    assert [e.data.block_hashes for e in tree.dump()] == [[12], [21]]


def test_indexer_counts_evictions_per_partition_and_after_unregister() -> None:
    indexer = Indexer(max_blocks=4)

    def stored(model: str, worker: int, hashes: list[int]) -> dict:
        return {f"{model}:default": {"block_size": 16, "events": [{"worker_id": worker, "event": {
            "event_id": hashes[0], "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": h, "tokens_hash": h * 7} for h in hashes]}}}}]}}

    indexer.apply_events(parse_events_document(stored("a", 1, [1, 2, 3])))
    indexer.apply_events(parse_events_document(stored("a", 1, [10, 11, 12])))  # evicts 3, then 2
    indexer.apply_events(parse_events_document(stored("b", 2, [1, 2, 3, 4])))  # its own budget
    assert indexer.evicted_blocks_total == 2
    assert [w.ranks[0].blocks for w in indexer.workers()] == [4, 4]
    assert query_answer(indexer.query("a", "default", [7, 14, 21]))["scores"] == {"1": {"0": 16}}
    assert query_answer(indexer.query("a", "default", [70, 77, 84]))["scores"] == {"1": {"0": 48}}
    indexer.unregister(1, "a", "default")
    assert indexer.evicted_blocks_total == 2  # kept after its partition is gone


def test_evictions_show_in_metrics_and_workers() -> None:
    with TestClient(create_app(IndexerConfig(max_blocks=2))) as client:
        document = {"m:default": {"block_size": 4, "events": [{"worker_id": 1, "event": {
            "event_id": 0, "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": h, "tokens_hash": h} for h in (1, 2, 3)]}}}}]}}
        assert client.post("/events", json=document).json()["applied"] == 1
        assert client.get("/workers").json()[0]["ranks"][0]["blocks"] == 2
        assert "dynamo_lite_indexer_evicted_blocks_total 1.0" in client.get("/metrics").text
        removal = {"m:default": {"block_size": 4, "events": [{"worker_id": 1, "event": {
            "event_id": 1, "dp_rank": 0, "data": {"removed": {"block_hashes": [3]}}}}]}}
        assert client.post("/events", json=removal).json()["unknown_removals"] == 1
