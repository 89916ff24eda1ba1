"""Dynamo RouterEvents as they appear in `GET /dump` and `POST /events` documents.

A document maps each partition, written `"<model_name>:<tenant_id>"`, to its block size and
its events:

    {"llama:default": {"block_size": 16, "events": [RouterEvent, ...],
                       "approximations"?: [Approximation, ...]}, ...}

    RouterEvent = {"worker_id": u64, "dp_rank"?: u32, "storage_tier"?: tier,
                   "residency_domain"?: ignored,
                   "event": {"event_id": u64, "dp_rank"?: u32, "data": data}}
    data = {"stored": {"parent_hash": hash | null, "start_position"?: ignored,
                       "blocks": [{"block_hash": hash, "tokens_hash": hash,
                                   "mm_extra_info"?: ignored}, ...]}}
         | {"removed": {"block_hashes": [hash, ...]}}
         | "cleared"

    Approximation = {"worker_id": u64, "dp_rank"?: u32, "parent_hash"?: hash | null,
                     "blocks": [{"block_hash": hash, "tokens_hash": hash,
                                 "expires_at": Unix time in seconds}, ...]}

`block_hash` is the engine's opaque (external) id of a block, `tokens_hash` the local block
hash the index is keyed on. `approximations` (our extension, left out when a partition has
none; Dynamo 1.6.1 ignores it) are the blocks `/routed` recorded, named by sequence hashes,
with the time each expires. A hash may be written as a u64 or as the i64 with the same bits;
both are normalised to u64 here, so the rest of the indexer only sees u64.

Partition keys are split at the LAST colon: model names do contain colons ("meta/llama:8b",
Ollama-style tags) while tenant ids are short labels, so "meta/llama:8b:default" is model
"meta/llama:8b", tenant "default". The indexer refuses tenant ids containing ":" so that every
key it writes in a dump reads back as the same partition.

`decode_events_document` (bytes) and `parse_events_document` (decoded JSON) check the whole
document before returning, so callers can apply all of it or none of it; every failure is an
`InvalidShape` (422) naming the offending field, e.g.
`"m:default".events[3].event.data.stored.blocks[0].block_hash: expected an integer in the u64
or i64 range, got string`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Annotated, Any, ClassVar, Final, Literal, NamedTuple, Union

import msgspec
import orjson
from msgspec import UNSET, UnsetType

from dynamo_lite.base.errors import InvalidShape
from dynamo_lite.base.integers import I64_MIN, U64_MAX
from dynamo_lite.hashing import to_unsigned, to_unsigned_list
from dynamo_lite.web.validation import U32, U64, decode_json, describe, expected, explain, refused

StorageTier = Literal["device", "host_pinned", "disk", "external"]
DEVICE: Final = "device"
LOWER_TIERS: Final[tuple[StorageTier, ...]] = ("host_pinned", "disk", "external")
STORAGE_TIERS: Final[tuple[StorageTier, ...]] = (DEVICE, *LOWER_TIERS)


@dataclass(slots=True)
class Stored:
    """Blocks stored as a chain under `parent_hash` (None: the chain starts at the root).
    `block_hashes[i]` (external) and `tokens_hashes[i]` (local) describe block i."""

    parent_hash: int | None
    block_hashes: list[int]
    tokens_hashes: list[int]


@dataclass(slots=True)
class Removed:
    block_hashes: list[int]


@dataclass(slots=True)
class Cleared:
    """Every block of the (worker, dp_rank), on every tier, is gone."""


CLEARED: Final = Cleared()

EventData = Union[Stored, Removed, Cleared]


@dataclass(slots=True)
class RouterEvent:
    worker_id: int
    dp_rank: int
    event_id: int
    storage_tier: StorageTier
    data: EventData


@dataclass(slots=True)
class Approximation:
    """Blocks a rank is assumed to hold because requests were routed to it (`/routed`), as a
    chain under `parent_hash` like `Stored`: `block_hashes` are sequence hashes of the local
    hashes `tokens_hashes`, and `expires_at[i]` is when block i's approximation lapses (Unix
    time in seconds)."""

    worker_id: int
    dp_rank: int
    parent_hash: int | None
    block_hashes: list[int]
    tokens_hashes: list[int]
    expires_at: list[float]


@dataclass(slots=True)
class PartitionEvents:
    model_name: str
    tenant_id: str
    block_size: int
    events: list[RouterEvent]
    approximations: list[Approximation] = field(default_factory=list)

    @property
    def key(self) -> str:
        return partition_key(self.model_name, self.tenant_id)


def partition_key(model_name: str, tenant_id: str) -> str:
    return f"{model_name}:{tenant_id}"


def split_partition_key(key: str) -> tuple[str, str]:
    """(model_name, tenant_id) of a document key, split at the last colon."""
    model_name, colon, tenant_id = key.rpartition(":")
    if not colon:
        raise ValueError(f'{key!r} is not "<model_name>:<tenant_id>"')
    return model_name, tenant_id


# --- the wire types ---------------------------------------------------------------------------
# The document, declared once: msgspec decodes a body straight into these Structs in one C pass
# (the hot path of `/events`), and when it refuses one, `validation.explain` walks the decoded
# JSON against the same declaration, in declaration order, to name the first problem. Fields
# are declared in the order they are checked (`kw_only=True` lets a required field follow an
# optional one); rules across fields are the `rules_before` / `rules_after` hooks. Unknown
# fields are ignored (`start_position`, `mm_extra_info`, `residency_domain`), except in `data`.

Hash = Annotated[int, msgspec.Meta(ge=I64_MIN)]  # a u64, or the i64 with the same bits
"""A block hash as documents write it; u64 on the way in (`explain` bounds it by u64)."""


class WireBlock(msgspec.Struct, kw_only=True):
    expected: ClassVar[str] = "an object with block_hash and tokens_hash"
    block_hash: Hash
    tokens_hash: Hash


class WireStored(msgspec.Struct, kw_only=True):
    parent_hash: Hash | None = None
    blocks: Annotated[list[WireBlock], expected("an array of blocks")]


class WireRemoved(msgspec.Struct, kw_only=True):
    block_hashes: Annotated[list[Hash], expected("an array of hashes")]


_TIERS: Final = "one of " + ", ".join(f'"{tier}"' for tier in STORAGE_TIERS)
_DATA_SHAPES: Final = '{"stored": ...}, {"removed": ...} or "cleared"'


class WireData(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`{"stored": ...}`, `{"removed": ...}` or `{"cleared": null}`: exactly one is set."""

    expected: ClassVar[str] = _DATA_SHAPES
    stored: WireStored | UnsetType = UNSET
    removed: WireRemoved | UnsetType = UNSET
    cleared: None | UnsetType = UNSET

    @staticmethod
    def rules_before(raw: dict[str, Any], path: str) -> None:
        if len(raw) != 1 or raw.get("cleared", None) is not None:
            raise refused(path, _DATA_SHAPES, raw)


class WireEvent(msgspec.Struct, kw_only=True):
    event_id: U64
    dp_rank: U32 | UnsetType = UNSET
    data: Annotated[Literal["cleared"] | WireData, expected(_DATA_SHAPES)]


class WireRouterEvent(msgspec.Struct, kw_only=True):
    """Dynamo writes dp_rank inside "event"; a top-level one is accepted too, if they agree."""

    expected: ClassVar[str] = "a RouterEvent object"
    worker_id: U64
    storage_tier: Annotated[StorageTier, expected(_TIERS)] = DEVICE
    event: WireEvent
    dp_rank: U32 | UnsetType = UNSET

    @staticmethod
    def rules_after(raw: dict[str, Any], path: str) -> None:
        outer, nested = raw.get("dp_rank"), raw["event"].get("dp_rank")
        if outer is not None and nested is not None and outer != nested:
            raise InvalidShape(f"{path}.dp_rank: {outer} differs from event.dp_rank {nested}")


class WireApproximateBlock(msgspec.Struct, kw_only=True):
    block_hash: Hash
    tokens_hash: Hash
    expires_at: float


class WireApproximation(msgspec.Struct, kw_only=True):
    worker_id: U64
    dp_rank: U32 = 0
    parent_hash: Hash | None = None
    blocks: list[WireApproximateBlock]


class WireSection(msgspec.Struct, kw_only=True):
    expected: ClassVar[str] = "an object with block_size and events"
    block_size: U32
    events: Annotated[list[WireRouterEvent], expected("an array of RouterEvents")]
    approximations: list[WireApproximation] = []

    @staticmethod
    def rules_before(raw: dict[str, Any], path: str) -> None:
        if "error" in raw and "events" not in raw:
            raise InvalidShape(f"{path}: the dump of this partition failed: {raw['error']!r}")


WireDocument = dict[str, WireSection]

_decode_document = msgspec.json.Decoder(WireDocument).decode
_block_hashes = attrgetter("block_hash")
_tokens_hashes = attrgetter("tokens_hash")


class _Refused(Exception):
    """msgspec took the document, but a check it cannot express failed; `explain` says which."""


class EventsDocument(NamedTuple):
    """A posted `/events` document: the bytes as received (what a replica publishes to the
    stream unchanged) and its sections, parsed."""

    body: bytes
    sections: list[PartitionEvents]


def read_events_document(body: bytes) -> EventsDocument:
    """The `/events` route's reader, the same with and without `--nats`."""
    return EventsDocument(body, decode_events_document(body))


def decode_events_document(body: bytes) -> list[PartitionEvents]:
    """An events or dump document's bytes, validated whole and typed, in document order: so
    callers can apply all of it or none of it."""
    try:
        return [_section(key, section) for key, section in _decode_document(body).items()]
    except Exception as refusal:  # noqa: BLE001 - msgspec raises several kinds, `_Refused` the rest
        raise _explained(decode_json(body), refusal) from None


def parse_events_document(document: Any) -> list[PartitionEvents]:
    """`decode_events_document` for a document already decoded from JSON."""
    try:
        return [_section(key, section) for key, section in msgspec.convert(document, WireDocument).items()]
    except Exception as refusal:  # noqa: BLE001 - as above
        raise _explained(document, refusal) from None


def _explained(document: Any, refusal: Exception) -> InvalidShape:
    try:
        explain_events_document(document)
    except InvalidShape as problem:
        return problem
    # The declaration's two readers disagree: a bug (tests/test_events_decoding.py looks for it),
    # still answered as a refusal rather than a 500.
    return InvalidShape(f"the document was refused ({refusal or type(refusal).__name__})")


def explain_events_document(document: Any) -> None:
    """Raise the `InvalidShape` naming the first problem of a decoded document, or return if
    it conforms to the declaration: `validation.explain` over `WireSection`, plus the rules of
    the document's keys."""
    if type(document) is not dict:
        raise InvalidShape(
            f"expected a JSON object mapping \"<model_name>:<tenant_id>\" to "
            f"{{\"block_size\", \"events\"}}, got {describe(document)}"
        )
    for key, section in document.items():
        where = _quote(key)
        if ":" not in key:
            raise InvalidShape(f'{where}: a partition key is written "<model_name>:<tenant_id>"')
        explain(WireSection, section, where)


def _section(key: str, section: WireSection) -> PartitionEvents:
    model_name, colon, tenant_id = key.rpartition(":")
    if not colon:
        raise _Refused
    return PartitionEvents(
        model_name,
        tenant_id,
        section.block_size,
        [_event(event) for event in section.events],
        [_approximation(entry) for entry in section.approximations],
    )


def _approximation(raw: WireApproximation) -> Approximation:
    parent = raw.parent_hash
    if raw.worker_id > U64_MAX or (parent is not None and parent > U64_MAX):
        raise _Refused
    blocks = raw.blocks
    return Approximation(
        raw.worker_id,
        raw.dp_rank,
        None if parent is None else to_unsigned(parent),
        _u64s(list(map(_block_hashes, blocks))),
        _u64s(list(map(_tokens_hashes, blocks))),
        [block.expires_at for block in blocks],
    )


def _event(raw: WireRouterEvent) -> RouterEvent:
    inner = raw.event
    if raw.worker_id > U64_MAX or inner.event_id > U64_MAX:
        raise _Refused
    outer_rank, dp_rank = raw.dp_rank, inner.dp_rank
    if outer_rank is not UNSET:
        if dp_rank is not UNSET and dp_rank != outer_rank:
            raise _Refused
        dp_rank = outer_rank
    elif dp_rank is UNSET:
        dp_rank = 0
    data = inner.data
    parsed: EventData
    if data == "cleared":
        parsed = CLEARED
    elif data.stored is not UNSET:
        if data.removed is not UNSET or data.cleared is not UNSET:
            raise _Refused
        stored = data.stored
        parent = stored.parent_hash
        if parent is not None:
            if parent > U64_MAX:
                raise _Refused
            parent = to_unsigned(parent)
        blocks = stored.blocks
        parsed = Stored(parent, _u64s(list(map(_block_hashes, blocks))), _u64s(list(map(_tokens_hashes, blocks))))
    elif data.removed is not UNSET:
        if data.cleared is not UNSET:
            raise _Refused
        parsed = Removed(_u64s(data.removed.block_hashes))
    elif data.cleared is None:
        parsed = CLEARED
    else:
        raise _Refused  # {}
    return RouterEvent(raw.worker_id, dp_rank, inner.event_id, raw.storage_tier, parsed)


def _u64s(values: list[int]) -> list[int]:
    """Hashes msgspec bounded below by i64's minimum, as u64s."""
    if not values:
        return values
    if max(values) > U64_MAX:
        raise _Refused
    if min(values) >= 0:
        return values
    return to_unsigned_list(values)


def _quote(key: str) -> str:
    return orjson.dumps(key).decode()


# --- serializing -----------------------------------------------------------------------------


def event_to_json(event: RouterEvent) -> dict[str, Any]:
    """One RouterEvent in Dynamo 1.6.1's `/dump` shape, hashes as unsigned integers."""
    data = event.data
    body: Any
    if type(data) is Stored:
        body = {
            "stored": {
                "parent_hash": data.parent_hash,
                "start_position": None,
                "blocks": [
                    {"block_hash": block_hash, "tokens_hash": tokens_hash, "mm_extra_info": None}
                    for block_hash, tokens_hash in zip(data.block_hashes, data.tokens_hashes)
                ],
            }
        }
    elif type(data) is Removed:
        body = {"removed": {"block_hashes": list(data.block_hashes)}}
    else:
        body = "cleared"
    return {
        "worker_id": event.worker_id,
        "storage_tier": event.storage_tier,
        "residency_domain": "worker",
        "event": {"event_id": event.event_id, "dp_rank": event.dp_rank, "data": body},
    }


def approximation_to_json(approximation: Approximation) -> dict[str, Any]:
    return {
        "worker_id": approximation.worker_id,
        "dp_rank": approximation.dp_rank,
        "parent_hash": approximation.parent_hash,
        "blocks": [
            {"block_hash": block_hash, "tokens_hash": tokens_hash, "expires_at": expires_at}
            for block_hash, tokens_hash, expires_at in zip(
                approximation.block_hashes, approximation.tokens_hashes, approximation.expires_at
            )
        ],
    }


def section_to_json(partition: PartitionEvents) -> dict[str, Any]:
    """One partition's section; `approximations` only when it has some, so the dump of an
    index fed by events alone is exactly Dynamo's."""
    section: dict[str, Any] = {
        "block_size": partition.block_size,
        "events": [event_to_json(event) for event in partition.events],
    }
    if partition.approximations:
        section["approximations"] = [approximation_to_json(entry) for entry in partition.approximations]
    return section


def events_document(partitions: Iterable[PartitionEvents]) -> dict[str, Any]:
    """The `/dump` document of `partitions` (one key each, even when it has no events)."""
    return {partition.key: section_to_json(partition) for partition in partitions}
