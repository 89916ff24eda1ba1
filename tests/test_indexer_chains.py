"""Chains (`dynamo_lite.indexer.tree.Chain`) against a node per block: the same operations on
a tree with chains and on one without must give the same answers, counts and dumps, whatever
the mix of long stores, shared prefixes, branches inside a chain, removals in the middle of a
chain (dormant blocks below), re-stores, renamed blocks (another slot's external hash for the
same content) and cleared slots. `tests/test_indexer_model.py` checks both against the model;
this drives longer chains than the model can follow and compares the trees directly."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_lite.indexer.tree import Chain, Node, PrefixTree

pytestmark = pytest.mark.unit

WORKERS = [(1, 0), (1, 1), (2, 0), (3, 0)]
# Few distinct local hashes, so prompts share prefixes and diverge inside chains.
LOCALS = [0x9E37_79B9_7F4A_7C15 * (i + 1) % 2**64 for i in range(5)]


def external(worker: tuple[int, int], path: tuple[int, ...], rename: int) -> int:
    """A slot's external hash for a block: by content, or (rename) its own for the content."""
    return hash((path, worker if rename else None)) % 2**64


def _pieces(tree: PrefixTree) -> tuple[int, int]:
    nodes = chains = 0
    stack = [tree.root]
    while stack:
        node = stack.pop()
        child = node.child
        members = [] if child is None else list(child.values()) if isinstance(child, dict) else [child]
        for member in members:
            assert member.parent is node
            if isinstance(member, Chain):
                chains += 1
                assert len(member.locals) == len(member.exts) >= 1
            else:
                assert isinstance(member, Node)
                nodes += 1
        stack.extend(members)
    return nodes, chains


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), steps=st.integers(1, 60))
def test_chains_answer_as_a_node_per_block(rng: random.Random, steps: int) -> None:
    # Each of rng's calls is a hypothesis draw, so a failing run shrinks to few, simple steps.
    prompts: list[tuple[int, ...]] = []
    for _ in range(rng.randint(2, 6)):
        base = rng.choice(prompts) if prompts else ()
        prompts.append(base[: rng.randint(0, len(base))] + tuple(rng.choice(LOCALS) for _ in range(rng.randint(1, 80))))
    trees = [PrefixTree(chains=True), PrefixTree(chains=False)]
    held: dict[tuple[int, int], list[tuple[tuple[int, ...], int]]] = {w: [] for w in WORKERS}
    for _ in range(steps):
        worker = rng.choice(WORKERS)
        action = rng.random()
        if action < 0.55:
            prompt = rng.choice(prompts)
            rename = int(rng.random() < 0.15)
            start = rng.randint(0, len(prompt) - 1) if rng.random() < 0.4 else 0
            end = rng.randint(start + 1, len(prompt))
            parent = external(worker, prompt[:start], rename) if start else None
            names = [external(worker, prompt[: j + 1], rename) for j in range(start, end)]
            statuses = {tree.store(worker, parent, names, list(prompt[start:end])) for tree in trees}
            assert len(statuses) == 1
            held[worker].append((prompt[:end], rename))
        elif action < 0.85 and held[worker]:
            path, rename = rng.choice(held[worker])
            cut = rng.randint(1, len(path))
            if rng.random() < 0.5:
                names = [external(worker, path[:cut], rename)]  # one block, often mid-chain
            else:
                names = [external(worker, path[:j], rename) for j in range(len(path), cut - 1, -1)]  # tail first
            assert len({tree.remove(worker, names) for tree in trees}) == 1
        elif action < 0.9:
            for tree in trees:
                tree.clear(worker)
        elif action < 0.93:
            for tree in trees:
                tree.drop_worker(worker)
        for query in rng.sample(prompts, min(2, len(prompts))):
            query = list(query[: rng.randint(1, len(query))])
            if rng.random() < 0.3:
                query = [h - 2**64 if h >= 2**63 else h for h in query]  # the i64 form
            assert trees[0].match(query) == trees[1].match(query)
    chained, plain = trees
    for worker in WORKERS:
        assert chained.block_count(worker) == plain.block_count(worker)
        assert sorted(chained.held_hashes(worker)) == sorted(plain.held_hashes(worker))
        for path, rename in held[worker]:
            names = [external(worker, path[: j + 1], rename) for j in range(len(path))]
            assert chained.holds(worker, names) == plain.holds(worker, names)
            for other in WORKERS:
                assert chained.counterparts(worker, names, other) == plain.counterparts(worker, names, other)
    assert chained.device_blocks == plain.device_blocks
    assert chained.dump() == plain.dump()
    _pieces(chained)


def test_a_chain_takes_a_batch_in_one_piece_and_is_cut_where_blocks_are_removed() -> None:
    tree = PrefixTree()
    worker = (1, 0)
    names = list(range(100, 164))
    locals_ = [0xA000 + i for i in range(64)]
    tree.store(worker, None, names[:32], locals_[:32])
    tree.store(worker, names[31], names[32:], locals_[32:])  # continues its own chain in place
    assert _pieces(tree) == (0, 1)
    assert tree.match(locals_).device == {worker: 64}
    tree.remove(worker, [names[-1]])  # tail first: the chain keeps the rest
    assert _pieces(tree) == (0, 1) and tree.block_count(worker) == 63
    tree.remove(worker, [names[10]])  # in the middle: the blocks below wait for the gap
    assert tree.match(locals_).device == {worker: 10}
    tree.store(worker, names[9], [names[10]], [locals_[10]])
    assert tree.match(locals_).device == {worker: 63}


def test_a_second_slot_storing_the_same_prompt_shares_the_chain() -> None:
    tree = PrefixTree()
    names = list(range(1, 129))
    locals_ = [0xB000 + i for i in range(128)]
    tree.store((1, 0), None, names, locals_)
    tree.store((2, 0), None, names[:64], locals_[:64])
    assert _pieces(tree) == (0, 2)  # the shared half, then the first slot's own
    assert tree.match(locals_).device == {(1, 0): 128, (2, 0): 64}


@settings(max_examples=20, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_a_chain_extended_past_a_thousand_blocks_answers_as_a_node_per_block(rng: random.Random) -> None:
    """An engine extends one chain batch after batch (queries in between): a query compares only
    a prompt's head of it (`Chain.form`), in either form, whole or diverging, as the nodes do."""
    worker = WORKERS[0]
    prompt = tuple(rng.getrandbits(64) for _ in range(1_400))
    trees = [PrefixTree(chains=True), PrefixTree(chains=False)]
    stored = 0
    while stored < len(prompt):
        end = min(len(prompt), stored + 64 * rng.randint(1, 4))
        parent = external(worker, prompt[:stored], 0) if stored else None
        names = [external(worker, prompt[: j + 1], 0) for j in range(stored, end)]
        assert len({tree.store(worker, parent, names, list(prompt[stored:end])) for tree in trees}) == 1
        stored = end
        for _ in range(3):
            query = list(prompt[: rng.randint(1, len(prompt))])
            if rng.random() < 0.3 and len(query) > 1:
                query[rng.randrange(1, len(query))] ^= 1  # diverges there
            if rng.random() < 0.4:
                query = [h - 2**64 if h >= 2**63 and rng.random() < 0.7 else h for h in query]  # i64, or mixed
            assert trees[0].match(query) == trees[1].match(query)
