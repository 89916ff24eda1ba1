"""Stateful schemathesis runs over both OpenAPI documents, following their `links`:
register -> add -> prefill_complete / output_blocks -> free (slot tracker), register -> events ->
query_by_hash / dump (indexer).

Every call must answer without a 5xx and conform to the document (status, content type, body
schema). At the end of every scenario the state must be consistent:

* slot tracker: `/output_blocks` answers as a model of each active request's last count says
  (200 for a count at least as large, 409 for a smaller one, 404 for a request not active); a
  rank's decode blocks are at least its requests' output blocks (decayed where `/add` gave an
  expected length); after freeing every request the scenario added, every rank's load is 0/0
  and no rank has an active request;
* indexer: after clearing every worker (a `cleared` event per rank), every query of every hash
  the scenario stored is empty and no rank holds a block.

Each scenario starts from an empty service (everything still registered is unregistered).
The budget follows the hypothesis profile (see `schema_support.stateful_settings`):
`pytest --hypothesis-profile=long tests/test_stateful.py` runs 2,000 scenarios per service,
at least 10,000 calls each (asserted).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from starlette.testclient import TestClient
from support.schema_support import (
    LONG_STATEFUL_CALLS,
    SCHEMA_API_KEY,
    CallStats,
    is_long_profile,
    load_stateful,
    run_stateful,
    settle_positive_case,
    tenant_of,
)

from dynamo_lite.indexer.app import create_app as create_indexer_app
from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker_app
from dynamo_lite.slot_tracker.core import decayed_output

pytestmark = pytest.mark.unit

U64_MAX = 2**64 - 1


def _client(app: Any) -> TestClient:
    """Direct calls for set-up and invariants (no lifespan: schemathesis runs the app's), with the
    key the apps require (`load_stateful`)."""
    return TestClient(app, raise_server_exceptions=True, headers={"authorization": f"Bearer {SCHEMA_API_KEY}"})


def _ok(response: Any, *statuses: int) -> Any:
    assert response.status_code in (statuses or (200,)), (response.status_code, response.text)
    return response.json() if response.content else None


# --------------------------------------------------------------------------------------------
# Slot tracker
# --------------------------------------------------------------------------------------------

slot_tracker_app = create_slot_tracker_app()
slot_tracker_schema = load_stateful("slot_tracker.yaml", slot_tracker_app)
slot_tracker_stats = CallStats()


class SlotTrackerWorkflow(slot_tracker_schema.as_state_machine()):  # type: ignore[misc]
    client = _client(slot_tracker_app)

    def setup(self) -> None:
        self.added: set[tuple[str, str, str]] = set()
        # (model_name, tenant_id, request_id) of each active request -> (worker_id, dp_rank, output blocks,
        # the expected output tokens its /add gave: its output blocks decay toward them)
        self.active: dict[tuple[str, str, str], tuple[int, int, int, int | None]] = {}
        for worker in _ok(self.client.get("/workers")):
            _ok(self.client.post("/unregister", json={key: worker[key] for key in ("worker_id", "model_name", "tenant_id")}))
        assert _ok(self.client.get("/loads")) == []

    def step(self, input: Any) -> Any:
        settle_positive_case(input.case, input.applied_parameters)
        return super().step(input)

    def after_call(self, response: Any, case: Any) -> None:
        super().after_call(response, case)
        slot_tracker_stats.record(case.operation.label, response.status_code)
        path, status = case.operation.path, response.status_code
        if path == "/add" and status == 201:
            key = (case.body["model_name"], tenant_of(case.body), case.body["request_id"])
            self.added.add(key)
            self.active[key] = (case.body["worker_id"], case.body["dp_rank"], 0,
                                case.body.get("expected_output_tokens"))
        elif path == "/free" and status == 200:
            self.active.pop((case.body["model_name"], tenant_of(case.body), case.body["request_id"]), None)
        elif path == "/unregister" and status == 200:
            worker = (case.body["model_name"], tenant_of(case.body), case.body["worker_id"])
            self.active = {key: value for key, value in self.active.items() if (*key[:2], value[0]) != worker}
        elif path == "/output_blocks" and status in (200, 404, 409):
            self._check_output_blocks(case.body, status)

    def _check_output_blocks(self, body: dict[str, Any], status: int) -> None:
        key = (body["model_name"], tenant_of(body), body["request_id"])
        active = self.active.get(key)
        if active is None:
            assert status == 404, (key, status)
            return
        worker_id, dp_rank, count, expected = active
        assert status == (200 if body["output_blocks"] >= count else 409), (key, count, body, status)
        slot_tracker_stats.notes["output block counts for active requests"] += 1
        if status == 200:
            self.active[key] = (worker_id, dp_rank, body["output_blocks"], expected)

    def teardown(self) -> None:
        slot_tracker_stats.notes["scenarios"] += 1
        decode_blocks = {
            (row["model_name"], row["tenant_id"], row["worker_id"], row["dp_rank"]): row["active_decode_blocks"]
            for row in _ok(self.client.get("/loads"))
        }
        workers = _ok(self.client.get("/workers"))
        block_sizes = {(w["model_name"], w["tenant_id"]): w["block_size"] for w in workers}
        # A prefill worker's ranks hold no blocks at all: no active blocks, no output blocks.
        prefill = {(w["model_name"], w["tenant_id"], w["worker_id"]) for w in workers if w.get("role") == "prefill"}
        held: Counter[tuple[str, str, int, int]] = Counter()
        for (model_name, tenant_id, _), (worker_id, dp_rank, count, expected) in self.active.items():
            if (model_name, tenant_id, worker_id) in prefill:
                continue
            if expected is not None:  # what the decay leaves of the count
                count = decayed_output(count, block_sizes[(model_name, tenant_id)], expected)
            held[(model_name, tenant_id, worker_id, dp_rank)] += count
        for rank, count in held.items():
            assert decode_blocks[rank] >= count, (rank, decode_blocks[rank], count)
        for rank, blocks in decode_blocks.items():
            if rank[:3] in prefill:
                slot_tracker_stats.notes["prefill workers' ranks checked"] += 1
                assert blocks == 0, (rank, blocks)
        for model_name, tenant_id, request_id in sorted(self.added):
            body = {"model_name": model_name, "tenant_id": tenant_id, "request_id": request_id}
            _ok(self.client.post("/free", json=body), 200, 404)  # 404: its tracker is gone
        loads = _ok(self.client.get("/loads"))
        busy = [row for row in loads if row["active_prefill_tokens"] or row["active_decode_blocks"]]
        assert not busy, f"loads left after freeing every added request: {busy}"
        for model_name, tenant_id in {(w["model_name"], w["tenant_id"]) for w in _ok(self.client.get("/workers"))}:
            body = {"model_name": model_name, "tenant_id": tenant_id, "sequence_hashes": [], "new_isl_tokens": 0}
            for row in _ok(self.client.post("/potential_loads", json=body)):
                assert (row["active_requests"], row["potential_prefill_tokens"], row["potential_decode_blocks"]) == (0, 0, 0), row
        if loads:
            slot_tracker_stats.notes["scenarios ending with registered ranks, all idle"] += 1
        if self.added:
            slot_tracker_stats.notes["scenarios that added requests"] += 1


def test_slot_tracker_stateful() -> None:
    run_stateful(SlotTrackerWorkflow, slot_tracker_stats,
                 covered=lambda: slot_tracker_stats.notes["output block counts for active requests"] > 0)
    print(slot_tracker_stats.summary())
    # The links must have led somewhere, not only to 404s.
    assert slot_tracker_stats.count("POST /add", 201) > 0, slot_tracker_stats.summary()
    assert slot_tracker_stats.count("POST /prefill_complete", 200) > 0, slot_tracker_stats.summary()
    assert slot_tracker_stats.notes["output block counts for active requests"] > 0, slot_tracker_stats.summary()
    assert slot_tracker_stats.count("POST /free", 200) > 0, slot_tracker_stats.summary()
    if is_long_profile():
        assert slot_tracker_stats.calls() >= LONG_STATEFUL_CALLS, slot_tracker_stats.summary()


# --------------------------------------------------------------------------------------------
# Indexer
# --------------------------------------------------------------------------------------------

indexer_app = create_indexer_app()
indexer_schema = load_stateful("indexer.yaml", indexer_app)
indexer_stats = CallStats()


def _stored_local_hashes(document: Any) -> dict[str, set[int]]:
    """Partition key -> the local (tokens) hashes a valid events document stores."""
    found: dict[str, set[int]] = {}
    for key, section in document.items():
        for event in section["events"]:
            data = event["event"]["data"]
            if isinstance(data, dict) and "stored" in data:
                found.setdefault(key, set()).update(block["tokens_hash"] for block in data["stored"]["blocks"])
    return found


def _as_i64(value: int) -> int:
    return value - 2**64 if value > 2**63 - 1 else value


class IndexerWorkflow(indexer_schema.as_state_machine()):  # type: ignore[misc]
    client = _client(indexer_app)

    def setup(self) -> None:
        self.stored: dict[tuple[str, str], set[int]] = {}
        for worker in _ok(self.client.get("/workers")):
            body = {key: worker[key] for key in ("instance_id", "model_name", "tenant_id")}
            _ok(self.client.post("/unregister", json=body))
        assert _ok(self.client.get("/workers")) == []
        assert _ok(self.client.get("/dump")) == {}

    def step(self, input: Any) -> Any:
        settle_positive_case(input.case, input.applied_parameters)
        return super().step(input)

    def after_call(self, response: Any, case: Any) -> None:
        super().after_call(response, case)
        indexer_stats.record(case.operation.label, response.status_code)
        if case.operation.path == "/events" and response.status_code == 200:
            for key, hashes in _stored_local_hashes(case.body).items():
                model_name, _, tenant_id = key.rpartition(":")
                self.stored.setdefault((model_name, tenant_id), set()).update(map(_as_i64, hashes))
        if case.operation.path == "/routed" and response.status_code == 200 and "block_hashes" in case.body:
            partition = (case.body["model_name"], case.body.get("tenant_id", case.body.get("routing_group", "default")))
            self.stored.setdefault(partition, set()).update(case.body["block_hashes"])
            if response.json()["recorded"]:
                indexer_stats.notes["routed prompts recorded"] += 1
        if case.operation.path in ("/query_by_hash", "/query") and response.status_code == 200:
            if response.json()["scores"]:
                indexer_stats.notes["queries that matched blocks"] += 1

    def _clear_every_rank(self) -> None:
        for worker in _ok(self.client.get("/workers")):
            partition = (worker["model_name"], worker["tenant_id"])
            key = f"{partition[0]}:{partition[1]}"
            for rank in worker["ranks"]:
                last = rank["last_event_id"]
                if last == U64_MAX:  # no event id left above the watermark: drop the rank instead
                    body = {"instance_id": worker["instance_id"], "model_name": partition[0],
                            "tenant_id": partition[1], "dp_rank": rank["dp_rank"]}
                    _ok(self.client.post("/unregister", json=body))
                    continue
                event = {"worker_id": worker["instance_id"], "event": {
                    "event_id": 0 if last is None else last + 1, "dp_rank": rank["dp_rank"], "data": "cleared"}}
                document = {key: {"block_size": worker["block_size"], "events": [event]}}
                report = _ok(self.client.post("/events", json=document))
                assert report["applied"] == 1, report

    def _found_before_clearing(self) -> bool:
        """Whether some block the scenario stored is still found (the first block of a chain
        matches on its own), so the run shows that its stores reached the index."""
        live = {(worker["model_name"], worker["tenant_id"]) for worker in _ok(self.client.get("/workers"))}
        for (model_name, tenant_id), hashes in self.stored.items():
            if (model_name, tenant_id) not in live:
                continue
            for single in sorted(hashes)[:32]:
                query = {"model_name": model_name, "tenant_id": tenant_id, "block_hashes": [single]}
                if _ok(self.client.post("/query_by_hash", json=query))["scores"]:
                    return True
        return False

    def teardown(self) -> None:
        indexer_stats.notes["scenarios"] += 1
        if self._found_before_clearing():
            indexer_stats.notes["scenarios whose stored blocks were found before clearing"] += 1
        self._clear_every_rank()
        partitions = set()
        for worker in _ok(self.client.get("/workers")):
            partitions.add((worker["model_name"], worker["tenant_id"]))
            for rank in worker["ranks"]:
                assert (rank["blocks"], rank["lower_tier_blocks"], rank["approximate_blocks"]) == (0, 0, 0), worker
        for (model_name, tenant_id), hashes in self.stored.items():
            query = {"model_name": model_name, "tenant_id": tenant_id, "block_hashes": sorted(hashes)}
            response = self.client.post("/query_by_hash", json=query)
            if response.status_code == 404:
                # The partition went away with its last worker (a worker known only from events
                # leaves once cleared; a rank at the last event id was unregistered above).
                assert (model_name, tenant_id) not in partitions, response.text
                continue
            answer = _ok(response)
            assert answer == {"scores": {}, "frequencies": [], "instances": {}}, answer
            for single in hashes:
                answer = _ok(self.client.post("/query_by_hash", json={**query, "block_hashes": [single]}))
                assert answer["scores"] == {} and answer["instances"] == {}, (single, answer)
        for section in _ok(self.client.get("/dump")).values():
            assert section["events"] == [] and "approximations" not in section, section
        if self.stored:
            indexer_stats.notes["scenarios that stored blocks"] += 1


def test_indexer_stateful() -> None:
    notes = indexer_stats.notes
    run_stateful(IndexerWorkflow, indexer_stats, covered=lambda: min(
        notes["scenarios that stored blocks"], notes["scenarios whose stored blocks were found before clearing"],
        notes["routed prompts recorded"]) > 0)
    print(indexer_stats.summary())
    assert indexer_stats.count("POST /events", 200) > 0, indexer_stats.summary()
    assert indexer_stats.notes["scenarios that stored blocks"] > 0, indexer_stats.summary()
    assert indexer_stats.notes["scenarios whose stored blocks were found before clearing"] > 0, indexer_stats.summary()
    assert indexer_stats.notes["routed prompts recorded"] > 0, indexer_stats.summary()
    if is_long_profile():
        assert indexer_stats.calls() >= LONG_STATEFUL_CALLS, indexer_stats.summary()
