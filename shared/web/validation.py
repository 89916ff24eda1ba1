"""Typed readers for decoded JSON request bodies.

Each reader either returns a value of the promised Python type or raises `InvalidShape` (422)
naming the field, so handlers never see a bool where an int belongs, a float, or a null.
Unknown fields are ignored, as Dynamo's serde-based services do.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import countOf
from typing import Annotated, Any, ClassVar, Final, TypeVar

import msgspec
import orjson

from dynamo_lite.base.errors import InvalidArgument, InvalidShape, MalformedRequest
from dynamo_lite.base.integers import I64_MAX, I64_MIN, U32_MAX, U64_MAX

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


def string(body: dict[str, Any], name: str) -> str:
    value = body.get(name, _MISSING)
    if value is _MISSING:
        raise InvalidShape(f"missing field `{name}`")
    if type(value) is not str:
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected a string")
    return value


def _bounded_int(body: dict[str, Any], name: str, low: int, high: int, kind: str) -> int:
    value = body.get(name, _MISSING)
    if value is _MISSING:
        raise InvalidShape(f"missing field `{name}`")
    if type(value) is not int:
        raise InvalidShape(f"{name}: invalid type: {describe(value)}, expected {kind}")
    if not low <= value <= high:
        raise InvalidShape(f"{name}: invalid value: integer `{value}`, expected {kind}")
    return value


def u64(body: dict[str, Any], name: str) -> int:
    return _bounded_int(body, name, 0, U64_MAX, "u64")


def u32(body: dict[str, Any], name: str) -> int:
    return _bounded_int(body, name, 0, U32_MAX, "u32")


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
            f"tenant_id `{tenant_id}` and its alias routing_group `{routing_group}` differ; send one"
        )
    if tenant_id is not None:
        return tenant_id
    if routing_group is not None:
        return routing_group
    return "default"


JSON_FAILURE: Final = "failed to parse the request body as JSON: "


def decode_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedRequest(f"{JSON_FAILURE}{exc}") from None


# --- typed request bodies ---------------------------------------------------------------------

class RequestBody(msgspec.Struct):
    """A route's request type, declared once: its fields, in the order Dynamo checks them
    (subclasses pass `kw_only=True`, so a required field may follow an optional one).

    The fast path is msgspec decoding straight into the struct, in one C pass: it checks the
    JSON types (no bool for an int, no null for a string, no float) and the integer ranges
    (`U64`, `U32`, `I64`); a `U64`'s top, which msgspec cannot bound, is checked after it. A body
    that fails is read again by the ordered path `decoder` derives from the same declaration:
    the field readers above, field by field in declaration order (`tenant_id` with its alias
    `routing_group`, which follows it), raising the precise 400/422 naming the first problem.
    The ordered path accepts exactly what the fast path accepts, with the same values
    (`tests/test_request_bodies.py`).

    Hand-written code is left for rules across fields: `check`, run on the value either path
    built, and `checks_before`, rules on the decoded body run just before the named field is
    read (where Dynamo checks them), which `check` must repeat if the fast path can accept the
    body.
    """

    checks_before: ClassVar[dict[str, Callable[[dict[str, Any]], None]]] = {}

    def check(self) -> None:
        """Rules across fields: raise the 400/422 the route answers."""


R = TypeVar("R", bound=RequestBody)
_Reader = Callable[[dict[str, Any]], Any]


def decoder(request_type: type[R]) -> Callable[[bytes], R]:
    """The body reader of one request type (see `RequestBody`)."""
    fast = msgspec.json.Decoder(request_type).decode
    u64_names = tuple(
        field.name for field in msgspec.inspect.type_info(request_type).fields  # type: ignore[attr-defined]
        if _is_u64(field.type)
    )
    aliased = "routing_group" in request_type.__struct_fields__
    checked = request_type.check is not RequestBody.check
    ordered = ordered_reader(request_type)

    def decode(body: bytes) -> R:
        try:
            request = fast(body)
        except Exception:  # noqa: BLE001 - msgspec raises several kinds; the ordered path explains
            return ordered(decode_json(body))
        for name in u64_names:
            if getattr(request, name) > U64_MAX:
                return ordered(decode_json(body))
        if aliased and request.routing_group is not msgspec.UNSET:  # type: ignore[attr-defined]
            tenant_of(request.tenant_id, request.routing_group)  # type: ignore[attr-defined]
        if checked:
            request.check()
        return request

    return decode


def ordered_reader(request_type: type[R]) -> Callable[[Any], R]:
    """The ordered path of `decoder`: a decoded JSON document to a request, or the first error."""
    what = request_type.__name__
    steps: list[tuple[str, _Reader]] = []
    for field in msgspec.inspect.type_info(request_type).fields:  # type: ignore[attr-defined]
        if field.name == "routing_group":
            continue  # read with tenant_id
        steps.append((field.name, _tenant_pair if field.name == "tenant_id" else _field_reader(field, what)))

    def read(body: Any) -> R:
        body = expect_object(body, what)
        values: dict[str, Any] = {}
        for name, reader in steps:
            rule = request_type.checks_before.get(name)
            if rule is not None:
                rule(body)
            if name == "tenant_id":
                values["tenant_id"], values["routing_group"] = reader(body)
            else:
                values[name] = reader(body)
        request = request_type(**values)
        request.check()
        return request

    return read


def _is_u64(info: msgspec.inspect.Type) -> bool:
    return isinstance(info, msgspec.inspect.IntType) and info.ge == 0 and info.le is None


def _field_reader(field: msgspec.inspect.Field, what: str) -> _Reader:
    """The field reader matching one declared field's type (absent: its default, or UNSET)."""
    name, info = field.name, field.type
    if field.default is not msgspec.NODEFAULT:
        default: Any = field.default
    else:
        default = _MISSING if field.required else msgspec.UNSET
    types = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    others = [t for t in types if not isinstance(t, msgspec.inspect.NoneType)]
    nullable = len(others) < len(types)
    if not others:  # only null: a rule in `checks_before` explains any other value
        return lambda body: None
    (info,) = others
    value_reader = _value_reader(name, info, what)

    def read(body: dict[str, Any]) -> Any:
        value = body.get(name, _MISSING)
        if value is _MISSING or (nullable and value is None):
            if default is _MISSING:
                raise InvalidShape(f"missing field `{name}`")
            return default
        return value_reader(body)

    return read


def _value_reader(name: str, info: msgspec.inspect.Type, what: str) -> _Reader:
    if isinstance(info, msgspec.inspect.StrType):
        return lambda body: string(body, name)
    if isinstance(info, msgspec.inspect.IntType):
        if _is_u64(info):
            return lambda body: u64(body, name)
        if info.ge == 0 and info.le == U32_MAX:
            return lambda body: u32(body, name)
    if isinstance(info, msgspec.inspect.ListType) and isinstance(info.item_type, msgspec.inspect.IntType):
        if info.item_type.ge == I64_MIN and info.item_type.le == I64_MAX:
            return lambda body: i64_list(body, name)
        if info.item_type.ge == 0 and info.item_type.le == U32_MAX:
            return lambda body: u32_list(body, name)
    raise TypeError(f"{what}.{name}: no field reader for {info}")


def _tenant_pair(body: dict[str, Any]) -> tuple[Any, Any]:
    """`tenant_id` and `routing_group` as declared (UNSET when absent), checked together."""
    tenant(body)
    return body.get("tenant_id", msgspec.UNSET), body.get("routing_group", msgspec.UNSET)


# Integer ranges msgspec checks while it decodes (a u32 rank, i64 hashes). Its bounds must fit
# an i64, so a `U64` field's top is checked after it (`decoder`).
U64 = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
I64 = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]


def tenant_of(tenant_id: str | msgspec.UnsetType, routing_group: str | msgspec.UnsetType) -> str:
    return resolve_tenant(
        None if tenant_id is msgspec.UNSET else tenant_id,
        None if routing_group is msgspec.UNSET else routing_group,
    )


# --- explaining a refused document ------------------------------------------------------------
# Documents (the indexer's `/events` and `/dump`) are declared once, as msgspec Structs, and
# decoded by msgspec in one pass. When msgspec refuses one, `explain` walks the decoded JSON
# against the same declaration, field by field in declaration order, and raises the first
# problem as `<path>: expected <what>, got <value>` (or `<path>: missing field`). What a type
# is called comes from the declaration: `Annotated[T, expected("...")]`, a Struct's `expected`
# ClassVar, or the type itself. Rules across fields are hooks on the Struct:
# `rules_before(raw, path)` runs on the raw object before its fields are read,
# `rules_after(raw, path)` once they all passed.


def expected(text: str) -> msgspec.Meta:
    """`Annotated[T, expected("...")]`: how error messages name what T accepts."""
    return msgspec.Meta(extra={"expected": text})


def explain(declared: Any, value: Any, path: str) -> None:
    """Raise the `InvalidShape` naming the first part of `value` that does not conform to
    `declared`; return if it conforms."""
    _explain(msgspec.inspect.type_info(declared), value, path)


def refused(path: str, expected: str, value: Any) -> InvalidShape:
    if value is _MISSING:
        return InvalidShape(f"{path}: missing field")
    return InvalidShape(f"{path}: expected {expected}, got {describe(value)}")


def _explain(info: msgspec.inspect.Type, value: Any, path: str) -> None:
    expected = _expected(info)
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        # A null, a literal, or (for an object) the union's one Struct, which says what is wrong.
        if value is None and any(isinstance(t, msgspec.inspect.NoneType) for t in info.types):
            return
        for member in info.types:
            if isinstance(member, msgspec.inspect.LiteralType) and _is_literal(member, value):
                return
        for member in info.types:
            if isinstance(member, msgspec.inspect.StructType) and type(value) is dict:
                _explain_struct(member, value, path, expected)
                return
        others = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(others) == 1 and isinstance(_unwrap(others[0]), (msgspec.inspect.StructType, msgspec.inspect.ListType)):
            _explain(others[0], value, path)  # the part inside says what is wrong
            return
        if len(others) == 1 and _conforms(others[0], value):
            return
        raise refused(path, expected, value)
    if isinstance(info, msgspec.inspect.StructType):
        if type(value) is not dict:
            raise refused(path, expected, value)
        _explain_struct(info, value, path, expected)
    elif isinstance(info, msgspec.inspect.ListType):
        if type(value) is not list:
            raise refused(path, expected, value)
        for index, item in enumerate(value):
            _explain(info.item_type, item, f"{path}[{index}]")
    elif isinstance(info, msgspec.inspect.IntType):
        # msgspec's bounds must fit an i64: a declared integer without `le` is bounded by u64.
        high = U64_MAX if info.le is None else info.le
        if type(value) is not int or (info.ge is not None and value < info.ge) or value > high:
            raise refused(path, expected, value)
    elif isinstance(info, msgspec.inspect.FloatType):
        if type(value) not in (int, float):
            raise refused(path, expected, value)
    elif isinstance(info, msgspec.inspect.StrType):
        if type(value) is not str:
            raise refused(path, expected, value)
    elif isinstance(info, msgspec.inspect.LiteralType):
        if not _is_literal(info, value):
            raise refused(path, expected, value)
    elif isinstance(info, msgspec.inspect.NoneType):
        if value is not None:
            raise refused(path, expected, value)
    else:
        raise TypeError(f"{path}: explain() does not know {info}")


def _unwrap(info: msgspec.inspect.Type) -> msgspec.inspect.Type:
    return info.type if isinstance(info, msgspec.inspect.Metadata) else info


def _conforms(info: msgspec.inspect.Type, value: Any) -> bool:
    try:
        _explain(info, value, "")
    except InvalidShape:
        return False
    return True


def _is_literal(info: msgspec.inspect.LiteralType, value: Any) -> bool:
    return any(value == allowed and type(value) is type(allowed) for allowed in info.values)


def _explain_struct(info: msgspec.inspect.StructType, raw: dict[str, Any], path: str, expected: str) -> None:
    cls = info.cls
    before = getattr(cls, "rules_before", None)
    if before is not None:
        before(raw, path)
    names: set[str] = set()
    for field in info.fields:
        names.add(field.encode_name)
        value = raw.get(field.encode_name, _MISSING)
        if value is _MISSING:
            if field.required:
                raise refused(f"{path}.{field.encode_name}", "", _MISSING)
            continue
        _explain(field.type, value, f"{path}.{field.encode_name}")
    if info.forbid_unknown_fields and not names.issuperset(raw):
        raise refused(path, expected, raw)
    after = getattr(cls, "rules_after", None)
    if after is not None:
        after(raw, path)


def _expected(info: msgspec.inspect.Type) -> str:
    """How error messages name what `info` accepts."""
    if isinstance(info, msgspec.inspect.Metadata):
        if info.extra and "expected" in info.extra:
            return str(info.extra["expected"])
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        others = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        text = " or ".join(_expected(t) for t in others)
        return f"null or {text}" if len(others) < len(info.types) and any(
            isinstance(t, msgspec.inspect.NoneType) for t in info.types) else text
    if isinstance(info, msgspec.inspect.StructType):
        return str(getattr(info.cls, "expected", "an object"))
    if isinstance(info, msgspec.inspect.IntType):
        if info.ge == 0 and info.le == U32_MAX:
            return "an integer in the u32 range"
        if info.ge == 0 and info.le is None:
            return "an integer in the u64 range"
        if info.ge == I64_MIN and info.le is None:
            return "an integer in the u64 or i64 range"
        return "an integer"
    if isinstance(info, msgspec.inspect.FloatType):
        return "a number"
    if isinstance(info, msgspec.inspect.StrType):
        return "a string"
    if isinstance(info, msgspec.inspect.LiteralType):
        return "one of " + ", ".join(orjson.dumps(v).decode() for v in info.values)
    if isinstance(info, msgspec.inspect.ListType):
        return "an array"
    return str(info)
