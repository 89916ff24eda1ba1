"""The slot tracker restarted under load, as a process: after SIGTERM, after SIGKILL (from its
last periodic snapshot), and started from a running peer (`--peers`).

Several clients add, prefill, extend and free their own requests concurrently and keep what the
service acknowledged: a call that got no answer was not applied (SIGTERM answers every request
it read before it stops). The loads the restarted service answers are compared with those of an
in-process tracker fed only the acknowledged state.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from support.reference_server import free_port, running_service
from support.slot_tracker_writes import MODEL, WORKERS, Booked, expected_loads

from dynamo_lite.client import AsyncSlotTrackerClient, ServiceCallError
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.snapshot import encode

pytestmark = pytest.mark.process

PREFIXES = [[(p << 32) + i for i in range(n)] for p, n in enumerate([8, 32, 64])]


class Load:
    """`clients` concurrent clients, each looping over its own requests: add (a chained prompt
    on a random rank), then prefill_complete, output_blocks and free in a random order of
    progress. `booked` holds every request added and not freed, as acknowledged."""

    def __init__(self, base_url: str, prefix: str, clients: int = 6) -> None:
        self.base_url = base_url
        self.prefix = prefix
        self.clients = clients
        self.booked: dict[str, Booked] = {}
        self.sent: dict[str, list[int]] = {}  # every /add sent, acknowledged or not: its hashes
        self.calls = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._client(number) for number in range(self.clients)))

    async def _client(self, number: int) -> None:
        rng = random.Random(f"{self.prefix}{number}")
        mine: list[str] = []
        async with AsyncSlotTrackerClient(self.base_url, timeout=10) as client:
            for index in range(10**9):
                if self.stop.is_set():
                    return
                try:
                    if len(mine) < 4 or rng.random() < 0.3:
                        await self._add(client, rng, f"{self.prefix}{number}-{index}", mine)
                    else:
                        await self._progress(client, rng, rng.choice(mine), mine)
                except ServiceCallError as error:
                    assert error.status == 0, error  # only "no answer": the service went away
                    return
                self.calls += 1

    async def _add(self, client: AsyncSlotTrackerClient, rng: random.Random, request_id: str, mine: list[str]) -> None:
        worker_id, tenant_id, dp_size = rng.choice(WORKERS)
        prefix = rng.choice(PREFIXES)
        hashes = prefix[: rng.randrange(len(prefix) + 1)] + [rng.getrandbits(63) for _ in range(rng.randrange(8))]
        if rng.random() < 0.1:
            hashes += hashes[:3]  # repeats count once, and must come back as sent
        booked = Booked(tenant_id, worker_id, rng.randrange(dp_size), hashes, rng.randrange(1, 4096))
        self.sent[request_id] = hashes
        await client.add(MODEL, request_id, worker_id, booked.dp_rank, hashes, booked.new_isl_tokens,
                         tenant_id=tenant_id)
        self.booked[request_id] = booked
        mine.append(request_id)

    async def _progress(self, client: AsyncSlotTrackerClient, rng: random.Random, request_id: str,
                        mine: list[str]) -> None:
        booked = self.booked[request_id]
        step = rng.random()
        if booked.new_isl_tokens and step < 0.5:
            await client.prefill_complete(MODEL, request_id, tenant_id=booked.tenant_id)
            booked.new_isl_tokens = 0
        elif step < 0.75:
            count = booked.output_blocks + rng.randrange(1, 3)
            await client.output_blocks(MODEL, request_id, count, tenant_id=booked.tenant_id)
            booked.output_blocks = count
        else:
            await client.free(MODEL, request_id, tenant_id=booked.tenant_id)
            del self.booked[request_id]
            mine.remove(request_id)


def drive(load: Load, seconds: float, interrupt: Callable[[], None] | None = None, *, calls: int = 0) -> None:
    """Run `load` for `seconds` and until it made `calls` calls (30 s at most: a loaded machine
    is slow), then `interrupt` the service (a signal) while calls are in flight, or stop the
    clients; return once every client has ended."""

    async def scenario() -> None:
        clients = asyncio.ensure_future(load.run())
        await asyncio.sleep(seconds)
        deadline = time.monotonic() + 30
        while load.calls < calls and time.monotonic() < deadline and not clients.done():
            await asyncio.sleep(0.05)
        if interrupt is None:
            load.stop.set()
        else:
            interrupt()
        await asyncio.wait_for(clients, 30)

    asyncio.run(scenario())


def register_workers(base_url: str) -> None:
    for worker_id, tenant_id, dp_size in WORKERS:
        body = {"worker_id": worker_id, "model_name": MODEL, "tenant_id": tenant_id, "block_size": 16,
                "dp_start": 0, "dp_size": dp_size}
        assert httpx.post(f"{base_url}/register", json=body).status_code == 201


def get(base_url: str, path: str) -> Any:
    response = httpx.get(f"{base_url}{path}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def requests_of(document: dict[str, Any]) -> dict[str, tuple]:
    """A dump's requests without their TTLs, which change as time passes."""
    return {request["request_id"]: (partition["tenant_id"], request["worker_id"], request["dp_rank"],
                                    request["sequence_hashes"], request["new_isl_tokens"], request["output_blocks"])
            for partition in document["partitions"] for request in partition["requests"]}


def tracker(path: Path, *flags: str) -> Any:
    return running_service("slot_tracker", "--snapshot", str(path), "--log-level", "info", *flags)


def test_sigterm_under_load_keeps_every_acknowledged_request(tmp_path: Path) -> None:
    path = tmp_path / "tracker.json"
    with tracker(path, "--snapshot-interval-secs", "3600") as url:
        register_workers(url)
        load = Load(url, "a")
        drive(load, 1.0, lambda: url.process.send_signal(signal.SIGTERM))
        assert url.process.wait(timeout=30) == 0
        assert "wrote the final snapshot" in url.log_text()
    assert load.calls > 200 and len(load.booked) > 10
    with tracker(path) as url:
        assert get(url, "/loads") == expected_loads(load.booked)
        assert [(w["worker_id"], w["tenant_id"], w["dp_size"]) for w in get(url, "/workers")] == WORKERS
        restored = requests_of(get(url, "/dump"))
        assert restored.keys() == load.booked.keys()
        assert all(restored[rid][3] == load.sent[rid] for rid in restored)  # hashes as sent, repeats included


def test_sigkill_restarts_from_the_last_periodic_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "tracker.json"
    interval = ("--snapshot-interval-secs", "0.05")
    # Killed mid-load, snapshots being written every 50 ms: the restart finds a whole one, of
    # requests that were sent, with the hashes they were sent with.
    with tracker(path, *interval) as url:
        register_workers(url)
        first = Load(url, "a")
        drive(first, 0.8, url.process.kill)
        url.process.wait(timeout=10)
    with tracker(path, *interval) as url:
        restored = requests_of(get(url, "/dump"))
        assert restored and all(restored[rid][3] == first.sent[rid] for rid in restored)
        assert [(w["worker_id"], w["tenant_id"], w["dp_size"]) for w in get(url, "/workers")] == WORKERS

        # More load, stopped; once a snapshot holds the state that /dump shows, SIGKILL.
        second = Load(url, "b")
        drive(second, 0.6, calls=101)
        assert second.calls > 100
        before = get(url, "/loads")
        live = requests_of(get(url, "/dump"))
        assert {rid for rid in live if rid.startswith("b")} == second.booked.keys()
        deadline = time.monotonic() + 10
        while requests_of(orjson.loads(path.read_bytes())) != live:
            assert time.monotonic() < deadline, "no snapshot of the final state within 10 s"
            time.sleep(0.05)
        url.process.kill()
        url.process.wait(timeout=10)
    with tracker(path) as url:
        assert get(url, "/loads") == before
        assert requests_of(get(url, "/dump")) == live


def test_a_peer_state_wins_over_the_snapshot(tmp_path: Path) -> None:
    # A snapshot of another state: one worker of another model, with one request.
    old = SlotTracker()
    old.register(5, "old", "default", 8, 0, 1)
    old.add("old", "default", "stale", 5, 0, [1, 2], 3)
    stale, fallback = tmp_path / "stale.json", tmp_path / "fallback.json"
    for path in (stale, fallback):
        path.write_bytes(encode(old.dump(taken_at=time.time())))
    dead = f"http://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        peer = stack.enter_context(running_service("slot_tracker"))
        register_workers(peer)
        load = Load(peer, "p", clients=3)
        drive(load, 0.4)
        copy = stack.enter_context(tracker(stale, "--peers", f"{dead},{peer}"))
        assert get(copy, "/loads") == get(peer, "/loads") == expected_loads(load.booked)
        assert get(copy, "/workers") == get(peer, "/workers")
        assert requests_of(get(copy, "/dump")) == requests_of(get(peer, "/dump"))
        assert f"the state of peer {peer} is newer" in copy.log_text()
    # No peer answers: the snapshot is loaded once the recovery timeout has passed.
    with tracker(fallback, "--peers", dead, "--recovery-timeout-secs", "0.3") as url:
        assert [(w["model_name"], w["worker_id"]) for w in get(url, "/workers")] == [("old", 5)]
        assert list(requests_of(get(url, "/dump"))) == ["stale"]


def test_an_unreadable_snapshot_stops_the_process_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "tracker.json"
    path.write_bytes(b'{"version": 1, "taken_at": 0, "partitions": [')
    result = subprocess.run([sys.executable, "-m", "dynamo_lite.slot_tracker", "--port", str(free_port()),
                             "--snapshot", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3  # dynamo_lite.web.server.STARTUP_FAILED_EXIT_STATUS
    assert f"snapshot {path} is not a slot tracker dump" in result.stderr
    assert "refusing to start" in result.stderr
