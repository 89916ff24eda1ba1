"""The KV-aware pick: which engine of the pool serves a request, from the two services' answers.

Per request (`KvPicker.pick`):

1. the body must be JSON naming a `model` (400); the candidates are the pool's ranks serving
   that model (as its name or one of its LoRA adapters), within the gateway's subset hint
   (none: 503);
2. the prompt's token ids (`prompt.PromptReader`) become local block hashes (for the indexer)
   and chained sequence hashes (for the slot tracker), computed here: a `/query_by_hash` is
   cheaper for the indexer than hashing a `/query`'s token ids itself (bench.gateway);
3. the indexer's overlap and the slot tracker's `/potential_loads` are read concurrently
   (`dynamo_lite.routing.read_ranks`; with `--state in-process`, the picker's own cores, read
   synchronously: `state.LocalState`) and the scheduling cycle chooses (`dynamo_lite.routing.scheduling`,
   the one `KvRouter` and the simulator run): by default the rank with the least predicted time
   to first token plus cache-write cost, or Dynamo's `overlap_weight * prefill_blocks +
   decode_blocks` with `--cost dynamo`; busy thresholds take ranks out; a session header keeps a
   conversation where its cache is;
4. when every candidate is busy (or past `queue_threshold` x its max_num_batched_tokens of
   active prefill), the request waits in the queue (fcfs / wspt, priority from a header) until
   one has room, or is refused with 429 and `x-dynamo-lite-dropped-reason`;
5. the pick and its fallbacks (the next cheapest ranks) go back to the gateway; the request is
   booked (`booking.Booking`), and the scheduler learns from its first token (the engine's
   speed) and its end (the blocks its answer wrote). An answer the gateway stops showing after
   its first chunk (the access-log configuration) has its output re-estimated every
   `output_estimate_secs` from its engine's decode step.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient, ServiceCallError, ServiceStatusError
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list
from dynamo_lite.routing import RankReadings
from dynamo_lite.routing.scheduling import (
    AllBusy,
    BusyThresholds,
    RankCost,
    RankInfo,
    RankState,
    Scheduler,
    SchedulerConfig,
    SchedulingRequest,
    Selection,
    ttft_config,
)
from dynamo_lite.routing.scheduling.cycle import FILTER_BUSY, FILTER_SATURATED
from dynamo_lite.routing.scheduling.model import RankKey

from .booking import Booking, BookingTarget, InFlight
from .disagg import PREFILLER_HEADER, DisaggSettings, PrefillChoice, PrefillRank, choose_prefill
from .endpoint import PREFILL, PoolEndpoint
from .metrics import EppMetrics
from .prompt import PromptReader, parse_body
from .protocol import NullTracker, Pick, PickError, RequestInfo
from .queue import AdmissionQueue, QueuedRequest, QueuePolicy, QueueRefused, RequestQueue
from .state import PickerState, RemoteState

logger = logging.getLogger("dynamo_lite.epp")

DROPPED_REASON_HEADER = "x-dynamo-lite-dropped-reason"
DEFAULT_PRIORITY_HEADER = "x-request-priority"
DEFAULT_SESSION_HEADER = "x-session-id"
# With no engine reporting its context length: 2^20 tokens, whose 65,536 hashes of 16-token
# blocks keep each service call (~1.4 MB) under the services' 2 MiB body limit.
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
DEFAULT_FALLBACKS = 2
LOAD_REFRESH_SECS = 0.05  # while requests wait in the queue, how often the loads are re-read
DEFAULT_OUTPUT_ESTIMATE_SECS = 1.0
PREFILL_BOOKING_SUFFIX = ":prefill"  # the slot tracker id of a disaggregated request's prefill booking


@dataclass(frozen=True, slots=True)
class PickerSettings:
    scheduler: SchedulerConfig = ttft_config()
    # Requests wait while every candidate's active prefill exceeds this fraction of its
    # max_num_batched_tokens (Dynamo's --router-queue-threshold); None: refuse at once instead.
    queue_threshold: float | None = 2.0
    queue_policy: QueuePolicy = QueuePolicy.FCFS
    queue_max_wait_secs: float = 30.0
    queue_max_size: int = 1024
    priority_header: str = DEFAULT_PRIORITY_HEADER
    # A request header naming the conversation (session affinity); None: sessions off.
    session_header: str | None = DEFAULT_SESSION_HEADER
    # Prompts longer than this are refused (400) before any service is asked; None: the shortest
    # context length the candidate engines report (their /v1/models), else DEFAULT_MAX_PROMPT_TOKENS.
    max_prompt_tokens: int | None = None
    fallbacks: int = DEFAULT_FALLBACKS
    seed: int | None = None
    # How often the output of answers the gateway no longer shows (the access-log configuration)
    # is re-estimated, and so how often each sends /output_blocks while its estimate grows.
    output_estimate_secs: float = DEFAULT_OUTPUT_ESTIMATE_SECS
    # When a request is prefilled on a prefill endpoint (pools with `role: prefill`; disagg.py).
    disagg: DisaggSettings = DisaggSettings()


def expected_output_tokens(data: dict[str, Any]) -> int | None:
    """The answer's expected length the client gives in `nvext.agent_hints.osl` (an integer
    count of tokens, 0..2^32-1 as Dynamo's u32); None when absent. PickError 400 when it is
    there but not such an integer."""
    nvext = data.get("nvext")
    if not isinstance(nvext, dict):
        return None
    hints = nvext.get("agent_hints")
    if not isinstance(hints, dict) or hints.get("osl") is None:
        return None
    osl = hints["osl"]
    if isinstance(osl, bool) or not isinstance(osl, int) or not 0 <= osl < 1 << 32:
        raise PickError(400, f"nvext.agent_hints.osl must be an integer count of tokens in 0..2^32-1, got {osl!r}",
                        code="invalid_request")
    return osl


def max_output_tokens(data: dict[str, Any]) -> int | None:
    """The request's cap on its answer (`max_completion_tokens`, else `max_tokens`); None: none."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


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
        slot_tracker: AsyncSlotTrackerClient | None = None,
        indexer: AsyncIndexerClient | None = None,
        prompts: PromptReader,
        metrics: EppMetrics,
        settings: PickerSettings = PickerSettings(),
        state: PickerState | None = None,
    ) -> None:
        """`state`: where to read and book (`state.LocalState` in process); by default the two
        services through `slot_tracker` and `indexer`."""
        if state is None:
            assert slot_tracker is not None and indexer is not None, "the services' clients, or a state"
            state = RemoteState(slot_tracker, indexer)
        self.state = state
        self.prompts = prompts
        self.metrics = metrics
        self.settings = settings
        self.scheduler = Scheduler(settings.scheduler, seed=settings.seed, saturation_threshold=settings.queue_threshold)
        self.rng = random.Random(settings.seed)
        self.in_flight = InFlight()
        self.bookings: dict[str, Booking] = {}
        self.prefill_bookings: dict[str, Booking] = {}  # request id -> the prefill half of a disaggregated one
        # Whether a prefill endpoint (by address) answers: the app sets it to `PrefillHealth.up`.
        self.prefill_up: Callable[[str], bool] = lambda address: True
        self._round_robin = itertools.count()
        self._slot_tracker_state = _Streak("slot tracker", metrics)
        self._indexer_state = _Streak("indexer", metrics)
        self._rank_busy: dict[tuple[int, int], bool] = {}  # busy or saturated at the last look
        self.context_lengths: dict[str, int] = {}  # engine address -> its max_model_len
        self._infos: dict[RankKey, RankInfo] = {}
        self._queue = AdmissionQueue(RequestQueue(settings.queue_policy, settings.queue_max_size), self._has_capacity)
        self._refresher: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[None]] = set()  # ended bookings whose calls are still going out
        self._unobserved: set[Booking] = set()  # answers whose output is estimated, not counted
        self._estimator: asyncio.Task[None] | None = None
        self.pool: list[PoolEndpoint] = []
        self._by_rank: dict[RankKey, PoolEndpoint] = {}
        self.set_pool(pool)

    # --- the pool and run-time settings ----------------------------------------------------------

    def set_pool(self, pool: Sequence[PoolEndpoint]) -> None:
        gone = set(self._by_rank) - {endpoint.rank_key for endpoint in pool}
        self.pool = list(pool)
        self._by_rank = {endpoint.rank_key: endpoint for endpoint in self.pool}
        self._infos = {endpoint.rank_key: RankInfo(endpoint.worker_id, endpoint.dp_rank, endpoint.total_kv_blocks,
                                                   endpoint.max_num_batched_tokens) for endpoint in self.pool}
        if gone:
            self.scheduler.forget(gone)
        self._queue.poke()

    def _info(self, endpoint: PoolEndpoint) -> RankInfo:
        """What the scheduler knows of an endpoint's rank (one the pool has just dropped: its file's values)."""
        return self._infos.get(endpoint.rank_key) or RankInfo(endpoint.worker_id, endpoint.dp_rank,
                                                              endpoint.total_kv_blocks, endpoint.max_num_batched_tokens)

    def set_context_length(self, address: str, tokens: int) -> None:
        """An engine reported its context length (vLLM's `max_model_len`)."""
        self.context_lengths[address] = tokens

    def _max_prompt_tokens(self, candidates: Sequence[PoolEndpoint]) -> int:
        if self.settings.max_prompt_tokens is not None:
            return self.settings.max_prompt_tokens
        known = [self.context_lengths[e.address] for e in candidates if e.address in self.context_lengths]
        return min(known) if known else DEFAULT_MAX_PROMPT_TOKENS

    @property
    def busy_thresholds(self) -> BusyThresholds:
        return self.scheduler.config.busy

    def set_thresholds(self, **thresholds: Any) -> BusyThresholds:
        """Busy thresholds at run time (`POST /busy_threshold`); ValueError for a bad value."""
        busy = self.scheduler.set_busy_thresholds(**thresholds)
        self._rank_busy.clear()  # judged again at the next look
        self._queue.poke()
        return busy

    def scheduler_state(self) -> dict[str, Any]:
        """What `GET /scheduler` shows: the configuration and, per rank of the pool, what the
        scheduler has learned."""
        scheduler = self.scheduler
        config = scheduler.config
        ranks = []
        for endpoint in self.pool:
            key = endpoint.rank_key
            timing = scheduler.rates.timing(key)
            speed = scheduler.rates.speed(key)
            ranks.append({
                "address": endpoint.address, "worker_id": endpoint.worker_id, "dp_rank": endpoint.dp_rank,
                "kv_capacity_blocks": endpoint.total_kv_blocks or scheduler.capacities.get(key),
                "prefill_secs_per_token": timing.prefill_secs_per_token, "decode_step_secs": timing.decode_step_secs,
                "speed_factor": scheduler.rates.factor(key),
                "ttft_observations": speed.observations if speed is not None else 0,
                "recent_write_blocks": scheduler.writes.written(key),
            })
        return {
            "config": {"cost": config.cost, "scorers": dict(config.scorers), "temperature": config.temperature,
                       "busy": {name: getattr(config.busy, name) for name in (
                           "active_decode_blocks_threshold", "active_prefill_tokens_threshold",
                           "active_prefill_tokens_threshold_frac")},
                       "kv_capacity_filter": config.kv_capacity_filter, "session_ttl_secs": config.session_ttl_secs,
                       "learn_rates": config.learn_rates, "saturation_threshold": scheduler.saturation_threshold},
            "sessions": len(scheduler.sessions),
            "overhead_secs": scheduler.rates.fleet.overhead_secs,
            "ranks": ranks,
        }

    async def aclose(self) -> None:
        self._queue.close()
        for task in (self._refresher, self._estimator):
            if task is not None:
                task.cancel()
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
        serving = self._candidates(model, request.subset)
        # The destination is a decode (or aggregated) endpoint; prefill endpoints only prefill.
        candidates = [endpoint for endpoint in serving if endpoint.role != PREFILL]
        if not candidates:
            raise PickError(503, f"no decode or aggregated endpoint serves {model!r} (only prefill endpoints)")
        block_size = candidates[0].block_size
        candidates = [endpoint for endpoint in candidates if endpoint.block_size == block_size]
        prompt = await self.prompts.read(request.path, data, self._max_prompt_tokens(candidates))
        lora_name = model if model != candidates[0].model else None
        tenant = candidates[0].tenant_id
        pool_prefills = [endpoint for endpoint in serving if endpoint.role == PREFILL
                         and endpoint.block_size == block_size and endpoint.model == candidates[0].model
                         and endpoint.tenant_id == tenant]
        prefills = [endpoint for endpoint in pool_prefills if self.prefill_up(endpoint.address)]
        local = local_block_hashes(prompt.token_ids, block_size, lora_name=lora_name)
        # The hashes are u64 by construction: the list form converts only those past i64 (a
        # quarter of the 33 us the per-hash function took for 4,096 tokens).
        signed_local = to_signed_list(local)
        signed_seq = to_signed_list(sequence_hashes(local))
        isl = len(prompt.token_ids)
        session = request.headers.get(self.settings.session_header) if self.settings.session_header else None
        scheduling = SchedulingRequest(isl, block_size, session_id=session or None,
                                       expected_output_tokens=expected_output_tokens(data))
        queued = False
        arrival = deadline = 0.0
        try:
            while True:
                selection, outcome, prefill_ranks = await self._select(
                    scheduling, candidates, candidates[0].model, tenant, signed_local, signed_seq, prefills)
                if selection is not None:
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
            ordered = self._rotate(selection.ordered) if outcome == "round_robin" else selection.ordered
            self.metrics.decisions.labels(outcome).inc()
            # The candidates as they were when the pick began: a pool re-read meanwhile does not
            # take an endpoint from under a decision made with it.
            by_rank = {endpoint.rank_key: endpoint for endpoint in candidates}
            # A pool with prefill endpoints, none of them up, counts as `no_prefill`.
            prefill = self._prefill_choice(isl, ordered[0], prefill_ranks) if pool_prefills else None
            return self._book(request, tenant, ordered, by_rank, signed_seq, signed_local, isl, block_size, outcome,
                              selection, scheduling, max_output_tokens(data), prefill)
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
            raise PickError(404, f"The model {model!r} does not exist: no endpoint of this gateway serves it",
                            code="model_not_found")
        if subset is not None:
            allowed = set(subset)
            serving = [endpoint for endpoint in serving if endpoint.address in allowed]
            if not serving:
                raise PickError(503, "no endpoint of the subset hint serves this model")
        return serving

    def _rotate(self, costs: list[RankCost]) -> list[RankCost]:
        ordered = sorted(costs, key=lambda c: (c.worker_id, c.dp_rank))
        start = next(self._round_robin) % len(ordered)
        return ordered[start:] + ordered[:start]

    async def _select(self, request: SchedulingRequest, candidates: list[PoolEndpoint], model: str, tenant: str,
                      local: list[int], seq: list[int],
                      prefills: list[PoolEndpoint]) -> tuple[Selection | None, str, list[PrefillRank]]:
        """Read both services and run the scheduling cycle over the candidates; (None, outcome)
        when every candidate is busy or saturated (the caller queues the request). The same
        readings give the `prefills`' cached tokens and booked prefill (none: an empty list)."""
        readings = await self.state.read(model, tenant, local, seq)
        for error in (readings.indexer_error, readings.tracker_error):
            if isinstance(error, ServiceStatusError) and error.status == 413:
                # The request's fault, not an outage: routing goes on for the next one.
                raise PickError(413, f"the prompt is too large to route: {error.message}", code="request_too_large")
        indexer_up = self._read_overlap(readings)
        loads, tracker_up = self._read_loads(readings, candidates, len(seq))
        if indexer_up and tracker_up:
            outcome = "kv"
        elif tracker_up:
            outcome = "load_only"
        elif indexer_up:
            outcome = "overlap_only"
        else:
            outcome = "round_robin"
        try:
            selection = self.scheduler.schedule(request, loads, self._infos)
        except AllBusy as busy:
            self._note_busy(busy.costs)
            return None, outcome, []
        self._note_busy(selection.costs)
        return selection, outcome, self._prefill_ranks(readings, prefills, tracker_up) if prefills else []

    def _prefill_ranks(self, readings: RankReadings, prefills: list[PoolEndpoint],
                       tracker_up: bool) -> list[PrefillRank]:
        """The prefill endpoints' cached tokens (indexer) and booked prefill (slot tracker; this
        picker's own counts for a rank it does not list, or while it is away)."""
        booked = {row.key: row.active_prefill_tokens
                  for row in readings.rank_loads([endpoint.rank_key for endpoint in prefills])} if tracker_up else {}
        return [PrefillRank(endpoint, readings.cached.get(endpoint.rank_key, 0),
                            booked.get(endpoint.rank_key, self.in_flight.get(endpoint.rank_key).prefill_tokens))
                for endpoint in prefills]

    def _prefill_choice(self, isl: int, chosen: RankCost, ranks: list[PrefillRank]) -> PrefillChoice | None:
        """Whether the request is prefilled on a prefill endpoint, and which (disagg.py); the
        ranks rotated so that equal ones take turns."""
        if ranks:
            start = next(self._round_robin) % len(ranks)
            ranks = ranks[start:] + ranks[:start]
        choice, reason = choose_prefill(
            isl, chosen.uncached_tokens, ranks, self.settings.disagg,
            busy=lambda rank: self.scheduler.config.busy.busy(self._info(rank.endpoint), rank.prefill_tokens, 0))
        self.metrics.disagg_decisions.labels(reason).inc()
        return choice

    def _note_busy(self, costs: list[RankCost]) -> None:
        for cost in costs:
            self._rank_busy[cost.key] = cost.filtered in (FILTER_BUSY, FILTER_SATURATED)

    def _read_overlap(self, readings: RankReadings) -> bool:
        if readings.indexer_error is not None:
            # A failed call, or an answer that does not read (not JSON, another shape).
            self._indexer_state.failed(readings.indexer_error, "by load alone")
            return False
        self._indexer_state.ok()  # a 404 too: nothing of this model indexed yet, no overlap anywhere
        return True

    def _read_loads(self, readings: RankReadings, candidates: list[PoolEndpoint],
                    prompt_blocks: int) -> tuple[list[RankState], bool]:
        """The candidates' loads: the slot tracker's rows for the ranks it lists; when it failed,
        or lists none of them (not registered there yet: its 404), this picker's own counts, and
        nothing is booked on the slot tracker."""
        cached = readings.cached
        if readings.tracker_error is not None:
            self._slot_tracker_state.failed(readings.tracker_error, "by overlap and this picker's own in-flight counts")
        else:
            self._slot_tracker_state.ok()
            loads = readings.rank_loads([endpoint.rank_key for endpoint in candidates])
            if loads:
                return loads, True
        return [self._own_load(endpoint, prompt_blocks, cached.get(endpoint.rank_key, 0)) for endpoint in candidates], False

    def _own_load(self, endpoint: PoolEndpoint, prompt_blocks: int, cached_tokens: int) -> RankState:
        count = self.in_flight.get(endpoint.rank_key)
        return RankState(endpoint.worker_id, endpoint.dp_rank, cached_tokens, count.prefill_tokens,
                        count.decode_blocks + prompt_blocks, count.requests)

    # --- the queue ---------------------------------------------------------------------------

    def _has_capacity(self) -> bool:
        """Whether some destination rank (not a prefill one) looked open at the last look (a
        pick, or a load refresh while requests wait): the queue releases its next request then,
        which looks again."""
        return any(not self._rank_busy.get(endpoint.rank_key, False) for endpoint in self.pool
                   if endpoint.role != PREFILL)

    def _busy_by_load(self, endpoint: PoolEndpoint, prefill_tokens: int, decode_blocks: int) -> bool:
        """The scheduler's busy and saturation filters, from a rank's current load (a new request
        would add at least one decode block)."""
        return self.scheduler.busy(self._infos[endpoint.rank_key], prefill_tokens, decode_blocks + 1)

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
                for load in await self.state.loads():
                    rank = (load.worker_id, load.dp_rank)
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
              block_size: int, outcome: str, selection: Selection, scheduling: SchedulingRequest,
              max_output: int | None, prefill: PrefillChoice | None = None) -> Pick:
        """Book the pick. Disaggregated (`prefill`), the decode rank is booked with the prompt's
        blocks (cached there once read from the prefill engine) and no prefill tokens, and the
        prefill rank beside it with the prompt's blocks and the tokens it does not cache, until
        the decode engine's first token (the prefill is done by then) or the request's end."""
        chosen = ordered[0]
        self.scheduler.booked(selection, scheduling, self._infos, rank=chosen.key)
        picked_at = time.monotonic()
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
            slot_tracker=self.state.booker if tracker_up else None, metrics=self.metrics, in_flight=self.in_flight,
            request_id=request_id, model=endpoint.model, tenant_id=tenant, target=target, fallbacks=fallbacks,
            sequence_hashes=seq, new_prefill_tokens=0 if prefill else max(isl - chosen.cached_tokens, 0),
            block_size=block_size, on_end=lambda: self._ended(request_id),
            on_prefilled=lambda: self._first_token(booking, chosen, picked_at),
            max_output_tokens=max_output, on_unobserved=self._estimate_from_now,
            expected_output_tokens=scheduling.expected_output_tokens,
        )
        self.bookings[request_id] = booking
        recorded = [endpoint]
        if prefill is not None:
            prefiller = prefill.endpoint
            self.prefill_bookings[request_id] = Booking(
                slot_tracker=booking.slot_tracker, metrics=self.metrics, in_flight=self.in_flight,
                request_id=request_id + PREFILL_BOOKING_SUFFIX, model=prefiller.model, tenant_id=tenant,
                target=BookingTarget(prefiller.worker_id, prefiller.dp_rank, prefiller.address), fallbacks={},
                sequence_hashes=seq, new_prefill_tokens=prefill.uncached_tokens, block_size=block_size,
                on_end=lambda: None, counted=False,
            )
            recorded.append(prefiller)
        for engine in recorded:
            if engine.kv_events_endpoint is None and outcome in ("kv", "overlap_only"):
                task = asyncio.get_running_loop().create_task(self._record(engine, local, tenant))
                self._settling.add(task)  # held until done: the loop keeps only weak references
                task.add_done_callback(self._settling.discard)
        headers = {
            "x-data-parallel-rank": str(endpoint.dp_rank),  # vLLM's header: the rank behind one server
            "x-dynamo-worker-instance-id": str(endpoint.worker_id),
            "x-dynamo-dp-rank": str(endpoint.dp_rank),
            "x-dynamo-routing-mode": outcome,
            "x-request-id": request_id,
        }
        remove: tuple[str, ...] = ()
        if prefill is not None:
            headers[PREFILLER_HEADER] = prefill.endpoint.address
        elif PREFILLER_HEADER in request.headers:
            remove = (PREFILLER_HEADER,)  # the picker decides where a request is prefilled, not its client
        if logger.isEnabledFor(logging.DEBUG):  # the formula is costly to write: only when it is logged
            logger.debug("request %s -> %s (%s)", request_id, endpoint.address, chosen.formula(),
                         extra={"fields": {"request_id": request_id, "endpoint": endpoint.address, "outcome": outcome}})
        return Pick(endpoints=addresses, headers=headers, tracker=booking, remove_headers=remove)

    async def _record(self, endpoint: PoolEndpoint, local: list[int], tenant: str) -> None:
        """An engine without KV events: the indexer approximates its cache from the picks."""
        try:
            await self.state.routed(endpoint, local, tenant)
        except ServiceCallError as error:
            self.metrics.lifecycle_failures.labels("routed").inc()
            logger.debug("/routed for %s failed: %s", endpoint.address, error)

    def _first_token(self, booking: Booking, chosen: RankCost, picked_at: float) -> None:
        """The engine's first token: the scheduler learns how long the rank took (unless the
        gateway served the request elsewhere, which the cost did not describe, or another engine
        prefilled it); a prefill engine's booking for it ends."""
        if self._end_prefill(booking.request_id):
            return
        if booking.target.rank == chosen.key:
            self.scheduler.first_token(chosen, time.monotonic() - picked_at)

    def _end_prefill(self, request_id: str) -> bool:
        """End a disaggregated request's prefill booking; False when it has none (any more)."""
        prefill = self.prefill_bookings.pop(request_id, None)
        if prefill is None:
            return False
        prefill.end("prefilled")
        task = prefill.last_call
        if task is not None and not task.done():
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        return True

    # --- answers the gateway no longer shows: their output estimated -------------------------

    def _estimate_from_now(self, booking: Booking) -> None:
        self._unobserved.add(booking)
        if self._estimator is None or self._estimator.done():
            self._estimator = asyncio.get_running_loop().create_task(self._estimate_outputs(), name="output-estimates")

    def _decode_step(self, rank: RankKey) -> float:
        """Seconds per token on `rank` now: its decode step as the scheduler has learned it, with
        the requests this picker runs there."""
        return self.scheduler.rates.timing(rank).decode_step_seconds(max(1, self.in_flight.get(rank).requests))

    async def _estimate_outputs(self) -> None:
        """Every `output_estimate_secs`, book each unobserved answer's output as estimated for the
        middle of the coming interval: the booked count is then as often above as below the
        answer's true output, and never by more than half an interval's tokens."""
        interval = self.settings.output_estimate_secs
        while self._unobserved:
            await asyncio.sleep(interval)
            at = time.monotonic() + interval / 2
            for booking in list(self._unobserved):
                booking.estimate_output(at, self._decode_step(booking.target.rank))
            self.metrics.output_estimates.inc(len(self._unobserved))

    def _ended(self, request_id: str) -> None:
        self._end_prefill(request_id)  # ended before its first token (cancelled, an error)
        booking = self.bookings.pop(request_id, None)
        self._queue.poke()
        if booking is not None:
            tokens = booking.output_tokens
            if booking in self._unobserved:
                self._unobserved.discard(booking)
                tokens = booking.estimated_tokens(time.monotonic(), self._decode_step(booking.target.rank))
            self.scheduler.ended(booking.target.rank, tokens, booking.block_size)
            # Its calls go out in one chain, /free last: that task done, the booking is settled.
            task = booking.last_call
            if task is not None and not task.done():
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

    async def settle(self) -> None:
        """End every booking still open (shutdown) and wait for all their calls (`/free`)."""
        for booking in list(self.bookings.values()):
            booking.end("cancelled")
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)


__all__ = ["DEFAULT_MAX_PROMPT_TOKENS", "DEFAULT_OUTPUT_ESTIMATE_SECS", "DROPPED_REASON_HEADER", "KvPicker",
           "PickerSettings", "expected_output_tokens", "max_output_tokens"]
