"""Remote mode: selectors on a shared slot tracker and indexer (`--slot-tracker URL --indexer URL`),
all started as processes, with engine stand-ins publishing vLLM's KV events. Two selectors see
the same cached blocks and each other's bookings; a selector keeps nothing the services refused;
an unreachable service is a 503, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from support.reference_server import ServerURL, free_port, running_service
from support.select_support import BLOCK, MODEL, engine, wait_until

from dynamo_lite.client import OverlapScores
from dynamo_lite.select_service.remote import _query_result


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[ServerURL, ServerURL, ServerURL, ServerURL, list[dict[str, Any]]]]:
    with ExitStack() as stack:
        engines = [engine(stack) for _ in range(2)]
        tracker = stack.enter_context(running_service("slot_tracker"))
        indexer = stack.enter_context(running_service("indexer"))
        remote = ("--slot-tracker", str(tracker), "--indexer", str(indexer))
        first = stack.enter_context(running_service("select_service", *remote))
        second = stack.enter_context(running_service("select_service", *remote))
        yield tracker, indexer, first, second, engines


@pytest.mark.process
def test_two_selectors_share_the_cache_and_the_load(
        shared: tuple[ServerURL, ServerURL, ServerURL, ServerURL, list[dict[str, Any]]]) -> None:
    tracker, indexer, first, second, engines = shared
    with httpx.Client(timeout=10) as client:
        for selector in (first, second):  # each selector registers the workers it routes to
            for worker_id, fields in enumerate(engines, start=1):
                record = client.post(f"{selector}/workers", json={"worker_id": worker_id, **fields})
                assert record.status_code == 201 and record.json()["lifecycle"] == "schedulable", record.text
        # Registered once with each service, whichever selector came first.
        assert sorted(w["worker_id"] for w in client.get(f"{tracker}/workers").json()) == [1, 2]
        assert sorted(w["instance_id"] for w in client.get(f"{indexer}/workers").json()) == [1, 2]

        prompt = list(range(300, 300 + 5 * BLOCK))
        served = httpx.post(f"{engines[0]['endpoint']}/v1/completions",
                            json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30)
        assert served.status_code == 200, served.text

        def cached(selector: ServerURL) -> Any:
            rows = client.post(f"{selector}/overlap_scores", json={"model_name": MODEL, "token_ids": prompt})
            return {row["worker_id"]: row["device_blocks"] for row in rows.json()["workers"]}.get(1) == 5

        wait_until(lambda: cached(first) and cached(second))  # the indexer's subscription feeds both

        booked = client.post(f"{first}/select_and_reserve",
                             json={"model_name": MODEL, "token_ids": prompt + [1, 2], "selection_id": "a"})
        assert booked.status_code == 200, booked.text
        assert booked.json()["worker_id"] == 1 and booked.json()["effective_prefill_tokens"] == 2
        # The second selector sees the first's booking: it is in the shared slot tracker.
        (loads,) = client.get(f"{second}/loads", params={"model_name": MODEL}).json()
        assert {row["worker_id"]: row["active_requests"] for row in loads["loads"]} == {1: 1, 2: 0}
        # A selection id is one booking service-wide: the second selector cannot book "a" again.
        again = client.post(f"{second}/select_and_reserve",
                            json={"model_name": MODEL, "token_ids": prompt, "selection_id": "a"})
        assert again.status_code == 409, again.text
        assert client.post(f"{second}/reservations/a/output_block", json={}).status_code == 404  # counted by "first"

        assert client.post(f"{first}/reservations/a/prefill_complete").status_code == 200
        for fraction in (None, None, 0.25):  # two blocks, then decayed to a quarter: the shared count stays
            body = {} if fraction is None else {"decay_fraction": fraction}
            assert client.post(f"{first}/reservations/a/output_block", json=body).status_code == 200
        rows = client.post(f"{tracker}/potential_loads", json={"model_name": MODEL, "sequence_hashes": []}).json()
        assert {row["worker_id"]: row["potential_prefill_tokens"] for row in rows} == {1: 0, 2: 0}
        assert {row["worker_id"]: row["potential_decode_blocks"] for row in rows}[1] == 5 + 2
        assert client.delete(f"{first}/reservations/a").json() == {"status": "ok"}
        assert client.delete(f"{first}/reservations/a").status_code == 200  # forwarded: /free is idempotent
        (loads,) = client.get(f"{second}/loads", params={"model_name": MODEL}).json()
        assert all(row["active_requests"] == 0 for row in loads["loads"])

        # Explicit reservations and /select + replay book on the shared tracker too.
        explicit = client.post(f"{second}/reservations", json={
            "model_name": MODEL, "token_ids": prompt, "selection_id": "b", "worker_id": 2, "dp_rank": 0,
            "effective_prefill_tokens": 80})
        assert explicit.status_code == 201, explicit.text
        chosen = client.post(f"{first}/select", json={"model_name": MODEL, "token_ids": prompt, "selection_id": "c"})
        assert chosen.status_code == 200 and chosen.json()["worker_id"] == 1
        assert client.post(f"{first}/reservations", json={"model_name": MODEL, "selection_id": "c"}).status_code == 201
        rows = client.post(f"{tracker}/potential_loads", json={"model_name": MODEL, "sequence_hashes": []}).json()
        assert {row["worker_id"]: (row["active_requests"], row["potential_prefill_tokens"]) for row in rows} == {
            1: (1, 0), 2: (1, 80)}
        for selector, selection in ((second, "b"), (first, "c")):
            assert client.delete(f"{selector}/reservations/{selection}").status_code == 200
        # A selector that goes away leaves its bookings in the shared slot tracker: another one
        # completes and frees them (what it cannot do is count their output: "first" counts it).
        booked = client.post(f"{first}/select_and_reserve",
                             json={"model_name": MODEL, "token_ids": prompt, "selection_id": "e"})
        assert booked.status_code == 200 and booked.json()["effective_prefill_tokens"] == 0
        assert client.post(f"{second}/reservations/e/prefill_complete").status_code == 200
        assert client.post(f"{second}/reservations/never-booked/prefill_complete").status_code == 404
        assert client.delete(f"{second}/reservations/e").status_code == 200
        rows = client.post(f"{tracker}/potential_loads", json={"model_name": MODEL, "sequence_hashes": []}).json()
        assert all(row["active_requests"] == 0 for row in rows)
        assert client.delete(f"{first}/reservations/e").status_code == 200  # its own record of it ends too
        assert client.post(f"{first}/potential_loads", json={"model_name": MODEL, "token_ids": prompt}).status_code \
            == 200
        assert client.get(f"{first}/dump").json() == client.get(f"{indexer}/dump").json()

        # An expected output length reaches the shared slot tracker, which decays the raw count.
        booked = client.post(f"{first}/select_and_reserve", json={
            "model_name": MODEL, "token_ids": prompt, "selection_id": "f", "expected_output_tokens": 2 * BLOCK})
        assert booked.status_code == 200 and booked.json()["worker_id"] == 1, booked.text
        decode = []
        for _ in range(3):
            assert client.post(f"{first}/reservations/f/output_block", json={}).status_code == 200
            rows = client.post(f"{tracker}/potential_loads", json={"model_name": MODEL, "sequence_hashes": []}).json()
            decode.append({row["worker_id"]: row["potential_decode_blocks"] for row in rows}[1])
        assert decode == [5 + 1, 5 + 0, 5 + 0]  # n blocks weigh n * (1 - n/2): 0.5 -> 1, then 0
        assert client.delete(f"{first}/reservations/f").status_code == 200

        # A worker removed through one selector leaves the services (the other selector's
        # catalog still names it, and finds it gone there: no booking on a rank the tracker lost).
        assert client.delete(f"{first}/workers/2").status_code == 200
        assert [w["worker_id"] for w in client.get(f"{tracker}/workers").json()] == [1]
        only = client.post(f"{second}/select_and_reserve", json={
            "model_name": MODEL, "token_ids": prompt, "selection_id": "d", "allowed_worker_ids": [2]})
        assert only.status_code == 503 and "slot tracker holds none" in only.json()["error"]
        assert client.post(f"{second}/workers", json={"worker_id": 2, **engines[1]}).status_code == 201
        assert sorted(w["worker_id"] for w in client.get(f"{tracker}/workers").json()) == [1, 2]


@pytest.mark.process
def test_an_unreachable_service_is_a_503_and_nothing_half_registered_is_kept() -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        tracker = stack.enter_context(running_service("slot_tracker"))
        selector = stack.enter_context(running_service(
            "select_service", "--slot-tracker", str(tracker), "--indexer", nowhere, "--service-timeout-secs", "1"))
        record = {"worker_id": 9, "model_name": MODEL, "endpoint": "http://127.0.0.1:1", "block_size": BLOCK,
                  "kv_events_endpoint": "tcp://127.0.0.1:2"}
        refused = httpx.post(f"{selector}/workers", json=record, timeout=10)
        assert refused.status_code == 503 and "indexer" in refused.json()["error"], refused.text
        assert httpx.get(f"{selector}/workers").json() == []
        assert httpx.get(f"{selector}/ready").status_code == 503
        assert httpx.post(f"{selector}/select", json={"model_name": MODEL, "token_ids": [1] * 40}).status_code == 503


@pytest.mark.process
def test_only_both_urls_start_remote_mode() -> None:
    import subprocess
    import sys
    for flags in (["--slot-tracker", "http://127.0.0.1:1"], ["--indexer", "ftp://x", "--slot-tracker", "http://a"],
                  ["--slot-tracker", "http://a", "--indexer", "http://b", "--indexer-peers", "http://c"]):
        done = subprocess.run([sys.executable, "-m", "dynamo_lite.select_service", *flags], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and "error:" in done.stderr, (flags, done.stderr)


@pytest.mark.unit
def test_the_indexer_s_answer_reads_back_per_rank_and_tier() -> None:
    # Worker 1: ranks 0 and 1, rank 1 longest on device, 2 more blocks on host, 1 on disk.
    answer = OverlapScores({(1, 0): 16, (1, 1): 48, (2, 0): 32}, {
        1: {"longest_matched": 96, "gpu": 48, "dp": {"0": 16, "1": 48}, "cpu": 80, "disk": 96},
        2: {"longest_matched": 32, "gpu": 32, "dp": {"0": 32}, "cpu": 32, "disk": 32}})
    result = _query_result(answer, 16)
    assert result.device == {(1, 0): 1, (1, 1): 3, (2, 0): 2}
    assert result.host_pinned == {(1, 1): 2} and result.disk == {(1, 1): 1}
    assert _query_result(None, 16).device == {}
