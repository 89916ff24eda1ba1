"""Output blocks that decay toward the expected output length (`expected_output_tokens` on
`/add`, the router guide's decay toward `nvext.agent_hints.osl`): in the core, through a dump
and restore, over replication, and over HTTP with the client."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_lite.slot_tracker.core import SlotTracker, decayed_output
from dynamo_lite.slot_tracker.replication import Batch, Replica, decode_message, encode

BLOCK = 16
MODEL, TENANT = "m", "default"


def replica(origin: int) -> Replica:
    t = SlotTracker(request_ttl_secs=300, clock=lambda: 0.0)
    t.register(1, MODEL, TENANT, BLOCK, 0, 1)
    return Replica(t, origin=origin, wall_clock=lambda: 0.0)


def publish(source: Replica) -> Batch:
    """The replica's outbox through the wire format, as the shell sends it."""
    taken = source.take_outbox()
    assert taken is not None
    batch = decode_message(encode(taken))
    assert isinstance(batch, Batch)
    return batch


def decode_blocks(tracker: SlotTracker, worker_id: int = 1) -> int:
    (row,) = [r for r in tracker.potential_load_rows(MODEL, TENANT, [], 0) if r["worker_id"] == worker_id]
    return row["potential_decode_blocks"]


def tracker() -> SlotTracker:
    t = SlotTracker(request_ttl_secs=300, clock=lambda: 0.0)
    t.register(1, MODEL, TENANT, BLOCK, 0, 1)
    return t


@pytest.mark.unit
def test_each_block_weighs_one_at_first_and_nothing_at_the_expected_length() -> None:
    # 256 expected tokens = 16 blocks of 16: the weight falls by 1/16 per block.
    weights = [decayed_output(blocks, BLOCK, 256) for blocks in range(0, 18)]
    assert weights == [0, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4, 3, 3, 2, 2, 1, 0, 0]
    assert decayed_output(4, BLOCK, 0) == 0


@pytest.mark.unit
@given(st.integers(0, 500), st.integers(1, 64), st.integers(1, 10_000))
def test_the_decayed_load_never_exceeds_the_count_nor_goes_negative(blocks: int, block_size: int,
                                                                     expected: int) -> None:
    assert 0 <= decayed_output(blocks, block_size, expected) <= blocks


@pytest.mark.unit
def test_a_request_with_an_expected_length_weighs_its_decayed_output_and_frees_all_of_it() -> None:
    t = tracker()
    t.add(MODEL, TENANT, "plain", 1, 0, [1, 2], 0)
    t.add(MODEL, TENANT, "decays", 1, 0, [3, 4], 0, expected_output_tokens=128)
    assert decode_blocks(t) == 4
    seen = []
    for blocks in range(1, 9):
        t.set_output_blocks(MODEL, TENANT, "plain", blocks)
        t.set_output_blocks(MODEL, TENANT, "decays", blocks)
        seen.append(decode_blocks(t) - 4 - blocks)  # the decaying request's share
    assert seen == [decayed_output(b, BLOCK, 128) for b in range(1, 9)] == [1, 2, 2, 2, 2, 2, 1, 0]
    with pytest.raises(Exception, match="cannot shrink"):
        t.set_output_blocks(MODEL, TENANT, "decays", 7)  # the count itself still only grows
    t.free(MODEL, TENANT, "plain")
    t.free(MODEL, TENANT, "decays")
    assert decode_blocks(t) == 0


@pytest.mark.unit
def test_a_dump_keeps_the_expected_length() -> None:
    t = tracker()
    t.add(MODEL, TENANT, "r", 1, 0, [1], 0, expected_output_tokens=64)
    t.set_output_blocks(MODEL, TENANT, "r", 2)
    dump = t.dump(taken_at=0.0)
    assert dump.partitions[0].requests[0].expected_output_tokens == 64
    again = tracker()
    again.restore(dump)
    assert decode_blocks(again) == decode_blocks(t) == 1 + 1  # 2 blocks at half weight
    again.set_output_blocks(MODEL, TENANT, "r", 3)
    assert decode_blocks(again) == 1 + 1  # 3 * (1 - 48/64) = 0.75 -> 1


@pytest.mark.unit
def test_replicas_decay_the_same_way() -> None:
    a, b = replica(1), replica(2)
    a.add(MODEL, TENANT, "r", 1, 0, [1, 2, 3], 0, 96)
    a.set_output_blocks(MODEL, TENANT, "r", 3)
    b.receive(publish(a))
    rows = [r.potential_decode_blocks for r in (*a.tracker.potential_loads(MODEL, TENANT, [], 0),)]
    assert rows == [r.potential_decode_blocks for r in b.tracker.potential_loads(MODEL, TENANT, [], 0)]
    assert a.tracker.request(MODEL, TENANT, "r").output_load == b.tracker.request(MODEL, TENANT, "r").output_load \
        == decayed_output(3, 16, 96) == 2


@pytest.mark.process
def test_over_http_the_field_is_optional_checked_and_sent_by_the_client() -> None:
    import httpx
    from support.reference_server import running_service

    from dynamo_lite.client import SlotTrackerClient

    with running_service("slot_tracker") as url, SlotTrackerClient(url) as client:
        client.register(1, MODEL, BLOCK)
        client.add(MODEL, "r", 1, 0, [5, 6], 0, expected_output_tokens=64)
        client.add(MODEL, "plain", 1, 0, [7], 0)
        client.output_blocks(MODEL, "r", 2)
        client.output_blocks(MODEL, "plain", 2)
        (row,) = client.potential_loads(MODEL, [])
        assert row.potential_decode_blocks == 3 + 1 + 2  # three prompt blocks, r's two at half weight, plain's two
        refused = httpx.post(f"{url}/add", json={"model_name": MODEL, "request_id": "x", "worker_id": 1, "dp_rank": 0,
                                                 "sequence_hashes": [], "expected_output_tokens": -1})
        assert refused.status_code in (400, 422) and "expected_output_tokens" in refused.json()["error"]
        document = httpx.get(f"{url}/dump").json()
        assert [r.get("expected_output_tokens") for r in document["partitions"][0]["requests"]] == [64, None]
