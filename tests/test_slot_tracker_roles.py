"""Worker roles on the slot tracker (`/register`'s `role`): a prefill worker's ranks count only
their requests' prefill tokens, as Dynamo's prefill router runs with `track_active_blocks=false`;
decode and aggregated workers count everything. In the core, through a dump and restore, over
replication, and over HTTP with the client."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo_lite.base.errors import InvalidArgument
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.replication import Batch, Replica, decode_message, encode

BLOCK = 16
MODEL, TENANT = "m", "default"
PREFILL, DECODE = 1, 2


def fleet() -> SlotTracker:
    t = SlotTracker(request_ttl_secs=300, clock=lambda: 0.0)
    t.register(PREFILL, MODEL, TENANT, BLOCK, 0, 1, "prefill")
    t.register(DECODE, MODEL, TENANT, BLOCK, 0, 1, "decode")
    return t


def rows(tracker: SlotTracker, hashes: list[int], isl: int = 0) -> dict[int, tuple[int, int, int]]:
    return {r["worker_id"]: (r["potential_prefill_tokens"], r["potential_decode_blocks"], r["active_requests"])
            for r in tracker.potential_load_rows(MODEL, TENANT, hashes, isl)}


@pytest.mark.unit
def test_a_prefill_worker_counts_prefill_tokens_and_requests_but_no_blocks() -> None:
    t = fleet()
    t.add(MODEL, TENANT, "p", PREFILL, 0, [1, 2, 3], 48)
    t.add(MODEL, TENANT, "d", DECODE, 0, [1, 2, 3], 0)
    assert rows(t, []) == {PREFILL: (48, 0, 1), DECODE: (0, 3, 1)}
    t.set_output_blocks(MODEL, TENANT, "p", 2)  # a stray report: output never counts there
    t.set_output_blocks(MODEL, TENANT, "d", 2)
    assert rows(t, []) == {PREFILL: (48, 0, 1), DECODE: (0, 5, 1)}
    # What a new prompt would add: prefill tokens on both, its blocks on the decode worker only.
    assert rows(t, [1, 2, 3, 4], 64) == {PREFILL: (112, 0, 1), DECODE: (64, 5 + 1, 1)}
    t.prefill_complete(MODEL, TENANT, "p")
    assert rows(t, []) == {PREFILL: (0, 0, 1), DECODE: (0, 5, 1)}
    for request_id in ("p", "d"):
        t.free(MODEL, TENANT, request_id)
    assert rows(t, []) == {PREFILL: (0, 0, 0), DECODE: (0, 0, 0)}
    assert [(w.worker_id, w.role) for w in t.workers()] == [(PREFILL, "prefill"), (DECODE, "decode")]


@pytest.mark.unit
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 6), max_size=6), st.integers(0, 64)), max_size=12))
def test_a_decode_worker_beside_a_prefill_one_answers_as_if_alone(requests: list[tuple[bool, list[int], int]]) -> None:
    """The prefill worker's bookings change nothing of the decode worker's loads, and its own
    decode blocks stay 0, whatever the prompts share."""
    both, alone = fleet(), SlotTracker(request_ttl_secs=300, clock=lambda: 0.0)
    alone.register(DECODE, MODEL, TENANT, BLOCK, 0, 1, "decode")
    for index, (on_prefill, hashes, isl) in enumerate(requests):
        if on_prefill:
            both.add(MODEL, TENANT, f"r{index}", PREFILL, 0, hashes, isl)
        else:
            for t in (both, alone):
                t.add(MODEL, TENANT, f"r{index}", DECODE, 0, hashes, isl)
    query = [0, 1, 2, 3, 9]
    assert rows(both, query)[DECODE] == rows(alone, query)[DECODE]
    assert rows(both, query)[PREFILL][1] == 0


@pytest.mark.unit
def test_an_unknown_role_is_refused() -> None:
    t = SlotTracker()
    with pytest.raises(InvalidArgument, match="role must be one of aggregated, decode, prefill"):
        t.register(1, MODEL, TENANT, BLOCK, 0, 1, "encode")
    assert t.workers() == []


@pytest.mark.unit
def test_a_dump_and_a_replica_keep_the_role() -> None:
    t = fleet()
    t.add(MODEL, TENANT, "p", PREFILL, 0, [1, 2], 32)
    dump = t.dump(taken_at=0.0)
    assert [w.role for w in dump.partitions[0].workers] == ["prefill", "decode"]
    again = SlotTracker(request_ttl_secs=300, clock=lambda: 0.0)
    again.restore(dump)
    assert rows(again, [5]) == rows(t, [5])

    a = Replica(SlotTracker(request_ttl_secs=300, clock=lambda: 0.0), origin=1, wall_clock=lambda: 0.0)
    b = Replica(SlotTracker(request_ttl_secs=300, clock=lambda: 0.0), origin=2, wall_clock=lambda: 0.0)
    a.register(PREFILL, MODEL, TENANT, BLOCK, 0, 1, "prefill")
    a.add(MODEL, TENANT, "p", PREFILL, 0, [1, 2], 32)
    taken = a.take_outbox()
    assert taken is not None
    batch = decode_message(encode(taken))
    assert isinstance(batch, Batch)
    b.receive(batch)
    assert [w.role for w in b.tracker.workers()] == ["prefill"]
    assert rows(b.tracker, [1]) == rows(a.tracker, [1]) == {PREFILL: (32, 0, 1)}


@pytest.mark.process
def test_over_http_the_role_is_optional_checked_and_sent_by_the_client() -> None:
    import httpx
    from support.reference_server import running_service

    from dynamo_lite.client import SlotTrackerClient

    with running_service("slot_tracker") as url, SlotTrackerClient(url) as client:
        client.register(PREFILL, MODEL, BLOCK, role="prefill")
        client.register(DECODE, MODEL, BLOCK)
        listed = httpx.get(f"{url}/workers").json()
        # Dynamo's row for a worker registered without a role; the role only where it is not the default.
        assert listed == [
            {"worker_id": PREFILL, "model_name": MODEL, "tenant_id": "default", "block_size": BLOCK, "dp_start": 0,
             "dp_size": 1, "role": "prefill"},
            {"worker_id": DECODE, "model_name": MODEL, "tenant_id": "default", "block_size": BLOCK, "dp_start": 0,
             "dp_size": 1}]
        assert [w.role for w in client.workers()] == ["prefill", "aggregated"]
        client.add(MODEL, "p", PREFILL, 0, [5, 6], 32)
        loads = {row.worker_id: (row.potential_prefill_tokens, row.potential_decode_blocks)
                 for row in client.potential_loads(MODEL, [5, 6, 7])}
        assert loads == {PREFILL: (32, 0), DECODE: (0, 3)}
        refused = httpx.post(f"{url}/register", json={"worker_id": 3, "model_name": MODEL, "block_size": BLOCK,
                                                      "dp_start": 0, "dp_size": 1, "role": "encoder"})
        assert refused.status_code == 400 and "role must be one of" in refused.json()["error"], refused.text
        document = httpx.get(f"{url}/dump").json()
        assert [w.get("role") for w in document["partitions"][0]["workers"]] == ["prefill", None]
