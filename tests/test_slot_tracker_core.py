"""The accounting core, without HTTP: examples from the contract, then invariants under
random lifecycles checked against a plain recomputation."""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dynamo_lite.errors import Conflict, InvalidArgument, NotFound
from dynamo_lite.slot_tracker.core import PotentialLoad, RankLoad, SlotTracker, WorkerInfo


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
    assert tracker.trackers  # validation failures never created a tracker before this
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
    with pytest.raises(NotFound, match="Request zz not found"):
        tracker.prefill_complete("m", "default", "zz")
    tracker.free("m", "default", "zz")  # idempotent


def test_unregister_drops_requests_and_last_worker_drops_tracker(tracker: SlotTracker) -> None:
    tracker.register(1, "m", "t", 16, 0, 2)
    tracker.register(2, "m", "t", 16, 0, 1)
    tracker.add("m", "t", "a", 1, 1, [5, 6], 9)
    tracker.add("m", "t", "b", 2, 0, [5, 6], 9)
    tracker.unregister(1, "m", "t")
    with pytest.raises(NotFound, match="Request a not found"):
        tracker.prefill_complete("m", "t", "a")
    tracker.add("m", "t", "a", 2, 0, [5], 0)  # the id is reusable
    [projected] = tracker.potential_loads("m", "t", [5, 6, 7], 0)
    assert projected.potential_decode_blocks == 3
    tracker.unregister(2, "m", "t")
    assert tracker.trackers == {}
    with pytest.raises(NotFound, match="worker 2 not found for model=m tenant_id=t"):
        tracker.unregister(2, "m", "t")
    tracker.register(1, "m", "t", 64, 0, 1)  # any block size once the tracker is gone


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


def test_add_sweeps_its_tracker_before_storing(clock: FakeClock) -> None:
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


# --- invariants under random lifecycles ----------------------------------------------------

PREFIXES = [[(p << 20) + i for i in range(n)] for p, n in enumerate([0, 3, 8, 20])]


@st.composite
def chained_hashes(draw: st.DrawFn) -> list[int]:
    prefix = draw(st.sampled_from(PREFIXES))
    suffix_id = draw(st.integers(0, 50))
    suffix = [-(suffix_id * 1000 + i) - 1 for i in range(draw(st.integers(0, 6)))]
    return prefix + suffix


class LifecycleMachine(RuleBasedStateMachine):
    """Random register/add/prefill/free/expire/unregister; after every step the core's answers
    equal a from-scratch recomputation over the requests the model believes are active."""

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock()
        self.tracker = SlotTracker(request_ttl_secs=100, clock=self.clock)
        self.ranks: dict[int, range] = {}
        self.active: dict[str, tuple[int, int, list[int], int, float]] = {}
        self.next_id = 0

    # 70 ranks a worker takes holder masks past 64 and 128 bits, where big-int paths differ.
    @rule(worker=st.integers(1, 4), dp_size=st.integers(1, 3) | st.just(70))
    def register(self, worker: int, dp_size: int) -> None:
        if worker in self.ranks:
            with pytest.raises(Conflict):
                self.tracker.register(worker, "m", "default", 16, 0, dp_size)
            return
        self.tracker.register(worker, "m", "default", 16, 0, dp_size)
        self.ranks[worker] = range(dp_size)

    @precondition(lambda self: self.ranks)
    @rule(data=st.data(), hashes=chained_hashes(), tokens=st.integers(0, 1000))
    def add(self, data: st.DataObject, hashes: list[int], tokens: int) -> None:
        worker = data.draw(st.sampled_from(sorted(self.ranks)))
        rank = data.draw(st.sampled_from(list(self.ranks[worker])))
        self._expire_model()
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.tracker.add("m", "default", request_id, worker, rank, hashes, tokens)
        self.active[request_id] = (worker, rank, hashes, tokens, self.clock.now)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def prefill_complete(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.active)))
        self.tracker.prefill_complete("m", "default", request_id)
        worker, rank, hashes, _, added = self.active[request_id]
        self.active[request_id] = (worker, rank, hashes, 0, added)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.active)))
        self.tracker.free("m", "default", request_id)
        del self.active[request_id]

    @precondition(lambda self: self.ranks)
    @rule(data=st.data())
    def unregister(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.ranks)))
        self.tracker.unregister(worker, "m", "default")
        del self.ranks[worker]
        self.active = {k: v for k, v in self.active.items() if v[0] != worker}

    @rule(seconds=st.floats(0, 60))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.tracker.expire()
        self._expire_model()

    @precondition(lambda self: self.ranks)
    @rule(hashes=chained_hashes(), tokens=st.integers(0, 100))
    def projection_matches_recomputation(self, hashes: list[int], tokens: int) -> None:
        expected = {}
        for worker, ranks in self.ranks.items():
            for rank in ranks:
                mine = [v for v in self.active.values() if (v[0], v[1]) == (worker, rank)]
                held = set().union(*(set(v[2]) for v in mine))
                expected[(worker, rank)] = (
                    sum(v[3] for v in mine) + tokens,
                    len(held | set(hashes)),
                    len(mine),
                )
        got = {
            (p.worker_id, p.dp_rank): (p.potential_prefill_tokens, p.potential_decode_blocks, p.active_requests)
            for p in self.tracker.potential_loads("m", "default", hashes, tokens)
        }
        assert got == expected

    def _expire_model(self) -> None:
        deadline = self.clock.now - 100
        self.active = {k: v for k, v in self.active.items() if v[4] > deadline}

    @invariant()
    def loads_match_active_requests(self) -> None:
        if not hasattr(self, "tracker"):
            return
        for key, (tokens, blocks) in loads_by_rank(self.tracker).items():
            mine = [v for v in self.active.values() if (v[0], v[1]) == key]
            assert tokens == sum(v[3] for v in mine)
            assert blocks == len(set().union(*(set(v[2]) for v in mine)))

    @invariant()
    def refcount_is_number_of_requests_holding_the_hash(self) -> None:
        if not hasattr(self, "tracker") or not self.ranks:
            return
        tracker = self.tracker.trackers[("m", "default")]
        for (worker, rank), slot in tracker.slots.items():
            mine = [v for v in self.active.values() if (v[0], v[1]) == (worker, rank)]
            expected = {}
            for v in mine:
                for h in set(v[2]):
                    expected[h] = expected.get(h, 0) + 1
            assert slot.block_refs == expected
        for block_hash, mask in tracker.holders.items():
            assert mask == sum(s.bit for s in tracker.slots.values() if block_hash in s.block_refs)
        assert all(any(h in s.block_refs for s in tracker.slots.values()) for h in tracker.holders) or not tracker.holders

    def teardown(self) -> None:
        if not hasattr(self, "tracker"):
            return
        for request_id in list(self.active):
            self.tracker.free("m", "default", request_id)
        assert all(load == (0, 0) for load in loads_by_rank(self.tracker).values())
        for tracker in self.tracker.trackers.values():
            assert tracker.holders == {} and not tracker.requests


TestLifecycle = LifecycleMachine.TestCase
