"""Ours and Dynamo 1.6.1's selection service (`python -m dynamo.select_service`), fed the same
workers and the same vLLM KV events from the same engines, answer alike: the catalog with its
reasons, selections at temperature 0 (ours with `--cost dynamo`, Dynamo's cost), the overlap and
load reads, the reservation lifecycle, the pending-selection cache, and the errors. Where ours
is deliberately different, the test pins both answers (docs/differences.md, "The selection
service").

Ties are avoided (both break them at random): every prompt here has one cheapest worker.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from support.reference_server import free_port, require_reference_or_skip, running_server

from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list
from dynamo_lite.kv_publishers import EnginePublisher, Stored, WireFormat

pytestmark = [pytest.mark.process, pytest.mark.reference]

BLOCK = 4
TOKENS = list(range(1, 17))  # 4 blocks
CHAIN = sequence_hashes(local_block_hashes(TOKENS, BLOCK))
DEADLINE_S = 10.0
Pair = dict[str, httpx.Client]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    python = require_reference_or_skip()
    ref_port, our_port = free_port(), free_port()
    reference = [str(python), "-m", "dynamo.select_service", "--port", str(ref_port), "--threads", "1"]
    ours = [sys.executable, "-m", "dynamo_lite.select_service", "--host", "127.0.0.1", "--port", str(our_port),
            "--log-level", "warning", "--cost", "dynamo", "--seed", "0"]
    with running_server(reference, ref_port) as ref_url, running_server(ours, our_port) as our_url, \
            httpx.Client(base_url=ref_url, timeout=10) as ref_client, \
            httpx.Client(base_url=our_url, timeout=10) as our_client:
        yield {"reference": ref_client, "ours": our_client}


_worker_ids = itertools.count(100)
_models = itertools.count()


def model() -> str:
    return f"m{next(_models)}"


def both(pair: Pair, method: str, path: str, body: Any = None) -> dict[str, tuple[int, Any]]:
    answers = {}
    for name, client in pair.items():
        answer = client.request(method, path, json=body) if body is not None else client.request(method, path)
        try:
            payload = answer.json()
        except ValueError:
            payload = answer.text
        answers[name] = (answer.status_code, payload)
    return answers


def alike(pair: Pair, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    answers = both(pair, method, path, body)
    assert answers["ours"] == answers["reference"], (method, path, body)
    return answers["ours"]


def worker_body(worker_id: int, model_name: str, engine: EnginePublisher | None = None, **fields: Any) -> dict[str, Any]:
    body = {"worker_id": worker_id, "model_name": model_name, "endpoint": f"http://w{worker_id}:8000",
            "block_size": BLOCK, "kv_events_endpoint": engine.endpoint if engine else "tcp://127.0.0.1:1"}
    body.update(fields)
    return body


class Fleet:
    """Three engines (worker ids `ids`) registered on both services in one fresh partition:
    the first caches all 4 blocks of TOKENS, the second the first 2, the third nothing."""

    def __init__(self, pair: Pair, context: zmq.Context) -> None:
        self.pair = pair
        self.model = model()
        self.engines = [EnginePublisher(WireFormat.VLLM, context=context) for _ in range(3)]
        self.ids = [next(_worker_ids) for _ in self.engines]
        for worker_id, engine in zip(self.ids, self.engines):
            assert alike(pair, "POST", "/workers", worker_body(worker_id, self.model, engine))[0] == 201
            engine.wait_for_subscribers(2)
        self.engines[0].publish([Stored(CHAIN[:4], None, TOKENS, BLOCK)])
        self.engines[1].publish([Stored(CHAIN[:2], None, TOKENS[:8], BLOCK)])
        self.wait_for({self.ids[0]: 4, self.ids[1]: 2})

    def wait_for(self, device_blocks: dict[int, int]) -> None:
        """Until both services' /overlap_scores for TOKENS show these device blocks."""
        deadline = time.monotonic() + DEADLINE_S
        body = {"model_name": self.model, "token_ids": TOKENS}
        while True:
            seen = {}
            for name, client in self.pair.items():
                rows = client.post("/overlap_scores", json=body).json()["workers"]
                seen[name] = {row["worker_id"]: row["device_blocks"] for row in rows if row["device_blocks"]}
            if all(value == device_blocks for value in seen.values()):
                return
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)

    def close(self) -> None:
        for worker_id in self.ids:
            both(self.pair, "DELETE", f"/workers/{worker_id}")
        for engine in self.engines:
            engine.close()


@pytest.fixture
def fleet(pair: Pair, context: zmq.Context) -> Iterator[Fleet]:
    fleet = Fleet(pair, context)
    yield fleet
    fleet.close()


def sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda row: (row["worker_id"], row["dp_rank"]))


def dynamo_costs(pair: Pair, body: dict[str, Any]) -> dict[int, float]:
    """Each rank's Dynamo cost for the prompt of `body`, from the reference's own reads: the
    prefill it would queue there (potential_prefill_tokens: booked + left to prefill) in blocks,
    plus its decode blocks with the prompt added."""
    rows = pair["reference"].post("/potential_loads", json={"model_name": body["model_name"],
                                                             "token_ids": body["token_ids"]}).json()
    return {row["worker_id"]: row["potential_prefill_tokens"] / BLOCK + row["potential_decode_blocks"] for row in rows}


def one_cheapest(pair: Pair, body: dict[str, Any]) -> int:
    costs = dynamo_costs(pair, body)
    best = min(costs.values())
    cheapest = [worker for worker, cost in costs.items() if cost == best]
    assert len(cheapest) == 1, f"a tie (both services break it at random): {costs}"
    return cheapest[0]


def loads(pair: Pair, model_name: str) -> dict[str, Any]:
    answers = {}
    for name, client in pair.items():
        (partition,) = client.get("/loads", params={"model_name": model_name}).json()
        answers[name] = sorted_rows(partition["loads"])
    return answers


# --- the catalog ------------------------------------------------------------------------------------


def test_worker_records_and_their_reasons_are_dynamos(pair: Pair) -> None:
    name = model()
    bodies = [
        {"worker_id": next(_worker_ids), "model_name": name},
        {"worker_id": next(_worker_ids), "model_name": name, "endpoint": "", "block_size": 0, "data_parallel_size": 0},
        worker_body(next(_worker_ids), name),
        worker_body(next(_worker_ids), name, data_parallel_size=2),  # a scalar endpoint names no rank of two
        worker_body(next(_worker_ids), name, kv_events_endpoint=None, data_parallel_start_rank=2,
                    data_parallel_size=2, kv_events_endpoints={"2": "tcp://127.0.0.1:3", "3": "tcp://127.0.0.1:4"},
                    max_num_batched_tokens=8192, total_kv_blocks=1000),
        worker_body(next(_worker_ids), name, data_parallel_size=2, replay_endpoint="tcp://127.0.0.1:5",
                    kv_events_endpoints={"0": "tcp://127.0.0.1:3", "1": "tcp://127.0.0.1:4"}),
        worker_body(next(_worker_ids), name, kv_events_endpoint="nonsense"),
        worker_body(next(_worker_ids), name, kv_events_endpoint="tcp://127.0.0.1"),
        worker_body(next(_worker_ids), name, replay_endpoint="bogus"),
        worker_body(next(_worker_ids), name, block_size=8),  # the partition's is 4
        worker_body(next(_worker_ids), name, stable_routing_id="s", is_eagle=False, taints=["gpu"],
                    topology_domains={"rack": "r1"}, kv_transfer_domain="d", kv_transfer_enforcement="preferred",
                    kv_transfer_preferred_weight=0.5, unknown_field=3),
    ]
    for body in bodies:
        alike(pair, "POST", "/workers", body)
    alike(pair, "GET", f"/workers?model_name={name}")
    # PATCH and DELETE
    patched = bodies[0]["worker_id"]
    alike(pair, "PATCH", f"/workers/{patched}", {"endpoint": "http://x", "block_size": BLOCK,
                                                 "kv_events_endpoint": "tcp://127.0.0.1:1", "model_name": "ignored"})
    alike(pair, "PATCH", f"/workers/{patched}", {"kv_events_endpoint": None})  # null: unchanged
    alike(pair, "PATCH", f"/workers/{patched}", {"block_size": 0})
    alike(pair, "DELETE", f"/workers/{patched}")
    alike(pair, "DELETE", f"/workers/{patched}")  # 404
    alike(pair, "PATCH", "/workers/999999999", {})  # 404
    alike(pair, "GET", f"/workers?model_name={name}")
    for body in bodies[1:]:
        alike(pair, "DELETE", f"/workers/{body['worker_id']}")


def test_a_data_parallel_size_over_the_limit_is_refused(pair: Pair) -> None:
    alike(pair, "POST", "/workers", worker_body(next(_worker_ids), model(), data_parallel_size=5000))


# --- selection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [TOKENS, TOKENS[:15], list(range(1, 19))], ids=["16", "15", "18"])
def test_a_selection_and_the_reads_behind_it_are_dynamos(pair: Pair, fleet: Fleet, tokens: list[int]) -> None:
    body = {"model_name": fleet.model, "token_ids": tokens}
    status, answer = alike(pair, "POST", "/select", body)
    assert status == 200 and answer["worker_id"] == fleet.ids[0]
    answers = both(pair, "POST", "/overlap_scores", body)
    assert answers["ours"] == answers["reference"]
    answers = both(pair, "POST", "/potential_loads", body)
    assert sorted_rows(answers["ours"][1]) == sorted_rows(answers["reference"][1])


def test_the_hash_form_selects_alike(pair: Pair, fleet: Fleet) -> None:
    local = to_signed_list(local_block_hashes(TOKENS[:12], BLOCK))
    body = {"model_name": fleet.model, "block_hashes": local, "sequence_hashes": to_signed_list(CHAIN[:3]),
            "isl_tokens": 14, "selection_id": "hash-form"}
    status, answer = alike(pair, "POST", "/select", body)
    assert status == 200 and answer["worker_id"] == fleet.ids[0]


def test_bookings_move_the_choice_and_the_loads_alike(pair: Pair, fleet: Fleet) -> None:
    body = {"model_name": fleet.model, "token_ids": TOKENS, "selection_id": "b1"}
    status, first = alike(pair, "POST", "/select_and_reserve", body)
    assert status == 200 and first["worker_id"] == fleet.ids[0]
    alike(pair, "POST", "/select_and_reserve", body)  # 409: booked already
    answers = loads(pair, fleet.model)
    assert answers["ours"] == answers["reference"]
    # More bookings of prompts no one caches pile load on the cheapest in turn (an explicit
    # booking on the third worker first, so that the second and the third differ).
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "b-explicit",
                                          "worker_id": fleet.ids[2], "token_ids": list(range(500, 512)),
                                          "effective_prefill_tokens": 12})
    for index, length in enumerate((40, 44, 30, 52)):
        other = {"model_name": fleet.model, "token_ids": list(range(1000 + 100 * index, 1000 + 100 * index + length)),
                 "selection_id": f"b-other-{index}"}
        expected = one_cheapest(pair, other)
        assert alike(pair, "POST", "/select_and_reserve", other)[1]["worker_id"] == expected
    answers = loads(pair, fleet.model)
    assert answers["ours"] == answers["reference"]
    alike(pair, "POST", "/reservations/b1/prefill_complete")
    alike(pair, "POST", "/reservations/b1/prefill_complete")  # idempotent
    alike(pair, "POST", "/reservations/b1/output_block", {})
    alike(pair, "POST", "/reservations/b1/output_block", {})
    answers = loads(pair, fleet.model)
    assert answers["ours"] == answers["reference"]
    alike(pair, "POST", "/select", {"model_name": fleet.model, "token_ids": TOKENS})
    for selection_id in ["b1", "b-explicit", *(f"b-other-{index}" for index in range(4))]:
        alike(pair, "DELETE", f"/reservations/{selection_id}")
    alike(pair, "DELETE", "/reservations/b1")  # 404
    alike(pair, "POST", "/reservations/b1/prefill_complete")  # 404
    answers = loads(pair, fleet.model)
    assert answers["ours"] == answers["reference"]


def test_pending_selections_and_explicit_reservations_alike(pair: Pair, fleet: Fleet) -> None:
    alike(pair, "POST", "/select", {"model_name": fleet.model, "token_ids": TOKENS, "selection_id": "p1"})
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "p1", "token_ids": [9, 9]})
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "p1"})  # used: 404
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "never"})  # 404
    explicit = {"model_name": fleet.model, "selection_id": "e1", "worker_id": fleet.ids[2], "token_ids": TOKENS}
    alike(pair, "POST", "/reservations", explicit)
    alike(pair, "POST", "/reservations", explicit)  # 409
    alike(pair, "POST", "/reservations", {**explicit, "selection_id": "e2", "effective_prefill_tokens": 12})
    alike(pair, "POST", "/reservations", {**explicit, "selection_id": "e3", "effective_prefill_tokens": 17})  # 400
    alike(pair, "POST", "/reservations", {**explicit, "selection_id": "e4", "worker_id": 999_999})  # 404
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "e5", "worker_id": fleet.ids[1],
                                          "sequence_hashes": to_signed_list(CHAIN[:2]), "isl_tokens": 0})
    answers = loads(pair, fleet.model)
    assert answers["ours"] == answers["reference"]
    for selection_id in ("p1", "e1", "e2", "e5"):
        alike(pair, "DELETE", f"/reservations/{selection_id}")


def test_filters_of_the_candidates_alike(pair: Pair, fleet: Fleet) -> None:
    base = {"model_name": fleet.model, "token_ids": TOKENS}
    alike(pair, "POST", "/select", {**base, "allowed_worker_ids": [fleet.ids[1], fleet.ids[2]]})
    alike(pair, "POST", "/select", {**base, "allowed_worker_ids": []})  # 503
    alike(pair, "POST", "/select", {**base, "allowed_worker_ids": [424242]})  # 503
    alike(pair, "POST", "/select", {**base, "pinned_worker": {"worker_id": fleet.ids[2], "dp_rank": 0}})
    alike(pair, "POST", "/select", {**base, "pinned_worker": {"worker_id": fleet.ids[2], "dp_rank": 5}})  # 503
    alike(pair, "POST", "/select", {**base, "pinned_worker": {"worker_id": fleet.ids[2], "dp_rank": 0},
                                    "allowed_worker_ids": [fleet.ids[0]]})  # 400
    alike(pair, "POST", "/select", {**base, "affinity_target": {"worker_id": fleet.ids[2]}})
    alike(pair, "POST", "/select", {**base, "affinity_target": {"worker_id": 424242}})  # ignored
    alike(pair, "POST", "/select", {**base, "routing_constraints": {"required_taints": ["none-has-it"]}})  # 503


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/select", {"model_name": "nowhere", "token_ids": [1]}),
    ("/select", {"token_ids": [1]}),
    ("/reservations/nope/prefill_complete", None),
    ("/reservations/nope/output_block", {}),
    ("/reservations/nope/output_block", {"decay_fraction": 2}),
], ids=["unknown model", "default model", "unknown reservation", "unknown reservation output",
        "fraction out of range"])
def test_service_errors_have_dynamos_status_and_message(pair: Pair, fleet: Fleet, path: str, body: Any) -> None:
    alike(pair, "POST", path, body)


@pytest.mark.parametrize("body", [
    {},
    {"block_hashes": [1]},
    {"block_hashes": [1], "sequence_hashes": [1]},
    {"block_hashes": [1], "sequence_hashes": [1], "isl_tokens": 0},
    {"block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 8},
], ids=["no prompt", "no sequence hashes", "no isl", "isl 0", "lengths differ"])
def test_a_prompt_s_hash_form_is_checked_in_dynamos_order(pair: Pair, fleet: Fleet, body: dict[str, Any]) -> None:
    alike(pair, "POST", "/select", {"model_name": fleet.model, **body})


@pytest.mark.parametrize("path, body", [
    ("/select", {"token_ids": "x"}),
    ("/select", {"token_ids": [-1]}),
    ("/select", {"model_name": None}),
    ("/select", {"router_config_override": 5}),
    ("/select", {"router_config_override": {"overlap_score_credit": -1}}),
    ("/select", {"router_config_override": {"router_temperature": -1}}),
    ("/select", {"pinned_worker": {"worker_id": 1}}),
    ("/select", {"session_context": {"session_id": "s", "input_trigger": "nope"}}),
    ("/workers", {"worker_id": "1"}),
    ("/workers", {"worker_id": -1}),
    ("/workers", {"model_name": "m"}),
    ("/workers", {"worker_id": 1, "kv_transfer_enforcement": "bogus"}),
    ("/reservations", {"model_name": "m"}),
], ids=lambda value: str(value)[:40])
def test_a_body_of_the_wrong_shape_gets_dynamos_status(pair: Pair, path: str, body: Any) -> None:
    """The status is Dynamo's; the message is ours (msgspec's words, not serde's)."""
    answers = both(pair, "POST", path, body)
    assert answers["ours"][0] == answers["reference"][0], answers


def test_transport_errors_have_dynamos_status(pair: Pair) -> None:
    for name, client in pair.items():
        assert client.post("/select", content=b"{").status_code == 415, name
        assert client.post("/select", content=b"{", headers={"content-type": "application/json"}).status_code == 400
        assert client.get("/nowhere").json() == {"error": "route not found"}
        refused = client.put("/select")
        assert refused.status_code == 405 and refused.json() == {"error": "method not allowed"}
        assert client.patch("/workers/abc", json={}).status_code == 400
        assert client.get("/health").json() == {"status": "ok"}


# --- documented differences ---------------------------------------------------------------------------------


def test_a_per_request_cost_override_is_honoured_by_ours_and_ignored_by_dynamo(pair: Pair, fleet: Fleet) -> None:
    """With no cache credit, the three workers cost the same prompt the same on ours (4 blocks
    to prefill everywhere) save for the decode blocks, which favour no one; Dynamo 1.6.1 still
    credits the cache and picks the first worker every time."""
    body = {"model_name": fleet.model, "token_ids": TOKENS, "router_config_override": {"overlap_score_credit": 0}}
    picks: dict[str, set[int]] = {"ours": set(), "reference": set()}
    for _ in range(30):
        for name, (status, answer) in both(pair, "POST", "/select", body).items():
            assert status == 200
            picks[name].add(answer["worker_id"])
    assert picks["reference"] == {fleet.ids[0]}
    assert len(picks["ours"]) > 1


def test_decay_weighs_output_blocks_only_on_ours(pair: Pair, fleet: Fleet) -> None:
    """The router guide's decay is of output blocks; Dynamo 1.6.1 also re-weighs the prompt
    blocks the request alone holds."""
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "d1", "worker_id": fleet.ids[2],
                                          "token_ids": TOKENS})
    for _ in range(2):
        alike(pair, "POST", "/reservations/d1/output_block", {})
    alike(pair, "POST", "/reservations/d1/output_block", {"decay_fraction": 0.5})
    answers = loads(pair, fleet.model)
    row = {name: next(r for r in rows if r["worker_id"] == fleet.ids[2]) for name, rows in answers.items()}
    assert row["reference"]["potential_decode_blocks"] == round(7 * 0.5)  # 4 prompt + 3 output blocks, all halved
    assert row["ours"]["potential_decode_blocks"] == 4 + 2  # 4 prompt blocks + 3 output blocks halved (1.5 -> 2)
    alike(pair, "DELETE", "/reservations/d1")


def test_unknown_query_parameters_are_refused_by_ours(pair: Pair) -> None:
    answers = both(pair, "GET", "/loads?model=x")
    assert answers["reference"][0] == 200 and answers["ours"][0] == 400


def test_expected_output_tokens_decays_output_blocks_only_on_ours(pair: Pair, fleet: Fleet) -> None:
    """Dynamo 1.6.1 takes `expected_output_tokens` but counts output blocks fully unless a
    `decay_fraction` is sent; ours decays them toward that length by itself (docs/differences.md)."""
    alike(pair, "POST", "/reservations", {"model_name": fleet.model, "selection_id": "x1", "worker_id": fleet.ids[2],
                                          "token_ids": TOKENS, "expected_output_tokens": 2 * BLOCK})
    decode: dict[str, list[int]] = {"reference": [], "ours": []}
    for _ in range(3):
        alike(pair, "POST", "/reservations/x1/output_block", {})
        for name, rows in loads(pair, fleet.model).items():
            decode[name].append(next(r for r in rows if r["worker_id"] == fleet.ids[2])["potential_decode_blocks"])
    assert decode["reference"] == [4 + 1, 4 + 2, 4 + 3]  # 4 prompt blocks, output at full weight
    assert decode["ours"] == [4 + 1, 4 + 0, 4 + 0]  # n blocks weigh n * (1 - n/2): 0.5 -> 1, then 0
    alike(pair, "DELETE", "/reservations/x1")


def test_a_prefill_worker_type_books_no_blocks_only_on_ours(pair: Pair, context: zmq.Context) -> None:
    """`router_hint_worker_type: prefill`: Dynamo 1.6.1 stores the hint and books the worker's
    prompt blocks as any other's; ours books its prefill tokens only (docs/differences.md)."""
    name = model()
    engine = EnginePublisher(WireFormat.VLLM, context=context)
    worker_id = next(_worker_ids)
    try:
        status, record = alike(pair, "POST", "/workers", worker_body(worker_id, name, engine,
                                                                     router_hint_worker_type="prefill"))
        assert status == 201 and record["router_hint_worker_type"] == "prefill"
        alike(pair, "POST", "/reservations", {"model_name": name, "selection_id": "pw1", "worker_id": worker_id,
                                              "token_ids": TOKENS, "effective_prefill_tokens": 16})
        answers = loads(pair, name)
        decode = {who: rows[0]["potential_decode_blocks"] for who, rows in answers.items()}
        assert decode == {"reference": 4, "ours": 0}
        assert {who: rows[0]["potential_prefill_tokens"] for who, rows in answers.items()} == {
            "reference": 16, "ours": 16}
        alike(pair, "DELETE", "/reservations/pw1")
    finally:
        both(pair, "DELETE", f"/workers/{worker_id}")
        engine.close()
