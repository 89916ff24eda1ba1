"""The slot tracker's wire types: the rows its routes answer with and the `/dump` document.

One definition of each shape, shared by the service (`core`, `app`), its replicas and
snapshots, and the client (`dynamo_lite.client`), which must not depend on the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from dynamo_lite.web.validation import I64, U32, U64

# A worker's role (`/register`): a prefill worker hands each request to a decode worker at its
# first token, so only its prefill tokens are tracked; decode and aggregated workers are alike here.
AGGREGATED: Final = "aggregated"
DECODE: Final = "decode"
PREFILL: Final = "prefill"
ROLES: Final = (AGGREGATED, DECODE, PREFILL)

# Response rows are plain dataclasses, not slotted ones: orjson serialises a dataclass through
# its __dict__ directly but walks a slotted one field by field, which made encoding 16 rows cost
# 13 us instead of 2 us on /loads and /potential_loads.
@dataclass
class WorkerInfo:
    worker_id: int
    model_name: str
    tenant_id: str
    block_size: int
    dp_start: int
    dp_size: int
    role: str = AGGREGATED  # answered only when not "aggregated" (Dynamo's rows have no role)


@dataclass
class RankLoad:
    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int


@dataclass
class PotentialLoad:
    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


# --- the dump: the whole state as data (`GET /dump`, snapshots, recovery from a peer) -----------
# msgspec structs: encoded and decoded (with every type checked) in one C pass each. Fields are
# encoded in declaration order; the lists come last so a writer can stream them.

DUMP_VERSION: Final = 1  # a reader refuses any other: `version` is declared `Literal[1]`


class DumpedWorker(msgspec.Struct, omit_defaults=True):
    worker_id: U64
    block_size: U32
    dp_start: U32
    dp_size: U32
    role: Literal["aggregated", "decode", "prefill"] = "aggregated"


class DumpedRequest(msgspec.Struct, omit_defaults=True):
    """An `/add` body, with `new_isl_tokens` the prompt tokens still to prefill (0 once prefill
    completed), plus the request's output blocks and the seconds left before it expires: the
    core's clock is monotonic and per process, so a time of `/add` would mean nothing elsewhere."""

    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: tuple[I64, ...]  # as sent, repeats included
    new_isl_tokens: U64
    output_blocks: U32
    remaining_ttl_secs: float
    expected_output_tokens: U64 | None = None  # sent with its /add (output blocks decay toward it)


class DumpedPartition(msgspec.Struct):
    model_name: str
    tenant_id: str
    workers: list[DumpedWorker]
    requests: list[DumpedRequest]  # in expiry order, which is /add order


class SlotTrackerDump(msgspec.Struct):
    version: Literal[1]
    taken_at: float  # wall-clock (Unix) time of the dump: how long ago remaining TTLs were true
    partitions: list[DumpedPartition]


__all__ = [
    "AGGREGATED",
    "DECODE",
    "DUMP_VERSION",
    "DumpedPartition",
    "DumpedRequest",
    "DumpedWorker",
    "PREFILL",
    "PotentialLoad",
    "ROLES",
    "RankLoad",
    "SlotTrackerDump",
    "WorkerInfo",
]
