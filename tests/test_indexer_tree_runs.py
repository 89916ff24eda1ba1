"""The query's runs (paths compared a list slice at a time) against walking node by node and
against a naive model, on random event streams with long chained prompts that branch, removals
mid-chain and tail-first, clears, dropped workers, dp ranks, lower tiers and eviction; queries
in u64, i64 and mixed forms, with repeats, diverging and running past what is stored.

`MIN_RUN` is lowered so that even short stretches become runs, and the model suites
(test_indexer_model, test_indexer_eviction) are run again with it.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.eviction_machine import EvictionMachine
from support.index_model_machine import IndexModel

from dynamo_lite.base.integers import U64_MODULUS
from dynamo_lite.hashing import to_signed
from dynamo_lite.indexer.answers import query_answer, tiered_answer
from dynamo_lite.indexer.core import Indexer, QueryResult
from dynamo_lite.indexer.protocols import parse_events_document
from dynamo_lite.indexer.tree import Chain, MatchResult, Node, PrefixTree, Run, StoreStatus
from dynamo_lite.indexer.tree import runs as runs_module

pytestmark = pytest.mark.unit

WORKERS = [(1, 0), (1, 1), (2, 0), (3, 0), (4, 2)]
_rng = random.Random(99)
# Content ids -> local hashes: half above 2**63 (negative as i64), one tiny, one at the edges.
LOCALS = [_rng.getrandbits(63) | (i % 2) << 63 for i in range(5)] + [3, 2**63, 2**63 - 1, 2**64 - 1]
Path = tuple[int, ...]


def ext(worker: tuple[int, int], path: Path) -> int:
    """A worker's external hash of a chain (Python's `hash` would collide: hash(2**63 - 1) == 3)."""
    return xxhash.xxh64_intdigest(repr((worker, path)).encode()) or 1


# --- reference: the walk before runs, node by node ---------------------------------------------


def plain_stops(tree: PrefixTree, hashes: list[int]) -> list[tuple[int, int, Node]]:
    stops: list[tuple[int, int, Node]] = []
    node = tree.root
    alive = -1
    depth = 0
    for depth, local in enumerate(hashes):
        if local < 0:
            local += U64_MODULUS
        if isinstance(node, tuple) and node[1] + 1 < len(node[0]):
            # Inside a chain (a block at a time): same holders, so no stop.
            chain, index = node
            if chain.locals[index + 1] != local:
                break
            node = (chain, index + 1)
            continue
        parent = node[0] if isinstance(node, tuple) else node
        child = parent.child
        if child.__class__ is Node or child.__class__ is Chain:
            if child.local != local:
                break
        elif child is None:
            break
        else:
            child = child.get(local)
            if child is None:
                break
        holders = child.holders
        if holders != alive:
            if depth:
                stops.append((alive ^ holders, depth, node))
            alive = holders
            if not holders:
                break
        node = (child, 0) if child.__class__ is Chain else child
    else:
        depth = len(hashes)
    if depth and alive:
        stops.append((alive, depth, node))
    return stops


def plain_match(tree: PrefixTree, hashes: list[int]) -> MatchResult:
    tree._match_device = lambda query: plain_stops(tree, list(query))  # type: ignore[method-assign]
    try:
        return tree.match(hashes)
    finally:
        del tree._match_device


def check_runs(tree: PrefixTree) -> None:
    """Every run is a linked path of held nodes that point back at it, with true marks,
    stops and hash forms; every node's run lists it."""
    depth_of: dict[Node, int] = {}
    runs: dict[int, Run] = {}
    stack = [(tree.root, 0)]
    while stack:
        node, depth = stack.pop()
        depth_of[node] = depth
        if node.run is not None:
            assert any(member is node for member in node.run.nodes)
            runs[id(node.run)] = node.run
        child = node.child
        children = [] if child is None else list(child.values()) if child.__class__ is dict else [child]
        stack.extend((c, depth + (len(c) if c.__class__ is Chain else 1)) for c in children)  # a chain: its last block
    assert tree.root.run is None
    for run in runs.values():
        nodes = run.nodes
        assert nodes
        for above, below in zip(nodes, nodes[1:]):
            assert below.parent is above
            assert above.child is below or (isinstance(above.child, dict) and above.child[below.local] is below)
        for node in nodes:
            assert node.run is run and node in depth_of and node.holders
        assert run.start == depth_of[nodes[0]] - 1
        marks = [i for i in range(1, len(nodes)) if nodes[i].holders != nodes[i - 1].holders]
        assert run.marks == marks
        assert run.stops == [
            (nodes[i - 1].holders ^ nodes[i].holders, depth_of[nodes[i - 1]], nodes[i - 1]) for i in marks
        ]
        for a, b in zip(run.stops, run.stops[1:]):
            assert a[1] < b[1]
        if run.unsigned is not None:
            assert run.unsigned == [node.local for node in nodes]
        if run.signed is not None:
            assert run.signed == [to_signed(node.local) for node in nodes]


def forms(query: list[int], how: str, rng: random.Random) -> list[int]:
    if how == "u64":
        return list(query)
    if how == "i64":
        return [to_signed(h) for h in query]
    return [to_signed(h) if rng.random() < 0.5 else h for h in query]


@pytest.fixture
def small_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs_module, "MIN_RUN", 1)


# --- the machine ------------------------------------------------------------------------------


class RunsMachine(RuleBasedStateMachine):
    """Random streams on one tree; every query is answered twice (runs made, then used) and
    compared with the node-by-node walk on the same tree (stops, lower tiers, recency), and
    with the model's device scores when nothing is evicted."""

    def __init__(self) -> None:
        super().__init__()
        self._min_run = runs_module.MIN_RUN

    def teardown(self) -> None:
        runs_module.MIN_RUN = self._min_run

    @initialize(
        prompts=st.lists(st.lists(st.integers(0, len(LOCALS) - 1), min_size=1, max_size=30), min_size=2, max_size=6),
        min_run=st.sampled_from([1, 1, 2, 3, 8]),
        limit=st.sampled_from([0, 0, 0, 7, 40]),
        rng=st.randoms(use_true_random=False),  # its calls are hypothesis draws: they shrink
    )
    def setup(self, prompts: list[list[int]], min_run: int, limit: int, rng: random.Random) -> None:
        runs_module.MIN_RUN = min_run
        self.rng = rng
        # Prompts continue one another (chat turns) so that they share prefixes and branch.
        self.prompts: list[Path] = []
        for content in prompts:
            base = self.prompts[len(content) % len(self.prompts)] if self.prompts else ()
            self.prompts.append(base[: self.rng.randint(0, len(base))] + tuple(LOCALS[c] for c in content))
        self.limit = limit
        self.tree = PrefixTree(max_blocks=limit, chains=False)  # runs are made on nodes
        self.held: dict[tuple[int, int], set[Path]] = {w: set() for w in WORKERS}

    def _prompt(self, which: int) -> Path:
        return self.prompts[which % len(self.prompts)]

    @rule(
        worker=st.sampled_from(WORKERS), which=st.integers(0, 10), start=st.integers(0, 40), length=st.integers(1, 40)
    )
    def store(self, worker: tuple[int, int], which: int, start: int, length: int) -> None:
        prompt = self._prompt(which)
        start = min(start, len(prompt) - 1)
        end = min(len(prompt), start + length)
        parent = prompt[:start]
        status = self.tree.store(
            worker,
            ext(worker, parent) if parent else None,
            [ext(worker, prompt[: j + 1]) for j in range(start, end)],
            list(prompt[start:end]),
        )
        if not self.limit:  # (with a limit, the parent may have been evicted)
            held = not parent or parent in self.held[worker]
            assert status is (StoreStatus.STORED if held else StoreStatus.UNKNOWN_PARENT)
        if status is StoreStatus.STORED:
            self.held[worker].update(prompt[: j + 1] for j in range(start, end))

    @rule(
        worker=st.sampled_from(WORKERS), pick=st.integers(0, 10_000), count=st.integers(1, 6), tail_first=st.booleans()
    )
    def remove(self, worker: tuple[int, int], pick: int, count: int, tail_first: bool) -> None:
        held = sorted(self.held[worker])
        if not held:
            return
        if tail_first:
            leaf = max(held, key=lambda p: (len(p), p)) if pick % 2 else held[pick % len(held)]
            doomed = [leaf[:i] for i in range(len(leaf), 0, -1) if leaf[:i] in self.held[worker]][:count]
        else:
            doomed = [held[(pick + 7 * i) % len(held)] for i in range(count)]
            doomed = list(dict.fromkeys(doomed))
        unknown = self.tree.remove(worker, [ext(worker, p) for p in doomed])
        if not self.limit:
            assert unknown == 0
        self.held[worker] -= set(doomed)

    @rule(worker=st.sampled_from(WORKERS), which=st.integers(0, 10), at=st.integers(0, 40),
          how=st.sampled_from(["u64", "i64"]))
    def remove_mid_chain_then_restore(self, worker: tuple[int, int], which: int, at: int, how: str) -> None:
        """A gap in a held chain, a query over what is below it, then the gap filled again:
        the blocks below come back (promoted) under runs the query made."""
        prompt = self._prompt(which)
        at = min(at, len(prompt) - 1)
        if prompt[: at + 1] not in self.held[worker]:
            return
        self.tree.remove(worker, [ext(worker, prompt[: at + 1])])
        self.held[worker].discard(prompt[: at + 1])
        self._check(list(prompt), how)
        parent = prompt[:at]
        if parent and parent not in self.held[worker]:
            return
        status = self.tree.store(
            worker, ext(worker, parent) if parent else None, [ext(worker, prompt[: at + 1])], [prompt[at]]
        )
        assert status is StoreStatus.STORED or self.limit  # with a limit, the parent may be gone
        if status is StoreStatus.STORED:
            self.held[worker].add(prompt[: at + 1])
        self._check(list(prompt), how)

    @rule(worker=st.sampled_from(WORKERS), which=st.integers(0, 10), start=st.integers(0, 30),
          tier=st.sampled_from(["host_pinned", "disk", "external"]))
    def store_lower(self, worker: tuple[int, int], which: int, start: int, tier: str) -> None:
        prompt = self._prompt(which)
        start = min(start, len(prompt) - 1)
        parent = prompt[:start]
        end = min(len(prompt), start + 3)
        self.tree.store(
            worker,
            ext(worker, parent) if parent else None,
            [ext(worker, prompt[: j + 1]) for j in range(start, end)],
            list(prompt[start:end]),
            tier,
        )

    @rule(worker=st.sampled_from(WORKERS))
    def clear(self, worker: tuple[int, int]) -> None:
        self.tree.clear(worker)
        self.held[worker] = set()

    @rule(worker=st.sampled_from(WORKERS))
    def drop(self, worker: tuple[int, int]) -> None:
        self.tree.drop_worker(worker)
        self.held[worker] = set()

    @rule(which=st.integers(0, 10), cut=st.integers(0, 40), tail=st.lists(st.integers(0, len(LOCALS) - 1), max_size=4),
          how=st.sampled_from(["u64", "i64", "mixed"]), doubled=st.booleans())
    def query(self, which: int, cut: int, tail: list[int], how: str, doubled: bool) -> None:
        prompt = list(self._prompt(which))
        query = prompt[: min(cut, len(prompt))] + [LOCALS[c] for c in tail]
        if doubled:
            query = query + query
        self._check(query, how)

    @rule(which=st.integers(0, 10), at=st.integers(0, 40), how=st.sampled_from(["u64", "i64", "mixed"]),
          flip=st.sampled_from([1, 2**63, 2**64 - 1]))
    def query_diverging(self, which: int, at: int, how: str, flip: int) -> None:
        """The whole prompt (runs made), then the prompt with one hash changed: the walk
        leaves a run at that point, with holders changes on both sides of it."""
        prompt = list(self._prompt(which))
        self._check(prompt, how)
        at = min(at, len(prompt) - 1)
        prompt[at] ^= flip
        self._check(prompt, how)

    @rule(which=st.integers(0, 10), other=st.integers(0, 10), how=st.sampled_from(["u64", "i64", "mixed"]))
    def query_many(self, which: int, other: int, how: str) -> None:
        """Queries that differ in length and branch, one after the other, as a router sends."""
        for prompt in (self._prompt(which), self._prompt(other)):
            for end in sorted({len(prompt), len(prompt) // 2, 1, len(prompt) - 1}):
                if end:
                    self._check(list(prompt[:end]), how)

    def _check(self, query: list[int], how: str) -> None:
        sent = forms(query, how, self.rng)
        expected = plain_match(self.tree, sent)
        for _ in range(2):  # the first answer may make runs, the second uses them
            assert self.tree.match(sent) == expected, (query, how)
            assert self.tree._match_device(tuple(sent)) == plain_stops(self.tree, sent)
        if not self.limit:
            model = {}
            for worker, held in self.held.items():
                score = 0
                while score < len(query) and tuple(query[: score + 1]) in held:
                    score += 1
                if score:
                    model[worker] = score
            assert expected.device == model

    @invariant()
    def runs_are_true(self) -> None:
        check_runs(self.tree)

    @invariant()
    def every_prompt_answers_like_the_plain_walk(self) -> None:
        for prompt in self.prompts:
            result = self.tree.match(list(prompt)).device
            assert result == plain_match(self.tree, list(prompt)).device


def machine_settings(examples: int) -> settings:
    """Long state-machine runs, at least `examples` of them (more when the profile asks)."""
    return settings(
        max_examples=max(examples, settings.default.max_examples),
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


TestRuns = RunsMachine.TestCase
TestRuns.settings = machine_settings(200)


# --- the model suites again, with runs everywhere ----------------------------------------------


class SmallRuns:
    """Makes a run of even the shortest stretch while the state machine runs."""

    def __init__(self) -> None:
        super().__init__()
        self._min_run = runs_module.MIN_RUN
        runs_module.MIN_RUN = 1

    def teardown(self) -> None:
        runs_module.MIN_RUN = self._min_run
        super().teardown()  # type: ignore[misc]


class SmallRunsIndexModel(SmallRuns, IndexModel):
    chains = False  # runs are made on nodes

    @invariant()
    def runs_are_true(self) -> None:
        if hasattr(self, "tree"):
            check_runs(self.tree)
            for prompt in self.prompts:
                assert self.tree.match(prompt) == plain_match(self.tree, prompt)


class SmallRunsEviction(SmallRuns, EvictionMachine):
    @invariant()
    def runs_are_true(self) -> None:
        if hasattr(self, "tree"):
            check_runs(self.tree)


TestSmallRunsIndexModel = SmallRunsIndexModel.TestCase
TestSmallRunsIndexModel.settings = machine_settings(150)
TestSmallRunsEviction = SmallRunsEviction.TestCase
TestSmallRunsEviction.settings = machine_settings(150)


# --- examples ---------------------------------------------------------------------------------


def test_a_run_spans_holders_changes_and_is_cut_where_they_change(small_runs: None) -> None:
    tree = PrefixTree(chains=False)
    chain = LOCALS * 4
    for w, depth in zip(WORKERS, (36, 30, 20, 9)):
        tree.store(w, None, [ext(w, tuple(chain[: i + 1])) for i in range(depth)], chain[:depth])
    assert tree.match(chain).device == {(1, 0): 36, (1, 1): 30, (2, 0): 20, (3, 0): 9}
    head = tree.root.child
    run = head.run
    assert run is not None and len(run.nodes) == 36 and run.marks == [9, 20, 30]
    assert tree.match([to_signed(h) for h in chain]).device == {(1, 0): 36, (1, 1): 30, (2, 0): 20, (3, 0): 9}
    tree.remove((1, 1), [ext((1, 1), tuple(chain[:25]))])  # mid-chain: cut at depth 25
    assert len(run.nodes) == 24 and run.marks == [9, 20]
    check_runs(tree)
    assert tree.match(chain).device == {(1, 0): 36, (1, 1): 24, (2, 0): 20, (3, 0): 9}
    check_runs(tree)
    tree.clear((1, 0))
    assert tree.match(chain[:30] + [5]).device == {(1, 1): 24, (2, 0): 20, (3, 0): 9}
    check_runs(tree)


def test_a_query_diverging_inside_a_run_or_at_a_branch_below_it(small_runs: None) -> None:
    tree = PrefixTree(chains=False)
    a, b = (1, 0), (2, 0)
    chain = [LOCALS[i % len(LOCALS)] ^ i for i in range(50)]
    tree.store(a, None, [ext(a, tuple(chain[: i + 1])) for i in range(50)], chain)
    assert tree.match(chain).device == {a: 50}
    branch = chain[:20] + [7, 8, 9]
    tree.store(b, None, [ext(b, tuple(branch[: i + 1])) for i in range(23)], branch)
    for query, device in (
        (chain[:33] + [1], {a: 33, b: 20}),
        (branch, {b: 23, a: 20}),
        (chain[:19] + [-1], {a: 19, b: 19}),
        ([to_signed(h) for h in branch] + chain, {b: 23, a: 20}),
        (chain, {a: 50, b: 20}),
    ):
        for _ in range(2):
            assert tree.match(query).device == device == plain_match(tree, query).device
            check_runs(tree)


def test_leaving_a_run_takes_only_the_stops_above_the_difference(small_runs: None) -> None:
    tree = PrefixTree(chains=False)
    chain = LOCALS * 5
    depths = (40, 33, 25, 18, 9)
    for w, depth in zip(WORKERS, depths):
        tree.store(w, None, [ext(w, tuple(chain[: i + 1])) for i in range(depth)], chain[:depth])
    tree.match(chain)
    assert tree.root.child.run.marks == [9, 18, 25, 33]
    for at in range(40):
        query = list(chain)
        query[at] ^= 1
        expected = plain_stops(tree, query)
        assert tree._match_device(query) == expected
        assert [stop[1] for stop in expected] == [d for d in sorted(depths) if d < at] + ([at] if at else [])
        assert tree.match(query).device == {w: min(d, at) for w, d in zip(WORKERS, depths) if at}
        check_runs(tree)


def test_filling_a_gap_revives_the_blocks_below_under_a_run(small_runs: None) -> None:
    tree = PrefixTree(chains=False)
    a, b = (1, 0), (2, 0)
    chain = LOCALS * 3
    for w in (a, b):
        tree.store(w, None, [ext(w, tuple(chain[: i + 1])) for i in range(27)], chain)
    tree.remove(a, [ext(a, tuple(chain[:10]))])
    assert tree.match(chain).device == {a: 9, b: 27}
    assert tree.root.child.run is not None
    tree.store(a, ext(a, tuple(chain[:9])), [ext(a, tuple(chain[:10]))], [chain[9]])
    check_runs(tree)
    assert tree.match(chain).device == {a: 27, b: 27}
    check_runs(tree)


def test_filling_a_gap_cuts_a_run_that_starts_below_it(small_runs: None) -> None:
    """A run that starts at a branch below the gap: reviving the blocks under it changes the
    holders inside it (a holds 21 blocks, b 27), so it must be cut there."""
    tree = PrefixTree(chains=False)
    a, b, c = (1, 0), (2, 0), (3, 0)
    chain = LOCALS * 3
    other = chain[:10] + [11, 12, 13]
    tree.store(a, None, [ext(a, tuple(chain[: i + 1])) for i in range(21)], chain[:21])
    tree.store(b, None, [ext(b, tuple(chain[: i + 1])) for i in range(27)], chain)
    tree.store(c, None, [ext(c, tuple(other[: i + 1])) for i in range(13)], other)
    tree.remove(a, [ext(a, tuple(chain[:10]))])  # a gap at depth 10: a's 11..21 are dormant
    tree.match(other)  # one run down to the branch and along c's side
    assert tree.match(chain).device == {a: 9, b: 27, c: 10}  # a run that starts below the branch
    below = tree.root.child.child.child.child.child.child.child.child.child.child.child[chain[10]]
    assert below.run is not None and below.run.nodes[0] is below
    check_runs(tree)
    tree.store(a, ext(a, tuple(chain[:9])), [ext(a, tuple(chain[:10]))], [chain[9]])
    check_runs(tree)
    assert tree.match(chain).device == {a: 21, b: 27, c: 10}
    check_runs(tree)


def test_mixed_forms_within_one_run(small_runs: None) -> None:
    tree = PrefixTree(chains=False)
    w = (1, 0)
    chain = [LOCALS[i % 2] ^ i for i in range(40)]  # alternately above and below 2**63
    assert sum(h >= 2**63 for h in chain) == 20
    tree.store(w, None, [ext(w, tuple(chain[: i + 1])) for i in range(40)], chain)
    tree.match(chain)
    for flip in range(0, 40, 3):
        query = [to_signed(h) if i >= flip else h for i, h in enumerate(chain)]
        query[flip] = to_signed(query[flip]) if query[flip] >= 0 else query[flip] + U64_MODULUS
        assert tree.match(query).device == {w: 40}
        bad = list(query)
        bad[min(flip + 5, 39)] ^= 1
        assert tree.match(bad).device == {w: min(flip + 5, 39)} == plain_match(tree, bad).device


# --- the query answer, byte for byte ----------------------------------------------------------


def reference_answer(indexer: Indexer, model_name: str, tenant_id: str, hashes: list[int]) -> dict[str, Any]:
    """`Indexer.query` and `query_answer` as they were before runs and cached labels: the
    node-by-node walk, and the answer shaped the general way, for every tier."""
    partition = indexer.partitions[(model_name, tenant_id)]
    match = plain_match(partition.tree, hashes)
    return tiered_answer(QueryResult(partition.block_size, match.device, match.host_pinned, match.disk))


@pytest.mark.parametrize("min_run", [1, 8])
@pytest.mark.parametrize("limit", [0, 25])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_query_answers_are_unchanged_byte_for_byte(min_run: int, limit: int, data: st.DataObject) -> None:
    saved = runs_module.MIN_RUN
    runs_module.MIN_RUN = min_run
    try:
        _answers_are_unchanged(limit, data)
    finally:
        runs_module.MIN_RUN = saved


def _answers_are_unchanged(limit: int, data: st.DataObject) -> None:
    rng = data.draw(st.randoms(use_true_random=False), label="rng")  # its calls are hypothesis draws: they shrink
    block_size = data.draw(st.sampled_from([1, 16]), label="block_size")
    prompts: list[list[int]] = []
    for _ in range(data.draw(st.integers(2, 5), label="prompts")):
        base = rng.choice(prompts) if prompts else []
        prompts.append(base[: rng.randint(0, len(base))] + [rng.choice(LOCALS) for _ in range(rng.randint(1, 40))])
    indexer = Indexer(max_blocks=limit)
    ranks = [(instance, rank) for instance in (7, 8, 10) for rank in (0, 1, 2)]
    event_ids = dict.fromkeys(ranks, 0)
    held: dict[tuple[int, int], list[list[int]]] = {key: [] for key in ranks}

    def send(key: tuple[int, int], data_: dict[str, Any], tier: str = "device") -> None:
        event: dict[str, Any] = {"event_id": event_ids[key], "dp_rank": key[1], "data": data_}
        if tier != "device":
            event["storage_tier"] = tier
        event_ids[key] += 1
        document = {"m:t": {"block_size": block_size, "events": [{"worker_id": key[0], "event": event}]}}
        indexer.apply_events(parse_events_document(document))

    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        key = rng.choice(ranks)
        action = rng.random()
        prompt = rng.choice(prompts)
        if action < 0.55:
            start = min(rng.randint(0, len(prompt)), len(prompt) - 1) if rng.random() < 0.3 else 0
            end = rng.randint(start + 1, len(prompt))
            tier = "device" if rng.random() < 0.8 else rng.choice(["host_pinned", "disk", "external"])
            parent = ext(key, tuple(prompt[:start])) if start else None
            blocks = [
                {"block_hash": ext(key, tuple(prompt[: j + 1])), "tokens_hash": prompt[j]} for j in range(start, end)
            ]
            send(key, {"stored": {"parent_hash": parent, "blocks": blocks}}, tier)
            held[key].append(prompt[:end])
        elif action < 0.85 and held[key]:
            chain = rng.choice(held[key])
            cut = rng.randint(1, len(chain))
            names = [ext(key, tuple(chain[:j])) for j in range(len(chain), cut - 1, -1)]
            if rng.random() < 0.5:
                names = [ext(key, tuple(chain[:cut]))]  # one block, maybe mid-chain
            send(key, {"removed": {"block_hashes": names}})
        elif action < 0.9:
            send(key, "cleared")
        if indexer.partitions:
            for _ in range(2):
                query = list(rng.choice(prompts))
                query = query[: rng.randint(1, len(query))] + [rng.choice(LOCALS) for _ in range(rng.randint(0, 3))]
                sent = forms(query, rng.choice(["u64", "i64", "mixed"]), rng)
                for _ in range(2):
                    answer = query_answer(indexer.query("m", "t", sent))
                    expected = reference_answer(indexer, "m", "t", sent)
                    assert json.dumps(answer) == json.dumps(expected)
                    assert answer == expected
            check_runs(indexer.partitions[("m", "t")].tree)
