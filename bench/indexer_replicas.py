"""Indexer replicas over NATS JetStream (`--nats`) on this machine: ingest through the stream,
replication lag, and reads spread over replicas. Prints numbers; never passes or fails.

    .venv/bin/python -m bench.indexer_replicas                  # about 4 minutes
    .venv/bin/python -m bench.indexer_replicas --quick          # about 1 minute
    .venv/bin/python -m bench.indexer_replicas --output /tmp/replicas.json --only ingest,lag

One `nats-server -js` (Debian's, tests/support/nats_support.py) runs in a temp dir for the whole run;
every replica set has its own stream (`--nats-stream`, `--nats-subject-prefix`) on it.

Layout (2 CPUs): indexers (the single process without `--nats` and every replica) on CPU 0,
nats-server, this process (posting clients, ZMQ publishers, probes) and wrk on CPU 1, except in
the reads scenario, where the second replica runs on CPU 1 beside wrk and nats-server (said in
the table). Three replicas on one CPU share it: their end-to-end rate is what one CPU applies
three times over, so the "1 replica" rows are what a fleet with a CPU per replica could reach
(if nats-server keeps up); the CPU seconds columns show the cost per replica.

1. `ingest`: fresh 64-block stored events from 16 workers (bench/index_data.py `IngestStream`),
   1 and 16 events per `/events` POST over 4 keep-alive connections (each owning 4 workers), to
   replica A. Rate = events / (time from the first POST until the LAST replica's
   `applied_sequence` reaches the highest `stream_sequence` answered), polled every 10 ms after
   the last 202; "accepted" is the rate of the 202 answers alone. The single process without
   `--nats` gets the same documents (answers 200 once applied). Then the ZMQ path: 16 vLLM-format
   publishers (bench/zmq_feed.py), registered through A; every replica subscribes and publishes
   every batch (JetStream keeps one per message id, the others count as duplicates). Rate =
   blocks / (first message until every replica applied the last batch). Workers are
   unregistered after every run, so each run starts from the same (empty) index.
2. `lag`: a steady background load of 1-event documents posted to A at a fixed rate (a child
   process, so its GIL does not delay the probe), light (50 posts/s) and heavy (half the
   3-replica ingest capacity measured in 1, 1 event per POST). Meanwhile a probe posts a 1-block
   event to A every 40 ms and, from its 202 answer on, polls `/query_by_hash` for that block on
   A, B and C until each scores it (applied, hence visible to reads), with a poll interval of 5%
   of the time waited (0.2-5 ms): lag = answer -> visible, p50 / p99 per replica.
3. `reads`: ~100k (block, worker) pairs from the Mooncake trace posted through replica A (64
   events per POST; the single process gets the same), then `/query_by_hash` (512 hashes,
   bench/lua/post_static.lua, the body of `python -m bench`'s query_by_hash) with wrk at c=64:
   the single process (CPU 0), one replica (CPU 0), two replicas side by side (A on CPU 0, B on
   CPU 1), two wrk processes of c=32 each on CPU 1 at once, their req/s summed; and the two
   replicas again with both wrk processes free to run on either CPU (the scheduler shares the
   2 CPUs among 2 servers and 2 load generators). Last, the whole machine for Dynamo 1.6.1:
   its indexer (default `--threads 4`), fed the same blocks over ZMQ and free to use both CPUs,
   under the same two unpinned wrk processes (issue 26: what one 2-core machine serves).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import zmq

from .http_post import Connection, post_request
from .index_data import (
    BLOCK_SIZE,
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
)
from .indexer_http import ReferenceFeed, build_lanes, send_lanes
from .runner import machine_facts, progress
from .servers import CLIENT_CPU, SERVER_CPU, pin_to_client_cpu
from .wrk import WrkError, WrkResult, ensure_wrk, run_wrk

# tests/ is not a package: `.servers` puts it on sys.path, as it does for its own use.
reference_server = importlib.import_module("support.reference_server")
NatsServer = importlib.import_module("support.nats_support").NatsServer

PHASES = ("ingest", "zmq", "lag", "reads")
INGEST_MODEL = "ingest"
ZMQ_MODEL = "zmq"
LAG_MODEL = "lag"
READ_MODEL = "bench"
INGEST_CONNECTIONS = 4
PER_POST_VARIANTS = (1, 16)
FILL_EVENTS_PER_POST = 64
APPLIED_POLL_S = 0.010
WAIT_APPLIED_TIMEOUT_S = 180.0
PROBE_WORKER = 987_654_321
PROBE_TIMEOUT_S = 10.0
LIGHT_POSTS_PER_S = 50.0
HEAVY_FRACTION = 0.5
HEAVY_FALLBACK_BLOCKS_PER_S = 100_000.0
LAG_LANES = 4
READ_CONNECTIONS = 64
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Plan:
    ingest_blocks: int  # per run (config x events per POST x repetition)
    ingest_reps: int
    zmq_blocks: int
    zmq_reps: int
    lag_seconds: float  # per load level
    probe_interval_s: float
    read_pairs: int
    read_duration_s: float
    read_warmup_s: float
    read_reps: int


FULL = Plan(ingest_blocks=640_000, ingest_reps=2, zmq_blocks=640_000, zmq_reps=2, lag_seconds=15.0,
            probe_interval_s=0.040, read_pairs=100_000, read_duration_s=10.0, read_warmup_s=2.0, read_reps=2)
QUICK = Plan(ingest_blocks=128_000, ingest_reps=1, zmq_blocks=128_000, zmq_reps=1, lag_seconds=5.0,
             probe_interval_s=0.040, read_pairs=100_000, read_duration_s=3.0, read_warmup_s=1.0, read_reps=1)


@dataclass
class Report:
    meta: dict[str, Any] = field(default_factory=dict)
    ingest: list[dict[str, Any]] = field(default_factory=list)
    zmq: list[dict[str, Any]] = field(default_factory=list)
    lag: list[dict[str, Any]] = field(default_factory=list)
    reads: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        progress(f"NOTE: {text}")
        self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "ingest": self.ingest, "zmq": self.zmq, "lag": self.lag, "reads": self.reads,
                "notes": self.notes}


# --- processes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Indexer:
    name: str
    url: str
    pid: int
    cpu: int
    stream: str | None  # None: the single process without --nats
    log_path: Path


class Processes:
    """Indexer processes started with `running_server` (kept logs, scanned at the end)."""

    def __init__(self, stack: contextlib.ExitStack, nats: NatsServer, logs: list[tuple[str, Path]]) -> None:
        self.stack = stack
        self.nats = nats
        self.logs = logs

    def start(self, name: str, cpu: int, stream: str | None = None) -> Indexer:
        port = reference_server.free_port()
        argv = ["taskset", "-c", str(cpu), sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning"]
        if stream is not None:
            argv += ["--nats", self.nats.url, "--nats-stream", stream,
                     "--nats-subject-prefix", f"bench.{stream.lower()}",
                     "--nats-replica-name", f"{stream.lower()}-{name.lower()}"]
        url = self.stack.enter_context(reference_server.running_server(
            argv, port, "/ready" if stream else "/health", timeout=60, keep_log=True))
        self.logs.append((f"{stream or 'single'}/{name}", url.log_path))
        return Indexer(name, str(url), url.process.pid, cpu, stream, url.log_path)

    def replicas(self, stream: str, names_cpus: list[tuple[str, int]]) -> list[Indexer]:
        return [self.start(name, cpu, stream) for name, cpu in names_cpus]

    def start_reference(self, name: str) -> Indexer | None:
        """Dynamo 1.6.1's indexer with its default options (`--threads 4`), on no CPU in
        particular: what it serves when it may use the whole machine. None when the reference
        cannot be installed here (said in the notes)."""
        python = reference_server.reference_python()
        if python is None:
            return None
        port = reference_server.free_port()
        url = self.stack.enter_context(reference_server.running_server(
            # This process is pinned to the client CPU, and children inherit that: unpin it.
            ["taskset", "-c", f"{SERVER_CPU},{CLIENT_CPU}", str(python), "-m", "dynamo.indexer", "--port", str(port)],
            port, "/health", timeout=60, keep_log=True))
        # Not in self.logs: it logs every registration at INFO, and its lines are not ours to flag.
        return Indexer(name, str(url), url.process.pid, -1, None, url.log_path)


class ForeignLoad:
    """Samples, every few seconds, the CPU time of processes that are not this one or its
    descendants (other sessions' tests and benchmarks on a shared machine), for the notes."""

    def __init__(self, interval_s: float = 3.0) -> None:
        self.interval_s = interval_s
        self.total_s = 0.0
        self.busiest: dict[str, float] = {}  # command -> highest share of one CPU over an interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _table() -> dict[int, tuple[int, float, str]]:
        table: dict[int, tuple[int, float, str]] = {}
        tick = os.sysconf("SC_CLK_TCK")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                table[int(entry.name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, command or name)
        return table

    def _run(self) -> None:
        me = os.getpid()
        previous = self._table()
        while not self._stop.wait(self.interval_s):
            current = self._table()
            for pid, (_, cpu, command) in current.items():
                ancestor, hops = pid, 0
                while ancestor not in (0, 1, me) and hops < 50:
                    ancestor, hops = current.get(ancestor, (0, 0.0, ""))[0], hops + 1
                if ancestor == me or pid == me or pid not in previous:
                    continue
                used = cpu - previous[pid][1]
                if used > 0:
                    self.total_s += used
                    share = used / self.interval_s
                    if share > 0.1:
                        key = " ".join(command.split())[:100]
                        self.busiest[key] = max(self.busiest.get(key, 0.0), share)
            previous = current

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_request(url: str, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n\r\n".encode("ascii")


class MetricsProbe:
    """GET /metrics of one replica over a kept-alive connection (cheap enough to poll)."""

    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer
        self.connection = Connection(indexer.url, timeout=30)
        self.request = _get_request(indexer.url, "/metrics")

    def metrics(self) -> dict[str, float]:
        status, body = self.connection.send(self.request)
        if status != 200:
            raise RuntimeError(f"{self.indexer.name}: GET /metrics -> {status}")
        values: dict[str, float] = {}
        for line in body.split(b"\n"):
            if line.startswith(b"dynamo_lite_indexer_replica_"):
                name, _, value = line.partition(b" ")
                if b"{" not in name:
                    values[name[len(b"dynamo_lite_indexer_replica_"):].decode()] = float(value)
        return values

    def applied(self) -> int:
        return int(self.metrics()["applied_sequence"])

    def close(self) -> None:
        self.connection.close()


@contextlib.contextmanager
def probes_for(replicas: list[Indexer]) -> Iterator[dict[str, MetricsProbe]]:
    probes = {replica.name: MetricsProbe(replica) for replica in replicas}
    try:
        yield probes
    finally:
        for probe in probes.values():
            probe.close()


def wait_applied(probes: dict[str, MetricsProbe], target: int, timeout: float = WAIT_APPLIED_TIMEOUT_S,
                 interval: float = APPLIED_POLL_S) -> tuple[dict[str, float], dict[str, int]]:
    """Poll one unfinished replica every `interval` until every replica's applied_sequence is
    at least `target`: (perf_counter time each got there, last sequence seen of each)."""
    done: dict[str, float] = {}
    last: dict[str, int] = {}
    pending = list(probes)
    deadline = time.perf_counter() + timeout
    while pending:
        name = pending[0]
        last[name] = probes[name].applied()
        now = time.perf_counter()
        if last[name] >= target:
            done[name] = now
            pending.pop(0)
            continue
        if now > deadline:
            break
        pending.append(pending.pop(0))
        time.sleep(interval)
    return done, last


def counters(probes: dict[str, MetricsProbe]) -> dict[str, dict[str, float]]:
    return {name: probe.metrics() for name, probe in probes.items()}


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], key: str) -> dict[str, float]:
    return {name: after[name][key] - before[name][key] for name in after}


def _expect(response: httpx.Response, *statuses: int) -> httpx.Response:
    if response.status_code not in statuses:
        raise RuntimeError(f"{response.request.method} {response.request.url} -> {response.status_code} "
                           f"{response.text[:300]}")
    return response


def workers_blocks(url: str, model: str, instance_ids: set[int]) -> int:
    workers = _expect(httpx.get(url + "/workers", params={"model_name": model}, timeout=60), 200).json()
    return sum(rank.get("blocks", 0) for worker in workers if worker["instance_id"] in instance_ids
               for rank in worker["ranks"])


def unregister(url: str, model: str, instance_ids: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for worker in instance_ids:
            _expect(client.post("/unregister", json={"instance_id": worker, "model_name": model}), 200)


def settle(replicas: list[Indexer], report: Report, what: str) -> int:
    """Wait until every replica applied what the first one has; its sequence."""
    with probes_for(replicas) as probes:
        target = max(probe.applied() for probe in probes.values())
        done, last = wait_applied(probes, target, timeout=60)
    if len(done) != len(replicas):
        report.note(f"{what}: replicas did not reach seq {target} within 60 s: {last}")
    return target


def scan_logs(report: Report, logs: list[tuple[str, Path]], nats: NatsServer | None) -> None:
    """Every warning/error line the indexers (run at --log-level warning) and nats-server wrote."""
    for name, path in logs:
        with contextlib.suppress(OSError):
            lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
            if lines:
                shown = "; ".join(lines[:5]) + (f" (+{len(lines) - 5} more lines)" if len(lines) > 5 else "")
                report.note(f"log of {name} ({path}): {len(lines)} lines: {shown[:1500]}")
            else:
                path.unlink()
    if nats is not None:
        bad = [line for line in nats.log_text().splitlines() if "[ERR]" in line or "[WRN]" in line]
        if bad:
            report.note(f"nats-server log: {len(bad)} [ERR]/[WRN] lines, e.g. {'; '.join(bad[:5])[:1500]}")


# --- 1. ingest ----------------------------------------------------------------------------------


@dataclass
class Target:
    """Where writes go (`entry`), and the replicas that must apply them (empty: no --nats)."""

    label: str
    entry: Indexer
    replicas: list[Indexer]

    @property
    def replicated(self) -> bool:
        return bool(self.replicas)

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in (self.replicas or [self.entry])}


_bases = iter(range(1_000, 10**9, 1_000))


def next_worker_base() -> int:
    return next(_bases)


def ingest_run(report: Report, target: Target, nats_pid: int, events: list[StoredEvent], per_post: int,
               rep: int) -> dict[str, Any]:
    base = next_worker_base()
    worker_ids = [base + w for w in range(1, WORKERS + 1)]
    blocks = sum(len(event.exts) for event in events)
    lanes = build_lanes(target.entry.url, INGEST_MODEL, events, base, per_post)
    posts = sum(len(lane) for lane in lanes)
    pids = {**target.pids(), "nats": nats_pid}
    row: dict[str, Any] = {"path": "http", "config": target.label, "events_per_post": per_post, "rep": rep,
                           "events": len(events), "blocks": blocks, "posts": posts}
    with contextlib.ExitStack() as stack:
        probes = stack.enter_context(probes_for(target.replicas)) if target.replicated else {}
        before = counters(probes) if probes else {}
        start_seq = max((p.applied() for p in probes.values()), default=0)
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        began, accepted, answers = send_lanes(target.entry.url, lanes)
        wanted = 202 if target.replicated else 200
        bad = [(status, body[:200]) for status, body in answers if status != wanted]
        if bad:
            report.note(f"ingest {target.label} {per_post}/POST rep {rep}: {len(bad)} answers not {wanted}, "
                        f"e.g. {bad[0]}")
        row["errors"] = len(bad)
        if target.replicated:
            sequences = [orjson.loads(body)["stream_sequence"] for status, body in answers if status == 202]
            end_seq = max(sequences, default=start_seq)
            done, last = wait_applied(probes, end_seq)
            cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
            after = counters(probes)
            if len(done) != len(probes):
                report.note(f"ingest {target.label} {per_post}/POST rep {rep}: replicas stuck below seq {end_seq} "
                            f"after {WAIT_APPLIED_TIMEOUT_S:.0f} s: {last}")
            finished = max(done.values(), default=float("nan"))
            row.update(stream_messages=end_seq - start_seq, accepted_s=accepted - began,
                       applied_s={name: t - began for name, t in done.items()}, seconds=finished - began,
                       refused=sum(delta(after, before, "refused_total").values()),
                       snapshots_written=sum(delta(after, before, "snapshots_written_total").values()))
            if row["refused"]:
                report.note(f"ingest {target.label} {per_post}/POST rep {rep}: {row['refused']:.0f} stream messages "
                            "refused by replicas")
        else:
            cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
            applied = 0
            for status, body in answers:
                if status == 200:
                    answer = orjson.loads(body)
                    applied += answer["applied"]
                    if answer["rejected"] or answer["gap_count"]:
                        report.note(f"ingest single: a document was not applied cleanly: {body[:300]!r}")
            if applied != len(events):
                report.note(f"ingest single: applied {applied} of {len(events)} events")
            row.update(accepted_s=accepted - began, seconds=accepted - began)
    row["cpu_s"] = {name: cpu_after[name] - cpu_before[name] for name in pids}
    row["events_per_s"] = len(events) / row["seconds"]
    row["blocks_per_s"] = blocks / row["seconds"]
    row["accepted_events_per_s"] = len(events) / row["accepted_s"]
    last_replica = (target.replicas or [target.entry])[-1]
    held = workers_blocks(last_replica.url, INGEST_MODEL, set(worker_ids))
    if held != blocks:
        report.note(f"ingest {target.label} {per_post}/POST rep {rep}: {last_replica.name} holds {held:,} blocks "
                    f"of the run's workers, expected {blocks:,}")
    unregister(target.entry.url, INGEST_MODEL, worker_ids)
    if target.replicated:
        settle(target.replicas, report, f"after ingest {target.label}")
    replica_cpu = sum(v for k, v in row["cpu_s"].items() if k != "nats")
    applied_s = row.get("applied_s") or {}
    progress(f"ingest {target.label:<22} {per_post:>2}/POST rep {rep}: {row['events_per_s']:>9,.0f} events/s "
             f"({row['blocks_per_s']:>11,.0f} blocks/s) end to end; accepted {row['accepted_events_per_s']:>9,.0f}"
             f" events/s; CPU s: indexers {replica_cpu:.2f}, nats {row['cpu_s']['nats']:.2f}"
             + (f"; applied at {', '.join(f'{k} {v:.2f}s' for k, v in applied_s.items())}" if applied_s else ""))
    return row


def zmq_run(report: Report, target: Target, nats_pid: int, context: zmq.Context, events: list[StoredEvent],
            rep: int) -> dict[str, Any]:
    base = next_worker_base()
    worker_ids = [base + w for w in range(1, WORKERS + 1)]
    payloads = [(base + event.worker, event.zmq_payload()) for event in events]
    blocks = sum(len(event.exts) for event in events)
    pids = {**target.pids(), "nats": nats_pid}
    row: dict[str, Any] = {"path": "zmq", "config": target.label, "rep": rep, "batches": len(payloads),
                           "blocks": blocks, "engines": WORKERS}
    feed = ReferenceFeed(context, target.entry.url, ZMQ_MODEL, worker_ids)  # registers, waits for one SUB
    try:
        for _ in range(len(target.replicas) - 1):  # the other replicas subscribe once they applied it
            for publisher in feed.publishers.values():
                publisher.wait_subscribed()
        if target.replicated:
            start_seq = settle(target.replicas, report, "zmq registration")
            with probes_for(target.replicas) as probes:
                before = counters(probes)
                cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                began = time.perf_counter()
                feed.publish(payloads)
                end_seq = start_seq + len(payloads)
                done, last = wait_applied(probes, end_seq)
                cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
                after = counters(probes)
            if len(done) != len(probes):
                report.note(f"zmq {target.label} rep {rep}: replicas below seq {end_seq} after "
                            f"{WAIT_APPLIED_TIMEOUT_S:.0f} s: {last}")
            row.update(seconds=max(done.values(), default=float("nan")) - began,
                       applied_s={name: t - began for name, t in done.items()},
                       published=sum(delta(after, before, "published_total").values()),
                       duplicates=sum(delta(after, before, "duplicates_total").values()),
                       published_by={name: v for name, v in delta(after, before, "published_total").items()},
                       expected_duplicates=(len(target.replicas) - 1) * len(payloads),
                       refused=sum(delta(after, before, "refused_total").values()))
            if row["published"] != len(payloads):
                report.note(f"zmq {target.label} rep {rep}: {row['published']:.0f} batches stored in the stream "
                            f"for {len(payloads)} published by the engines")
        else:
            cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            began = time.perf_counter()
            feed.publish(payloads)
            feed.sync()
            row["seconds"] = time.perf_counter() - began
            cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        last_replica = (target.replicas or [target.entry])[-1]
        held = workers_blocks(last_replica.url, ZMQ_MODEL, set(worker_ids))
        if held < blocks:
            report.note(f"zmq {target.label} rep {rep}: {last_replica.name} holds {held:,} blocks of the run's "
                        f"workers, expected {blocks:,} (+ sentinels)")
    finally:
        feed.close(unregister=True)
    if target.replicated:
        settle(target.replicas, report, f"after zmq {target.label}")
    row["cpu_s"] = {name: cpu_after[name] - cpu_before[name] for name in pids}
    row["blocks_per_s"] = blocks / row["seconds"]
    extra = (f"; stored {row['published']:,.0f}, duplicates {row['duplicates']:,.0f} "
             f"(expected {row['expected_duplicates']:,})" if target.replicated else "")
    progress(f"zmq    {target.label:<22} rep {rep}: {row['blocks_per_s']:>11,.0f} blocks/s on every indexer; "
             f"CPU s: indexers {sum(v for k, v in row['cpu_s'].items() if k != 'nats'):.2f}, "
             f"nats {row['cpu_s']['nats']:.2f}{extra}")
    return row


def run_ingest(report: Report, plan: Plan, phases: set[str], procs: Processes, nats: NatsServer) -> None:
    nats_pid = nats.process.pid if nats.process else 0
    progress("ingest: starting the single indexer, 1 replica (stream INGEST1) and 3 replicas (INGEST3), all on CPU 0")
    single = procs.start("single", SERVER_CPU)
    one = procs.replicas("INGEST1", [("A", SERVER_CPU)])
    three = procs.replicas("INGEST3", [("A", SERVER_CPU), ("B", SERVER_CPU), ("C", SERVER_CPU)])
    targets = [Target("single (no --nats)", single, []), Target("1 replica", one[0], one),
               Target("3 replicas", three[0], three)]
    if "ingest" in phases:
        blocks = plan.ingest_blocks - plan.ingest_blocks % EVENT_BLOCKS
        for rep in range(1, plan.ingest_reps + 1):
            events = list(IngestStream(list(range(1, WORKERS + 1)), stream=rep).events(blocks))
            for per_post in PER_POST_VARIANTS:
                for target in targets:  # interleaved: every config sees the same machine drift
                    report.ingest.append(ingest_run(report, target, nats_pid, events, per_post, rep))
    if "zmq" in phases:
        context = zmq.Context()
        try:
            blocks = plan.zmq_blocks - plan.zmq_blocks % EVENT_BLOCKS
            for rep in range(1, plan.zmq_reps + 1):
                events = list(IngestStream(list(range(1, WORKERS + 1)), stream=20 + rep).events(blocks))
                for target in targets:
                    report.zmq.append(zmq_run(report, target, nats_pid, context, events, rep))
        finally:
            context.term()


# --- 2. lag -------------------------------------------------------------------------------------


def _lag_load(url: str, worker_base: int, stream: int, posts_per_s: float, seconds: float, lanes: int,
              ready: Any, start: Any, results: Any) -> None:
    """Child process: POST 1-event documents to `url` at `posts_per_s` over `lanes`
    connections (each paced on its own schedule, sending at once when behind) for `seconds`."""
    count = int(posts_per_s * seconds * 1.05) + lanes
    events = list(IngestStream(list(range(1, WORKERS + 1)), stream=stream).events(count * EVENT_BLOCKS))
    requests = build_lanes(url, LAG_MODEL, events, worker_base, 1, lanes)
    connections = [Connection(url, timeout=60) for _ in range(lanes)]
    outcome: list[dict[str, Any]] = [{} for _ in range(lanes)]
    ready.set()
    start.wait()
    began = time.perf_counter()
    interval = lanes / posts_per_s

    def send(lane: int) -> None:
        sent = errors = max_seq = 0
        behind = 0.0
        for index, request in enumerate(requests[lane]):
            due = began + lane * interval / lanes + index * interval
            now = time.perf_counter()
            if due - began > seconds:
                break
            if due > now:
                time.sleep(due - now)
            else:
                behind = max(behind, now - due)
            status, body = connections[lane].send(request)
            sent += 1
            if status == 202:
                max_seq = max(max_seq, orjson.loads(body)["stream_sequence"])
            else:
                errors += 1
        outcome[lane] = {"sent": sent, "errors": errors, "max_seq": max_seq, "max_behind_s": behind}

    threads = [threading.Thread(target=send, args=(lane,)) for lane in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ended = time.perf_counter()
    results.put({"sent": sum(o["sent"] for o in outcome), "errors": sum(o["errors"] for o in outcome),
                 "max_seq": max(o["max_seq"] for o in outcome), "seconds": ended - began,
                 "max_behind_s": max(o["max_behind_s"] for o in outcome)})


class LagProbe:
    """Posts 1-block events to the entry replica and times, per replica, answer -> visible."""

    def __init__(self, entry: Indexer, replicas: list[Indexer]) -> None:
        self.entry = Connection(entry.url, timeout=30)
        self.entry_url = entry.url
        self.readers = {r.name: Connection(r.url, timeout=30) for r in replicas}
        self.urls = {r.name: r.url for r in replicas}
        self.rng = random.Random(5)
        self.event_id = 0
        self.worker = str(PROBE_WORKER).encode()
        self.max_seq = 0
        self.turn = 0
        self.poll_round_trips: list[float] = []

    def once(self) -> tuple[dict[str, float | None], float]:
        """({replica: lag in seconds, None: not visible within PROBE_TIMEOUT_S}, post round trip)."""
        local, external = self.rng.getrandbits(62) + 1, self.rng.getrandbits(62) + 1
        document = orjson.dumps({f"{LAG_MODEL}:default": {"block_size": BLOCK_SIZE, "events": [{
            "worker_id": PROBE_WORKER, "storage_tier": "device", "event": {
                "event_id": self.event_id, "dp_rank": 0, "data": {"stored": {
                    "parent_hash": None, "blocks": [{"block_hash": external, "tokens_hash": local}]}}}}]}})
        self.event_id += 1
        queries = {name: post_request(self.urls[name], "/query_by_hash",
                                      orjson.dumps({"model_name": LAG_MODEL, "block_hashes": [local]}))
                   for name in self.readers}
        sent = time.perf_counter()
        status, body = self.entry.send(post_request(self.entry_url, "/events", document))
        answered = time.perf_counter()
        if status != 202:
            raise RuntimeError(f"probe POST /events -> {status} {body[:200]!r}")
        self.max_seq = max(self.max_seq, orjson.loads(body)["stream_sequence"])
        lags: dict[str, float | None] = dict.fromkeys(self.readers)
        names = list(self.readers)
        self.turn += 1  # each probe starts polling at another replica: no replica always waits for the others
        pending = names[self.turn % len(names):] + names[:self.turn % len(names)]
        while pending:
            for name in list(pending):
                polled = time.perf_counter()
                status, body = self.readers[name].send(queries[name])
                now = time.perf_counter()
                self.poll_round_trips.append(now - polled)
                if status == 200 and self.worker in body:
                    lags[name] = now - answered
                    pending.remove(name)
            waited = time.perf_counter() - answered
            if waited > PROBE_TIMEOUT_S:
                break
            if pending:
                time.sleep(min(0.005, max(0.0002, waited * 0.05)))
        return lags, answered - sent

    def close(self) -> None:
        self.entry.close()
        for connection in self.readers.values():
            connection.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def lag_level(report: Report, plan: Plan, replicas: list[Indexer], level: str, posts_per_s: float,
              stream: int) -> dict[str, Any]:
    entry = replicas[0]
    spawn = multiprocessing.get_context("spawn")
    ready, start, results = spawn.Event(), spawn.Event(), spawn.Queue()
    child = spawn.Process(target=_lag_load, args=(entry.url, next_worker_base(), stream, posts_per_s,
                                                  plan.lag_seconds, LAG_LANES, ready, start, results), daemon=True)
    child.start()
    if not ready.wait(120):
        raise RuntimeError("the lag load generator did not get ready")
    probe = LagProbe(entry, replicas)
    samples: dict[str, list[float]] = {r.name: [] for r in replicas}
    timeouts: dict[str, int] = {r.name: 0 for r in replicas}
    round_trips: list[float] = []
    with probes_for(replicas) as probes:
        before = counters(probes)
        cpu_before = {r.name: cpu_seconds(r.pid) for r in replicas}
        start.set()
        began = time.perf_counter()
        next_probe = began + plan.probe_interval_s
        while time.perf_counter() - began < plan.lag_seconds:
            delay = next_probe - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            next_probe += plan.probe_interval_s
            lags, round_trip = probe.once()
            round_trips.append(round_trip)
            for name, lag in lags.items():
                if lag is None:
                    timeouts[name] += 1
                else:
                    samples[name].append(lag)
        load = results.get(timeout=120)
        load_ended = time.perf_counter()
        child.join(30)
        end_seq = max(load["max_seq"], probe.max_seq)
        done, last = wait_applied(probes, end_seq)
        cpu_after = {r.name: cpu_seconds(r.pid) for r in replicas}
        after = counters(probes)
    probe.close()
    if len(done) != len(replicas):
        report.note(f"lag {level}: replicas below seq {end_seq} {WAIT_APPLIED_TIMEOUT_S:.0f} s after the load: {last}")
    measured = time.perf_counter() - began
    row: dict[str, Any] = {
        "level": level, "posts_per_s_asked": posts_per_s,
        "posts_per_s_sent": load["sent"] / load["seconds"],
        "blocks_per_s_sent": load["sent"] * EVENT_BLOCKS / load["seconds"],
        "load_errors": load["errors"], "load_max_behind_s": load["max_behind_s"],
        "probes": len(round_trips), "probe_post_rtt_p50_ms": percentile(round_trips, 50) * 1000,
        "poll_rtt_p50_ms": percentile(probe.poll_round_trips, 50) * 1000,
        "catch_up_s": max(done.values(), default=float("nan")) - load_ended,
        "lag_ms": {name: {"p50": percentile(v, 50) * 1000, "p99": percentile(v, 99) * 1000,
                          "max": max(v, default=float("nan")) * 1000, "samples": len(v), "timeouts": timeouts[name]}
                   for name, v in samples.items()},
        "cpu_s": {name: cpu_after[name] - cpu_before[name] for name in cpu_after},
        "cpu_busy": sum(cpu_after[n] - cpu_before[n] for n in cpu_after) / measured,
        "snapshots_written": sum(delta(after, before, "snapshots_written_total").values()),
        "snapshot_seconds": {name: after[name]["snapshot_seconds"] for name in after},
        "final_lag_gauge": {name: after[name]["lag"] for name in after},
    }
    if load["errors"]:
        report.note(f"lag {level}: {load['errors']} background POSTs not answered 202")
    if any(timeouts.values()):
        report.note(f"lag {level}: probes not visible within {PROBE_TIMEOUT_S:.0f} s: {timeouts}")
    progress(f"lag {level:<5} {row['blocks_per_s_sent']:>9,.0f} blocks/s ({row['posts_per_s_sent']:,.0f} posts/s "
             f"sent): " + ", ".join(f"{n} p50 {v['p50']:.2f} / p99 {v['p99']:.2f} ms" for n, v in row["lag_ms"].items())
             + f" (polls {row['poll_rtt_p50_ms']:.2f} ms); replicas busy {row['cpu_busy']:.0%} of CPU 0; "
             f"snapshots {row['snapshots_written']:.0f}; "
             f"catch-up after load {row['catch_up_s']:.2f} s")
    return row


def run_lag(report: Report, plan: Plan, procs: Processes) -> None:
    progress("lag: 3 replicas (stream LAG) on CPU 0")
    replicas = procs.replicas("LAG", [("A", SERVER_CPU), ("B", SERVER_CPU), ("C", SERVER_CPU)])
    capacity = [row["blocks_per_s"] for row in report.ingest
                if row["config"] == "3 replicas" and row["events_per_post"] == 1]
    if capacity:
        heavy_blocks = HEAVY_FRACTION * statistics.median(capacity)
        basis = f"{HEAVY_FRACTION:.0%} of the measured 3-replica capacity at 1 event/POST"
    else:
        heavy_blocks = HEAVY_FALLBACK_BLOCKS_PER_S
        basis = "no ingest measurement in this run: a fixed rate"
    heavy_posts = heavy_blocks / EVENT_BLOCKS
    report.meta["lag_heavy_basis"] = basis
    for level, posts_per_s, stream in (("light", LIGHT_POSTS_PER_S, 40), ("heavy", heavy_posts, 42)):
        report.lag.append(lag_level(report, plan, replicas, level, posts_per_s, stream))
        settle(replicas, report, f"after lag {level}")


# --- 3. reads -----------------------------------------------------------------------------------


def run_reads(report: Report, plan: Plan, procs: Processes, scratch: Path) -> None:
    progress("reads: single indexer (CPU 0), replica A (CPU 0) and replica B (CPU 1) on stream READS")
    single = procs.start("single", SERVER_CPU)
    a, b = procs.replicas("READS", [("A", SERVER_CPU), ("B", CLIENT_CPU)])
    trace = load_trace()
    fill = TraceFill(trace)
    started = time.monotonic()
    events = list(fill.events(plan.read_pairs))
    ids_single, ids_replica = EventIds(), EventIds()
    last_seq = 0
    with httpx.Client(timeout=120) as client:
        for start in range(0, len(events), FILL_EVENTS_PER_POST):
            chunk = events[start:start + FILL_EVENTS_PER_POST]
            _expect(client.post(single.url + "/events", content=events_document(READ_MODEL, chunk, ids_single),
                                headers=JSON_HEADERS), 200)
            answer = _expect(client.post(a.url + "/events", content=events_document(READ_MODEL, chunk, ids_replica),
                                         headers=JSON_HEADERS), 202).json()
            last_seq = max(last_seq, answer["stream_sequence"])
    with probes_for([a, b]) as probes:
        done, last = wait_applied(probes, last_seq)
    if len(done) != 2:
        report.note(f"reads: replicas did not apply the fill (seq {last_seq}): {last}")
    progress(f"reads: indexed {fill.pairs:,} (block, worker) pairs ({len(events):,} events, {fill.requests_used:,} "
             f"trace requests) on the single indexer and through the stream in {time.monotonic() - started:.1f} s")
    dynamo = procs.start_reference("dynamo")
    if dynamo is None:
        report.note(f"reads: no Dynamo 1.6.1 row: {reference_server.reference_unavailable_reason()}")
    else:
        context = zmq.Context()
        feed = ReferenceFeed(context, dynamo.url, READ_MODEL, sorted({event.worker for event in events}))
        feed.publish((event.worker, event.zmq_payload()) for event in events)
        feed.sync()  # its sentinels are in Dynamo's index only: the query below does not touch them
        feed.close(unregister=False)
        context.term()
    body = query_body(READ_MODEL, query_locals(trace))
    query_file = scratch / "query_by_hash.json"
    query_file.write_bytes(body)
    answers = {s.name: _expect(httpx.post(s.url + "/query_by_hash", content=body, headers=JSON_HEADERS), 200).json()
               for s in (single, a, b, *([dynamo] if dynamo else []))}
    if not all(answer["scores"] == answers["single"]["scores"] for answer in answers.values()):
        report.note(f"reads: the query's scores differ: { {k: v['scores'] for k, v in answers.items()} }")
    report.meta["reads_pairs"] = fill.pairs
    report.meta["reads_scores"] = answers["A"]["scores"]
    args = ["/query_by_hash", str(query_file)]

    def wrk(url: str, connections: int, seconds: float, cpus: str) -> WrkResult:
        return run_wrk(url, "post_static.lua", args, connections=connections, duration_s=seconds,
                       cpu=cpus)  # type: ignore[arg-type]  (taskset -c takes a list too)

    def side_by_side(urls: list[str], seconds: float, cpus: str) -> list[WrkResult]:
        out: list[WrkResult | BaseException | None] = [None] * len(urls)

        def one(index: int) -> None:
            try:
                out[index] = wrk(urls[index], READ_CONNECTIONS // len(urls), seconds, cpus)
            except BaseException as exc:  # noqa: BLE001 - reported below
                out[index] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in out:
            if not isinstance(result, WrkResult):
                raise WrkError(str(result))
        return out  # type: ignore[return-value]

    client_cpu, any_cpu = str(CLIENT_CPU), f"{SERVER_CPU},{CLIENT_CPU}"
    configs = [("single (no --nats), CPU 0", [single], client_cpu), ("1 replica (A, CPU 0)", [a], client_cpu),
               ("2 replicas (A CPU 0 + B CPU 1)", [a, b], client_cpu),
               ("2 replicas, wrk on either CPU", [a, b], any_cpu)]
    if dynamo is not None:
        # The whole machine: Dynamo free to use both CPUs, as its services do, beside two wrk
        # processes of c=32 (the load the two replicas get), also free to run anywhere.
        twin = dataclasses.replace(dynamo, name="dynamo (2nd wrk)")
        configs.append(("Dynamo 1.6.1 unpinned, wrk on either CPU", [dynamo, twin], any_cpu))
    for rep in range(1, plan.read_reps + 1):
        for label, servers, cpus in configs:
            urls = [s.url for s in servers]
            try:
                if plan.read_warmup_s > 0:
                    side_by_side(urls, plan.read_warmup_s, cpus)
                cpu_before = {s.name: cpu_seconds(s.pid) for s in servers}
                results = side_by_side(urls, plan.read_duration_s, cpus)
                cpu_after = {s.name: cpu_seconds(s.pid) for s in servers}
            except WrkError as exc:
                report.note(f"reads {label} rep {rep}: wrk failed: {exc}")
                continue
            row = {"config": label, "rep": rep, "connections": READ_CONNECTIONS, "wrk_cpus": cpus,
                   "rps": sum(r.rps for r in results),
                   "per_server": {s.name: r.as_dict() for s, r in zip(servers, results)},
                   "server_cpu_busy": {s.name: (cpu_after[s.name] - cpu_before[s.name]) / results[0].duration_s
                                       for s in servers},
                   "errors": sum(r.errors for r in results)}
            if row["errors"]:
                report.note(f"reads {label} rep {rep}: {row['errors']} wrk errors")
            report.reads.append(row)
            progress(f"reads  {label:<32} rep {rep}: {row['rps']:>9,.0f} req/s  ("
                     + ", ".join(f"{s.name} {r.rps:,.0f} req/s p50 {r.p50_us / 1000:.2f} ms, "
                                 f"{row['server_cpu_busy'][s.name]:.0%} CPU" for s, r in zip(servers, results)) + ")")


# --- the summary --------------------------------------------------------------------------------


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [row[key] for row in rows if row.get(key) == row.get(key)]  # drops NaN
    return statistics.median(values) if values else float("nan")


def _spread(rows: list[dict[str, Any]], key: str) -> str:
    values = [row[key] for row in rows]
    return f" ({min(values):,.0f}-{max(values):,.0f})" if len(values) > 1 else ""


def summary_rows(report: Report) -> list[tuple[str, str, str, str]]:
    table: list[tuple[str, str, str, str]] = []
    for per_post in PER_POST_VARIANTS:
        for config in ("single (no --nats)", "1 replica", "3 replicas"):
            rows = [r for r in report.ingest if r["events_per_post"] == per_post and r["config"] == config]
            if not rows:
                continue
            events_s, blocks_s = _median(rows, "events_per_s"), _median(rows, "blocks_per_s")
            cpu = statistics.median(sum(v for k, v in r["cpu_s"].items() if k != "nats") / r["events"] * 1e6
                                    for r in rows)
            nats = statistics.median(r["cpu_s"]["nats"] / r["events"] * 1e6 for r in rows)
            if config.startswith("single"):
                detail = f"indexer CPU {cpu:,.0f} us/event"
            else:
                names = [k for k in rows[0]["cpu_s"] if k != "nats"]
                each = ", ".join(f"{name} {statistics.median(r['cpu_s'][name] / r['events'] * 1e6 for r in rows):,.0f}"
                                 for name in names)
                detail = (f"202s at {_median(rows, 'accepted_events_per_s'):,.0f} events/s; CPU us/event: "
                          f"{each}, nats {nats:,.0f}")
            table.append(((f"ingest /events, {per_post} event{'s' if per_post > 1 else ''}/POST, "
                           f"{INGEST_CONNECTIONS} conns (events/s end to end)"), config,
                          f"{events_s:,.0f}{_spread(rows, 'events_per_s')} events/s = {blocks_s:,.0f} blocks/s",
                          detail))
    for config in ("single (no --nats)", "1 replica", "3 replicas"):
        rows = [r for r in report.zmq if r["config"] == config]
        if not rows:
            continue
        names = [k for k in rows[0]["cpu_s"] if k != "nats"]
        detail = "CPU us/batch: " + ", ".join(
            f"{name} {statistics.median(r['cpu_s'][name] / r['batches'] * 1e6 for r in rows):,.0f}" for name in names)
        if config != "single (no --nats)":
            detail += (f", nats {statistics.median(r['cpu_s']['nats'] / r['batches'] * 1e6 for r in rows):,.0f}; "
                       f"duplicates {statistics.median(r['duplicates'] for r in rows):,.0f} of "
                       f"{rows[0]['expected_duplicates']:,} expected, {rows[0]['batches']:,} batches")
        table.append((f"ingest ZMQ, {WORKERS} vLLM engines (blocks/s applied on every indexer)", config,
                      f"{_median(rows, 'blocks_per_s'):,.0f}{_spread(rows, 'blocks_per_s')} blocks/s", detail))
    for row in report.lag:
        lags = row["lag_ms"]
        result = "; ".join(f"{name} {v['p50']:.2f} / {v['p99']:.2f}" for name, v in lags.items() if name != "A")
        own = lags.get("A")
        table.append(((f"lag 202 at A -> visible, {row['level']} ({row['blocks_per_s_sent']:,.0f} blocks/s, "
                       f"{row['posts_per_s_sent']:,.0f} posts/s)"), "3 replicas, p50 / p99 ms",
                      result, (f"A itself {own['p50']:.2f} / {own['p99']:.2f} ms; " if own else "")
                      + f"{lags['B']['samples']} probes, poll round trip {row['poll_rtt_p50_ms']:.2f} ms; "
                      f"replicas {row['cpu_busy']:.0%} of CPU 0"))
    for config in dict.fromkeys(r["config"] for r in report.reads):
        rows = [r for r in report.reads if r["config"] == config]
        per_server = {name: statistics.median(r["per_server"][name]["rps"] for r in rows) for name in rows[0]["per_server"]}
        busy = {name: statistics.median(r["server_cpu_busy"][name] for r in rows) for name in per_server}
        where = ("wrk on CPU 1" if rows[0]["wrk_cpus"] == str(CLIENT_CPU)
                 else "wrk unpinned (either CPU)")
        detail = ("; ".join(f"{n} {v:,.0f} req/s ({busy[n]:.0%} CPU)" for n, v in per_server.items())
                  + f"; {where}" + (f", c={READ_CONNECTIONS // len(per_server)} per replica" if len(per_server) > 1
                                    else ""))
        table.append(((f"reads /query_by_hash, 512 hashes, c={READ_CONNECTIONS}, "
                       f"{report.meta.get('reads_pairs', 0) / 1e3:.0f}k pairs"), config,
                      f"{_median(rows, 'rps'):,.0f}{_spread(rows, 'rps')} req/s", detail))
    return table


def print_table(report: Report) -> None:
    rows = summary_rows(report)
    print()
    print(f"Indexer replicas over NATS JetStream ({report.meta.get('cpu', '')}, {report.meta.get('cpus')} CPUs; "
          f"indexers on CPU {SERVER_CPU}, nats-server + clients + wrk on CPU {CLIENT_CPU}; load average "
          f"{report.meta.get('loadavg_start', [0])[0]:.2f} at start, {report.meta.get('loadavg_end', [0])[0]:.2f} "
          "at end)")
    print()
    print("| Measure | Configuration | Result | Detail |")
    print("|---|---|---|---|")
    for measure, config, result, detail in rows:
        print(f"| {measure} | {config} | {result} | {detail} |")
    if report.notes:
        print()
        print("Notes:")
        for note in report.notes:
            print(f"- {note}")


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.indexer_replicas", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller runs, one repetition (about 1 minute)")
    parser.add_argument("--output", type=Path, default=None, help="write the numbers as JSON to this file")
    parser.add_argument("--only", default="", help=f"comma-separated phases among {', '.join(PHASES)} (default: all)")
    args = parser.parse_args(argv)
    args.phases = {p.strip() for p in args.only.split(",") if p.strip()} or set(PHASES)
    unknown = args.phases - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; choose among {', '.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if (os.cpu_count() or 1) < 2:
        print(f"needs 2 CPUs (indexers on CPU {SERVER_CPU}, clients on CPU {CLIENT_CPU})", file=sys.stderr)
        return 2
    pin_to_client_cpu()  # nats-server, started from here, inherits CPU 1
    ensure_wrk()
    report = Report()
    report.meta.update(machine_facts())
    report.meta.update(started=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), quick=args.quick,
                       plan=plan.__dict__, phases=sorted(args.phases), loadavg_start=list(os.getloadavg()),
                       layout=f"indexers on CPU {SERVER_CPU}; nats-server, clients and wrk on CPU {CLIENT_CPU}; "
                              f"reads: replica B on CPU {CLIENT_CPU}")
    if report.meta["loadavg_start"][0] > 0.7:
        report.note(f"the machine was busy at start (load average {report.meta['loadavg_start'][0]:.2f})")
    began = time.monotonic()
    logs: list[tuple[str, Path]] = []
    nats: NatsServer | None = None
    foreign = ForeignLoad()
    foreign.start()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_replicas_") as scratch:
            nats = NatsServer(Path(scratch) / "nats")
            nats.start()
            report.meta["nats_server"] = nats.log_text().split("Version:", 1)[-1].split("\n", 1)[0].strip()
            try:
                if args.phases & {"ingest", "zmq", "lag"}:
                    with contextlib.ExitStack() as stack:
                        procs = Processes(stack, nats, logs)
                        if args.phases & {"ingest", "zmq"}:
                            run_ingest(report, plan, args.phases, procs, nats)
                        if "lag" in args.phases:
                            run_lag(report, plan, procs)
                        progress("stopping the ingest and lag processes")
                if "reads" in args.phases:
                    with contextlib.ExitStack() as stack:
                        run_reads(report, plan, Processes(stack, nats, logs), Path(scratch))
                        progress("stopping the reads processes")
            finally:
                scan_logs(report, logs, nats)
                nats.stop()
    finally:
        foreign.stop()
        report.meta["wall_s"] = time.monotonic() - began
        report.meta["loadavg_end"] = list(os.getloadavg())
        report.meta["other_processes_cpu_s"] = foreign.total_s
        report.meta["other_processes_busiest"] = foreign.busiest
        if foreign.total_s > 0.05 * report.meta["wall_s"]:
            top = sorted(foreign.busiest.items(), key=lambda item: -item[1])[:4]
            report.note(f"other processes used {foreign.total_s:.0f} CPU-s during the {report.meta['wall_s']:.0f} s "
                        f"run ({foreign.total_s / report.meta['wall_s']:.0%} of one CPU on average); busiest: "
                        + "; ".join(f"{command} (up to {share:.0%})" for command, share in top))
        if args.output is not None:
            args.output.write_text(json.dumps(report.to_json(), indent=1) + "\n")
            progress(f"wrote {args.output}")
    progress(f"done in {report.meta['wall_s'] / 60:.1f} min")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
