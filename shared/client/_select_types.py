"""The selection service's answers as the clients return them (re-exported by
`dynamo_lite.client`): msgspec Structs decoded in one pass, unknown fields ignored."""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo_lite.slot_tracker.protocols import PotentialLoad

from ._client_base import _Typed


class Overlap(msgspec.Struct, frozen=True):
    """The chosen worker's cached prefix, in tokens: on the device tier (`gpu`, and per rank in
    `dp`), with host-pinned copies after it (`cpu`), with disk after those (`disk`)."""

    longest_matched: int = 0
    gpu: int = 0
    dp: dict[str, int] = {}
    cpu: int = 0
    disk: int = 0


class SelectedWorker(msgspec.Struct, frozen=True):
    """A pick (`select`, `select_and_reserve`): the worker and rank to send the request to, at
    `endpoint`; the prompt tokens left to prefill there and its KV blocks with the request
    added. A booking (`select_and_reserve`) also carries its `selection_id`, the
    `sequence_hashes` booked, `isl_tokens` and whether its prefill is tracked."""

    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str | None
    block_size: int
    overlap: Overlap
    effective_prefill_tokens: int
    potential_decode_blocks: int
    selection_id: str | None = None
    sequence_hashes: list[int] | None = None
    isl_tokens: int | None = None
    track_prefill_tokens: bool | None = None
    worker_load: dict[str, int] | None = None  # with `advisory`: the rank's load before this request


class Reservation(msgspec.Struct, frozen=True):
    """A booking made by `reserve`."""

    selection_id: str
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str | None


class WorkerRecord(msgspec.Struct, frozen=True):
    """A worker as the catalog holds it: `lifecycle` `schedulable` once complete, else
    `incomplete` with the reasons in `not_schedulable_reasons`."""

    worker_id: int
    model_name: str
    routing_group: str
    lifecycle: str
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: dict[str, str] = {}
    replay_endpoint: str | None = None
    block_size: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    taints: list[str] = []
    not_schedulable_reasons: list[str] = []


class Readiness(msgspec.Struct, frozen=True):
    """`GET /ready`: whether a worker can be selected, and the catalog."""

    ready: bool
    schedulable_workers: int
    workers: list[WorkerRecord] = []


class PartitionLoads(msgspec.Struct, frozen=True):
    """One partition's booked load per rank (`loads`)."""

    model_name: str
    routing_group: str
    loads: list[PotentialLoad]
    pending_count: int = 0
    pending_isl_tokens: int = 0


class RankOverlap(msgspec.Struct, frozen=True):
    """One rank's cached blocks of a prompt: on the device tier, then cumulated with the
    host-pinned and disk tiers (the extensions: what each lower tier adds after the one above)."""

    worker_id: int
    dp_rank: int
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    host_pinned_extension_blocks: int
    disk_extension_blocks: int


class TieredOverlap(msgspec.Struct, frozen=True):
    """`overlap_scores`: the prompt's `num_blocks` full blocks and every schedulable rank's cache of them."""

    block_size: int
    num_blocks: int
    workers: list[RankOverlap]


SELECTED = _Typed(SelectedWorker)
RESERVATION = _Typed(Reservation)
WORKER_RECORD = _Typed(WorkerRecord)
WORKER_RECORDS = _Typed(list[WorkerRecord])
READINESS = _Typed(Readiness)
PARTITION_LOADS = _Typed(list[PartitionLoads])
TIERED_OVERLAP = _Typed(TieredOverlap)
SELECT_POTENTIAL_LOADS = _Typed(list[PotentialLoad])


def decode_readiness(content: bytes | str) -> Readiness | None:
    """A 503 `/ready` answer's body (the catalog, not an error), or None if it is not one."""
    try:
        return msgspec.json.decode(content, type=Readiness)
    except msgspec.DecodeError:
        return None


def prompt_body(model_name: str, routing_group: str, token_ids: Any, block_hashes: Any, sequence_hashes: Any,
                isl_tokens: int | None, lora_name: str | None, cache_salt: str | None,
                router_config_override: dict[str, Any] | None) -> dict[str, Any]:
    """The prompt fields of a request body, the ones left unset left out."""
    body: dict[str, Any] = {"model_name": model_name, "routing_group": routing_group}
    for name, value in (("token_ids", token_ids), ("block_hashes", block_hashes),
                        ("sequence_hashes", sequence_hashes)):
        if value is not None:
            body[name] = list(value)
    for name, value in (("isl_tokens", isl_tokens), ("lora_name", lora_name), ("cache_salt", cache_salt),
                        ("router_config_override", router_config_override)):
        if value is not None:
            body[name] = value
    return body


def select_filters(model_name: str | None, routing_group: str | None) -> dict[str, str]:
    """The query string of `GET /workers` and `GET /loads`."""
    params = {}
    if model_name is not None:
        params["model_name"] = model_name
    if routing_group is not None:
        params["routing_group"] = routing_group
    return params


def worker_fields(endpoint: str | None, block_size: int | None, kv_events_endpoint: str | None,
                  kv_events_endpoints: dict[int, str] | None, replay_endpoint: str | None,
                  data_parallel_start_rank: int | None, data_parallel_size: int | None,
                  max_num_batched_tokens: int | None, total_kv_blocks: int | None) -> dict[str, Any]:
    """A worker record's usual fields, the ones left unset left out (ranks of the endpoint map
    written as the JSON keys they are)."""
    body: dict[str, Any] = {}
    for name, value in (("endpoint", endpoint), ("block_size", block_size),
                        ("kv_events_endpoint", kv_events_endpoint), ("replay_endpoint", replay_endpoint),
                        ("data_parallel_start_rank", data_parallel_start_rank),
                        ("data_parallel_size", data_parallel_size), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("total_kv_blocks", total_kv_blocks)):
        if value is not None:
            body[name] = value
    if kv_events_endpoints is not None:
        body["kv_events_endpoints"] = {str(rank): url for rank, url in kv_events_endpoints.items()}
    return body


__all__ = [
    "Overlap", "PartitionLoads", "RankOverlap", "Readiness", "Reservation", "SelectedWorker", "TieredOverlap",
    "WorkerRecord",
]
