"""Indexer scenarios over HTTP: `POST /query_by_hash` against a tree built from the Mooncake
trace (at ~10k and ~1M indexed (block, worker) pairs) and the `/events` ingest rate. Memory is
measured by bench/memory.py, with both sides fed the same paced stream: this fill posts to ours
and bursts into the reference, whose RSS right after a burst holds the heap that buffered it.

Ours gets each stored event as a RouterEvent through `POST /events`; the reference gets the
same event as a vLLM msgpack batch from a ZMQ publisher per worker (bench/zmq_feed.py) and
applies it asynchronously, so after each fill every worker publishes a sentinel block and the
fill waits until a query scores all workers for it (ZMQ keeps order per socket).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Collection, Iterable
from pathlib import Path

import httpx
import orjson
import zmq

from . import profiling
from .http_post import Connection, post_request
from .index_data import (
    EVENT_BLOCKS,
    WORKERS,
    EventIds,
    IngestStream,
    StoredEvent,
    TraceFill,
    events_document,
    load_trace,
    query_body,
    query_locals,
    sentinel_event,
)
from .runner import CONNECTIONS, HEAVY_CONNECTIONS, Load, Results, measure_point, progress
from .servers import Server, running_servers
from .slot_tracker_http import set_canned
from .zmq_feed import Publisher

MODEL = "bench"
INGEST_MODEL = "ingest"
FILL_EVENTS_PER_POST = 64
INGEST_CONNECTIONS = 4
INGEST_VARIANTS = {"ours": (1, 16), "stub": (1, 16)}  # stored events per POST
SYNC_TIMEOUT_S = 600.0
JSON = {"Content-Type": "application/json"}

SCENARIOS = ("query_by_hash", "scale_query_by_hash", "events")


class ReferenceFeed:
    """One ZMQ publisher per worker, registered with the reference indexer."""

    _salt = 0

    def __init__(self, context: zmq.Context, url: str, model: str, worker_ids: Iterable[int]) -> None:
        self.url = url
        self.model = model
        self.publishers = {worker: Publisher(context, worker) for worker in worker_ids}
        with httpx.Client(base_url=url, timeout=30) as client:
            for worker, publisher in self.publishers.items():
                _expect(client.post("/register", json={
                    "instance_id": worker, "endpoint": publisher.endpoint, "model_name": model,
                    "block_size": 16, "routing_group": "default", "dp_rank": 0}), 201)
        for publisher in self.publishers.values():
            publisher.wait_subscribed()

    def publish(self, payloads: Iterable[tuple[int, bytes]]) -> None:
        for worker, payload in payloads:
            self.publishers[worker].send(payload)

    def sync(self) -> list[StoredEvent]:
        """Publish a fresh sentinel per worker and wait until the reference has applied it
        (hence everything published before). Returns the sentinels, for ours to get them too."""
        ReferenceFeed._salt += 1
        sentinels = [sentinel_event(worker, ReferenceFeed._salt) for worker in self.publishers]
        self.publish((event.worker, event.zmq_payload()) for event in sentinels)
        body = query_body(self.model, sentinels[0].locals)
        wanted = {str(worker) for worker in self.publishers}
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while True:
                answer = _expect(client.post("/query_by_hash", content=body, headers=JSON), 200).json()
                if wanted <= set(answer.get("scores", {})):
                    return sentinels
                if time.monotonic() > deadline:
                    raise TimeoutError("the reference did not apply the published events "
                                       f"within {SYNC_TIMEOUT_S:.0f} s")
                time.sleep(0.005)

    def close(self, unregister: bool) -> None:
        if unregister:
            with httpx.Client(base_url=self.url, timeout=60) as client:
                for worker in self.publishers:
                    _expect(client.post("/unregister", json={"instance_id": worker, "model_name": self.model,
                                                             "routing_group": "default", "dp_rank": 0}), 200)
        for publisher in self.publishers.values():
            publisher.close()


def _expect(response: httpx.Response, status: int) -> httpx.Response:
    if response.status_code != status:
        raise RuntimeError(f"{response.request.method} {response.request.url} -> {response.status_code} "
                           f"{response.text[:300]}")
    return response


def post_to_ours(url: str, model: str, events: list[StoredEvent], ids: EventIds, per_post: int) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, len(events), per_post):
            chunk = events[start:start + per_post]
            report = _expect(client.post("/events", content=events_document(model, chunk, ids), headers=JSON),
                             200).json()
            if report["applied"] != len(chunk) or report["rejected"] or report["gap_count"]:
                raise RuntimeError(f"ours did not apply a fill document cleanly: {str(report)[:500]}")


def unregister_ours(url: str, model: str, worker_ids: Iterable[int]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for worker in worker_ids:
            _expect(client.post("/unregister", json={"instance_id": worker, "model_name": model}), 200)


def run(results: Results, selected: Collection[str], ref_python: Path) -> None:
    if not any(name in selected for name in SCENARIOS):
        return
    settings = results.settings
    progress("indexer: starting ours, the reference and the stub (server CPU 0)")
    context = zmq.Context()
    with running_servers("indexer", ref_python) as servers, \
            tempfile.TemporaryDirectory(prefix="bench_indexer_") as scratch:
        ours, reference = servers["ours"], servers["reference"]
        worker_ids = list(range(1, WORKERS + 1))
        trace = load_trace()
        fill = TraceFill(trace)
        ids = EventIds()
        feed = ReferenceFeed(context, reference.url, MODEL, worker_ids)
        query_file = Path(scratch) / "query_by_hash.json"
        query_file.write_bytes(query_body(MODEL, query_locals(trace)))
        load = Load("post_static.lua", ["/query_by_hash", str(query_file)])

        def grow(target: int) -> str:
            started = time.monotonic()
            events = list(fill.events(target))
            post_to_ours(ours.url, MODEL, events, ids, FILL_EVENTS_PER_POST)
            feed.publish((event.worker, event.zmq_payload()) for event in events)
            post_to_ours(ours.url, MODEL, feed.sync(), ids, FILL_EVENTS_PER_POST)
            progress(f"indexed {fill.pairs:,} (block, worker) pairs from {fill.requests_used:,} trace requests "
                     f"on ours and the reference in {time.monotonic() - started:.1f} s")
            _compare_answers(results, servers, query_file.read_bytes(), f"{fill.pairs:,} pairs")
            return f"{fill.pairs / 1e6:.2f}M pairs" if fill.pairs >= 1e6 else f"{fill.pairs / 1e3:.1f}k pairs"

        if "scale_query_by_hash" in selected:
            label = grow(settings.small_index_pairs)
            measure_point(results, "scale_query_by_hash", label, servers, ("ours", "reference"), (HEAVY_CONNECTIONS,),
                          settings.scaling_repetitions, lambda role, run_id: load)
        if any(name in selected for name in ("query_by_hash", "scale_query_by_hash")):
            label = grow(settings.large_index_pairs)
            if "query_by_hash" in selected:
                with httpx.Client(base_url=ours.url, timeout=30) as client:
                    set_canned(servers["stub"], "/query_by_hash",
                               client.post("/query_by_hash", content=query_file.read_bytes(), headers=JSON))
                measure_point(results, "query_by_hash", label, servers, ("ours", "reference", "stub"), CONNECTIONS,
                              settings.repetitions, lambda role, run_id: load)
                if settings.profile:
                    profiling.profile_ours(results, "query_by_hash", ours, load, HEAVY_CONNECTIONS, settings.duration_s)
            elif "scale_query_by_hash" in selected:
                measure_point(results, "scale_query_by_hash", label, servers, ("ours", "reference"),
                              (HEAVY_CONNECTIONS,), settings.scaling_repetitions, lambda role, run_id: load)
        feed.close(unregister=False)
        if "events" in selected:
            _ingest(results, servers, context)
    context.term()


def _compare_answers(results: Results, servers: dict[str, Server], body: bytes, when: str) -> None:
    """Same state, same answer: a check that both indexers hold the tree the suite meant."""
    answers = {}
    for role in ("ours", "reference"):
        answer = httpx.post(servers[role].url + "/query_by_hash", content=body, headers=JSON, timeout=30)
        answers[role] = _expect(answer, 200).json().get("scores")
    if answers["ours"] != answers["reference"]:
        results.note(f"at {when} the benchmark query's scores differ: ours {answers['ours']} "
                     f"reference {answers['reference']}")


def _ingest(results: Results, servers: dict[str, Server], context: zmq.Context) -> None:
    """Blocks per second of fresh 64-block stored events from 16 workers: ours and the stub
    over HTTP (INGEST_CONNECTIONS connections, each owning a quarter of the workers so every
    worker's events stay in order), the reference over ZMQ. Workers are unregistered after
    each run, so every run starts from the same index."""
    settings = results.settings
    blocks = settings.ingest_blocks - settings.ingest_blocks % EVENT_BLOCKS
    _can_events_answer(servers)
    for rep in range(1, settings.repetitions + 1):
        started = time.monotonic()
        stream_events = list(IngestStream(list(range(1, WORKERS + 1)), stream=rep).events(blocks))
        payloads = [(event.worker, event.zmq_payload()) for event in stream_events]
        progress(f"ingest rep {rep}: {len(stream_events):,} events of {EVENT_BLOCKS} blocks generated "
                 f"in {time.monotonic() - started:.1f} s")
        for role in ("ours", "reference", "stub"):
            if role == "reference":
                worker_base = 100 * rep
                feed = ReferenceFeed(context, servers[role].url, INGEST_MODEL,
                                     [worker_base + w for w in range(1, WORKERS + 1)])
                shifted = [(worker_base + worker, payload) for worker, payload in payloads]
                began = time.perf_counter()
                feed.publish(shifted)
                feed.sync()
                seconds = time.perf_counter() - began
                feed.close(unregister=True)
                _record_ingest(results, role, "1 event per ZMQ batch", rep, blocks, seconds)
                continue
            for variant, per_post in enumerate(INGEST_VARIANTS[role]):
                worker_base = 100 * (rep * 4 + variant)
                seconds = _post_stream(servers[role].url, stream_events, worker_base, per_post, check=role == "ours")
                if role == "ours":
                    unregister_ours(servers[role].url, INGEST_MODEL, [worker_base + w for w in range(1, WORKERS + 1)])
                detail = f"{per_post} event{'s' if per_post > 1 else ''} per POST, {INGEST_CONNECTIONS} connections"
                _record_ingest(results, role, detail, rep, blocks, seconds)


def _record_ingest(results: Results, role: str, detail: str, rep: int, blocks: int, seconds: float) -> None:
    rate = blocks / seconds
    results.ingest.append({"role": role, "detail": detail, "rep": rep, "blocks": blocks, "seconds": seconds,
                           "blocks_per_s": rate})
    progress(f"{'events':<22} {detail:<40} rep {rep} {role:<9} {rate:>12,.0f} blocks/s")


def _can_events_answer(servers: dict[str, Server]) -> None:
    """The stub answers /events with ours' report for a one-event document."""
    event = next(IngestStream([99_999], stream=0).events(EVENT_BLOCKS))
    with httpx.Client(base_url=servers["ours"].url, timeout=30) as client:
        answer = client.post("/events", content=events_document(INGEST_MODEL, [event], EventIds()), headers=JSON)
        set_canned(servers["stub"], "/events", _expect(answer, 200))
    unregister_ours(servers["ours"].url, INGEST_MODEL, [99_999])


def build_lanes(url: str, model: str, events: list[StoredEvent], worker_base: int, per_post: int,
                lanes: int = INGEST_CONNECTIONS) -> list[list[bytes]]:
    """Prepared POST /events requests per connection; each connection owns a subset of the
    workers, so each worker's events stay in order."""
    ids = EventIds()
    requests: list[list[bytes]] = [[] for _ in range(lanes)]
    pending: list[list[StoredEvent]] = [[] for _ in range(lanes)]
    for event in events:
        moved = StoredEvent(worker_base + event.worker, event.parent, event.exts, event.locals, event.tokens)
        lane = event.worker % lanes
        pending[lane].append(moved)
        if len(pending[lane]) == per_post:
            requests[lane].append(post_request(url, "/events", events_document(model, pending[lane], ids)))
            pending[lane] = []
    for lane, rest in enumerate(pending):
        if rest:
            requests[lane].append(post_request(url, "/events", events_document(model, rest, ids)))
    return requests


def send_lanes(url: str, lanes: list[list[bytes]]) -> tuple[float, float, list[tuple[int, bytes]]]:
    """Send every lane over its own connection at once: (perf_counter start, end, answers)."""
    answers: list[list[tuple[int, bytes]]] = [[] for _ in lanes]
    connections = [Connection(url, timeout=120) for _ in lanes]
    barrier = threading.Barrier(len(lanes) + 1)

    def send_all(lane: int) -> None:
        barrier.wait()
        answers[lane] = [connections[lane].send(request) for request in lanes[lane]]

    threads = [threading.Thread(target=send_all, args=(lane,)) for lane in range(len(lanes))]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    ended = time.perf_counter()
    for connection in connections:
        connection.close()
    return began, ended, [answer for lane in answers for answer in lane]


def _post_stream(url: str, events: list[StoredEvent], worker_base: int, per_post: int, *, check: bool) -> float:
    """Seconds to POST every event, `per_post` per document, over INGEST_CONNECTIONS
    connections; the documents are built before the clock starts."""
    lanes = build_lanes(url, INGEST_MODEL, events, worker_base, per_post)
    began, ended, answers = send_lanes(url, lanes)
    seconds = ended - began
    applied = 0
    for status, body in answers:
        if status != 200:
            raise RuntimeError(f"/events answered {status}: {body[:300]!r}")
        if check:
            report = orjson.loads(body)
            if report["rejected"] or report["gap_count"]:
                raise RuntimeError(f"ours did not apply an ingest document cleanly: {body[:500]!r}")
            applied += report["applied"]
    if check and applied != len(events):
        raise RuntimeError(f"ours applied {applied} of {len(events)} ingest events")
    return seconds
