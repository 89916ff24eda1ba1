"""Dynamo 1.6.1 hash compatibility: the observed test vectors and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from dynamo_lite.hashing import (
    I64_MAX,
    I64_MIN,
    U64_MAX,
    block_hash_seed,
    local_block_hashes,
    sequence_hashes,
    to_signed,
    to_signed_list,
    to_unsigned,
    to_unsigned_list,
)

pytestmark = pytest.mark.unit

# (tokens, block_size, options, u64 hashes, i64 hashes) exactly as observed on Dynamo 1.6.1;
# None where the i64 form is the same (every hash below 2**63).
VECTORS = [
    (
        list(range(0, 32)),
        16,
        {},
        [15310707395893867146, 15292316782987903195],
        [-3136036677815684470, -3154427290721648421],
    ),
    (list(range(0, 32)), 32, {}, [5756925433886871916], None),
    (
        list(range(1, 65)),
        16,
        {},
        [16863443419780771464, 2287610619914608821, 12129935312930971799, 5453111288643762282],
        [-1583300653928780152, 2287610619914608821, -6316808760778579817, 5453111288643762282],
    ),
    (list(range(1, 65)), 32, {}, [6399025751206689338, 8774225238254794491], None),
    ([7] * 16 + [8] * 16, 16, {}, [8771127959296939342, 4852085626999092119], None),
    (
        list(range(0, 40)),
        16,
        {},
        [15310707395893867146, 15292316782987903195],
        [-3136036677815684470, -3154427290721648421],
    ),
    (list(range(0, 16)), 16, {"lora_name": "my-lora"}, [7774427462321301335], None),
    (list(range(0, 16)), 16, {"cache_salt": "tenant-a"}, [2130915519417463704], None),
    ([0, 1, 2, 3], 4, {}, [9143094415614847814], None),
    ([100, 101, 102, 103], 4, {}, [6320977984009303047], None),
]


@pytest.mark.parametrize(("tokens", "block_size", "options", "unsigned", "signed"), VECTORS)
def test_reference_vectors(
    tokens: list[int], block_size: int, options: dict[str, str], unsigned: list[int], signed: list[int] | None
) -> None:
    signed = unsigned if signed is None else signed
    hashes = local_block_hashes(tokens, block_size, **options)
    assert hashes == unsigned
    assert to_signed_list(hashes) == signed
    assert [to_signed(h) for h in hashes] == signed
    assert to_unsigned_list(signed) == unsigned


def test_seed_values() -> None:
    assert block_hash_seed() == 1337
    assert block_hash_seed("my-lora") == 12827409268353072861
    assert block_hash_seed(cache_salt="tenant-a") == 1948188790972764086
    both = block_hash_seed("my-lora", "tenant-a")
    assert both == (12827409268353072861 + 1948188790972764086 - 1337) % 2**64


def test_empty_strings_count_as_absent() -> None:
    tokens = list(range(16))
    plain = local_block_hashes(tokens, 16)
    assert local_block_hashes(tokens, 16, lora_name="", cache_salt="") == plain
    assert local_block_hashes(tokens, 16, lora_name="my-lora") != plain
    assert local_block_hashes(tokens, 16, lora_name="my-lora", cache_salt="tenant-a") not in (
        plain,
        local_block_hashes(tokens, 16, lora_name="my-lora"),
    )


def test_short_inputs_and_block_size_zero() -> None:
    assert local_block_hashes([], 16) == []
    assert local_block_hashes(list(range(15)), 16) == []
    assert local_block_hashes(list(range(64)), 0) == []
    with pytest.raises(ValueError):
        local_block_hashes([1, 2], -1)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_tokens_must_be_u32(bad: object) -> None:
    with pytest.raises(ValueError, match=r"token_ids\[2\]"):
        local_block_hashes([1, 2, bad, 4], 2)  # type: ignore[list-item]


def test_u32_bounds_are_accepted() -> None:
    assert len(local_block_hashes([0, 2**32 - 1], 2)) == 1


def test_sequence_hashes_chain_with_seed_1337_by_default() -> None:
    local = local_block_hashes(list(range(1, 65)), 16)
    chained = sequence_hashes(local)
    assert chained[0] == local[0]
    for i in range(1, len(local)):
        data = chained[i - 1].to_bytes(8, "little") + local[i].to_bytes(8, "little")
        assert chained[i] == xxh3_64_intdigest(data, 1337)
    assert sequence_hashes(local, seed=0)[1] == xxh3_64_intdigest(
        local[0].to_bytes(8, "little") + local[1].to_bytes(8, "little"), 0
    )
    assert sequence_hashes(to_signed_list(local)) == chained
    assert sequence_hashes([]) == []


def test_signed_unsigned_bounds() -> None:
    assert to_signed(0) == 0
    assert to_signed(I64_MAX) == I64_MAX
    assert to_signed(I64_MAX + 1) == I64_MIN
    assert to_signed(U64_MAX) == -1
    assert to_signed(-5) == -5
    assert to_unsigned(-1) == U64_MAX
    assert to_unsigned(I64_MIN) == 2**63
    assert to_unsigned(U64_MAX) == U64_MAX
    for bad in (U64_MAX + 1, I64_MIN - 1):
        with pytest.raises(ValueError):
            to_signed(bad)
        with pytest.raises(ValueError):
            to_unsigned(bad)
    assert to_unsigned_list([]) == [] and to_signed_list([]) == []


@given(st.integers(0, U64_MAX))
def test_u64_round_trip(value: int) -> None:
    signed = to_signed(value)
    assert I64_MIN <= signed <= I64_MAX
    assert to_unsigned(signed) == value
    assert to_signed_list([value]) == [signed] and to_unsigned_list([signed]) == [value]


@given(st.integers(I64_MIN, I64_MAX))
def test_i64_round_trip(value: int) -> None:
    assert to_signed(to_unsigned(value)) == value


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=80),
    st.integers(1, 9),
    st.sampled_from([None, "", "adapter-a"]),
    st.sampled_from([None, "", "tenant-b"]),
)
def test_blocks_hash_independently_like_a_plain_xxh3(
    tokens: list[int], block_size: int, lora_name: str | None, cache_salt: str | None
) -> None:
    """An independent implementation: per full block, XXH3 of LE u32 bytes."""
    seed = 1337
    if lora_name:
        seed += xxh3_64_intdigest(lora_name.encode(), 0)
    if cache_salt:
        seed += xxh3_64_intdigest(cache_salt.encode(), 1)
    expected = [
        xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens[i : i + block_size]), seed % 2**64)
        for i in range(0, len(tokens) - block_size + 1, block_size)
    ]
    assert local_block_hashes(tokens, block_size, lora_name=lora_name, cache_salt=cache_salt) == expected


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=64))
def test_list_conversions_agree_with_the_scalar_ones(values: list[int]) -> None:
    # to_unsigned_list has a fast path for all-i64 lists; both paths must match the scalar rule.
    assert to_unsigned_list(values) == [to_unsigned(v) for v in values]
    assert to_signed_list(values) == [to_signed(v) for v in values]
