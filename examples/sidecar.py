"""An engine-side sidecar: reports what one engine caches to the indexer with `POST /events`.

vLLM and SGLang publish their KV events over ZMQ and the indexer subscribes to them itself
(README, "Connecting vLLM and SGLang"). An engine that publishes nothing (a custom engine, a
test bed) can report its cache with a sidecar like this one: it hashes the token ids of the
blocks the engine stored, as Dynamo does, and posts Dynamo's RouterEvent documents, one batch
per engine step, every event of a batch under the step's number (its event id).

    .venv/bin/python examples/sidecar.py --indexer http://localhost:8090 examples/sidecar_events.jsonl

The file stands for one engine's life: the sidecar registers its worker (31, model
`sidecar-example`: its own, so it runs next to the other examples; `--worker-id` and
`--model-name` change them), reports every step, and unregisters the worker at the end, as a
sidecar would when its engine stops.

Each line of the events file is one engine step, a list of operations on one worker:
`{"stored": [token ids of a whole prompt]}` (its full blocks not reported yet are stored),
`{"evicted": [token ids of a prompt]}` (the last of its blocks still held is removed), or
`{"cleared": true}` (every block is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from dynamo_lite.client import AsyncIndexerClient, IngestReport, ServiceCallError
from dynamo_lite.hashing import local_block_hashes, sequence_hashes
from dynamo_lite.web.cli import HelpFormatter


class EngineSidecar:
    """Reports one engine rank's cached blocks to the indexer.

    The engine's own block ids (external hashes) are Dynamo's chained sequence hashes of the
    prompt, so equal prefixes get equal ids; the index is keyed on the local block hashes.
    """

    def __init__(self, indexer: AsyncIndexerClient, model_name: str, worker_id: int, *, block_size: int,
                 dp_rank: int = 0, tenant_id: str = "default") -> None:
        self.indexer = indexer
        self.model_name = model_name
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.tenant_id = tenant_id
        self.held: set[int] = set()  # external hashes of the blocks reported as stored
        self.step = 0  # the next batch's event id

    def stored(self, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        """Events for a prompt whose full blocks are now cached: the ones not reported yet, as
        one chain under the last block already held."""
        locals_ = local_block_hashes(token_ids, self.block_size)
        chain = sequence_hashes(locals_)
        start = 0
        while start < len(chain) and chain[start] in self.held:
            start += 1
        if start == len(chain):
            return []
        self.held.update(chain[start:])
        return [self._event({"stored": {
            "parent_hash": chain[start - 1] if start else None,
            "blocks": [{"block_hash": ext, "tokens_hash": local}
                       for ext, local in zip(chain[start:], locals_[start:])],
        }})]

    def evicted_tail(self, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        """Events for the engine evicting the last cached block of a prompt (engines evict
        leaves first, so the blocks above it stay)."""
        chain = sequence_hashes(local_block_hashes(token_ids, self.block_size))
        held = [ext for ext in chain if ext in self.held]
        if not held:
            return []
        self.held.discard(held[-1])
        return [self._event({"removed": {"block_hashes": [held[-1]]}})]

    def cleared(self) -> list[dict[str, Any]]:
        self.held.clear()
        return [self._event("cleared")]

    async def publish(self, events: list[dict[str, Any]]) -> IngestReport | None:
        """Post one engine step's events as one batch; returns the indexer's report."""
        if not events:
            return None
        for event in events:
            event["event"]["event_id"] = self.step
        self.step += 1
        key = f"{self.model_name}:{self.tenant_id}"
        return await self.indexer.events({key: {"block_size": self.block_size, "events": events}})

    def _event(self, data: Any) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "storage_tier": "device",
                "event": {"event_id": self.step, "dp_rank": self.dp_rank, "data": data}}


async def replay(indexer_url: str, lines: Sequence[str], model_name: str, worker_id: int, block_size: int) -> int:
    async with AsyncIndexerClient(indexer_url) as indexer:
        await indexer.register(worker_id, model_name, block_size)
        try:
            sidecar = EngineSidecar(indexer, model_name, worker_id, block_size=block_size)
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                events: list[dict[str, Any]] = []
                for operation in json.loads(line):
                    if "stored" in operation:
                        events += sidecar.stored(operation["stored"])
                    elif "evicted" in operation:
                        events += sidecar.evicted_tail(operation["evicted"])
                    elif operation.get("cleared"):
                        events += sidecar.cleared()
                    else:
                        raise ValueError(f"line {number}: unknown operation {operation!r}")
                report = await sidecar.publish(events)
                if report is not None:
                    print(f"step {sidecar.step - 1}: {len(events)} events, applied {report.applied}, "
                          f"rejected {report.rejected}, gaps {report.gap_count}")
            (worker,) = await indexer.workers(model_name=model_name)
            print(f"worker {worker_id} holds {worker.ranks[0].blocks} blocks")
        finally:
            await indexer.unregister(worker_id, model_name)  # the engine stopped: its cache is gone
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Report one engine's cached blocks to the indexer.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("events", help="JSON lines: one engine step per line, a list of operations")
    parser.add_argument("--indexer", default=os.environ.get("INDEXER_URL", "http://localhost:8090"),
                        help="the indexer's base URL [env INDEXER_URL]")
    parser.add_argument("--model-name", default="sidecar-example", help="the model the engine serves")
    parser.add_argument("--worker-id", type=int, default=31, help="the engine's worker (instance) id")
    parser.add_argument("--block-size", type=int, default=16, help="the engine's KV block size, in tokens")
    args = parser.parse_args(argv)
    try:
        with open(args.events, encoding="utf-8") as file:
            lines = file.readlines()
        return asyncio.run(replay(args.indexer, lines, args.model_name, args.worker_id, args.block_size))
    except (OSError, ValueError, ServiceCallError) as error:  # expected failures: one line, no traceback
        print(f"sidecar.py: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
