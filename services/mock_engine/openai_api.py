"""The OpenAI-compatible request and answer shapes of the engine stand-in, as vLLM's server has them.

Pure functions: a request body (already JSON-decoded) becomes a `GenerationRequest` or raises
`ApiError` with vLLM's status and message; a finished or streaming generation becomes vLLM's
JSON objects. Fields vLLM accepts but that change nothing here (temperature, top_p, stop, ...)
are accepted and ignored: the text is filler, only its length and timing matter.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from dynamo_lite.routing.tokenizer import Tokenizer, TokenizerError

# OpenAI's (and vLLM's) default for the legacy completions API.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An answer other than 200, in vLLM's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def kind(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            self.status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the server serves: its model names and limits (`/v1/models`, validation)."""

    name: str
    max_model_len: int
    default_max_tokens: int
    lora_names: tuple[str, ...] = ()
    created: int = 0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    lora_name: str | None
    cache_salt: str | None
    # vLLM's KV connector parameters (prefill/decode disaggregation), passed on as sent.
    kv_transfer_params: dict[str, Any] | None = None


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _model(body: dict[str, Any], served: ServedModel) -> tuple[str, str | None]:
    """The model a request names (the served one when absent) and its LoRA adapter, if any."""
    model = body.get("model")
    if model is None:
        return served.name, None
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model == served.name:
        return model, None
    if model in served.lora_names:
        return model, model
    raise ApiError(404, f"The model `{model}` does not exist.", "model")


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be an integer", name)
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}.", name)
    return value


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "stream_options.include_usage must be true or false", "stream_options")
    return stream, include_usage


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def _n(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "this engine stand-in generates one choice per request (n must be 1)", "n")


def completion_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """`prompt`: a string, a list of token ids, or a list holding one of those (vLLM batches
    longer lists into several choices; the stand-in answers one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt cannot be empty", "prompt")
        return tokenizer.prompt_token_ids(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "prompt cannot be empty", "prompt")
        if all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            if any(not 0 <= token < tokenizer.vocab_size for token in prompt):
                raise ApiError(400, f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
            return list(prompt)
        raise ApiError(400, "a list of several prompts is not supported: send one prompt per request", "prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")


def chat_prompt_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise ApiError(400, "add_generation_prompt must be true or false", "add_generation_prompt")
    try:
        return tokenizer.chat_token_ids(messages, add_generation_prompt=add_generation_prompt,
                                        tools=body.get("tools"), chat_template_kwargs=kwargs)
    except TokenizerError as exc:
        raise ApiError(400, str(exc), "messages") from None


def _kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    return params


def parse_generation(kind: str, body: Any, served: ServedModel, tokenizer: Tokenizer) -> GenerationRequest:
    """A `/v1/completions` (kind "completion") or `/v1/chat/completions` ("chat") body."""
    body = _object(body)
    model, lora_name = _model(body, served)
    stream, include_usage = _stream_flags(body)
    _n(body)
    cache_salt = _cache_salt(body)
    if kind == "completion":
        prompt = completion_prompt_ids(body, tokenizer)
        max_tokens = _positive_int(body, "max_tokens")
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        prompt = chat_prompt_ids(body, tokenizer)
        max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
        default = served.default_max_tokens
    room = served.max_model_len - len(prompt)
    if room <= 0:
        raise ApiError(400, f"This model's maximum context length is {served.max_model_len} tokens. However, your "
                            f"request has {len(prompt)} input tokens. Please reduce the length of the input messages.")
    if max_tokens is None:
        max_tokens = min(default, room)
    elif max_tokens > room:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                            f"context length is {served.max_model_len} tokens and your request has {len(prompt)} input "
                            f"tokens ({max_tokens} > {served.max_model_len} - {len(prompt)}).", "max_tokens")
    return GenerationRequest(kind, model, prompt, max_tokens, stream, include_usage, lora_name, cache_salt,
                             _kv_transfer_params(body))


# --- answers ---------------------------------------------------------------------------------


def new_request_id(kind: str, given: str | None) -> str:
    """vLLM's ids: `cmpl-...` / `chatcmpl-...`, from the X-Request-Id header when there is one."""
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return f"{prefix}-{given or uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's usage, with prompt_tokens_details as vLLM writes it under
    `--enable-prompt-tokens-details` (always on here: the cached tokens are the point)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_answer(request: GenerationRequest, request_id: str, text: str, finish_reason: str,
                completion_tokens: int, cached_tokens: int, created: int | None = None,
                kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    created = int(time.time()) if created is None else created
    if request.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                                  "stop_reason": None, "prompt_logprobs": None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                          "tool_calls": []},
                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "chat.completion"
    return {
        "id": request_id, "object": obj, "created": created, "model": request.model, "choices": [choice],
        "usage": usage(len(request.prompt_token_ids), completion_tokens, cached_tokens),
        "prompt_logprobs": None, "kv_transfer_params": kv_transfer_params,
    }


def chunk(request: GenerationRequest, request_id: str, created: int, text: str | None,
          finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
    """One streamed chunk; chat's first chunk carries the role and empty content."""
    if request.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                                  "stop_reason": None}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text or ""}
        if finish_reason is not None and not text and not role:
            delta = {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        obj = "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": request.model, "choices": [choice]}


def usage_chunk(request: GenerationRequest, request_id: str, created: int, completion_tokens: int,
                cached_tokens: int) -> dict[str, Any]:
    """The last chunk with `stream_options.include_usage`: no choices, the usage."""
    obj = "text_completion" if request.kind == "completion" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": request.model, "choices": [],
            "usage": usage(len(request.prompt_token_ids), completion_tokens, cached_tokens)}


def models_answer(served: ServedModel) -> dict[str, Any]:
    def card(name: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": served.created, "owned_by": "vllm",
                "root": name if parent is None else name, "parent": parent,
                "max_model_len": served.max_model_len, "permission": []}

    return {"object": "list",
            "data": [card(served.name, None)] + [card(name, served.name) for name in served.lora_names]}


__all__ = [
    "ApiError",
    "GenerationRequest",
    "ServedModel",
    "chat_prompt_ids",
    "chunk",
    "completion_prompt_ids",
    "full_answer",
    "models_answer",
    "new_request_id",
    "parse_generation",
    "usage",
    "usage_chunk",
]
