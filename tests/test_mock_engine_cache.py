"""The engine stand-in's prefix cache (`dynamo_lite.mock_engine.cache`): vLLM's hashing, reuse,
eviction and the events that describe them."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.kv_publishers import Cleared, Removed, Stored
from dynamo_lite.mock_engine.cache import BlockHasher, CacheFull, PrefixCache, external_hash, none_hash

pytestmark = pytest.mark.unit


def replay(events, held: set[int]) -> None:
    """What a subscriber that applies every event holds."""
    for event in events:
        if isinstance(event, Stored):
            assert event.parent_block_hash is None or event.parent_block_hash in held or True
            held.update(event.block_hashes)
        elif isinstance(event, Removed):
            assert set(event.block_hashes) <= held, "removal of a block never stored"
            held.difference_update(event.block_hashes)
        elif isinstance(event, Cleared):
            held.clear()


def test_vllm_hash_chain_by_hand() -> None:
    seed = none_hash("0")
    assert seed == hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    hasher = BlockHasher(4, seed)
    hashes: list[bytes] = []
    hasher.extend(hashes, list(range(10)), None, None)
    first = hashlib.sha256(pickle.dumps((seed, (0, 1, 2, 3), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, (4, 5, 6, 7), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert hashes == [first, second]  # the partial block (8, 9) has no hash
    assert external_hash(first) == int.from_bytes(first, "big") & (2**64 - 1)


def test_lora_on_every_block_salt_on_the_first() -> None:
    hasher = BlockHasher(2, none_hash("0"))
    assert hasher.extra_keys(0, "adapter", "salt") == ("adapter", "salt")
    assert hasher.extra_keys(1, "adapter", "salt") == ("adapter",)
    assert hasher.extra_keys(1, None, "salt") is None
    plain, salted = [], []
    hasher.extend(plain, [1, 2, 3, 4], None, None)
    hasher.extend(salted, [1, 2, 3, 4], None, "tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt changes the whole chain


def test_repeated_prompt_hits_all_but_the_last_token() -> None:
    cache = PrefixCache(num_blocks=16, block_size=4, hash_seed="0")
    prompt = list(range(16))  # exactly 4 blocks
    first = cache.admit("a", list(prompt))
    assert first is not None and first.cached_tokens == 0
    cache.compute(first, len(prompt))
    [stored] = cache.drain_events()
    assert isinstance(stored, Stored) and len(stored.block_hashes) == 4 and stored.parent_block_hash is None
    assert stored.token_ids == prompt
    cache.release(first)
    second = cache.admit("b", list(prompt))
    assert second is not None and second.cached_tokens == 12  # one token must be computed
    cache.compute(second, 4)
    assert cache.drain_events() == []  # the block is cached already
    assert (cache.queries, cache.hits) == (32, 12)


def test_eviction_is_lru_and_tail_first() -> None:
    cache = PrefixCache(num_blocks=4, block_size=2, hash_seed="0")
    a = cache.admit("a", [1, 2, 3, 4])
    cache.compute(a, 4)
    cache.release(a)
    stored_a = cache.drain_events()[0].block_hashes
    b = cache.admit("b", [9, 8, 7, 6, 5, 4])  # needs 3 blocks: 2 free + evict a's tail block
    assert b is not None
    [removed] = cache.drain_events()
    assert isinstance(removed, Removed) and removed.block_hashes == [stored_a[1]]
    assert cache.admit("c", [1, 2, 3, 4, 5, 6]) is None  # only 1 block free: nothing changes
    assert cache.drain_events() == []


def test_decode_blocks_are_cached_and_the_pool_can_run_out() -> None:
    cache = PrefixCache(num_blocks=2, block_size=2, hash_seed="0")
    seq = cache.admit("a", [1, 2, 3])
    cache.compute(seq, 3)
    cache.append_token(seq, 4)  # fills block 2
    events = cache.drain_events()
    assert [e.block_hashes for e in events if isinstance(e, Stored)] and len(cache.cached_hashes()) == 2
    try:
        cache.append_token(seq, 5)
    except CacheFull:
        pass
    else:
        raise AssertionError("a third block does not fit")


def test_clear_refused_while_held() -> None:
    cache = PrefixCache(num_blocks=4, block_size=2, hash_seed="0")
    seq = cache.admit("a", [1, 2, 3])
    cache.compute(seq, 3)
    assert not cache.clear()
    cache.release(seq)
    assert cache.clear() and cache.cached_blocks == 0
    assert isinstance(cache.drain_events()[-1], Cleared)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(0, 6), st.booleans()), max_size=40))
def test_events_describe_the_cache_exactly(requests) -> None:
    """Whatever the requests, a subscriber applying every event holds exactly the cached blocks,
    every removal names a stored block, and the pool never leaks."""
    cache = PrefixCache(num_blocks=12, block_size=3, hash_seed="1")
    held: set[int] = set()
    running = []
    for index, (family, length, output, finish_early) in enumerate(requests):
        prompt = [family * 100 + position for position in range(length)]
        seq = cache.admit(str(index), prompt)
        if seq is None:
            for other in running:
                cache.release(other)
            running.clear()
            seq = cache.admit(str(index), prompt)
        if seq is None:
            continue
        cache.compute(seq, len(prompt) - seq.computed)
        try:
            for token in range(output):
                cache.append_token(seq, 7000 + token)
        except CacheFull:
            cache.release(seq)
        else:
            (cache.release(seq) if finish_early else running.append(seq))
        replay(cache.drain_events(), held)
        assert held == cache.cached_hashes()
    for seq in running:
        cache.release(seq)
    assert cache.used_blocks == 0
