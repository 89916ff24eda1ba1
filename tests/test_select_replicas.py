"""Selection service replicas (`--nats URL` in remote mode), all started as processes on a real
`nats-server -js`: a worker registered with one replica is routed to by all, any replica serves
any booking's lifecycle with the right counts, and a replica killed with SIGKILL comes back with
the whole catalog from the bucket."""

from __future__ import annotations

import signal
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from support.nats_support import NatsServer
from support.reference_server import ServerURL, running_service
from support.select_support import BLOCK, MODEL, engine, wait_until


def loads_of(tracker: ServerURL) -> dict[int, dict[str, int]]:
    rows = httpx.post(f"{tracker}/potential_loads", json={"model_name": MODEL, "sequence_hashes": []}).json()
    return {row["worker_id"]: row for row in rows}


def catalog(selector: ServerURL) -> list[int]:
    return [record["worker_id"] for record in httpx.get(f"{selector}/workers").json()]


@pytest.mark.process
@pytest.mark.nats
def test_replicas_share_the_catalog_and_serve_each_other_s_bookings(nats_server: NatsServer) -> None:
    with ExitStack() as stack:
        engines = [engine(stack) for _ in range(2)]
        tracker = stack.enter_context(running_service("slot_tracker"))
        indexer = stack.enter_context(running_service("indexer"))
        flags = ("--slot-tracker", str(tracker), "--indexer", str(indexer), "--nats", nats_server.url)
        first = stack.enter_context(running_service("select_service", *flags))
        second = stack.enter_context(running_service("select_service", *flags))
        client = stack.enter_context(httpx.Client(timeout=10))

        for worker_id, fields in enumerate(engines, start=1):  # registered with the first replica only
            assert client.post(f"{first}/workers", json={"worker_id": worker_id, **fields}).status_code == 201
        wait_until(lambda: catalog(second) == [1, 2])
        assert client.get(f"{second}/ready").status_code == 200
        record: dict[str, Any] = client.get(f"{second}/workers").json()[1]
        assert record["endpoint"] == engines[1]["endpoint"] and record["lifecycle"] == "schedulable"
        assert client.patch(f"{first}/workers/2", json={"total_kv_blocks": 77}).status_code == 200
        wait_until(lambda: client.get(f"{second}/workers").json()[1]["total_kv_blocks"] == 77)

        prompt = list(range(500, 500 + 4 * BLOCK))
        assert httpx.post(f"{engines[1]['endpoint']}/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30).status_code == 200
        wait_until(lambda: client.post(f"{second}/overlap_scores", json={"model_name": MODEL, "token_ids": prompt})
                   .json()["workers"][1]["device_blocks"] == 4)

        # Booked by the second replica; its lifecycle served by the first, with the same counts.
        booked = client.post(f"{second}/select_and_reserve",
                             json={"model_name": MODEL, "token_ids": prompt + [3] * 20, "selection_id": "r1"})
        assert booked.status_code == 200 and booked.json()["worker_id"] == 2, booked.text
        assert loads_of(tracker)[2]["potential_prefill_tokens"] == 20
        wait_until(lambda: client.post(f"{first}/reservations/r1/prefill_complete").status_code == 200)
        assert loads_of(tracker)[2]["potential_prefill_tokens"] == 0
        for _ in range(2):
            assert client.post(f"{first}/reservations/r1/output_block", json={}).status_code == 200
        # One more from the booking replica: it learned the first's prefill and two blocks, so it counts the third.
        wait_until(lambda: "dynamo_lite_select_replica_announcements_received_total 3.0"
                   in client.get(f"{second}/metrics").text)
        assert client.post(f"{second}/reservations/r1/output_block", json={}).status_code == 200
        decode = loads_of(tracker)[2]["potential_decode_blocks"]
        assert decode == 5 + 3, decode  # the prompt's 5 full blocks and 3 output blocks
        assert client.delete(f"{first}/reservations/r1").status_code == 200
        assert loads_of(tracker)[2]["active_requests"] == 0
        wait_until(lambda: "dynamo_lite_select_reservations 0.0" in client.get(f"{second}/metrics").text)

        # A replica killed outright comes back with the whole catalog, without registering again.
        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        again = stack.enter_context(running_service("select_service", *flags))
        assert catalog(again) == [1, 2] and client.get(f"{again}/ready").status_code == 200
        chosen = client.post(f"{again}/select", json={"model_name": MODEL, "token_ids": prompt})
        assert chosen.status_code == 200 and chosen.json()["worker_id"] == 2
        # A removal through any replica reaches every replica.
        assert client.delete(f"{again}/workers/1").status_code == 200
        wait_until(lambda: catalog(second) == [2])
        assert [w["worker_id"] for w in client.get(f"{tracker}/workers").json()] == [2]


@pytest.mark.process
def test_replicas_need_remote_mode() -> None:
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "dynamo_lite.select_service", "--nats", "nats://127.0.0.1:4222"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--slot-tracker" in done.stderr


@pytest.mark.process
@pytest.mark.nats
def test_a_catalog_change_nats_does_not_take_is_a_503_and_goes_through_when_sent_again(nats_server: NatsServer) -> None:
    with ExitStack() as stack:
        tracker = stack.enter_context(running_service("slot_tracker"))
        indexer = stack.enter_context(running_service("indexer"))
        flags = ("--slot-tracker", str(tracker), "--indexer", str(indexer), "--nats", nats_server.url)
        first = stack.enter_context(running_service("select_service", *flags))
        second = stack.enter_context(running_service("select_service", *flags))
        record = {"worker_id": 7, "model_name": MODEL, "endpoint": "http://127.0.0.1:1", "block_size": BLOCK,
                  "kv_events_endpoint": "tcp://127.0.0.1:2"}
        removed = {**record, "worker_id": 8}
        assert httpx.post(f"{first}/workers", json=removed).status_code == 201
        wait_until(lambda: catalog(second) == [8])
        nats_server.stop()
        refused = httpx.post(f"{first}/workers", json=record, timeout=30)
        assert refused.status_code == 503 and "not shared" in refused.json()["error"], refused.text
        assert httpx.delete(f"{first}/workers/8", timeout=30).status_code == 200  # shared once NATS is back
        nats_server.start()
        wait_until(lambda: httpx.post(f"{first}/workers", json=record, timeout=30).status_code == 201, timeout=30)
        wait_until(lambda: catalog(second) == [7], timeout=30)
