"""Indexer event documents built by hand (stored, removed, cleared), applied to an Indexer core, and its scores."""

from __future__ import annotations

from typing import Any

from dynamo_lite.hashing import local_block_hashes
from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document

# Local hashes of the token ids 1..64 in blocks of 16: four blocks of one prompt.
L = local_block_hashes(list(range(1, 65)), 16)


def stored(
    worker: int, event_id: int, parent: int | None, hashes: list[int], locals_: list[int], **extra: Any
) -> dict:
    event = {
        "worker_id": worker,
        "event": {
            "event_id": event_id,
            "dp_rank": extra.pop("dp_rank", 0),
            "data": {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, locals_)],
                }
            },
        },
    }
    event.update(extra)
    return event


def removed(worker: int, event_id: int, hashes: list[int], **extra: Any) -> dict:
    event = {
        "worker_id": worker,
        "event": {
            "event_id": event_id,
            "dp_rank": extra.pop("dp_rank", 0),
            "data": {"removed": {"block_hashes": hashes}},
        },
    }
    event.update(extra)
    return event


def cleared(worker: int, event_id: int, dp_rank: int = 0) -> dict:
    return {"worker_id": worker, "event": {"event_id": event_id, "dp_rank": dp_rank, "data": "cleared"}}


def doc(*events: dict, key: str = "llama:default", block_size: int = 16) -> dict:
    return {key: {"block_size": block_size, "events": list(events)}}


def apply(indexer: Indexer, document: dict) -> Any:
    return indexer.apply_events(parse_events_document(document))


def scores(indexer: Indexer, hashes: list[int], model: str = "llama", tenant: str = "default") -> dict:
    return query_answer(indexer.query(model, tenant, hashes))["scores"]
