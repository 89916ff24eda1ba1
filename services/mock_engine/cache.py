"""The engine stand-in's KV cache: vLLM's block hashing, pool and prefix cache, without the GPU.

Pure bookkeeping (no clock, no I/O), one `PrefixCache` per data-parallel rank. It does what
vLLM's V1 `KVCacheManager` does with prefix caching on, at block granularity:

* **Hashing** (`BlockHasher`): every full block of a request's tokens (prompt, then generated)
  gets vLLM's chained hash `sha256(pickle((parent_hash, token_ids, extra_keys)))`, the first
  block chained under `NONE_HASH`. `extra_keys` holds the LoRA adapter's name on every block
  and the cache salt on the first block only, so two tenants with different salts never share
  a block. This is vLLM's `--prefix-caching-hash-algo sha256`; `NONE_HASH` is
  `sha256(PYTHONHASHSEED)` when that variable is set, else random per process, as in vLLM
  (hashes are only compared within one engine; the indexer keys on the token ids). Events
  carry the low 64 bits of each digest as an int, as vLLM publishes them by default.
* **Pool**: `num_blocks` blocks. A running request holds one block per started block of its
  tokens (a partial last block included). A full block is cached under its hash as soon as its
  tokens are computed: a `BlockStored` event. Blocks nobody holds any more stay cached and go
  to the back of the free queue; a request that needs a new block takes it from the front, and
  a cached block taken that way is evicted: a `BlockRemoved` event. A request's blocks are freed
  tail first (vLLM frees in reverse order), so the evicted block is a sequence's last block
  before its parents.
* **Prefix hits**: a new request's longest prefix of full prompt blocks already cached is
  reused (held again, taken out of the free queue) and counted as cached tokens. At least one
  prompt token is always computed (vLLM recomputes the last token of a fully cached prompt), so
  a prompt that is an exact multiple of the block size reuses all but its last block.

Events come out in the order they happened (`drain_events`), for the engine to publish one
batch per step.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_lite.kv_publishers import Cleared, Event, Removed, Stored

BlockHash = bytes


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """vLLM's `NONE_HASH`, the parent of every first block: `sha256(seed)` for a fixed seed
    (vLLM reads PYTHONHASHSEED), else 32 random bytes."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else _sha256(seed)


def external_hash(block_hash: BlockHash) -> int:
    """The int vLLM publishes for a digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, the default):
    its low 64 bits."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """vLLM's chained block hashes for one engine (`none_hash` is per engine)."""

    block_size: int
    none_hash: BlockHash

    def extra_keys(self, block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple[Any, ...] | None:
        """vLLM's `generate_block_hash_extra_keys` for a text-only request: LoRA name, then the
        cache salt on the first block; None when there is neither."""
        keys: list[Any] = []
        if lora_name:
            keys.append(lora_name)
        if cache_salt and block_index == 0:
            keys.append(cache_salt)
        return tuple(keys) if keys else None

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], lora_name: str | None,
               cache_salt: str | None) -> list[BlockHash]:
        """Append to `hashes` (the hashes of the first len(hashes) blocks of `token_ids`) the
        hashes of the full blocks that follow; returns the new ones."""
        size = self.block_size
        new: list[BlockHash] = []
        parent = hashes[-1] if hashes else self.none_hash
        for index in range(len(hashes), len(token_ids) // size):
            block = tuple(token_ids[index * size:(index + 1) * size])
            parent = _sha256((parent, block, self.extra_keys(index, lora_name, cache_salt)))
            new.append(parent)
        hashes.extend(new)
        return new


class CacheFull(Exception):
    """The pool has no free block for a running request (it must be preempted)."""


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set while the block is cached


@dataclass(slots=True)
class Sequence_:
    """What one request holds in the cache."""

    request_id: str
    token_ids: list[int]
    lora_name: str | None
    cache_salt: str | None
    blocks: list[_Block] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks, in order
    computed: int = 0  # tokens whose KV is computed
    cached_tokens: int = 0  # prompt tokens served from the cache at admission
    stored_blocks: int = 0  # leading full blocks cached (hit at admission, or stored since)


class PrefixCache:
    """One rank's KV blocks (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, hash_seed: str | None = None,
                 medium: str | None = "GPU") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, none_hash(hash_seed))
        self.medium = medium
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        # Blocks held by no request, front first to be reused; cached ones keep their hash.
        self._free: OrderedDict[int, _Block] = OrderedDict((block.block_id, block) for block in self._blocks)
        self._cached: dict[BlockHash, _Block] = {}
        self._events: list[Event] = []
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of which served from the cache (prefix_cache_hits)

    # --- reading ----------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests (vLLM's kv_cache_usage_perc)."""
        return self.used_blocks / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> set[int]:
        """The external (published) hashes of every cached block."""
        return {external_hash(block_hash) for block_hash in self._cached}

    def prompt_hashes(self, token_ids: Sequence[int], lora_name: str | None = None,
                      cache_salt: str | None = None) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        self.hasher.extend(hashes, token_ids, lora_name, cache_salt)
        return hashes

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """How many leading blocks of a prompt with these full-block `hashes` are cached, keeping
        at least one prompt token to compute."""
        usable = min(len(hashes), (prompt_tokens - 1) // self.block_size)
        count = 0
        cached = self._cached
        while count < usable and hashes[count] in cached:
            count += 1
        return count

    def held_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` are cached (what an indexer matches, without the
        engine's rule of computing the last prompt token)."""
        count = 0
        cached = self._cached
        while count < len(hashes) and hashes[count] in cached:
            count += 1
        return count

    def blocks_needed(self, seq: Sequence_, tokens: int) -> int:
        """New blocks `seq` needs to hold `tokens` tokens."""
        return max(0, -(-tokens // self.block_size) - len(seq.blocks))

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= len(self._free)

    # --- admission, growth, release -----------------------------------------------------------

    def admit(self, request_id: str, token_ids: list[int], *, lora_name: str | None = None,
              cache_salt: str | None = None, reserve_tokens: int | None = None) -> Sequence_ | None:
        """Start a request: reuse its cached prefix and hold blocks for `reserve_tokens` tokens
        (default: the prompt). None when the pool cannot hold them now (nothing changes)."""
        hashes = self.prompt_hashes(token_ids, lora_name, cache_salt)
        hit_blocks = self.cached_prefix_blocks(hashes, len(token_ids))
        reserve = len(token_ids) if reserve_tokens is None else max(reserve_tokens, len(token_ids))
        total_blocks = -(-reserve // self.block_size)
        hit = [self._cached[block_hash] for block_hash in hashes[:hit_blocks]]
        # Hit blocks in the free queue stop counting as free once held again.
        reusable_free = sum(1 for block in hit if block.ref_count == 0)
        if total_blocks - hit_blocks > len(self._free) - reusable_free:
            return None
        seq = Sequence_(request_id, token_ids, lora_name, cache_salt)
        for block in hit:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            seq.blocks.append(block)
        seq.hashes = hashes
        seq.computed = seq.cached_tokens = hit_blocks * self.block_size
        seq.stored_blocks = hit_blocks
        self.queries += len(token_ids)
        self.hits += seq.cached_tokens
        self._take(seq, total_blocks - hit_blocks)
        return seq

    def load(self, request_id: str, token_ids: list[int], tokens: int, *, lora_name: str | None = None,
             cache_salt: str | None = None) -> Sequence_ | None:
        """Admit a request whose first `tokens` prompt tokens' KV arrived from another engine
        (a remote prefill): its cached prefix is reused as by `admit`, the rest up to `tokens`
        is computed now (its full blocks cached and published). None when the pool cannot hold
        the prompt now."""
        seq = self.admit(request_id, token_ids, lora_name=lora_name, cache_salt=cache_salt)
        if seq is not None and tokens > seq.computed:
            self.compute(seq, min(tokens, len(token_ids)) - seq.computed)
        return seq

    def compute(self, seq: Sequence_, tokens: int) -> None:
        """`tokens` more of `seq`'s tokens have their KV computed (a prefill chunk, or the token
        a decode step appended): the blocks they fill are cached and published."""
        target = seq.computed + tokens
        if target > len(seq.token_ids):
            raise ValueError("cannot compute tokens the sequence does not have")
        needed = self.blocks_needed(seq, target)
        if needed:
            self._take(seq, needed)  # raises CacheFull
        seq.computed = target
        full = target // self.block_size
        if full <= seq.stored_blocks:
            return
        if len(seq.hashes) < full:
            self.hasher.extend(seq.hashes, seq.token_ids[:full * self.block_size], seq.lora_name, seq.cache_salt)
        run: list[int] = []  # consecutive blocks cached now: one BlockStored
        for index in range(seq.stored_blocks, full):
            block, block_hash = seq.blocks[index], seq.hashes[index]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                run.append(index)
            elif run:
                # Another request computed the same block meanwhile: vLLM keeps the first copy
                # cached and this one as a plain block, and publishes nothing for it.
                self._events.append(self._stored_event(seq, run[0], len(run)))
                run = []
        if run:
            self._events.append(self._stored_event(seq, run[0], len(run)))
        seq.stored_blocks = full

    def append_token(self, seq: Sequence_, token_id: int) -> None:
        """A decode step generated `token_id`; its KV is computed in the same step (its block is
        cached once full). Raises CacheFull when the token needs a block the pool lacks."""
        seq.token_ids.append(token_id)
        self.compute(seq, 1)

    def release(self, seq: Sequence_) -> None:
        """The request finished or was aborted: its blocks are freed tail first; cached ones stay
        cached until reused."""
        for block in reversed(seq.blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
        seq.blocks = []

    def clear(self) -> bool:
        """vLLM's `reset_prefix_cache`: drop every cached block; refused (False) while requests
        hold blocks, as vLLM refuses."""
        if self.used_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._events.append(Cleared())
        return True

    def drain_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # --- internals --------------------------------------------------------------------------

    def _take(self, seq: Sequence_, count: int) -> None:
        if count > len(self._free):
            raise CacheFull(f"request {seq.request_id} needs {count} blocks, {len(self._free)} are free")
        evicted: list[int] = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(external_hash(block.block_hash))
                block.block_hash = None
            block.ref_count = 1
            seq.blocks.append(block)
        if evicted:
            self._events.append(Removed(block_hashes=evicted, medium=self.medium))

    def _stored_event(self, seq: Sequence_, start: int, count: int) -> Stored:
        """BlockStored for `seq`'s blocks start..start+count, chained under the block before."""
        size = self.block_size
        hashes = seq.hashes[start:start + count]
        extra = [self.hasher.extra_keys(index, seq.lora_name, seq.cache_salt) for index in range(start, start + count)]
        return Stored(
            block_hashes=[external_hash(block_hash) for block_hash in hashes],
            parent_block_hash=external_hash(seq.hashes[start - 1]) if start > 0 else None,
            token_ids=seq.token_ids[start * size:(start + count) * size],
            block_size=size,
            lora_id=None,
            medium=self.medium,
            lora_name=seq.lora_name,
            extra_keys=extra if any(keys is not None for keys in extra) else None,
        )


__all__ = ["BlockHasher", "CacheFull", "PrefixCache", "Sequence_", "external_hash", "none_hash"]
