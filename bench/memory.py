"""Memory and ingest pauses, ours and Dynamo 1.6.1's side by side, each in a fresh process.

* `index_memory`: an indexer subscribed to engine publishers over ZMQ (both kinds the same way,
  `ReferenceFeed`) gets a fill cut into 16 parts with a sentinel sync after each, so neither
  side holds a burst in its queues when RSS is read. Two fills of 64-block `BlockStored`
  chains (prompts of 4 events, as `IngestStream` makes them): 8 workers holding N blocks each,
  half of them chains that all 8 store (same tokens, hence the same local and external
  hashes) and half their own; and one worker holding ~1M blocks. Bytes of RSS growth per
  (block, worker) pair and per distinct block.
* `slot_tracker_memory`: 16 workers registered, then 1,000 and 10,000 active requests of 256
  hashes added over HTTP (half of them start with one of 20 shared 128-hash prefixes); bytes
  of RSS growth per (request, hash) and per active request.
* `ingest_pauses`: 16 engines publish ~1M pairs at full speed while a client process on the
  client CPU sends `/query_by_hash` (256 hashes of a stored chain) one at a time over a
  keep-alive connection; the longest latency and p99 during the fill and at idle.

Servers run on the server CPU; publishers and clients on the client CPU.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import zmq

from .http_post import Connection, post_request
from .index_data import EVENT_BLOCKS, IngestStream, query_body, sentinel_event
from .indexer_http import JSON, ReferenceFeed, _expect
from .runner import Results, progress
from .seed import HASHES_PER_REQUEST, NEW_ISL_TOKENS, SHARED_PREFIX, TrackerShape, register_tracker
from .servers import rss_bytes, running_servers

SCENARIOS = ("index_memory", "slot_tracker_memory", "ingest_pauses")
ROLES = ("ours", "reference")
MODEL = "memory"
FILL_PARTS = 16
SHARED_WORKERS = 8
PAUSE_WORKERS = 16
QUERY_EVENTS = 4  # the pause query: a stored chain of four 64-block events, 256 hashes
TRACKER_WORKERS = 16
TRACKER_STEPS = (1_000, 10_000)
TRACKER_PREFIXES = 20
SETTLE_S = 0.5  # after the last sync, before reading RSS
SYNC_POLL_S = 0.05  # while measuring pauses: poll for the sentinels rarely, not to load the server
# IngestStream token ranges (1.25M blocks each), apart from the other scenarios' streams.
STREAM_SHARED, STREAM_OWN, STREAM_ONE, STREAM_PAUSES = 120, 121, 122, 130


def run(results: Results, selected: Collection[str], ref_python: Path) -> None:
    if not any(name in selected for name in SCENARIOS):
        return
    if "index_memory" in selected:
        _index_memory(results, ref_python)
    if "slot_tracker_memory" in selected:
        _slot_tracker_memory(results, ref_python)
    if "ingest_pauses" in selected:
        _ingest_pauses(results, ref_python)


def _target_pairs(results: Results) -> int:
    pairs = results.settings.large_index_pairs
    return pairs // 10 if results.settings.quick else pairs


# --- index memory -------------------------------------------------------------------------


def shared_prefix_fill(pairs: int, workers: int = SHARED_WORKERS) -> tuple[list[tuple[int, bytes]], int, int]:
    """(worker, ZMQ payload) for `workers` workers holding ~pairs / workers blocks each, half
    in chains every worker stores (the very same payload, published by each worker) and half
    in chains of its own; with the (block, worker) pairs and distinct blocks it makes."""
    per_worker = pairs // workers
    half = max(EVENT_BLOCKS, per_worker // 2 // EVENT_BLOCKS * EVENT_BLOCKS)
    shared = [event.zmq_payload() for event in IngestStream([0], stream=STREAM_SHARED).events(half)]
    own = [(event.worker, event.zmq_payload())
           for event in IngestStream(list(range(1, workers + 1)), stream=STREAM_OWN).events(half * workers)]
    payloads: list[tuple[int, bytes]] = []
    for index, payload in enumerate(shared):  # each shared event, then one own event per worker
        payloads.extend((worker, payload) for worker in range(1, workers + 1))
        payloads.extend(own[index * workers:(index + 1) * workers])
    return payloads, 2 * half * workers, half + half * workers


def one_worker_fill(pairs: int) -> tuple[list[tuple[int, bytes]], int, int]:
    blocks = max(EVENT_BLOCKS, pairs // EVENT_BLOCKS * EVENT_BLOCKS)
    payloads = [(1, event.zmq_payload()) for event in IngestStream([1], stream=STREAM_ONE).events(blocks)]
    return payloads, blocks, blocks


def _parts(payloads: list[tuple[int, bytes]], parts: int) -> Iterator[list[tuple[int, bytes]]]:
    size = -(-len(payloads) // parts)
    for start in range(0, len(payloads), size):
        yield payloads[start:start + size]


def _index_memory(results: Results, ref_python: Path) -> None:
    target = _target_pairs(results)
    fills = {
        f"{SHARED_WORKERS} workers, half shared": (SHARED_WORKERS, *shared_prefix_fill(target)),
        "1 worker": (1, *one_worker_fill(target)),
    }
    context = zmq.Context()
    try:
        for fill, (workers, payloads, pairs, distinct) in fills.items():
            for role in ROLES:
                with running_servers("indexer", ref_python, (role,)) as servers:
                    server = servers[role]
                    feed = ReferenceFeed(context, server.url, MODEL, range(1, workers + 1))
                    feed.sync()  # warm-up: the first events, queries and sync of the process
                    time.sleep(SETTLE_S)
                    before = rss_bytes(server.pid)
                    started = time.monotonic()
                    for part in _parts(payloads, FILL_PARTS):
                        feed.publish(part)
                        feed.sync()
                    seconds = time.monotonic() - started
                    time.sleep(SETTLE_S)
                    after = rss_bytes(server.pid)
                    feed.close(unregister=False)
                row = {"fill": fill, "role": role, "workers": workers, "pairs": pairs, "distinct_blocks": distinct,
                       "rss_before": before, "rss_after": after, "fill_s": seconds,
                       "bytes_per_pair": (after - before) / pairs, "bytes_per_block": (after - before) / distinct}
                results.index_memory.append(row)
                progress(f"{'index_memory':<22} {fill:<24} {role:<9} {row['bytes_per_pair']:6,.0f} B per pair, "
                         f"{row['bytes_per_block']:6,.0f} B per distinct block (RSS {before / 2**20:,.0f} -> "
                         f"{after / 2**20:,.0f} MiB, {pairs:,} pairs, {distinct:,} blocks, filled in {seconds:.1f} s)")
    finally:
        context.term()


# --- slot tracker memory ------------------------------------------------------------------


def tracker_hash_lists(count: int, seed: int = 26) -> list[list[int]]:
    """`count` requests of 256 hashes: even ones start with one of 20 shared 128-hash
    prefixes (in turn) and end with 128 own hashes, odd ones have 256 own hashes."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.getrandbits(64) - 2**63 for _ in range(n)]

    prefixes = [fresh(SHARED_PREFIX) for _ in range(TRACKER_PREFIXES)]
    return [prefixes[index // 2 % TRACKER_PREFIXES] + fresh(HASHES_PER_REQUEST - SHARED_PREFIX) if index % 2 == 0
            else fresh(HASHES_PER_REQUEST) for index in range(count)]


def _add_bodies(shape: TrackerShape, lists: list[list[int]]) -> list[bytes]:
    return [orjson.dumps({"model_name": shape.model, "request_id": f"mem-{index}",
                          "worker_id": index % shape.workers + 1, "dp_rank": 0,
                          "sequence_hashes": hashes, "new_isl_tokens": NEW_ISL_TOKENS})
            for index, hashes in enumerate(lists)]


def _post_all(url: str, path: str, bodies: list[bytes], expect: int) -> None:
    connection = Connection(url)
    try:
        for body in bodies:
            status, answer = connection.send(post_request(url, path, body))
            if status != expect:
                raise RuntimeError(f"{url}{path} answered {status} {answer[:300]!r}")
    finally:
        connection.close()


def _slot_tracker_memory(results: Results, ref_python: Path) -> None:
    shape = TrackerShape(MODEL, TRACKER_WORKERS, 1)
    bodies = _add_bodies(shape, tracker_hash_lists(TRACKER_STEPS[-1]))
    warm = orjson.dumps({"model_name": MODEL, "request_id": "warm-up", "worker_id": 1, "dp_rank": 0,
                         "sequence_hashes": tracker_hash_lists(1, seed=27)[0], "new_isl_tokens": NEW_ISL_TOKENS})
    for role in ROLES:
        with running_servers("slot_tracker", ref_python, (role,)) as servers:
            server = servers[role]
            with httpx.Client(base_url=server.url, timeout=60) as client:
                register_tracker(client, shape)
            _post_all(server.url, "/add", [warm], 201)  # warm-up: one request added and freed
            _post_all(server.url, "/free", [orjson.dumps({"model_name": MODEL, "request_id": "warm-up"})], 200)
            time.sleep(SETTLE_S)
            before = rss_bytes(server.pid)
            added = 0
            started = time.monotonic()
            for step in TRACKER_STEPS:
                _post_all(server.url, "/add", bodies[added:step], 201)
                added = step
                time.sleep(SETTLE_S)
                rss = rss_bytes(server.pid)
                growth = rss - before
                row = {"role": role, "requests": step, "hashes": step * HASHES_PER_REQUEST, "rss_before": before,
                       "rss_after": rss, "bytes_per_request_hash": growth / (step * HASHES_PER_REQUEST),
                       "bytes_per_request": growth / step}
                results.tracker_memory.append(row)
                progress(f"{'slot_tracker_memory':<22} {step:>6,} active {role:<9} "
                         f"{row['bytes_per_request_hash']:6,.1f} B per (request, hash), "
                         f"{row['bytes_per_request'] / 1024:7,.1f} KiB per request (RSS {before / 2**20:,.0f} -> "
                         f"{rss / 2**20:,.0f} MiB)")
            if time.monotonic() - started > 240:
                results.note(f"slot_tracker_memory: adding took {time.monotonic() - started:.0f} s on {role}; "
                             "the first requests may have aged out (both trackers free them 300 s after /add)")


# --- pauses while ingesting ---------------------------------------------------------------


def _query_client(url: str, request: bytes, ready: Any, stop: Any, sink: Any) -> None:
    """In its own process (no GIL shared with the publishers): one query at a time over one
    keep-alive connection until `stop`; sends back (start, seconds, status) per query."""
    connection = Connection(url, timeout=60)
    for _ in range(20):
        connection.send(request)
    ready.set()
    samples: list[tuple[float, float, int]] = []
    clock = time.perf_counter
    while not stop.is_set():
        began = clock()
        status, _ = connection.send(request)
        samples.append((began, clock() - began, status))
    connection.close()
    sink.send(samples)
    sink.close()


def _sync_rarely(feed: ReferenceFeed, connection: Connection, poll_s: float) -> None:
    """`feed.sync()`, polling every `poll_s` over a bare connection, so the polls cost the
    server little next to the measured queries."""
    ReferenceFeed._salt += 1
    sentinels = [sentinel_event(worker, ReferenceFeed._salt) for worker in feed.publishers]
    feed.publish((event.worker, event.zmq_payload()) for event in sentinels)
    request = post_request(feed.url, "/query_by_hash", query_body(feed.model, sentinels[0].locals))
    wanted = {str(worker) for worker in feed.publishers}
    deadline = time.monotonic() + 900
    while True:
        status, body = connection.send(request)
        if status == 200 and wanted <= set(orjson.loads(body).get("scores", {})):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the indexer did not apply the published events within 900 s")
        time.sleep(poll_s)


def _latencies(samples: list[tuple[float, float, int]], start: float, end: float) -> dict[str, Any]:
    window = sorted(seconds for began, seconds, _ in samples if start <= began < end)
    errors = sum(1 for began, _, status in samples if start <= began < end and status != 200)
    if not window:
        return {"queries": 0, "errors": errors}

    def quantile(q: float) -> float:
        return window[min(len(window) - 1, int(len(window) * q))] * 1000

    return {"queries": len(window), "errors": errors, "max_ms": window[-1] * 1000, "p999_ms": quantile(0.999),
            "p99_ms": quantile(0.99), "p50_ms": statistics.median(window) * 1000}


def _ingest_pauses(results: Results, ref_python: Path) -> None:
    """Per repetition, each role in turn (a fresh server each time): idle, then the fill."""
    settings = results.settings
    workers = list(range(1, PAUSE_WORKERS + 1))
    stream = IngestStream(workers, stream=STREAM_PAUSES)
    first = list(stream.events(PAUSE_WORKERS * QUERY_EVENTS * EVENT_BLOCKS))
    chain = [event for event in first if event.worker == 1][:QUERY_EVENTS]
    query = query_body(MODEL, [h for event in chain for h in event.locals])
    seeded = [(event.worker, event.zmq_payload()) for event in first]
    fill = [(event.worker, event.zmq_payload())
            for event in stream.events(_target_pairs(results) - len(first) * EVENT_BLOCKS)]
    pairs = (len(first) + len(fill)) * EVENT_BLOCKS
    context = zmq.Context()
    try:
        for rep in range(1, settings.repetitions + 1):
            for role in ROLES:
                _pause_run(results, ref_python, context, role, rep, query, seeded, fill, pairs)
    finally:
        context.term()


def _pause_run(results: Results, ref_python: Path, context: zmq.Context, role: str, rep: int, query: bytes,
               seeded: list[tuple[int, bytes]], fill: list[tuple[int, bytes]], pairs: int) -> None:
    spawn = multiprocessing.get_context("spawn")
    with running_servers("indexer", ref_python, (role,)) as servers:
        server = servers[role]
        feed = ReferenceFeed(context, server.url, MODEL, range(1, PAUSE_WORKERS + 1))
        feed.publish(seeded)
        feed.sync()
        answer = _expect(httpx.post(server.url + "/query_by_hash", content=query, headers=JSON, timeout=30),
                         200).json()
        if set(answer.get("scores", {})) != {"1"}:
            results.note(f"ingest_pauses: {role} scores the query {answer.get('scores')} (expected worker 1 alone)")
        ready, stop = spawn.Event(), spawn.Event()
        receiver, sink = spawn.Pipe(duplex=False)
        client = spawn.Process(target=_query_client, daemon=True, args=(
            server.url, post_request(server.url, "/query_by_hash", query), ready, stop, sink))
        client.start()
        sink.close()
        if not ready.wait(60):
            raise RuntimeError("the query client did not start")
        idle_start = time.perf_counter()
        time.sleep(results.settings.duration_s)
        idle_end = fill_start = time.perf_counter()
        poller = Connection(server.url, timeout=60)
        feed.publish(fill)
        published = time.perf_counter()
        _sync_rarely(feed, poller, SYNC_POLL_S)
        fill_end = time.perf_counter()
        poller.close()
        stop.set()
        samples = receiver.recv()
        client.join(30)
        feed.close(unregister=False)
    for state, (start, end) in (("idle", (idle_start, idle_end)), ("ingesting", (fill_start, fill_end))):
        row = {"role": role, "state": state, "rep": rep, "pairs": pairs, "seconds": end - start,
               **_latencies(samples, start, end)}
        if state == "ingesting":
            # The publishers share the client CPU while they queue the fill: the longest pause
            # after that too, which the client's own scheduling cannot have stretched.
            row["blocks_per_s"] = len(fill) * EVENT_BLOCKS / (end - start)
            row["publish_s"] = published - start
            row["max_after_publish_ms"] = _latencies(samples, published, end).get("max_ms")
        results.pauses.append(row)
        if row["errors"]:
            results.note(f"ingest_pauses: {role} {state} rep {rep}: {row['errors']} queries did not answer 200")
        progress(f"{'ingest_pauses':<22} {state:<10} rep {rep} {role:<9} {row['queries']:>7,} queries, "
                 f"longest {row.get('max_ms', 0):8.2f} ms, p99.9 {row.get('p999_ms', 0):6.2f} ms, "
                 f"p99 {row.get('p99_ms', 0):6.2f} ms, p50 {row.get('p50_ms', 0):5.2f} ms over {end - start:.1f} s"
                 + (f" ({row['blocks_per_s']:,.0f} blocks/s; published in {row['publish_s']:.2f} s, longest "
                    f"after that {row['max_after_publish_ms'] or 0:.2f} ms)" if state == "ingesting" else ""))
