"""Slot tracker replicas (`--nats`) as processes, on a real NATS server on loopback.

Client threads run request lifecycles (add, prefill_complete, output_blocks, free), each call
to a random live replica, and keep what was acknowledged, as a gateway would: a call that got
no answer (its replica was killed) is sent again to another replica, and a lifecycle call that
overtook its `/add` on the way between replicas (404) is retried until the add has arrived.
After each disturbance (a replica SIGKILLed and a fresh one joining, the NATS server
restarted, a replica stopped with SIGSTOP) every replica must converge to `/loads` and `/dump`
requests equal to an in-process tracker fed exactly the acknowledged writes: nothing lost,
nothing doubled.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.nats_support import NatsServer
from support.reference_server import ServerURL, free_port, running_service
from support.slot_tracker_writes import Booked, expected_loads  # the acknowledged writes, and their /loads

from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.nats_replica import NatsReplication, NatsSettings
from dynamo_lite.slot_tracker.ops import Batch, Message
from dynamo_lite.slot_tracker.replication import Replica

MODEL = "m"
WORKERS = [(1, "default", 2), (2, "default", 1), (9, "team-b", 2)]  # id, tenant, dp size
PREFIXES = [[(p << 32) + i for i in range(n)] for p, n in enumerate([8, 32])]
CONVERGENCE_SECS = 20.0
OVERTAKEN_RETRY_SECS = 10.0  # a lifecycle call that overtook its /add: retried this long


def replica(nats_url: str, *flags: str) -> Any:
    return running_service("slot_tracker", "--nats", nats_url, "--nats-join-timeout-secs", "0.3",
                           "--log-level", "info", *flags)


def origin_of(url: ServerURL) -> int:
    match = re.search(r"replica ([0-9a-f]{16}) joined", url.log_text())
    assert match, url.log_text()
    return int(match.group(1), 16)


@dataclass
class Fleet:
    """The replicas the clients may call, changed as the test kills and starts them."""

    urls: list[str]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pick(self, rng: random.Random, avoid: str | None = None) -> str:
        with self.lock:
            choices = [url for url in self.urls if url != avoid] or list(self.urls)
            return rng.choice(choices)

    def set(self, urls: list[str]) -> None:
        with self.lock:
            self.urls = list(urls)


class Load:
    """`clients` threads, each with its own requests, until `stop` is set."""

    def __init__(self, fleet: Fleet, prefix: str, clients: int = 4) -> None:
        self.fleet = fleet
        self.prefix = prefix
        self.clients = clients
        self.booked: dict[str, Booked] = {}
        self.calls = 0
        self.retries = 0  # calls sent again: no answer, or overtaken
        self.failures: list[str] = []
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(number,), daemon=True)
                         for number in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self._threads), "a client thread is stuck"

    def _client(self, number: int) -> None:
        rng = random.Random(f"{self.prefix}{number}")
        mine: list[str] = []
        with httpx.Client(timeout=15) as client:
            index = 0
            while not self.stop.is_set():
                try:
                    if len(mine) < 4 or rng.random() < 0.3:
                        self._add(client, rng, f"{self.prefix}{number}-{index}", mine)
                        index += 1
                    else:
                        self._progress(client, rng, rng.choice(mine), mine)
                except AssertionError as error:
                    self.failures.append(str(error))
                    return
                self.calls += 1

    def _call(self, client: httpx.Client, rng: random.Random, path: str, body: dict[str, Any],
              ok: tuple[int, ...], *, overtaken: tuple[int, ...] = ()) -> int:
        """POST to a random replica until one answers a status in `ok`; another replica after no
        answer, any replica again after an `overtaken` status (the write it depends on is still
        on its way)."""
        deadline = time.monotonic() + OVERTAKEN_RETRY_SECS
        avoid = None
        first = True
        while True:
            url = self.fleet.pick(rng, avoid)
            try:
                response = client.post(f"{url}{path}", json=body)
            except httpx.TransportError:
                avoid = url  # killed: a gateway tries another replica
            else:
                if response.status_code in ok:
                    return response.status_code
                assert response.status_code in overtaken and time.monotonic() < deadline, (
                    f"{path} {body} -> {response.status_code} {response.text} from {url}")
                avoid = None
            if not first:
                time.sleep(0.01)
            first = False
            self.retries += 1

    def _add(self, client: httpx.Client, rng: random.Random, request_id: str, mine: list[str]) -> None:
        worker_id, tenant_id, dp_size = rng.choice(WORKERS)
        prefix = rng.choice(PREFIXES)
        hashes = prefix[: rng.randrange(len(prefix) + 1)] + [rng.getrandbits(63) for _ in range(rng.randrange(6))]
        booked = Booked(tenant_id, worker_id, rng.randrange(dp_size), hashes, rng.randrange(1, 4096))
        body = {"model_name": MODEL, "tenant_id": tenant_id, "request_id": request_id, "worker_id": worker_id,
                "dp_rank": booked.dp_rank, "sequence_hashes": hashes, "new_isl_tokens": booked.new_isl_tokens}
        # 409 only when a first attempt, unanswered, was applied after all: the id is this client's.
        self._call(client, rng, "/add", body, (201, 409))
        self.booked[request_id] = booked
        mine.append(request_id)

    def _progress(self, client: httpx.Client, rng: random.Random, request_id: str, mine: list[str]) -> None:
        booked = self.booked[request_id]
        step = rng.random()
        key = {"model_name": MODEL, "tenant_id": booked.tenant_id, "request_id": request_id}
        if booked.new_isl_tokens and step < 0.4:
            self._call(client, rng, "/prefill_complete", key, (200,), overtaken=(404,))
            booked.new_isl_tokens = 0
        elif step < 0.7:
            count = booked.output_blocks + rng.randrange(1, 3)
            self._call(client, rng, "/output_blocks", {**key, "output_blocks": count}, (200,), overtaken=(404,))
            booked.output_blocks = count
        else:
            self._call(client, rng, "/free", key, (200,))
            del self.booked[request_id]
            mine.remove(request_id)


def register_workers(url: str) -> None:
    for worker_id, tenant_id, dp_size in WORKERS:
        body = {"worker_id": worker_id, "model_name": MODEL, "tenant_id": tenant_id, "block_size": 16,
                "dp_start": 0, "dp_size": dp_size}
        assert httpx.post(f"{url}/register", json=body).status_code == 201


def expected(booked: dict[str, Booked]) -> tuple[list[dict[str, Any]], dict[str, tuple]]:
    """`/loads` and `/dump` requests of a tracker fed only the acknowledged writes."""
    loads = expected_loads(booked, WORKERS)
    requests = {request_id: (request.tenant_id, request.worker_id, request.dp_rank, request.hashes,
                             request.new_isl_tokens, request.output_blocks) for request_id, request in booked.items()}
    return loads, requests


def observed(url: str) -> tuple[list[dict[str, Any]], dict[str, tuple]]:
    loads = httpx.get(f"{url}/loads", timeout=30).json()
    dump = httpx.get(f"{url}/dump", timeout=30).json()
    requests = {request["request_id"]: (partition["tenant_id"], request["worker_id"], request["dp_rank"],
                                        request["sequence_hashes"], request["new_isl_tokens"],
                                        request["output_blocks"])
                for partition in dump["partitions"] for request in partition["requests"]}
    return loads, requests


def assert_converges(urls: list[ServerURL], want: tuple[list[dict[str, Any]], dict[str, tuple]]) -> float:
    """Poll every replica until its state is `want`; returns how long that took."""
    started = time.monotonic()
    while True:
        states = [observed(url) for url in urls]
        if all(state == want for state in states):
            return time.monotonic() - started
        if time.monotonic() - started > CONVERGENCE_SECS:
            for url, state in zip(urls, states):
                missing = want[1].keys() - state[1].keys()
                extra = state[1].keys() - want[1].keys()
                differ = [rid for rid in want[1].keys() & state[1].keys() if want[1][rid] != state[1][rid]]
                print(f"{url}: {len(missing)} missing {sorted(missing)[:5]}, {len(extra)} extra {sorted(extra)[:5]}, "
                      f"{len(differ)} differ {[(rid, want[1][rid], state[1][rid]) for rid in differ[:3]]}")
                print(url.log_text(5000))
                print(metrics(url, "replication_"))
            raise AssertionError(f"no convergence within {CONVERGENCE_SECS}s")
        time.sleep(0.1)


def metrics(url: str, part: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if part in line and not line.startswith("#") and "_bucket" not in line}


def counter(url: str, name: str) -> float:
    return metrics(url, name)[f"dynamo_lite_slot_tracker_replication_{name}_total"]


def report(load: Load, took: float, *urls: str) -> None:
    """What the run exercised, for `pytest -s`."""
    names = ("ops_applied", "gaps", "replays", "resyncs", "conflicts", "late_adds", "unconfirmed_answers")
    print(f"\n{load.calls} calls ({load.retries} sent again), {len(load.booked)} requests active; "
          f"converged {took:.2f}s after the load stopped")
    for url in urls:
        print("  " + ", ".join(f"{name} {counter(url, name):.0f}" for name in names))


@pytest.mark.process
@pytest.mark.nats
def test_a_replica_killed_under_load_is_replaced_by_one_that_joins_from_the_survivor(nats_server: NatsServer) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(replica(nats_server.url))
        register_workers(a)
        b = stack.enter_context(replica(nats_server.url))
        assert "joined" in b.log_text() and f"from replica {origin_of(a):016x}" in b.log_text()
        fleet = Fleet([a, b])
        with Load(fleet, "k") as load:
            time.sleep(1.5)
            fleet.set([a])
            b.process.kill()  # mid-load: calls in flight to it get no answer and go to a
            b.process.wait(10)
            c = stack.enter_context(replica(nats_server.url))  # joins from a, under load
            fleet.set([a, c])
            time.sleep(1.5)
        assert not load.failures, load.failures[:3]
        assert load.calls > 300 and len(load.booked) > 10
        report(load, assert_converges([a, c], expected(load.booked)), a, c)
        assert counter(c, "lost_ops") == counter(a, "lost_ops") == 0
        assert counter(a, "states_sent") == 2


@pytest.mark.process
@pytest.mark.nats
def test_the_nats_server_restarting_mid_run_loses_nothing(nats_server: NatsServer) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(replica(nats_server.url))
        register_workers(a)
        b = stack.enter_context(replica(nats_server.url))
        with Load(Fleet([a, b]), "n", clients=3) as load:
            time.sleep(1.0)
            nats_server.stop()  # writes go on: answered at once, sent after the reconnection
            time.sleep(0.5)
            nats_server.start()
            time.sleep(1.5)
        assert not load.failures, load.failures[:3]
        report(load, assert_converges([a, b], expected(load.booked)), a, b)
        for url in (a, b):
            assert metrics(url, "nats_reconnects")["dynamo_lite_nats_reconnects_total"] >= 1
            assert counter(url, "lost_ops") == 0


@pytest.mark.process
@pytest.mark.nats
def test_a_replica_stopped_for_seconds_catches_up(nats_server: NatsServer) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(replica(nats_server.url))
        register_workers(a)
        b = stack.enter_context(replica(nats_server.url))
        fleet = Fleet([a, b])
        with Load(fleet, "s", clients=3) as load:
            time.sleep(0.7)
            fleet.set([a])
            b.process.send_signal(signal.SIGSTOP)  # a slow consumer: reads nothing meanwhile
            try:
                time.sleep(3)
            finally:
                b.process.send_signal(signal.SIGCONT)
            fleet.set([a, b])
            time.sleep(0.7)
        assert not load.failures, load.failures[:3]
        report(load, assert_converges([a, b], expected(load.booked)), a, b)
        assert counter(b, "lost_ops") == 0


@pytest.mark.process
@pytest.mark.nats
def test_the_same_request_id_added_on_both_replicas_ends_as_one_request(nats_server: NatsServer) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(replica(nats_server.url))
        register_workers(a)
        b = stack.enter_context(replica(nats_server.url))
        # While NATS is down each replica takes its add; both meet once it is back.
        nats_server.stop()
        adds = {a: (1, 0, [11, 12], 100), b: (2, 0, [21], 200)}
        for url, (worker_id, dp_rank, hashes, tokens) in adds.items():
            body = {"model_name": MODEL, "request_id": "twice", "worker_id": worker_id, "dp_rank": dp_rank,
                    "sequence_hashes": hashes, "new_isl_tokens": tokens}
            assert httpx.post(f"{url}/add", json=body).status_code == 201
        nats_server.start()
        winner = min((a, b), key=origin_of)
        worker_id, dp_rank, hashes, tokens = adds[winner]
        want_request = {"twice": ("default", worker_id, dp_rank, hashes, tokens, 0)}
        deadline = time.monotonic() + CONVERGENCE_SECS
        while not (observed(a)[1] == observed(b)[1] == want_request):
            assert time.monotonic() < deadline, (observed(a)[1], observed(b)[1], want_request)
            time.sleep(0.1)
        assert observed(a) == observed(b)
        assert counter(a, "conflicts") + counter(b, "conflicts") >= 1
        assert httpx.post(f"{a}/free", json={"model_name": MODEL, "request_id": "twice"}).status_code == 200
        while observed(b)[1]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.process
@pytest.mark.nats
def test_the_first_replica_starts_from_its_snapshot_and_the_next_from_the_first(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    old = SlotTracker()
    old.register(5, MODEL, "default", 8, 0, 1)
    old.add(MODEL, "default", "kept", 5, 0, [1, 2], 3)
    path = tmp_path / "a.json"
    from dynamo_lite.slot_tracker.snapshot import encode

    path.write_bytes(encode(old.dump(taken_at=time.time())))
    ignored = tmp_path / "b.json"
    ignored.write_bytes(encode(SlotTracker().dump(taken_at=time.time())))
    with ExitStack() as stack:
        a = stack.enter_context(replica(nats_server.url, "--snapshot", str(path)))
        # b answers its writes at once, without waiting for NATS: they replicate all the same.
        b = stack.enter_context(replica(nats_server.url, "--snapshot", str(ignored),
                                        "--nats-publish-timeout-secs", "0"))
        assert list(observed(a)[1]) == list(observed(b)[1]) == ["kept"]
        assert httpx.post(f"{b}/free", json={"model_name": MODEL, "request_id": "kept"}).status_code == 200
        deadline = time.monotonic() + CONVERGENCE_SECS
        while observed(a)[1]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.process
def test_peers_and_nats_together_are_a_usage_error() -> None:
    result = subprocess.run([sys.executable, "-m", "dynamo_lite.slot_tracker", "--port", str(free_port()),
                             "--nats", "nats://127.0.0.1:1", "--peers", "http://127.0.0.1:1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--peers does not go with --nats" in result.stderr


# --- the shell in-process: a gap its origin cannot replay is healed by a whole state --------------


@contextmanager
def in_process(nats_url: str, count: int) -> Iterator[tuple[asyncio.AbstractEventLoop, list[NatsReplication]]]:
    loop = asyncio.new_event_loop()
    syncs = [NatsReplication(Replica(SlotTracker()), NatsSettings(nats_url, join_timeout_secs=0.3))
             for _ in range(count)]
    try:
        for sync in syncs:
            loop.run_until_complete(sync.start())
        yield loop, syncs
    finally:
        for sync in syncs:
            loop.run_until_complete(sync.stop())
        loop.close()


async def until(condition: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.process
@pytest.mark.nats
def test_a_gap_its_origin_cannot_replay_is_healed_by_a_resync(nats_server: NatsServer) -> None:
    with in_process(nats_server.url, 2) as (loop, (a, b)):

        async def scenario() -> None:
            a.replica.register(1, MODEL, "default", 16, 0, 1)
            await a.confirmed(201, None)
            a.replica.add(MODEL, "default", "seen", 1, 0, [1], 4)
            await a.confirmed(201, None)
            await until(lambda: "seen" in requests_of(b))
            dropped: list[Batch] = []

            def lose(message: Message) -> bool:
                if isinstance(message, Batch) and any(getattr(op, "request_id", "") == "lost" for op in message.ops):
                    dropped.append(message)  # b loses the batch of "lost"
                    a._log.clear()  # and a no longer has it to send again
                    return True
                return False

            b.drop = lose
            a.replica.add(MODEL, "default", "lost", 1, 0, [2], 4)
            await a.confirmed(201, None)
            await until(lambda: bool(dropped))
            a.replica.add(MODEL, "default", "after", 1, 0, [3], 4)
            await a.confirmed(201, None)
            await until(lambda: requests_of(b) == requests_of(a) == {"seen", "lost", "after"})
            assert b.counts.replays_requested == b.counts.resyncs == 1 and b.replica.counts.lost == 0
            assert not b.resyncing

        loop.run_until_complete(scenario())


def requests_of(sync: NatsReplication) -> set[str]:
    return {request_id for partition in sync.replica.tracker.partitions.values() for request_id in partition.requests}


@pytest.mark.process
@pytest.mark.nats
def test_a_write_too_large_for_one_nats_message_is_refused_before_it_is_applied(nats_server: NatsServer) -> None:
    with replica(nats_server.url) as a:
        register_workers(a)
        body = {"model_name": MODEL, "worker_id": 1, "dp_rank": 0}
        small = {**body, "request_id": "small", "sequence_hashes": [7] * 1000}
        assert httpx.post(f"{a}/add", json=small).status_code == 201
        # A million one-digit hashes fit the 2 MiB body, not one message of the test server (8 MB max_payload).
        response = httpx.post(f"{a}/add", json={**body, "request_id": "big", "sequence_hashes": [7] * 1_000_000})
        assert response.status_code == 413 and "max_payload" in response.json()["error"]
        assert list(observed(a)[1]) == ["small"]
