"""Indexers fed by engines over ZMQ, ours and Dynamo 1.6.1's side by side.

* `zmq_ingest`: 16 engines, one vLLM publisher socket each (bench/zmq_feed.py), publish fresh
  64-block `BlockStored` batches as fast as they can; both indexers subscribe (`POST /register`
  with the endpoint) and hash every block's tokens themselves. Rate = blocks / time from the
  first message until a sentinel published last by every engine is applied (polled every 5 ms).
* `query_while_ingesting`: `/query_by_hash` p50 at one connection (wrk, 256 hashes of a stored
  chain) on an idle index, then while the 16 engines publish at a paced 200k blocks/s; reports
  both p50s, their ratio, and the ingest rate the server actually kept up with.

Each server runs alone on the server CPU (`taskset`), publishers and wrk on the client CPU.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path

import zmq

from .index_data import EVENT_BLOCKS, WORKERS, IngestStream, query_body
from .indexer_http import ReferenceFeed
from .runner import Load, Results, measure_point, progress
from .servers import running_servers

SCENARIOS = ("zmq_ingest", "query_while_ingesting")
ROLES = ("ours", "reference")
MODEL = "zmq"
PACED_BLOCKS_PER_S = 200_000
QUERY_EVENTS = 4  # the query: one worker's first four 64-block events, 256 hashes


def run(results: Results, selected: Collection[str], ref_python: Path) -> None:
    if not any(name in selected for name in SCENARIOS):
        return
    context = zmq.Context()
    try:
        with running_servers("indexer", ref_python, ROLES) as servers:
            if "zmq_ingest" in selected:
                _ingest(results, servers, context)
            if "query_while_ingesting" in selected:
                _query_while_ingesting(results, servers, context)
    finally:
        context.term()


def _ingest(results: Results, servers: dict, context: zmq.Context) -> None:
    settings = results.settings
    blocks = settings.ingest_blocks - settings.ingest_blocks % EVENT_BLOCKS
    for rep in range(1, settings.repetitions + 1):
        events = list(IngestStream(list(range(1, WORKERS + 1)), stream=50 + rep).events(blocks))
        for role in ROLES:  # interleaved: both servers see the same machine state per repetition
            base = 10_000 * rep + (0 if role == "ours" else 5_000)
            payloads = [(base + event.worker, event.zmq_payload()) for event in events]
            feed = ReferenceFeed(context, servers[role].url, MODEL, [base + w for w in range(1, WORKERS + 1)])
            began = time.perf_counter()
            feed.publish(payloads)
            feed.sync()
            seconds = time.perf_counter() - began
            feed.close(unregister=True)
            rate = blocks / seconds
            results.ingest.append({"role": role, "detail": f"ZMQ, {WORKERS} engines, one 64-block event per batch",
                                   "rep": rep, "blocks": blocks, "seconds": seconds, "blocks_per_s": rate})
            progress(f"{'zmq_ingest':<22} rep {rep} {role:<9} {rate:>12,.0f} blocks/s")


def _query_while_ingesting(results: Results, servers: dict, context: zmq.Context) -> None:
    settings = results.settings
    seconds = settings.warmup_s + settings.duration_s
    paced_events = int(PACED_BLOCKS_PER_S * seconds / EVENT_BLOCKS * settings.repetitions) + WORKERS
    with tempfile.TemporaryDirectory() as scratch:
        feeds: dict[str, ReferenceFeed] = {}
        pending: dict[str, list[tuple[int, bytes]]] = {}
        query_file = Path(scratch) / "query.json"
        for role in ROLES:
            base = 90_000 + (0 if role == "ours" else 5_000)
            stream = IngestStream(list(range(1, WORKERS + 1)), stream=90)
            fill = list(stream.events(WORKERS * QUERY_EVENTS * EVENT_BLOCKS))
            chain = [event for event in fill if event.worker == 1][:QUERY_EVENTS]
            query_file.write_bytes(query_body(MODEL, [h for event in chain for h in event.locals]))
            feed = ReferenceFeed(context, servers[role].url, MODEL, [base + w for w in range(1, WORKERS + 1)])
            feed.publish((base + event.worker, event.zmq_payload()) for event in fill)
            feed.sync()
            feeds[role] = feed
            more = list(stream.events(paced_events * EVENT_BLOCKS))
            pending[role] = [(base + event.worker, event.zmq_payload()) for event in more]

        load = Load("post_static.lua", ["/query_by_hash", str(query_file)])
        measure_point(results, "query_while_ingesting", "idle", servers, ROLES, [1], settings.repetitions,
                      lambda role, run_id: load)
        offsets = dict.fromkeys(ROLES, 0)
        kept_up: dict[str, list[float]] = {role: [] for role in ROLES}

        def prepare(role: str, seconds: float) -> None:
            """Start pacing 200k blocks/s at `role` for the next warm-up + run."""
            batch = pending[role][offsets[role]:]
            count = min(len(batch), int(PACED_BLOCKS_PER_S * seconds / EVENT_BLOCKS))
            offsets[role] += count
            threading.Thread(target=_paced, args=(feeds[role], batch[:count], seconds, kept_up[role]),
                             daemon=True).start()

        measure_point(results, "query_while_ingesting", f"ingesting {PACED_BLOCKS_PER_S // 1000}k blocks/s",
                      servers, ROLES, [1], settings.repetitions, lambda role, run_id: load, prepare)
        time.sleep(0.5)
        for role in ROLES:
            began = time.perf_counter()
            feeds[role].sync()
            backlog = time.perf_counter() - began
            feeds[role].close(unregister=True)
            if kept_up[role]:
                results.note(f"query_while_ingesting: {role} was sent {min(kept_up[role]):,.0f}-"
                             f"{max(kept_up[role]):,.0f} blocks/s (paced at {PACED_BLOCKS_PER_S:,}); its last "
                             f"sentinel was applied {backlog:.2f} s after the last run (no backlog: ~0.01 s)")


def _paced(feed: ReferenceFeed, payloads: list[tuple[int, bytes]], seconds: float, rates: list[float]) -> None:
    """Publish `payloads` evenly over `seconds`, then record the blocks/s sent."""
    started = time.perf_counter()
    interval = seconds / max(len(payloads), 1)
    for index, (worker, payload) in enumerate(payloads):
        delay = started + index * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        feed.publishers[worker].send(payload)
    rates.append(len(payloads) * EVENT_BLOCKS / (time.perf_counter() - started))
