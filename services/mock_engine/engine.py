"""The engine stand-in's running engine: one step loop per data-parallel rank on the real clock,
each rank with its own cache, scheduler and KV event publisher.

The rank's `Scheduler` (pure) plans a step; the loop sleeps the step's modelled time, applies
it, publishes the step's KV events as one batch (as vLLM publishes once per scheduler step) and
hands each request its new token. All of it runs on the event loop thread, so no locks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.hashing import to_signed
from dynamo_lite.kv_publishers import BlockHash, EnginePublisher, Event, Removed, Stored, WireFormat

from .cache import PrefixCache
from .kv_transfer import KvTransferConfig, TransferModel
from .scheduler import EngineRequest, Output, Scheduler

logger = logging.getLogger("dynamo_lite.mock_engine")

DEFAULT_BUFFER_STEPS = 10_000


class KvEventsConfigError(ValueError):
    """`--kv-events-config` is not what vLLM accepts."""


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's `KVEventsConfig` (the JSON of `--kv-events-config`), the fields a ZMQ publisher reads."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KvEventsConfigError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise KvEventsConfigError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise KvEventsConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
        config = cls(**data)
        if not isinstance(config.enable_kv_cache_events, bool):
            raise KvEventsConfigError("--kv-events-config: enable_kv_cache_events must be true or false")
        if config.publisher not in ("zmq", "null"):
            raise KvEventsConfigError(f"--kv-events-config: publisher {config.publisher!r}: 'zmq' or 'null'")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(config, name), str):
                raise KvEventsConfigError(f"--kv-events-config: {name} must be a string")
        if config.replay_endpoint is not None and not isinstance(config.replay_endpoint, str):
            raise KvEventsConfigError("--kv-events-config: replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KvEventsConfigError(f"--kv-events-config: {name} must be a positive integer")
        return config

    @property
    def publishes(self) -> bool:
        """vLLM publishes only with events enabled and the zmq publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """vLLM's `offset_endpoint_port`: rank r of a data-parallel engine binds its tcp port + r
    (other transports get the rank appended to the path)."""
    if rank == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    if match:
        return f"{match.group(1)}:{int(match.group(2)) + rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    raise KvEventsConfigError(f"cannot offset the port of endpoint {endpoint!r} for dp rank {rank}")


def _sglang_event(event: Event) -> Event:
    """SGLang publishes signed int64 hashes. (The cache salt is not written: the picker, like
    the indexer for vLLM's events, hashes without it, so both sides stay in step.)"""
    if isinstance(event, Stored):
        return Stored(
            block_hashes=[_signed(h) for h in event.block_hashes],
            parent_block_hash=None if event.parent_block_hash is None else _signed(event.parent_block_hash),
            token_ids=event.token_ids, block_size=event.block_size, lora_id=None, medium=event.medium,
            lora_name=event.lora_name,
        )
    if isinstance(event, Removed):
        return Removed(block_hashes=[_signed(h) for h in event.block_hashes], medium=event.medium)
    return event


def _signed(block_hash: BlockHash) -> BlockHash:
    """An int hash as SGLang writes it (i64); the cache here makes no bytes hashes."""
    return block_hash if isinstance(block_hash, bytes) else to_signed(block_hash)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "mock"
    block_size: int = 16
    num_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    data_parallel_size: int = 1
    timing: TimingModel = field(default_factory=TimingModel)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    kv_events_format: WireFormat = WireFormat.VLLM
    seed: int = 0
    hash_seed: str | None = None
    # `--kv-transfer-config` (None: no connector; `kv_transfer_params` are ignored, as vLLM does
    # without one), the transfer's timing, and the address a prefill answer names as its side
    # channel (`remote_host`, `remote_port`: the stand-in's own HTTP address).
    kv_transfer: KvTransferConfig | None = None
    transfer: TransferModel = field(default_factory=TransferModel)
    side_channel_host: str = "localhost"
    side_channel_port: int = 8000


@dataclass(slots=True)
class TransferCounts:
    """One rank's disaggregation counters (`/metrics`)."""

    remote_decode_requests: int = 0  # prefills finished for a remote decode engine (blocks held)
    remote_prefill_requests: int = 0  # decode requests that read their prompt's blocks
    remote_prefill_fallbacks: int = 0  # decode requests that asked for it but prefilled locally
    blocks_read: int = 0  # blocks this rank read from prefill engines
    blocks_sent: int = 0  # held blocks a decode engine read from this rank
    external_tokens: int = 0  # prompt tokens whose KV was read, not computed
    failed_transfers: int = 0  # reads that failed (vllm:nixl_num_failed_transfers)
    expired: int = 0  # held blocks nobody read in time (vllm:nixl_num_kv_expired_reqs)


class RequestStream:
    """One request's tokens as they come out of its rank's steps."""

    def __init__(self, rank: Rank, request: EngineRequest) -> None:
        self.rank = rank
        self.request = request
        self._outputs: asyncio.Queue[Output] = asyncio.Queue()

    def deliver(self, output: Output) -> None:
        self._outputs.put_nowait(output)

    async def outputs(self) -> AsyncIterator[Output]:
        """Each step's output until the request finishes; leaving early aborts the request."""
        try:
            while True:
                output = await self._outputs.get()
                yield output
                if output.finished is not None:
                    return
        finally:
            if self.request.finished is None:
                self.rank.abort(self)


class Rank:
    """One data-parallel rank: cache, scheduler, publisher and step loop."""

    def __init__(self, config: EngineConfig, dp_rank: int, filler: Sequence[int]) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.cache = PrefixCache(config.num_blocks, config.block_size, hash_seed=config.hash_seed)
        self._filler = filler
        self.scheduler = Scheduler(self.cache, config.timing, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, next_token=self._next_token)
        self.publisher: EnginePublisher | None = None
        self.streams: dict[int, RequestStream] = {}  # id(EngineRequest) -> stream
        self.ttft_observer: Any = None  # set by the app: called with (rank, seconds)
        self.itl_observer: Any = None  # set by the app: called with (rank, seconds) for each later token
        self.steps = 0
        self.transfers = TransferCounts()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        events = config.kv_events
        if events.publishes:
            self.publisher = EnginePublisher(
                config.kv_events_format, dp_rank=dp_rank, topic=events.topic.encode(),
                replay=events.replay_endpoint is not None, buffer_steps=events.buffer_steps,
                bind=offset_endpoint_port(events.endpoint, dp_rank),
                replay_bind=None if events.replay_endpoint is None else offset_endpoint_port(events.replay_endpoint, dp_rank),
            )

    def _next_token(self, request: EngineRequest, index: int) -> int:
        """Deterministic filler: the same prompt gets the same answer (seeded)."""
        rng = random.Random(hash((self.config.seed, len(request.prompt_token_ids), request.prompt_token_ids[-1], index)))
        return self._filler[rng.randrange(len(self._filler))]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"rank-{self.dp_rank}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.publisher is not None:
            self.publisher.close()

    def submit(self, request: EngineRequest) -> RequestStream:
        stream = RequestStream(self, request)
        self.scheduler.add(request)
        self.streams[id(request)] = stream
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.scheduler.abort(stream.request)
        self.streams.pop(id(stream.request), None)
        self._publish()

    def load_remote(self, request: EngineRequest, tokens: int) -> bool:
        """Queue a decode request whose first `tokens` prompt tokens' KV was read from a prefill
        engine: admitted now with them computed, their blocks cached and published. False (and
        nothing queued) when the pool cannot hold the prompt now."""
        seq = self.cache.load(request.request_id, list(request.prompt_token_ids), tokens,
                              lora_name=request.lora_name, cache_salt=request.cache_salt)
        if seq is None:
            return False
        self.transfers.external_tokens += seq.computed - seq.cached_tokens
        request.seq = seq
        request.cached_tokens = seq.cached_tokens
        self._publish()
        return True

    def read_held(self, transfer_id: str) -> list[int] | None:
        """A decode engine reads the blocks held for `transfer_id`: they are freed (they stay
        cached) and the token ids they held returned; None when none are held."""
        seq = self.scheduler.release_held(transfer_id)
        if seq is None:
            return None
        self.transfers.blocks_sent += -(-seq.computed // self.cache.block_size)
        return seq.token_ids[:seq.computed]

    def _expire(self, transfer_id: str) -> None:
        if self.scheduler.release_held(transfer_id) is not None:
            self.transfers.expired += 1
            logger.warning("blocks held for remote decode %s were not read in time; freed", transfer_id)

    def reset_prefix_cache(self) -> bool:
        cleared = self.cache.clear()
        self._publish()
        return cleared

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        while True:
            if not scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
            step = scheduler.plan()
            if step is None:
                # Waiting requests that cannot be admitted yet and nothing running cannot
                # happen (an empty pool admits any prompt the API accepts); idle briefly.
                await asyncio.sleep(0.001)
                continue
            if step.seconds > 0:
                await asyncio.sleep(step.seconds)
            else:
                await asyncio.sleep(0)
            self.steps += 1
            outputs = scheduler.finish(step, loop.time())
            self._publish()
            for output in outputs:
                request = output.request
                stream = self.streams.get(id(request))
                if stream is None:
                    continue
                if output.token_id is not None:
                    now = loop.time()
                    if len(request.output_token_ids) == 1:
                        if self.ttft_observer:
                            self.ttft_observer(self.dp_rank, now - request.arrival)
                    elif self.itl_observer and request.last_token_at is not None:
                        self.itl_observer(self.dp_rank, now - request.last_token_at)
                    request.last_token_at = now
                if output.finished is not None:
                    del self.streams[id(request)]
                    if request.transfer_id is not None and request.transfer_id in scheduler.held:
                        self.transfers.remote_decode_requests += 1
                        loop.call_later(self.config.transfer.hold_secs, self._expire, request.transfer_id)
                stream.deliver(output)

    def _publish(self) -> None:
        events = self.cache.drain_events()
        if not events or self.publisher is None:
            return
        if self.config.kv_events_format is WireFormat.SGLANG:
            events = [_sglang_event(event) for event in events]
        self.publisher.publish(events, ts=time.time())


class MockEngine:
    """Every rank of one engine process."""

    def __init__(self, config: EngineConfig, filler: Sequence[int]) -> None:
        if config.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        self.config = config
        self.ranks: list[Rank] = []
        try:
            for dp_rank in range(config.data_parallel_size):
                self.ranks.append(Rank(config, dp_rank, filler))
        except BaseException:
            for rank in self.ranks:
                if rank.publisher is not None:
                    rank.publisher.close()
            raise

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    async def stop(self) -> None:
        for rank in self.ranks:
            await rank.stop()

    def choose_rank(self, requested: int | None) -> Rank:
        """The rank a request asked for (vLLM's `X-data-parallel-rank` header), else the least
        loaded one, as vLLM's internal balancer scores it."""
        if requested is not None:
            return self.ranks[requested]
        return min(self.ranks, key=lambda rank: (rank.scheduler.load(), rank.dp_rank))

    def submit(self, request: EngineRequest, dp_rank: int | None = None) -> RequestStream:
        return self.choose_rank(dp_rank).submit(request)


__all__ = [
    "EngineConfig",
    "KvEventsConfig",
    "KvEventsConfigError",
    "MockEngine",
    "Rank",
    "RequestStream",
    "TransferCounts",
    "offset_endpoint_port",
]
