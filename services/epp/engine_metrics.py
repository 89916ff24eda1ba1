"""Each engine's own `/metrics`, read now and then for the scheduler (vLLM's metric names, which
the engine stand-in serves too):

* `vllm:cache_config_info{num_gpu_blocks="..."}`: the rank's KV capacity in blocks (unless the
  pool file gives `total_kv_blocks`), which the default cost's write turnover and the KV capacity
  filter weigh against;
* `vllm:inter_token_latency_seconds` (`_sum`, `_count`; vLLM before 0.11:
  `vllm:time_per_output_token_seconds`) with `vllm:num_requests_running`: the mean decode step
  over the interval, at that batch size, which the scheduler's rate estimate observes.

* `GET /v1/models` (once per engine, until it answers): the engine's context length
  (`max_model_len`), which bounds the prompts the picker accepts.

Series are told apart by their `engine` label (vLLM's data-parallel rank); without one, a series
belongs to rank 0. An engine that cannot be read is skipped until the next round (logged once
per streak at debug level): routing never waits on it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from dynamo_lite.routing.scheduling import Scheduler

from .endpoint import PoolEndpoint

logger = logging.getLogger("dynamo_lite.epp")

READ_TIMEOUT_SECS = 2.0
MAX_BODY_BYTES = 4 * 1024 * 1024
MIN_TOKENS_PER_READING = 10  # fewer decoded tokens in an interval say too little of the step time
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


@dataclass(slots=True)
class EngineReading:
    """One rank's figures at one read."""

    num_gpu_blocks: int | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    running: float | None = None


def parse_metrics(text: str) -> dict[int, EngineReading]:
    """The figures this module reads, per data-parallel rank (the `engine` label)."""
    readings: dict[int, EngineReading] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, labels_text, value_text = match.groups()
        labels = dict(_LABEL.findall(labels_text or ""))
        try:
            rank = int(labels.get("engine", "0"))
            value = float(value_text)
        except ValueError:
            continue
        if name == "vllm:cache_config_info":
            blocks = labels.get("num_gpu_blocks")
            if blocks is not None and blocks.isdigit() and int(blocks) > 0:
                readings.setdefault(rank, EngineReading()).num_gpu_blocks = int(blocks)
        elif name == "vllm:num_requests_running":
            readings.setdefault(rank, EngineReading()).running = value
        else:
            for itl in _ITL_NAMES:
                if name == itl + "_sum":
                    reading = readings.setdefault(rank, EngineReading())
                    reading.itl_sum = (reading.itl_sum or 0.0) + value  # summed over model names
                elif name == itl + "_count":
                    reading = readings.setdefault(rank, EngineReading())
                    reading.itl_count = (reading.itl_count or 0.0) + value
    return readings


class EngineMetricsReader:
    """Reads every engine of the pool every `interval` seconds and tells the scheduler."""

    def __init__(self, pool: Callable[[], Sequence[PoolEndpoint]], scheduler: Scheduler, interval: float,
                 client: httpx.AsyncClient | None = None,
                 on_context_length: Callable[[str, int], None] | None = None) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.interval = interval
        self.on_context_length = on_context_length
        self._context_known: set[str] = set()
        self._client = client or httpx.AsyncClient(timeout=READ_TIMEOUT_SECS)
        self._previous: dict[tuple[int, int], EngineReading] = {}
        self._failing: set[str] = set()

    async def run(self) -> None:
        try:
            while True:
                await self.read_once()
                await asyncio.sleep(self.interval)
        finally:
            await self._client.aclose()

    async def read_once(self) -> None:
        by_address: dict[str, list[PoolEndpoint]] = {}
        for endpoint in self.pool():
            by_address.setdefault(endpoint.address, []).append(endpoint)
        await asyncio.gather(*(self._read(address, endpoints) for address, endpoints in by_address.items()))

    async def _read(self, address: str, endpoints: list[PoolEndpoint]) -> None:
        if self.on_context_length is not None and address not in self._context_known:
            await self._read_context_length(address)
        try:
            answer = await self._client.get(f"http://{address}/metrics")
            if answer.status_code != 200 or len(answer.content) > MAX_BODY_BYTES:
                raise ValueError(f"status {answer.status_code}, {len(answer.content)} bytes")
            readings = parse_metrics(answer.text)
        except (httpx.HTTPError, ValueError, UnicodeDecodeError) as exc:
            if address not in self._failing:
                self._failing.add(address)
                logger.debug("engine metrics of %s not read (%s): routing goes on without them", address, exc)
            return
        self._failing.discard(address)
        for endpoint in endpoints:
            reading = readings.get(endpoint.dp_rank)
            if reading is None:
                continue
            rank = endpoint.rank_key
            if endpoint.total_kv_blocks is None and reading.num_gpu_blocks is not None:
                self.scheduler.set_capacity(rank, reading.num_gpu_blocks)
            previous = self._previous.get(rank)
            self._previous[rank] = reading
            if previous is None or None in (reading.itl_sum, reading.itl_count, previous.itl_sum, previous.itl_count):
                continue
            assert reading.itl_sum is not None and reading.itl_count is not None
            assert previous.itl_sum is not None and previous.itl_count is not None
            tokens = reading.itl_count - previous.itl_count
            if tokens >= MIN_TOKENS_PER_READING:
                running = reading.running if reading.running is not None else 1.0
                self.scheduler.observe_decode_step(rank, (reading.itl_sum - previous.itl_sum) / tokens, max(1.0, running))

    async def _read_context_length(self, address: str) -> None:
        try:
            answer = await self._client.get(f"http://{address}/v1/models")
            cards = answer.json().get("data") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        declared = [card.get("max_model_len") for card in cards or () if isinstance(card, dict)]
        lengths = [length for length in declared if isinstance(length, int) and length > 0]
        if lengths and self.on_context_length is not None:
            self._context_known.add(address)
            self.on_context_length(address, min(lengths))


__all__ = ["EngineMetricsReader", "EngineReading", "parse_metrics"]
