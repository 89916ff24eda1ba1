"""Indexer replicas on a real NATS server (`--nats`): several processes, one index.

Every test starts `nats-server -js` on loopback (tests/support/nats_support.py) and indexer processes
with `--nats`. The engines are the seeded fleets of tests/support/fake_engine.py (batches of several
events under one sequence number, several partitions, lower tiers) and the exact-bytes vLLM
publishers of dynamo_lite.kv_publishers (shared/kv_publishers.py) (restarts at seq 0, dropped messages with replay).

What they prove: whatever replica a write goes to, and whichever replicas are killed, replaced,
stopped or lagging meanwhile, every replica ends with the index that a single process without
NATS ends with when fed the same operations (and that the clean-domain model predicts): nothing
lost, nothing doubled.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from support.fake_engine import GROW, SHRINK, FakeEngine, Workload, events_document
from support.indexer_differential import (
    Mismatches,
    Service,
    compare_queries,
    distinct_ports,
    make_engines,
    ours_argv,
    wait_for_facts,
)
from support.nats_support import NatsServer
from support.reference_server import ServerURL, running_server

from dynamo_lite.kv_publishers import EnginePublisher, Stored, WireFormat

pytestmark = [pytest.mark.process, pytest.mark.nats]

CONVERGE_SECS = 30.0
QUERIES = 60


def replica_argv(port: int, nats: NatsServer, *extra: str) -> list[str]:
    return ours_argv(port, "--nats", nats.url, "--nats-snapshot-interval-secs", "1", *extra)


class Fleet:
    """Replica processes by name, plus one indexer without NATS fed the same operations."""

    def __init__(self, stack: ExitStack, nats: NatsServer) -> None:
        self.stack = stack
        self.nats = nats
        self.replicas: dict[str, ServerURL] = {}
        self.clients: dict[str, httpx.Client] = {}
        self._lock = threading.Lock()

    def start(self, name: str, *extra: str, ready: str = "/ready") -> Service:
        (port,) = distinct_ports(1)
        url = self.stack.enter_context(running_server(replica_argv(port, self.nats, *extra), port, ready,
                                                      timeout=60))
        client = self.stack.enter_context(httpx.Client(base_url=url, timeout=30))
        with self._lock:
            self.replicas[name], self.clients[name] = url, client
        return Service(name, url, client, False)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        with self._lock:
            url = self.replicas.pop(name)
            self.clients.pop(name)
        url.process.send_signal(sig)
        url.process.wait(timeout=30)

    def services(self) -> list[Service]:
        with self._lock:
            return [Service(name, url, self.clients[name], False) for name, url in self.replicas.items()]

    def write(self, rng: random.Random, path: str, body: Any, ok: tuple[int, ...], *,
              after_retry: tuple[int, ...] = ()) -> httpx.Response:
        """POST to a random live replica until one answers `ok`. A replica killed under the
        request, or a NATS server away (503), means: try again, maybe elsewhere. A retry may
        find the first attempt applied (`after_retry`: e.g. 409 for a registration)."""
        retried = False
        deadline = time.monotonic() + CONVERGE_SECS
        while True:
            with self._lock:
                name = rng.choice(sorted(self.replicas))
                client = self.clients[name]
            try:
                response = client.post(path, json=body)
            except httpx.TransportError:
                response = None
            if response is not None:
                if response.status_code in ok or (retried and response.status_code in after_retry):
                    return response
                assert response.status_code == 503, f"{name}: POST {path} -> {response.status_code} {response.text}"
            assert time.monotonic() < deadline, f"POST {path}: no replica took it within {CONVERGE_SECS}s"
            retried = True
            time.sleep(0.1)


@contextmanager
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, Service]]:
    """A NATS server, no replica yet, and the single-process indexer to compare with."""
    with ExitStack() as stack:
        nats = NatsServer(tmp_path / "nats")
        nats.start()
        stack.callback(nats.stop)
        (port,) = distinct_ports(1)
        single_url = stack.enter_context(running_server(ours_argv(port), port))
        single = Service("single process", single_url, stack.enter_context(httpx.Client(base_url=single_url,
                                                                                           timeout=30)), False)
        yield Fleet(stack, nats), single


@contextmanager
def seeded_engines(seed: int) -> Iterator[list[FakeEngine]]:
    """The engines of `make_engines(seed)` (two partitions, several wire layouts), closed after."""
    context = zmq.Context()
    engines = make_engines(seed, context)
    try:
        yield engines
    finally:
        for engine in engines:
            engine.close()
        context.term()


def post_ok(service: Service, path: str, body: Any, status: int) -> None:
    response = service.client.post(path, json=body)
    assert response.status_code == status, f"{service.name}: POST {path} -> {response.status_code} {response.text}"


def worker_view(service: Service) -> list[dict[str, Any]]:
    """/workers without the ZMQ listener's own counters (each process has its own)."""
    workers = service.client.get("/workers").json()
    for worker in workers:
        for rank in worker["ranks"]:
            rank.pop("listener", None)
    return workers


def wait_until(probe: Callable[[], Any], done: Callable[[Any], bool], what: str,
               timeout: float = CONVERGE_SECS) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout:.0f}s; last: {value!r}"
        time.sleep(0.1)


def metric(service: Service, name: str) -> float:
    for line in service.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{service.name}: no metric {name}")


def assert_same_index(replicas: list[Service], single: Service, workload: Workload, rng: random.Random,
                      where: str) -> None:
    """Every replica converges on the model's facts and on the single process's /workers and
    query answers."""
    expected = workload.expected_facts()
    wait_for_facts(single, expected, timeout=CONVERGE_SECS)
    for replica in replicas:
        wait_for_facts(replica, expected, timeout=CONVERGE_SECS)
    reference_workers = worker_view(single)
    for replica in replicas:
        wait_until(lambda replica=replica: worker_view(replica), lambda view: view == reference_workers,
                   f"{where}: {replica.name}'s /workers equal to the single process's")
    mismatches = Mismatches()
    for key in workload.partitions:
        compare_queries([single, *replicas], workload.sample_queries(key, QUERIES), workload, mismatches, where, rng)
    mismatches.check(f"({where})")


class RoutedLoad:
    """A gateway reporting routing decisions (`/routed`) and querying, in a thread, the whole
    time: to any live replica, and once acknowledged to the single process too."""

    def __init__(self, fleet: Fleet, single: Service, model_name: str, seed: int) -> None:
        self.fleet, self.single, self.model_name = fleet, single, model_name
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                prefix = [self.rng.getrandbits(63) for _ in range(self.rng.randint(1, 3))]
                body = {"model_name": self.model_name, "instance_id": 900 + self.rng.randint(0, 2),
                        "block_hashes": prefix + [self.rng.getrandbits(63) for _ in range(self.rng.randint(0, 6))]}
                self.fleet.write(self.rng, "/routed", body, (202,))
                post_ok(self.single, "/routed", body, 200)
                self.sent += 1
                with self.fleet._lock:
                    client = self.rng.choice(list(self.fleet.clients.values()))
                try:
                    client.post("/query_by_hash", json={"model_name": self.model_name, "block_hashes": prefix})
                except httpx.TransportError:
                    pass  # that replica was just killed
        except BaseException as error:  # noqa: BLE001 - reported by `join`
            self.error = error

    def __enter__(self) -> RoutedLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        if self.error is not None and exc[0] is None:
            raise self.error


def feed(fleet: Fleet, single: Service, workload: Workload, posted: list[FakeEngine], subscribed: list[FakeEngine],
         rng: random.Random, ops: int, weights: dict[str, int]) -> None:
    """Engines publish `ops` operations: the subscribed ones over ZMQ (every replica and the
    single process listen), the others' events posted as one /events document to a replica
    and, once acknowledged, to the single process."""
    workload.run(ops, weights)
    for engine in subscribed:
        engine.take_router_events()
    document = events_document((e.model_name, e.tenant_id, e.block_size, e.take_router_events()) for e in posted)
    if any(section["events"] for section in document.values()):
        answer = fleet.write(rng, "/events", document, (202,)).json()
        assert answer["status"] == "accepted" and answer["stream_sequence"] > 0
        report = single.client.post("/events", json=document).json()
        assert (report["rejected"], report["skipped"], report["gap_count"]) == (0, 0, 0), report


def test_replicas_killed_and_replaced_under_load_agree_with_a_single_process(tmp_path: Path) -> None:
    rng = random.Random(7)
    with seeded_engines(61) as engines:
        subscribed, posted = engines[::2], engines[1::2]
        with fleet(tmp_path) as (fleet_, single):
            for name in "ABC":
                fleet_.start(name)
            for engine in subscribed:
                fleet_.write(rng, "/register", engine.our_registration(subscribe=True), (201,))
                post_ok(single, "/register", engine.our_registration(subscribe=True), 201)
            for engine in posted:
                fleet_.write(rng, "/register", engine.our_registration(subscribe=False), (201,))
                post_ok(single, "/register", engine.our_registration(subscribe=False), 201)
            for engine in subscribed:
                engine.wait_for_subscribers(4)  # three replicas and the single process
            workload = Workload(rng, engines)
            with RoutedLoad(fleet_, single, engines[0].model_name, 8) as routed:
                feed(fleet_, single, workload, posted, subscribed, rng, 150, GROW)
                fleet_.kill("C")  # mid-run: the others go on publishing what the engines send
                feed(fleet_, single, workload, posted, subscribed, rng, 80, SHRINK)
                # The feed can take less than the 1 s snapshot interval: wait for a snapshot
                # before starting D, which must start from one.
                wait_until(lambda: metric(fleet_.services()[0], "dynamo_lite_indexer_replica_snapshot_sequence"),
                           lambda sequence: sequence > 0, "a snapshot written")
                d = fleet_.start("D")  # a fresh replica: the newest snapshot, then the stream after it
                feed(fleet_, single, workload, posted, subscribed, rng, 120, GROW)
                fleet_.kill("A", signal.SIGTERM)
                feed(fleet_, single, workload, posted, subscribed, rng, 60, SHRINK)
            assert routed.sent > 10
            replicas = fleet_.services()
            assert [r.name for r in replicas] == ["B", "D"]
            assert_same_index(replicas, single, workload, rng, "after a SIGKILL, a new replica and a SIGTERM")
            assert metric(d, "dynamo_lite_indexer_replica_snapshot_sequence") > 0, "D started from a snapshot"
            # Every engine batch is in the stream once, whoever published it.
            duplicates = sum(metric(r, "dynamo_lite_indexer_replica_duplicates_total") for r in replicas)
            assert duplicates > 0


def test_a_nats_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(11)
    with seeded_engines(62) as engines:
        subscribed, posted = engines[:3], engines[3:]
        with fleet(tmp_path) as (fleet_, single):
            replicas = [fleet_.start(name) for name in "AB"]
            for engine in engines:
                body = engine.our_registration(subscribe=engine in subscribed)
                fleet_.write(rng, "/register", body, (201,))
                post_ok(single, "/register", body, 201)
            for engine in subscribed:
                engine.wait_for_subscribers(3)
            workload = Workload(rng, engines)
            feed(fleet_, single, workload, posted, subscribed, rng, 100, GROW)
            fleet_.nats.stop()
            # While NATS is away, the engines go on publishing: the replicas' listeners hold
            # the batches and retry; posted documents are refused (503) until it is back.
            workload.run(40, GROW)
            threading.Timer(1.5, fleet_.nats.start).start()
            for engine in subscribed:
                engine.take_router_events()
            document = events_document((e.model_name, e.tenant_id, e.block_size, e.take_router_events())
                                       for e in posted)
            fleet_.write(rng, "/events", document, (202,))
            post_ok(single, "/events", document, 200)
            feed(fleet_, single, workload, posted, subscribed, rng, 60, SHRINK)
            assert_same_index(replicas, single, workload, rng, "after a NATS restart")
            assert all(metric(r, "dynamo_lite_nats_reconnects_total") >= 1 for r in replicas)


def test_a_replica_down_longer_than_the_retention_comes_back_from_the_snapshot(tmp_path: Path) -> None:
    rng = random.Random(12)
    flags = ("--nats-retention-secs", "3", "--nats-snapshot-interval-secs", "1")
    with seeded_engines(63) as engines:
        with fleet(tmp_path) as (fleet_, single):
            fleet_.start("A", *flags)
            b = fleet_.start("B", *flags, "--nats-replica-name", "indexer-b")
            for engine in engines:
                fleet_.write(rng, "/register", engine.our_registration(subscribe=False), (201,))
                post_ok(single, "/register", engine.our_registration(subscribe=False), 201)
            workload = Workload(rng, engines)
            feed(fleet_, single, workload, engines, [], rng, 100, GROW)
            fleet_.kill("B")
            feed(fleet_, single, workload, engines, [], rng, 60, SHRINK)
            time.sleep(4)  # longer than the retention: what B missed has left the stream
            feed(fleet_, single, workload, engines, [], rng, 60, GROW)
            time.sleep(1.5)  # A snapshots the last writes too
            b = fleet_.start("B", *flags, "--nats-replica-name", "indexer-b")  # same consumer name
            assert_same_index(fleet_.services(), single, workload, rng, "B back after the retention")
            assert metric(b, "dynamo_lite_indexer_replica_skipped_sequences_total") == 0


def test_a_stopped_replica_catches_up_and_says_so_on_ready(tmp_path: Path) -> None:
    """A slow consumer: SIGSTOP under load, then SIGCONT. It catches up on its own and ends with
    the same index as everyone; `/ready` is 200 again (the 503 while behind is
    `test_indexer_replication.test_ready_follows_the_lag`: catching up here takes milliseconds)."""
    rng = random.Random(13)
    with seeded_engines(64) as engines:
        with fleet(tmp_path) as (fleet_, single):
            fleet_.start("A")
            slow = fleet_.start("S", "--nats-ready-max-lag", "2")
            for engine in engines:
                fleet_.write(rng, "/register", engine.our_registration(subscribe=False), (201,))
                post_ok(single, "/register", engine.our_registration(subscribe=False), 201)
            workload = Workload(rng, engines)
            process = fleet_.replicas["S"].process
            process.send_signal(signal.SIGSTOP)
            try:
                fleet_.replicas.pop("S")  # writes go to A meanwhile
                for _ in range(20):
                    feed(fleet_, single, workload, engines, [], rng, 10, GROW)
                # Many small writes: more than one fetch of the stream behind.
                for index in range(600):
                    body = {"model_name": engines[0].model_name, "instance_id": 990, "block_hashes": [index]}
                    fleet_.write(rng, "/routed", body, (202,))
                    post_ok(single, "/routed", body, 200)
            finally:
                process.send_signal(signal.SIGCONT)
            fleet_.replicas["S"] = slow.url  # type: ignore[assignment]
            wait_until(lambda: (slow.client.get("/ready").status_code, metric(slow, "dynamo_lite_indexer_replica_lag")),
                       lambda state: state == (200, 0), "S ready and caught up")
            assert_same_index(fleet_.services(), single, workload, rng, "after SIGSTOP / SIGCONT")


def test_engine_restarts_and_lost_batches_reach_every_replica_once(tmp_path: Path) -> None:
    """Exact vLLM bytes: every replica listens to the engine; a restart at seq 0 is one reset in
    the stream (not one per replica), and a batch one replica lost arrives through the others or
    through the replay."""
    rng = random.Random(14)
    context = zmq.Context()
    with fleet(tmp_path) as (fleet_, single), EnginePublisher(WireFormat.VLLM, context=context) as engine:
        replicas = [fleet_.start(name) for name in "ABC"]
        body = {"instance_id": 5, "model_name": "m", "block_size": 4, "endpoint": engine.endpoint,
                "replay_endpoint": engine.replay_endpoint}
        fleet_.write(rng, "/register", body, (201,))
        post_ok(single, "/register", body, 201)
        engine.wait_for_subscribers(4)

        def store(start: int, end: int, parent: int | None) -> Stored:
            hashes = list(range(1000 + start, 1000 + end))
            return Stored(block_hashes=hashes, parent_block_hash=parent,
                          token_ids=list(range(4 * start, 4 * end)), block_size=4)

        engine.publish([store(0, 3, None), store(3, 4, 1002)])  # two events, one seq
        engine.publish([store(4, 6, 1003)])
        engine.restart()
        engine.publish([store(0, 2, None)])
        engine.drop_next(1)  # lost by every subscriber: the replay brings it back
        engine.publish([store(2, 3, 1001)])
        engine.publish([store(3, 5, 1002)])
        views = [wait_until(lambda r=r: worker_view(r), lambda v: v and v[0]["ranks"][0]["blocks"] == 5,
                            f"{r.name} holds the 5 blocks stored since the restart") for r in [single, *replicas]]
        assert all(view == views[0] for view in views)
        published = sum(metric(r, "dynamo_lite_indexer_replica_published_total") for r in replicas)
        applied = metric(replicas[0], "dynamo_lite_indexer_replica_applied_total")
        assert published == applied  # each message once in the stream, however many replicas sent it
        assert sum(metric(r, "dynamo_lite_indexer_replica_duplicates_total") for r in replicas) > 0


def test_reset_state_purges_the_stream_and_the_snapshot(tmp_path: Path) -> None:
    rng = random.Random(15)
    with fleet(tmp_path) as (fleet_, _single):
        a = fleet_.start("A")
        fleet_.write(rng, "/register", {"instance_id": 1, "model_name": "m", "block_size": 4}, (201,))
        fleet_.write(rng, "/routed", {"model_name": "m", "instance_id": 1, "block_hashes": [1, 2]}, (202,))
        wait_until(lambda: metric(a, "dynamo_lite_indexer_replica_snapshot_sequence"), lambda s: s >= 2,
                   "a snapshot of both writes")
        fleet_.kill("A", signal.SIGTERM)
        kept = fleet_.start("B")
        assert [w["instance_id"] for w in worker_view(kept)] == [1]
        fleet_.kill("B", signal.SIGTERM)
        fresh = fleet_.start("C", "--reset-state")
        assert worker_view(fresh) == []
        # Sequences go on after a purge: nothing before it is applied, by C or by a later replica.
        assert metric(fresh, "dynamo_lite_indexer_replica_applied_total") == 0
        assert worker_view(fleet_.start("D")) == []


def test_replica_answers_are_the_documented_ones(tmp_path: Path) -> None:
    """202 with the stream sequence while NATS is there, 503 JSON errors while it is away (for
    every write route), each listed in openapi/indexer.yaml with the schema the body matches."""
    import jsonschema_rs  # schemathesis' validator
    import yaml

    document = yaml.safe_load((Path(__file__).resolve().parents[1] / "openapi" / "indexer.yaml").read_text())

    def check(path: str, response: httpx.Response) -> None:
        declared = document["paths"][path]["post"]["responses"][str(response.status_code)]
        if "$ref" in declared:
            declared = document["components"]["responses"][declared["$ref"].rsplit("/", 1)[1]]
        schema = declared["content"]["application/json"]["schema"]
        jsonschema_rs.validate({**schema, "components": document["components"]}, response.json())

    events = {"m:default": {"block_size": 4, "events": [{"worker_id": 1, "event": {"event_id": 0, "data": {
        "stored": {"parent_hash": None, "blocks": [{"block_hash": 1, "tokens_hash": 11}]}}}}]}}
    writes = [("/register", {"instance_id": 1, "model_name": "m", "block_size": 4}, 201),
              ("/events", events, 202),
              ("/routed", {"model_name": "m", "instance_id": 2, "block_hashes": [11]}, 202),
              ("/unregister", {"instance_id": 2, "model_name": "m"}, 200)]
    with fleet(tmp_path) as (fleet_, _single):
        replica = fleet_.start("A")
        for path, body, status in writes:
            response = replica.client.post(path, json=body)
            assert response.status_code == status, (path, response.text)
            check(path, response)
        fleet_.nats.stop()
        wait_until(lambda: metric(replica, "dynamo_lite_nats_connected"), lambda up: up == 0, "disconnected")
        assert replica.client.get("/health").status_code == 200
        for path, body, _status in writes:
            response = replica.client.post(path, json=body)
            assert response.status_code == 503, (path, response.text)
            assert "not connected to the NATS server" in response.json()["error"]
            check(path, response)
        # Queries still answer from the index the replica has.
        answer = replica.client.post("/query_by_hash", json={"model_name": "m", "block_hashes": [11]}).json()
        assert answer["scores"] == {"1": {"0": 4}}


def test_replicas_started_with_the_same_workers_register_them_once(tmp_path: Path) -> None:
    context = zmq.Context()
    with fleet(tmp_path) as (fleet_, _single), EnginePublisher(WireFormat.SGLANG, context=context) as engine:
        flags = ("--workers", f"5={engine.endpoint}", "--block-size", "4", "--model-name", "m")
        replicas = [fleet_.start(name, *flags) for name in "AB"]
        engine.wait_for_subscribers(2)
        engine.publish([Stored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4)])
        for replica in replicas:
            view = wait_until(lambda r=replica: worker_view(r), lambda v: v and v[0]["ranks"][0]["blocks"] == 2,
                              f"{replica.name} holds the engine's 2 blocks")
            assert [(w["instance_id"], w["ranks"][0]["registered"], w["ranks"][0]["endpoint"]) for w in view] == [
                (5, True, engine.endpoint)]
    context.term()


def test_a_nats_server_back_without_its_store_is_rebuilt_and_replicas_go_on(tmp_path: Path) -> None:
    """The stream, the consumers and the snapshots are gone: the replicas create them again,
    keep the index they hold, and apply the new stream from its start, in agreement."""
    rng = random.Random(16)
    with seeded_engines(65) as engines, fleet(tmp_path) as (fleet_, single):
        replicas = [fleet_.start(name) for name in "AB"]
        for engine in engines:
            fleet_.write(rng, "/register", engine.our_registration(subscribe=False), (201,))
            post_ok(single, "/register", engine.our_registration(subscribe=False), 201)
        workload = Workload(rng, engines)
        feed(fleet_, single, workload, engines, [], rng, 80, GROW)
        assert_same_index(replicas, single, workload, rng, "before the NATS store is lost")
        fleet_.nats.restart(wipe=True)
        # Counted once the new server is up: a periodic snapshot still on its way to the old one
        # when it stopped is not the one written of the loss (a replica started on its count
        # alone found no snapshot, and never got the history).
        written = [metric(replica, "dynamo_lite_indexer_replica_snapshots_written_total") for replica in replicas]
        # A quiet fleet: nothing is written after the loss. The survivors notice it and put what
        # they hold into the object store at once, so a replica started now gets the history
        # (before, the first snapshot waited for the first new message).
        wait_until(lambda: [metric(replica, "dynamo_lite_indexer_replica_snapshots_written_total")
                            for replica in replicas],
                   lambda now: sum(now) > sum(written), "a survivor snapshotted the history the stream lost")
        early = fleet_.start("D")
        assert_same_index([*replicas, early], single, workload, rng, "a replica started on a quiet fleet after the loss")
        replicas.append(early)
        feed(fleet_, single, workload, engines, [], rng, 60, SHRINK)
        assert_same_index(replicas, single, workload, rng, "after the NATS store was lost")
        # What the replicas held before the loss is in no stream any more, only in the snapshots
        # they write of the new one (its sequence was reset to 0 with the loss).
        wait_until(lambda: max(metric(replica, "dynamo_lite_indexer_replica_snapshot_sequence") for replica in replicas),
                   lambda sequence: sequence > 0, "a snapshot of the new stream written")
        late = fleet_.start("C")  # from the snapshot the survivors write of what they hold
        assert_same_index([*replicas, late], single, workload, rng, "a replica started after the loss")
