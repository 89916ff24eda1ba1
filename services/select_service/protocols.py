"""The selection service's request types, as Dynamo 1.6.1's `dynamo.select_service` reads them.

Every body is one msgspec Struct decoded in one C pass; unknown fields are ignored (Dynamo's
serde does the same), a JSON syntax error is a 400, a wrong shape a 422 naming the field
(`read`). Rules across fields (a prompt's hash form needs its three fields, a fraction in
[0, 1]) are checked where the core needs them, with Dynamo's messages.

The prompt of a request is `token_ids` (hashed here with the partition's block size) or its
hash form (`block_hashes`, `sequence_hashes`, `isl_tokens`); `token_ids` wins when both are
sent. The partition is (`model_name`, `routing_group`), both "default" when absent;
`tenant_id`, our other services' name for `routing_group`, is accepted as its alias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from dynamo_lite.base.errors import InvalidArgument, InvalidShape
from dynamo_lite.base.integers import U64_MAX
from dynamo_lite.web.validation import I64, U32, U64, decode_json, tenant_of

F64 = float
MAX_DP_SIZE = 4096  # Dynamo's bound on a worker's data-parallel ranks
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class RouterConfigOverride(msgspec.Struct, kw_only=True):
    """Per-request changes of the cost (`router_config_override`). Dynamo 1.6.1 validates all
    of them but applies only the last two; this service applies every one (docs/differences.md).
    `overlap_score_weight` is the deprecated alias of `prefill_load_scale` (0 also turns the
    cache credit off)."""

    overlap_score_credit: F64 | None = None
    prefill_load_scale: F64 | None = None
    overlap_score_weight: F64 | None = None
    router_temperature: F64 | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: F64 | None = None

    def check(self) -> None:
        # Dynamo's texts, as it words them in 1.6.1 (422: a shape it refuses while decoding).
        if self.overlap_score_credit is not None and not _finite_non_negative(self.overlap_score_credit):
            raise InvalidShape("router_config_override: overlap_score_credit must be a finite, non-negative number")
        for name in ("prefill_load_scale", "overlap_score_weight"):
            value = getattr(self, name)
            if value is not None and not _finite_non_negative(value):
                raise InvalidShape(f"router_config_override: {name} must be finite and non-negative")
        if self.router_temperature is not None and not _finite_non_negative(self.router_temperature):
            raise InvalidShape("router_config_override: router_temperature must be finite and non-negative")
        if self.shared_cache_multiplier is not None and not 0.0 <= self.shared_cache_multiplier <= 1.0:
            raise InvalidShape("router_config_override: shared_cache_multiplier must be between 0 and 1")


def _finite_non_negative(value: float) -> bool:
    return value >= 0.0 and value != float("inf")  # NaN fails the first test


class MmRoutingInfo(msgspec.Struct, kw_only=True):
    """A multimodal prompt's routing tokens. Only `routing_token_ids` is used; per-block
    multimodal hashes (`block_mm_infos`) are refused (docs/differences.md)."""

    routing_token_ids: list[U32]
    block_mm_infos: list[Any] = []


class PromptFields(msgspec.Struct, kw_only=True):
    """The prompt, flattened into every request that carries one."""

    token_ids: list[U32] | None = None
    mm_routing_info: MmRoutingInfo | None = None
    block_mm_infos: list[Any] | None = None
    block_hashes: list[I64] | None = None
    sequence_hashes: list[I64] | None = None
    isl_tokens: U64 | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    model_name: str = "default"
    routing_group: str | UnsetType = UNSET  # a null is refused, as in Dynamo
    tenant_id: str | UnsetType = UNSET
    router_config_override: RouterConfigOverride | None = None

    @property
    def partition(self) -> tuple[str, str]:
        return self.model_name, tenant_of(self.tenant_id, self.routing_group)

    def check(self) -> None:
        if self.router_config_override is not None:
            self.router_config_override.check()
        if self.block_mm_infos or (self.mm_routing_info is not None and self.mm_routing_info.block_mm_infos):
            raise InvalidArgument("block_mm_infos (multimodal block hashes) are not supported: send "
                                  "mm_routing_info.routing_token_ids or token_ids")


class SessionContext(msgspec.Struct, kw_only=True):
    session_id: str
    parent_session_id: str | None = None
    session_final: bool | None = None
    input_trigger: Literal["user_message", "tool_result", "other"] | None = None


class AffinityTarget(msgspec.Struct, kw_only=True):
    worker_id: U64
    dp_rank: U32 | None = None


class PinnedWorker(msgspec.Struct, kw_only=True):
    worker_id: U64
    dp_rank: U32


class RoutingConstraints(msgspec.Struct, kw_only=True):
    required_taints: list[str] = []
    preferred_taints: list[str] = []


class SelectRequest(PromptFields, kw_only=True):
    """`POST /select` (and, without `advisory`, `POST /select_and_reserve`)."""

    selection_id: str | None = None
    expected_output_tokens: U32 | None = None
    priority_jump: F64 = 0.0
    strict_priority: U32 = 0
    session_id: str | None = None
    session_context: SessionContext | None = None
    affinity_target: AffinityTarget | None = None
    pinned_worker: PinnedWorker | None = None
    allowed_worker_ids: list[U64] | None = None
    routing_constraints: RoutingConstraints = msgspec.field(default_factory=RoutingConstraints)
    advisory: bool = False

    @property
    def session(self) -> str | None:
        """The session this request belongs to: the structured form wins over the flat one."""
        if self.session_context is not None:
            return self.session_context.session_id
        return self.session_id


class ReservationRequest(PromptFields, kw_only=True):
    """`POST /reservations`: with `worker_id`, book this prompt there; without, book what a
    `/select` with this `selection_id` chose (its cached selection)."""

    selection_id: str
    worker_id: U64 | None = None
    dp_rank: U32 = 0
    expected_output_tokens: U32 | None = None
    effective_prefill_tokens: U64 | None = None
    track_prefill_tokens: bool | None = None


class OutputBlockRequest(msgspec.Struct, kw_only=True):
    """`POST /reservations/{selection_id}/output_block`: one more output block; `decay_fraction`
    (in [0, 1]) weighs every output block of the request from now on."""

    decay_fraction: F64 | None = None

    def check(self) -> None:
        if self.decay_fraction is not None and not 0.0 <= self.decay_fraction <= 1.0:
            raise InvalidArgument("decay_fraction must be between 0.0 and 1.0")


class QueryRequest(PromptFields, kw_only=True):
    """`POST /potential_loads` and `POST /overlap_scores`."""


KvTransferEnforcement = Literal["required", "preferred"]


class WorkerFields(msgspec.Struct, kw_only=True):
    """What a worker's catalog record holds besides its id and partition. All optional: what a
    record lacks makes it `incomplete`, with the reasons listed, never a refused request."""

    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: dict[str, str] | None = None
    replay_endpoint: str | None = None
    block_size: U32 | None = None
    data_parallel_start_rank: U32 | None = None
    data_parallel_size: U32 | None = None
    max_num_batched_tokens: U64 | None = None
    total_kv_blocks: U64 | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: list[str] | None = None
    topology_domains: dict[str, str] | None = None
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: KvTransferEnforcement | None = None
    kv_transfer_preferred_weight: F64 | None = None
    router_hint_worker_type: str | None = None
    router_hint_source_control_endpoints: dict[str, str] | None = None
    kv_event_source_mode: str | None = None

    def check(self) -> None:
        if self.data_parallel_size is not None and self.data_parallel_size > MAX_DP_SIZE:
            raise InvalidArgument(f"data_parallel_size {self.data_parallel_size} exceeds the maximum {MAX_DP_SIZE}")
        for name in ("kv_events_endpoints", "router_hint_source_control_endpoints"):
            mapping = getattr(self, name)
            for key in mapping or ():
                if not (key.isascii() and key.isdigit() and len(key) <= 9):
                    raise InvalidShape(f"{name}.{key}: invalid value: expected a data-parallel rank in quotes")


class WorkerRequest(WorkerFields, kw_only=True):
    """`POST /workers`: a whole record (an upsert replaces the previous one)."""

    worker_id: U64
    model_name: str = "default"
    routing_group: str | UnsetType = UNSET
    tenant_id: str | UnsetType = UNSET

    @property
    def partition(self) -> tuple[str, str]:
        return self.model_name, tenant_of(self.tenant_id, self.routing_group)


class WorkerPatch(WorkerFields, kw_only=True):
    """`PATCH /workers/{worker_id}`: the fields sent replace the record's (null: unchanged, as
    in Dynamo); the partition changes only through `POST /workers`."""


T = TypeVar("T", bound=msgspec.Struct)


def reader(declared: type[T]) -> Callable[[bytes], T]:
    """A body reader: one C pass into `declared`; a syntax error is a 400, a shape error a 422
    with msgspec's description of it (the field's JSON path), then the u64 fields' top (msgspec
    bounds only what fits an i64) and the type's `check`."""
    decode = msgspec.json.Decoder(declared).decode
    check = getattr(declared, "check", None)
    beyond_u64 = _u64_walker(msgspec.inspect.type_info(declared), "$")

    def read(body: bytes) -> T:
        try:
            value = decode(body)
        except msgspec.ValidationError as exc:
            raise InvalidShape(f"failed to deserialize the JSON body into the target type: {exc}") from None
        except msgspec.DecodeError:
            decode_json(body)  # raises the 400 naming the syntax error
            raise InvalidShape("failed to deserialize the JSON body into the target type") from None
        if beyond_u64 is not None:
            where = beyond_u64(value)
            if where is not None:
                raise InvalidShape(f"failed to deserialize the JSON body into the target type: Expected `int` <= "
                                   f"{U64_MAX} - at `{where}`")
        if check is not None:
            value.check()  # type: ignore[attr-defined]
        return value

    return read


_Walker = Callable[[Any], "str | None"]


def _u64_walker(info: msgspec.inspect.Type, path: str) -> _Walker | None:
    """A function naming the first u64 field (`U64`: ge=0 and no upper bound) of a decoded value
    above the u64 range, or None when the type has no such field."""
    if isinstance(info, msgspec.inspect.IntType):
        if info.ge == 0 and info.le is None:
            return lambda value: path if value > U64_MAX else None
        return None
    if isinstance(info, msgspec.inspect.UnionType):
        walkers = [w for w in (_u64_walker(t, path) for t in info.types) if w is not None]
        if not walkers:
            return None
        (walker,) = walkers  # the unions here pair one type with None
        return lambda value: None if value is None else walker(value)
    if isinstance(info, msgspec.inspect.ListType):
        item = _u64_walker(info.item_type, path + "[...]")
        if item is None:
            return None
        return lambda value: next((where for where in map(item, value) if where is not None), None)
    if isinstance(info, msgspec.inspect.StructType):
        fields = [(f.name, w) for f in info.fields if (w := _u64_walker(f.type, f"{path}.{f.name}")) is not None]
        if not fields:
            return None

        def walk(value: Any) -> str | None:
            for name, walker in fields:
                where = walker(getattr(value, name))
                if where is not None:
                    return where
            return None

        return walk
    return None


def optional_reader(declared: type[T]) -> Callable[[bytes], T | None]:
    """`reader`, for a route whose body may be left out (None then)."""
    read = reader(declared)
    return lambda body: read(body) if body else None


__all__ = [
    "AffinityTarget", "MmRoutingInfo", "OutputBlockRequest", "PinnedWorker", "PromptFields", "QueryRequest",
    "ReservationRequest", "RouterConfigOverride", "RoutingConstraints", "SelectRequest", "SessionContext",
    "WorkerFields", "WorkerPatch", "WorkerRequest", "optional_reader", "reader",
]
