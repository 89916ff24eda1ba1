"""The slot tracker stays bounded when frees are lost: `--request-ttl-secs` expiry.

A steady stream of requests arrives on a simulated clock; a share of them is never freed (a
gateway crashed, a network partition ate the `/free`). Whatever is held, requests, hash
refcounts and the hash -> ranks index, must level off at what the last TTL's worth of traffic
holds, and drain to nothing once the traffic stops.
"""

from __future__ import annotations

import random

import pytest

from dynamo_lite.slot_tracker.core import SlotTracker

pytestmark = pytest.mark.unit

TTL = 60.0
RATE = 20  # requests per simulated second
LIFETIME = 3.0  # seconds from /add to /free for the requests that do get freed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def held(tracker: SlotTracker) -> tuple[int, int, int]:
    """(active requests, hash refcount entries over all ranks, entries of the hash index)."""
    (partition,) = tracker.partitions.values()
    return (
        len(partition.requests),
        sum(slot.blocks for slot in partition.slots.values()),
        len(partition.holders),
    )


@pytest.mark.parametrize("sweep", [True, False], ids=["with-sweep", "expiry-on-add-only"])
def test_lost_frees_level_off_and_drain(sweep: bool) -> None:
    clock = Clock()
    tracker = SlotTracker(request_ttl_secs=TTL, clock=clock)
    for worker_id in range(4):
        tracker.register(worker_id, "m", "default", 16, 0, 2)
    rng = random.Random(5)
    pending_frees: list[tuple[float, str]] = []
    peaks: list[tuple[int, int, int]] = []
    for second in range(int(8 * TTL)):
        for n in range(RATE):
            clock.now = second + n / RATE
            request_id = f"r{second}-{n}"
            prefix = rng.randrange(50)  # shared system prompts, then a private tail
            hashes = [prefix * 1000 + i for i in range(8)] + [rng.getrandbits(63) for _ in range(24)]
            tracker.add("m", "default", request_id, rng.randrange(4), rng.randrange(2), hashes, 512)
            if rng.random() < 0.7:  # the other 30 % of frees are lost
                pending_frees.append((clock.now + LIFETIME, request_id))
            while pending_frees and pending_frees[0][0] <= clock.now:
                tracker.free("m", "default", pending_frees.pop(0)[1])
        if sweep:
            tracker.expire()  # what the service's one-second sweep does
        if second % int(TTL) == int(TTL) - 1:
            peaks.append(held(tracker))
    # After the first TTL the state is a moving window: the same size every TTL, not growing.
    requests_cap = int(RATE * (TTL + 1 + LIFETIME))
    for requests, refs, index in peaks[1:]:
        assert requests <= requests_cap
        assert refs <= requests * 32 and index <= requests * 32
    assert max(p[0] for p in peaks[4:]) <= max(p[0] for p in peaks[1:4]) * 1.05
    assert tracker.expired_total > 0.25 * RATE * 6 * TTL

    clock.now += TTL + 1  # traffic stops
    if sweep:
        tracker.expire()
    else:
        tracker.add("m", "default", "last", 0, 0, [1], 0)  # expiry runs on the next /add
        tracker.free("m", "default", "last")
    assert held(tracker) == (0, 0, 0)
    assert all((load.active_prefill_tokens, load.active_decode_blocks) == (0, 0) for load in tracker.loads())
