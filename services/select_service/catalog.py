"""The worker catalog: one record per worker, what it lacks, and the ranks it listens on.

A registration never fails for what a record lacks: the record is kept `incomplete`, with the
reasons listed in Dynamo's order and words, and becomes `schedulable` once a `PATCH` or a new
`POST` completes it. Only schedulable workers are indexed, booked and selected.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from dynamo_lite.base.integers import U32_MAX

from .protocols import WorkerFields, WorkerRequest

Lifecycle = Literal["incomplete", "schedulable", "draining", "unschedulable"]

# The record's fields in the order Dynamo writes them; the last four are left out when empty.
_OMITTED_WHEN_EMPTY = ("kv_events_endpoints", "router_hint_worker_type", "router_hint_source_control_endpoints",
                       "kv_event_source_mode")


@dataclass(slots=True)
class WorkerRecord:
    """A worker as registered: its id, partition and every field of `WorkerFields`, plus its
    lifecycle and why it is not schedulable."""

    worker_id: int
    model_name: str
    routing_group: str
    lifecycle: Lifecycle = "incomplete"
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: dict[str, str] = field(default_factory=dict)
    replay_endpoint: str | None = None
    block_size: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: list[str] = field(default_factory=list)
    topology_domains: dict[str, str] = field(default_factory=dict)
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: str | None = None
    kv_transfer_preferred_weight: float | None = None
    router_hint_worker_type: str | None = None
    router_hint_source_control_endpoints: dict[str, str] = field(default_factory=dict)
    kv_event_source_mode: str | None = None
    not_schedulable_reasons: list[str] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: WorkerRequest) -> WorkerRecord:
        model_name, routing_group = request.partition
        record = cls(request.worker_id, model_name, routing_group)
        record.apply(request, replace_all=True)
        return record

    def apply(self, changes: WorkerFields, *, replace_all: bool = False) -> None:
        """Take `changes`' fields: every one (an upsert), or only those sent (a patch: null and
        absent leave a field as it is, as in Dynamo)."""
        for name in WorkerFields.__struct_fields__:
            value = getattr(changes, name)
            if value is None and not replace_all:
                continue
            if value is None and name in ("kv_events_endpoints", "router_hint_source_control_endpoints",
                                          "topology_domains"):
                value = {}
            elif value is None and name == "taints":
                value = []
            elif name == "taints":
                value = sorted(set(value))  # a set in Dynamo: duplicates fold
            setattr(self, name, value)

    @property
    def partition(self) -> tuple[str, str]:
        return self.model_name, self.routing_group

    @property
    def schedulable(self) -> bool:
        return self.lifecycle == "schedulable"

    def ranks(self) -> range:
        start = self.data_parallel_start_rank or 0
        size = 1 if self.data_parallel_size is None else self.data_parallel_size
        return range(start, start + size)

    def listener_endpoints(self) -> dict[int, str]:
        """The KV-event publisher of each rank: `kv_events_endpoints` when sent, else the one
        `kv_events_endpoint` for a single-rank worker (Dynamo's rule: with several ranks, the
        scalar endpoint names none of them)."""
        if self.kv_events_endpoints:
            return {int(rank): endpoint for rank, endpoint in self.kv_events_endpoints.items() if endpoint}
        if self.kv_events_endpoint and (self.data_parallel_size in (None, 1)):
            return {self.data_parallel_start_rank or 0: self.kv_events_endpoint}
        return {}

    def missing(self) -> list[str]:
        """Why the record cannot be scheduled from its own fields, in Dynamo's order and words."""
        reasons = []
        if not self.endpoint:
            reasons.append("endpoint is required")
        if not self.block_size:
            reasons.append("block_size must be greater than 0")
        if self.data_parallel_size == 0:
            reasons.append("data_parallel_size must be greater than 0")
        ranks = self.ranks()
        if len(ranks) and ranks.stop - 1 > U32_MAX:
            # Dynamo saturates the range to nothing and calls the worker schedulable (with no rank).
            return [*reasons, f"data-parallel ranks {ranks.start}..{ranks.stop - 1} exceed the u32 range"]
        listening = self.listener_endpoints()
        reasons.extend(f"kv_events endpoint is required for dp_rank {rank}"
                       for rank in self.ranks() if rank not in listening)
        if self.replay_endpoint and (self.data_parallel_size or 1) > 1:
            reasons.append("replay_endpoint is supported only for data_parallel_size 1")
        return reasons

    def answer(self) -> dict[str, Any]:
        """The record as the routes answer it."""
        body: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in _OMITTED_WHEN_EMPTY and not value:
                continue
            if item.name == "not_schedulable_reasons" and not value:
                continue
            body[item.name] = list(value) if isinstance(value, list) else (dict(value) if isinstance(value, dict)
                                                                           else value)
        return body


def endpoint_problem(endpoint: str) -> str | None:
    """What a SUB or DEALER socket could not connect to in `endpoint`, in Dynamo's words (its
    `validate_endpoint`; Rust's integer parse errors for a bad port), or None. Stricter in two
    cases Dynamo lets through to a socket that never connects: port 0 and the bind-only host `*`."""
    scheme, separator, address = endpoint.partition("://")
    if not separator:
        return "missing scheme"
    if scheme not in ("tcp", "ipc", "inproc"):
        return f"unsupported scheme `{scheme}`"
    if not address:
        return "missing address"
    if scheme != "tcp":
        return None
    if address.startswith("["):
        close = address.find("]")
        if close < 0:
            return "missing closing `]`"
        host, rest = address[1:close], address[close + 1:]
        if not rest.startswith(":"):
            return "missing TCP port"
        port = rest[1:]
    else:
        host, colon, port = address.rpartition(":")
        if not colon:
            return "missing TCP port"
    if not host:
        return "missing TCP host"
    if not port:
        return "invalid TCP port: cannot parse integer from empty string"
    if not (port.isascii() and port.isdigit()):
        return "invalid TCP port: invalid digit found in string"
    if int(port) > 65535:
        return "invalid TCP port: number too large to fit in target type"
    if int(port) == 0:
        return "invalid TCP port: 0 (a socket connects to 1..65535)"
    if host == "*":
        return "the host `*` binds; name the engine's address to connect to"
    return None


__all__ = ["Lifecycle", "WorkerRecord", "endpoint_problem"]
