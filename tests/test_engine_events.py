"""Decoding engine KV-event batches (services/indexer/engine_events.py), layout by layout.

The payloads are built the way each engine's msgspec encoder writes them (tests/
dynamo_lite.kv_publishers reproduces the engines' Structs byte for byte); a few are written out as
raw bytes from the reference notes, so the decoder is checked against bytes nobody here chose.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest

from dynamo_lite.hashing import local_block_hashes, local_block_hashes_with_media
from dynamo_lite.indexer.engine_events import (
    BLOCK_SIZE_MISMATCH,
    IGNORED_TAG,
    NO_FULL_BLOCK,
    OTHER_GROUP,
    UNKNOWN_MEDIUM,
    MalformedBatch,
    decode_batch,
)
from dynamo_lite.indexer.protocols import CLEARED, Removed, Stored

pytestmark = pytest.mark.unit

encode = msgspec.msgpack.encode
TOKENS = list(range(1, 65))
LOCAL_16 = local_block_hashes(TOKENS, 16)  # a Dynamo 1.6.1 test vector (tests/test_hashing.py)


def decode(payload: bytes, *, block_size: int = 16, dp_rank: int = 0) -> Any:
    return decode_batch(payload, worker_id=7, dp_rank=dp_rank, seq=41, block_size=block_size)


def vllm_stored(hashes: list[Any], parent: Any, tokens: list[Any], block_size: int = 16, **optional: Any) -> dict:
    """vLLM 0.33's BlockStored map: required fields always written, optional ones when set."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
             "block_size": block_size, "lora_id": None, "medium": optional.pop("medium", "GPU"),
             "lora_name": optional.pop("lora_name", None)}
    event.update(optional)
    return event


def test_reference_example_bytes_of_a_legacy_positional_batch() -> None:
    # Dynamo 1.6.1's own example batch: [1700000000.0, [["BlockStored",[161,162],nil,[1..32],16,nil,nil,nil]], 0]
    payload = bytes.fromhex(
        "93cb41d954fc40000000919" "8ab426c6f636b53746f726564" "92cca1cca2c0dc0020"
        + bytes(range(1, 33)).hex() + "10c0c0c000"
    )
    batch = decode(payload)
    assert batch.dp_rank == 0 and batch.ignored == {}
    (event,) = batch.events
    assert (event.worker_id, event.dp_rank, event.event_id, event.storage_tier) == (7, 0, 41, "device")
    assert event.data == Stored(None, [161, 162], LOCAL_16[:2])


def test_the_three_layouts_give_the_same_events() -> None:
    positional_events = [
        ["BlockStored", [161, 162], None, TOKENS[:32], 16, None, None, None],
        ["BlockStored", [163], 162, TOKENS[32:48], 16, None, "GPU", None],
        ["BlockRemoved", [163], None],
        ["AllBlocksCleared"],
    ]
    map_events = [
        vllm_stored([161, 162], None, TOKENS[:32]),
        vllm_stored([163], 162, TOKENS[32:48]),
        {"type": "BlockRemoved", "block_hashes": [163], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    legacy = decode(encode([1.5, positional_events, 0]))
    vllm = decode(encode([1.5, map_events, 0]))
    in_between = decode(encode({"ts": 1.5, "events": map_events, "data_parallel_rank": 0}))
    expected = [Stored(None, [161, 162], LOCAL_16[:2]), Stored(162, [163], LOCAL_16[2:3]), Removed([163]), CLEARED]
    for batch in (legacy, vllm, in_between):
        assert [event.data for event in batch.events] == expected
        assert {event.event_id for event in batch.events} == {41}


def test_sglang_batch_of_one_page_stores_with_signed_hashes_and_media_names() -> None:
    parent = -(2**63) + 5
    events = [
        {"type": "BlockStored", "block_hashes": [parent], "parent_block_hash": None, "token_ids": TOKENS[:16],
         "block_size": 16, "lora_id": None, "medium": "GPU", "session_id": "s-1"},
        {"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": parent, "token_ids": TOKENS[16:32],
         "block_size": 16, "lora_id": None, "medium": "CPU_PINNED"},
        {"type": "BlockRemoved", "block_hashes": [-1], "medium": "DISK"},
        {"type": "BlockRemoved", "block_hashes": [-1], "medium": "EXTERNAL"},
    ]
    batch = decode(encode([2.0, events, None]), dp_rank=3)  # attn_dp_rank nil: the registered rank
    assert [(event.dp_rank, event.storage_tier) for event in batch.events] == [
        (3, "device"), (3, "host_pinned"), (3, "disk"), (3, "external")
    ]
    assert batch.events[0].data == Stored(None, [2**63 + 5], LOCAL_16[:1])
    assert batch.events[1].data == Stored(2**63 + 5, [2**64 - 1], LOCAL_16[1:2])


def test_batch_dp_rank_overrides_the_registered_one_and_may_be_absent() -> None:
    stored = ["BlockStored", [1], None, TOKENS[:16], 16]
    assert decode(encode([0.0, [stored], 5]), dp_rank=1).events[0].dp_rank == 5
    assert decode(encode([0.0, [stored]]), dp_rank=1).events[0].dp_rank == 1  # omit_defaults dropped it
    assert decode(encode({"events": [vllm_stored([1], None, TOKENS[:16])]}), dp_rank=2).dp_rank == 2


def test_block_hashes_as_bytes_become_the_int_vllm_would_have_sent() -> None:
    digest = bytes(range(32))
    batch = decode(encode([0.0, [vllm_stored([digest], None, TOKENS[:16])], 0]))
    assert batch.events[0].data.block_hashes == [int.from_bytes(digest, "big") % 2**64]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [(None, "device"), ("GPU", "device"), ("CPU", "host_pinned"), ("cpu", "host_pinned"),
     ("CPU_TIER2", "disk"), ("STORAGE", "disk"), ("NVME", "disk"), ("EXTERNAL", "external")],
)
def test_media_map_to_tiers(medium: str | None, tier: str) -> None:
    batch = decode(encode([0.0, [vllm_stored([1], None, TOKENS[:16], medium=medium)], 0]))
    assert batch.events[0].storage_tier == tier


def test_events_that_are_not_indexed_are_counted_by_reason() -> None:
    events = [
        vllm_stored([1], None, TOKENS[:16], medium="weird"),
        vllm_stored([2], None, TOKENS[:16], group_idx=1),
        vllm_stored([3], None, TOKENS[:16], group_idx=0, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128),
        vllm_stored([4], None, TOKENS[:16], group_idx=1, kv_cache_spec_kind="full_attention"),  # indexed
        vllm_stored([5], None, TOKENS[:8], block_size=8),
        vllm_stored([6], None, TOKENS[:15]),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 2},
        {"type": "Ignored"},
        ["BlockStored", [7], None, TOKENS[:16], 16, None, None, None, None, 1, "sliding_window", 128],
        ["BlockRemoved", [7], None, 1],
    ]
    batch = decode(encode([0.0, events, 0]))
    assert [event.data.block_hashes for event in batch.events] == [[4]]
    assert batch.ignored == {UNKNOWN_MEDIUM: 1, OTHER_GROUP: 5, BLOCK_SIZE_MISMATCH: 1, NO_FULL_BLOCK: 1,
                             IGNORED_TAG: 1}


def test_short_token_ids_keep_the_blocks_before_the_first_short_one() -> None:
    # As Dynamo 1.6.1 does: 6 tokens for 2 x 4 stores 1 block; extra tokens are ignored.
    batch = decode(encode([0.0, [vllm_stored([1, 2], None, [1, 2, 3, 4, 5, 6], block_size=4),
                                 vllm_stored([3], None, [1, 2, 3, 4, 5], block_size=4)], 0]), block_size=4)
    assert [event.data.block_hashes for event in batch.events] == [[1], [3]]


def test_lora_name_cache_salt_and_multimodal_keys_enter_the_local_hash() -> None:
    image = "ab" * 32  # a vLLM multimodal identifier: 64 hex digits
    events = [
        vllm_stored([1], None, list(range(16)), lora_name="my-lora"),
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None, "token_ids": TOKENS[:16],
         "block_size": 16, "lora_id": None, "medium": "GPU", "cache_salt": "tenant-a"},  # SGLang
        vllm_stored([3, 4], None, TOKENS[:32], extra_keys=[["my-lora", [image, 0], "salt"], None]),
        vllm_stored([5], None, TOKENS[:16], extra_keys=[None]),
        vllm_stored([6], None, TOKENS[:16],
                    block_mm_infos=[{"mm_objects": [{"mm_hash": 9, "offsets": []}, {"mm_hash": 3}]}]),
    ]
    hashes = [event.data.tokens_hashes for event in decode(encode([0.0, events, 0])).events]
    assert hashes[0] == [7774427462321301335]  # Dynamo 1.6.1's test vector: range(0, 16), lora_name my-lora
    assert hashes[1] == local_block_hashes(TOKENS[:16], 16, cache_salt="tenant-a")
    media = local_block_hashes_with_media(TOKENS[:32], 16, [[int(image[:16], 16)], None])
    assert hashes[2] == media and media[1] == LOCAL_16[1] and media[0] != LOCAL_16[0]
    assert hashes[3] == LOCAL_16[:1]
    assert hashes[4] == local_block_hashes_with_media(TOKENS[:16], 16, [[9, 3]])
    # Dynamo 1.6.1's compute_block_hash_for_seq with block_mm_infos [{"mm_objects": [{"mm_hash": 5}]}]
    # over range(16) (checked against the reference binding).
    assert local_block_hashes_with_media(list(range(16)), 16, [[5]]) == [14492624133500104032]


def test_eagle_bigram_tokens_hash_a_window_one_token_longer() -> None:
    pairs = [[t, t + 1] for t in range(1, 33)]  # tokens 1..33
    batch = decode(encode([0.0, [vllm_stored([1, 2], None, pairs)], 0]))
    expected = [struct.pack("<17I", *range(1, 18)), struct.pack("<17I", *range(17, 34))]
    from xxhash import xxh3_64_intdigest

    assert batch.events[0].data.tokens_hashes == [xxh3_64_intdigest(data, 1337) for data in expected]


@pytest.mark.parametrize(
    "payload",
    [
        encode([0.0, [["Unknown"]], 0]),  # Dynamo: unknown variant, the whole batch fails
        encode([0.0, [["BlockStored", [1], None, [2**32], 1]], 0]),  # token outside u32
        encode([0.0, [["BlockStored", ["x"], None, [1], 1]], 0]),
        encode([0.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),  # token_ids missing
        encode([0.0, [{"block_hashes": [1]}], 0]),  # no tag
        encode({"ts": 0.0}),  # no events
        encode([0.0, [vllm_stored([1], None, TOKENS[:16])], 2**40]),  # dp rank outside u32
        encode("text"),
        b"\xc1",  # never valid msgpack
        b"",
    ],
)
def test_a_batch_that_does_not_decode_is_dropped_whole(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode(payload)
