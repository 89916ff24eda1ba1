"""The engine stand-in's HTTP routes: vLLM's OpenAI-compatible server over the `MockEngine`.

Each route decodes its body, asks `openai_api` for the request (or vLLM's error), runs it on a
rank of the engine and shapes vLLM's answer: JSON, or Server-Sent Events (`data: {...}` lines
and `data: [DONE]`) when `stream` is true. A client that hangs up aborts its request, streamed
or not, which frees its blocks, as vLLM does.

With `--kv-transfer-config`, requests' `kv_transfer_params` make it a prefill or a decode engine
of a disaggregated pair (`kv_transfer`): a decode request first reads its prompt's blocks from
the prefill engine's `POST /kv_transfer/read` (this app serves that route too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Route

from dynamo_lite.routing.tokenizer import Tokenizer, TokenizerError
from dynamo_lite.web import http
from dynamo_lite.web.http import Answer, Headers, HeadersEndpoint, StreamAnswer, find_header

from .engine import EngineConfig, MockEngine, Rank, RequestStream
from .kv_transfer import (
    READ_PATH,
    ReadFailed,
    RemoteBlocks,
    prefill_answer_params,
    read_remote_blocks,
    remote_blocks,
    wants_remote_decode,
)
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
# Buckets of the NIXL transfer histograms (vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred).
XFER_TIME_BUCKETS = (0.001, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
XFER_BYTES_BUCKETS = tuple(float(2 ** (20 + i)) for i in range(15))  # 1 MiB .. 16 GiB
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
    http: httpx.AsyncClient | None = None  # reads remote blocks (with --kv-transfer-config)
    xfer_observer: Any = None  # called with (rank, seconds, bytes) for each read


class GenerateEndpoint(HeadersEndpoint):
    """`POST /v1/completions` and `POST /v1/chat/completions`."""

    max_body = MAX_BODY
    cancel_on_disconnect = True  # a client that hangs up before a whole answer aborts it, as vLLM does

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
        remote = self._kv_transfer(rank, request, engine_request)
        if request.stream:
            return StreamAnswer(200, _SSE, self._stream(rank, request, engine_request, remote))
        return asyncio.ensure_future(self._whole(rank, request, engine_request, remote))

    def _kv_transfer(self, rank: Rank, request: GenerationRequest, engine_request: EngineRequest) -> RemoteBlocks | None:
        """What the request's `kv_transfer_params` ask (with a KV connector; vLLM ignores them
        without one): a prefill for a remote decode engine (`transfer_id` set: its blocks will
        be held), or the remote blocks a decode request reads first."""
        config = self.state.engine.config
        params = request.kv_transfer_params
        if config.kv_transfer is None or not params:
            return None
        if wants_remote_decode(params):
            engine_request.transfer_id = f"{engine_request.request_id}-{uuid.uuid4().hex[:8]}"
            return None
        remote = remote_blocks(params)
        if isinstance(remote, str):
            logger.warning("Got invalid KVTransferParams (%s) for %s: it is prefilled locally", remote,
                           engine_request.request_id)
            rank.transfers.remote_prefill_fallbacks += 1
            return None
        return remote

    async def _start(self, rank: Rank, engine_request: EngineRequest, remote: RemoteBlocks | None) -> RequestStream:
        """Run the request on `rank`, its prompt's blocks read from the prefill engine first
        when it names one (and prefilled locally when they cannot be)."""
        if remote is not None and not await self._read_remote(rank, engine_request, remote):
            rank.transfers.remote_prefill_fallbacks += 1
        return rank.submit(engine_request)

    async def _read_remote(self, rank: Rank, engine_request: EngineRequest, remote: RemoteBlocks) -> bool:
        state = self.state
        config = state.engine.config
        assert config.kv_transfer is not None and state.http is not None
        prompt = engine_request.prompt_token_ids
        try:
            tokens = await read_remote_blocks(state.http, remote, config.kv_transfer.engine_id)
            # vLLM recomputes the last prompt token locally (its logits give the first token).
            load = min(len(prompt) - 1, len(tokens))
            if tokens[:load] != prompt[:load]:
                raise ReadFailed(f"{remote.url}: the blocks of {remote.request_id} hold another prompt")
        except ReadFailed as exc:
            rank.transfers.failed_transfers += 1
            logger.warning("cannot read the prompt's blocks of %s from the prefill engine (%s): it is prefilled "
                           "locally", engine_request.request_id, exc)
            return False
        cache = rank.cache
        block_size = cache.block_size
        hashes = cache.prompt_hashes(prompt, engine_request.lora_name, engine_request.cache_salt)
        local = cache.cached_prefix_blocks(hashes, len(prompt))
        # NIXL moves every prompt block the decode engine does not cache, the partial last one too.
        blocks = max(0, min(len(remote.block_ids), -(-len(prompt) // block_size)) - local)
        seconds = config.transfer.seconds(blocks, block_size)
        started = time.monotonic()
        await asyncio.sleep(seconds)
        if not rank.load_remote(engine_request, load):
            return False
        rank.transfers.remote_prefill_requests += 1
        rank.transfers.blocks_read += blocks
        if state.xfer_observer is not None:
            state.xfer_observer(rank.dp_rank, time.monotonic() - started, blocks * config.transfer.bytes_per_block(block_size))
        return True

    def _answer_params(self, engine_request: EngineRequest) -> dict[str, Any] | None:
        """A finished prefill's `kv_transfer_params` for the decode engine (None for others)."""
        config = self.state.engine.config
        if (config.kv_transfer is None or engine_request.transfer_id is None
                or engine_request.held_block_ids is None):
            return None
        return prefill_answer_params(engine_request.held_block_ids, config.kv_transfer.engine_id,
                                     engine_request.transfer_id, config.side_channel_host, config.side_channel_port)

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

    async def _whole(self, rank: Rank, request: GenerationRequest, engine_request: EngineRequest,
                     remote: RemoteBlocks | None) -> Answer:
        stream = await self._start(rank, engine_request, remote)
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
                             finished or "length", len(tokens), max(engine_request.cached_tokens, 0),
                             kv_transfer_params=self._answer_params(engine_request))
        return 200, orjson.dumps(answer), _JSON

    async def _stream(self, rank: Rank, request: GenerationRequest, engine_request: EngineRequest,
                      remote: RemoteBlocks | None) -> AsyncIterator[bytes]:
        stream: RequestStream | None = None
        try:
            stream = await self._start(rank, engine_request, remote)
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


class ReadBlocksEndpoint(http.DirectEndpoint):
    """`POST /kv_transfer/read` (a stand-in route, its NIXL side channel): a decode engine reads
    the blocks this engine holds for one of its prefills (`remote_engine_id`,
    `remote_request_id` as the prefill's answer named them). 200 `{"token_ids", "block_size"}`
    and the blocks are freed; 404 when this engine holds none under that id (read already,
    expired, another engine's, or no KV connector)."""

    max_body = 1024 * 1024

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        try:
            data = _decode_body(body)
            if not isinstance(data, dict) or not isinstance(data.get("remote_request_id"), str):
                raise ApiError(400, "the body must be an object with remote_request_id (a string)")
        except ApiError as exc:
            return _error(exc)
        kv_transfer = self.engine.config.kv_transfer
        transfer_id = data["remote_request_id"]
        if kv_transfer is not None and data.get("remote_engine_id") in (None, kv_transfer.engine_id):
            for rank in self.engine.ranks:
                tokens = rank.read_held(transfer_id)
                if tokens is not None:
                    answer = {"token_ids": tokens, "block_size": rank.cache.block_size}
                    return 200, orjson.dumps(answer), _JSON
        return _error(ApiError(404, f"no blocks held for {transfer_id!r}: read already, expired, or not prefilled "
                                    "by this engine"))


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
        if self.engine.config.kv_transfer is not None:
            yield from self._transfers(labels)

    def _transfers(self, labels: list[str]) -> Iterator[Metric]:
        """The disaggregation counters, with a KV connector only."""
        counters = {
            "remote_decode_requests": CounterMetricFamily(
                "dynamo_lite_mock_engine_remote_decode_requests",
                "Prefill requests (kv_transfer_params.do_remote_decode) finished with their blocks held for a decode engine.",
                labels=labels),
            "remote_prefill_requests": CounterMetricFamily(
                "dynamo_lite_mock_engine_remote_prefill_requests",
                "Decode requests (kv_transfer_params.do_remote_prefill) that read their prompt's blocks from a prefill engine.",
                labels=labels),
            "remote_prefill_fallbacks": CounterMetricFamily(
                "dynamo_lite_mock_engine_remote_prefill_fallbacks",
                "Decode requests that asked for a remote prefill but were prefilled locally (invalid parameters, "
                "failed read, no room).", labels=labels),
            "blocks_read": CounterMetricFamily(
                "dynamo_lite_mock_engine_kv_blocks_read", "KV blocks read from prefill engines.", labels=labels),
            "blocks_sent": CounterMetricFamily(
                "dynamo_lite_mock_engine_kv_blocks_sent", "Held KV blocks decode engines read from this engine.",
                labels=labels),
            "failed_transfers": CounterMetricFamily(
                "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", labels=labels),
            "expired": CounterMetricFamily(
                "vllm:nixl_num_kv_expired_reqs", "Number of requests whose held KV blocks expired unread.",
                labels=labels),
        }
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                                        labels=[*labels, "source"])
        held = GaugeMetricFamily("dynamo_lite_mock_engine_held_requests",
                                 "Finished prefills whose blocks are held for a decode engine to read.", labels=labels)
        for rank in self.engine.ranks:
            values = [self.model, str(rank.dp_rank)]
            counts = rank.transfers
            for name, family in counters.items():
                family.add_metric(values, getattr(counts, name))
            cache = rank.cache
            by_source.add_metric([*values, "local_cache_hit"], cache.hits)
            by_source.add_metric([*values, "external_kv_transfer"], counts.external_tokens)
            by_source.add_metric([*values, "local_compute"], max(0, cache.queries - cache.hits - counts.external_tokens))
            held.add_metric(values, len(rank.scheduler.held))
        yield from counters.values()
        yield by_source
        yield held


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
        if config.kv_transfer is not None:
            state.http = httpx.AsyncClient(trust_env=False)
        try:
            yield
        finally:
            await engine.stop()
            if state.http is not None:
                await state.http.aclose()
                state.http = None

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
            Route(READ_PATH, ReadBlocksEndpoint(engine), methods=["POST"]),
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
    if config.kv_transfer is not None:
        xfer_time = Histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                              ["model_name", "engine"], buckets=XFER_TIME_BUCKETS, registry=app.metrics_registry)
        xfer_bytes = Histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                               ["model_name", "engine"], buckets=XFER_BYTES_BUCKETS, registry=app.metrics_registry)

        def observe_transfer(dp_rank: int, seconds: float, size: int) -> None:
            xfer_time.labels(config.model, str(dp_rank)).observe(seconds)
            xfer_bytes.labels(config.model, str(dp_rank)).observe(size)

        state.xfer_observer = observe_transfer
    app.state.engine = engine
    return app


__all__ = ["EngineState", "create_app", "filler_tokens"]
