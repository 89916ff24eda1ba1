"""Block hashes bit-compatible with NVIDIA Dynamo 1.6.1's KV router.

Dynamo names two hashes per KV block:

* the **local block hash** ("tokens_hash"): XXH3-64 over the block's token ids, each written
  as a 4-byte little-endian u32, seeded with 1337 (plus the LoRA / cache-salt terms below).
  It depends on the block's tokens only, not on its position, and it is what the indexer's
  prefix tree is keyed on and what `/query` computes from `token_ids`;
* the **sequence hash**: a chain over the local hashes, which engines publish as their
  opaque "external" block ids. The indexer never computes it; it is here for publishers,
  test fixtures and the slot tracker's `sequence_hashes`.

Hashes travel as u64 in KV events and dumps but as signed i64 in `/query_by_hash` and the slot
tracker. `to_signed` / `to_unsigned` (and their list forms) are the only place the
two's-complement reinterpretation is written.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Final

from xxhash import xxh3_64_intdigest

from .base.integers import I64_MAX, I64_MIN, U64_MASK, U64_MAX, U64_MODULUS

LOCAL_HASH_SEED: Final = 1337
"""Seed of local block hashes without LoRA adapter or cache salt (Dynamo's `XXH3_SEED`)."""

# Seed of the sequence-hash chain. Dynamo's own publishers in the sources contemporary with
# 1.6.1 chain with `compute_hash`, i.e. XXH3 seeded with `XXH3_SEED` = 1337
# (`lib/kv-router/src/protocols.rs: compute_seq_hash_for_block`), and the mocker engine still
# does "to preserve existing wire values". Newer `lib/tokens` (`TokenBlockSequence`, KVBM)
# documents seed 0. The indexer never checks external hashes, so this only has to be stable
# and match what Dynamo-side publishers emit; pass `seed=0` to reproduce the newer chain.
SEQUENCE_HASH_SEED: Final = 1337
"""Default seed of the sequence-hash chain (1337, as Dynamo 1.6.1's publishers chain)."""

_SALT_SEED: Final = 1  # XXH3 seed of the cache-salt term

_pack_pair = struct.Struct("<QQ").pack


def block_hash_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed of local block hashes: 1337, plus XXH3(lora_name, seed 0) for a LoRA
    adapter, plus XXH3(cache_salt, seed 1) for a cache namespace (mod 2**64).

    An empty string counts as absent, as in Dynamo.
    """
    seed = LOCAL_HASH_SEED
    if lora_name:
        seed += xxh3_64_intdigest(lora_name.encode("utf-8"), 0)
    if cache_salt:
        seed += xxh3_64_intdigest(cache_salt.encode("utf-8"), _SALT_SEED)
    return seed & U64_MASK


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian u32 bytes of `tokens`, packed in one C call (struct checks the range,
    and is measurably faster than building an `array`); ValueError names a bad token."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        for index, token in enumerate(tokens):
            if not isinstance(token, int) or not 0 <= token <= 0xFFFF_FFFF:
                raise ValueError(f"token_ids[{index}]: {token!r} is not a u32") from None
        raise


def local_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Local hash (u64) of every full block of `tokens`; a trailing partial block is ignored.

    `block_size` 0 gives no blocks, as in Dynamo. Raises ValueError for any token that is not
    an integer in the u32 range, the ignored tail included, as Dynamo rejects the whole request.
    A bool passes as 0/1: rejecting JSON booleans is the request validator's job, and this
    function stays one C-level pack.
    """
    if block_size < 0:
        raise ValueError(f"block_size must not be negative, got {block_size}")
    data = _token_bytes(tokens)  # every token is checked, the ignored tail too
    if block_size == 0:
        return []
    count = len(tokens) // block_size
    seed = block_hash_seed(lora_name, cache_salt)
    step = block_size * 4
    # Slicing bytes (a copy of `step` bytes) is cheaper per call here than memoryview slices.
    return [xxh3_64_intdigest(data[start : start + step], seed) for start in range(0, count * step, step)]


def local_block_hashes_with_media(
    tokens: Sequence[int],
    block_size: int,
    media: Sequence[Sequence[int] | None],
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    window: int = 0,
) -> list[int]:
    """`local_block_hashes` for blocks that carry multimodal objects, or Eagle windows.

    `media[i]` lists the multimodal hashes (u64) of block i, or None: Dynamo appends them,
    sorted, as little-endian u64 after the block's token bytes (checked against Dynamo 1.6.1's
    `compute_block_hash_for_seq(block_mm_infos=...)`). `window` extra tokens are hashed with
    each block (Eagle speculative decoding hashes `block_size + 1` tokens at a stride of
    `block_size`); the blocks are still `block_size` apart.
    """
    if block_size <= 0:
        return []
    data = _token_bytes(tokens)
    count = (len(tokens) - window) // block_size
    seed = block_hash_seed(lora_name, cache_salt)
    step = block_size * 4
    span = step + window * 4
    hashes = []
    for index in range(max(count, 0)):
        start = index * step
        block = data[start : start + span]
        extra = media[index] if index < len(media) else None
        if extra:
            block += struct.pack(f"<{len(extra)}Q", *sorted(value & U64_MASK for value in extra))
        hashes.append(xxh3_64_intdigest(block, seed))
    return hashes


def sequence_hashes(local_hashes: Iterable[int], seed: int = SEQUENCE_HASH_SEED) -> list[int]:
    """Dynamo's chained block hashes: seq[0] = local[0],
    seq[i] = XXH3(le_u64(seq[i-1]) || le_u64(local[i]), seed). Inputs may be u64 or i64."""
    result: list[int] = []
    previous: int | None = None
    for local in local_hashes:
        local &= U64_MASK
        previous = local if previous is None else xxh3_64_intdigest(_pack_pair(previous, local), seed)
        result.append(previous)
    return result



def to_signed(value: int) -> int:
    """The i64 with the same 64 bits as `value` (a u64, or an i64 already)."""
    if not I64_MIN <= value <= U64_MAX:
        raise ValueError(f"{value} is outside the u64 and i64 ranges")
    return value - U64_MODULUS if value > I64_MAX else value


def to_unsigned(value: int) -> int:
    """The u64 with the same 64 bits as `value` (an i64, or a u64 already)."""
    if not I64_MIN <= value <= U64_MAX:
        raise ValueError(f"{value} is outside the u64 and i64 ranges")
    return value & U64_MASK


def to_signed_list(values: Sequence[int]) -> list[int]:
    """`to_signed` over a list; values must already be known to lie in the u64/i64 range."""
    if not values or max(values) <= I64_MAX:
        return list(values)
    return [value - U64_MODULUS if value > I64_MAX else value for value in values]


def to_unsigned_list(values: Sequence[int]) -> list[int]:
    """`to_unsigned` over a list; values must already be known to lie in the u64/i64 range."""
    if not values or min(values) >= 0:
        return list(values)
    # `% 2**64` gives the same bits as `& U64_MASK` a third faster: CPython's bitwise `&` on a
    # negative int builds two's-complement copies first.
    return [value % U64_MODULUS for value in values]


__all__ = [
    # The hash ranges, from `dynamo_lite.base.integers`: what the conversions below convert between.
    "U64_MASK",
    "I64_MIN",
    "I64_MAX",
    "U64_MAX",
    "U64_MODULUS",
    "LOCAL_HASH_SEED",
    "SEQUENCE_HASH_SEED",
    "block_hash_seed",
    "local_block_hashes",
    "local_block_hashes_with_media",
    "sequence_hashes",
    "to_signed",
    "to_unsigned",
    "to_signed_list",
    "to_unsigned_list",
]
