"""Acknowledged slot tracker writes (Booked) and the /loads they add up to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dynamo_lite.slot_tracker.core import SlotTracker

MODEL = "m"
WORKERS = [(1, "default", 2), (2, "default", 2), (3, "default", 1), (9, "team-b", 3)]  # id, tenant, dp_size


@dataclass
class Booked:
    """A request as far as the service acknowledged it."""

    tenant_id: str
    worker_id: int
    dp_rank: int
    hashes: list[int]
    new_isl_tokens: int
    output_blocks: int = 0


def expected_loads(booked: dict[str, Booked], workers: list[tuple[int, str, int]] = WORKERS) -> list[dict[str, Any]]:
    """/loads of a tracker that saw only the acknowledged state (`workers`: id, tenant, dp size)."""
    tracker = SlotTracker()
    for worker_id, tenant_id, dp_size in workers:
        tracker.register(worker_id, MODEL, tenant_id, 16, 0, dp_size)
    for request_id, request in booked.items():
        tracker.add(MODEL, request.tenant_id, request_id, request.worker_id, request.dp_rank, request.hashes,
                    request.new_isl_tokens)
        tracker.set_output_blocks(MODEL, request.tenant_id, request_id, request.output_blocks)
    return [dataclasses.asdict(load) for load in tracker.loads()]
