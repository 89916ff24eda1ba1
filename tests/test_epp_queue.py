"""The endpoint picker's admission queue: the pure RequestQueue and the asyncio AdmissionQueue."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.epp.queue import (
    AdmissionQueue,
    QueuedRequest,
    QueuePolicy,
    QueueRefused,
    RequestQueue,
)

pytestmark = pytest.mark.unit


def req(rid: str, arrival: float = 0.0, *, isl: int = 100, jump: float = 0.0, wait: float = math.inf) -> QueuedRequest:
    return QueuedRequest(rid, isl, arrival, jump, arrival + wait, payload={"id": rid})


def drain_order(q: RequestQueue) -> list[str]:
    out = []
    while (item := q.pop_ready()) is not None:
        out.append(item.request_id)
    return out


def filled(policy: QueuePolicy, items: list[QueuedRequest], max_size: int = 100) -> RequestQueue:
    q = RequestQueue(policy, max_size)
    for item in items:
        assert q.push(item)
    return q


# -- ordering ----------------------------------------------------------------------------------


def test_fcfs_orders_by_adjusted_arrival() -> None:
    items = [
        req("a", 0.0),  # adjusted 0.0
        req("b", 1.0),  # adjusted 1.0
        req("c", 2.0, jump=1.5),  # adjusted 0.5: overtakes b, not a
        req("d", 3.0, jump=5.0),  # adjusted -2.0: latest arrival, goes first
    ]
    assert drain_order(filled(QueuePolicy.FCFS, items)) == ["d", "a", "c", "b"]


def test_fcfs_ignores_isl() -> None:
    items = [req("long", 0.0, isl=10_000), req("short", 1.0, isl=1)]
    assert drain_order(filled(QueuePolicy.FCFS, items)) == ["long", "short"]


def test_wspt_orders_by_smiths_rule() -> None:
    items = [
        req("a", 0.0, isl=1000),  # 1/1000 = 0.001
        req("b", 1.0, isl=100),  # 1/100 = 0.01
        req("c", 2.0, isl=1000, jump=19.0),  # 20/1000 = 0.02
        req("d", 3.0, isl=50),  # 1/50 = 0.02: ties with c, later arrival
        req("e", 4.0, isl=400, jump=1.0),  # 2/400 = 0.005
    ]
    assert drain_order(filled(QueuePolicy.WSPT, items)) == ["c", "d", "b", "e", "a"]


def test_wspt_zero_isl_counts_as_one_token() -> None:
    items = [req("one", 0.0, isl=1), req("zero", 1.0, isl=0), req("two", 2.0, isl=2)]
    assert drain_order(filled(QueuePolicy.WSPT, items)) == ["one", "zero", "two"]


def test_ties_break_by_arrival_then_push_order() -> None:
    # fcfs: equal adjusted arrival (3.0), the earlier real arrival first.
    items = [req("late", 5.0, jump=2.0), req("early", 3.0)]
    assert drain_order(filled(QueuePolicy.FCFS, items)) == ["early", "late"]
    # Everything equal: push order, for both policies.
    same = [req(f"r{i}", 1.0, isl=64, jump=0.5) for i in range(20)]
    for policy in QueuePolicy:
        assert drain_order(filled(policy, same)) == [f"r{i}" for i in range(20)]


def test_policy_values() -> None:
    assert QueuePolicy("fcfs") is QueuePolicy.FCFS and QueuePolicy("wspt") is QueuePolicy.WSPT
    assert RequestQueue("wspt", 1).policy is QueuePolicy.WSPT  # type: ignore[arg-type]


# -- capacity, expiry, removal -------------------------------------------------------------------


def test_full_queue_refuses_push() -> None:
    q = RequestQueue(QueuePolicy.FCFS, 2)
    assert q.push(req("a")) and q.push(req("b"))
    assert not q.push(req("c"))
    assert len(q) == 2 and "c" not in q
    assert q.pop_ready().request_id == "a"
    assert q.push(req("c")) and len(q) == 2
    assert not RequestQueue(QueuePolicy.FCFS, 0).push(req("x"))


def test_duplicate_and_invalid_requests() -> None:
    q = RequestQueue(QueuePolicy.FCFS, 5)
    q.push(req("a"))
    with pytest.raises(ValueError):
        q.push(req("a", 1.0))
    q.pop_ready()
    assert q.push(req("a", 2.0))  # the id is free again once it left
    with pytest.raises(ValueError):
        req("neg", jump=-0.1)
    with pytest.raises(ValueError):
        req("nan", jump=math.nan)
    with pytest.raises(ValueError):
        req("isl", isl=-1)
    with pytest.raises(ValueError):
        RequestQueue(QueuePolicy.FCFS, -1)


def test_expire_at_exact_deadlines() -> None:
    q = filled(QueuePolicy.FCFS, [req("a", 0.0, wait=10.0), req("b", 1.0, wait=11.0), req("c", 2.0, wait=13.0)])
    assert q.next_deadline() == 10.0
    assert q.expire(9.999) == []
    assert [i.request_id for i in q.expire(10.0)] == ["a"]  # due at its deadline
    assert q.next_deadline() == 12.0
    assert [i.request_id for i in q.expire(14.9)] == ["b"]
    assert len(q) == 1 and q.next_deadline() == 15.0
    assert q.pop_ready().request_id == "c"
    assert q.expire(100.0) == [] and q.next_deadline() is None


def test_expire_returns_earliest_deadline_first_and_skips_popped() -> None:
    q = filled(QueuePolicy.FCFS, [req("a", 0.0, wait=5.0), req("b", 1.0, wait=1.0), req("c", 2.0, wait=2.0)])
    assert q.pop_ready().request_id == "a"
    assert [i.request_id for i in q.expire(10.0)] == ["b", "c"]
    assert len(q) == 0 and q.pop_ready() is None


def test_remove() -> None:
    q = filled(QueuePolicy.WSPT, [req("a", 0.0, isl=10), req("b", 1.0, isl=20), req("c", 2.0, isl=30, wait=1.0)])
    assert q.remove("a") and not q.remove("a") and not q.remove("nope")
    assert len(q) == 2 and "a" not in q
    assert q.peek().request_id == "b"
    assert q.pop_ready().request_id == "b"
    assert not q.remove("b")  # already popped
    assert q.remove("c")
    assert q.expire(10.0) == [] and q.pop_ready() is None and len(q) == 0


def test_oldest_wait_and_drain() -> None:
    q = filled(QueuePolicy.FCFS, [req("a", 1.0), req("b", 2.0, jump=5.0), req("c", 3.0)])
    assert q.oldest_wait(4.5) == 3.5
    assert q.pop_ready().request_id == "b"
    assert q.oldest_wait(4.5) == 3.5
    q.remove("a")
    assert q.oldest_wait(4.5) == 1.5
    assert [i.request_id for i in q.drain()] == ["c"]
    assert len(q) == 0 and q.oldest_wait(4.5) == 0.0 and q.pop_ready() is None


def test_dead_entries_are_compacted() -> None:
    q = RequestQueue(QueuePolicy.FCFS, 10_000)
    for i in range(2000):
        q.push(req(f"r{i}", float(i), wait=1e6))
    for _ in range(0, 2000, 10):
        q.pop_ready()
    for i in range(1000, 2000):
        q.remove(f"r{i}")
    live = len(q)
    assert live == 800
    for heap in (q._order, q._deadlines, q._arrivals):  # lazy deletion keeps at most ~2x the live set
        assert len(heap) <= max(64, 2 * live) + 1
    assert drain_order(q) == [f"r{i}" for i in range(200, 1000)]


# -- properties ----------------------------------------------------------------------------------

request_fields = st.tuples(
    st.integers(0, 5000),  # isl
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]) | st.floats(0, 100, allow_nan=False),  # arrival
    st.sampled_from([0.0, 1.0, 2.5]) | st.floats(0, 50, allow_nan=False),  # priority_jump
)


def reference_key(policy: QueuePolicy, item: QueuedRequest, index: int) -> tuple:
    if policy is QueuePolicy.FCFS:
        primary = item.arrival - item.priority_jump
    else:
        primary = -(1.0 + item.priority_jump) / max(item.isl_tokens, 1)
    return (primary, item.arrival, index)


@settings(max_examples=200)
@given(st.sampled_from(QueuePolicy), st.lists(request_fields, max_size=60))
def test_pop_order_is_sorted_by_policy_key(policy: QueuePolicy, fields: list) -> None:
    items = [QueuedRequest(f"r{i}", isl, arrival, jump, math.inf) for i, (isl, arrival, jump) in enumerate(fields)]
    expected = [it.request_id for _, it in sorted(enumerate(items), key=lambda p: reference_key(policy, p[1], p[0]))]
    assert drain_order(filled(policy, items)) == expected


operation = st.one_of(
    st.tuples(st.just("push"), request_fields, st.floats(0.0, 20.0)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.integers(0, 80)),
    st.tuples(st.just("expire"), st.floats(0.0, 130.0)),
)


@settings(max_examples=200)
@given(st.sampled_from(QueuePolicy), st.integers(0, 12), st.lists(operation, max_size=80))
def test_matches_a_sorted_list_model(policy: QueuePolicy, max_size: int, ops: list) -> None:
    q = RequestQueue(policy, max_size)
    model: list[tuple[tuple, QueuedRequest]] = []  # (reference key, item)
    n = 0
    for op in ops:
        if op[0] == "push":
            (isl, arrival, jump), wait = op[1], op[2]
            item = QueuedRequest(f"r{n}", isl, arrival, jump, arrival + wait)
            accepted = q.push(item)
            assert accepted == (len(model) < max_size)
            if accepted:
                model.append((reference_key(policy, item, n), item))
            n += 1
        elif op[0] == "pop":
            got = q.pop_ready()
            if not model:
                assert got is None
            else:
                best = min(model, key=lambda m: m[0])
                model.remove(best)
                assert got is best[1]
        elif op[0] == "remove":
            rid = f"r{op[1]}"
            present = [m for m in model if m[1].request_id == rid]
            assert q.remove(rid) == bool(present)
            for m in present:
                model.remove(m)
        else:
            now = op[1]
            due = sorted((m for m in model if m[1].deadline <= now), key=lambda m: (m[1].deadline, m[0][2]))
            assert q.expire(now) == [m[1] for m in due]
            for m in due:
                model.remove(m)
        assert len(q) == len(model)
        live = [m[1] for m in model]
        assert q.next_deadline() == (min(i.deadline for i in live) if live else None)
        assert q.oldest_wait(200.0) == (200.0 - min(i.arrival for i in live) if live else 0.0)


# -- the asyncio wrapper -------------------------------------------------------------------------


class Capacity:
    """The picker's view: `slots` requests may still be routed before every worker is busy."""

    def __init__(self, slots: int = 0) -> None:
        self.slots = slots
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.slots > 0


def admission(policy: QueuePolicy = QueuePolicy.FCFS, max_size: int = 100, slots: int = 0) -> tuple[AdmissionQueue, Capacity]:
    cap = Capacity(slots)
    return AdmissionQueue(RequestQueue(policy, max_size), cap), cap


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def waiter(aq: AdmissionQueue, cap: Capacity, item: QueuedRequest, log: list, *, ack: bool = True,
           book: bool = True) -> asyncio.Task:
    """A picker request: waits its turn, takes fresh costs (an await), books its load, acks."""

    async def run() -> None:
        try:
            await aq.wait_turn(item)
        except QueueRefused as refused:
            log.append((item.request_id, refused.reason))
            return
        await asyncio.sleep(0)  # fresh costs: the load is booked only after an await
        if book:
            cap.slots -= 1
            log.append(item.request_id)
        else:
            log.append((item.request_id, "gave-up"))
        if ack:
            aq.admitted(item.request_id)

    return asyncio.ensure_future(run())


def test_empty_queue_with_capacity_passes_straight_through() -> None:
    async def scenario() -> None:
        aq, cap = admission(slots=1)
        await asyncio.wait_for(aq.wait_turn(req("a", aq.now())), 1.0)
        assert aq.depth == 0

    asyncio.run(scenario())


def test_waiters_released_in_policy_order_as_capacity_frees() -> None:
    async def scenario() -> None:
        aq, cap = admission(QueuePolicy.FCFS)
        log: list = []
        t0 = aq.now()
        tasks = [
            waiter(aq, cap, req("a", t0, wait=30), log),
            waiter(aq, cap, req("b", t0 + 0.001, wait=30), log),
            waiter(aq, cap, req("vip", t0 + 0.002, jump=10.0, wait=30), log),
        ]
        await settle()
        assert aq.depth == 3 and log == []
        aq.poke()  # still busy: nothing moves
        await settle()
        assert aq.depth == 3 and log == []

        cap.slots = 1
        aq.poke()
        await settle()
        assert log == ["vip"] and aq.depth == 2 and cap.slots == 0
        aq.poke()  # no capacity after vip's load was booked
        await settle()
        assert log == ["vip"]

        cap.slots = 2  # room for two: one poke releases both, each after the previous one booked
        aq.poke()
        await settle()
        assert log == ["vip", "a", "b"] and aq.depth == 0 and cap.slots == 0
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_wspt_releases_short_requests_first() -> None:
    async def scenario() -> None:
        aq, cap = admission(QueuePolicy.WSPT)
        log: list = []
        t0 = aq.now()
        tasks = [waiter(aq, cap, req(name, t0, isl=isl), log) for name, isl in [("long", 8000), ("short", 50), ("mid", 900)]]
        await settle()
        cap.slots = 3
        aq.poke()
        await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
        assert log == ["short", "mid", "long"]

    asyncio.run(scenario())


def test_a_new_arrival_queues_behind_held_requests() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        first = waiter(aq, cap, req("first", t0), log)
        await settle()
        cap.slots = 1  # capacity freed, but nobody poked yet: the newcomer must not jump the queue
        second = waiter(aq, cap, req("second", t0 + 0.01), log)
        await settle()
        assert log == ["first"] and aq.depth == 1
        cap.slots = 1
        aq.poke()
        await asyncio.wait_for(asyncio.gather(first, second), 1.0)
        assert log == ["first", "second"]

    asyncio.run(scenario())


def test_one_release_at_a_time_until_admitted() -> None:
    async def scenario() -> None:
        aq, cap = admission(slots=0)
        log: list = []
        t0 = aq.now()
        tasks = [waiter(aq, cap, req(f"r{i}", t0 + i * 0.001), log, ack=False) for i in range(3)]
        await settle()
        cap.slots = 10  # plenty of room, but nobody acknowledges its booking
        aq.poke()
        await settle()
        assert log == ["r0"] and aq.depth == 2  # r0's load may not be booked yet: hold the rest
        aq.admitted("r2")  # not the outstanding release: ignored
        await settle()
        assert log == ["r0"]
        aq.poke()  # a later capacity event takes r0 as booked
        await settle()
        assert log == ["r0", "r1"]
        aq.admitted("r1")
        await settle()
        assert log == ["r0", "r1", "r2"] and aq.depth == 0
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_released_request_that_gives_up_passes_its_slot_on() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        tasks = [waiter(aq, cap, req("quitter", t0), log, book=False), waiter(aq, cap, req("next", t0 + 0.001), log)]
        await settle()
        cap.slots = 1
        aq.poke()
        await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
        assert log == [("quitter", "gave-up"), "next"] and cap.slots == 0

    asyncio.run(scenario())


def test_expiry_fires_on_its_own() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        quick = waiter(aq, cap, req("quick", t0, wait=0.05), log)
        slow = waiter(aq, cap, req("slow", t0, wait=0.5), log)
        await asyncio.wait_for(quick, 2.0)
        # Nothing poked: quick's deadline timer ended it, not before its deadline, and while slow
        # (a later deadline) still waits.
        assert aq.now() - t0 >= 0.04
        assert log == [("quick", "queue-timeout")]
        assert aq.depth == 1
        await asyncio.wait_for(slow, 2.0)
        assert log == [("quick", "queue-timeout"), ("slow", "queue-timeout")]
        assert aq.now() - t0 >= 0.49 and aq.depth == 0
        assert aq._timer is None

    asyncio.run(scenario())


def test_already_expired_and_full_are_refused() -> None:
    async def scenario() -> None:
        aq, cap = admission(max_size=1)
        with pytest.raises(QueueRefused) as late:
            await aq.wait_turn(req("late", aq.now() - 5.0, wait=1.0))
        assert late.value.reason == "queue-timeout"
        log: list = []
        held = waiter(aq, cap, req("held", aq.now()), log)
        await settle()
        with pytest.raises(QueueRefused) as full:
            await aq.wait_turn(req("extra", aq.now()))
        assert full.value.reason == "queue-full" and aq.depth == 1
        aq.close()
        await held

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        gone = waiter(aq, cap, req("gone", t0), log)
        waiter(aq, cap, req("stays", t0 + 0.001), log)
        await settle()
        gone.cancel()
        cap.slots = 1
        aq.poke()  # in the same iteration as the cancel: "gone" is skipped, not released
        await settle()
        assert gone.cancelled()
        assert log == ["stays"] and cap.slots == 0 and aq.depth == 0

    asyncio.run(scenario())


def test_cancelled_waiter_is_withdrawn_at_once() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        gone = waiter(aq, cap, req("gone", t0 - 5.0, wait=30), log)
        stays = waiter(aq, cap, req("stays", t0, wait=30), log)
        await settle()
        assert aq.depth == 2 and aq.oldest_wait() >= 5.0
        gone.cancel()
        await settle()
        assert aq.depth == 1 and aq.oldest_wait() < 4.0
        again = waiter(aq, cap, req("gone", t0 + 1.0, wait=30), log)  # the id is free again
        await settle()
        assert aq.depth == 2
        cap.slots = 2
        aq.poke()
        await asyncio.wait_for(asyncio.gather(stays, again), 1.0)
        assert log == ["stays", "gone"]

    asyncio.run(scenario())


def test_released_then_cancelled_waiter_passes_its_slot_on() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        first = waiter(aq, cap, req("first", t0), log)
        second = waiter(aq, cap, req("second", t0 + 0.001), log)
        await settle()
        cap.slots = 1
        aq.poke()  # releases "first"...
        first.cancel()  # ...which is cancelled before it can run
        await settle()
        assert first.cancelled()
        assert log == ["second"] and cap.slots == 0 and aq.depth == 0
        await second

    asyncio.run(scenario())


def test_close_refuses_everyone() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        log: list = []
        t0 = aq.now()
        tasks = [waiter(aq, cap, req(f"r{i}", t0 + i * 0.001, wait=0.5), log) for i in range(5)]
        await settle()
        assert aq.depth == 5
        aq.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
        assert sorted(log) == [(f"r{i}", "shutting-down") for i in range(5)]
        assert aq.depth == 0 and aq._timer is None
        cap.slots = 1
        with pytest.raises(QueueRefused) as after:
            await aq.wait_turn(req("after", aq.now()))
        assert after.value.reason == "shutting-down"
        aq.poke()  # harmless after close

    asyncio.run(scenario())


def test_failing_capacity_check_leaves_nothing_queued() -> None:
    async def scenario() -> None:
        calls = 0

        def flaky() -> bool:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("loads unavailable")
            return False

        aq = AdmissionQueue(RequestQueue(QueuePolicy.FCFS, 10), flaky)
        with pytest.raises(RuntimeError):
            await aq.wait_turn(req("a", aq.now()))
        assert aq.depth == 0 and aq._waiters == {}

    asyncio.run(scenario())


def test_oldest_wait_metric() -> None:
    async def scenario() -> None:
        aq, cap = admission()
        assert aq.oldest_wait() == 0.0
        log: list = []
        arrival = aq.now() - 2.0
        task = waiter(aq, cap, req("a", arrival, wait=10.0), log)
        await settle()
        before = aq.now()
        oldest = aq.oldest_wait()
        assert before - arrival <= oldest <= aq.now() - arrival  # the age at the call, however late it runs
        aq.close()
        await task

    asyncio.run(scenario())
