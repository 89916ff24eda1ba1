"""The slot tracker's dump (`GET /dump`, `--snapshot`, `--peers`) in process: restoring a dump
gives back exactly the loads, potential loads, workers and expiry times of the tracker it came
from; the document's encoding and versioning; snapshot files at start-up and shutdown."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from dynamo_lite.base.errors import Conflict, InvalidArgument, NotFound, ServiceError
from dynamo_lite.client import AsyncSlotTrackerClient
from dynamo_lite.durability.snapshots import SnapshotError
from dynamo_lite.slot_tracker import snapshot
from dynamo_lite.slot_tracker.app import SlotTrackerConfig, create_app
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.protocols import SlotTrackerDump

pytestmark = pytest.mark.unit

TTL = 100  # of the examples
PROPERTY_TTL = 300  # of the random operations, whose time steps add up to a few hundred seconds


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def state(tracker: SlotTracker) -> tuple[list, list]:
    return tracker.loads(), tracker.workers()


def potential(tracker: SlotTracker, queries: list[list[int]]) -> list:
    return [tracker.potential_loads(*key, query, 7) for key in sorted(tracker.partitions) for query in queries]


def round_trip(tracker: SlotTracker, taken_at: float = 0.0) -> SlotTrackerDump:
    """The dump as another process reads it: through its JSON text, written in pieces."""
    text = b"".join(snapshot.encode_pieces(tracker.dump(taken_at=taken_at)))
    return snapshot.decode(text)


# --- random operations, dump, restore ----------------------------------------------------------

PREFIXES = [[(p << 20) + i for i in range(n)] for p, n in enumerate([4, 12, 30])]


@st.composite
def hash_lists(draw: st.DrawFn) -> list[int]:
    """Chained prompts (a shared prefix, then own hashes), and small-pool hashes with repeats
    that split groups in every way."""
    if draw(st.booleans()):
        prefix = draw(st.sampled_from(PREFIXES))
        own = draw(st.integers(0, 30))
        return prefix[: draw(st.integers(0, len(prefix)))] + [-(own * 100 + i) - 1 for i in range(draw(st.integers(0, 5)))]
    return draw(st.lists(st.integers(-6, 12), max_size=16))


register = st.tuples(st.just("register"), st.integers(1, 4), st.integers(1, 3), st.sampled_from(["default", "t2"]))
registrations = st.lists(register, min_size=1, max_size=4)
ARGUMENTS = {
    "add": st.tuples(st.integers(0, 50), hash_lists(), st.integers(0, 500)),
    "prefill_complete": st.tuples(st.integers(0, 60)),
    "output_blocks": st.tuples(st.integers(0, 60), st.integers(0, 40)),
    "free": st.tuples(st.integers(0, 60)),
    "unregister": st.tuples(st.integers(0, 50)),
    "time_passes": st.tuples(st.integers(0, 150)),
}
# Mostly adds, so that dumps hold many requests; every kind of change in between.
KINDS = ["add"] * 8 + ["prefill_complete", "output_blocks", "output_blocks", "free", "free", "unregister",
                       "time_passes", "register"]
operations = st.lists(
    st.sampled_from(KINDS).flatmap(
        lambda kind: register if kind == "register" else ARGUMENTS[kind].map(lambda args: (kind, *args))
    ),
    min_size=10, max_size=80,
)


def apply(tracker: SlotTracker, clock: FakeClock, ops: list[tuple]) -> None:
    """Random operations; those the tracker refuses (a request id twice, a smaller output
    count, an unknown worker) are part of the test too: they must leave no trace in a dump."""
    added: list[tuple[str, str, str]] = []  # (model, tenant, request id)
    for op in ops:
        kind, *args = op
        workers = [(key, worker_id, dp_rank) for key, p in sorted(tracker.partitions.items())
                   for (worker_id, dp_rank) in p.slots]
        try:
            if kind == "register":
                worker_id, dp_size, tenant = args
                tracker.register(worker_id, "m", tenant, 16, 0, dp_size)
            elif kind == "add" and workers:
                pick, hashes, tokens = args
                (model, tenant), worker_id, dp_rank = workers[pick % len(workers)]
                request_id = f"r{pick}"  # ids come back: some adds are 409s
                tracker.add(model, tenant, request_id, worker_id, dp_rank, hashes, tokens)
                added.append((model, tenant, request_id))
            elif kind in ("prefill_complete", "free", "output_blocks") and added:
                model, tenant, request_id = added[args[0] % len(added)]
                if kind == "prefill_complete":
                    tracker.prefill_complete(model, tenant, request_id)
                elif kind == "free":
                    tracker.free(model, tenant, request_id)
                else:
                    tracker.set_output_blocks(model, tenant, request_id, args[1])
            elif kind == "unregister" and workers:
                (model, tenant), worker_id, _ = workers[args[0] % len(workers)]
                tracker.unregister(worker_id, model, tenant)
            elif kind == "time_passes":
                clock.now += args[0]
                tracker.expire()
        except ServiceError:
            pass


QUERIES = [[], PREFIXES[1][:6], PREFIXES[2] + [-1, -2], list(range(-6, 12)), [3, 3, 3, -101]]


@settings(max_examples=300)
@given(workers=registrations, ops=operations, later=st.integers(0, 200), elapsed=st.integers(0, 200))
def test_a_restored_tracker_answers_exactly_as_the_dumped_one(
    workers: list[tuple], ops: list[tuple], later: int, elapsed: int
) -> None:
    clock = FakeClock(1000.0)
    original = SlotTracker(request_ttl_secs=PROPERTY_TTL, clock=clock)
    apply(original, clock, workers + ops)
    original.expire()  # a dump leaves out what the next sweep frees
    dump = round_trip(original)
    assert snapshot.encode(dump) == snapshot.encode(original.dump(taken_at=0.0))

    # Another process: its monotonic clock is elsewhere.
    restored_clock = FakeClock(50_000.0)
    restored = SlotTracker(request_ttl_secs=PROPERTY_TTL, clock=restored_clock)
    restored.restore(dump)
    assert state(restored) == state(original)
    assert potential(restored, QUERIES) == potential(original, QUERIES)
    assert restored.dump(taken_at=0.0) == original.dump(taken_at=0.0)

    # The TTLs left carried over: both expire the same requests from here on.
    clock.now += later
    restored_clock.now += later
    assert original.expire() == restored.expire()
    assert state(restored) == state(original)

    # Restored `elapsed` seconds after the dump (the process was down that long): as the
    # original is after that long, the requests that expired meanwhile left out.
    late = SlotTracker(request_ttl_secs=PROPERTY_TTL, clock=FakeClock(7.0))
    report = late.restore(dump, elapsed_secs=later + elapsed)
    clock.now += elapsed
    expired = original.expire()
    assert state(late) == state(original)
    assert potential(late, QUERIES) == potential(original, QUERIES)
    assert report.requests == sum(len(p.requests) for p in original.partitions.values())
    assert report.expired + report.requests == sum(len(p.requests) for p in dump.partitions)
    assert expired >= 0


# --- the core's dump and restore, by example ------------------------------------------------------


def sample(clock: FakeClock) -> SlotTracker:
    tracker = SlotTracker(request_ttl_secs=TTL, clock=clock)
    tracker.register(7, "llama", "default", 16, 0, 2)
    tracker.register(3, "llama", "default", 16, 4, 1)
    tracker.register(1, "llama", "team-b", 32, 0, 1)
    tracker.add("llama", "default", "a", 7, 0, [1, 2, 3, 3], 48)
    clock.now += 10
    tracker.add("llama", "default", "b", 7, 1, [1, 2, 4], 16)
    tracker.prefill_complete("llama", "default", "b")
    tracker.set_output_blocks("llama", "default", "b", 2)
    tracker.add("llama", "team-b", "a", 1, 0, [2**63 - 1, -(2**63)], 5)
    return tracker


def test_the_dump_holds_workers_and_requests_with_the_ttl_they_have_left() -> None:
    clock = FakeClock(1000.0)
    tracker = sample(clock)
    clock.now += 30
    document = orjson.loads(snapshot.encode(tracker.dump(taken_at=1_700_000_000.5)))
    assert document == {"version": 1, "taken_at": 1_700_000_000.5, "partitions": [
        {"model_name": "llama", "tenant_id": "default",
         "workers": [{"worker_id": 3, "block_size": 16, "dp_start": 4, "dp_size": 1},
                     {"worker_id": 7, "block_size": 16, "dp_start": 0, "dp_size": 2}],
         "requests": [
             {"request_id": "a", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [1, 2, 3, 3],
              "new_isl_tokens": 48, "output_blocks": 0, "remaining_ttl_secs": 60.0},
             {"request_id": "b", "worker_id": 7, "dp_rank": 1, "sequence_hashes": [1, 2, 4],
              "new_isl_tokens": 0, "output_blocks": 2, "remaining_ttl_secs": 70.0}]},
        {"model_name": "llama", "tenant_id": "team-b",
         "workers": [{"worker_id": 1, "block_size": 32, "dp_start": 0, "dp_size": 1}],
         "requests": [{"request_id": "a", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [2**63 - 1, -(2**63)],
                       "new_isl_tokens": 5, "output_blocks": 0, "remaining_ttl_secs": 70.0}]},
    ]}
    clock.now += 60  # "a" is past its TTL, not yet swept: the dump leaves it out
    assert [r.request_id for r in tracker.dump(taken_at=0).partitions[0].requests] == ["b"]


def test_restore_drops_what_expired_and_cuts_ttls_to_its_own() -> None:
    clock = FakeClock(1000.0)
    dump = sample(clock).dump(taken_at=0.0)  # "a" has 90 s left, the others 100 s
    shorter = SlotTracker(request_ttl_secs=50, clock=FakeClock(0.0))
    report = shorter.restore(dump, elapsed_secs=95)
    assert (report.workers, report.requests, report.expired) == (3, 2, 1)
    assert [(load.worker_id, load.dp_rank, load.active_decode_blocks) for load in shorter.loads("llama", "default")] \
        == [(3, 4, 0), (7, 0, 0), (7, 1, 5)]
    # 5 s were left; a tracker whose TTL is 50 s keeps none for longer than that
    assert [r.remaining_ttl_secs for p in shorter.dump(taken_at=0).partitions for r in p.requests] == [5.0, 5.0]
    capped = SlotTracker(request_ttl_secs=50, clock=FakeClock(0.0))
    capped.restore(dump)
    assert [r.remaining_ttl_secs for p in capped.dump(taken_at=0).partitions for r in p.requests] == [50.0] * 3


@pytest.mark.parametrize(("edit", "error", "message"), [
    (lambda d: d["partitions"][0]["requests"][0].update(dp_rank=5), NotFound,
     "model=llama tenant_id=default: worker 7 dp_rank 5 is not registered"),
    (lambda d: d["partitions"][0]["requests"][1].update(request_id="a"), Conflict,
     "model=llama tenant_id=default: request a already exists"),
    (lambda d: d["partitions"][0]["requests"].reverse(), InvalidArgument,
     "model=llama tenant_id=default: request a is out of expiry order"),
    (lambda d: d["partitions"].append(d["partitions"][0]), Conflict, "partition listed twice"),
    (lambda d: d["partitions"][1]["workers"].clear(), NotFound, "no slot tracker for model=llama tenant_id=team-b"),
])
def test_an_inconsistent_dump_is_refused_and_changes_nothing(edit, error: type, message: str) -> None:
    clock = FakeClock(1000.0)
    document = orjson.loads(snapshot.encode(sample(clock).dump(taken_at=0.0)))
    edit(document)
    tracker = SlotTracker(clock=clock)
    tracker.register(99, "kept", "default", 4, 0, 1)
    with pytest.raises(error, match=message):
        tracker.restore(snapshot.decode(orjson.dumps(document)))
    assert [w.worker_id for w in tracker.workers()] == [99]


@pytest.mark.parametrize(("text", "message"), [
    (b'{"version": 2, "taken_at": 0, "partitions": []}', "Invalid enum value 2 - at `$.version`"),
    (b'{"m:default": {"block_size": 16, "events": []}}', "missing required field `version`"),
    ((b'{"version": 1, "taken_at": 0, "partitions": [{"model_name": "m", "tenant_id": "d", "workers": [], '
      b'"requests": [{"request_id": "r", "worker_id": -1}]}]}'), "at `$.partitions[0].requests[0].worker_id`"),
    (b'{"version": 1, "taken_at": 0, "partitions": [', "truncated"),
])
def test_only_a_dump_of_this_version_decodes(text: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        snapshot.decode(text)


def test_pieces_join_into_the_document() -> None:
    clock = FakeClock(0.0)
    tracker = sample(clock)
    for i in range(10):
        tracker.add("llama", "default", f"x{i}", 3, 4, [i, i + 1], i)
    dump = tracker.dump(taken_at=12.25)
    pieces = list(snapshot.encode_pieces(dump, batch=3))
    assert len(pieces) > 8
    assert b"".join(pieces) == snapshot.encode(dump) == msgspec.json.encode(dump)
    assert b"".join(snapshot.encode_pieces(SlotTracker().dump(taken_at=0))) == b'{"version":1,"taken_at":0,"partitions":[]}'


# --- GET /dump, the client, and snapshot files ----------------------------------------------------


def test_get_dump_and_the_client_return_the_state_that_restores_it() -> None:
    async def scenario() -> None:
        app = create_app()
        transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service")
        async with AsyncSlotTrackerClient(client=transport) as client:
            await client.register(7, "m", 16, dp_size=2)
            await client.add("m", "r1", 7, 1, [1, 2, 3], 48)
            await client.add("m", "r2", 7, 0, [1, 2], 8)
            await client.prefill_complete("m", "r2")
            document = await client.dump()
            assert [r["request_id"] for r in document["partitions"][0]["requests"]] == ["r1", "r2"]
            assert 299 < document["partitions"][0]["requests"][0]["remaining_ttl_secs"] <= 300
            assert abs(document["taken_at"] - time.time()) < 60
            copy = SlotTracker()
            copy.restore(snapshot.decode(orjson.dumps(document)))
            assert copy.loads() == [load for load in app.state.tracker.loads()]

    asyncio.run(scenario())


def write_dump(path: Path, tracker: SlotTracker, taken_at: float) -> None:
    path.write_bytes(snapshot.encode(tracker.dump(taken_at=taken_at)))


def test_a_snapshot_loads_before_serving_less_the_time_it_waited(tmp_path: Path) -> None:
    path = tmp_path / "tracker.json"
    clock = FakeClock(1000.0)
    write_dump(path, sample(clock), taken_at=time.time() - 95)  # "a" had 90 s left, the others 100
    with TestClient(create_app(SlotTrackerConfig(snapshot=str(path), request_ttl_secs=TTL))) as client:
        document = client.get("/dump").json()
        left = {(p["tenant_id"], r["request_id"]): r["remaining_ttl_secs"]
                for p in document["partitions"] for r in p["requests"]}
        assert left.keys() == {("default", "b"), ("team-b", "a")}
        assert all(4 < seconds <= 5 for seconds in left.values())
        assert [w["worker_id"] for w in client.get("/workers").json()] == [3, 7, 1]


def test_shutdown_writes_the_final_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "tracker.json"
    with TestClient(create_app(SlotTrackerConfig(snapshot=str(path), snapshot_interval_secs=3600))) as client:
        assert client.post("/register", json={"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0,
                                              "dp_size": 1}).status_code == 201
        assert client.post("/add", json={"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0,
                                         "sequence_hashes": [5, 6]}).status_code == 201
        expected = client.get("/loads").json()
        assert not path.exists()
    with TestClient(create_app(SlotTrackerConfig(snapshot=str(path)))) as client:
        assert client.get("/loads").json() == expected


def test_periodic_snapshots_are_written_only_when_the_state_changed(tmp_path: Path) -> None:
    async def scenario() -> int:
        tracker = SlotTracker()
        saver = snapshot.TrackerSnapshots(tracker, str(tmp_path / "tracker.json"), 0.01)
        task = asyncio.create_task(saver.run_periodically())
        await asyncio.sleep(0.2)
        tracker.register(1, "m", "default", 4, 0, 1)
        await asyncio.sleep(0.2)
        tracker.loads()  # a read changes nothing
        await asyncio.sleep(0.2)
        task.cancel()
        return saver.written

    assert asyncio.run(scenario()) == 2  # the first state, then the registration


@pytest.mark.parametrize("content", [b'{"version": 1, "taken_at": 0, "partitions": [{', b"[]", b"\xff"])
def test_a_bad_snapshot_stops_start_up_and_is_kept(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "tracker.json"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match=f"snapshot {path} is not a slot tracker dump"):
        with TestClient(create_app(SlotTrackerConfig(snapshot=str(path)))):
            pass
    assert path.read_bytes() == content


def test_a_bad_snapshot_is_moved_aside_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "tracker.json"
    # A request on a worker the dump does not have (and not expired: it was taken just now)
    document = {"version": 1, "taken_at": time.time(), "partitions": [{"model_name": "m", "tenant_id": "default",
                "workers": [], "requests": [{"request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [],
                                             "new_isl_tokens": 0, "output_blocks": 0, "remaining_ttl_secs": 60}]}]}
    path.write_bytes(orjson.dumps(document))
    with TestClient(create_app(SlotTrackerConfig(snapshot=str(path), ignore_bad_snapshot=True))) as client:
        assert client.get("/workers").json() == []
    assert orjson.loads((tmp_path / "tracker.json.bad").read_bytes()) == document
