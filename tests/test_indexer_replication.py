"""The pure side of indexer replicas (`dynamo_lite.indexer.replication`): stream messages applied
to an `Indexer`, snapshots that carry what a dump does not, message ids, readiness.

The property test is the one the replicas rely on: a replica that loads a snapshot taken at any
point of a stream, then applies the rest of the stream, ends exactly where a replica that applied
the whole stream ends (blocks, registrations, endpoints, watermarks, approximations).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.indexer import replication
from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.listeners import Listeners
from dynamo_lite.indexer.nats_replica import StreamReplica, StreamSettings
from dynamo_lite.indexer.replication import Batch, Register, Reset, Routed, Unregister
from dynamo_lite.kv_publishers import Stored, WireFormat, encode_batch

pytestmark = pytest.mark.unit

MODEL = "m"
BLOCK = 4


def events_message(worker_id: int, event_id: int, chain: list[int], *, dp_rank: int = 0) -> bytes:
    blocks = [{"block_hash": 10_000 + h, "tokens_hash": h} for h in chain]
    return orjson.dumps({f"{MODEL}:default": {"block_size": BLOCK, "events": [
        {"worker_id": worker_id, "storage_tier": "device", "event": {
            "event_id": event_id, "dp_rank": dp_rank, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}},
    ]}})


def vllm_batch(worker_id: int, seq: int, hashes: list[int]) -> Batch:
    payload = encode_batch(WireFormat.VLLM, [Stored(block_hashes=hashes, parent_block_hash=None,
                                                    token_ids=list(range(BLOCK * len(hashes))), block_size=BLOCK)],
                           dp_rank=0, ts=1.0)
    return Batch(MODEL, "default", BLOCK, worker_id, 0, seq, payload)


def _canonical_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """A dump as sets of (rank, parent, block) edges: two equal indexes may list their chains in
    different orders (a tree's children come in insertion order, and a replica loaded from a
    snapshot inserted them in the snapshot's order), which renumbers the dump's event ids too."""
    canonical = {}
    for key, partition in dump.items():
        edges = set()
        for item in partition.get("events", []):
            event = item["event"]
            stored = event["data"].get("stored")
            if stored is None:
                edges.add((item["worker_id"], item["storage_tier"], event["dp_rank"], "other", orjson.dumps(event["data"])))
                continue
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                edges.add((item["worker_id"], item["storage_tier"], event["dp_rank"], parent, block["block_hash"],
                           block["tokens_hash"]))
                parent = block["block_hash"]
        approximations = set()
        for chain in partition.get("approximations", []):
            parent = chain["parent_hash"]
            for block in chain["blocks"]:
                approximations.add((chain["worker_id"], chain["dp_rank"], parent, block["block_hash"],
                                    block["tokens_hash"], block["expires_at"]))
                parent = block["block_hash"]
        canonical[key] = (partition["block_size"], frozenset(edges), frozenset(approximations))
    return canonical


def state_of(indexer: Indexer) -> Any:
    """Everything a replica answers with, in comparable form."""
    return (_canonical_dump(orjson.loads(orjson.dumps(indexer.dump()))), indexer.rank_states(),
            [(w.instance_id, [(r.dp_rank, r.source, r.registered, r.blocks, r.approximate_blocks, r.last_event_id)
                              for r in w.ranks]) for w in indexer.workers()])


def test_each_kind_applies_and_says_what_the_shell_must_do() -> None:
    indexer = Indexer()
    applied = replication.apply(indexer, *replication.encode(
        Register(MODEL, "default", BLOCK, 7, 0, "tcp://127.0.0.1:5557", None)))
    assert applied.error is None and [s.endpoint for s in applied.subscribe] == ["tcp://127.0.0.1:5557"]
    assert replication.apply(indexer, replication.EVENTS, events_message(7, 0, [1, 2])).report.applied == 1
    assert query_answer(indexer.query(MODEL, "default", [1, 2]))["scores"] == {"7": {"0": 2 * BLOCK}}
    applied = replication.apply(indexer, *replication.encode(Routed(MODEL, "default", 8, 0, [1, 2, 3])))
    assert applied.error is None and applied.report.recorded == 3
    assert replication.apply(indexer, *replication.encode(vllm_batch(7, 0, [5]))).error is None
    replication.apply(indexer, *replication.encode(Reset(MODEL, "default", [(7, 0)], 0)))
    assert query_answer(indexer.query(MODEL, "default", [1, 2]))["scores"] == {"8": {"0": 2 * BLOCK}}
    applied = replication.apply(indexer, *replication.encode(Unregister(MODEL, "default", 7)))
    assert applied.unsubscribe == [(7, 0)]


def test_a_refused_message_changes_nothing_and_names_the_reason() -> None:
    indexer = Indexer()
    replication.apply(indexer, *replication.encode(Register(MODEL, "default", BLOCK, 7, 0)))
    before = state_of(indexer)
    for kind, data in [replication.encode(Register(MODEL, "default", BLOCK, 7, 0)),
                       replication.encode(Register(MODEL, "default", BLOCK * 2, 9, 0)),
                       replication.encode(Unregister(MODEL, "default", 99)),
                       replication.encode(Routed("unknown", "default", 1, 0, [1])),
                       (replication.EVENTS, b"{not json"),
                       (replication.BATCH, b"\x00garbage"),
                       ("no-such-kind", b"")]:
        applied = replication.apply(indexer, kind, data)
        assert applied.error is not None and applied.error.message, kind
        assert state_of(indexer) == before, kind


def test_a_late_copy_of_an_engine_batch_is_skipped_until_a_reset() -> None:
    """A replica stalled past JetStream's duplicate window publishes batches the stream already
    has: at or below the rank's watermark they change nothing; after a reset they are new."""
    indexer = Indexer()
    replication.apply(indexer, *replication.encode(Register(MODEL, "default", BLOCK, 7, 0)))
    assert replication.apply(indexer, *replication.encode(vllm_batch(7, 0, [1, 2]))).report.applied == 1
    replication.apply(indexer, *replication.encode(vllm_batch(7, 1, [3])))
    before = state_of(indexer)
    late = replication.apply(indexer, *replication.encode(vllm_batch(7, 0, [9])))
    assert (late.error, late.report.applied, late.report.skipped) == (None, 0, 1)
    assert state_of(indexer) == before
    replication.apply(indexer, *replication.encode(Reset(MODEL, "default", [(7, 0)], 0)))
    assert replication.apply(indexer, *replication.encode(vllm_batch(7, 0, [9]))).report.applied == 1
    assert [r.blocks for r in indexer.workers()[0].ranks] == [1]


def test_message_ids_name_one_engine_batch_whoever_publishes_it() -> None:
    batch = vllm_batch(7, 3, [1, 2])
    assert replication.batch_message_id(batch) == replication.batch_message_id(vllm_batch(7, 3, [1, 2]))
    assert replication.batch_message_id(batch) != replication.batch_message_id(vllm_batch(7, 4, [1, 2]))
    assert replication.batch_message_id(batch) != replication.batch_message_id(vllm_batch(8, 3, [1, 2]))
    assert replication.batch_message_id(batch) != replication.batch_message_id(vllm_batch(7, 3, [1, 3]))
    reset = Reset(MODEL, "default", [(7, 0)], 0)
    assert replication.reset_message_id(reset, b"a") == replication.reset_message_id(reset, b"a")
    assert replication.reset_message_id(reset, b"a") != replication.reset_message_id(reset, b"b")


# --- snapshots --------------------------------------------------------------------------------

operations = st.one_of(
    st.tuples(st.just("register"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("events"), st.integers(1, 4), st.integers(0, 6), st.lists(st.integers(1, 30), min_size=1,
                                                                             max_size=5, unique=True)),
    st.tuples(st.just("routed"), st.integers(1, 5), st.lists(st.integers(1, 30), max_size=6)),
    st.tuples(st.just("batch"), st.integers(1, 4), st.integers(0, 6), st.lists(st.integers(1, 30), min_size=1,
                                                                            max_size=4, unique=True)),
    st.tuples(st.just("reset"), st.integers(1, 4)),
    st.tuples(st.just("unregister"), st.integers(1, 4)),
)


def message(op: tuple) -> tuple[str, bytes]:
    kind, worker = op[0], op[1]
    if kind == "register":
        return replication.encode(Register(MODEL, "default", BLOCK, worker, 0,
                                           f"tcp://127.0.0.1:{5000 + worker}" if op[2] else None))
    if kind == "events":
        return replication.EVENTS, events_message(worker, op[2], op[3])
    if kind == "routed":
        return replication.encode(Routed(MODEL, "default", worker, 0, op[2]))
    if kind == "batch":
        return replication.encode(vllm_batch(worker, op[2], op[3]))
    if kind == "reset":
        return replication.encode(Reset(MODEL, "default", [(worker, 0)], 0))
    return replication.encode(Unregister(MODEL, "default", worker))


@settings(max_examples=150)
@given(st.lists(operations, max_size=30), st.data())
def test_a_snapshot_then_the_rest_of_the_stream_equals_the_whole_stream(ops: list[tuple], data: st.DataObject) -> None:
    stream = [message(op) for op in ops]
    cut = data.draw(st.integers(0, len(stream)), label="snapshot after")
    whole = Indexer(clock=lambda: 100.0, wall_clock=lambda: 1_000.0)
    for kind, body in stream[:cut]:
        replication.apply(whole, kind, body)
    snapshot = replication.collect(whole, cut)
    encoded = b"".join(replication.encode_snapshot(snapshot))
    restored = Indexer(clock=lambda: 100.0, wall_clock=lambda: 1_000.0)
    sequence, subscriptions = replication.load_snapshot(restored, encoded)
    assert sequence == cut
    assert sorted(s.key for s in subscriptions) == sorted(
        (r.instance_id, r.dp_rank) for r in whole.rank_states() if r.registered and r.endpoint)
    assert state_of(restored) == state_of(whole)
    for kind, body in stream[cut:]:
        left, right = replication.apply(whole, kind, body), replication.apply(restored, kind, body)
        assert (left.error is None) == (right.error is None)
        assert left.report == right.report
    assert state_of(restored) == state_of(whole)


def test_the_generated_streams_really_index_blocks() -> None:
    """The property above is not vacuous: its messages apply, watermarks skip re-deliveries."""
    indexer = Indexer()
    for op in [("register", 1, False), ("events", 1, 0, [1, 2]), ("events", 1, 0, [3]), ("batch", 2, 0, [4, 5]),
               ("routed", 3, [1])]:
        applied = replication.apply(indexer, *message(op))
        assert applied.error is None, (op, applied.error)
    assert query_answer(indexer.query(MODEL, "default", [1, 2]))["scores"] == {"1": {"0": 2 * BLOCK}, "3": {"0": BLOCK}}
    assert indexer.events_skipped_total == 1  # the second document repeated event id 0


def test_a_snapshot_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError):
        replication.load_snapshot(Indexer(), b'{"sequence": 1}')
    with pytest.raises(ValueError):
        replication.load_snapshot(Indexer(), b"not json")


# --- settings and readiness -------------------------------------------------------------------


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="at most half"):
        StreamSettings(url="nats://x", retention_secs=60, snapshot_interval_secs=31).check()
    with pytest.raises(ValueError, match="stream name"):
        StreamSettings(url="nats://x", stream="a.b").check()
    StreamSettings(url="nats://x", retention_secs=60, snapshot_interval_secs=30).check()


def test_ready_follows_the_lag() -> None:
    indexer = Indexer()
    replica = StreamReplica(indexer, Listeners(indexer), StreamSettings(url="nats://x", ready_max_lag=10))
    assert replica.not_ready() == "not ready: catching up with the stream"
    replica.lag = 11
    assert "11 stream messages behind" in (replica.not_ready() or "")
    replica.lag = 10
    assert replica.not_ready() is None
