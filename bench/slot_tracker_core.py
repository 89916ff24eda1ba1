"""Cost of the slot tracker's hot paths in the pure core (no HTTP), by active-request count.

    python -m bench.slot_tracker_core

Prints microseconds per call for /potential_loads (512 hashes), /add + /prefill_complete +
/free (256 hashes) and /loads at 16 and 256 ranks with 10, 1k and 10k active requests, first
for chained prompts (what engines send), then for unchained ones: random subsets of one hash
pool. Those share hashes in scattered subsets rather than as prefixes, which as requests pile up
splits the core's groups down to single hashes (its worst case; the answers are exact either
way). The numbers should stay flat along each row.
"""

from __future__ import annotations

import random
import timeit
from collections.abc import Callable

from dynamo_lite.slot_tracker.core import SlotTracker

PREFIX_POOL = 32
UNCHAINED_POOL = 20_000


def chained_request(rng: random.Random, length: int, prefixes: list[list[int]]) -> list[int]:
    """Half of the requests start with a shared 128-block prefix, like a system prompt."""
    if rng.random() < 0.5:
        prefix = rng.choice(prefixes)
        return prefix + [rng.getrandbits(63) for _ in range(length - len(prefix))]
    return [rng.getrandbits(63) for _ in range(length)]


def build(ranks: int, active: int, rng: random.Random) -> tuple[SlotTracker, list[list[int]]]:
    tracker = SlotTracker()
    workers = ranks // 2
    for worker in range(workers):
        tracker.register(worker, "bench", "default", 16, 0, 2)
    prefixes = [[rng.getrandbits(63) for _ in range(128)] for _ in range(PREFIX_POOL)]
    for i in range(active):
        slot = i % ranks
        tracker.add("bench", "default", f"seed-{i}", slot // 2, slot % 2, chained_request(rng, 256, prefixes), 16 * 256)
    return tracker, prefixes


def measure(ranks: int, active: int, chained: bool = True) -> dict[str, float]:
    rng = random.Random(7)
    if chained:
        tracker, prefixes = build(ranks, active, rng)

        def request(length: int) -> list[int]:
            return chained_request(rng, length, prefixes)
    else:
        pool = [rng.getrandbits(63) for _ in range(UNCHAINED_POOL)]
        tracker = SlotTracker()
        for worker in range(ranks // 2):
            tracker.register(worker, "bench", "default", 16, 0, 2)
        for i in range(active):
            slot = i % ranks
            tracker.add("bench", "default", f"seed-{i}", slot // 2, slot % 2, rng.sample(pool, 256), 16 * 256)

        def request(length: int) -> list[int]:
            return rng.sample(pool, length)
    query = request(512)
    # Unchained requests rotate: repeating one would leave it its own groups after the first.
    requests = [request(256) for _ in range(1 if chained else 50)]
    counter = iter(range(10**9))

    def lifecycle() -> None:
        n = next(counter)
        request_id = f"bench-{n}"
        tracker.add("bench", "default", request_id, 0, 0, requests[n % len(requests)], 4096)
        tracker.prefill_complete("bench", "default", request_id)
        tracker.free("bench", "default", request_id)

    def best(fn: Callable[[], object], number: int) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    number = 200 if chained else 50
    return {
        # What the route calls (its rows are the answer's JSON objects): `potential_loads`, the
        # typed form for Python callers, builds a PotentialLoad per rank on top (+0.4 us per rank).
        "potential_loads(512)": best(lambda: tracker.potential_load_rows("bench", "default", query, 8192), number),
        "add+prefill+free(256)": best(lifecycle, number),
        "loads": best(lambda: tracker.loads("bench"), number),
    }


def main() -> None:
    for chained in (True, False):
        print("chained prompts" if chained else "\nunchained: random subsets of one hash pool")
        print(f"{'ranks':>5} {'active':>7} " + " ".join(f"{name:>22}" for name in measure(16, 0)))
        for ranks in (16, 256):
            for active in (10, 1_000, 10_000):
                row = measure(ranks, active, chained)
                print(f"{ranks:>5} {active:>7} " + " ".join(f"{value:>19.1f} us" for value in row.values()))


if __name__ == "__main__":
    main()
