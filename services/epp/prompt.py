"""The prompt tokens the engine will compute, as the picker sees them before the pick.

Three sources, tried in this order:

1. token ids already in the body: `/v1/completions` with `prompt` a list of token ids (or a
   list holding one), or Dynamo's `nvext.token_data`;
2. `--render-url`: vLLM's render endpoints (`POST /v1/completions/render`,
   `POST /v1/chat/completions/render`) answer the ids the engine computes, chat template
   included; a GPU-less vLLM (or the engine stand-in) can serve them beside the picker;
3. a local tokenizer directory (`tokenizer.json` + `tokenizer_config.json`): the same code as
   the engine stand-in (`dynamo_lite.routing.tokenizer`), so both agree token for token.

A prompt whose text is longer than `offload_chars` is tokenized on a worker thread
(`--tokenizer-threads`): the loop that picks also relays every streamed answer, and an 80,000-token
chat prompt takes ~85 ms to tokenize (the Rust tokenizer releases the GIL while it encodes).
Shorter ones are tokenized inline, where the hand-over to a thread would cost more than the work.

Which model the request names decides the LoRA adapter (a model name the pool lists under an
endpoint's `lora_names`); `cache_salt` is read for the record but, like the indexer for vLLM's
events, not hashed (vLLM publishes the salt only inside `extra_keys`, which the indexer does not
hash: see docs/gateway.md).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from dynamo_lite.base.integers import U32_MAX
from dynamo_lite.routing.tokenizer import Tokenizer, TokenizerError

from .protocol import PickError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
DEFAULT_TOKENIZER_THREADS = 2
# Prompt text up to this many characters is tokenized inline: ~2,000 tokens, a fraction of a
# millisecond, less than a thread hand-over costs (bench.gateway's picker profile).
DEFAULT_OFFLOAD_CHARS = 8192


@dataclass(frozen=True, slots=True)
class Prompt:
    model: str
    token_ids: list[int]
    stream: bool
    cache_salt: str | None


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON body, which must name a `model` (the GIE picker's 400s)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise PickError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PickError(400, "the request body must be a JSON object")
    if not isinstance(data.get("model"), str) or not data["model"]:
        raise PickError(400, "model not found in request body")
    return data


def api_of(path: str) -> str:
    """"chat" or "completion" from the request path (query string ignored)."""
    route = path.split("?", 1)[0].rstrip("/")
    if route.endswith("/chat/completions"):
        return "chat"
    if route.endswith("/completions"):
        return "completion"
    raise PickError(400, f"unsupported path {route!r}: the picker routes /v1/completions and /v1/chat/completions")


def _ids_in_body(data: dict[str, Any]) -> list[int] | None:
    nvext = data.get("nvext")
    if isinstance(nvext, dict) and isinstance(nvext.get("token_data"), list):
        candidate: Any = nvext["token_data"]
    else:
        candidate = data.get("prompt")
        if isinstance(candidate, list) and len(candidate) == 1 and isinstance(candidate[0], list):
            candidate = candidate[0]
    if isinstance(candidate, list) and candidate and all(
            isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= U32_MAX for token in candidate):
        return list(candidate)
    return None


class PromptReader:
    """Token ids per request from the body, a render endpoint or a local tokenizer."""

    def __init__(self, *, tokenizer: Tokenizer | None, render_url: str | None = None,
                 render_timeout_secs: float = 5.0, threads: int = DEFAULT_TOKENIZER_THREADS,
                 offload_chars: int = DEFAULT_OFFLOAD_CHARS) -> None:
        if tokenizer is None and render_url is None:
            raise ValueError("a tokenizer or a render URL is needed")
        self.tokenizer = tokenizer
        self.render_url = render_url.rstrip("/") if render_url else None
        self.offload_chars = offload_chars
        self._http = httpx.AsyncClient(timeout=render_timeout_secs) if render_url else None
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer") if threads > 0 else None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    async def read(self, path: str, data: dict[str, Any], max_tokens: int | None = None) -> Prompt:
        """The prompt's token ids; a prompt longer than `max_tokens` is refused (400
        `context_length_exceeded`), before tokenizing when its text alone says so."""
        api = api_of(path)
        stream = data.get("stream") is True
        salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
        ids = _ids_in_body(data) if api == "completion" or "nvext" in data else None
        if ids is None:
            if max_tokens is not None and self.tokenizer is not None:
                at_least = _text_size(api, data) // self.tokenizer.max_token_chars
                if at_least > max_tokens:
                    raise too_long(max_tokens, f"at least {at_least}")
            if self.render_url:
                ids = await self._render(api, data)
            elif self._threads is not None and _text_size(api, data) > self.offload_chars:
                ids = await asyncio.get_running_loop().run_in_executor(self._threads, self._tokenize, api, data)
            else:
                ids = self._tokenize(api, data)
        if not ids:
            raise PickError(400, "the prompt has no tokens")
        if max_tokens is not None and len(ids) > max_tokens:
            raise too_long(max_tokens, str(len(ids)))
        return Prompt(data["model"], ids, stream, salt)

    def _tokenize(self, api: str, data: dict[str, Any]) -> list[int]:
        tokenizer = self.tokenizer
        assert tokenizer is not None
        try:
            if api == "chat":
                kwargs = data.get("chat_template_kwargs")
                return tokenizer.chat_token_ids(
                    data.get("messages"), add_generation_prompt=data.get("add_generation_prompt", True) is not False,
                    tools=data.get("tools"), chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None)
            prompt = data.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise PickError(400, "prompt must be a string or a list of token ids")
            return tokenizer.prompt_token_ids(prompt)
        except TokenizerError as exc:
            raise PickError(400, f"tokenization failed: {exc}") from None

    async def _render(self, api: str, data: dict[str, Any]) -> list[int]:
        assert self._http is not None
        url = f"{self.render_url}{CHAT_PATH if api == 'chat' else COMPLETIONS_PATH}/render"
        try:
            answer = await self._http.post(url, content=orjson.dumps(data), headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            raise PickError(504, f"the render endpoint {url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise PickError(503, f"the render endpoint {url} cannot be reached: {type(exc).__name__}") from None
        if answer.status_code == 400:
            raise PickError(400, f"tokenization failed: {_message(answer.content)}")
        if answer.status_code != 200:
            raise PickError(503, f"the render endpoint answered {answer.status_code}: {_message(answer.content)}")
        try:
            rendered = orjson.loads(answer.content)
        except orjson.JSONDecodeError:
            raise PickError(503, "the render endpoint's answer is not JSON") from None
        for key in ("prompt_token_ids", "token_ids"):
            ids = rendered.get(key) if isinstance(rendered, dict) else None
            if isinstance(ids, list):
                return ids
        raise PickError(503, "the render endpoint's answer has no prompt_token_ids")


def too_long(limit: int, tokens: str) -> PickError:
    """OpenAI's answer to a prompt past the context length."""
    return PickError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                     f"{tokens} tokens. Please reduce the length of the prompt.", code="context_length_exceeded")


def _text_size(api: str, data: dict[str, Any]) -> int:
    """Characters of prompt text a request carries (what tokenizing it costs, roughly)."""
    if api != "chat":
        prompt = data.get("prompt")
        return len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str)) \
            if isinstance(prompt, list) else 0
    size = 0
    messages = data.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(part.get("text", "")) for part in content if isinstance(part, dict)
                        and isinstance(part.get("text"), str))
    return size


def _message(content: bytes) -> str:
    try:
        error = orjson.loads(content)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return content[:200].decode("utf-8", "replace")
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


__all__ = ["DEFAULT_OFFLOAD_CHARS", "DEFAULT_TOKENIZER_THREADS", "Prompt", "PromptReader", "api_of", "parse_body"]
