"""The slot tracker's answer rows: the wire shape of `/workers`, `/loads` and `/potential_loads`.

The core builds them and the HTTP shell serialises them; the clients (`dynamo_lite.client`)
build the same classes from the JSON, so one definition holds the shape on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass


# Plain dataclasses, not slotted ones: orjson serialises a dataclass through its __dict__
# directly but walks a slotted one field by field, ~6 times slower (bench/ANALYSIS.md).
@dataclass
class WorkerInfo:
    """One registered worker and its DP range `dp_start` .. `dp_start + dp_size - 1`."""

    worker_id: int
    model_name: str
    tenant_id: str
    block_size: int
    dp_start: int
    dp_size: int


@dataclass
class RankLoad:
    """One rank's current load: prompt tokens still to prefill and KV blocks held."""

    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int


@dataclass
class PotentialLoad:
    """One rank's load if a request were added there, and how many requests it has now."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


__all__ = ["PotentialLoad", "RankLoad", "WorkerInfo"]
