"""The pure replication core of the slot tracker (`dynamo_lite.slot_tracker.replication`):
replicas exchange batches by hand here, in every order a network could deliver them.

The property test runs two or three replicas (and one that only follows) that take writes and
deliver each other's batches in random interleavings (each origin's batches in order, some
twice, some after a later one), sometimes replacing a replica's state with another's (a
resync), then delivers the rest: every replica must end with the same loads and the same
requests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.base.errors import ServiceError
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.replication import (
    Add,
    Batch,
    Free,
    Gap,
    Heartbeat,
    Replica,
    Tag,
    decode_header,
    decode_message,
    encode,
)
from dynamo_lite.slot_tracker.snapshot import decode as decode_dump
from dynamo_lite.slot_tracker.snapshot import encode_pieces

pytestmark = pytest.mark.unit

MODEL, TENANT = "m", "default"
WORKERS = ((1, 2), (2, 1))  # worker id, dp size


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replica(origin: int, clock: Clock | None = None, *, register: bool = True) -> Replica:
    tracker = SlotTracker(request_ttl_secs=300, clock=clock or Clock())
    if register:
        for worker_id, dp_size in WORKERS:
            tracker.register(worker_id, MODEL, TENANT, 16, 0, dp_size)
    return Replica(tracker, origin=origin, wall_clock=lambda: 0.0)


def publish(source: Replica) -> Batch:
    batch = source.take_outbox()
    assert batch is not None
    # Through the wire format, as the shell sends it.
    decoded = decode_message(encode(batch))
    assert isinstance(decoded, Batch)
    return decoded


def state(replica: Replica) -> tuple[list[Any], dict[str, tuple]]:
    """What a gateway sees: `/loads`, and each active request (its TTL aside)."""
    loads = [dataclasses.asdict(load) for load in replica.tracker.loads()]
    dump = replica.tracker.dump(taken_at=0.0)
    requests = {(partition.tenant_id, request.request_id): (request.worker_id, request.dp_rank,
                                                            tuple(request.sequence_hashes), request.new_isl_tokens,
                                                            request.output_blocks)
                for partition in dump.partitions for request in partition.requests}
    return loads, requests


def requests_of(replica: Replica) -> dict[str, tuple]:
    return {request_id: value for (_, request_id), value in state(replica)[1].items()}


# --- one rule at a time --------------------------------------------------------------------------


def test_a_write_is_applied_where_it_was_taken_then_on_the_others_exactly_once() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "r", 1, 1, [1, 2, 3], 40)
    a.prefill_complete(MODEL, TENANT, "r")
    a.set_output_blocks(MODEL, TENANT, "r", 2)
    batch = publish(a)
    assert (batch.first_seq, batch.last_seq) == (1, 3)
    assert b.receive(batch) is None
    assert state(b) == state(a)
    assert requests_of(b) == {"r": (1, 1, (1, 2, 3), 0, 2)}
    assert b.receive(batch) is None  # delivered again: skipped by the version vector
    assert state(b) == state(a)
    assert (b.counts.applied, b.counts.duplicates) == (3, 3)
    assert b.vector[1] == 3
    a.free(MODEL, TENANT, "r")
    b.receive(publish(a))
    assert requests_of(a) == requests_of(b) == {}


def test_failed_writes_publish_nothing() -> None:
    a = replica(1)
    with pytest.raises(ServiceError):
        a.add(MODEL, TENANT, "r", 9, 0, [1])  # unknown worker
    with pytest.raises(ServiceError):
        a.prefill_complete(MODEL, TENANT, "nope")
    a.add(MODEL, TENANT, "r", 1, 0, [1])
    a.take_outbox()
    with pytest.raises(ServiceError):
        a.add(MODEL, TENANT, "r", 1, 0, [1])  # 409: already active
    a.set_output_blocks(MODEL, TENANT, "r", 3)
    a.take_outbox()
    with pytest.raises(ServiceError):
        a.set_output_blocks(MODEL, TENANT, "r", 2)  # 409: the count cannot shrink
    assert a.take_outbox() is None


def test_registrations_replicate_and_repeat_harmlessly() -> None:
    a, b = replica(1, register=False), replica(2, register=False)
    a.register(5, MODEL, TENANT, 16, 0, 2)
    b.receive(publish(a))
    assert b.tracker.workers() == a.tracker.workers()
    b.register(6, MODEL, TENANT, 16, 0, 1)
    a.receive(publish(b))
    a.unregister(5, MODEL, TENANT)
    b.unregister(5, MODEL, TENANT)  # both at once: each applies the other's as a no-op
    a.receive(publish(b))
    b.receive(publish(a))
    assert [w.worker_id for w in a.tracker.workers()] == [w.worker_id for w in b.tracker.workers()] == [6]
    c = replica(3, register=False)
    c.register(6, MODEL, TENANT, 32, 0, 1)  # another block size: refused here, counted
    c.receive(Batch(1, 1, 0.0, [publish_register(6, 16)]))
    assert c.counts.topology_conflicts == 1


def publish_register(worker_id: int, block_size: int) -> Any:
    from dynamo_lite.slot_tracker.replication import Register

    return Register(MODEL, TENANT, worker_id, block_size, 0, 1)


@pytest.mark.parametrize("order", ["a first", "b first"])
def test_the_same_id_added_on_two_replicas_is_the_smaller_origins_add_everywhere(order: str) -> None:
    a, b, c = replica(1), replica(2), replica(3)
    a.add(MODEL, TENANT, "r", 1, 0, [1, 2], 10)
    b.add(MODEL, TENANT, "r", 2, 0, [7, 8, 9], 20)
    from_a, from_b = publish(a), publish(b)
    a.receive(from_b)
    b.receive(from_a)
    for batch in ([from_a, from_b] if order == "a first" else [from_b, from_a]):
        c.receive(batch)
    assert requests_of(a) == requests_of(b) == requests_of(c) == {"r": (1, 0, (1, 2), 10, 0)}
    assert state(a) == state(b) == state(c)
    assert a.counts.conflicts == b.counts.conflicts == c.counts.conflicts == 1


def test_calls_on_the_losing_copy_count_for_the_winner() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "r", 1, 0, [1, 2], 10)
    b.add(MODEL, TENANT, "r", 1, 0, [1, 2], 10)  # a gateway retried on b
    b.prefill_complete(MODEL, TENANT, "r")
    b.set_output_blocks(MODEL, TENANT, "r", 4)
    from_a, from_b = publish(a), publish(b)
    a.receive(from_b)
    b.receive(from_a)
    assert requests_of(a) == requests_of(b) == {"r": (1, 0, (1, 2), 0, 4)}
    b.free(MODEL, TENANT, "r")  # b holds a's copy now: the free names it
    a.receive(publish(b))
    assert requests_of(a) == requests_of(b) == {}


def test_a_free_of_either_copy_ends_both() -> None:
    a, b, c = replica(1), replica(2), replica(3)
    a.add(MODEL, TENANT, "r", 1, 0, [1], 10)
    b.add(MODEL, TENANT, "r", 2, 0, [2], 10)
    b.free(MODEL, TENANT, "r")  # before b saw a's add: frees b's copy, and so a's
    from_a, from_b = publish(a), publish(b)
    a.receive(from_b)
    b.receive(from_a)
    c.receive(from_a)
    c.receive(from_b)
    assert requests_of(a) == requests_of(b) == requests_of(c) == {}


def test_a_free_that_overtakes_its_add_leaves_a_tombstone() -> None:
    a, b, c = replica(1), replica(2), replica(3)
    a.add(MODEL, TENANT, "r", 1, 0, [1, 2], 10)
    add = publish(a)
    b.receive(add)
    b.free(MODEL, TENANT, "r")  # the gateway freed it through b, which had it
    free = publish(b)
    c.receive(free)  # c gets the free first (a replay, another NATS route)
    c.receive(add)
    assert requests_of(c) == {} and c.counts.late_adds == 1
    a.receive(free)
    assert requests_of(a) == requests_of(b) == {}


def test_a_free_of_an_id_not_held_yet_ends_the_add_that_arrives_later() -> None:
    a, b, c = replica(1), replica(2), replica(3)
    a.add(MODEL, TENANT, "r", 1, 0, [1], 10)
    b.free(MODEL, TENANT, "r")  # the gateway's free reached b before a's add did: 200 there
    add, free = publish(a), publish(b)
    assert isinstance(free.ops[0], Free) and free.ops[0].target is None
    a.receive(free)
    b.receive(add)
    c.receive(add)
    c.receive(free)
    assert requests_of(a) == requests_of(b) == requests_of(c) == {}
    assert b.counts.late_adds == 1


def test_an_id_reused_after_its_free_is_a_new_request_everywhere() -> None:
    a, b, c = replica(1), replica(2), replica(3)
    a.add(MODEL, TENANT, "r", 1, 0, [1], 10)
    a.free(MODEL, TENANT, "r")
    first = publish(a)
    b.receive(first)
    b.add(MODEL, TENANT, "r", 2, 0, [5, 6], 30)  # b saw the free: its add comes after it
    second = publish(b)
    c.receive(second)  # even before the first request's add and free
    c.receive(first)
    a.receive(second)
    assert requests_of(a) == requests_of(b) == requests_of(c) == {"r": (2, 0, (5, 6), 30, 0)}
    assert a.counts.conflicts == 0


def test_a_repeated_free_does_not_end_a_later_reuse_that_saw_it() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "r", 1, 0, [1], 10)
    a.free(MODEL, TENANT, "r")
    a.free(MODEL, TENANT, "r")  # a retried free: a no longer holds it
    b.receive(publish(a))
    b.add(MODEL, TENANT, "r", 1, 1, [3], 5)
    a.receive(publish(b))
    assert requests_of(a) == requests_of(b) == {"r": (1, 1, (3,), 5, 0)}


def test_gaps_hold_later_batches_until_the_missing_ops_arrive() -> None:
    a, b = replica(1), replica(2)
    batches = []
    for number in range(4):
        a.add(MODEL, TENANT, f"r{number}", 1, 0, [number], 1)
        batches.append(publish(a))
    assert b.receive(batches[0]) is None
    assert b.receive(batches[2]) == Gap(1, 2, 2)
    assert b.receive(batches[3]) == Gap(1, 2, 2)
    assert set(requests_of(b)) == {"r0"} and b.counts.gaps == 1
    assert b.receive(batches[1]) is None  # the replay: everything held is applied, in order
    assert set(requests_of(b)) == {"r0", "r1", "r2", "r3"}
    assert b.vector[1] == 4 and not b.held


def test_a_heartbeat_reveals_ops_lost_at_the_end_of_a_burst() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "r0", 1, 0, [1], 1)
    b.receive(publish(a))
    a.add(MODEL, TENANT, "r1", 1, 0, [2], 1)
    lost = publish(a)
    assert b.receive(a.heartbeat(a.seq)) == Gap(1, 2, 2)
    assert b.receive(Heartbeat(1, 2, 0.0)) == Gap(1, 2, 2) and b.counts.gaps == 1
    assert b.skip(1) == 1  # nobody could send it again
    assert b.counts.lost == 1 and b.gap(1) is None
    b.receive(lost)  # it turns up after all: already given up on
    assert set(requests_of(b)) == {"r0"}


def test_skipping_a_gap_applies_what_was_held_behind_it() -> None:
    a, b = replica(1), replica(2)
    batches = []
    for number in range(3):
        a.add(MODEL, TENANT, f"r{number}", 1, 0, [number], 1)
        batches.append(publish(a))
    b.receive(batches[0])
    b.receive(batches[2])
    assert b.skip(1) == 1
    assert set(requests_of(b)) == {"r0", "r2"}


def transfer(source: Replica) -> tuple[Any, Any]:
    """`collect_state` through the wire formats the shell uses."""
    header, dump = source.collect_state(taken_at=0.0)
    return decode_header(encode(header)), decode_dump(b"".join(encode_pieces(dump)))


def test_a_joining_replica_skips_buffered_ops_its_state_already_holds() -> None:
    clock = Clock()
    a, b = replica(1, clock), replica(2, clock)
    a.add(MODEL, TENANT, "r0", 1, 0, [1, 2], 10)
    first = publish(a)
    b.receive(first)
    b.add(MODEL, TENANT, "r1", 2, 0, [3], 5)
    from_b = publish(b)
    a.receive(from_b)
    joiner = replica(3, clock, register=False)
    # Subscribed first, so it buffered a batch the state holds, and one it does not.
    a.prefill_complete(MODEL, TENANT, "r0")
    later = publish(a)
    header, dump = transfer(a)  # taken after `later` was applied
    a.free(MODEL, TENANT, "r1")
    newest = publish(a)
    held = joiner.load_state(header, dump)
    joiner.own_ops([])
    assert header.vector == {1: 2, 2: 1}
    for batch in [*held, first, from_b, later, newest]:
        joiner.receive(batch)
    b.receive(later)
    b.receive(newest)
    assert state(joiner) == state(a) == state(b)
    assert joiner.counts.applied == 1 and joiner.counts.duplicates == 3
    assert joiner.tracker.workers() == a.tracker.workers()
    # The joiner knows what the others know of each request id: a late copy of r1's add is ignored.
    joiner.receive(Batch(2, 1, 0.0, [Add(MODEL, TENANT, "r1", 2, 0, [3], 5)]))
    assert "r1" not in requests_of(joiner)


def test_a_resync_keeps_this_replicas_own_ops_the_other_had_not_applied() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "mine", 1, 0, [1], 10)
    published = publish(a)  # b lost it
    a.add(MODEL, TENANT, "queued", 1, 1, [2], 10)  # still in the outbox
    b.add(MODEL, TENANT, "theirs", 2, 0, [3], 10)
    a.receive(publish(b))
    header, dump = transfer(b)
    held = a.load_state(header, dump)
    a.own_ops([published])
    assert not held and set(requests_of(a)) == {"mine", "queued", "theirs"}
    assert a.counts.lost == 0 and a.vector[1] == a.seq == 2
    b.receive(published)
    b.receive(publish(a))
    assert state(a) == state(b)


def test_own_ops_no_longer_logged_are_counted_as_lost() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "gone", 1, 0, [1], 10)
    publish(a)
    header, dump = transfer(b)
    a.load_state(header, dump)
    a.own_ops([])
    assert a.counts.lost == 1 and a.vector[1] == 1 and requests_of(a) == {}


def test_histories_and_silent_origins_are_forgotten_a_ttl_later() -> None:
    clock = Clock()
    a, b = replica(1, clock), replica(2, clock)
    a.add(MODEL, TENANT, "r", 1, 0, [1], 10)
    a.free(MODEL, TENANT, "r")
    b.receive(publish(a))
    assert b.remembered() == 1 and 1 in b.vector
    clock.now += 299
    assert b.prune() == 0
    clock.now += 2
    assert b.prune() == 1 and b.remembered() == 0 and 1 not in b.vector


def test_a_snapshot_loaded_alone_gives_every_request_a_history() -> None:
    source = SlotTracker()
    source.register(1, MODEL, TENANT, 16, 0, 1)
    source.add(MODEL, TENANT, "kept", 1, 0, [1, 2], 9)
    a = replica(7, register=False)
    a.tracker.restore(source.dump(taken_at=0.0))
    assert a.adopt_tracker() == 1
    a.prefill_complete(MODEL, TENANT, "kept")
    assert publish(a).ops[0].target == Tag(7, 0)
    b = replica(8, register=False)
    b.load_state(*transfer(a))
    b.free(MODEL, TENANT, "kept")
    a.receive(publish(b))
    assert requests_of(a) == requests_of(b) == {}


def test_the_delay_histogram_counts_from_acceptance_to_application() -> None:
    times = iter([10.0, 10.004])
    a = Replica(SlotTracker(), origin=1, wall_clock=lambda: next(times))
    b = Replica(SlotTracker(), origin=2, wall_clock=lambda: next(times))
    a.register(1, MODEL, TENANT, 16, 0, 1)
    b.receive(publish(a))
    assert b.counts.last_delay == pytest.approx(0.004)
    assert sum(b.counts.delay_buckets) == 1


# --- any interleaving ------------------------------------------------------------------------------

REQUEST_IDS = ("r0", "r1", "r2")
HASHES = st.lists(st.integers(0, 6), max_size=5)

local_write = st.tuples(
    st.just("write"),
    st.integers(0, 2),  # replica
    st.sampled_from(["add", "add", "prefill", "output", "free", "free"]),
    st.sampled_from(REQUEST_IDS),
    st.tuples(st.sampled_from([(1, 0), (1, 1), (2, 0)]), HASHES, st.integers(0, 50), st.integers(0, 3)),
)
delivery = st.tuples(
    st.just("deliver"),
    st.integers(0, 3),  # to (3: a replica that only follows)
    st.integers(0, 2),  # from
    st.sampled_from(["next", "next", "next", "skip ahead", "again"]),
)
resync = st.tuples(st.just("resync"), st.integers(0, 3), st.integers(0, 3))  # to, from


def run_scenario(origins: int, steps: list[tuple], final_orders: list[list[int]]) -> list[Replica]:
    replicas = [replica(origin + 1) for origin in range(origins)] + [replica(99)]
    published: list[list[Batch]] = [[] for _ in range(origins)]
    delivered = [[set() for _ in range(origins)] for _ in replicas]
    for step in steps:
        if step[0] == "write":
            _, index, kind, request_id, (rank, hashes, tokens, extra) = step
            if index >= origins:
                continue
            source = replicas[index]
            try:
                if kind == "add":
                    source.add(MODEL, TENANT, request_id, rank[0], rank[1], hashes, tokens)
                elif kind == "prefill":
                    source.prefill_complete(MODEL, TENANT, request_id)
                elif kind == "output":
                    held = source.tracker.partitions[(MODEL, TENANT)].requests.get(request_id)
                    count = (held.output_blocks if held is not None else 0) + extra
                    source.set_output_blocks(MODEL, TENANT, request_id, count)
                else:
                    source.free(MODEL, TENANT, request_id)
            except ServiceError:
                continue
            batch = source.take_outbox()
            if batch is not None:
                published[index].append(batch)
        elif step[0] == "resync":
            # A gap healed by a whole state: `to` loads `source`'s, then re-applies its own ops.
            _, to, source = step
            to, source = min(to, origins), min(source, origins)
            if to == source:
                continue
            target = replicas[to]
            held = target.load_state(*transfer(replicas[source]))
            target.own_ops(published[to] if to < origins else [])
            for batch in held:
                target.receive(batch)
            for origin in range(origins):
                done = target.vector.get(origin + 1, 0)
                delivered[to][origin] = {n for n, batch in enumerate(published[origin]) if batch.last_seq <= done}
        else:
            _, to, origin, how = step
            to = min(to, origins)  # past the origins: the follower
            if origin >= origins or to == origin or not published[origin]:
                continue
            done = delivered[to][origin]
            waiting = [n for n in range(len(published[origin])) if n not in done]
            if how == "again" and done:
                number = min(done)
            elif waiting:
                number = waiting[min(1, len(waiting) - 1)] if how == "skip ahead" else waiting[0]
            else:
                continue
            done.add(number)
            replicas[to].receive(published[origin][number])
    # Everything left, to everyone, each origin's batches in order, origins interleaved as drawn.
    for to, order in zip(range(len(replicas)), final_orders):
        cursors = [0] * origins
        for origin in order + [o for o in range(origins) for _ in published[o]]:
            origin %= origins
            while cursors[origin] < len(published[origin]) and cursors[origin] in delivered[to][origin]:
                cursors[origin] += 1
            if cursors[origin] < len(published[origin]) and to != origin:
                replicas[to].receive(published[origin][cursors[origin]])
                delivered[to][origin].add(cursors[origin])
    for target in replicas:
        for origin in range(origins):
            assert target.gap(origin + 1) is None
    return replicas


@settings(max_examples=400)
@given(
    origins=st.integers(2, 3),
    steps=st.lists(st.one_of(local_write, delivery, resync), min_size=20, max_size=100),
    final_orders=st.lists(st.lists(st.integers(0, 2), max_size=40), min_size=4, max_size=4),
)
def test_replicas_that_received_the_same_ops_hold_the_same_requests(
    origins: int, steps: list[tuple], final_orders: list[list[int]]
) -> None:
    replicas = run_scenario(origins, steps, final_orders)
    first = state(replicas[0])
    for other in replicas[1:]:
        assert state(other) == first
