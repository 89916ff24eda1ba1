"""One picked request's bookkeeping on the slot tracker, from the pick to the end of its answer.

Dynamo's picker does the same: `/add` at the pick, `/prefill_complete` at the first non-empty
response chunk (the first token is out), `/output_blocks` each time the streamed output fills a
block, and `/free` exactly once, whatever ends the request: the end of the stream, trailers, an
error status, a client or Envoy cancelling. Calls for one request go out in that order, one
after the other, in a background task: the protocol layer never waits for them (a chunk is
handed back to Envoy at once). A failing call is retried a few times; `/free` until it lands
or the slot tracker's request TTL would free it anyway.

The picker also keeps its own count of what it booked per rank (`InFlight`): what it routes
by when the slot tracker cannot be reached, and what tells the queue a rank has room again.

When the gateway stops showing the picker the answer after its first chunk (the access-log
configuration, `access_log.py`), the booking is told so (`unobserved`) and its output is
estimated instead of counted: one token per decode step of its engine since the last chunk seen,
up to the request's max_tokens (`estimated_output_tokens`); the picker re-estimates every
answer it no longer sees on a timer (`estimate_output`) and the blocks go out as counted ones do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from dynamo_lite.client import ServiceCallError, ServiceStatusError

from .metrics import EppMetrics
from .state import SlotTrackerCalls, run_now

logger = logging.getLogger("dynamo_lite.epp")

RankKey = tuple[int, int]
RETRIES = 3
RETRY_BASE_SECS = 0.05
FREE_RETRY_SECS = 1.0
FREE_GIVE_UP_SECS = 60.0


@dataclass(slots=True)
class RankCount:
    requests: int = 0
    prefill_tokens: int = 0
    decode_blocks: int = 0


class InFlight:
    """What this picker has booked per rank and not yet seen end."""

    def __init__(self) -> None:
        self.ranks: dict[RankKey, RankCount] = {}
        self.total = 0

    def get(self, rank: RankKey) -> RankCount:
        return self.ranks.get(rank) or RankCount()

    def add(self, rank: RankKey, prefill_tokens: int, blocks: int) -> None:
        count = self.ranks.setdefault(rank, RankCount())
        count.requests += 1
        count.prefill_tokens += prefill_tokens
        count.decode_blocks += blocks
        self.total += 1

    def prefilled(self, rank: RankKey, prefill_tokens: int) -> None:
        count = self.ranks.get(rank)
        if count is not None:
            count.prefill_tokens -= prefill_tokens

    def grow(self, rank: RankKey, blocks: int) -> None:
        count = self.ranks.get(rank)
        if count is not None:
            count.decode_blocks += blocks

    def remove(self, rank: RankKey, prefill_tokens: int, blocks: int) -> None:
        count = self.ranks.get(rank)
        if count is None:
            return
        count.requests -= 1
        count.prefill_tokens -= prefill_tokens
        count.decode_blocks -= blocks
        self.total -= 1
        if count.requests <= 0:
            del self.ranks[rank]


def estimated_output_tokens(seen: int, seconds_unseen: float, step_secs: float, cap: int | None) -> int:
    """An answer's output after `seconds_unseen` without seeing it, `seen` tokens counted before:
    one token per decode step (`step_secs`) of its engine, at most `cap` (its max_tokens)."""
    tokens = seen + (int(seconds_unseen / step_secs) if step_secs > 0 and seconds_unseen > 0 else 0)
    return tokens if cap is None else max(seen, min(tokens, cap))


@dataclass(frozen=True, slots=True)
class BookingTarget:
    """Where a request is booked: the rank, and the pieces `/add` needs."""

    worker_id: int
    dp_rank: int
    address: str

    @property
    def rank(self) -> RankKey:
        return (self.worker_id, self.dp_rank)


class Booking:
    """The `RequestTracker` of one picked request (see the module docstring)."""

    def __init__(
        self,
        *,
        slot_tracker: SlotTrackerCalls | None,
        metrics: EppMetrics,
        in_flight: InFlight,
        request_id: str,
        model: str,
        tenant_id: str,
        target: BookingTarget,
        fallbacks: dict[str, BookingTarget],
        sequence_hashes: list[int],
        new_prefill_tokens: int,
        block_size: int,
        on_end: Callable[[], None],
        on_prefilled: Callable[[], None] | None = None,
        max_output_tokens: int | None = None,
        on_unobserved: Callable[[Booking], None] | None = None,
        expected_output_tokens: int | None = None,
        counted: bool = True,
    ) -> None:
        """`counted`: the booking is a request's own (in the in-flight and end metrics); False
        for the prefill half of a disaggregated request, booked beside its decode booking."""
        self.slot_tracker = slot_tracker  # None: the slot tracker was away at the pick: own counts only
        self._immediate = getattr(slot_tracker, "immediate", False)  # in-process: each call made at once
        self.metrics = metrics
        self.in_flight = in_flight
        self.request_id = request_id
        self.model = model
        self.tenant_id = tenant_id
        self.target = target
        self.fallbacks = fallbacks
        self.sequence_hashes = sequence_hashes
        self.new_prefill_tokens = new_prefill_tokens
        self.block_size = block_size
        self.on_end = on_end
        self.on_prefilled = on_prefilled
        self.max_output_tokens = max_output_tokens  # the request's max_tokens: what an estimate stays under
        self.on_unobserved = on_unobserved
        # The answer's expected length (`nvext.agent_hints.osl`): the slot tracker decays its
        # output blocks toward it.
        self.expected_output_tokens = expected_output_tokens
        self.counted = counted
        self.unobserved_since: float | None = None  # time.monotonic() when the gateway stopped showing chunks
        self._seen_tokens = 0  # output tokens counted from chunks before that
        self.prefilled = False
        self.output_tokens = 0
        self.output_blocks = 0
        self.ended: str | None = None
        self._log_adapter: logging.LoggerAdapter[logging.Logger] | None = None
        self._prompt_blocks = len(sequence_hashes)
        self._non_stream_body: list[bytes] | None = None
        self._headers_seen = False  # the access-log configuration shows the picker no response headers
        self._calls: asyncio.Task[None] | None = None
        self._blocks_queued = False  # an /output_blocks call waits in the queue
        self._blocks_sent = 0
        in_flight.add(target.rank, new_prefill_tokens, self._prompt_blocks)
        if counted:
            metrics.in_flight.inc()
        if slot_tracker is not None:
            self._then(self._add)

    @property
    def _log(self) -> logging.LoggerAdapter[logging.Logger]:
        """Every line about this request carries its id as a field (`--log-format json`); made
        on the first line, which most requests never write."""
        if self._log_adapter is None:
            self._log_adapter = logging.LoggerAdapter(logger, {"fields": {"request_id": self.request_id}})
        return self._log_adapter

    @property
    def last_call(self) -> asyncio.Task[None] | None:
        """The last slot tracker call sent: done once every call sent so far is."""
        return self._calls

    # --- RequestTracker -------------------------------------------------------------------------

    def response_headers(self, status: int, headers: dict[str, str]) -> None:
        self._headers_seen = True
        if status >= 400:
            self.end("error_status")
            return
        if not headers.get("content-type", "").startswith("text/event-stream"):
            self._non_stream_body = []

    def served(self, endpoint: str) -> None:
        """Where the gateway really sent the request: after a fallback, the bookkeeping moves there."""
        if self.ended is not None or endpoint == self.target.address:
            return
        self.metrics.served_mismatches.inc()
        moved_to = self.fallbacks.get(endpoint)
        if moved_to is None:
            self._log.warning("request %s served by %s, which is not in its pick or fallbacks; kept on %s",
                           self.request_id, endpoint, self.target.address)
            return
        self._log.info("request %s served by fallback %s (picked %s): booking moved",
                    self.request_id, endpoint, self.target.address)
        old = self.target
        self.in_flight.remove(old.rank, 0 if self.prefilled else self.new_prefill_tokens,
                              self._prompt_blocks + self.output_blocks)
        self.target = moved_to
        self.in_flight.add(moved_to.rank, 0 if self.prefilled else self.new_prefill_tokens,
                           self._prompt_blocks + self.output_blocks)
        if self.slot_tracker is not None:
            self._then(self._free_call)
            self._then(self._add)

    def response_chunk(self, data: bytes) -> None:
        if self.ended is not None or not data:
            return
        if not self.prefilled:
            if not self._headers_seen and data.lstrip()[:1] in (b"{", b"["):
                # No headers to say so (the access-log configuration): a JSON body is a whole
                # answer, not a stream whose output grows after this chunk.
                self._non_stream_body = []
            self.prefilled = True
            self.in_flight.prefilled(self.target.rank, self.new_prefill_tokens)
            if self.on_prefilled is not None:
                self.on_prefilled()
            if self.slot_tracker is not None:
                self._then(self._prefill_complete)
        if self._non_stream_body is not None:
            if sum(map(len, self._non_stream_body)) < 4 * 1024 * 1024:
                self._non_stream_body.append(data)
            return
        # One SSE event per generated token (vLLM, SGLang, TensorRT-LLM stream token by token);
        # the usage chunk (`"choices":[]`) and `[DONE]` are not tokens.
        self._output(self.output_tokens + data.count(b"data: {") - data.count(b'"choices":[]'))

    def unobserved(self) -> None:
        """The gateway relays the rest of the answer without the picker (the end is still
        reported): from here the output is estimated (`estimate_output`)."""
        if self.ended is not None or self.unobserved_since is not None:
            return
        self.unobserved_since = time.monotonic()
        self._seen_tokens = self.output_tokens
        if self._non_stream_body is not None:
            return  # a whole (not streamed) answer: its first chunk came once it was written
        if self.on_unobserved is not None:
            self.on_unobserved(self)

    def estimated_tokens(self, at: float, step_secs: float) -> int:
        """The output by time.monotonic() `at` (estimated once unobserved, else as counted)."""
        if self.unobserved_since is None or self._non_stream_body is not None:
            return self.output_tokens
        return estimated_output_tokens(self._seen_tokens, at - self.unobserved_since, step_secs,
                                       self.max_output_tokens)

    def estimate_output(self, at: float, step_secs: float) -> None:
        """Book the output estimated for time `at` (an unobserved answer; see the module docstring)."""
        if self.ended is None and self.unobserved_since is not None:
            self._output(self.estimated_tokens(at, step_secs))

    def _output(self, tokens: int) -> None:
        """The answer's output is `tokens` (counted or estimated): the blocks it fills are booked."""
        if tokens <= self.output_tokens:
            return
        self.output_tokens = tokens
        blocks = tokens // self.block_size
        if blocks > self.output_blocks:
            self.in_flight.grow(self.target.rank, blocks - self.output_blocks)
            self.output_blocks = blocks
            if self.slot_tracker is not None and not self._blocks_queued:
                # One call in the queue at a time, sending the count when it goes out: the count
                # is absolute, so blocks that filled meanwhile ride along (a fast stream fills
                # several blocks while a call is on its way).
                self._blocks_queued = True
                self._then(self._output_blocks)

    def end(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        if self.counted:
            self.metrics.ends.labels(reason).inc()
            self.metrics.in_flight.dec()
        self.in_flight.remove(self.target.rank, 0 if self.prefilled else self.new_prefill_tokens,
                              self._prompt_blocks + self.output_blocks)
        if self.slot_tracker is not None:
            self._then(self._free)
        self.on_end()

    # --- the calls, in order ---------------------------------------------------------------------

    def _then(self, call: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._immediate:
            run_now(call())
            return
        previous = self._calls
        if previous is None or previous.done():  # nothing to wait for: no wrapper task
            self._calls = asyncio.get_running_loop().create_task(call())
            return

        async def run() -> None:
            if not previous.done():
                await asyncio.shield(previous)
            await call()

        self._calls = asyncio.get_running_loop().create_task(run())

    async def _retrying(self, name: str, call: Callable[[], Awaitable[None]], *, ok_statuses: tuple[int, ...] = ()) -> bool:
        delay = RETRY_BASE_SECS
        for attempt in range(RETRIES):
            try:
                await call()
                return True
            except ServiceCallError as exc:
                if exc.status in ok_statuses:
                    return True
                if isinstance(exc, ServiceStatusError) and exc.status < 500:
                    self._log.warning("request %s: %s refused: %s", self.request_id, name, exc)
                    self.metrics.lifecycle_failures.labels(name).inc()
                    return False
                if attempt == RETRIES - 1:
                    self._log.warning("request %s: %s failed: %s", self.request_id, name, exc)
            await asyncio.sleep(delay)
            delay *= 4
        self.metrics.lifecycle_failures.labels(name).inc()
        return False

    async def _add(self) -> None:
        tracker = self.slot_tracker
        assert tracker is not None
        target = self.target
        await self._retrying("add", lambda: tracker.add(
            self.model, self.request_id, target.worker_id, target.dp_rank, self.sequence_hashes,
            self.new_prefill_tokens, tenant_id=self.tenant_id, expected_output_tokens=self.expected_output_tokens),
            ok_statuses=(409,))

    async def _prefill_complete(self) -> None:
        tracker = self.slot_tracker
        assert tracker is not None
        await self._retrying("prefill_complete", lambda: tracker.prefill_complete(
            self.model, self.request_id, tenant_id=self.tenant_id), ok_statuses=(404,))

    async def _output_blocks(self) -> None:
        tracker = self.slot_tracker
        assert tracker is not None
        self._blocks_queued = False
        count = self.output_blocks
        if count <= self._blocks_sent or self.ended is not None:
            return
        self._blocks_sent = count
        await self._retrying("output_blocks", lambda: tracker.output_blocks(
            self.model, self.request_id, count, tenant_id=self.tenant_id), ok_statuses=(404, 409))

    async def _free_call(self) -> None:
        tracker = self.slot_tracker
        assert tracker is not None
        await self._retrying("free", lambda: tracker.free(self.model, self.request_id, tenant_id=self.tenant_id),
                             ok_statuses=(404,))

    async def _free(self) -> None:
        """`/free` until it lands: a leaked booking skews every later pick until its TTL."""
        tracker = self.slot_tracker
        assert tracker is not None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + FREE_GIVE_UP_SECS
        while True:
            try:
                await tracker.free(self.model, self.request_id, tenant_id=self.tenant_id)
                return
            except ServiceCallError as exc:
                if isinstance(exc, ServiceStatusError) and exc.status < 500:
                    return  # not active any more (expired, worker gone): nothing to free
                if loop.time() >= give_up:
                    self._log.error("request %s: /free failed for %.0f s, giving up (the slot tracker's TTL frees it): %s",
                                 self.request_id, FREE_GIVE_UP_SECS, exc)
                    self.metrics.lifecycle_failures.labels("free").inc()
                    return
            await asyncio.sleep(FREE_RETRY_SECS)

    async def settled(self) -> None:
        """Wait until every call sent so far is done (shutdown, tests)."""
        while self._calls is not None and not self._calls.done():
            await asyncio.shield(self._calls)


__all__ = ["Booking", "BookingTarget", "InFlight", "RankCount", "estimated_output_tokens"]
