"""KV events as inference engines publish them over ZMQ, decoded into RouterEvents.

An engine's publisher sends one message per batch of events, three frames:
`[topic, seq (8-byte big-endian u64), payload]`, the payload a msgpack `KVEventBatch`. The
layouts seen in the field, all of which `decode_batch` applies:

| producer | batch | events |
|---|---|---|
| vLLM up to ~0.10 (what Dynamo 1.6.1 was built for) | `[ts, events, dp_rank]` | positional, tag first: `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys?, group_idx?, kind?, window?]` |
| vLLM builds between | `{"ts", "events", "data_parallel_rank"}` | maps tagged `"type"` |
| vLLM 0.33 (`vllm/distributed/kv_events.py`) | `[ts, events, dp_rank]` | maps tagged `"type"`, optional fields omitted when unset |
| SGLang 0.5 (`sglang/srt/disaggregation/kv_events.py`) | `[ts, events, attn_dp_rank]` | maps tagged `"type"`, one `BlockStored` per page, `cache_salt` / `session_id` fields |

Dynamo 1.6.1 decodes only positional batches; a map batch fails there, every time.

What each event becomes (the reference notes, sections 5 and 6, and Dynamo's `zmq_wire.rs`):

* Block hashes are the engine's opaque ids: ints in the i64 or u64 range (normalised to u64),
  or bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends sha256 digests; they
  become `int.from_bytes(digest, "big") mod 2**64`, the int vLLM itself would have sent).
* The index is keyed on local block hashes, computed here from `token_ids`: the LoRA name
  and a map event's `cache_salt` change the seed; multimodal identifiers (vLLM's 64-hex-digit
  `extra_keys` entries, or `block_mm_infos`) are appended to the block's bytes. Other
  `extra_keys` entries (vLLM repeats the LoRA name and cache salt there, untagged) do not
  change the hash, as in Dynamo. A token array of `[a, b]` pairs is Eagle's bigram form.
* `medium` picks the storage tier; an unknown medium is not indexed (Dynamo 1.6.1 drops such
  an event too), nor is an event of another KV-cache group: a `kv_cache_spec_kind` other than
  full / MLA / sink-full attention (sliding-window, Mamba, ... groups of hybrid models), or,
  without a kind, a `group_idx` other than 0. The prompt's prefix is fully described by the
  main attention group; the others hold only windows of it.
* A store whose `block_size` differs from the partition's stores nothing; blocks past the end
  of `token_ids` are cut, earlier ones kept.

Such events are counted as `ignored` by reason, never silently. A batch that does not decode
(wrong types, unknown event tag, a token outside u32) is dropped whole, as in Dynamo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Union, cast

import msgspec

from dynamo_lite.base.integers import I64_MIN, U64_MASK
from dynamo_lite.hashing import local_block_hashes, local_block_hashes_with_media

from .protocols import CLEARED, EventData, Removed, RouterEvent, StorageTier, Stored

MEDIUM_TIERS: Final[dict[str, StorageTier]] = {
    "GPU": "device",
    "DEVICE": "device",
    "CPU": "host_pinned",
    "CPU_PINNED": "host_pinned",
    "CPU_TIER1": "host_pinned",
    "CPU_TIER2": "disk",
    "DISK": "disk",
    "NVME": "disk",
    "STORAGE": "disk",  # vLLM 0.33's offloading connector, file-system tier
    "EXTERNAL": "external",
    "NETWORK": "external",
    "REMOTE": "external",
    "SHARED": "external",
}
MAIN_ATTENTION_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

# Reasons an event is received but not indexed (the keys of `DecodedBatch.ignored`).
UNKNOWN_MEDIUM: Final = "unknown_medium"
OTHER_GROUP: Final = "other_kv_cache_group"
BLOCK_SIZE_MISMATCH: Final = "block_size_mismatch"
NO_FULL_BLOCK: Final = "no_full_block"
IGNORED_TAG: Final = "ignored_tag"
IGNORE_REASONS: Final = (UNKNOWN_MEDIUM, OTHER_GROUP, BLOCK_SIZE_MISMATCH, NO_FULL_BLOCK, IGNORED_TAG)

_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")

Hash = Union[int, bytes]
# token_ids decode untyped: msgspec builds the list of ints in C either way, a typed
# `list[int | tuple[int, int]]` (ids, or Eagle's pairs) costs a second pass here to tell the forms
# apart, and `Meta` range constraints crash msgspec 0.22 in a Struct field. `_tokens` checks them.
Tokens = Any
U32_MAX: Final = 0xFFFF_FFFF


class MalformedBatch(ValueError):
    """The payload is not a KVEventBatch this indexer can read; the whole batch is dropped."""


# --- wire types --------------------------------------------------------------------------------
# Trailing positional fields are typed Any: producers put group_idx, kv_cache_spec_kind and
# block_mm_infos there in more than one order (Dynamo reads them by type, so does `_filter`).


class _PositionalStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: Tokens = []
    block_size: int = 0
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    trailing_1: Any = None
    trailing_2: Any = None
    trailing_3: Any = None


class _PositionalRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    trailing_1: Any = None
    trailing_2: Any = None


class _PositionalCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _PositionalIgnored(msgspec.Struct, array_like=True, tag="Ignored"):
    pass


class _MapStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[Hash]
    token_ids: Tokens
    block_size: int
    parent_block_hash: Hash | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: Any = None
    block_mm_infos: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _MapIgnored(msgspec.Struct, tag_field="type", tag="Ignored"):
    pass


class _PositionalBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct):
    events: list[msgspec.Raw]
    ts: float = 0.0
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None
    dp_rank: int | None = None


_positional_batch = msgspec.msgpack.Decoder(_PositionalBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_positional_event = msgspec.msgpack.Decoder(
    Union[_PositionalStored, _PositionalRemoved, _PositionalCleared, _PositionalIgnored]
)
_map_event = msgspec.msgpack.Decoder(Union[_MapStored, _MapRemoved, _MapCleared, _MapIgnored])

_Stored = Union[_PositionalStored, _MapStored]


@dataclass(slots=True)
class DecodedBatch:
    """One engine batch as RouterEvents (all with `event_id` = the batch's seq), and what was
    received but not indexed, by reason."""

    dp_rank: int
    events: list[RouterEvent]
    ignored: dict[str, int] = field(default_factory=dict)


def decode_batch(payload: bytes, *, worker_id: int, dp_rank: int, seq: int, block_size: int) -> DecodedBatch:
    """The events of one KVEventBatch payload, for the partition of `block_size`.

    `dp_rank` is the rank the listener was registered for; a batch's own data-parallel rank
    overrides it. Raises `MalformedBatch` when any part does not decode.
    """
    try:
        if _is_map(payload):
            mapped = _map_batch.decode(payload)
            raw_events = mapped.events
            batch_rank = _first_rank(mapped.data_parallel_rank, mapped.attn_dp_rank, mapped.dp_rank)
        else:
            positional = _positional_batch.decode(payload)
            raw_events = positional.events
            batch_rank = positional.data_parallel_rank
        if batch_rank is not None and not 0 <= batch_rank <= 0xFFFF_FFFF:
            raise MalformedBatch(f"data_parallel_rank {batch_rank} is outside the u32 range")
        rank = dp_rank if batch_rank is None else batch_rank
        decoded = DecodedBatch(rank, [])
        for raw in raw_events:
            event = (_map_event if _is_map(raw) else _positional_event).decode(raw)
            data, tier, reason = _convert(event, block_size)
            if reason is not None:
                decoded.ignored[reason] = decoded.ignored.get(reason, 0) + 1
            elif data is not None:  # always, without a reason
                decoded.events.append(RouterEvent(worker_id, rank, seq, tier, data))
        return decoded
    except msgspec.DecodeError as error:
        raise MalformedBatch(str(error)) from None
    except ValueError as error:  # a token outside u32, a bad hash, a bad extra key
        if isinstance(error, MalformedBatch):
            raise
        raise MalformedBatch(str(error)) from None


def _is_map(data: Any) -> bool:
    """Whether a msgpack value is a map: fixmap 0x80-0x8f, map16 0xde, map32 0xdf."""
    view = memoryview(data)
    if not view:
        return False
    first = view[0]
    return 0x80 <= first <= 0x8F or first == 0xDE or first == 0xDF


def _first_rank(*ranks: int | None) -> int | None:
    for rank in ranks:
        if rank is not None:
            return rank
    return None


def _convert(event: Any, block_size: int) -> tuple[EventData | None, StorageTier, str | None]:
    """(data, tier, None), or (None, tier, reason) for an event received but not indexed."""
    if type(event) in (_PositionalCleared, _MapCleared):
        return CLEARED, "device", None
    if type(event) in (_PositionalIgnored, _MapIgnored):
        return None, "device", IGNORED_TAG
    stored = type(event) in (_PositionalStored, _MapStored)
    if stored:
        tokens, window = _tokens(event.token_ids)
    tier = _tier(event.medium)
    if tier is None or not _main_group(event):
        if stored:
            _check_tokens(tokens)  # a bad token fails the batch even when the event is not indexed
        return None, tier or "device", UNKNOWN_MEDIUM if tier is None else OTHER_GROUP
    if not stored:
        return Removed(_hashes(event.block_hashes)), tier, None
    return _stored(event, tokens, window, block_size, tier)


def _tier(medium: str | None) -> StorageTier | None:
    if medium is None:
        return "device"
    tier = MEDIUM_TIERS.get(medium)
    if tier is None:
        tier = MEDIUM_TIERS.get(medium.upper())  # vLLM's Mooncake store connector writes "cpu"
    return tier


def _main_group(event: Any) -> bool:
    if type(event) in (_MapStored, _MapRemoved):
        kind, group = event.kv_cache_spec_kind, event.group_idx
    else:
        kind = group = None
        trailing = (event.trailing_1, event.trailing_2, getattr(event, "trailing_3", None))
        for value in trailing:
            if type(value) is int and group is None:
                group = value
            elif type(value) is str and kind is None:
                kind = value
    if kind is not None:
        return kind in MAIN_ATTENTION_KINDS
    return group is None or group == 0


def _hashes(values: list[Hash]) -> list[int]:
    try:  # ints only, in the u64 range: two C passes (an int compared with bytes raises)
        low: Any = min(values) if values else 0  # an int or bytes, compared once it is known to be an int
        if type(low) is int and low >= 0 and cast(int, max(values, default=0)) <= U64_MASK:
            return cast("list[int]", values)  # every value an int: min() raised otherwise
    except TypeError:
        pass
    return [_hash(value) for value in values]


def _hash(value: Hash) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & U64_MASK
    if not I64_MIN <= value <= U64_MASK:
        raise ValueError(f"block hash {value} is outside the i64 and u64 ranges")
    return value & U64_MASK


def _tokens(raw: Any) -> tuple[list[int], int]:
    """The token ids of an event and how many extra tokens each block's hash covers: Eagle's
    bigram form `[[t0, t1], [t1, t2], ...]` is the tokens t0..tn, each block hashed with the
    first token of the next one. Whether the ids are u32s is checked where they are packed for
    hashing (`dynamo_lite.hashing`), or by `_check_tokens` for an event that is not hashed."""
    if type(raw) is not list:
        raise ValueError("token_ids is not an array")
    if raw and type(raw[0]) is list:
        if any(type(pair) is not list or len(pair) != 2 for pair in raw):
            raise ValueError("token_ids mixes token ids and [token, token] pairs")
        tokens = [pair[0] for pair in raw]
        tokens.append(raw[-1][1])
        _check_tokens([pair[1] for pair in raw])
        return tokens, 1
    return raw, 0


def _check_tokens(tokens: list[Any]) -> None:
    """Every token a u32, as Dynamo's `Vec<u32>` requires: otherwise the batch fails."""
    if tokens and set(map(type, tokens)) != {int}:
        raise ValueError("token_ids: a token is not an integer")
    if tokens and (min(tokens) < 0 or max(tokens) > U32_MAX):
        raise ValueError("token_ids: a token is outside the u32 range")


def _stored(
    event: _Stored, tokens: list[int], window: int, block_size: int, tier: StorageTier
) -> tuple[EventData | None, StorageTier, str | None]:
    if event.block_size != block_size:
        _check_tokens(tokens)
        return None, tier, BLOCK_SIZE_MISMATCH
    full_blocks = (len(tokens) - window) // block_size if block_size else 0
    count = min(len(event.block_hashes), full_blocks)
    if count <= 0:
        _check_tokens(tokens)
        return None, tier, NO_FULL_BLOCK
    block_hashes = _hashes(event.block_hashes[:count])
    parent = None if event.parent_block_hash is None else _hash(event.parent_block_hash)
    cache_salt = event.cache_salt if type(event) is _MapStored else None
    media = _media(event)
    # Hashing packs every token (a bad one fails the batch); blocks past `count` are cut after.
    if media is None and not window:
        locals_ = local_block_hashes(tokens, block_size, lora_name=event.lora_name, cache_salt=cache_salt)
    else:
        locals_ = local_block_hashes_with_media(
            tokens, block_size, media or [], lora_name=event.lora_name, cache_salt=cache_salt, window=window
        )
    if len(locals_) > count:
        del locals_[count:]
    return Stored(parent, block_hashes, locals_), tier, None


def _media(event: _Stored) -> list[list[int] | None] | None:
    """Per block, the multimodal hashes that enter its local hash (None: a text-only event)."""
    infos = event.block_mm_infos if isinstance(event, _MapStored) else _positional_mm_infos(event)
    if infos is not None:
        return _from_mm_infos(infos)
    if event.extra_keys is not None:
        return _from_extra_keys(event.extra_keys)
    return None


def _positional_mm_infos(event: _PositionalStored) -> Any:
    for value in (event.trailing_1, event.trailing_2, event.trailing_3):
        if type(value) is list:
            return value
    return None


def _from_mm_infos(infos: Any) -> list[list[int] | None] | None:
    """Dynamo's own `block_mm_infos`: per block null or {"mm_objects": [{"mm_hash": u64}, ...]}."""
    if type(infos) is not list:
        raise ValueError("block_mm_infos is not an array")
    media: list[list[int] | None] = []
    for info in infos:
        if info is None:
            media.append(None)
            continue
        objects = info.get("mm_objects") if type(info) is dict else None
        if type(objects) is not list:
            raise ValueError("a block_mm_infos entry has no mm_objects array")
        hashes = []
        for item in objects:
            value = item.get("mm_hash") if type(item) is dict else None
            if type(value) is not int:
                raise ValueError("an mm_objects entry has no integer mm_hash")
            hashes.append(_hash(value))
        media.append(hashes or None)
    return media if any(media) else None


def _from_extra_keys(extra_keys: Any) -> list[list[int] | None] | None:
    """vLLM's `extra_keys`: per block null or a list mixing the LoRA name, multimodal
    identifiers (64 hex digits, alone or as [identifier, offset]), the cache salt and prompt
    embedding digests, untagged. Only multimodal identifiers can be told apart; Dynamo keys a
    block on the first 16 hex digits of each, as a u64."""
    if type(extra_keys) is not list:
        raise ValueError("extra_keys is not an array")
    media: list[list[int] | None] = []
    for keys in extra_keys:
        hashes = []
        if type(keys) in (list, tuple):
            for key in keys:
                if type(key) in (list, tuple) and key and type(key[0]) is str:
                    key = key[0]
                if type(key) is str and len(key) == 64 and _HEX_DIGITS.issuperset(key):
                    hashes.append(int(key[:16], 16))
        media.append(hashes or None)
    return media if any(media) else None
