"""The accounting core, without HTTP: examples from the contract, then random lifecycles and
queries checked against a naive model (sets of hashes per active request, recomputed)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dynamo_lite.base.errors import Conflict, InvalidArgument, NotFound
from dynamo_lite.slot_tracker import core
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.protocols import PotentialLoad, RankLoad, WorkerInfo

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tracker(clock: FakeClock) -> SlotTracker:
    return SlotTracker(clock=clock)


def loads_by_rank(tracker: SlotTracker) -> dict[tuple[int, int], tuple[int, int]]:
    return {
        (load.worker_id, load.dp_rank): (load.active_prefill_tokens, load.active_decode_blocks)
        for load in tracker.loads()
    }


def test_contract_example(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 2)
    tracker.register(2, "m", "default", 16, 0, 2)
    tracker.add("m", "default", "a", 1, 0, [1, 2, 3], 100)
    tracker.add("m", "default", "b", 1, 0, [1, 2, 4], 50)
    tracker.add("m", "default", "c", 1, 1, [1, 2, 3], 0)
    tracker.add("m", "default", "d", 2, 0, [], 7)
    assert loads_by_rank(tracker) == {(1, 0): (150, 4), (1, 1): (0, 3), (2, 0): (7, 0), (2, 1): (0, 0)}


def test_size_counts_workers_and_active_requests_over_partitions(tracker: SlotTracker) -> None:
    assert tracker.size() == (0, 0)
    tracker.register(1, "m", "default", 16, 0, 2)
    tracker.register(2, "other", "t", 16, 0, 1)
    tracker.add("m", "default", "a", 1, 0, [1], 0)
    tracker.add("other", "t", "a", 2, 0, [1], 0)
    assert tracker.size() == (2, 2)
    tracker.free("m", "default", "a")
    assert tracker.size() == (2, 1)


def test_potential_loads_counts_hashes_the_rank_does_not_hold(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 2)
    tracker.add("m", "default", "a", 1, 0, [1, 2, 3], 10)
    tracker.add("m", "default", "b", 1, 0, [1, 2, 4], 0)
    projected = tracker.potential_loads("m", "default", [1, 2, 3, 9], 48)
    assert sorted(projected, key=lambda p: p.dp_rank) == [
        PotentialLoad(1, 0, 58, 5, 2),
        PotentialLoad(1, 1, 48, 4, 0),
    ]


def test_potential_equals_load_after_add_even_with_repeated_hashes(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "a", 1, 0, [7, 8], 0)
    [projected] = tracker.potential_loads("m", "default", [7, 7, 9, 9, 10], 0)
    tracker.add("m", "default", "b", 1, 0, [7, 7, 9, 9, 10], 0)
    assert projected.potential_decode_blocks == loads_by_rank(tracker)[(1, 0)][1] == 4


def test_refcounted_blocks_stay_until_last_holder_leaves(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "a", 1, 0, [1, 2, 3], 0)
    tracker.add("m", "default", "b", 1, 0, [1, 2], 0)
    tracker.free("m", "default", "a")
    assert loads_by_rank(tracker)[(1, 0)] == (0, 2)
    tracker.free("m", "default", "b")
    assert loads_by_rank(tracker)[(1, 0)] == (0, 0)


def test_prefill_complete_stops_counting_tokens_once(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "a", 1, 0, [1], 40)
    tracker.add("m", "default", "b", 1, 0, [2], 2)
    tracker.prefill_complete("m", "default", "a")
    tracker.prefill_complete("m", "default", "a")
    assert loads_by_rank(tracker)[(1, 0)] == (2, 2)
    tracker.free("m", "default", "a")
    assert loads_by_rank(tracker)[(1, 0)] == (2, 1)


def test_output_blocks_add_to_decode_blocks_until_free(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 2)
    tracker.add("m", "default", "a", 1, 0, [1, 2, 3], 0)
    tracker.add("m", "default", "b", 1, 0, [1, 2], 0)
    tracker.set_output_blocks("m", "default", "a", 2)
    assert loads_by_rank(tracker) == {(1, 0): (0, 5), (1, 1): (0, 0)}
    tracker.set_output_blocks("m", "default", "a", 2)  # a retry changes nothing
    tracker.set_output_blocks("m", "default", "b", 1)  # never shared, even with a's prompt
    assert loads_by_rank(tracker)[(1, 0)] == (0, 6)
    projected = {p.dp_rank: p.potential_decode_blocks for p in tracker.potential_loads("m", "default", [1, 9], 0)}
    assert projected == {0: 7, 1: 2}
    tracker.set_output_blocks("m", "default", "a", 4)
    with pytest.raises(Conflict, match=r"^request a already holds 4 output blocks; the count cannot shrink to 3$"):
        tracker.set_output_blocks("m", "default", "a", 3)
    assert loads_by_rank(tracker)[(1, 0)] == (0, 8)  # the refused call changed nothing
    tracker.free("m", "default", "a")
    assert loads_by_rank(tracker)[(1, 0)] == (0, 3)
    tracker.add("m", "default", "a", 1, 1, [], 0)  # a reused id starts with no output blocks
    tracker.set_output_blocks("m", "default", "a", 0)
    assert loads_by_rank(tracker) == {(1, 0): (0, 3), (1, 1): (0, 0)}
    tracker.free("m", "default", "b")
    assert loads_by_rank(tracker)[(1, 0)] == (0, 0)


def test_output_blocks_of_unknown_requests_and_trackers_are_not_found(tracker: SlotTracker) -> None:
    with pytest.raises(NotFound, match="^no slot tracker for model=m tenant_id=default$"):
        tracker.set_output_blocks("m", "default", "a", 1)
    tracker.register(1, "m", "default", 16, 0, 1)
    with pytest.raises(NotFound, match="^request a not found$"):
        tracker.set_output_blocks("m", "default", "a", 1)
    tracker.add("m", "default", "a", 1, 0, [], 0)
    tracker.free("m", "default", "a")
    with pytest.raises(NotFound, match="^request a not found$"):
        tracker.set_output_blocks("m", "default", "a", 1)


def test_expiry_and_unregister_release_output_blocks(clock: FakeClock) -> None:
    tracker = SlotTracker(request_ttl_secs=100, clock=clock)
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.register(2, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "old", 1, 0, [1], 0)
    clock.now += 60
    tracker.add("m", "default", "young", 1, 0, [1], 0)
    tracker.add("m", "default", "other", 2, 0, [1], 0)
    tracker.set_output_blocks("m", "default", "old", 5)  # does not extend its TTL
    tracker.set_output_blocks("m", "default", "young", 2)
    tracker.set_output_blocks("m", "default", "other", 7)
    assert loads_by_rank(tracker) == {(1, 0): (0, 8), (2, 0): (0, 8)}
    clock.now += 40
    assert tracker.expire() == 1
    assert loads_by_rank(tracker) == {(1, 0): (0, 3), (2, 0): (0, 8)}
    tracker.unregister(1, "m", "default")
    assert loads_by_rank(tracker) == {(2, 0): (0, 8)}
    tracker.register(1, "m", "default", 16, 0, 1)  # the same rank again starts idle
    assert loads_by_rank(tracker) == {(1, 0): (0, 0), (2, 0): (0, 8)}


def test_register_validation_order(tracker: SlotTracker) -> None:
    with pytest.raises(InvalidArgument, match="block_size must be greater than 0"):
        tracker.register(1, "m", "default", 0, 0, 0)
    with pytest.raises(InvalidArgument, match="dp_size must be greater than 0"):
        tracker.register(1, "m", "default", 16, 0, 0)
    with pytest.raises(InvalidArgument, match="dp_size 5000 exceeds the maximum 4096"):
        tracker.register(1, "m", "default", 16, 4294967295, 5000)
    with pytest.raises(InvalidArgument, match="dp range overflows u32: start=4294967295 size=1"):
        tracker.register(1, "m", "default", 16, 4294967295, 1)
    with pytest.raises(InvalidArgument, match="overflows"):
        tracker.register(1, "m", "default", 16, 4294963200, 4096)
    tracker.register(1, "m", "default", 16, 4294963199, 4096)
    assert tracker.partitions  # validation failures never created a partition before this
    with pytest.raises(Conflict, match="block_size mismatch for model=m tenant_id=default: existing=16, requested=32"):
        tracker.register(1, "m", "default", 32, 0, 1)
    with pytest.raises(Conflict, match="worker 1 already registered for model=m tenant_id=default"):
        tracker.register(1, "m", "default", 16, 0, 1)


def test_lifecycle_errors(tracker: SlotTracker) -> None:
    with pytest.raises(NotFound, match="no slot tracker for model=m tenant_id=default"):
        tracker.add("m", "default", "a", 1, 0, [], 0)
    with pytest.raises(NotFound, match="no slot tracker"):
        tracker.free("m", "default", "a")
    tracker.register(1, "m", "default", 16, 0, 1)
    with pytest.raises(NotFound, match=r"^worker 1 dp_rank 1 is not registered for this model and tenant$"):
        tracker.add("m", "default", "a", 1, 1, [], 0)
    tracker.add("m", "default", "a", 1, 0, [], 0)
    with pytest.raises(NotFound, match=r"is not registered for this model and tenant"):
        tracker.add("m", "default", "a", 2, 0, [], 0)  # unknown rank wins over the duplicate id
    with pytest.raises(Conflict, match=r"^request a already exists \(assigned to worker 1 dp_rank 0\)$"):
        tracker.add("m", "default", "a", 1, 0, [], 0)
    with pytest.raises(NotFound, match="request zz not found"):
        tracker.prefill_complete("m", "default", "zz")
    tracker.free("m", "default", "zz")  # idempotent


def test_unregister_drops_requests_and_last_worker_drops_partition(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "t", 16, 0, 2)
    tracker.register(2, "m", "t", 16, 0, 1)
    tracker.add("m", "t", "a", 1, 1, [5, 6], 9)
    tracker.add("m", "t", "b", 2, 0, [5, 6], 9)
    tracker.unregister(1, "m", "t")
    with pytest.raises(NotFound, match="request a not found"):
        tracker.prefill_complete("m", "t", "a")
    tracker.add("m", "t", "a", 2, 0, [5], 0)  # the id is reusable
    [projected] = tracker.potential_loads("m", "t", [5, 6, 7], 0)
    assert projected.potential_decode_blocks == 3
    tracker.unregister(2, "m", "t")
    assert tracker.partitions == {}
    with pytest.raises(NotFound, match="worker 2 not found for model=m tenant_id=t"):
        tracker.unregister(2, "m", "t")
    tracker.register(1, "m", "t", 64, 0, 1)  # any block size once the partition is gone


def test_workers_and_loads_are_sorted_and_filtered(tracker: SlotTracker) -> None:
    tracker.register(3, "b", "x", 16, 0, 1)
    tracker.register(2, "a", "y", 16, 1, 2)
    tracker.register(10, "a", "default", 16, 0, 1)
    tracker.register(9, "a", "default", 16, 0, 1)
    assert [(w.model_name, w.tenant_id, w.worker_id) for w in tracker.workers()] == [
        ("a", "default", 9), ("a", "default", 10), ("a", "y", 2), ("b", "x", 3)]
    assert tracker.workers(tenant_id="y") == [WorkerInfo(2, "a", "y", 16, 1, 2)]
    assert tracker.workers(model_name="b", tenant_id="y") == []
    assert tracker.loads(model_name="a", tenant_id="y") == [
        RankLoad("a", "y", 2, 1, 0, 0), RankLoad("a", "y", 2, 2, 0, 0)]


def test_stale_requests_expire_after_ttl(clock: FakeClock) -> None:
    tracker = SlotTracker(request_ttl_secs=300, clock=clock)
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "old", 1, 0, [1, 2], 100)
    clock.now += 200
    tracker.add("m", "default", "young", 1, 0, [1], 5)
    clock.now += 99.9
    assert tracker.expire() == 0
    clock.now += 0.2
    assert tracker.expire() == 1
    assert loads_by_rank(tracker)[(1, 0)] == (5, 1)
    with pytest.raises(NotFound):
        tracker.prefill_complete("m", "default", "old")
    tracker.add("m", "default", "old", 1, 0, [], 0)  # forgotten, so reusable
    assert tracker.expired_total == 1


def test_add_sweeps_its_partition_before_storing(clock: FakeClock) -> None:
    tracker = SlotTracker(request_ttl_secs=10, clock=clock)
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "a", 1, 0, [1], 3)
    clock.now += 10
    tracker.add("m", "default", "a", 1, 0, [2], 4)  # "a" expired first, so no 409
    assert loads_by_rank(tracker)[(1, 0)] == (4, 1)


def test_integers_never_wrap(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "a", 1, 0, [], 2**64 - 1)
    tracker.add("m", "default", "b", 1, 0, [], 3)
    assert loads_by_rank(tracker)[(1, 0)] == (2**64 + 2, 0)
    [projected] = tracker.potential_loads("m", "default", [], 2**64 - 1)
    assert projected.potential_prefill_tokens == 2**65 + 1


def test_same_hashes_on_two_ranks_count_on_both(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "default", 16, 0, 2)
    tracker.add("m", "default", "a", 1, 0, [-1, 5], 0)
    tracker.add("m", "default", "b", 1, 1, [-1, 5], 0)
    tracker.free("m", "default", "a")
    projected = {p.dp_rank: p.potential_decode_blocks for p in tracker.potential_loads("m", "default", [-1, 5, 6], 0)}
    assert projected == {0: 3, 1: 3}


def test_potential_loads_with_hundreds_of_ranks_credits_every_holder(tracker: SlotTracker) -> None:
    """Holder masks wider than a machine word, with a bit freed by an unregister and reused."""
    rng = random.Random(11)
    for worker in range(4):
        tracker.register(worker, "m", "default", 16, 0, 70)
    tracker.unregister(1, "m", "default")
    tracker.register(9, "m", "default", 16, 100, 70)
    ranks = [(w, r) for w in (0, 2, 3) for r in range(70)] + [(9, r) for r in range(100, 170)]
    prefix = [rng.getrandbits(63) - 2**62 for _ in range(20)]
    held: dict[tuple[int, int], set[int]] = {rank: set() for rank in ranks}
    for i in range(600):
        worker, rank = rng.choice(ranks)
        hashes = prefix[: rng.randint(0, 20)] + [rng.randrange(1000) for _ in range(rng.randint(0, 8))]
        tracker.add("m", "default", f"r{i}", worker, rank, hashes, 0)
        held[(worker, rank)].update(hashes)
    query = prefix + [rng.randrange(1000) for _ in range(30)]
    projected = {(p.worker_id, p.dp_rank): p.potential_decode_blocks
                 for p in tracker.potential_loads("m", "default", query, 0)}
    assert projected == {rank: len(hashes | set(query)) for rank, hashes in held.items()}


def test_a_group_split_after_add_is_still_released_exactly(tracker: SlotTracker) -> None:
    """b takes half of a's hashes to another rank after a was added: a's release must not
    trust the groups recorded at its /add, which no longer cover it."""
    tracker.register(1, "m", "default", 16, 0, 2)
    tracker.add("m", "default", "a", 1, 0, [1, 2, 3, 4], 0)
    tracker.add("m", "default", "b", 1, 1, [4, 2], 0)
    tracker.free("m", "default", "a")
    assert loads_by_rank(tracker) == {(1, 0): (0, 0), (1, 1): (0, 2)}
    projected = {p.dp_rank: p.potential_decode_blocks for p in tracker.potential_loads("m", "default", [1, 2, 3], 0)}
    assert projected == {0: 3, 1: 4}
    tracker.free("m", "default", "b")
    assert tracker.partitions[("m", "default")].holders == {}


def test_a_shared_prefix_stays_one_group(tracker: SlotTracker) -> None:
    """What keeps /add, /free and /potential_loads cheap for chained prompts: requests sharing a
    prefix touch one group for it, whatever its length, plus one for their own hashes."""
    for worker in range(4):
        tracker.register(worker, "m", "default", 16, 0, 2)
    prefix = list(range(1000, 1128))
    for i in range(40):
        tracker.add("m", "default", f"r{i}", i % 4, i % 2, prefix + [-i * 1000 - j for j in range(1, 65)], 0)
    partition = tracker.partitions[("m", "default")]
    assert len({id(group) for group in partition.holders.values()}) == 41
    # The first request's hashes were all new: one group, which the second one split.
    assert [len(request.groups) for request in partition.requests.values()] == [1] + [2] * 39
    assert len(partition.holders[prefix[0]].members) == 128


# --- random lifecycles against a naive model ---------------------------------------------


class NaiveModel:
    """One partition as the contract states it, recomputed from scratch at every question:
    a rank's blocks are the union of its active requests' hash sets, plus their output blocks."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.ranks: dict[int, list[int]] = {}  # worker -> dp_ranks
        # request id -> (worker, rank, hashes, prefill tokens, added at, output blocks)
        self.active: dict[str, tuple[int, int, frozenset[int], int, float, int]] = {}

    def slots(self) -> list[tuple[int, int]]:
        return [(worker, rank) for worker in sorted(self.ranks) for rank in self.ranks[worker]]

    def held(self, slot: tuple[int, int]) -> set[int]:
        return set().union(*(r[2] for r in self.active.values() if (r[0], r[1]) == slot))

    def output(self, slot: tuple[int, int]) -> int:
        return sum(r[5] for r in self.active.values() if (r[0], r[1]) == slot)

    def expire(self, now: float) -> None:
        self.active = {k: r for k, r in self.active.items() if r[4] > now - self.ttl}

    def loads(self) -> list[tuple[int, int, int, int]]:
        return [
            (*slot, sum(r[3] for r in self.active.values() if (r[0], r[1]) == slot),
             len(self.held(slot)) + self.output(slot))
            for slot in self.slots()
        ]

    def potential_loads(self, hashes: list[int], tokens: int) -> list[tuple[int, int, int, int, int]]:
        rows = []
        for slot in self.slots():
            mine = [r for r in self.active.values() if (r[0], r[1]) == slot]
            rows.append((*slot, sum(r[3] for r in mine) + tokens,
                         len(self.held(slot) | set(hashes)) + self.output(slot), len(mine)))
        return rows


PREFIXES = [[(p << 20) + i for i in range(n)] for p, n in enumerate([3, 8, 20, 40])]
POOL = list(range(-8, 24))


@st.composite
def hash_lists(draw: st.DrawFn) -> list[int]:
    """Chained prompts (a shared prefix, then own hashes) and what breaks chaining: runs cut
    from a prefix's middle, shuffled prefixes with repeats, and small-pool hashes that collide
    across requests in any order, so groups get split and requests touch many of them."""
    prefix = draw(st.sampled_from(PREFIXES))
    kind = draw(st.sampled_from(["chained", "run", "shuffled", "pool", "mixed"]))
    if kind == "chained":
        own = draw(st.integers(0, 50))
        return prefix[: draw(st.integers(0, len(prefix)))] + [-(own * 1000 + i) - 1 for i in range(draw(st.integers(0, 6)))]
    if kind == "run":
        start = draw(st.integers(0, len(prefix)))
        return prefix[start : draw(st.integers(start, len(prefix)))]
    if kind == "shuffled":
        chosen = prefix[: draw(st.integers(0, len(prefix)))]
        return draw(st.permutations(chosen + draw(st.lists(st.sampled_from(prefix), max_size=5))))
    if kind == "pool":
        return draw(st.lists(st.sampled_from(POOL), max_size=24))
    return draw(st.permutations(prefix[: draw(st.integers(0, len(prefix)))] + draw(st.lists(st.sampled_from(POOL), max_size=10))))


class LifecycleMachine(RuleBasedStateMachine):
    """Random register/add/prefill/output blocks/free/expire/unregister; after every step the
    core's answers equal the naive model's, and its groups are consistent with the active
    requests."""

    walk_steps: int | None = None  # overrides core._WALK_STEPS, to drive the other path

    @initialize()
    def setup(self) -> None:
        self.saved_walk_steps = core._WALK_STEPS
        if self.walk_steps is not None:
            core._WALK_STEPS = self.walk_steps
        self.clock = FakeClock()
        self.tracker = SlotTracker(request_ttl_secs=100, clock=self.clock)
        self.model = NaiveModel(ttl=100)
        self.next_id = 0

    # 70 ranks a worker takes holder masks past 64 and 128 bits, where big-int paths differ.
    @rule(worker=st.integers(1, 4), dp_size=st.integers(1, 3) | st.just(70))
    def register(self, worker: int, dp_size: int) -> None:
        if worker in self.model.ranks:
            with pytest.raises(Conflict):
                self.tracker.register(worker, "m", "default", 16, 0, dp_size)
            return
        self.tracker.register(worker, "m", "default", 16, 0, dp_size)
        self.model.ranks[worker] = list(range(dp_size))

    @precondition(lambda self: self.model.ranks)
    @rule(data=st.data(), hashes=hash_lists(), tokens=st.integers(0, 1000))
    def add(self, data: st.DataObject, hashes: list[int], tokens: int) -> None:
        worker = data.draw(st.sampled_from(sorted(self.model.ranks)))
        rank = data.draw(st.sampled_from(self.model.ranks[worker]))
        self.model.expire(self.clock.now)
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.tracker.add("m", "default", request_id, worker, rank, hashes, tokens)
        self.model.active[request_id] = (worker, rank, frozenset(hashes), tokens, self.clock.now, 0)

    @precondition(lambda self: self.model.active)
    @rule(data=st.data())
    def prefill_complete(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model.active)))
        self.tracker.prefill_complete("m", "default", request_id)
        worker, rank, hashes, _, added, output = self.model.active[request_id]
        self.model.active[request_id] = (worker, rank, hashes, 0, added, output)

    @precondition(lambda self: self.model.active)
    @rule(data=st.data())
    def output_blocks(self, data: st.DataObject) -> None:
        """Mostly growth or a retry of the last count; sometimes a smaller count, refused."""
        request_id = data.draw(st.sampled_from(sorted(self.model.active)))
        worker, rank, hashes, tokens, added, output = self.model.active[request_id]
        count = data.draw(st.integers(max(0, output - 3), output + 40))
        if count < output:
            with pytest.raises(Conflict):
                self.tracker.set_output_blocks("m", "default", request_id, count)
            return
        self.tracker.set_output_blocks("m", "default", request_id, count)
        self.model.active[request_id] = (worker, rank, hashes, tokens, added, count)

    @precondition(lambda self: self.model.active)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model.active)))
        self.tracker.free("m", "default", request_id)
        del self.model.active[request_id]

    @precondition(lambda self: self.model.ranks)
    @rule(data=st.data())
    def unregister(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.model.ranks)))
        self.tracker.unregister(worker, "m", "default")
        del self.model.ranks[worker]
        self.model.active = {k: r for k, r in self.model.active.items() if r[0] != worker}

    @rule(seconds=st.floats(0, 60))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.tracker.expire()
        self.model.expire(self.clock.now)

    @precondition(lambda self: self.model.ranks)
    @rule(hashes=hash_lists(), tokens=st.integers(0, 100))
    def potential_loads_match_the_model(self, hashes: list[int], tokens: int) -> None:
        got = [
            (p.worker_id, p.dp_rank, p.potential_prefill_tokens, p.potential_decode_blocks, p.active_requests)
            for p in self.tracker.potential_loads("m", "default", hashes, tokens)
        ]
        assert got == self.model.potential_loads(hashes, tokens)

    @invariant()
    def loads_match_the_model(self) -> None:
        if not hasattr(self, "tracker"):
            return
        got = [(load.worker_id, load.dp_rank, load.active_prefill_tokens, load.active_decode_blocks)
               for load in self.tracker.loads()]
        assert got == self.model.loads()

    @invariant()
    def groups_hold_what_the_requests_hold(self) -> None:
        """Every held hash's group has, per slot, the number of that slot's active requests
        holding the hash; a slot's set is the union of its requests' hashes; and each request's
        recorded groups lie inside it (they may no longer cover it after later splits)."""
        if not hasattr(self, "tracker") or not self.model.ranks:
            return
        partition = self.tracker.partitions[("m", "default")]
        index = {key: slot.index for key, slot in partition.slots.items()}
        expected_refs: dict[int, dict[int, int]] = {}
        for worker, rank, hashes, _, _, _ in self.model.active.values():
            for block_hash in hashes:
                refs = expected_refs.setdefault(block_hash, {})
                refs[index[(worker, rank)]] = refs.get(index[(worker, rank)], 0) + 1
        assert partition.holders.keys() == expected_refs.keys() == partition.held
        for block_hash, group in partition.holders.items():
            assert block_hash in group.members and group.size == len(group.members)
            assert group.refs == expected_refs[block_hash]
            assert group.mask == sum(1 << i for i in group.refs)
            assert all(partition.holders[member] is group for member in group.members)
        for key, slot in partition.slots.items():
            assert slot.blocks == len(self.model.held(key))  # the refs above say which
            assert slot.output_blocks == self.model.output(key)
        for request_id, request in partition.requests.items():
            hashes = self.model.active[request_id][2]
            assert request.output_blocks == self.model.active[request_id][5]
            assert request.block_count == len(hashes)
            assert all(hashes.issuperset(group.members) for group in request.groups)

    def teardown(self) -> None:
        core._WALK_STEPS = getattr(self, "saved_walk_steps", core._WALK_STEPS)
        if not hasattr(self, "tracker"):
            return
        for request_id in list(self.model.active):
            self.tracker.free("m", "default", request_id)
        assert all(load.active_decode_blocks == load.active_prefill_tokens == 0 for load in self.tracker.loads())
        for partition in self.tracker.partitions.values():
            assert partition.holders == {} and partition.held == set() and not partition.requests


class NoWalkLifecycleMachine(LifecycleMachine):
    """Every group lookup through the one-pass fallback, which the walk otherwise spares."""

    walk_steps = 0


class OneStepWalkLifecycleMachine(LifecycleMachine):
    walk_steps = 1


TestLifecycle = LifecycleMachine.TestCase
TestLifecycleWithoutWalk = NoWalkLifecycleMachine.TestCase
TestLifecycleOneStepWalk = OneStepWalkLifecycleMachine.TestCase


@pytest.mark.parametrize("walk_steps", [0, 2, core._WALK_STEPS])
@settings(max_examples=300)
@given(
    placed=st.lists(st.tuples(st.integers(0, 5), hash_lists()), max_size=30),
    freed=st.sets(st.integers(0, 29)),
    query=hash_lists(),
)
def test_potential_loads_equal_the_naive_count(
    walk_steps: int, placed: list[tuple[int, list[int]]], freed: set[int], query: list[int]
) -> None:
    """Many requests at once, some freed again (splits leave the survivors' groups cut), then
    one query: each rank's projection is its distinct hashes united with the query's."""
    saved, core._WALK_STEPS = core._WALK_STEPS, walk_steps
    try:
        tracker = SlotTracker()
        tracker.register(1, "m", "default", 16, 0, 3)
        tracker.register(2, "m", "default", 16, 0, 3)
        held: dict[int, list[frozenset[int]]] = {slot: [] for slot in range(6)}
        for i, (slot, hashes) in enumerate(placed):
            tracker.add("m", "default", f"r{i}", 1 + slot // 3, slot % 3, hashes, 0)
            if i in freed:
                continue
            held[slot].append(frozenset(hashes))
        for i in freed & set(range(len(placed))):
            tracker.free("m", "default", f"r{i}")
        projected = [p.potential_decode_blocks for p in tracker.potential_loads("m", "default", query, 0)]
        assert projected == [len(set(query).union(*held[slot])) for slot in range(6)]
        assert [load.active_decode_blocks for load in tracker.loads()] == [
            len(set().union(*held[slot])) for slot in range(6)]
    finally:
        core._WALK_STEPS = saved
