"""The KV-aware pick: which engine of the pool serves a request, from the two services' answers.

Per request (`KvPicker.pick`):

1. the body must be JSON naming a `model` (400); the candidates are the pool's ranks serving
   that model (as its name or one of its LoRA adapters), within the gateway's subset hint
   (none: 503);
2. the prompt's token ids (`prompt.PromptReader`) become local block hashes (for the indexer)
   and chained sequence hashes (for the slot tracker), computed here: a `/query_by_hash` is
   cheaper for the indexer than hashing a `/query`'s token ids itself (bench.gateway);
3. the indexer's overlap and the slot tracker's `/potential_loads` are read concurrently and
   scored with the KV router's cost (`dynamo_lite.routing.score_ranks` and `choose`, the code
   `KvRouter` runs): `overlap_weight * prefill_blocks + decode_blocks`, with temperature;
   busy thresholds take ranks out;
4. when every candidate is busy (or past `queue_threshold` x its max_num_batched_tokens of
   active prefill), the request waits in the queue (fcfs / wspt, priority from a header) until
   one has room, or is refused with 429 and `x-dynamo-lite-dropped-reason`;
5. the pick and its fallbacks (the next cheapest ranks) go back to the gateway; the request is
   booked (`booking.Booking`).

Degraded, never down: the indexer away → pick by load alone; the slot tracker away → by
overlap and this picker's own in-flight counts; both → round robin. Each is counted and logged
once per streak; no request fails because a service is away.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    PotentialLoad,
    ServiceCallError,
    ServiceStatusError,
)
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed
from dynamo_lite.routing import RankCost, RouterConfig, choose, score_ranks

from .booking import Booking, BookingTarget, InFlight
from .metrics import EppMetrics
from .pool import PoolEndpoint
from .prompt import PromptReader, parse_body
from .protocol import NullTracker, Pick, PickError, RequestInfo
from .queue import AdmissionQueue, QueuedRequest, QueuePolicy, QueueRefused, RequestQueue

logger = logging.getLogger("dynamo_lite.epp")

DROPPED_REASON_HEADER = "x-dynamo-lite-dropped-reason"
DEFAULT_PRIORITY_HEADER = "x-request-priority"
DEFAULT_FALLBACKS = 2
LOAD_REFRESH_SECS = 0.05  # while requests wait in the queue, how often the loads are re-read


@dataclass(frozen=True, slots=True)
class PickerSettings:
    router: RouterConfig = RouterConfig()
    # Requests wait while every candidate's active prefill exceeds this fraction of its
    # max_num_batched_tokens (Dynamo's --router-queue-threshold); None: refuse at once instead.
    queue_threshold: float | None = 2.0
    queue_policy: QueuePolicy = QueuePolicy.FCFS
    queue_max_wait_secs: float = 30.0
    queue_max_size: int = 1024
    priority_header: str = DEFAULT_PRIORITY_HEADER
    fallbacks: int = DEFAULT_FALLBACKS
    seed: int | None = None


class _Streak:
    """A service's reachability, logged once per change."""

    def __init__(self, name: str, metrics: EppMetrics) -> None:
        self.name = name
        self.metrics = metrics
        self.down = False

    def failed(self, error: BaseException, what: str) -> None:
        if not self.down:
            self.down = True
            self.metrics.degraded.labels(self.name).set(1)
            logger.warning("%s unreachable (%s): picking %s until it answers again", self.name, error, what)

    def ok(self) -> None:
        if self.down:
            self.down = False
            self.metrics.degraded.labels(self.name).set(0)
            logger.info("%s answers again: picking with it", self.name)


class KvPicker:
    """The `Picker` the gRPC layer asks (see the module docstring). All state lives on the event
    loop: the pool (swapped whole by the pool watcher), the in-flight counts and the queue."""

    def __init__(
        self,
        *,
        pool: Sequence[PoolEndpoint],
        slot_tracker: AsyncSlotTrackerClient,
        indexer: AsyncIndexerClient,
        prompts: PromptReader,
        metrics: EppMetrics,
        settings: PickerSettings = PickerSettings(),
    ) -> None:
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self.prompts = prompts
        self.metrics = metrics
        self.settings = settings
        self.router_config = settings.router
        self.rng = random.Random(settings.seed)
        self.in_flight = InFlight()
        self.bookings: dict[str, Booking] = {}
        self._round_robin = itertools.count()
        self._slot_tracker_state = _Streak("slot tracker", metrics)
        self._indexer_state = _Streak("indexer", metrics)
        self._last_loads: dict[tuple[int, int], int] = {}  # active prefill tokens per rank, last read
        self._rank_busy: dict[tuple[int, int], bool] = {}  # busy or saturated at the last look
        self._queue = AdmissionQueue(RequestQueue(settings.queue_policy, settings.queue_max_size), self._has_capacity)
        self._refresher: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[None]] = set()  # ended bookings whose calls are still going out
        self.pool: list[PoolEndpoint] = []
        self.set_pool(pool)

    # --- the pool and run-time settings ----------------------------------------------------------

    def set_pool(self, pool: Sequence[PoolEndpoint]) -> None:
        self.pool = list(pool)
        self._by_rank = {endpoint.rank_key: endpoint for endpoint in self.pool}
        self._queue.poke()

    def set_thresholds(self, **thresholds: Any) -> RouterConfig:
        """Busy thresholds at run time (`POST /busy_threshold`); ValueError for a bad value."""
        self.router_config = replace(self.router_config, **thresholds)
        self._rank_busy.clear()  # judged again at the next look
        self._queue.poke()
        return self.router_config

    async def aclose(self) -> None:
        self._queue.close()
        if self._refresher is not None:
            self._refresher.cancel()
        await self.prompts.aclose()

    # --- the pick ----------------------------------------------------------------------------

    async def pick(self, request: RequestInfo) -> Pick:
        started = time.perf_counter()
        try:
            pick = await self._pick(request)
        except PickError as error:
            self.metrics.decisions.labels(f"refused_{error.status}").inc()
            raise
        finally:
            self.metrics.pick_seconds.observe(time.perf_counter() - started)
        return pick

    async def _pick(self, request: RequestInfo) -> Pick:
        if not request.body:
            return self._pick_without_body(request)
        data = parse_body(request.body)
        model = data["model"]
        candidates = self._candidates(model, request.subset)
        block_size = candidates[0].block_size
        candidates = [endpoint for endpoint in candidates if endpoint.block_size == block_size]
        prompt = await self.prompts.read(request.path, data)
        lora_name = model if model != candidates[0].model else None
        tenant = candidates[0].tenant_id
        local = local_block_hashes(prompt.token_ids, block_size, lora_name=lora_name)
        signed_local = [to_signed(h) for h in local]
        signed_seq = [to_signed(h) for h in sequence_hashes(local)]
        isl = len(prompt.token_ids)
        queued = False
        arrival = deadline = 0.0
        try:
            while True:
                costs, outcome = await self._costs(candidates, candidates[0].model, tenant, signed_local, signed_seq,
                                                   isl, block_size)
                open_costs = [cost for cost in costs if not cost.busy and not self._saturated(cost)]
                if open_costs:
                    break
                if self.settings.queue_threshold is None:
                    raise PickError(429, f"every endpoint serving {model!r} is busy",
                                    {DROPPED_REASON_HEADER: "rejected-saturated"})
                now = asyncio.get_running_loop().time()
                if queued:
                    # Released, but the ranks were busy again by the time it looked (another
                    # picker, a stale view): back into the queue, with its first arrival.
                    self._queue.admitted(request.request_id)
                    queued = False
                    if now >= deadline:
                        raise PickError(429, "not routed: queue-timeout", {DROPPED_REASON_HEADER: "queue-timeout"})
                else:
                    arrival, deadline = now, now + self.settings.queue_max_wait_secs
                await self._wait_in_queue(request, isl, arrival, deadline)
                queued = True
            if outcome == "round_robin":
                ordered = self._rotate(open_costs)
            else:
                chosen = choose(open_costs, self.router_config.router_temperature, self.rng)
                rest = sorted((cost for cost in open_costs if cost is not chosen),
                              key=lambda c: (c.cost, c.worker_id, c.dp_rank))
                ordered = [chosen, *rest]
            self.metrics.decisions.labels(outcome).inc()
            # The candidates as they were when the pick began: a pool re-read meanwhile does not
            # take an endpoint from under a decision made with it.
            by_rank = {endpoint.rank_key: endpoint for endpoint in candidates}
            return self._book(request, tenant, ordered, by_rank, signed_seq, signed_local, isl, block_size, outcome)
        finally:
            if queued:
                # Booked (or refused): the queue may release the next request.
                self._queue.admitted(request.request_id)

    def _pick_without_body(self, request: RequestInfo) -> Pick:
        """A request without body (`GET /v1/models`, `/health`): no prompt, no model to match,
        nothing to book; any endpoint of the pool (within the subset hint) can answer it."""
        addresses = list(dict.fromkeys(endpoint.address for endpoint in self.pool))
        if request.subset is not None:
            allowed = set(request.subset)
            addresses = [address for address in addresses if address in allowed]
        if not addresses:
            raise PickError(503, "no endpoint to send the request to")
        start = next(self._round_robin) % len(addresses)
        ordered = addresses[start:] + addresses[:start]
        self.metrics.decisions.labels("no_body").inc()
        return Pick(endpoints=ordered[:self.settings.fallbacks + 1], headers={"x-request-id": request.request_id},
                    tracker=NullTracker())

    def _candidates(self, model: str, subset: tuple[str, ...] | None) -> list[PoolEndpoint]:
        serving = [endpoint for endpoint in self.pool if endpoint.model == model or model in endpoint.lora_names]
        if not serving:
            raise PickError(503, f"no endpoint serves model {model!r}")
        if subset is not None:
            allowed = set(subset)
            serving = [endpoint for endpoint in serving if endpoint.address in allowed]
            if not serving:
                raise PickError(503, "no endpoint of the subset hint serves this model")
        return serving

    def _saturated(self, cost: RankCost) -> bool:
        threshold = self.settings.queue_threshold
        if threshold is None:
            return False
        rank = (cost.worker_id, cost.dp_rank)
        endpoint = self._by_rank.get(rank)
        if endpoint is None:
            return False
        return self._last_loads.get(rank, 0) > threshold * endpoint.max_num_batched_tokens

    def _rotate(self, costs: list[RankCost]) -> list[RankCost]:
        ordered = sorted(costs, key=lambda c: (c.worker_id, c.dp_rank))
        start = next(self._round_robin) % len(ordered)
        return ordered[start:] + ordered[:start]

    async def _costs(self, candidates: list[PoolEndpoint], model: str, tenant: str, local: list[int],
                     seq: list[int], isl: int, block_size: int) -> tuple[list[RankCost], str]:
        overlap_result, loads_result = await asyncio.gather(
            self.indexer.query_by_hash(model, local, tenant_id=tenant),
            self.slot_tracker.potential_loads(model, seq, 0, tenant_id=tenant),
            return_exceptions=True,
        )
        indexer_up, cached = self._read_overlap(overlap_result)
        tracker_up, loads = self._read_loads(loads_result, candidates)
        ranks = {endpoint.rank_key for endpoint in candidates}
        if not tracker_up:
            loads = [self._own_load(endpoint, len(seq)) for endpoint in candidates]
        else:
            loads = [load for load in loads if (load.worker_id, load.dp_rank) in ranks]
            known = {(load.worker_id, load.dp_rank) for load in loads}
            # A rank the slot tracker does not list (not registered yet) cannot be booked there.
            if not loads:
                loads = [self._own_load(endpoint, len(seq)) for endpoint in candidates if endpoint.rank_key not in known]
                tracker_up = False
        capacities = {endpoint.rank_key: endpoint.max_num_batched_tokens for endpoint in candidates}
        for load in loads:
            self._last_loads[(load.worker_id, load.dp_rank)] = load.potential_prefill_tokens
        costs = score_ranks(loads, cached, isl, block_size, self.router_config, capacities)
        for cost in costs:
            self._rank_busy[(cost.worker_id, cost.dp_rank)] = cost.busy or self._saturated(cost)
        if indexer_up and tracker_up:
            outcome = "kv"
        elif tracker_up:
            outcome = "load_only"
        elif indexer_up:
            outcome = "overlap_only"
        else:
            outcome = "round_robin"
        return costs, outcome

    def _read_overlap(self, result: Any) -> tuple[bool, dict[tuple[int, int], int]]:
        if isinstance(result, ServiceStatusError) and result.status == 404:
            self._indexer_state.ok()  # nothing of this model indexed yet: no overlap anywhere
            return True, {}
        # A failed call (`ServiceCallError`) or an answer that does not read (not JSON, another shape).
        if isinstance(result, Exception):
            self._indexer_state.failed(result, "by load alone")
            return False, {}
        if isinstance(result, BaseException):
            raise result
        self._indexer_state.ok()
        return True, result.scores

    def _read_loads(self, result: Any, candidates: list[PoolEndpoint]) -> tuple[bool, list[PotentialLoad]]:
        # A failed call (`ServiceCallError`) or an answer that does not read (not JSON, another shape).
        if isinstance(result, Exception):
            self._slot_tracker_state.failed(result, "by overlap and this picker's own in-flight counts")
            return False, []
        if isinstance(result, BaseException):
            raise result
        self._slot_tracker_state.ok()
        return True, result

    def _own_load(self, endpoint: PoolEndpoint, prompt_blocks: int) -> PotentialLoad:
        count = self.in_flight.get(endpoint.rank_key)
        return PotentialLoad(endpoint.worker_id, endpoint.dp_rank, count.prefill_tokens,
                             count.decode_blocks + prompt_blocks, count.requests)

    # --- the queue ---------------------------------------------------------------------------

    def _has_capacity(self) -> bool:
        """Whether some rank looked open at the last look (a pick, or a load refresh while
        requests wait): the queue releases its next request then, which looks again."""
        return any(not self._rank_busy.get(endpoint.rank_key, False) for endpoint in self.pool)

    def _busy_by_load(self, endpoint: PoolEndpoint, prefill_tokens: int, decode_blocks: int) -> bool:
        """`score_ranks`' busy rule and the queue threshold, from a rank's current load (a new
        request would add at least one decode block)."""
        config = self.router_config
        capacity = endpoint.max_num_batched_tokens
        frac = config.active_prefill_tokens_threshold_frac
        queue = self.settings.queue_threshold
        return bool(
            (config.active_decode_blocks_threshold is not None and decode_blocks + 1 > config.active_decode_blocks_threshold)
            or (config.active_prefill_tokens_threshold is not None and prefill_tokens > config.active_prefill_tokens_threshold)
            or (frac is not None and prefill_tokens > frac * capacity)
            or (queue is not None and prefill_tokens > queue * capacity))

    async def _wait_in_queue(self, request: RequestInfo, isl: int, arrival: float, deadline: float) -> None:
        item = QueuedRequest(request_id=request.request_id, isl_tokens=isl, arrival=arrival,
                             priority_jump=self._priority(request), deadline=deadline, payload=None)
        self._ensure_refresher()
        self.metrics.queue_depth.set(self._queue.depth + 1)
        try:
            await self._queue.wait_turn(item)
        except ValueError:
            raise PickError(409, f"a request with x-request-id {request.request_id!r} is already waiting") from None
        except QueueRefused as refused:
            raise PickError(429, f"not routed: {refused.reason}", {DROPPED_REASON_HEADER: refused.reason}) from None
        finally:
            self.metrics.queue_depth.set(self._queue.depth)

    def _priority(self, request: RequestInfo) -> float:
        """Seconds a request may jump ahead (Dynamo's latency_sensitivity), from a header."""
        value = request.headers.get(self.settings.priority_header)
        if value is None:
            return 0.0
        try:
            jump = float(value)
        except ValueError:
            raise PickError(400, f"{self.settings.priority_header} must be a number of seconds, not {value!r}") from None
        if not jump >= 0 or jump == float("inf"):
            raise PickError(400, f"{self.settings.priority_header} must be a finite number >= 0")
        return jump

    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_loads())

    async def _refresh_loads(self) -> None:
        """While requests wait, re-read the loads (other pickers' requests end too) and poke."""
        while self._queue.depth:
            try:
                for load in await self.slot_tracker.loads():
                    rank = (load.worker_id, load.dp_rank)
                    self._last_loads[rank] = load.active_prefill_tokens
                    endpoint = self._by_rank.get(rank)
                    if endpoint is not None:
                        self._rank_busy[rank] = self._busy_by_load(endpoint, load.active_prefill_tokens,
                                                                   load.active_decode_blocks)
                self._slot_tracker_state.ok()
            except ServiceCallError as error:
                self._slot_tracker_state.failed(error, "by overlap and this picker's own in-flight counts")
                for endpoint in self.pool:  # by this picker's own counts meanwhile
                    count = self.in_flight.get(endpoint.rank_key)
                    self._rank_busy[endpoint.rank_key] = self._busy_by_load(endpoint, count.prefill_tokens,
                                                                            count.decode_blocks)
            self._queue.poke()
            await asyncio.sleep(LOAD_REFRESH_SECS)

    # --- booking ------------------------------------------------------------------------------

    def _book(self, request: RequestInfo, tenant: str, ordered: list[RankCost],
              by_rank: dict[tuple[int, int], PoolEndpoint], seq: list[int], local: list[int], isl: int,
              block_size: int, outcome: str) -> Pick:
        chosen = ordered[0]
        endpoint = by_rank[(chosen.worker_id, chosen.dp_rank)]
        target = BookingTarget(endpoint.worker_id, endpoint.dp_rank, endpoint.address)
        addresses = [endpoint.address]
        fallbacks: dict[str, BookingTarget] = {}
        for cost in ordered[1:]:
            if len(addresses) > self.settings.fallbacks:
                break
            other = by_rank[(cost.worker_id, cost.dp_rank)]
            if other.address not in addresses:
                addresses.append(other.address)
                fallbacks[other.address] = BookingTarget(other.worker_id, other.dp_rank, other.address)
        self.metrics.fallbacks.inc(len(addresses) - 1)
        request_id = request.request_id or uuid.uuid4().hex
        tracker_up = outcome in ("kv", "load_only")
        booking = Booking(
            slot_tracker=self.slot_tracker if tracker_up else None, metrics=self.metrics, in_flight=self.in_flight,
            request_id=request_id, model=endpoint.model, tenant_id=tenant, target=target, fallbacks=fallbacks,
            sequence_hashes=seq, new_prefill_tokens=max(isl - chosen.cached_tokens, 0), block_size=block_size,
            on_end=lambda: self._ended(request_id),
        )
        self.bookings[request_id] = booking
        if endpoint.kv_events_endpoint is None and outcome in ("kv", "overlap_only"):
            asyncio.get_running_loop().create_task(self._record(endpoint, local, tenant))
        headers = {
            "x-data-parallel-rank": str(endpoint.dp_rank),  # vLLM's header: the rank behind one server
            "x-dynamo-worker-instance-id": str(endpoint.worker_id),
            "x-dynamo-dp-rank": str(endpoint.dp_rank),
            "x-dynamo-routing-mode": outcome,
            "x-request-id": request_id,
        }
        logger.debug("request %s -> %s (%s)", request_id, endpoint.address,
                     chosen.formula(self.router_config.overlap_score_weight),
                     extra={"fields": {"request_id": request_id, "endpoint": endpoint.address, "outcome": outcome}})
        return Pick(endpoints=addresses, headers=headers, tracker=booking)

    async def _record(self, endpoint: PoolEndpoint, local: list[int], tenant: str) -> None:
        """An engine without KV events: the indexer approximates its cache from the picks."""
        try:
            await self.indexer.routed(endpoint.worker_id, endpoint.model, local, dp_rank=endpoint.dp_rank,
                                      tenant_id=tenant)
        except ServiceCallError as error:
            self.metrics.lifecycle_failures.labels("routed").inc()
            logger.debug("/routed for %s failed: %s", endpoint.address, error)

    def _ended(self, request_id: str) -> None:
        booking = self.bookings.pop(request_id, None)
        self._queue.poke()
        if booking is not None:
            task = asyncio.get_running_loop().create_task(booking.settled())
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def settle(self) -> None:
        """End every booking still open (shutdown) and wait for all their calls (`/free`)."""
        for booking in list(self.bookings.values()):
            booking.end("cancelled")
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)


__all__ = ["DROPPED_REASON_HEADER", "KvPicker", "PickerSettings"]
