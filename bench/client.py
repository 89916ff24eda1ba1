"""The service clients' own cost per call (no network, no service): microseconds per call.

    python -m bench.client          # a table
    python -m bench.client --json   # {name: microseconds}

httpx's `MockTransport` answers each call with a canned body, so a figure is the client's
request building, httpx's machinery and the answer's decoding into rows or an error: what a
gateway pays per call on top of the service's answer. Best of five runs of 3,000 calls each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import orjson

from dynamo_lite.client import AsyncSlotTrackerClient, ServiceCallError, SlotTrackerClient

from .cores import print_measured

CALLS = 3_000
RUNS = 5
_ROWS = orjson.dumps([
    {"worker_id": 1, "dp_rank": rank, "potential_prefill_tokens": 10, "potential_decode_blocks": 3,
     "active_requests": 1}
    for rank in range(16)
])
_HASHES = list(range(64))


def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/potential_loads":
        return httpx.Response(200, content=_ROWS)
    if request.url.path == "/free":
        return httpx.Response(404, content=b'{"error":"request r not found"}')
    return httpx.Response(201)


def _best(run: Callable[[], float]) -> float:
    return min(run() for _ in range(RUNS)) / CALLS * 1e6


async def _measure_async() -> dict[str, float]:
    http = httpx.AsyncClient(base_url="http://service", transport=httpx.MockTransport(_answer))
    client = AsyncSlotTrackerClient(client=http)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "add": lambda: client.add("m", "r", 1, 0, [1, 2, 3], 5),
        "potential_loads (16 rows)": lambda: client.potential_loads("m", _HASHES),
        "free answered 404": lambda: client.free("m", "r"),
    }
    measured = {}
    for name, call in calls.items():
        times = []
        for _ in range(RUNS):
            started = time.perf_counter()
            for _ in range(CALLS):
                try:
                    await call()
                except ServiceCallError:
                    pass
            times.append(time.perf_counter() - started)
        measured[f"async {name}"] = min(times) / CALLS * 1e6
    await http.aclose()
    return measured


def _measure_sync() -> dict[str, float]:
    http = httpx.Client(base_url="http://service", transport=httpx.MockTransport(_answer))
    client = SlotTrackerClient(client=http)
    calls: dict[str, Callable[[], object]] = {
        "add": lambda: client.add("m", "r", 1, 0, [1, 2, 3], 5),
        "potential_loads (16 rows)": lambda: client.potential_loads("m", _HASHES),
        "free answered 404": lambda: client.free("m", "r"),
    }

    def timed(call: Callable[[], object]) -> float:
        started = time.perf_counter()
        for _ in range(CALLS):
            try:
                call()
            except ServiceCallError:
                pass
        return time.perf_counter() - started

    measured = {f"sync {name}": _best(lambda call=call: timed(call)) for name, call in calls.items()}
    http.close()
    return measured


def measure() -> dict[str, float]:
    """{"async add": us, ..., "sync free answered 404": us}."""
    return {**asyncio.run(_measure_async()), **_measure_sync()}


if __name__ == "__main__":
    print_measured(measure(), width=35)
