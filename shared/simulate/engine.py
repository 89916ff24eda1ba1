"""Discrete-event replay of a trace against the running services, in simulated time.

Simulated time (seconds) only advances between events; the services are real and every call is
awaited, but how long they take never enters the simulated clock. Per request:

1. arrival at its trace timestamp: the policy picks a rank (KV routing reads the indexer and
   the slot tracker), then slot tracker `/add` with `new_isl_tokens` = prompt minus the cached
   tokens the policy expected; the request joins its rank's FIFO prefill queue;
2. prefill start, when the rank is not prefilling and the request is at the head of the queue
   and its uncached blocks fit in KV memory (else it waits for running requests to finish): the
   rank's cache pins the cached prefix, evicts LRU leaves and takes the new blocks; prefill lasts
   `uncached tokens / prefill_tps`;
3. prefill end: the new blocks are published (`stored`), slot tracker `/prefill_complete`;
   TTFT = prefill end - arrival (queue wait + prefill);
4. during decode, every `block_size` generated tokens: slot tracker `/output_blocks` with the
   request's output blocks so far, so its rank's decode load grows as the output does (the
   simulated KV memory holds prompt blocks only);
5. decode end after `output tokens / decode_tps`: the prompt blocks are unpinned, slot tracker
   `/free`.

At one instant, completions are handled before arrivals. The KV events and slot tracker
notifications produced since the last routing decision are delivered right before the next one
(and at the end), so every decision sees the services exactly as if each had been sent at its
instant, with far fewer round trips: one `/events` document holding the events of those
instants in the order the ranks produced them (ids still +1 per rank), concurrently with the
`/prefill_complete`s, `/output_blocks` and `/free`s in the order they happened, one call at a
time.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    IngestReport,
    ServiceCallError,
    ServiceStatusError,
)
from dynamo_lite.hashing import to_signed_list

from .calls import LatencyRecorder, RouteLatency, percentile
from .fleet import (
    Admission,
    Fleet,
    FleetConfig,
    RankCache,
    RankKey,
    RouterEventJson,
    events_document,
)
from .metrics import LoadSummary, RankLoad, summarize
from .policies import Policy
from .trace import SimRequest

TENANT = "default"
_PREFILL_DONE, _OUTPUT_BLOCK, _DECODE_DONE = 0, 1, 2  # order of completions at one instant
# What the slot tracker hears after an event, in `_pending_notices`
_NOTE_PREFILL_COMPLETE, _NOTE_OUTPUT_BLOCKS, _NOTE_FREE = "prefill_complete", "output_blocks", "free"

ProgressCallback = Callable[[int, int], None]  # (finished requests, total)


@dataclass(slots=True)
class _Request:
    request: SimRequest
    request_id: str
    rank: RankKey
    expected_cached_tokens: int
    admission: Admission | None = None
    prefill_start: float = math.nan
    prefill_end: float = math.nan
    waited_for_memory: bool = False
    output_blocks: int = 0  # full blocks of generated tokens so far


@dataclass(slots=True)
class _Rank:
    cache: RankCache
    load: RankLoad
    queue: deque[_Request] = field(default_factory=deque)
    prefilling: _Request | None = None
    routed: int = 0


@dataclass(slots=True)
class IngestTotals:
    """Sums of the indexer's `/events` reports over a run (all zero but `applied` when the
    simulated workers and the indexer agree)."""

    documents: int = 0
    applied: int = 0
    skipped: int = 0
    rejected: int = 0
    unknown_removals: int = 0
    gap_count: int = 0
    first_problems: list[Any] = field(default_factory=list)

    def add(self, report: IngestReport) -> None:
        self.documents += 1
        for name in ("applied", "skipped", "rejected", "unknown_removals", "gap_count"):
            setattr(self, name, getattr(self, name) + getattr(report, name))
        for item in (*report.rejections, *report.gaps):
            if len(self.first_problems) < 5:
                self.first_problems.append(item)


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    model_name: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    expected_cached_tokens: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    queue_wait_mean: float
    simulated_seconds: float
    wall_seconds: float
    load_requests: LoadSummary
    load_blocks: LoadSummary
    routed_per_rank: dict[str, int]
    evicted_blocks: int
    memory_waits: int  # requests that waited at the head of their queue for KV memory
    latencies: list[RouteLatency]
    ingest: IngestTotals
    checks: dict[str, Any]

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def check_capacity(requests: Sequence[SimRequest], config: FleetConfig) -> None:
    """Every prompt must fit in one rank's KV memory, or it would wait forever."""
    if not requests:
        raise ValueError("no requests to replay")
    largest = max(requests, key=lambda r: r.blocks)
    if largest.blocks > config.kv_blocks:
        raise ValueError(
            f"request {largest.index} needs {largest.blocks} blocks of {config.block_size} tokens, "
            f"more than the {config.kv_blocks} KV blocks of a rank: raise --kv-blocks or --block-size"
        )


class Simulation:
    """One policy's replay of one trace on a fresh fleet, under its own model name."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        config: FleetConfig,
        policy: Policy,
        slot_tracker: AsyncSlotTrackerClient,
        indexer: AsyncIndexerClient,
        recorder: LatencyRecorder,
        model_name: str,
        progress: ProgressCallback | None = None,
    ) -> None:
        check_capacity(requests, config)
        self.requests = sorted(requests, key=lambda r: r.arrival)  # stable: trace order at ties
        self.config = config
        self.policy = policy
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self.recorder = recorder
        self.model_name = model_name
        self.progress = progress
        self.fleet = Fleet(config)
        self.start = self.requests[0].arrival
        self.ranks = {key: _Rank(cache, RankLoad(self.start)) for key, cache in self.fleet.ranks.items()}
        self._heap: list[tuple[float, int, int, _Request]] = []
        self._sequence = 0
        self._pending_events: list[RouterEventJson] = []
        self._pending_notices: list[tuple[str, str, int]] = []  # (what, request id, output blocks), in order
        self.ingest = IngestTotals()
        self._ttfts: list[float] = []
        self._waits: list[float] = []
        self._cached_tokens = 0
        self._expected_cached_tokens = 0
        self._evicted = 0
        self._memory_waits = 0
        self._registered: list[tuple[Callable[..., Awaitable[None]], int]] = []

    # --- service setup and teardown -----------------------------------------------------------

    async def register(self) -> None:
        """Register every simulated worker with both services; fails (409) if the model name is
        already in use, leaving the other user's workers alone."""
        for worker in self.config.worker_ids():
            await self.slot_tracker.register(
                worker, self.model_name, self.config.block_size, dp_start=0, dp_size=self.config.dp_size
            )
            self._registered.append((self.slot_tracker.unregister, worker))
            for dp_rank in range(self.config.dp_size):
                await self.indexer.register(worker, self.model_name, self.config.block_size, dp_rank=dp_rank)
                if dp_rank == 0:
                    self._registered.append((self.indexer.unregister, worker))

    async def unregister(self) -> None:
        """Drop the workers this run registered from both services (and with them the model's
        requests and index)."""
        while self._registered:
            call, worker = self._registered.pop()
            try:
                await call(worker, self.model_name)
            except ServiceStatusError as exc:
                if exc.status != 404:
                    raise

    async def verify(self) -> dict[str, Any]:
        """Cross-check the services against the simulated fleet after the replay: every request
        freed in the slot tracker, and (when the engines published events) the indexer holding
        exactly each rank's cached blocks."""
        loads = await self.slot_tracker.loads(self.model_name, TENANT)
        busy = [(x.worker_id, x.dp_rank) for x in loads if x.active_decode_blocks or x.active_prefill_tokens]
        if not self.policy.publishes_events:
            return {"slot_tracker_idle_at_end": not busy}
        workers = await self.indexer.workers(self.model_name, TENANT)
        indexed = {
            (info.instance_id, rank.dp_rank): rank.blocks for info in workers for rank in info.ranks
        }
        mismatched = {
            f"{key[0]}/{key[1]}": {"simulated": state.cache.used, "indexer": indexed.get(key)}
            for key, state in self.ranks.items()
            if indexed.get(key) != state.cache.used
        }
        return {
            "slot_tracker_idle_at_end": not busy,
            "indexer_matches_fleet": not mismatched,
            "indexer_mismatches": mismatched,
        }

    # --- replay -------------------------------------------------------------------------------

    async def run(self) -> PolicyResult:
        started = time.perf_counter()
        try:
            await self.register()
            self.recorder.recording = True
            end = await self._replay()
            self.recorder.recording = False
            checks = await self.verify()
        except BaseException:
            self.recorder.recording = False
            with contextlib.suppress(ServiceCallError):  # best effort: the original error matters
                await self.unregister()
            raise
        await self.unregister()
        return self._result(end, time.perf_counter() - started, checks)

    async def _replay(self) -> float:
        requests = self.requests
        total = len(requests)
        heap = self._heap
        now = self.start
        next_arrival = 0
        finished = 0
        while next_arrival < total or heap:
            arrival_time = requests[next_arrival].arrival if next_arrival < total else math.inf
            completion = heap and heap[0][0] <= arrival_time
            when = heap[0][0] if completion else arrival_time
            now = when
            if completion:
                _, kind, _, item = heapq.heappop(heap)
                if kind == _PREFILL_DONE:
                    self._prefill_done(item, now)
                elif kind == _OUTPUT_BLOCK:
                    self._output_block(item, now)
                else:
                    self._decode_done(item, now)
                    finished += 1
                    if self.progress is not None:
                        self.progress(finished, total)
            else:
                await self._arrive(requests[next_arrival], now)
                next_arrival += 1
        await self._flush()
        return now

    async def _arrive(self, request: SimRequest, now: float) -> None:
        await self._flush()
        signed = to_signed_list(request.sequence_hashes)
        placement = await self.policy.place(request, signed)
        expected = min(placement.expected_cached_tokens, request.input_length)
        item = _Request(request, f"sim-{request.index}", placement.rank, expected)
        await self.slot_tracker.add(
            self.model_name, item.request_id, placement.rank[0], placement.rank[1], signed,
            request.input_length - expected, tenant_id=TENANT,
        )
        self._expected_cached_tokens += expected
        self.policy.booked(request, placement)
        state = self.ranks[placement.rank]
        state.routed += 1
        state.load.add(now, request.sequence_hashes)
        state.queue.append(item)
        self._start_prefill(state, now)

    def _start_prefill(self, state: _Rank, now: float) -> None:
        if state.prefilling is not None or not state.queue:
            return
        item = state.queue[0]
        request = item.request
        if not state.cache.fits(request.sequence_hashes):
            if not item.waited_for_memory:
                item.waited_for_memory = True
                self._memory_waits += 1
            return
        state.queue.popleft()
        admission = state.cache.admit(request.local_hashes, request.sequence_hashes)
        if admission.removed is not None:
            if self.policy.publishes_events:
                self._pending_events.append(admission.removed)
            self._evicted += len(admission.evicted)
        item.admission = admission
        item.prefill_start = now
        state.prefilling = item
        cached_tokens = admission.cached_blocks * self.config.block_size
        self._cached_tokens += cached_tokens
        self._schedule(now + self.config.prefill_seconds(request.input_length - cached_tokens), _PREFILL_DONE, item)

    def _prefill_done(self, item: _Request, now: float) -> None:
        state = self.ranks[item.rank]
        assert item.admission is not None
        stored = state.cache.stored_event(item.admission)
        if stored is not None and self.policy.publishes_events:
            self._pending_events.append(stored)
        self._pending_notices.append((_NOTE_PREFILL_COMPLETE, item.request_id, 0))
        item.prefill_end = now
        self._ttfts.append(now - item.request.arrival)
        self.policy.first_token(item.request, item.rank, now - item.request.arrival)
        self._waits.append(item.prefill_start - item.request.arrival)
        state.prefilling = None
        config = self.config
        # A block fills every block_size tokens; one filled by the last token is freed with the
        # request at that same instant, so it is never reported.
        for tokens in range(config.block_size, item.request.output_length, config.block_size):
            self._schedule(now + config.decode_seconds(tokens), _OUTPUT_BLOCK, item)
        self._schedule(now + config.decode_seconds(item.request.output_length), _DECODE_DONE, item)
        self._start_prefill(state, now)

    def _output_block(self, item: _Request, now: float) -> None:
        item.output_blocks += 1
        self.ranks[item.rank].load.grow_output(now, 1)
        self._pending_notices.append((_NOTE_OUTPUT_BLOCKS, item.request_id, item.output_blocks))

    def _decode_done(self, item: _Request, now: float) -> None:
        state = self.ranks[item.rank]
        state.cache.release(item.request.sequence_hashes)
        state.load.remove(now, item.request.sequence_hashes, item.output_blocks)
        self._pending_notices.append((_NOTE_FREE, item.request_id, 0))
        self.policy.ended(item.request, item.rank)
        self._start_prefill(state, now)

    def _schedule(self, when: float, kind: int, item: _Request) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (when, kind, self._sequence, item))

    async def _flush(self) -> None:
        """Deliver what happened since the last routing decision: one events document to the
        indexer while the slot tracker hears the prefill completions and frees, in order."""
        calls = []
        if self._pending_events:
            document = events_document(self.model_name, TENANT, self.config.block_size, self._pending_events)
            self._pending_events = []
            calls.append(self._post_events(document))
        if self._pending_notices:
            notices, self._pending_notices = self._pending_notices, []
            calls.append(self._notify(notices))
        if calls:
            await asyncio.gather(*calls)

    async def _post_events(self, document: dict[str, Any]) -> None:
        self.ingest.add(await self.indexer.events(document))

    async def _notify(self, notices: list[tuple[str, str, int]]) -> None:
        # One call at a time, in the order they happened: a gateway's calls for one request are
        # sequential too, and the measured latency stays the service's, not a self-made queue's.
        model = self.model_name
        slot_tracker = self.slot_tracker
        for what, request_id, output_blocks in notices:
            if what == _NOTE_FREE:
                await slot_tracker.free(model, request_id, tenant_id=TENANT)
            elif what == _NOTE_OUTPUT_BLOCKS:
                await slot_tracker.output_blocks(model, request_id, output_blocks, tenant_id=TENANT)
            else:
                await slot_tracker.prefill_complete(model, request_id, tenant_id=TENANT)

    # --- results ------------------------------------------------------------------------------

    def _result(self, end: float, wall_seconds: float, checks: dict[str, Any]) -> PolicyResult:
        ttfts = self._ttfts
        ranks = list(self.ranks.values())
        return PolicyResult(
            policy=self.policy.name,
            model_name=self.model_name,
            requests=len(self.requests),
            prompt_tokens=sum(r.input_length for r in self.requests),
            cached_tokens=self._cached_tokens,
            expected_cached_tokens=self._expected_cached_tokens,
            ttft_mean=sum(ttfts) / len(ttfts),
            ttft_p50=percentile(ttfts, 50),
            ttft_p99=percentile(ttfts, 99),
            queue_wait_mean=sum(self._waits) / len(self._waits),
            simulated_seconds=end - self.start,
            wall_seconds=wall_seconds,
            load_requests=summarize([r.load.requests for r in ranks], self.start, end),
            load_blocks=summarize([r.load.blocks for r in ranks], self.start, end),
            routed_per_rank={f"{key[0]}/{key[1]}": state.routed for key, state in self.ranks.items()},
            evicted_blocks=self._evicted,
            memory_waits=self._memory_waits,
            latencies=self.recorder.summary(),
            ingest=self.ingest,
            checks=checks,
        )
