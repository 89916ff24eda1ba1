"""An indexer fed by ZeroMQ engine publishers: stored chains of the test prompt, the listener's
state, and waits for its sequence numbers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest

from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed
from dynamo_lite.kv_publishers import Stored

BLOCK = 16
TOKENS = list(range(1, 129))  # 8 blocks
LOCAL = local_block_hashes(TOKENS, BLOCK)
CHAIN = sequence_hashes(LOCAL)  # the engines' external hashes: chained, a function of the prefix
DEADLINE = 10.0
T = TypeVar("T")


def eventually(probe: Callable[[], T], done: Callable[[T], bool], what: str) -> T:
    deadline = time.monotonic() + DEADLINE
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within {DEADLINE:.0f} s; last seen {value!r}", pytrace=False)
        time.sleep(0.02)


def listener(client: httpx.Client, model: str, worker: int, dp_rank: int = 0) -> dict[str, Any]:
    for entry in client.get("/workers", params={"model_name": model}).json():
        if entry["instance_id"] == worker:
            for rank in entry["ranks"]:
                if rank["dp_rank"] == dp_rank:
                    return rank["listener"] or {}
    return {}


def wait_seq(client: httpx.Client, model: str, worker: int, seq: int, dp_rank: int = 0) -> dict[str, Any]:
    return eventually(lambda: listener(client, model, worker, dp_rank),
                      lambda info: info.get("last_seq") == seq, f"worker {worker} applying seq {seq}")


def query(client: httpx.Client, model: str, blocks: int = len(LOCAL), **extra: Any) -> dict[str, Any]:
    body = {"model_name": model, "block_hashes": [to_signed(h) for h in LOCAL[:blocks]], **extra}
    response = client.post("/query_by_hash", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chain(start: int, end: int, **fields: Any) -> Stored:
    """Blocks start..end-1 of TOKENS as one store under the block before them."""
    return Stored(CHAIN[start:end], CHAIN[start - 1] if start else None,
                  TOKENS[start * BLOCK:end * BLOCK], BLOCK, **fields)
