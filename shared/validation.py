"""Typed readers for decoded JSON request bodies.

Each reader either returns a value of the promised Python type or raises `InvalidShape` (422)
naming the field, so handlers never see a bool where an int belongs, a float, or a null.
Unknown fields are ignored, as Dynamo's serde-based services do.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import countOf
from typing import Annotated, Any, Final, TypeVar

import msgspec
import orjson

from .errors import InvalidArgument, InvalidShape, MalformedRequest
from .integers import I64_MAX, I64_MIN, U32_MAX, U64_MAX

_MISSING: Final = object()


def describe(value: Any) -> str:
    """How an error message names a decoded JSON value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        if value.is_integer() and abs(value) >= 2**63:
            # orjson reads an integer beyond the 64-bit range as a float: say what was sent.
            return f"an integer beyond the 64-bit range (about {value:.4g})"
        return "floating point number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def expect_object(body: Any, what: str) -> dict[str, Any]:
    if type(body) is not dict:
        raise InvalidShape(f"invalid type: {describe(body)}, expected a JSON object ({what})")
    return body


def string(body: dict[str, Any], name: str, default: Any = _MISSING) -> str:
    value = body.get(name, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise InvalidShape(f"missing field `{name}`")
        fallback: str = default
        return fallback
    if type(value) is not str:
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected a string")
    return value


def optional_string(body: dict[str, Any], name: str) -> str | None:
    """A string that may also be absent or null (fields Dynamo declares as Option<String>)."""
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not str:
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected a string")
    return value


def _bounded_int(body: dict[str, Any], name: str, low: int, high: int, kind: str, default: Any) -> int:
    value = body.get(name, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise InvalidShape(f"missing field `{name}`")
        fallback: int = default
        return fallback
    if type(value) is not int:
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected {kind}")
    if not low <= value <= high:
        raise InvalidShape(f"{name}: invalid value: integer `{value}`, expected {kind}")
    return value


def u64(body: dict[str, Any], name: str, default: Any = _MISSING) -> int:
    return _bounded_int(body, name, 0, U64_MAX, "u64", default)


def u32(body: dict[str, Any], name: str, default: Any = _MISSING) -> int:
    return _bounded_int(body, name, 0, U32_MAX, "u32", default)


def i64_list(body: dict[str, Any], name: str) -> list[int]:
    """A list of signed 64-bit integers, checked with C-level passes only (this is the hot path)."""
    value = body.get(name, _MISSING)
    if value is _MISSING:
        raise InvalidShape(f"missing field `{name}`")
    if type(value) is not list:
        raise InvalidShape(
            f"{name}: invalid type: {describe(value)}, expected an array of signed 64-bit integers"
        )
    if not value:
        return value
    if countOf(map(type, value), int) != len(value):  # no set to build: a third faster
        index, bad = next((i, v) for i, v in enumerate(value) if type(v) is not int)
        raise InvalidShape(f"{name}[{index}]: invalid type: {describe(bad)}, expected i64")
    # orjson decodes integers below -2**63 as floats, rejected above, so only the top needs a pass.
    if max(value) > I64_MAX:
        index, bad = next((i, v) for i, v in enumerate(value) if not I64_MIN <= v <= I64_MAX)
        raise InvalidShape(
            f"{name}[{index}]: invalid value: integer `{bad}`, expected i64 (hashes travel signed: write "
            f"a u64 above 2**63 - 1 as value - 2**64, e.g. dynamo_lite.hashing.to_signed, here {bad - 2**64})"
        )
    return value


def u32_list(body: dict[str, Any], name: str) -> list[int]:
    """A list of u32 values (token ids), checked with C-level passes only."""
    value = body.get(name, _MISSING)
    if value is _MISSING:
        raise InvalidShape(f"missing field `{name}`")
    if type(value) is not list:
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected an array of u32")
    if not value:
        return value
    if countOf(map(type, value), int) != len(value):
        index, bad = next((i, v) for i, v in enumerate(value) if type(v) is not int)
        raise InvalidShape(f"{name}[{index}]: invalid type: {describe(bad)}, expected u32")
    if min(value) < 0 or max(value) > U32_MAX:
        index, bad = next((i, v) for i, v in enumerate(value) if not 0 <= v <= U32_MAX)
        raise InvalidShape(f"{name}[{index}]: invalid value: integer `{bad}`, expected u32")
    return value


def tenant(body: dict[str, Any]) -> str:
    """The partition's tenant: `tenant_id`, or its input alias `routing_group`; default "default"."""
    return resolve_tenant(_optional_string(body, "tenant_id"), _optional_string(body, "routing_group"))


def _optional_string(body: dict[str, Any], name: str) -> str | None:
    """`body[name]`, a string, or None when absent (a JSON null is a wrong type, not absent)."""
    value = body.get(name, _MISSING)
    if value is _MISSING:
        return None
    if not isinstance(value, str):
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected a string")
    return value


def resolve_tenant(tenant_id: str | None, routing_group: str | None) -> str:
    if tenant_id is not None and routing_group is not None and tenant_id != routing_group:
        raise InvalidArgument(
            f"tenant_id {tenant_id!r} and its alias routing_group {routing_group!r} differ; send one"
        )
    if tenant_id is not None:
        return tenant_id
    if routing_group is not None:
        return routing_group
    return "default"


def decode_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedRequest(f"Failed to parse the request body as JSON: {exc}") from None


# --- typed request bodies ---------------------------------------------------------------------

class RequestBody(msgspec.Struct):
    """A route's request type: decoded and type-checked in one C pass by msgspec.

    msgspec checks the JSON types (no bool for an int, no null for a string, no float) and the
    integer ranges (`U64`, `U32`, `I64`); what it cannot express is `in_range`. A body that
    fails either is read again by `from_json`, the field-by-field readers above, which either raise
    the precise 400/422 naming the field (rare, so its cost does not matter) or build the same
    request: the fast path only ever accepts a subset of what `from_json` accepts, with the
    same values, so the two can never disagree.
    """

    def in_range(self) -> bool:
        return True

    @classmethod
    def from_json(cls: type[R], body: Any) -> R:
        raise NotImplementedError


R = TypeVar("R", bound=RequestBody)


def decoder(request_type: type[R]) -> Callable[[bytes], R]:
    """The body reader of one request type (see `RequestBody`)."""
    fast = msgspec.json.Decoder(request_type).decode

    def decode(body: bytes) -> R:
        try:
            request = fast(body)
        except Exception:  # noqa: BLE001 - msgspec raises several kinds; the slow path explains
            pass
        else:
            if request.in_range():
                return request
        return request_type.from_json(decode_json(body))

    return decode


# Integer ranges msgspec checks while it decodes (a u32 rank, i64 hashes). Its bounds must fit
# an i64, so a `U64` field's top is checked by `in_range` (`is_u64`).
U64 = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
I64 = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]


def is_u64(value: int) -> bool:
    return value <= U64_MAX


def tenant_of(tenant_id: str | msgspec.UnsetType, routing_group: str | msgspec.UnsetType) -> str:
    return resolve_tenant(
        None if tenant_id is msgspec.UNSET else tenant_id,
        None if routing_group is msgspec.UNSET else routing_group,
    )
