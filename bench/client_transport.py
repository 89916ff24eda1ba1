"""The service clients' CPU per call, by transport: httpx and the lean one (`dynamo_lite.client.lean_http`).

    python -m bench.client_transport            # a table

A slot tracker runs on the server CPU; this process, on the client CPU, makes the picker's calls
(`/potential_loads` with 256 hashes, `/add`, `/prefill_complete`, `/output_blocks`, `/free`)
one at a time and 32 at a time for a few seconds per transport, and reports its own CPU time per call (what a
picker spends on each). Best of three rounds.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from typing import Any

from dynamo_lite.client import AsyncSlotTrackerClient

from .servers import CLIENT_CPU, SERVER_CPU, reference_server

ROUNDS = 3
SECONDS = 3.0
CONCURRENCIES = (1, 32)  # one caller, and a busy picker's many pending calls
HASHES = list(range(1000, 1256))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _round(url: str, lean: bool, tag: str, concurrency: int) -> tuple[float, float]:
    async with AsyncSlotTrackerClient(url, lean=lean, timeout=10) as client:
        calls = 0
        stop = time.monotonic() + SECONDS

        async def worker(index: int) -> None:
            nonlocal calls
            sequence = 0
            while time.monotonic() < stop:
                request_id = f"{tag}-{index}-{sequence}"
                sequence += 1
                await client.potential_loads("bench", HASHES)
                await client.add("bench", request_id, 1, 0, HASHES, 100)
                await client.prefill_complete("bench", request_id)
                await client.output_blocks("bench", request_id, 1)
                await client.free("bench", request_id)
                calls += 5

        before, started = _cpu(), time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return (_cpu() - before) / calls * 1e6, calls / (time.monotonic() - started)


def measure() -> dict[str, Any]:
    import os

    os.sched_setaffinity(0, {CLIENT_CPU})
    port = reference_server.free_port()
    argv = ["taskset", "-c", str(SERVER_CPU), sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]
    with reference_server.running_server(argv, port) as url:
        async def setup() -> None:
            async with AsyncSlotTrackerClient(str(url)) as client:
                await client.register(1, "bench", 16)

        asyncio.run(setup())
        results = {}
        for concurrency in CONCURRENCIES:
            for lean in (False, True):
                name = f"{'lean (one call per connection)' if lean else 'httpx'}, c={concurrency}"
                cpu_us, per_second = min(asyncio.run(_round(str(url), lean, f"{lean}-{concurrency}-{r}", concurrency))
                                         for r in range(ROUNDS))
                results[name] = {"client_cpu_us_per_call": cpu_us, "calls_per_second": per_second}
        return results


def main() -> None:
    results = measure()
    if "--json" in sys.argv[1:]:
        print(json.dumps(results))
        return
    for name, row in results.items():
        print(f"{name:<34} {row['client_cpu_us_per_call']:7.1f} us of client CPU per call, "
              f"{row['calls_per_second']:7.0f} calls/s")


if __name__ == "__main__":
    main()
