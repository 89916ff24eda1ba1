"""The selection service's benchmark state and request bodies, from the Mooncake conversation
trace (see bench/index_data.py for how trace hash ids become 16-token blocks).

* The index: 16 engines store the prompts of the trace's first requests, round-robin, as vLLM
  would after serving them (`TraceFill`), until FILL_PAIRS (block, worker) pairs: about 32k
  blocks (512k tokens) a worker, a device cache's worth. Their KV events reach every service
  from the same publishers.
* The prompts: the first 4,096 tokens (8 trace hash ids) of the requests that follow the fill,
  so a conversation's earlier turn is cached on the worker that served it and common prefixes
  on many, as a fleet sees them.

Token ids are drawn below a real vocabulary's size (VOCAB), not the index bench's counters
(`block_tokens`, up to 10^8): a 4,096-token body is then as long as a real one, ~28 KB.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list
from dynamo_lite.kv_publishers import Stored

from .index_data import BLOCK_SIZE, BLOCKS_PER_ID, TRACE_BLOCK_TOKENS, StoredEvent, TraceFill

VOCAB = 151_936  # Qwen2.5's vocabulary
PROMPT_TOKENS = 4096
PROMPT_IDS = PROMPT_TOKENS // TRACE_BLOCK_TOKENS
FILL_PAIRS = 512_000
PROMPTS = 256
_TOKEN_BITS = 18  # 2^18 > VOCAB: one draw of 18 bits a token


def vocab_block_tokens(hash_id: int, position: int) -> list[int]:
    """The 16 token ids of block `position` of trace hash id `hash_id`: pseudo-random below
    VOCAB, the same on every call (two blocks alike by chance: ~2^-270)."""
    bits = random.Random(hash_id * BLOCKS_PER_ID + position).getrandbits(_TOKEN_BITS * BLOCK_SIZE)
    mask = (1 << _TOKEN_BITS) - 1
    return [((bits >> (_TOKEN_BITS * t)) & mask) % VOCAB for t in range(BLOCK_SIZE)]


def index_fill(trace: list[list[int]], workers: int) -> TraceFill:
    return TraceFill(trace, workers, tokens=vocab_block_tokens)


def stored(event: StoredEvent) -> Stored:
    """The event as the worker's engine publishes it (its chained hashes as its block hashes)."""
    return Stored(block_hashes=event.exts, parent_block_hash=event.parent, token_ids=event.tokens,
                  block_size=BLOCK_SIZE)


def trace_prompts(trace: list[list[int]], start: int, count: int = PROMPTS) -> list[list[int]]:
    """The first PROMPT_TOKENS tokens of the first `count` requests from `start` on that are
    that long."""
    prompts: list[list[int]] = []
    for ids in trace[start:]:
        if len(ids) >= PROMPT_IDS:
            prompts.append([t for hash_id in ids[:PROMPT_IDS] for p in range(BLOCKS_PER_ID)
                            for t in vocab_block_tokens(hash_id, p)])
            if len(prompts) == count:
                return prompts
    raise RuntimeError(f"the trace has only {len(prompts)} prompts of {PROMPT_TOKENS} tokens after request {start}")


@dataclass(frozen=True)
class PromptForm:
    """How a /select_and_reserve body carries the prompt: `token_ids` (the service hashes
    them) or the hash form (block_hashes, sequence_hashes, isl_tokens: the caller hashed)."""

    name: str
    hashed: bool

    def body(self, model: str, tokens: list[int], selection_id: str | None = None) -> bytes:
        document: dict[str, object] = {"model_name": model}
        if self.hashed:
            local = local_block_hashes(tokens, BLOCK_SIZE)
            document.update(block_hashes=to_signed_list(local), sequence_hashes=to_signed_list(sequence_hashes(local)),
                            isl_tokens=len(tokens))
        else:
            document["token_ids"] = tokens
        if selection_id is not None:
            document["selection_id"] = selection_id
        return orjson.dumps(document)

    def lines(self, model: str, prompts: list[list[int]]) -> Iterator[bytes]:
        """One body per prompt, without selection id: the lines lua/select_lifecycle.lua reads."""
        for tokens in prompts:
            yield self.body(model, tokens)


TOKEN_FORM = PromptForm("token_ids", hashed=False)
HASH_FORM = PromptForm("block and sequence hashes", hashed=True)
