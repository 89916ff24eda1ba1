"""The selection core (`dynamo_lite.select_service.core`) without HTTP: the catalog's dynamics
(what a re-registration keeps and drops), pending selections and their bounds, session
affinity, the reservation lifecycle and its expiry, on a fake clock. Dynamo's answers to the
same calls are pinned by tests/test_select_service_differential.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from dynamo_lite.base.errors import Conflict, InvalidArgument, NotFound
from dynamo_lite.routing.scheduling import dynamo_config
from dynamo_lite.select_service.core import NoCandidate, NotReady, SelectionCore, SelectionSettings
from dynamo_lite.select_service.pending import PendingSelection, SelectionCache
from dynamo_lite.select_service.protocols import (
    OutputBlockRequest,
    QueryRequest,
    ReservationRequest,
    SelectRequest,
    WorkerPatch,
    WorkerRequest,
)

pytestmark = pytest.mark.unit

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core(clock: Clock | None = None, **settings: Any) -> SelectionCore:
    settings.setdefault("scheduler", dynamo_config())
    settings.setdefault("seed", 0)
    return SelectionCore(SelectionSettings(**settings), clock=clock or Clock())


def worker(worker_id: int, model_name: str = "m", **fields: Any) -> WorkerRequest:
    body = {"endpoint": f"http://w{worker_id}", "block_size": BLOCK, "kv_events_endpoint": f"tcp://127.0.0.1:{worker_id}"}
    body.update(fields)
    return WorkerRequest(worker_id=worker_id, model_name=model_name, **body)


def tokens(count: int, start: int = 1) -> list[int]:
    return list(range(start, start + count))


def select(request_id: str | None = None, count: int = 16, start: int = 1, **fields: Any) -> SelectRequest:
    return msgspec.convert({"model_name": "m", "token_ids": tokens(count, start), "selection_id": request_id, **fields},
                           SelectRequest)


def active(core: SelectionCore) -> dict[tuple[int, int], int]:
    (partition,) = core.loads("m")
    return {(row["worker_id"], row["dp_rank"]): row["active_requests"] for row in partition["loads"]}


# --- the catalog ------------------------------------------------------------------------------


def test_a_complete_record_is_schedulable_and_subscribed_per_rank() -> None:
    selection = core()
    record, changes = selection.upsert_worker(worker(1, data_parallel_size=2, kv_events_endpoint=None,
                                                     kv_events_endpoints={"0": "tcp://h:1", "1": "tcp://h:2"}))
    assert record["lifecycle"] == "schedulable" and "not_schedulable_reasons" not in record
    assert [(s.worker_id, s.dp_rank, s.endpoint) for s in changes.start] == [(1, 0, "tcp://h:1"), (1, 1, "tcp://h:2")]
    assert changes.stop == []
    assert selection.ready()[0]


def test_an_incomplete_record_says_why_and_subscribes_to_nothing() -> None:
    selection = core()
    record, changes = selection.upsert_worker(WorkerRequest(worker_id=3))
    assert record["lifecycle"] == "incomplete"
    assert record["not_schedulable_reasons"] == ["endpoint is required", "block_size must be greater than 0",
                                                 "kv_events endpoint is required for dp_rank 0"]
    assert changes.start == [] and not selection.ready()[0]
    record, _ = selection.upsert_worker(worker(4, data_parallel_start_rank=2**32 - 1, data_parallel_size=2))
    assert record["not_schedulable_reasons"] == ["data-parallel ranks 4294967295..4294967296 exceed the u32 range"]


def test_re_registering_keeps_what_did_not_change() -> None:
    selection = core()
    selection.upsert_worker(worker(1, data_parallel_size=2, kv_events_endpoint=None,
                                   kv_events_endpoints={"0": "tcp://h:1", "1": "tcp://h:2"}))
    for rank in (0, 1):
        selection.reserve(ReservationRequest(model_name="m", selection_id=f"r{rank}", worker_id=1, dp_rank=rank,
                                             token_ids=tokens(8)))
    same = worker(1, data_parallel_size=2, kv_events_endpoint=None,
                  kv_events_endpoints={"0": "tcp://h:1", "1": "tcp://h:2"}, endpoint="http://moved")
    _, changes = selection.upsert_worker(same)
    assert changes.start == [] and changes.stop == []  # only the request endpoint changed
    assert active(selection) == {(1, 0): 1, (1, 1): 1}
    # A new publisher for rank 1: its subscription is replaced, its bookings stay.
    _, changes = selection.patch_worker(1, WorkerPatch(kv_events_endpoints={"0": "tcp://h:1", "1": "tcp://h:3"}))
    assert changes.stop == [(1, 1)] and [(s.dp_rank, s.endpoint) for s in changes.start] == [(1, "tcp://h:3")]
    assert active(selection) == {(1, 0): 1, (1, 1): 1}
    # One rank fewer: its bookings go with it, the other rank's stay.
    _, changes = selection.patch_worker(1, WorkerPatch(data_parallel_size=1))
    assert changes.stop == [(1, 1)] and changes.start == []
    assert active(selection) == {(1, 0): 1}
    with pytest.raises(NotFound, match="reservation r1 not found"):
        selection.prefill_complete("r1")
    selection.prefill_complete("r0")


def test_a_move_to_another_partition_drops_the_bookings() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    selection.select_and_reserve(select("r"))
    _, changes = selection.upsert_worker(worker(1, model_name="other"))
    assert changes.stop == [(1, 0)] and [s.model_name for s in changes.start] == ["other"]
    with pytest.raises(NotFound):
        selection.free("r")
    with pytest.raises(NotReady, match="no schedulable workers for model=m routing_group=default"):
        selection.select(select())


def test_a_partition_s_block_size_is_its_workers_and_goes_with_the_last() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    selection.upsert_worker(worker(2))
    record, _ = selection.patch_worker(2, WorkerPatch(block_size=8))
    assert record["not_schedulable_reasons"] == [
        "reconciliation failed: block_size mismatch for model=m routing_group=default: existing=4 requested=8"]
    selection.delete_worker(1)
    record, _ = selection.patch_worker(2, WorkerPatch(block_size=8))  # alone now: Dynamo keeps refusing
    assert record["lifecycle"] == "schedulable"
    assert selection.select(select())["block_size"] == 8


def test_deleting_a_worker_answers_its_record_unschedulable() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    record, changes = selection.delete_worker(1)
    assert record["lifecycle"] == "unschedulable" and changes.stop == [(1, 0)]
    with pytest.raises(NotFound, match="worker 1 not found"):
        selection.delete_worker(1)
    with pytest.raises(NotReady, match="no schedulable workers are available"):
        selection.select(select())


# --- selection and bookings ---------------------------------------------------------------------


def test_the_least_loaded_worker_is_chosen_and_booking_moves_the_next_choice() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    selection.upsert_worker(worker(2))
    first = selection.select_and_reserve(select("a"))
    second = selection.select_and_reserve(select("b", start=100))
    assert {first["worker_id"], second["worker_id"]} == {1, 2}
    assert first["sequence_hashes"] and first["isl_tokens"] == 16 and first["track_prefill_tokens"] is True
    with pytest.raises(Conflict, match="selection a is already reserved or being reserved"):
        selection.select_and_reserve(select("a"))


def test_a_booking_without_an_id_gets_a_uuid() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    answer = selection.select_and_reserve(select())
    assert len(answer["selection_id"]) == 36 and answer["selection_id"] in selection.reservations


def test_the_candidates_follow_pins_targets_allowed_ids_and_taints() -> None:
    selection = core()
    selection.upsert_worker(worker(1, taints=["a100"]))
    selection.upsert_worker(worker(2))
    assert selection.select(select(allowed_worker_ids=[2]))["worker_id"] == 2
    with pytest.raises(NoCandidate, match="no endpoints available to route work"):
        selection.select(select(allowed_worker_ids=[]))
    with pytest.raises(InvalidArgument, match="pinned worker 2 is not in allowed worker set"):
        selection.select(_with(select(), pinned_worker={"worker_id": 2, "dp_rank": 0}, allowed_worker_ids=[1]))
    assert selection.select(_with(select(), routing_constraints={"required_taints": ["a100"]}))["worker_id"] == 1
    assert selection.select(_with(select(), affinity_target={"worker_id": 2}))["worker_id"] == 2


def _with(request: SelectRequest, **fields: Any) -> SelectRequest:
    """`request` with `fields` changed, as a client would have sent them."""
    return msgspec.convert({**msgspec.to_builtins(request), **fields}, SelectRequest)


def test_the_hash_form_is_checked_in_dynamos_order() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    cases = [({}, "block_hashes is required without token_ids"),
             ({"block_hashes": [1]}, "sequence_hashes is required without token_ids"),
             ({"block_hashes": [1], "sequence_hashes": [1]}, "isl_tokens is required without token_ids"),
             ({"block_hashes": [1], "sequence_hashes": [1], "isl_tokens": 0}, "isl_tokens must be greater than 0"),
             ({"block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 8},
              "block_hashes length 2 must match sequence_hashes length 1")]
    for fields, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            selection.select(SelectRequest(model_name="m", **fields))


def test_output_blocks_decay_and_free_releases_everything() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    selection.reserve(ReservationRequest(model_name="m", selection_id="r", worker_id=1, token_ids=tokens(16)))
    for fraction in (None, None, 0.5):
        selection.output_block("r", OutputBlockRequest(decay_fraction=fraction))
    (partition,) = selection.loads("m")
    assert partition["loads"][0]["potential_decode_blocks"] == 4 + 2  # 3 output blocks x 0.5 = 1.5 -> 2
    selection.output_block("r", None)
    (partition,) = selection.loads("m")
    assert partition["loads"][0]["potential_decode_blocks"] == 4 + 3  # 1.5 + a new block at full weight
    with pytest.raises(InvalidArgument, match="decay_fraction must be between 0.0 and 1.0"):
        OutputBlockRequest(decay_fraction=1.5).check()
    selection.free("r")
    (partition,) = selection.loads("m")
    assert partition["loads"][0] == {"worker_id": 1, "dp_rank": 0, "potential_prefill_tokens": 0,
                                      "potential_decode_blocks": 0, "active_requests": 0}


def test_output_decays_toward_the_expected_length_unless_a_fraction_is_sent() -> None:
    """With `expected_output_tokens` and no `decay_fraction`, each output block weighs 1 at first
    and the weight falls linearly to 0 at the expected length, as the slot tracker's `/add`
    decays; a fraction sent wins."""
    selection = core()
    selection.upsert_worker(worker(1))
    selection.reserve(ReservationRequest(model_name="m", selection_id="r", worker_id=1, token_ids=tokens(16),
                                         expected_output_tokens=8 * BLOCK))
    seen = []
    for _ in range(9):
        selection.output_block("r", None)
        (partition,) = selection.loads("m")
        seen.append(partition["loads"][0]["potential_decode_blocks"] - 4)  # less the 4 prompt blocks
    # n blocks weigh n * (1 - n/8), rounded half away from zero; 0 from the expected length on.
    assert seen == [1, 2, 2, 2, 2, 2, 1, 0, 0]
    selection.output_block("r", OutputBlockRequest(decay_fraction=0.5))
    (partition,) = selection.loads("m")
    assert partition["loads"][0]["potential_decode_blocks"] == 4 + 5  # 10 blocks at the fraction sent
    selection.free("r")
    # Booked through /select_and_reserve, the same.
    answer = selection.select_and_reserve(select("s", expected_output_tokens=2 * BLOCK))
    for _ in range(2):
        selection.output_block(answer["selection_id"], None)
    (partition,) = selection.loads("m")
    assert partition["loads"][0]["potential_decode_blocks"] == 4  # 2 blocks at the expected length weigh 0


def test_a_prefill_worker_is_booked_for_its_prefill_only() -> None:
    """`router_hint_worker_type: prefill` books no active or output blocks on the worker (Dynamo's
    prefill router runs with track_active_blocks=false); a change of type re-registers it."""
    selection = core()
    selection.upsert_worker(worker(1, router_hint_worker_type="prefill"))
    selection.upsert_worker(worker(2, router_hint_worker_type="decode"))
    for worker_id, selection_id in ((1, "p"), (2, "d")):
        selection.reserve(ReservationRequest(model_name="m", selection_id=selection_id, worker_id=worker_id,
                                             token_ids=tokens(16), effective_prefill_tokens=16))
        selection.output_block(selection_id, None)
    (partition,) = selection.loads("m")
    assert {row["worker_id"]: (row["potential_prefill_tokens"], row["potential_decode_blocks"])
            for row in partition["loads"]} == {1: (16, 0), 2: (16, 4 + 1)}
    selection.upsert_worker(worker(1, router_hint_worker_type="decode"))  # the booking is kept, counted fully now
    (partition,) = selection.loads("m")
    assert {row["worker_id"]: row["potential_decode_blocks"] for row in partition["loads"]} == {1: 4 + 1, 2: 4 + 1}


def test_an_explicit_booking_books_prefill_only_when_told() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    selection.reserve(ReservationRequest(model_name="m", selection_id="a", worker_id=1, token_ids=tokens(16)))
    selection.reserve(ReservationRequest(model_name="m", selection_id="b", worker_id=1, token_ids=tokens(16, 50),
                                         effective_prefill_tokens=10))
    selection.reserve(ReservationRequest(model_name="m", selection_id="c", worker_id=1, token_ids=tokens(16, 90),
                                         effective_prefill_tokens=10, track_prefill_tokens=False))
    (partition,) = selection.loads("m")
    assert partition["loads"][0]["potential_prefill_tokens"] == 10
    with pytest.raises(InvalidArgument, match=r"effective_prefill_tokens \(17\) must not exceed isl_tokens \(16\)"):
        selection.reserve(ReservationRequest(model_name="m", selection_id="d", worker_id=1, token_ids=tokens(16),
                                             effective_prefill_tokens=17))
    with pytest.raises(NotFound, match="worker 1 has no dp_rank 3"):
        selection.reserve(ReservationRequest(model_name="m", selection_id="d", worker_id=1, dp_rank=3,
                                             token_ids=tokens(16)))


def test_bookings_never_freed_expire_with_their_sessions() -> None:
    clock = Clock()
    selection = core(clock, request_ttl_secs=10, session_affinity_ttl_secs=5)
    selection.upsert_worker(worker(1))
    selection.upsert_worker(worker(2))
    pinned = selection.select_and_reserve(select("a", session_id="s"))["worker_id"]
    clock.now += 11
    assert selection.expire() == 1 and not selection.reservations
    clock.now += 6  # the binding's idle TTL, counted from the expiry's release
    assert selection.sessions is not None and selection.sessions.bound(("m", "default"), "s") is None
    assert pinned in (1, 2)


# --- pending selections ---------------------------------------------------------------------------


def test_a_select_with_an_id_is_booked_once_by_a_reservation() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    chosen = selection.select(select("p"))
    assert chosen["selection_id"] == "p"
    booked = selection.reserve(ReservationRequest(model_name="m", selection_id="p", token_ids=[9, 9, 9]))
    assert booked == {"selection_id": "p", "model_name": "m", "routing_group": "default", "worker_id": 1,
                      "dp_rank": 0, "endpoint": "http://w1"}
    with pytest.raises(NotFound, match=r"no pending selection p for model=m routing_group=default \(expired"):
        selection.reserve(ReservationRequest(model_name="m", selection_id="p"))


def test_pending_selections_are_bounded_by_age_count_and_bytes_as_dynamo_counts_them() -> None:
    clock = Clock()

    def entry(hashes: int) -> PendingSelection:
        return PendingSelection(1, 0, tuple(range(hashes)), 8, 8, True, None, None, None, None)

    key = ("t", "default", "aa")
    assert SelectionCache.size_of(key, entry(2)) == 26  # Dynamo's count: 8 per hash + the names' bytes
    for budget, kept in ((52, 2), (51, 1), (25, 0)):
        cache = SelectionCache(max_bytes=budget, clock=clock)
        cache.put(("t", "default", "aa"), entry(2))
        cache.put(("t", "default", "bb"), entry(2))
        assert len(cache) == kept, budget
    cache = SelectionCache(max_entries=3, clock=clock)
    for name in "abcad":
        cache.put(("m", "g", name), entry(1))
    assert [cache.peek(("m", "g", name)) is not None for name in "abcd"] == [True, False, True, True]
    cache = SelectionCache(ttl_secs=2, clock=clock)
    cache.put(key, entry(1))
    clock.now += 2
    assert cache.peek(key) is not None  # strictly older is gone
    clock.now += 0.1
    assert cache.peek(key) is None
    cache.put(("t", "default", "later"), entry(1))
    assert len(cache) == 1 and cache.expired_total == 1


# --- session affinity -----------------------------------------------------------------------------


def test_a_bound_session_goes_to_its_rank_however_loaded_until_idle_past_its_ttl() -> None:
    clock = Clock()
    selection = core(clock, session_affinity_ttl_secs=5)
    selection.upsert_worker(worker(1))
    selection.upsert_worker(worker(2))
    bound = selection.select_and_reserve(select("s1", session_id="chat"))["worker_id"]
    for index in range(3):  # pile load on the bound worker
        selection.reserve(ReservationRequest(model_name="m", selection_id=f"load{index}", worker_id=bound,
                                             token_ids=tokens(64, 1000 * (index + 1)), effective_prefill_tokens=64))
    assert selection.select(select(start=500, session_id="chat"))["worker_id"] == bound  # /select reads the binding
    assert selection.select(select(start=500))["worker_id"] != bound  # others go elsewhere
    selection.free("s1")
    clock.now += 4
    assert selection.select_and_reserve(select("s2", start=600, session_id="chat"))["worker_id"] == bound
    selection.free("s2")
    clock.now += 6  # idle past the TTL: chosen by cost again
    assert selection.select(select(start=700, session_id="chat"))["worker_id"] != bound


def test_a_session_bound_to_a_removed_worker_is_bound_anew() -> None:
    selection = core(session_affinity_ttl_secs=60)
    selection.upsert_worker(worker(1))
    selection.upsert_worker(worker(2))
    bound = selection.select_and_reserve(select("a", session_id="s"))["worker_id"]
    selection.delete_worker(bound)
    other = selection.select_and_reserve(select("b", start=50, session_id="s"))["worker_id"]
    assert other != bound
    assert selection.sessions is not None and selection.sessions.bound(("m", "default"), "s") == (other, 0)


def test_a_replay_whose_session_moved_meanwhile_is_refused_and_forgotten() -> None:
    selection = core(session_affinity_ttl_secs=60)
    selection.upsert_worker(worker(1))
    selection.upsert_worker(worker(2))
    pending = selection.select(select("p", session_id="s"))["worker_id"]
    other = 2 if pending == 1 else 1
    selection.select_and_reserve(select("q", start=40, session_id="s", allowed_worker_ids=[other]))
    with pytest.raises(InvalidArgument, match=f"session s is bound to worker {other}, not {pending}"):
        selection.reserve(ReservationRequest(model_name="m", selection_id="p"))
    with pytest.raises(NotFound, match="no pending selection p"):
        selection.reserve(ReservationRequest(model_name="m", selection_id="p"))


def test_session_ids_are_bounded_only_with_affinity_on() -> None:
    long_id = "x" * 300
    selection = core()
    selection.upsert_worker(worker(1))
    assert selection.select(_with(select(), session_id=long_id))["worker_id"] == 1
    selection = core(session_affinity_ttl_secs=60)
    selection.upsert_worker(worker(1))
    with pytest.raises(InvalidArgument, match="session affinity ID must not exceed 256 bytes"):
        selection.select(_with(select(), session_id=long_id))


# --- reads -------------------------------------------------------------------------------------------


def test_potential_loads_add_the_prompt_left_to_prefill_on_each_rank() -> None:
    selection = core()
    selection.upsert_worker(worker(1))
    selection.reserve(ReservationRequest(model_name="m", selection_id="r", worker_id=1, token_ids=tokens(8),
                                         effective_prefill_tokens=8))
    rows = selection.potential_loads(QueryRequest(model_name="m", token_ids=tokens(16)))
    # 8 booked + 16 to prefill; the booked prompt's 2 blocks are shared with this one's first 2
    assert rows == [{"worker_id": 1, "dp_rank": 0, "potential_prefill_tokens": 24, "potential_decode_blocks": 4,
                     "active_requests": 1}]
