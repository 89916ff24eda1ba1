"""Cost of the indexer core (no HTTP): memory per indexed block, ingest rate, query time, and
what approximations (`/routed`) cost.

    python -m bench.indexer_core [--blocks 1000000]

Memory is counted with tracemalloc (Python objects the index keeps, hashes included) and as
the growth of the process RSS.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
import tracemalloc

import orjson

from dynamo_lite.hashing import to_signed
from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document
from dynamo_lite.indexer.tree import PrefixTree
from dynamo_lite.web.cli import YOUNG_ONLY_GC_THRESHOLDS


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_one_worker(blocks: int, *, traced: bool, chain: int = 64) -> float:
    """Bytes per block in the worst case: every block held by one worker, nothing shared.
    `traced`: count with tracemalloc (which itself inflates RSS), else by RSS growth."""
    rng = random.Random(7)
    tree = PrefixTree()
    gc.collect()
    rss_before = rss_bytes()
    if traced:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(blocks // chain):
        tree.store((1, 0), None, [rng.getrandbits(64) for _ in range(chain)], [rng.getrandbits(64) for _ in range(chain)])
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base if traced else rss_bytes() - rss_before
    tracemalloc.stop()
    return used / blocks


def ingest_rate(blocks: int, batch: int = 64, workers: int = 16, tuned_gc: bool = False) -> float:
    """Blocks per second through parse + apply, 64-block stored events from 16 workers.
    `tuned_gc`: with the garbage collector thresholds the indexer service sets at start-up
    (`dynamo_lite.web.cli.YOUNG_ONLY_GC_THRESHOLDS`), else Python's defaults."""
    rng = random.Random(11)
    documents = []
    event_ids = [0] * workers
    tails: list[int | None] = [None] * workers
    for i in range(blocks // batch):
        worker = i % workers
        externals = [rng.getrandbits(64) for _ in range(batch)]
        event = {"worker_id": worker, "event": {"event_id": event_ids[worker], "dp_rank": 0, "data": {"stored": {
            "parent_hash": tails[worker], "blocks": [
                {"block_hash": e, "tokens_hash": rng.getrandbits(64)} for e in externals]}}}}
        event_ids[worker] += 1
        tails[worker] = externals[-1] if rng.random() < 0.8 else None
        documents.append({"bench:default": {"block_size": 16, "events": [event]}})
    indexer = Indexer()
    thresholds = gc.get_threshold()
    if tuned_gc:
        gc.set_threshold(*YOUNG_ONLY_GC_THRESHOLDS)
    try:
        started = time.perf_counter()
        for document in documents:
            indexer.apply_events(parse_events_document(document))
        return blocks / (time.perf_counter() - started)
    finally:
        gc.set_threshold(*thresholds)


def query_time(
    workers: int = 16, length: int = 512, signed: bool = False, parsed: bool = False, approximated: int = 0
) -> float:
    """Microseconds for a 512-hash query that every one of 16 workers holds 256..512 deep;
    `signed` sends the hashes as i64, as `/query_by_hash` receives them. `parsed`: the hashes
    are int objects of their own, as a request body's JSON gives them, not the very objects
    the index stores (an equality test of two such ints cannot stop at their identity).
    `approximated`: that many more ranks hold 256..512 of them as approximations (`/routed`)."""
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(length)]
    indexer = Indexer()
    events = []
    for worker in range(workers):
        depth = rng.randint(length // 2, length)
        events.append({"worker_id": worker, "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
            "parent_hash": None, "blocks": [{"block_hash": (worker << 20) + i, "tokens_hash": h}
                                            for i, h in enumerate(chain[:depth])]}}}})
    indexer.apply_events(parse_events_document({"bench:default": {"block_size": 16, "events": events}}))
    for rank in range(workers, workers + approximated):
        indexer.record_routed("bench", "default", rank, 0, chain[: rng.randint(length // 2, length)])
    query = [to_signed(h) for h in chain] if signed else chain
    if parsed:
        query = orjson.loads(orjson.dumps(query))
    runs = 2000
    started = time.perf_counter()
    for _ in range(runs):
        query_answer(indexer.query("bench", "default", query))  # what /query_by_hash runs
    return (time.perf_counter() - started) / runs * 1e6


def routed_time(length: int = 512, prompts: int = 300, refresh: bool = False) -> float:
    """Microseconds for `/routed` in the core (with the service's GC thresholds): a prompt of
    `length` blocks new to the rank, or (`refresh`) one it has approximations of already."""
    rng = random.Random(5)
    chains = [[rng.getrandbits(64) for _ in range(length)] for _ in range(prompts)]
    indexer = Indexer()
    indexer.register(1, "bench", "default", 16)
    if refresh:
        for chain in chains:
            indexer.record_routed("bench", "default", 1, 0, chain)
    thresholds = gc.get_threshold()
    gc.set_threshold(*YOUNG_ONLY_GC_THRESHOLDS)
    try:
        started = time.perf_counter()
        for chain in chains:
            indexer.record_routed("bench", "default", 1, 0, chain)
        return (time.perf_counter() - started) / prompts * 1e6
    finally:
        gc.set_threshold(*thresholds)


def memory_approximated(blocks: int, chain: int = 64) -> float:
    """Bytes per approximation (tracemalloc): one rank, `blocks` routed blocks nothing else holds."""
    rng = random.Random(8)
    indexer = Indexer(approx_max_blocks=0)
    indexer.register(1, "bench", "default", 16)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(blocks // chain):
        indexer.record_routed("bench", "default", 1, 0, [rng.getrandbits(64) for _ in range(chain)])
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    rss = memory_one_worker(args.blocks, traced=False)
    traced = memory_one_worker(args.blocks, traced=True)
    print(f"memory, {args.blocks} blocks on one worker: {traced:.0f} B/block (tracemalloc), {rss:.0f} B/block (RSS)")
    print(f"ingest, 64-block stored events, 16 workers: {ingest_rate(min(args.blocks, 500_000)):,.0f} blocks/s")
    print(f"ingest, the same with the indexer service's GC thresholds: "
          f"{ingest_rate(min(args.blocks, 500_000), tuned_gc=True):,.0f} blocks/s")
    print(f"query, 512 u64 hashes, 16 workers: {query_time():.1f} us")
    print(f"query, 512 i64 hashes, 16 workers: {query_time(signed=True):.1f} us")
    print(f"query, 512 u64 hashes parsed from JSON, 16 workers: {query_time(parsed=True):.1f} us")
    print(f"query, 512 i64 hashes parsed from JSON, 16 workers: {query_time(signed=True, parsed=True):.1f} us")
    print(f"query, the same, 16 workers and 16 approximated ranks: "
          f"{query_time(signed=True, parsed=True, approximated=16):.1f} us")
    print(f"query, the same, 32 workers: {query_time(workers=32, signed=True, parsed=True):.1f} us")
    print(f"/routed, a 512-block prompt new to the rank: {routed_time():.0f} us; "
          f"one it has approximated already: {routed_time(refresh=True):.0f} us")
    print(f"memory, {min(args.blocks, 500_000)} approximations on one rank: "
          f"{memory_approximated(min(args.blocks, 500_000)):.0f} B each (tracemalloc)")


if __name__ == "__main__":
    main()
