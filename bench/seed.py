"""Slot-tracker state and request bodies, identical for every server.

Hashes are random signed 64-bit values from a seeded generator: distinct blocks have distinct
hashes, as real chained hashes do, so the reference's compressed tree and our refcounts see
the same thing. Bodies leave the partition field out, so ours (`tenant_id`) and the reference
(`routing_group`) both use their default partition.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from .http_post import Connection, post_request

HASHES_PER_REQUEST = 256
SHARED_PREFIX = 128
QUERY_HASHES = 512
NEW_ISL_TOKENS = 4096


@dataclass(frozen=True)
class TrackerShape:
    """One tracker: `workers` workers of `dp_size` ranks each."""

    model: str
    workers: int
    dp_size: int

    @property
    def ranks(self) -> int:
        return self.workers * self.dp_size


def shape_for(model: str, ranks: int) -> TrackerShape:
    """16 ranks as 8 workers x 2 (a common DP layout); larger counts as 16 workers."""
    if ranks == 16:
        return TrackerShape(model, 8, 2)
    if ranks % 16:
        raise ValueError(f"ranks {ranks} is not a multiple of 16")
    return TrackerShape(model, 16, ranks // 16)


def _hash(rng: random.Random) -> int:
    return rng.getrandbits(64) - 2**63


def hash_lists(count: int, seed: int) -> list[list[int]]:
    """`count` requests of 256 hashes; every other one starts with the same 128-hash prefix."""
    rng = random.Random(seed)
    shared = [_hash(rng) for _ in range(SHARED_PREFIX)]
    lists = []
    for index in range(count):
        if index % 2 == 0:
            lists.append(shared + [_hash(rng) for _ in range(HASHES_PER_REQUEST - SHARED_PREFIX)])
        else:
            lists.append([_hash(rng) for _ in range(HASHES_PER_REQUEST)])
    return lists


def query_hashes(lists: list[list[int]], seed: int) -> list[int]:
    """A 512-hash prompt that continues the first active request (shared prefix included)."""
    rng = random.Random(seed + 1)
    return lists[0] + [_hash(rng) for _ in range(QUERY_HASHES - len(lists[0]))]


def potential_loads_body(model: str, hashes: list[int]) -> bytes:
    return orjson.dumps({"model_name": model, "sequence_hashes": hashes, "new_isl_tokens": NEW_ISL_TOKENS})


def write_hash_lists(path: Path, lists: list[list[int]]) -> None:
    """One JSON array per line, for lua/lifecycle.lua."""
    path.write_bytes(b"\n".join(orjson.dumps(hashes) for hashes in lists) + b"\n")


def _adds(shape: TrackerShape, lists: list[list[int]], prefix: str) -> Iterator[bytes]:
    for index, hashes in enumerate(lists):
        slot = index % shape.ranks
        yield orjson.dumps({
            "model_name": shape.model,
            "request_id": f"{prefix}-{index}",
            "worker_id": slot % shape.workers + 1,
            "dp_rank": slot // shape.workers,
            "sequence_hashes": hashes,
            "new_isl_tokens": NEW_ISL_TOKENS,
        })


def _post(client: httpx.Client, path: str, body: bytes, expect: int) -> httpx.Response:
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    if response.status_code != expect:
        raise RuntimeError(f"{client.base_url}{path} answered {response.status_code} {response.text[:300]}")
    return response


def register_tracker(client: httpx.Client, shape: TrackerShape) -> None:
    for worker in range(1, shape.workers + 1):
        _post(client, "/register", orjson.dumps({
            "worker_id": worker, "model_name": shape.model, "block_size": 16,
            "dp_start": 0, "dp_size": shape.dp_size,
        }), 201)


def drop_tracker(client: httpx.Client, shape: TrackerShape) -> None:
    """Unregister every worker: the tracker and all its requests go."""
    for worker in range(1, shape.workers + 1):
        _post(client, "/unregister", orjson.dumps({"worker_id": worker, "model_name": shape.model}), 200)


def seed_tracker(url: str, shape: TrackerShape, lists: list[list[int]]) -> None:
    """Register the tracker and add one active request per hash list (over a bare keep-alive
    connection: with httpx, the client's own cost per /add would double the seeding time)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        register_tracker(client, shape)
    connection = Connection(url)
    try:
        for body in _adds(shape, lists, "seed"):
            status, answer = connection.send(post_request(url, "/add", body))
            if status != 201:
                raise RuntimeError(f"{url}/add answered {status} {answer[:300]!r}")
    finally:
        connection.close()


def reset_tracker(url: str, shape: TrackerShape) -> None:
    """Drop and re-register the tracker: no active request left (for the lifecycle mix)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        drop_tracker(client, shape)
        register_tracker(client, shape)


def unseed_tracker(url: str, shape: TrackerShape) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        drop_tracker(client, shape)
