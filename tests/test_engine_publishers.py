"""Tests of the engine publishers used to drive the indexer (`dynamo_lite.kv_publishers`).

The byte-for-byte match with the engines' own structs was checked once against vLLM 0.33.0's and
SGLang 0.5.23's sources; these tests pin the decoded shapes, the frames and the replay protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.unit

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from dynamo_lite.kv_publishers import (  # noqa: E402
    END_SEQ,
    Cleared,
    DpEngine,
    EnginePublisher,
    Removed,
    Stored,
    WireFormat,
    encode_batch,
    int_block_hash,
)

TS = 1757500000.25
TIMEOUT_MS = 3000


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def subscribe(ctx: zmq.Context, publisher: EnginePublisher) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    publisher.wait_for_subscribers(1, timeout=5.0)
    return sub


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), "nothing received"
    return sock.recv_multipart()


def request_replay(ctx: zmq.Context, publisher: EnginePublisher, start_seq: int) -> list[list[bytes]]:
    """Send a replay request as a DEALER (as Dynamo does) and collect the answer, end marker
    included. The ROUTER's identity frame is stripped on the way back, the empty one is not."""
    assert publisher.replay_endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        while True:
            frames = recv(dealer)
            replies.append(frames)
            if frames[-2] == END_SEQ:
                return replies
    finally:
        dealer.close()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


STORE = Stored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2)


# --- payloads --------------------------------------------------------------------------------


def test_vllm_payload_is_a_positional_batch_of_map_events() -> None:
    payload = encode_batch(
        WireFormat.VLLM,
        [STORE, Stored([b"\xab" * 32], 12, [5, 6], 2, medium="CPU", session_id="s1"), Removed([11]), Cleared()],
        dp_rank=0,
        ts=TS,
    )
    required = {"parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None}
    assert msgspec.msgpack.decode(payload) == [
        TS,
        [
            {"type": "BlockStored", "block_hashes": [11, 12], **required, "medium": None, "lora_name": None},
            {
                "type": "BlockStored",
                "block_hashes": [b"\xab" * 32],
                "parent_block_hash": 12,
                "token_ids": [5, 6],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "session_id": "s1",
            },
            {"type": "BlockRemoved", "block_hashes": [11], "medium": None},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]


def test_vllm_writes_every_optional_field_it_declares_and_nothing_else() -> None:
    event = Stored(
        [1],
        None,
        [9],
        1,
        lora_name="lora-a",
        cache_salt="ignored by vLLM",
        extra_keys=[("lora-a", "salt")],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        ownership="tier2",
        session_id="s",
        lookahead_token_ids=[[10, 11]],
    )
    (decoded,) = msgspec.msgpack.decode(encode_batch(WireFormat.VLLM, [event], dp_rank=1, ts=TS))[1]
    assert list(decoded) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ]
    assert decoded["extra_keys"] == [["lora-a", "salt"]]


def test_sglang_batch_keeps_three_elements_and_omits_a_none_medium() -> None:
    signed = -(2**63) + 5
    payload = encode_batch(
        WireFormat.SGLANG,
        [
            Stored([signed], None, [1, 2], 2, cache_salt="salt", lora_name="a", session_id="s", group_idx=3),
            Stored([-7], signed, [3, 4], 2, medium="CPU_PINNED"),
            Removed([signed]),
            Cleared(),
        ],
        dp_rank=None,
        ts=TS,
    )
    assert msgspec.msgpack.decode(payload) == [
        TS,
        [
            {
                "type": "BlockStored",
                "block_hashes": [signed],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "cache_salt": "salt",
                "session_id": "s",
                "lora_name": "a",
            },
            {
                "type": "BlockStored",
                "block_hashes": [-7],
                "parent_block_hash": signed,
                "token_ids": [3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU_PINNED",
            },
            {"type": "BlockRemoved", "block_hashes": [signed]},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]


def test_map_batch_payload_is_a_map_and_omits_a_none_rank() -> None:
    events = [STORE, Removed([11], medium="GPU", group_idx=0, locality="LOCAL")]
    assert msgspec.msgpack.decode(encode_batch(WireFormat.VLLM_MAP_BATCH, events, dp_rank=None, ts=TS)) == {
        "ts": TS,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [11, 12],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": None,
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0},
        ],
    }
    assert msgspec.msgpack.decode(encode_batch(WireFormat.VLLM_MAP_BATCH, [], dp_rank=2, ts=TS)) == {
        "ts": TS,
        "events": [],
        "data_parallel_rank": 2,
    }


def test_legacy_payload_is_positional_and_as_long_as_the_version_carrying_its_fields() -> None:
    u64 = 2**64 - 1
    events = [
        Stored([u64], None, [1], 1, medium="GPU", lora_name="a", cache_salt="dropped"),
        Stored([2], u64, [2], 1, group_idx=1),
        Stored([3], 2, [3], 1, kv_cache_spec_kind="full_attention"),
        Removed([u64], medium="GPU"),
        Removed([2], group_idx=1),
        Cleared(),
    ]
    assert msgspec.msgpack.decode(encode_batch(WireFormat.VLLM_LEGACY, events, dp_rank=None, ts=TS)) == [
        TS,
        [
            ["BlockStored", [u64], None, [1], 1, None, "GPU", "a"],
            ["BlockStored", [2], u64, [2], 1, None, None, None, None, 1],
            ["BlockStored", [3], 2, [3], 1, None, None, None, None, None, "full_attention", None],
            ["BlockRemoved", [u64], "GPU"],
            ["BlockRemoved", [2], None, 1],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_int_block_hash_takes_the_low_64_bits_of_a_digest() -> None:
    digest = bytes(range(32))
    assert int_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert int_block_hash(42) == 42


# --- frames and replay -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_live_messages_are_topic_seq_payload(ctx: zmq.Context, fmt: WireFormat) -> None:
    with EnginePublisher(fmt, dp_rank=3, topic=b"kv", replay=False, context=ctx) as publisher:
        sub = subscribe(ctx, publisher)
        try:
            assert publisher.publish([STORE], ts=TS) == 0
            assert publisher.publish([Cleared()], ts=TS) == 1
            assert publisher.seq == 2
            assert recv(sub) == [b"kv", seq_bytes(0), encode_batch(fmt, [STORE], dp_rank=3, ts=TS)]
            assert recv(sub) == [b"kv", seq_bytes(1), encode_batch(fmt, [Cleared()], dp_rank=3, ts=TS)]
        finally:
            sub.close()


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_replay_answers_in_the_formats_layout_then_the_end_marker(ctx: zmq.Context, fmt: WireFormat) -> None:
    with EnginePublisher(fmt, topic=b"kv", context=ctx) as publisher:
        payloads = [encode_batch(fmt, [Removed([n])], dp_rank=0, ts=TS) for n in range(3)]
        for n in range(3):
            publisher.publish([Removed([n])], ts=TS)
        replies = request_replay(ctx, publisher, start_seq=1)
        if fmt in (WireFormat.VLLM, WireFormat.SGLANG):
            assert replies == [
                [b"", b"kv", seq_bytes(1), payloads[1]],
                [b"", b"kv", seq_bytes(2), payloads[2]],
                [b"", b"", END_SEQ, b""],
            ]
        else:
            assert replies == [
                [b"", seq_bytes(1), payloads[1]],
                [b"", seq_bytes(2), payloads[2]],
                [b"", END_SEQ, b""],
            ]
        assert publisher.replay_requests == 1


def test_replay_buffer_keeps_the_last_buffer_steps_batches(ctx: zmq.Context) -> None:
    with EnginePublisher(WireFormat.VLLM, buffer_steps=2, context=ctx) as publisher:
        for _ in range(4):
            publisher.publish([Cleared()], ts=TS)
        assert [reply[2] for reply in request_replay(ctx, publisher, 0)] == [seq_bytes(2), seq_bytes(3), END_SEQ]


def test_malformed_replay_request_is_ignored(ctx: zmq.Context) -> None:
    with EnginePublisher(WireFormat.SGLANG, context=ctx) as publisher:
        publisher.publish([Cleared()], ts=TS)
        assert publisher.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        try:
            dealer.send_multipart([b"", seq_bytes(0), b"extra"])  # four frames at the ROUTER
            assert not dealer.poll(200)
        finally:
            dealer.close()
        assert publisher.replay_requests == 0
        assert [reply[2] for reply in request_replay(ctx, publisher, 0)] == [seq_bytes(0), END_SEQ]
        assert publisher.replay_requests == 1


def test_drop_next_skips_the_wire_but_not_the_replay_buffer(ctx: zmq.Context) -> None:
    with EnginePublisher(WireFormat.VLLM, context=ctx) as publisher:
        sub = subscribe(ctx, publisher)
        try:
            publisher.publish([Removed([0])], ts=TS)
            publisher.drop_next()
            publisher.publish([Removed([1])], ts=TS)
            publisher.publish([Removed([2])], ts=TS)
            assert [recv(sub)[1] for _ in range(2)] == [seq_bytes(0), seq_bytes(2)]
            replayed = request_replay(ctx, publisher, 1)
            lost = encode_batch(WireFormat.VLLM, [Removed([1])], dp_rank=0, ts=TS)
            assert replayed[0] == [b"", b"", seq_bytes(1), lost]
        finally:
            sub.close()


def test_restart_resets_seq_and_empties_the_replay_buffer(ctx: zmq.Context) -> None:
    with EnginePublisher(WireFormat.SGLANG, context=ctx) as publisher:
        sub = subscribe(ctx, publisher)
        try:
            publisher.publish([Cleared()], ts=TS)
            publisher.publish([Cleared()], ts=TS)
            publisher.restart()
            assert publisher.seq == 0
            assert publisher.publish([Removed([5])], ts=TS) == 0
            assert [recv(sub)[1] for _ in range(3)] == [seq_bytes(0), seq_bytes(1), seq_bytes(0)]
            assert [reply[2] for reply in request_replay(ctx, publisher, 0)] == [seq_bytes(0), END_SEQ]
        finally:
            sub.close()


def test_publish_raw_sends_any_frames_and_buffers_only_batches(ctx: zmq.Context) -> None:
    with EnginePublisher(WireFormat.VLLM_LEGACY, context=ctx) as publisher:
        sub = subscribe(ctx, publisher)
        try:
            assert publisher.publish_raw(b"\xc1 not msgpack") == 0
            assert publisher.publish_raw(b"", frames=[b"only", b"two"]) == -1  # no batch: no seq
            assert publisher.seq == 1
            assert recv(sub) == [b"", seq_bytes(0), b"\xc1 not msgpack"]
            assert recv(sub) == [b"only", b"two"]
            assert request_replay(ctx, publisher, 0) == [[b"", seq_bytes(0), b"\xc1 not msgpack"], [b"", END_SEQ, b""]]
        finally:
            sub.close()


def test_dp_engine_publishes_each_rank_on_its_own_port(ctx: zmq.Context) -> None:
    with DpEngine(WireFormat.VLLM, 2) as engine:
        assert len(engine) == 2 and len(set(engine.endpoints)) == 2
        subs = [subscribe(ctx, rank) for rank in engine]
        try:
            for rank in engine:
                rank.publish([Cleared()], ts=TS)
            for dp_rank, sub in enumerate(subs):
                topic, seq, payload = recv(sub)
                assert seq == seq_bytes(0)
                assert msgspec.msgpack.decode(payload)[2] == dp_rank
        finally:
            for sub in subs:
                sub.close()


def test_close_stops_the_replay_thread_and_is_idempotent() -> None:
    before = set(threading.enumerate())
    publisher = EnginePublisher(WireFormat.VLLM)
    assert len(set(threading.enumerate()) - before) == 1
    publisher.close()
    publisher.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(RuntimeError):
        publisher.publish([Cleared()])
