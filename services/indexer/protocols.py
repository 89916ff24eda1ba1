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

`parse_events_document` checks the whole document before returning, so callers can apply all
of it or none of it; every failure is an `InvalidShape` (422) naming the offending field, e.g.
`"m:default".events[3].event.data.stored.blocks[0].block_hash: expected an integer in the u64
or i64 range, got string`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Annotated, Any, Final, Literal, NamedTuple, NoReturn, Union

import msgspec
import orjson
from msgspec import UNSET, UnsetType

from dynamo_lite.errors import InvalidShape
from dynamo_lite.hashing import to_unsigned, to_unsigned_list
from dynamo_lite.integers import I64_MIN, U32_MAX, U64_MAX
from dynamo_lite.validation import decode_json, describe

StorageTier = Literal["device", "host_pinned", "disk", "external"]
DEVICE: Final = "device"
LOWER_TIERS: Final[tuple[StorageTier, ...]] = ("host_pinned", "disk", "external")
STORAGE_TIERS: Final[tuple[StorageTier, ...]] = (DEVICE, *LOWER_TIERS)
_TIER_NAMES: Final = frozenset(STORAGE_TIERS)

_MISSING: Final = object()
_HASH_RANGE: Final = "an integer in the u64 or i64 range"


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


# --- parsing ---------------------------------------------------------------------------------


def parse_events_document(document: Any) -> list[PartitionEvents]:
    """Validate a whole events/dump document and return it typed, in document order."""
    if type(document) is not dict:
        raise InvalidShape(
            f"expected a JSON object mapping \"<model_name>:<tenant_id>\" to "
            f"{{\"block_size\", \"events\"}}, got {describe(document)}"
        )
    return [_parse_partition(key, section) for key, section in document.items()]


def _parse_partition(key: str, section: Any) -> PartitionEvents:
    where = _quote(key)
    model_name, colon, tenant_id = key.rpartition(":")
    if not colon:
        raise InvalidShape(f'{where}: a partition key is written "<model_name>:<tenant_id>"')
    if type(section) is not dict:
        raise InvalidShape(f"{where}: expected an object with block_size and events, got {describe(section)}")
    if "error" in section and "events" not in section:
        raise InvalidShape(f"{where}: the dump of this partition failed: {section['error']!r}")
    block_size = section.get("block_size", _MISSING)
    if type(block_size) is not int or not 0 <= block_size <= U32_MAX:
        _bad(f"{where}.block_size", "an integer in the u32 range", block_size)
    events = section.get("events", _MISSING)
    if type(events) is not list:
        _bad(f"{where}.events", "an array of RouterEvents", events)
    approximations = section.get("approximations", _MISSING)
    return PartitionEvents(
        model_name,
        tenant_id,
        block_size,
        [_parse_event(event, where, i) for i, event in enumerate(events)],
        [] if approximations is _MISSING else _parse_approximations(approximations, where),
    )


def _parse_approximations(raw: Any, where: str) -> list[Approximation]:
    """msgspec's own type check names the bad field (`... - at `$[0].blocks[1].expires_at``);
    the hash and id ranges are checked here."""
    try:
        entries = msgspec.convert(raw, list[_Approximation])
    except msgspec.ValidationError as error:
        raise InvalidShape(f"{where}.approximations: {error}") from None
    try:
        return [_approximation(entry) for entry in entries]
    except _Refused:
        for index, entry in enumerate(entries):
            path = f"{where}.approximations[{index}]"
            if entry.worker_id > U64_MAX:
                _bad(f"{path}.worker_id", "an integer in the u64 range", entry.worker_id)
            if entry.parent_hash is not None and not I64_MIN <= entry.parent_hash <= U64_MAX:
                _bad(f"{path}.parent_hash", f"null or {_HASH_RANGE}", entry.parent_hash)
            for position, block in enumerate(entry.blocks):
                for name in ("block_hash", "tokens_hash"):
                    value = getattr(block, name)
                    if not I64_MIN <= value <= U64_MAX:
                        _bad(f"{path}.blocks[{position}].{name}", _HASH_RANGE, value)
        raise


def _parse_event(raw: Any, where: str, index: int) -> RouterEvent:
    # Paths are only formatted on failure: this runs once per event on the ingest path.
    if type(raw) is not dict:
        _bad(_path(where, index, ""), "a RouterEvent object", raw)
    worker_id = raw.get("worker_id", _MISSING)
    if type(worker_id) is not int or not 0 <= worker_id <= U64_MAX:
        _bad(_path(where, index, ".worker_id"), "an integer in the u64 range", worker_id)
    tier = raw.get("storage_tier", DEVICE)
    if type(tier) is not str or tier not in _TIER_NAMES:
        _bad(_path(where, index, ".storage_tier"), 'one of "device", "host_pinned", "disk", "external"', tier)
    inner = raw.get("event", _MISSING)
    if type(inner) is not dict:
        _bad(_path(where, index, ".event"), "an object", inner)
    event_id = inner.get("event_id", _MISSING)
    if type(event_id) is not int or not 0 <= event_id <= U64_MAX:
        _bad(_path(where, index, ".event.event_id"), "an integer in the u64 range", event_id)
    dp_rank = inner.get("dp_rank", 0)
    if "dp_rank" in raw or type(dp_rank) is not int or not 0 <= dp_rank <= U32_MAX:
        dp_rank = _dp_rank(raw, inner, where, index)
    data = inner.get("data", _MISSING)
    parsed: EventData
    if data == "cleared":
        parsed = CLEARED
    elif type(data) is dict and len(data) == 1:
        if "stored" in data:
            parsed = _parse_stored(data["stored"], where, index)
        elif "removed" in data:
            parsed = _parse_removed(data["removed"], where, index)
        elif "cleared" in data and data["cleared"] is None:
            parsed = CLEARED
        else:
            _bad(_path(where, index, ".event.data"), '{"stored": ...}, {"removed": ...} or "cleared"', data)
    else:
        _bad(_path(where, index, ".event.data"), '{"stored": ...}, {"removed": ...} or "cleared"', data)
    return RouterEvent(worker_id, dp_rank, event_id, tier, parsed)


def _dp_rank(raw: dict[str, Any], inner: dict[str, Any], where: str, index: int) -> int:
    """Dynamo writes dp_rank inside "event"; a top-level one is accepted too, if they agree."""
    outer = raw.get("dp_rank", _MISSING)
    nested = inner.get("dp_rank", _MISSING)
    for value, suffix in ((outer, ".dp_rank"), (nested, ".event.dp_rank")):
        if value is not _MISSING and (type(value) is not int or not 0 <= value <= U32_MAX):
            _bad(_path(where, index, suffix), "an integer in the u32 range", value)
    if outer is _MISSING:
        return 0 if nested is _MISSING else nested
    if nested is not _MISSING and nested != outer:
        raise InvalidShape(
            f"{_path(where, index, '.dp_rank')}: {outer} differs from event.dp_rank {nested}"
        )
    rank: int = outer
    return rank


def _parse_stored(stored: Any, where: str, index: int) -> Stored:
    if type(stored) is not dict:
        _bad(_path(where, index, ".event.data.stored"), "an object", stored)
    parent = stored.get("parent_hash")
    if parent is not None:
        if type(parent) is not int or not I64_MIN <= parent <= U64_MAX:
            _bad(_path(where, index, ".event.data.stored.parent_hash"), f"null or {_HASH_RANGE}", parent)
        parent = to_unsigned(parent)
    blocks = stored.get("blocks", _MISSING)
    if type(blocks) is not list:
        _bad(_path(where, index, ".event.data.stored.blocks"), "an array of blocks", blocks)
    if len(blocks) == 1 and type(blocks[0]) is dict:
        # A missing field reaches _hash_list as _MISSING, which reports it by name.
        block_hashes = [blocks[0].get("block_hash", _MISSING)]
        tokens_hashes = [blocks[0].get("tokens_hash", _MISSING)]
    else:
        try:
            block_hashes = [block["block_hash"] for block in blocks]
            tokens_hashes = [block["tokens_hash"] for block in blocks]
        except (TypeError, KeyError, IndexError):
            _find_bad_block(blocks, where, index)
            raise
    block_hashes = _hash_list(block_hashes, where, index, ".event.data.stored.blocks", ".block_hash")
    tokens_hashes = _hash_list(tokens_hashes, where, index, ".event.data.stored.blocks", ".tokens_hash")
    return Stored(parent, block_hashes, tokens_hashes)


def _find_bad_block(blocks: list[Any], where: str, index: int) -> None:
    for position, block in enumerate(blocks):
        path = _path(where, index, f".event.data.stored.blocks[{position}]")
        if type(block) is not dict:
            _bad(path, "an object with block_hash and tokens_hash", block)
        for name in ("block_hash", "tokens_hash"):
            if name not in block:
                raise InvalidShape(f"{path}.{name}: missing field")


def _parse_removed(removed: Any, where: str, index: int) -> Removed:
    if type(removed) is not dict:
        _bad(_path(where, index, ".event.data.removed"), "an object", removed)
    hashes = removed.get("block_hashes", _MISSING)
    if type(hashes) is not list:
        _bad(_path(where, index, ".event.data.removed.block_hashes"), "an array of hashes", hashes)
    return Removed(_hash_list(hashes, where, index, ".event.data.removed.block_hashes", ""))


def _hash_list(values: list[Any], where: str, index: int, array_path: str, field: str) -> list[int]:
    """`values` as u64s, checked with C-level passes; the slow scan runs only to name a bad one."""
    if len(values) == 1:  # decode-time stores carry one block: skip the set/min/max passes
        value = values[0]
        if type(value) is int and 0 <= value <= U64_MAX:
            return values
    elif not values:
        return values
    if set(map(type, values)) == {int}:
        low = min(values)
        if low >= 0 and max(values) <= U64_MAX:
            return values
        if low >= I64_MIN and max(values) <= U64_MAX:
            return to_unsigned_list(values)
    for position, value in enumerate(values):
        if type(value) is not int or not I64_MIN <= value <= U64_MAX:
            _bad(_path(where, index, f"{array_path}[{position}]{field}"), _HASH_RANGE, value)
    return to_unsigned_list(values)


def _path(where: str, index: int, suffix: str) -> str:
    return f"{where}.events[{index}]{suffix}"


def _quote(key: str) -> str:
    return orjson.dumps(key).decode()


def _bad(path: str, expected: str, value: Any) -> NoReturn:
    if value is _MISSING:
        raise InvalidShape(f"{path}: missing field")
    raise InvalidShape(f"{path}: expected {expected}, got {describe(value)}")


# --- decoding in one pass ---------------------------------------------------------------------
# The same document as msgspec Structs: one C pass decodes and type-checks it (about half the
# time of orjson plus `parse_events_document` for 1,024 blocks). Whatever these types refuse,
# or whatever needs a check they cannot express, is parsed again by `parse_events_document`,
# which names the problem; it stays the definition of what is accepted.


class _Block(msgspec.Struct):
    block_hash: int
    tokens_hash: int


class _Stored(msgspec.Struct):
    blocks: list[_Block]
    parent_hash: int | None = None


class _Removed(msgspec.Struct):
    block_hashes: list[int]


class _Data(msgspec.Struct, forbid_unknown_fields=True):
    """`{"stored": ...}`, `{"removed": ...}` or `{"cleared": null}`: exactly one is set."""

    stored: _Stored | UnsetType = UNSET
    removed: _Removed | UnsetType = UNSET
    cleared: None | UnsetType = UNSET


class _Event(msgspec.Struct):
    event_id: Annotated[int, msgspec.Meta(ge=0)]
    data: Literal["cleared"] | _Data
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)] | UnsetType = UNSET


class _RouterEvent(msgspec.Struct):
    worker_id: Annotated[int, msgspec.Meta(ge=0)]
    event: _Event
    storage_tier: StorageTier = DEVICE
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)] | UnsetType = UNSET


class _ApproximateBlock(msgspec.Struct):
    block_hash: int
    tokens_hash: int
    expires_at: float


class _Approximation(msgspec.Struct):
    worker_id: Annotated[int, msgspec.Meta(ge=0)]
    blocks: list[_ApproximateBlock]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)] = 0
    parent_hash: int | None = None


class _Section(msgspec.Struct):
    block_size: Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
    events: list[_RouterEvent]
    approximations: list[_Approximation] = []


_decode_document = msgspec.json.Decoder(dict[str, _Section]).decode
_block_hashes = attrgetter("block_hash")
_tokens_hashes = attrgetter("tokens_hash")


class _Refused(Exception):
    """The fast path cannot take this document; `parse_events_document` will say why."""


class EventsDocument(NamedTuple):
    """A posted `/events` document: the bytes as received (what a replica publishes to the
    stream unchanged) and its sections, parsed."""

    body: bytes
    sections: list[PartitionEvents]


def read_events_document(body: bytes) -> EventsDocument:
    """The `/events` route's reader, the same with and without `--nats`."""
    return EventsDocument(body, decode_events_document(body))


def decode_events_document(body: bytes) -> list[PartitionEvents]:
    """`parse_events_document(json.loads(body))`, faster for documents it accepts."""
    try:
        return [_section(key, section) for key, section in _decode_document(body).items()]
    except Exception:  # noqa: BLE001 - msgspec raises several kinds, `_Refused` the rest
        return parse_events_document(decode_json(body))


def _section(key: str, section: _Section) -> PartitionEvents:
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


def _approximation(raw: _Approximation) -> Approximation:
    parent = raw.parent_hash
    if raw.worker_id > U64_MAX or (parent is not None and not I64_MIN <= parent <= U64_MAX):
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


def _event(raw: _RouterEvent) -> RouterEvent:
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
            if not I64_MIN <= parent <= U64_MAX:
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
    if not values:
        return values
    low = min(values)
    if low >= 0 and max(values) <= U64_MAX:
        return values
    if low >= I64_MIN and max(values) <= U64_MAX:
        return to_unsigned_list(values)
    raise _Refused


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
