"""The picker's prompt reader (`dynamo_lite.epp.prompt`): a long prompt is tokenized on a worker
thread while the event loop that relays every answer keeps running; a prompt too long for the
engines is refused before tokenizing it when its text alone says so, after otherwise."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dynamo_lite.epp.prompt import PromptReader
from dynamo_lite.epp.protocol import PickError
from dynamo_lite.routing.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
WORDS = "routing requests to the engine that caches the prompt is what a KV router does best "


def test_a_long_prompt_is_tokenized_off_the_loop_which_keeps_running() -> None:
    tokenizer = Tokenizer.load()
    seen_on: list[int] = []
    encode = tokenizer.encode

    def recording(text: str, **kwargs: object) -> list[int]:
        seen_on.append(threading.get_ident())
        return encode(text, **kwargs)  # type: ignore[arg-type]

    async def scenario() -> tuple[int, float, int]:
        reader = PromptReader(tokenizer=tokenizer, threads=2)
        tokenizer.encode = recording  # type: ignore[method-assign]
        ticks = 0
        gaps: list[float] = []
        reading = asyncio.ensure_future(reader.read(CHAT, {"model": "mock", "messages": [
            {"role": "user", "content": WORDS * 5000}]}))
        last = time.perf_counter()
        while not reading.done():  # what relaying chunks needs: the loop turning
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            ticks += 1
        prompt = await reading
        await reader.aclose()
        return len(prompt.token_ids), max(gaps), ticks

    try:
        tokens, longest_gap, ticks = asyncio.run(scenario())
    finally:
        del tokenizer.encode  # type: ignore[method-assign]
    assert tokens > 75_000
    assert seen_on and seen_on[0] != threading.get_ident()  # tokenized on a worker thread
    assert ticks >= 10, ticks  # the loop kept turning through the ~100 ms of tokenizing
    assert longest_gap < 0.05, longest_gap  # not stalled (the GIL is free while Rust encodes)


def test_a_short_prompt_is_tokenized_inline() -> None:
    tokenizer = Tokenizer.load()
    reader = PromptReader(tokenizer=tokenizer, threads=2)
    prompt = asyncio.run(reader.read(CHAT, {"model": "mock", "messages": [{"role": "user", "content": "hello"}]}))
    assert prompt.token_ids == tokenizer.chat_token_ids([{"role": "user", "content": "hello"}])
    asyncio.run(reader.aclose())


def test_a_prompt_too_long_for_the_engines_is_refused_with_openai_s_code() -> None:
    tokenizer = Tokenizer.load()
    reader = PromptReader(tokenizer=tokenizer, threads=0)
    huge = {"model": "mock", "messages": [{"role": "user", "content": WORDS * 80_000}]}  # 6.7 MB of text
    started = time.perf_counter()
    with pytest.raises(PickError) as refused:
        asyncio.run(reader.read(CHAT, huge, max_tokens=131_072))
    assert time.perf_counter() - started < 0.5  # its text alone said so: nothing was tokenized
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert "maximum context length is 131072 tokens" in refused.value.message
    # Within the text bound, too long once tokenized: refused after tokenizing.
    with pytest.raises(PickError) as after:
        asyncio.run(reader.read(CHAT, {"model": "mock", "messages": [{"role": "user", "content": WORDS * 30}]},
                                max_tokens=100))
    assert after.value.code == "context_length_exceeded" and "has 4" in after.value.message
    # Token ids in the body are counted as they are.
    with pytest.raises(PickError):
        asyncio.run(reader.read("/v1/completions", {"model": "mock", "prompt": list(range(101))}, max_tokens=100))


def test_the_gil_free_path_encodes_exactly_as_the_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynamo_lite.routing.tokenizer as tokenizer_module

    tokenizer = Tokenizer.load()
    text = WORDS * 200  # past GIL_FREE_CHARS: encode_batch
    assert len(text) > tokenizer_module.GIL_FREE_CHARS
    batched = tokenizer.encode(text)
    monkeypatch.setattr(tokenizer_module, "GIL_FREE_CHARS", 10**9)  # the plain encode
    assert tokenizer.encode(text) == batched
