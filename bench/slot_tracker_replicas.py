"""Slot tracker replicas over NATS core (`--nats`) on this machine: what publishing costs a
replica, and how stale the other replica is. Prints numbers; never passes or fails.

    .venv/bin/python -m bench.slot_tracker_replicas            # about 5 minutes
    .venv/bin/python -m bench.slot_tracker_replicas --quick    # about 1 minute

Layout (2 CPUs): the measured process (the single one without `--nats`, or replica A) on CPU 0;
nats-server (Debian's, default settings: 1 MB max_payload), replica B, wrk and this process on
CPU 1.

1. throughput: wrk with bench/lua/lifecycle.lua (`/add` of 256 hashes, `/prefill_complete`,
   `/free`, each id once; c=64, as `python -m bench`'s lifecycle scenario) against one process
   without `--nats`, one replica alone, and replica A while replica B follows; replicas with
   answers waiting for the NATS server (the default) and answering at once
   (`--nats-publish-timeout-secs 0`). With B, "B behind" is how long after wrk ended B had
   applied every op A published during the run. Every configuration runs side by side (idle
   but for the one measured); rounds interleave them and each row is the median, so other work
   on a shared machine weighs on all alike.
2. staleness: a child process sends lifecycles to A at a fixed rate over 4 keep-alive
   connections (each connection adds, completes and frees its own requests, 256 hashes each).
   Meanwhile a probe adds a request with a unique token count to a probe worker on A every
   20 ms and, from A's answer on, polls B's `/loads` (of the probe's model only) until that rank
   shows the tokens: staleness = A's answer -> visible on B. Also B's
   `dynamo_lite_slot_tracker_replication_delay_seconds` over the same time (from a batch's
   acceptance on A to its application on B), p50/p99 interpolated in its buckets.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
from support import reference_server  # noqa: E402  (tests/, put on sys.path by .servers; needs no pytest)

from .http_post import Connection, post_request
from .runner import progress
from .seed import hash_lists, register_tracker, reset_tracker, shape_for, write_hash_lists
from .servers import CLIENT_CPU, SERVER_CPU, pin_to_client_cpu
from .slot_tracker_http import LIFECYCLE_LAG
from .wrk import WrkError, ensure_wrk, run_wrk

MODEL = "lifecycle"
PROBE_MODEL = "probe"
PROBE_WORKER = 999
PROBE_INTERVAL_S = 0.020
PROBE_TIMEOUT_S = 10.0
DRIVER_CONNECTIONS = 4
DRIVER_LAG = 64  # each connection completes a request this many adds later, and frees it twice as late
WRK_CONNECTIONS = 64


@dataclass(frozen=True)
class Plan:
    rounds: int  # of every throughput configuration, interleaved
    wrk_seconds: float
    warmup_seconds: float
    staleness_seconds: float
    rates: tuple[float, ...]  # lifecycles per second sent to A; 0: the probe alone


FULL = Plan(rounds=3, wrk_seconds=8, warmup_seconds=2, staleness_seconds=10, rates=(0, 100, 500))
QUICK = Plan(rounds=1, wrk_seconds=3, warmup_seconds=1, staleness_seconds=4, rates=(0, 100, 500))


# --- processes -----------------------------------------------------------------------------------


@contextlib.contextmanager
def nats_server(directory: Path) -> Iterator[str]:
    """Debian's nats-server with its defaults, on a free loopback port, pinned to the client CPU."""
    binary = shutil.which("nats-server")
    if binary is None:
        raise SystemExit("nats-server is not installed (Debian: apt-get install nats-server)")
    port = reference_server.free_port()
    config = directory / "nats-server.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\n")
    log = open(directory / "nats-server.log", "wb")
    process = subprocess.Popen(["taskset", "-c", str(CLIENT_CPU), binary, "-c", str(config)],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"nats-server did not start: {(directory / 'nats-server.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def tracker(cpu: int, *flags: str) -> contextlib.AbstractContextManager[reference_server.ServerURL]:
    port = reference_server.free_port()
    argv = ["taskset", "-c", str(cpu), sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *flags]
    return reference_server.running_server(argv, port, ready_path="/ready", timeout=60)


def replica(cpu: int, nats_url: str, *flags: str) -> contextlib.AbstractContextManager[reference_server.ServerURL]:
    return tracker(cpu, "--nats", nats_url, "--nats-join-timeout-secs", "0.3", *flags)


PUBLISHED = "dynamo_lite_slot_tracker_replication_ops_published_total"
APPLIED = "dynamo_lite_slot_tracker_replication_ops_applied_total"


def caught_up(a: str, b: str, timeout: float = 60.0) -> None:
    """Wait until B answers the /loads A answers (both idle)."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{a}/loads", timeout=30).json() != httpx.get(f"{b}/loads", timeout=30).json():
        if time.monotonic() > deadline:
            raise RuntimeError("B did not catch up with A")
        time.sleep(0.01)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    raise KeyError(name)


def delay_buckets(url: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of B's replication delay histogram."""
    buckets = []
    prefix = "dynamo_lite_slot_tracker_replication_delay_seconds_bucket{le=\""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(prefix):
            bound = line[len(prefix):line.index('"', len(prefix))]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    return buckets


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of the observations between two scrapes, linear within its bucket."""
    counts = [(bound, later - earlier) for (bound, earlier), (_, later) in zip(before, after)]
    total = counts[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    lower = 0.0
    previous = 0.0
    for bound, cumulative in counts:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - previous
            return lower + (bound - lower) * ((rank - previous) / inside if inside else 1.0)
        lower, previous = bound, cumulative
    return lower


# --- 1. throughput ---------------------------------------------------------------------------------


def throughput(plan: Plan, nats_url: str, lists_file: Path) -> list[dict[str, object]]:
    """Every configuration runs at once (idle but for the one measured), each pair of replicas
    on its own subjects; rounds interleave the configurations, and each row is their median:
    other work on the machine then weighs on all of them alike."""
    shape = shape_for(MODEL, 16)
    args = lambda run_id: [run_id, shape.model, str(lists_file), str(shape.workers), str(shape.dp_size),  # noqa: E731
                           str(LIFECYCLE_LAG)]
    runs: dict[str, list[dict[str, float]]] = {}

    def measure(label: str, url: str, follower: str | None = None) -> None:
        reset_tracker(url, shape)
        run_id = f"{len(runs.get(label, []))}-{time.monotonic_ns()}"
        try:
            run_wrk(url, "lifecycle.lua", args(run_id + "w"), connections=WRK_CONNECTIONS,
                    duration_s=plan.warmup_seconds, cpu=CLIENT_CPU)
            reset_tracker(url, shape)
            if follower is not None:
                caught_up(url, follower)
                published = metric(url, PUBLISHED)
                applied = metric(follower, APPLIED)
            result = run_wrk(url, "lifecycle.lua", args(run_id), connections=WRK_CONNECTIONS,
                             duration_s=plan.wrk_seconds, cpu=CLIENT_CPU)
        except WrkError as exc:
            progress(f"{label}: wrk failed: {exc}")
            return
        behind = float("nan")
        if follower is not None:
            ended = time.monotonic()
            target = applied + metric(url, PUBLISHED) - published
            while metric(follower, APPLIED) < target:
                if time.monotonic() - ended > 60:
                    raise RuntimeError(f"B did not apply A's ops within 60 s ({metric(follower, APPLIED)} < {target})")
                time.sleep(0.005)
            behind = time.monotonic() - ended
        runs.setdefault(label, []).append({"rps": result.rps, "p50_ms": result.p50_us / 1000,
                                           "p99_ms": result.p99_us / 1000, "errors": result.errors,
                                           "behind_s": behind})
        progress(f"{label:<46} {result.rps:>9,.0f} req/s  p50 {result.p50_us / 1000:6.2f} ms  "
                 f"p99 {result.p99_us / 1000:6.2f} ms" + (f"  B behind {behind:.2f} s" if follower else ""))

    at_once = ("--nats-publish-timeout-secs", "0")
    with contextlib.ExitStack() as stack:
        def start(cpu: int, *flags: str) -> str:
            return stack.enter_context(tracker(cpu, *flags))

        def pair(prefix: str, *flags: str) -> tuple[str, str]:
            subjects = ("--nats", nats_url, "--nats-join-timeout-secs", "0.3", "--nats-subject-prefix", prefix)
            a = start(SERVER_CPU, *subjects, *flags)
            with httpx.Client(base_url=a, timeout=60) as client:
                register_tracker(client, shape)
            return a, start(CLIENT_CPU, *subjects)

        single = start(SERVER_CPU)
        with httpx.Client(base_url=single, timeout=60) as client:
            register_tracker(client, shape)
        configs: list[tuple[str, str, str | None]] = [("one process, no --nats", single, None)]
        for name, flags, answers in (("wait", (), "answers wait for NATS"), ("once", at_once, "answers at once")):
            alone = start(SERVER_CPU, "--nats", nats_url, "--nats-join-timeout-secs", "0.3",
                          "--nats-subject-prefix", f"bench.alone.{name}", *flags)
            with httpx.Client(base_url=alone, timeout=60) as client:
                register_tracker(client, shape)
            a, b = pair(f"bench.pair.{name}", *flags)
            configs += [(f"one replica alone, {answers}", alone, None), (f"replica A, B following, {answers}", a, b)]
        for _ in range(plan.rounds):
            for label, url, follower in configs:
                measure(label, url, follower)
        for _, url, _ in configs:
            reset_tracker(url, shape)
    rows = []
    for label, results in runs.items():
        rows.append({"config": label, "runs": len(results),
                     **{key: statistics.median(run[key] for run in results)
                        for key in ("rps", "p50_ms", "p99_ms", "behind_s")},
                     "rps_range": (min(run["rps"] for run in results), max(run["rps"] for run in results))})
    return rows


# --- 2. staleness ----------------------------------------------------------------------------------


def drive(url: str, rate: float, seconds: float, lists: list[list[int]], ready: multiprocessing.Event) -> None:
    """Child process: `rate` lifecycles per second to `url`, spread over DRIVER_CONNECTIONS threads."""
    pin_to_client_cpu()
    shape = shape_for(MODEL, 16)

    def lane(number: int) -> None:
        connection = Connection(url)
        interval = DRIVER_CONNECTIONS / rate
        step = 0
        pending: list[str] = []
        prefilled: list[str] = []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            request_id = f"d{number}-{step}"
            slot = step % shape.ranks
            body = orjson.dumps({"model_name": MODEL, "request_id": request_id, "worker_id": slot % shape.workers + 1,
                                 "dp_rank": slot // shape.workers, "sequence_hashes": lists[step % len(lists)],
                                 "new_isl_tokens": 4096})
            connection.send(post_request(url, "/add", body))
            pending.append(request_id)
            if len(pending) > DRIVER_LAG:
                done = pending.pop(0)
                connection.send(post_request(url, "/prefill_complete", orjson.dumps(
                    {"model_name": MODEL, "request_id": done})))
                prefilled.append(done)
            if len(prefilled) > DRIVER_LAG:
                connection.send(post_request(url, "/free", orjson.dumps(
                    {"model_name": MODEL, "request_id": prefilled.pop(0)})))
            step += 1
            wait = start + step * interval - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        connection.close()

    ready.wait()
    threads = [threading.Thread(target=lane, args=(number,)) for number in range(DRIVER_CONNECTIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def probe(a: str, b: str, seconds: float) -> list[float]:
    """Staleness samples: A's answer to a probe /add -> B's /loads shows it."""
    samples = []
    to_a, to_b = Connection(a), Connection(b)
    host = b.split("//", 1)[1]
    poll = f"GET /loads?model_name={PROBE_MODEL} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    rng = random.Random(7)
    end = time.monotonic() + seconds
    number = 0
    while time.monotonic() < end:
        number += 1
        tokens = 1_000_000 + number
        request_id = f"probe-{number}"
        body = orjson.dumps({"model_name": PROBE_MODEL, "request_id": request_id, "worker_id": PROBE_WORKER,
                             "dp_rank": 0, "sequence_hashes": [rng.getrandbits(62)], "new_isl_tokens": tokens})
        status, _ = to_a.send(post_request(a, "/add", body))
        answered = time.perf_counter()
        if status != 201:
            raise RuntimeError(f"probe /add answered {status}")
        while True:
            _, loads = to_b.send(poll)
            rows = orjson.loads(loads)
            if rows and rows[0]["active_prefill_tokens"] == tokens:
                samples.append(time.perf_counter() - answered)
                break
            if time.perf_counter() - answered > PROBE_TIMEOUT_S:
                raise RuntimeError("a probe never showed on B")
            time.sleep(0.0002)
        to_a.send(post_request(a, "/free", orjson.dumps({"model_name": PROBE_MODEL, "request_id": request_id})))
        time.sleep(max(0.0, PROBE_INTERVAL_S - (time.perf_counter() - answered)))
    to_a.close()
    to_b.close()
    return samples


def staleness(plan: Plan, nats_url: str, lists: list[list[int]]) -> list[dict[str, object]]:
    shape = shape_for(MODEL, 16)
    rows = []
    with replica(SERVER_CPU, nats_url) as a:
        with httpx.Client(base_url=a, timeout=60) as client:
            register_tracker(client, shape)
            assert client.post("/register", json={"worker_id": PROBE_WORKER, "model_name": PROBE_MODEL,
                                                  "block_size": 16, "dp_start": 0, "dp_size": 1}).status_code == 201
        with replica(CLIENT_CPU, nats_url) as b:
            for rate in plan.rates:
                reset_tracker(a, shape)
                before = delay_buckets(b)
                ready = multiprocessing.Event()
                driver = None
                if rate:
                    driver = multiprocessing.Process(target=drive, args=(a, rate, plan.staleness_seconds + 0.5, lists,
                                                                        ready))
                    driver.start()
                ready.set()
                time.sleep(0.3)
                samples = probe(a, b, plan.staleness_seconds)
                if driver is not None:
                    driver.join(60)
                after = delay_buckets(b)
                samples.sort()
                label = "probe alone" if not rate else f"{rate:.0f} lifecycles/s ({3 * rate:.0f} writes/s)"
                row = {
                    "load": label, "probes": len(samples),
                    "p50_ms": 1000 * statistics.median(samples),
                    "p99_ms": 1000 * samples[min(len(samples) - 1, int(0.99 * len(samples)))],
                    "max_ms": 1000 * samples[-1],
                    "delay_p50_ms": 1000 * quantile(before, after, 0.5),
                    "delay_p99_ms": 1000 * quantile(before, after, 0.99),
                }
                rows.append(row)
                progress(f"{label:<36} {row['probes']:>5} probes  staleness p50 {row['p50_ms']:6.2f} ms  "
                         f"p99 {row['p99_ms']:6.2f} ms  max {row['max_ms']:6.2f} ms  "
                         f"delay metric p50 {row['delay_p50_ms']:.2f} / p99 {row['delay_p99_ms']:.2f} ms")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slot_tracker_replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    # SIGTERM (a `timeout`, a CI job cancelled) unwinds like Ctrl-C: the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 CPUs: the measured process on CPU 0, the rest on CPU 1")
    ensure_wrk()
    pin_to_client_cpu()
    with tempfile.TemporaryDirectory(prefix="bench_replicas_") as scratch:
        directory = Path(scratch)
        lists = hash_lists(256, seed=2)
        lists_file = directory / "lifecycle_hashes.jsonl"
        write_hash_lists(lists_file, lists)
        with nats_server(directory) as nats_url:
            tput = throughput(plan, nats_url, lists_file)
            stale = staleness(plan, nats_url, lists)
    print(f"\nthroughput: lifecycle.lua (/add of 256 hashes, /prefill_complete, /free), wrk c={WRK_CONNECTIONS}, "
          f"{plan.wrk_seconds:g} s runs, median of {plan.rounds} interleaved rounds")
    print("| config | req/s (range) | p50 ms | p99 ms | B behind after the run |\n|---|---|---|---|---|")
    for row in tput:
        low, high = row["rps_range"]
        behind = "" if row["behind_s"] != row["behind_s"] else f"{row['behind_s']:.2f} s"
        print(f"| {row['config']} | {row['rps']:,.0f} ({low:,.0f}-{high:,.0f}) | {row['p50_ms']:.2f} | "
              f"{row['p99_ms']:.2f} | {behind} |")
    print(f"\nstaleness on B of writes answered by A (a probe every {PROBE_INTERVAL_S * 1000:.0f} ms, "
          f"{plan.staleness_seconds:g} s per load)")
    print("| load on A | probes | p50 ms | p99 ms | max ms | delay metric p50 / p99 ms |\n|---|---|---|---|---|---|")
    for row in stale:
        print(f"| {row['load']} | {row['probes']} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['max_ms']:.2f} | "
              f"{row['delay_p50_ms']:.2f} / {row['delay_p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
