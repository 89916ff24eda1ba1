"""The engine stand-in's HTTP routes: vLLM's OpenAI-compatible server over the `MockEngine`.

Each route decodes its body, asks `openai_api` for the request (or vLLM's error), runs it on a
rank of the engine and shapes vLLM's answer: JSON, or Server-Sent Events (`data: {...}` lines
and `data: [DONE]`) when `stream` is true. A client that hangs up mid-stream aborts its request,
which frees its blocks, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Route

from dynamo_lite import http
from dynamo_lite.http import Answer, Headers, HeadersEndpoint, StreamAnswer, find_header
from dynamo_lite.tokenizer import Tokenizer, TokenizerError

from .engine import EngineConfig, MockEngine, Rank, RequestStream
from .openai_api import (
    ApiError,
    GenerationRequest,
    ServedModel,
    chat_prompt_ids,
    chunk,
    full_answer,
    models_answer,
    new_request_id,
    parse_generation,
    usage_chunk,
)
from .scheduler import FINISHED_ABORT, EngineRequest

logger = logging.getLogger("dynamo_lite.mock_engine")

_JSON = b"application/json"
_SSE = b"text/event-stream"
_DONE = b"data: [DONE]\n\n"
MAX_BODY = 16 * 1024 * 1024
# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's buckets for vllm:inter_token_latency_seconds.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
_FILLER_WORD = re.compile(r" [a-z]{2,10}")


def filler_tokens(tokenizer: Tokenizer) -> list[int]:
    """Token ids that decode to one lower-case word with a leading space: generated text made of
    them decodes token by token to the same string as all at once."""
    words = [token for token in range(tokenizer.vocab_size)
             if _FILLER_WORD.fullmatch(tokenizer.decode([token]))]
    if not words:
        raise TokenizerError(f"tokenizer {tokenizer.name}: no plain word tokens to generate filler text from")
    return words


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _error(exc: ApiError) -> Answer:
    return exc.status, orjson.dumps(exc.body()), _JSON


def _decode_body(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


@dataclass
class EngineState:
    engine: MockEngine
    tokenizer: Tokenizer
    served: ServedModel
    texts: list[str]  # token id -> its text (filler ids only are generated)


class GenerateEndpoint(HeadersEndpoint):
    """`POST /v1/completions` and `POST /v1/chat/completions`."""

    max_body = MAX_BODY

    def __init__(self, state: EngineState, kind: str) -> None:
        self.state = state
        self.kind = kind

    def respond_with_headers(self, query_string: bytes, body: bytes, headers: Headers) -> Answer | StreamAnswer | Any:
        state = self.state
        try:
            request = parse_generation(self.kind, _decode_body(body), state.served, state.tokenizer)
            dp_rank = self._dp_rank(headers)
        except ApiError as exc:
            return _error(exc)
        given_id = find_header(headers, b"x-request-id")
        request_id = new_request_id(self.kind, given_id.decode("latin-1") if given_id else None)
        engine_request = EngineRequest(request_id, request.prompt_token_ids, request.max_tokens,
                                       asyncio.get_running_loop().time(), request.lora_name, request.cache_salt)
        rank = state.engine.choose_rank(dp_rank)
        if request.stream:
            return StreamAnswer(200, _SSE, self._stream(rank, request, engine_request))
        return asyncio.ensure_future(self._whole(rank, request, engine_request))

    def _dp_rank(self, headers: Headers) -> int | None:
        """vLLM's `X-data-parallel-rank` header: the rank an external balancer chose."""
        value = find_header(headers, b"x-data-parallel-rank")
        if value is None:
            return None
        size = len(self.state.engine.ranks)
        try:
            rank = int(value)
        except ValueError:
            rank = -1
        if not 0 <= rank < size:
            raise ApiError(400, f"X-data-parallel-rank must be an integer in [0, {size}), not {value.decode('latin-1')!r}")
        return rank

    async def _whole(self, rank: Rank, request: GenerationRequest, engine_request: EngineRequest) -> Answer:
        stream = rank.submit(engine_request)
        tokens: list[int] = []
        finished = None
        async for output in stream.outputs():
            if output.token_id is not None:
                tokens.append(output.token_id)
            finished = output.finished
        if finished == FINISHED_ABORT:
            return _error(ApiError(503, "the request could not be scheduled: the KV cache cannot hold it"))
        texts = self.state.texts
        answer = full_answer(request, engine_request.request_id, "".join(texts[token] for token in tokens),
                             finished or "length", len(tokens), max(engine_request.cached_tokens, 0))
        return 200, orjson.dumps(answer), _JSON

    async def _stream(self, rank: Rank, request: GenerationRequest, engine_request: EngineRequest) -> AsyncIterator[bytes]:
        stream: RequestStream | None = None
        try:
            stream = rank.submit(engine_request)
            created = int(time.time())
            request_id = engine_request.request_id
            texts = self.state.texts
            if request.kind == "chat":
                yield _sse(chunk(request, request_id, created, None, None, role=True))
            completion_tokens = 0
            async for output in stream.outputs():
                if output.token_id is None:
                    if output.finished == FINISHED_ABORT:
                        yield _sse(ApiError(503, "the request could not be scheduled: the KV cache cannot hold it").body())
                    break
                completion_tokens += 1
                yield _sse(chunk(request, request_id, created, texts[output.token_id], output.finished))
            if request.include_usage:
                yield _sse(usage_chunk(request, request_id, created, completion_tokens,
                                       max(engine_request.cached_tokens, 0)))
            yield _DONE
        finally:
            if stream is not None and engine_request.finished is None:
                rank.abort(stream)


class RenderEndpoint(HeadersEndpoint):
    """`POST /v1/completions/render` and `/v1/chat/completions/render`: the token ids the engine
    would compute for a request, without running it (what a gateway's picker tokenizes with)."""

    max_body = MAX_BODY

    def __init__(self, state: EngineState, kind: str) -> None:
        self.state = state
        self.kind = kind

    def respond_with_headers(self, query_string: bytes, body: bytes, headers: Headers) -> Answer:
        state = self.state
        try:
            request = parse_generation(self.kind, _decode_body(body), state.served, state.tokenizer)
        except ApiError as exc:
            return _error(exc)
        answer = {"model": request.model, "prompt_token_ids": request.prompt_token_ids,
                  "num_prompt_tokens": len(request.prompt_token_ids), "max_tokens": request.max_tokens,
                  "lora_name": request.lora_name, "cache_salt": request.cache_salt,
                  "block_size": state.engine.config.block_size}
        return 200, orjson.dumps(answer), _JSON


class TokenizeEndpoint(HeadersEndpoint):
    """vLLM's `POST /tokenize`: `prompt` (a string), or `messages` rendered with the template."""

    max_body = MAX_BODY

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def respond_with_headers(self, query_string: bytes, body: bytes, headers: Headers) -> Answer:
        state = self.state
        try:
            data = _decode_body(body)
            if not isinstance(data, dict):
                raise ApiError(400, "the request body must be a JSON object")
            if "messages" in data:
                tokens = chat_prompt_ids(data, state.tokenizer)
            else:
                add_special = data.get("add_special_tokens", True)
                prompt = data.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "prompt must be a string (or send messages)", "prompt")
                if not isinstance(add_special, bool):
                    raise ApiError(400, "add_special_tokens must be true or false", "add_special_tokens")
                tokens = state.tokenizer.encode(prompt, add_special_tokens=add_special)
        except ApiError as exc:
            return _error(exc)
        answer = {"count": len(tokens), "max_model_len": state.served.max_model_len, "tokens": tokens,
                  "token_strs": None}
        return 200, orjson.dumps(answer), _JSON


class JsonGetEndpoint(http.DirectEndpoint):
    def __init__(self, produce: Any) -> None:
        self.produce = produce

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        return 200, orjson.dumps(self.produce()), _JSON


class ResetPrefixCacheEndpoint(http.DirectEndpoint):
    """vLLM's `POST /reset_prefix_cache`: drop every cached block (AllBlocksCleared), refused
    with 400 while requests run, as vLLM refuses."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        if all(rank.reset_prefix_cache() for rank in self.engine.ranks):
            return 200, b"", None
        return _error(ApiError(400, "the prefix cache cannot be reset while requests are running"))


class VllmCollector(Collector):
    """vLLM's engine metrics, per rank (label `engine`, as vLLM labels data-parallel ranks)."""

    def __init__(self, engine: MockEngine, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "running": GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                         labels=labels),
            "waiting": GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                         labels=labels),
            "usage": GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                       labels=labels),
            "queries": CounterMetricFamily("vllm:prefix_cache_queries",
                                           "Prefix cache queries, in terms of number of queried tokens.", labels=labels),
            "hits": CounterMetricFamily("vllm:prefix_cache_hits",
                                        "Prefix cache hits, in terms of number of cached tokens.", labels=labels),
            "preemptions": CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                               labels=labels),
        }
        # vLLM publishes its cache configuration as labels of a constant gauge; a router reads the
        # KV capacity (num_gpu_blocks) from it.
        cache_info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"])
        for rank in self.engine.ranks:
            cache_info.add_metric([str(rank.cache.block_size), "True", str(rank.cache.num_blocks), str(rank.dp_rank)], 1)
        yield cache_info
        for rank in self.engine.ranks:
            values = [self.model, str(rank.dp_rank)]
            scheduler, cache = rank.scheduler, rank.cache
            families["running"].add_metric(values, len(scheduler.running))
            families["waiting"].add_metric(values, len(scheduler.waiting))
            families["usage"].add_metric(values, cache.usage)
            families["queries"].add_metric(values, cache.queries)
            families["hits"].add_metric(values, cache.hits)
            families["preemptions"].add_metric(values, scheduler.preemptions)
        yield from families.values()


def create_app(config: EngineConfig, tokenizer: Tokenizer, *, default_max_tokens: int = 128,
               lora_names: tuple[str, ...] = ()) -> http.Service:
    """The engine stand-in app. The engine (its ranks' loops and KV event sockets) starts with
    the app's lifespan and stops, closing its sockets, at shutdown."""
    max_model_len = min(config.max_model_len, config.num_blocks * config.block_size)
    served = ServedModel(config.model, max_model_len, default_max_tokens, lora_names, int(time.time()))
    filler = filler_tokens(tokenizer)
    engine = MockEngine(config, filler)
    texts = [""] * tokenizer.vocab_size
    for token in filler:
        texts[token] = tokenizer.decode([token])
    collector = VllmCollector(engine, config.model)
    state = EngineState(engine, tokenizer, served, texts)

    @contextlib.asynccontextmanager
    async def lifespan(app: http.Service) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = http.Service(
        routes=[
            http.health_route(),
            Route("/v1/models", JsonGetEndpoint(lambda: models_answer(served)), methods=["GET"]),
            Route("/v1/completions", GenerateEndpoint(state, "completion"), methods=["POST"]),
            Route("/v1/chat/completions", GenerateEndpoint(state, "chat"), methods=["POST"]),
            Route("/v1/completions/render", RenderEndpoint(state, "completion"), methods=["POST"]),
            Route("/v1/chat/completions/render", RenderEndpoint(state, "chat"), methods=["POST"]),
            Route("/tokenize", TokenizeEndpoint(state), methods=["POST"]),
            Route("/reset_prefix_cache", ResetPrefixCacheEndpoint(engine), methods=["POST"]),
        ],
        lifespan=lifespan,
        collectors=[collector],
    )
    ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                     ["model_name", "engine"], buckets=TTFT_BUCKETS, registry=app.metrics_registry)
    itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                    ["model_name", "engine"], buckets=ITL_BUCKETS, registry=app.metrics_registry)
    for rank in engine.ranks:
        rank.ttft_observer = lambda dp_rank, seconds: ttft.labels(config.model, str(dp_rank)).observe(seconds)
        rank.itl_observer = lambda dp_rank, seconds: itl.labels(config.model, str(dp_rank)).observe(seconds)
    app.state.engine = engine
    return app


__all__ = ["EngineState", "create_app", "filler_tokens"]
