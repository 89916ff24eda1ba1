"""Soak test: both services under a realistic mixed load; their RSS must stay flat.

    python -m bench.soak [--minutes 10] [--trace conversation_trace.jsonl]

Starts the slot tracker (with `--request-ttl-secs`) and the indexer (with `--max-blocks` and
`--snapshot`) as subprocesses, then replays a Mooncake trace (JSON lines with `hash_ids`, one
id per 512-token block) in a loop, as a gateway and a fleet of engines would drive them:

* per request: `/query_by_hash` and `/potential_loads` in parallel, `/add` on the least loaded
  rank, the engine's `stored` event for the prompt's blocks, `/prefill_complete`, `/free`;
* every pass over the trace salts the block ids, so new content keeps arriving and the index
  only stays bounded through `--max-blocks`;
* engines evict tail-first beyond their capacity and publish `removed`, but a share of those
  events is lost (`--lost-removals`), as is a share of the frees (`--lost-frees`): without the
  limit and the TTL both services would grow without end.

Every `--sample-secs` it prints each service's RSS and what it holds; at the end it compares
the mean RSS of the last third of the samples with the middle third (the first third is the
warm-up, while the index fills up to its limit) and prints FLAT or GROWING per service. Exit
status 1 when one is growing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from dynamo_lite.hashing import sequence_hashes, to_signed_list

DEFAULT_TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
MODEL = "soak-model"
BLOCK_SIZE = 512
ID_MIX = 0x9E3779B97F4A7C15  # spreads trace ids over 64 bits


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def load_trace(path: Path) -> list[list[int]]:
    with path.open("rb") as lines:
        return [orjson.loads(line)["hash_ids"] for line in lines if line.strip()]


class Engine:
    """One worker's prefix cache: stores whole chains, evicts oldest chains tail-first."""

    def __init__(self, worker_id: int, capacity: int) -> None:
        self.worker_id = worker_id
        self.capacity = capacity
        self.chains: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # tail -> chain
        self.held = 0
        self.event_id = 0

    def store(self, chain: list[int]) -> list[int]:
        """The chain's hashes to announce; returns the hashes evicted to make room."""
        tail = chain[-1]
        if tail in self.chains:
            self.chains.move_to_end(tail)
        else:
            self.chains[tail] = chain
            self.held += len(chain)
        evicted: list[int] = []
        while self.held > self.capacity and len(self.chains) > 1:
            _, old = self.chains.popitem(last=False)
            self.held -= len(old)
            evicted.extend(reversed(old))
        return evicted

    def next_event_id(self) -> int:
        self.event_id += 1
        return self.event_id - 1


def stored_document(engine: Engine, externals: list[int], locals_: list[int]) -> dict:
    return {f"{MODEL}:default": {"block_size": BLOCK_SIZE, "events": [{
        "worker_id": engine.worker_id, "event": {"event_id": engine.next_event_id(), "dp_rank": 0, "data": {
            "stored": {"parent_hash": None, "blocks": [
                {"block_hash": e, "tokens_hash": t} for e, t in zip(externals, locals_)]}}}}]}}


def removed_document(engine: Engine, externals: list[int]) -> dict:
    return {f"{MODEL}:default": {"block_size": BLOCK_SIZE, "events": [{
        "worker_id": engine.worker_id, "event": {"event_id": engine.next_event_id(), "dp_rank": 0, "data": {
            "removed": {"block_hashes": externals}}}}]}}


class Load:
    def __init__(self, args: argparse.Namespace, tracker: str, indexer: str, trace: list[list[int]]) -> None:
        self.args = args
        self.tracker = tracker
        self.indexer = indexer
        self.trace = trace
        self.rng = random.Random(args.seed)
        self.engines = [Engine(w, args.engine_capacity) for w in range(args.workers)]
        self.requests = 0
        self.errors = 0
        self.next_index = 0

    def next_prompt(self) -> tuple[list[int], list[int]]:
        position = self.next_index
        self.next_index += 1
        salt, line = divmod(position, len(self.trace))
        ids = self.trace[line]
        locals_ = [((i + 1) * ID_MIX ^ salt * 0xD1B54A32D192ED03) & (2**64 - 1) for i in ids]
        return locals_, sequence_hashes(locals_)

    async def setup(self, client: httpx.AsyncClient) -> None:
        for engine in self.engines:
            await self._post(client, f"{self.tracker}/register", {
                "worker_id": engine.worker_id, "model_name": MODEL, "block_size": BLOCK_SIZE,
                "dp_start": 0, "dp_size": 1})
            await self._post(client, f"{self.indexer}/register", {
                "instance_id": engine.worker_id, "model_name": MODEL, "block_size": BLOCK_SIZE})

    async def _post(self, client: httpx.AsyncClient, url: str, body: object) -> httpx.Response | None:
        try:
            response = await client.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        except httpx.HTTPError:
            self.errors += 1
            return None
        if response.status_code >= 400:
            self.errors += 1
        return response

    async def one_request(self, client: httpx.AsyncClient) -> None:
        rng = self.rng
        locals_, chained = self.next_prompt()
        signed_chain = to_signed_list(chained)
        await asyncio.gather(
            self._post(client, f"{self.indexer}/query_by_hash",
                       {"model_name": MODEL, "block_hashes": to_signed_list(locals_)}),
            self._post(client, f"{self.tracker}/potential_loads",
                       {"model_name": MODEL, "sequence_hashes": signed_chain, "new_isl_tokens": 0}),
        )
        engine = rng.choice(self.engines)
        request_id = f"soak-{self.requests}"
        self.requests += 1
        await self._post(client, f"{self.tracker}/add", {
            "model_name": MODEL, "request_id": request_id, "worker_id": engine.worker_id, "dp_rank": 0,
            "sequence_hashes": signed_chain, "new_isl_tokens": len(locals_) * BLOCK_SIZE})
        evicted = engine.store(chained)
        await self._post(client, f"{self.indexer}/events", stored_document(engine, chained, locals_))
        if evicted and rng.random() >= self.args.lost_removals:
            await self._post(client, f"{self.indexer}/events", removed_document(engine, evicted))
        await self._post(client, f"{self.tracker}/prefill_complete", {"model_name": MODEL, "request_id": request_id})
        if rng.random() >= self.args.lost_frees:
            await self._post(client, f"{self.tracker}/free", {"model_name": MODEL, "request_id": request_id})

    async def run(self, until: float) -> None:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
            await self.setup(client)

            async def user() -> None:
                while time.monotonic() < until:
                    await self.one_request(client)

            await asyncio.gather(*(user() for _ in range(self.args.concurrency)))


async def held_state(tracker: str, indexer: str) -> tuple[int, int]:
    """(device blocks in the index, active decode blocks in the slot tracker)."""
    async with httpx.AsyncClient(timeout=30) as client:
        workers = (await client.get(f"{indexer}/workers")).json()
        loads = (await client.get(f"{tracker}/loads")).json()
    return (sum(rank["blocks"] for worker in workers for rank in worker["ranks"]),
            sum(load["active_decode_blocks"] for load in loads))


async def sample(args: argparse.Namespace, load: Load, pids: dict[str, int], until: float,
                 samples: dict[str, list[float]]) -> None:
    started = time.monotonic()
    last_requests = 0
    print(f"{'time':>6} {'requests/s':>10} {'tracker MiB':>12} {'indexer MiB':>12} {'index blocks':>13} "
          f"{'decode blocks':>14} {'errors':>7}", flush=True)
    while True:
        await asyncio.sleep(min(args.sample_secs, max(0.0, until - time.monotonic())))
        now = time.monotonic()
        for name, pid in pids.items():
            samples[name].append(rss_mib(pid))
        indexed, decoding = await held_state(load.tracker, load.indexer)
        rate = (load.requests - last_requests) / args.sample_secs
        last_requests = load.requests
        print(f"{now - started:6.0f} {rate:10.0f} {samples['slot tracker'][-1]:12.1f} "
              f"{samples['indexer'][-1]:12.1f} {indexed:13,} {decoding:14,} {load.errors:7}", flush=True)
        if now >= until:
            return


def verdict(series: list[float], tolerance: float) -> tuple[str, float]:
    third = len(series) // 3
    middle = statistics.fmean(series[third: 2 * third])
    last = statistics.fmean(series[2 * third:])
    growth = (last - middle) / middle
    return ("FLAT" if growth <= tolerance else "GROWING"), growth


def start_services(args: argparse.Namespace, workdir: Path) -> tuple[list[subprocess.Popen], str, str]:
    tracker_port, indexer_port = free_port(), free_port()
    python = [sys.executable, "-m"]
    common = ["--host", "127.0.0.1", "--log-level", "warning"]
    tracker = subprocess.Popen(
        [*python, "dynamo_lite.slot_tracker", *common, "--port", str(tracker_port),
         "--request-ttl-secs", str(args.request_ttl_secs)],
        stdout=(workdir / "slot_tracker.log").open("w"), stderr=subprocess.STDOUT)
    indexer = subprocess.Popen(
        [*python, "dynamo_lite.indexer", *common, "--port", str(indexer_port),
         "--max-blocks", str(args.max_blocks), "--snapshot", str(workdir / "index.json"),
         "--snapshot-interval-secs", str(args.snapshot_interval_secs)],
        stdout=(workdir / "indexer.log").open("w"), stderr=subprocess.STDOUT)
    urls = f"http://127.0.0.1:{tracker_port}", f"http://127.0.0.1:{indexer_port}"
    deadline = time.monotonic() + 30
    for url, process in zip(urls, (tracker, indexer)):
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{url}: service exited with {process.returncode}; logs in {workdir}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}: not healthy after 30 s; logs in {workdir}")
            time.sleep(0.1)
    return [tracker, indexer], *urls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-blocks", type=int, default=20_000, help="the indexer's --max-blocks")
    parser.add_argument("--engine-capacity", type=int, default=4_000, help="blocks each engine caches")
    parser.add_argument("--request-ttl-secs", type=float, default=20.0, help="the slot tracker's TTL")
    parser.add_argument("--snapshot-interval-secs", type=float, default=15.0)
    parser.add_argument("--lost-frees", type=float, default=0.05, help="share of /free calls never sent")
    parser.add_argument("--lost-removals", type=float, default=0.5, help="share of removed events never sent")
    parser.add_argument("--sample-secs", type=float, default=10.0)
    parser.add_argument("--tolerance", type=float, default=0.05, help="RSS growth still called flat")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trace = load_trace(args.trace)
    workdir = Path(tempfile.mkdtemp(prefix="dynamo-lite-soak-"))
    processes, tracker_url, indexer_url = start_services(args, workdir)
    pids = {"slot tracker": processes[0].pid, "indexer": processes[1].pid}
    samples: dict[str, list[float]] = {name: [] for name in pids}
    load = Load(args, tracker_url, indexer_url, trace)
    until = time.monotonic() + args.minutes * 60
    print(f"soak: {args.minutes:g} min, {len(trace):,} trace requests, {args.workers} workers, "
          f"--max-blocks {args.max_blocks}, --request-ttl-secs {args.request_ttl_secs:g}; logs in {workdir}",
          flush=True)

    async def both() -> None:
        await asyncio.gather(load.run(until), sample(args, load, pids, until, samples))

    try:
        asyncio.run(both())
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    growing = False
    for name, series in samples.items():
        if len(series) < 6:
            print(f"{name}: too few samples for a verdict; run longer")
            continue
        word, growth = verdict(series, args.tolerance)
        growing |= word == "GROWING"
        print(f"{name}: RSS {series[0]:.1f} -> {series[-1]:.1f} MiB; last third vs middle third {growth:+.1%}: {word}")
    print(f"{load.requests:,} requests, {load.errors} errors; exit statuses "
          f"{[process.returncode for process in processes]}")
    sys.exit(1 if growing or load.errors else 0)


if __name__ == "__main__":
    main()
