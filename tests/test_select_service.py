"""The selection service as a user meets it: started as a process, two engine stand-ins
registered with `POST /workers`, one call per request answering the engine that caches the
prompt, and the reservation lifecycle bringing the load back to zero. Also its process-level
behaviour: `--workers` at start-up, `--indexer-peers` recovery, `/metrics`, keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.reference_server import ServerURL, running_service
from support.select_support import BLOCK, MODEL, engine, wait_until

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[ServerURL, list[dict[str, Any]]]]:
    with ExitStack() as stack:
        engines = [engine(stack) for _ in range(2)]
        service = stack.enter_context(running_service("select_service"))
        yield service, engines


def test_one_call_per_request_finds_the_engine_that_caches_the_prompt(
        fleet: tuple[ServerURL, list[dict[str, Any]]]) -> None:
    service, engines = fleet
    with httpx.Client(base_url=service, timeout=10) as client:
        assert client.get("/ready").status_code == 503  # no worker yet
        for worker_id, fields in enumerate(engines, start=1):
            record = client.post("/workers", json={"worker_id": worker_id, **fields})
            assert record.status_code == 201 and record.json()["lifecycle"] == "schedulable", record.text
        assert client.get("/ready").json()["schedulable_workers"] == 2
        prompt = list(range(100, 100 + 6 * BLOCK))
        # The second engine serves the prompt once: it caches it and says so in its KV events.
        answer = httpx.post(f"{engines[1]['endpoint']}/v1/completions",
                            json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200, answer.text

        def cached_on_second() -> Any:
            rows = client.post("/overlap_scores", json={"model_name": MODEL, "token_ids": prompt}).json()["workers"]
            return {row["worker_id"]: row["device_blocks"] for row in rows}.get(2) == 6

        wait_until(cached_on_second)
        booked = client.post("/select_and_reserve", json={"model_name": MODEL, "token_ids": prompt + [7, 8, 9],
                                                          "selection_id": "turn-2"})
        assert booked.status_code == 200, booked.text
        body = booked.json()
        assert body["worker_id"] == 2 and body["endpoint"] == engines[1]["endpoint"]
        assert body["overlap"]["gpu"] == 6 * BLOCK and body["effective_prefill_tokens"] == 3
        (partition,) = client.get("/loads", params={"model_name": MODEL}).json()
        assert {row["worker_id"]: row["active_requests"] for row in partition["loads"]} == {1: 0, 2: 1}
        assert client.post("/reservations/turn-2/prefill_complete").status_code == 200
        assert client.post("/reservations/turn-2/output_block", json={}).status_code == 200
        assert client.delete("/reservations/turn-2").json() == {"status": "ok"}
        (partition,) = client.get("/loads", params={"model_name": MODEL}).json()
        assert all(row["active_requests"] == 0 and row["potential_decode_blocks"] == 0 for row in partition["loads"])
        metrics = client.get("/metrics").text
        assert 'dynamo_lite_select_workers{lifecycle="schedulable"} 2.0' in metrics
        assert "dynamo_lite_select_reservations 0.0" in metrics


def test_workers_listed_at_start_up_are_registered_and_a_peer_s_index_recovered(tmp_path: Path) -> None:
    with ExitStack() as stack:
        (fields,) = [engine(stack)]
        workers = tmp_path / "workers.yaml"
        workers.write_text(json.dumps({"workers": [{"worker_id": 5, **fields}]}))
        first = stack.enter_context(running_service("select_service", "--workers", str(workers)))
        assert httpx.get(f"{first}/ready").status_code == 200
        prompt = list(range(7, 7 + 4 * BLOCK))
        assert httpx.post(f"{fields['endpoint']}/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30).status_code == 200
        wait_until(lambda: httpx.get(f"{first}/dump").json().get(f"{MODEL}:default", {}).get("events"))
        second = stack.enter_context(running_service("select_service", "--indexer-peers", str(first)))
        assert httpx.get(f"{second}/workers").json() == []  # workers are not recovered
        record = {"worker_id": 5, **fields, "kv_events_endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None}
        assert httpx.post(f"{second}/workers", json=record).status_code == 201
        scores = httpx.post(f"{second}/overlap_scores", json={"model_name": MODEL, "token_ids": prompt}).json()
        assert [row["device_blocks"] for row in scores["workers"]] == [4]  # the peer's index, recovered


def test_a_bad_workers_file_stops_the_start_with_its_reason(tmp_path: Path) -> None:
    workers = tmp_path / "workers.json"
    workers.write_text(json.dumps([{"worker_id": -1}]))
    done = subprocess.run([sys.executable, "-m", "dynamo_lite.select_service", "--workers", str(workers)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "worker 0:" in done.stderr and "worker_id" in done.stderr


def test_with_keys_selection_needs_one_and_probes_do_not() -> None:
    with running_service("select_service", "--api-key", "full", "--read-api-key", "reader") as service:
        assert httpx.get(f"{service}/health").status_code == 200
        assert httpx.get(f"{service}/ready").status_code == 503
        body = {"model_name": MODEL, "token_ids": [1, 2, 3]}
        assert httpx.post(f"{service}/select", json=body).status_code == 401
        read = {"authorization": "Bearer reader"}
        assert httpx.post(f"{service}/select", json=body, headers=read).status_code == 503  # allowed: no worker
        assert httpx.post(f"{service}/workers", json={"worker_id": 1}, headers=read).status_code == 403
        full = {"authorization": "Bearer full"}
        assert httpx.post(f"{service}/workers", json={"worker_id": 1}, headers=full).status_code == 201


@pytest.mark.parametrize("lean", [False, True], ids=["httpx", "lean"])
def test_the_clients_speak_every_route(fleet: tuple[ServerURL, list[dict[str, Any]]], lean: bool) -> None:
    import asyncio

    from dynamo_lite.client import AsyncSelectClient, SelectClient, ServiceStatusError

    service, engines = fleet
    model_name = f"client-{lean}"
    with SelectClient(service) as selector:
        record = selector.upsert_worker(31, model_name=model_name, endpoint="http://a", block_size=BLOCK,
                                        kv_events_endpoint="tcp://127.0.0.1:1")
        assert record.lifecycle == "schedulable"
        assert selector.patch_worker(31, total_kv_blocks=64).total_kv_blocks == 64
        assert [w.worker_id for w in selector.workers(model_name)] == [31]
        assert selector.ready().ready

    async def lifecycle() -> None:
        async with AsyncSelectClient(service, lean=lean) as selector:
            picked = await selector.select_and_reserve(model_name, list(range(40)), selection_id="a/1")
            assert picked.worker_id == 31 and picked.selection_id == "a/1" and picked.isl_tokens == 40
            await selector.prefill_complete("a/1")
            await selector.output_block("a/1", decay_fraction=0.5)
            (partition,) = await selector.loads(model_name)
            assert partition.loads[0].active_requests == 1
            chosen = await selector.select(model_name, list(range(8)), selection_id="later")
            booked = await selector.reserve("later", model_name=model_name)
            assert (booked.worker_id, booked.dp_rank) == (chosen.worker_id, chosen.dp_rank)
            explicit = await selector.reserve("b", model_name=model_name, worker_id=31, token_ids=[1, 2, 3])
            assert explicit.endpoint == "http://a"
            for selection_id in ("a/1", "later", "b"):
                await selector.free(selection_id)
            with pytest.raises(ServiceStatusError) as refused:
                await selector.free("a/1")
            assert refused.value.status == 404
            overlap = await selector.overlap_scores(model_name, list(range(16)))
            assert overlap.num_blocks == 1 and [row.worker_id for row in overlap.workers] == [31]
            rows = await selector.potential_loads(model_name, list(range(16)))
            assert rows[0].potential_prefill_tokens == 16
            assert isinstance(await selector.dump(), dict)
            await selector.delete_worker(31)

    asyncio.run(lifecycle())


ROOT = Path(__file__).resolve().parent.parent


def test_the_example_routes_the_next_turn_to_the_engine_that_caches_the_first(
        fleet: tuple[ServerURL, list[dict[str, Any]]]) -> None:
    service, _ = fleet
    env = {**os.environ, "SELECT_SERVICE_URL": str(service)}
    done = subprocess.run([sys.executable, "examples/select_service.py"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turn 2: 104 tokens -> worker 72 at http://engine-72:8000 (cached 64 tokens, 40 left to prefill)" in done.stdout
    assert httpx.get(f"{service}/workers", params={"model_name": "select-example"}).json() == []
    unreachable = {**env, "SELECT_SERVICE_URL": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "examples/select_service.py"], env=unreachable, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
