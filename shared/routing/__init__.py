"""KV-aware worker selection for a gateway, on top of the two services.

Per LLM request a gateway makes two reads, concurrently, then one write:

1. indexer `POST /query_by_hash` with the prompt's local block hashes → cached tokens per
   (instance, dp_rank);
2. slot tracker `POST /potential_loads` with the prompt's chained sequence hashes → each rank's
   active prefill tokens, projected decode blocks and active requests;
3. slot tracker `POST /add` on the chosen rank (then `/prefill_complete` at the first output
   token, `/output_blocks` every `block_size` generated tokens and `/free` at the end, through
   the returned `RequestHandle`); when the chosen rank's engine publishes no KV events, indexer
   `POST /routed` with the prompt's local hashes at the same time (approximate indexing).

The choice is the scheduling cycle of `dynamo_lite.routing.scheduling`, the one the endpoint picker and
the simulator run too. Its default cost predicts time: per rank, the seconds until the request's
first token (the prefill queued there plus its own uncached tokens at the engine's prefill rate,
plus the running decode batch's share of those steps) plus what its cache writes will cost later
requests (`docs/routing.md`). `RouterConfig` is Dynamo's KV router cost instead:
`overlap_score_weight * prefill_blocks + decode_blocks`, softmax at `router_temperature`.

`read_ranks` (the two reads, and what each kind of answer means) is shared with the picker;
`KvRouter` adds the booking calls and feeds the scheduler what it learns from them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    OverlapScores,
    PotentialLoad,
    ServiceCallError,
    ServiceStatusError,
)
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list

from .scheduling import (
    AllBusy,  # noqa: F401 - raised by select: importable from here, as it was
    BusyThresholds,
    NoWorkerAvailable,
    RankCost,
    RankInfo,
    RankState,
    Scheduler,
    SchedulerConfig,
    SchedulingRequest,
    Selection,
    dynamo_config,
)
from .scheduling.model import RankKey

_logger = logging.getLogger("dynamo_lite.routing")

DEFAULT_SOURCES_REFRESH_SECS = 5.0
"""How long `KvRouter` trusts what the indexer's `/workers` said about each rank's `source`."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Dynamo 1.6.1's KV router settings: its cost, temperature and busy thresholds.

    `overlap_score_weight` multiplies the prefill blocks in the cost (0 ignores the cache);
    `router_temperature` 0 takes the cheapest rank, higher values spread requests more
    randomly. Both must be finite and >= 0 (ValueError otherwise). `KvRouter(config=RouterConfig(...))`
    routes with Dynamo's cost; without a config it uses the default cost (`docs/routing.md`).
    """

    overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    # A rank is busy, so not a candidate, when its decode blocks with this request would exceed
    # the first threshold or its active prefill tokens exceed the second (None: no limit).
    active_decode_blocks_threshold: int | None = None
    active_prefill_tokens_threshold: int | None = None
    # ... or, as Dynamo's --active-prefill-tokens-threshold-frac, when its active prefill tokens
    # exceed this fraction of the rank's max_num_batched_tokens.
    active_prefill_tokens_threshold_frac: float | None = None

    def __post_init__(self) -> None:
        if self.overlap_score_weight < 0 or not math.isfinite(self.overlap_score_weight):
            raise ValueError("overlap_score_weight must be a finite number >= 0")
        if self.router_temperature < 0 or not math.isfinite(self.router_temperature):
            raise ValueError("router_temperature must be a finite number >= 0")
        self.busy_thresholds()  # validates them

    def busy_thresholds(self) -> BusyThresholds:
        """The three thresholds, as the scheduling cycle's busy filter takes them."""
        return BusyThresholds(self.active_decode_blocks_threshold, self.active_prefill_tokens_threshold,
                              self.active_prefill_tokens_threshold_frac)

    def scheduler_config(self) -> SchedulerConfig:
        """These settings as a scheduling cycle (the `dynamo` cost)."""
        return dynamo_config(self.overlap_score_weight, self.router_temperature, self.busy_thresholds())


# --- the two reads ---------------------------------------------------------------------------------


@dataclass(slots=True)
class RankReadings:
    """What the two services answered for one request.

    `cached`: matched tokens per rank (empty when the indexer knows nothing of the model: its
    404); `loads`: the slot tracker's `/potential_loads` rows (empty when it knows no worker of
    the model: its 404). `indexer_error` / `tracker_error`: the failed call, when one failed (a
    `ServiceCallError`: unreachable, or an answer other than 200 and 404); its reading is then
    empty too.
    """

    cached: dict[RankKey, int] = field(default_factory=dict)
    loads: list[PotentialLoad] = field(default_factory=list)
    indexer_error: ServiceCallError | None = None
    tracker_error: ServiceCallError | None = None
    seconds: float = 0.0

    def rank_loads(self, ranks: Sequence[RankKey] | None = None) -> list[RankState]:
        """The slot tracker's rows joined with the cached tokens, as the scheduler reads them;
        with `ranks`, only those (in the slot tracker's order)."""
        cached = self.cached
        wanted = None if ranks is None else set(ranks)
        return [RankState(row.worker_id, row.dp_rank, cached.get((row.worker_id, row.dp_rank), 0),
                         row.potential_prefill_tokens, row.potential_decode_blocks, row.active_requests)
                for row in self.loads if wanted is None or (row.worker_id, row.dp_rank) in wanted]


async def read_ranks(
    slot_tracker: AsyncSlotTrackerClient,
    indexer: AsyncIndexerClient,
    model_name: str,
    tenant_id: str,
    local_hashes: Sequence[int],
    sequence_hashes: Sequence[int],
) -> RankReadings:
    """Both reads, concurrently. A 404 is an answer (nothing cached; no worker registered), any
    other failure is kept in the readings for the caller to decide (`KvRouter` raises it, the
    picker routes without that service)."""
    started = time.perf_counter()
    overlap, loads = await asyncio.gather(
        indexer.query_by_hash(model_name, local_hashes, tenant_id=tenant_id),
        slot_tracker.potential_loads(model_name, sequence_hashes, 0, tenant_id=tenant_id),
        return_exceptions=True,
    )
    readings = RankReadings(seconds=time.perf_counter() - started)
    if isinstance(overlap, OverlapScores):
        readings.cached = overlap.scores
    elif isinstance(overlap, ServiceStatusError) and overlap.status == 404:
        pass  # no worker published anything for this model yet
    elif isinstance(overlap, ServiceCallError):
        readings.indexer_error = overlap
    elif isinstance(overlap, BaseException):
        raise overlap
    if isinstance(loads, list):
        readings.loads = loads
    elif isinstance(loads, ServiceStatusError) and loads.status == 404:
        pass  # the slot tracker knows no worker of this model
    elif isinstance(loads, ServiceCallError):
        readings.tracker_error = loads
    elif isinstance(loads, BaseException):
        raise loads
    return readings


# --- the router --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Decision:
    """The rank `KvRouter.select` chose, with what `commit` needs to book it.

    `costs` holds every candidate's breakdown (`RankCost.formula()` writes one out), `selection`
    the scheduling cycle's whole answer, `lookup_secs` how long the two service reads took.
    """

    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    isl_tokens: int
    sequence_hashes: list[int]
    costs: list[RankCost]
    selection: Selection
    request: SchedulingRequest
    lookup_secs: float
    local_hashes: list[int] = field(default_factory=list)  # what /routed records, if it is called
    decided_at: float = field(default_factory=time.monotonic)

    @property
    def chosen(self) -> RankCost:
        """The cost breakdown of the chosen rank."""
        return next(c for c in self.costs if (c.worker_id, c.dp_rank) == (self.worker_id, self.dp_rank))


@dataclass(slots=True)
class RequestHandle:
    """A booked request: call `prefill_complete()` at the first output token, `output_blocks(n)`
    each time its output fills a block, `free()` at the end. The router's scheduler learns from
    them (the time to the first token, the blocks the answer wrote)."""

    slot_tracker: AsyncSlotTrackerClient
    decision: Decision
    request_id: str
    scheduler: Scheduler | None = None
    prefilled: bool = field(default=False)
    freed: bool = field(default=False)
    generated_blocks: int = field(default=0)

    async def prefill_complete(self) -> None:
        """Tell the slot tracker the first token is out (once; a no-op after `free()`)."""
        if not self.prefilled and not self.freed:
            self.prefilled = True
            if self.scheduler is not None:
                self.scheduler.first_token(self.decision.chosen, time.monotonic() - self.decision.decided_at)
            await self.slot_tracker.prefill_complete(
                self.decision.model_name, self.request_id, tenant_id=self.decision.tenant_id
            )

    async def output_blocks(self, count: int) -> None:
        """Tell the slot tracker the request has generated `count` full blocks so far (call it
        every `block_size` tokens; a no-op after `free()`)."""
        if not self.freed:
            self.generated_blocks = max(self.generated_blocks, count)
            await self.slot_tracker.output_blocks(
                self.decision.model_name, self.request_id, count, tenant_id=self.decision.tenant_id
            )

    async def free(self) -> None:
        """Tell the slot tracker the request ended (once); call it on errors and cancellation too."""
        if not self.freed:
            self.freed = True
            if self.scheduler is not None and self.generated_blocks:
                block_size = self.decision.request.block_size
                self.scheduler.ended((self.decision.worker_id, self.decision.dp_rank),
                                     self.generated_blocks * block_size, block_size)
            await self.slot_tracker.free(self.decision.model_name, self.request_id, tenant_id=self.decision.tenant_id)


class KvRouter:
    """Selects a (worker_id, dp_rank) per request from the indexer's and slot tracker's answers.

    `block_size` is the model's tokens per KV block (as its workers registered). `config`: a
    `SchedulerConfig` (default: `dynamo_lite.routing.scheduling.ttft_config()`, the cost in predicted
    time), or a `RouterConfig` for Dynamo's cost; or pass a ready `scheduler`. `seed` makes the
    tie-breaking and sampling reproducible; `rank_infos` gives ranks' KV capacity and step budget
    when known. One instance serves all of a gateway's concurrent requests for that block size.

    `record_routes` says when `commit` also records the decision on the indexer (`/routed`,
    approximate indexing): None (the default) when the chosen rank's engine publishes no KV
    events, i.e. the indexer knows the partition and its `/workers` does not say `source:
    "events"` for the rank (read at most every `sources_refresh_secs` per model and tenant);
    True always; False never.
    """

    def __init__(
        self,
        slot_tracker: AsyncSlotTrackerClient,
        indexer: AsyncIndexerClient,
        *,
        block_size: int,
        config: SchedulerConfig | RouterConfig | None = None,
        scheduler: Scheduler | None = None,
        seed: int | None = None,
        record_routes: bool | None = None,
        sources_refresh_secs: float = DEFAULT_SOURCES_REFRESH_SECS,
        rank_infos: Mapping[RankKey, RankInfo] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if not sources_refresh_secs >= 0:
            raise ValueError("sources_refresh_secs must be >= 0")
        if scheduler is not None and config is not None:
            raise ValueError("pass a config or a scheduler, not both")
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self.block_size = block_size
        if scheduler is None:
            scheduler_config = config.scheduler_config() if isinstance(config, RouterConfig) else config
            scheduler = Scheduler(scheduler_config, seed=seed)
        self.scheduler = scheduler
        self.rank_infos: dict[RankKey, RankInfo] = dict(rank_infos or {})
        self.record_routes = record_routes
        self.sources_refresh_secs = sources_refresh_secs
        # (model_name, tenant_id) -> (read at, monotonic; {(instance_id, dp_rank): source})
        self._sources: dict[tuple[str, str], tuple[float, dict[tuple[int, int], str]]] = {}

    @property
    def config(self) -> SchedulerConfig:
        """The scheduling cycle's configuration in force."""
        return self.scheduler.config

    def hashes_for(
        self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[list[int], list[int]]:
        """(local hashes for the indexer, chained sequence hashes for the slot tracker), signed."""
        local = local_block_hashes(token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt)
        return to_signed_list(local), to_signed_list(sequence_hashes(local))

    async def select(
        self,
        model_name: str,
        *,
        isl_tokens: int,
        local_hashes: Sequence[int],
        sequence_hashes: Sequence[int],
        tenant_id: str = "default",
        overlap_score_weight: float | None = None,
        router_temperature: float | None = None,
        session_id: str | None = None,
        allowed_worker_ids: Sequence[int] | None = None,
        expected_output_tokens: int | None = None,
    ) -> Decision:
        """Query both services concurrently and pick a rank. Overrides apply to this call only
        (`overlap_score_weight` to Dynamo's cost only: ValueError with another); `session_id`
        keeps a conversation where its cache is; `allowed_worker_ids` limits the candidates;
        `expected_output_tokens` (the answer's expected length, `nvext.agent_hints.osl`) goes
        to the cost and, at `commit`, to the slot tracker, whose count of the answer's output
        blocks then decays toward it.

        Raises `NoWorkerAvailable` when no rank of the model is registered (or allowed) or all
        are busy, a `TransportError` when a service cannot be reached, and a
        `ServiceStatusError` when one answers another error (both are `ServiceCallError`s).
        """
        if overlap_score_weight is not None:
            if not (overlap_score_weight >= 0 and math.isfinite(overlap_score_weight)):
                raise ValueError("overlap_score_weight must be a finite number >= 0")
            if "prefill_blocks" not in self.config.weights:
                raise ValueError(f"overlap_score_weight applies to Dynamo's cost (RouterConfig), not to the "
                                 f"{self.config.cost!r} cost in force")
        if router_temperature is not None and not (router_temperature >= 0 and math.isfinite(router_temperature)):
            raise ValueError("router_temperature must be a finite number >= 0")
        readings = await read_ranks(self.slot_tracker, self.indexer, model_name, tenant_id, local_hashes,
                                    sequence_hashes)
        for error in (readings.tracker_error, readings.indexer_error):
            if error is not None:
                raise error
        loads = readings.rank_loads()
        if allowed_worker_ids is not None:
            allowed = set(allowed_worker_ids)
            loads = [load for load in loads if load.worker_id in allowed]
        if not loads:
            which = "is registered with the slot tracker" if allowed_worker_ids is None else \
                "among the allowed worker ids is registered with the slot tracker"
            raise NoWorkerAvailable(
                f"no rank can take the request: no worker of model {model_name!r} (tenant {tenant_id!r}) {which}")
        request = SchedulingRequest(isl_tokens, self.block_size, session_id=session_id, temperature=router_temperature,
                                    overlap_score_weight=overlap_score_weight,
                                    expected_output_tokens=expected_output_tokens)
        selection = self.scheduler.schedule(request, loads, self.rank_infos)
        chosen = selection.chosen
        return Decision(model_name, tenant_id, chosen.worker_id, chosen.dp_rank, isl_tokens,
                        list(sequence_hashes), selection.costs, selection, request, readings.seconds,
                        list(local_hashes))

    async def commit(self, decision: Decision, request_id: str) -> RequestHandle:
        """Book the chosen rank with `/add` (new prefill tokens = the prompt minus its cached part),
        and record the decision on the indexer (`record`) at the same time.

        A `ServiceStatusError` with status 404 from `/add` means the rank left since `select`:
        select again.
        """
        add = self.slot_tracker.add(
            decision.model_name, request_id, decision.worker_id, decision.dp_rank,
            decision.sequence_hashes, decision.isl_tokens - decision.chosen.cached_tokens,
            tenant_id=decision.tenant_id, expected_output_tokens=decision.request.expected_output_tokens,
        )
        await asyncio.gather(add, self.record(decision))
        self.scheduler.booked(decision.selection, decision.request, self.rank_infos,
                              rank=(decision.worker_id, decision.dp_rank))
        return RequestHandle(self.slot_tracker, decision, request_id, self.scheduler)

    async def record(self, decision: Decision) -> bool:
        """Record the decision on the indexer (`/routed`) if `record_routes` says so for its
        rank; returns whether it did. Called by `commit`; call it yourself only when booking
        the request some other way.

        A 404 (the indexer knows no such partition: register the workers there) is logged, not
        raised: the request is booked either way, and routing still works, without the
        approximation.
        """
        if not await self._records(decision):
            return False
        try:
            await self.indexer.routed(
                decision.worker_id, decision.model_name, decision.local_hashes,
                dp_rank=decision.dp_rank, tenant_id=decision.tenant_id,
            )
        except ServiceStatusError as exc:
            if exc.status != 404:
                raise
            _logger.warning("not recorded on the indexer: %s", exc.message)
            return False
        return True

    async def _records(self, decision: Decision) -> bool:
        if self.record_routes is not None:
            return self.record_routes
        key = (decision.model_name, decision.tenant_id)
        known = self._sources.get(key)
        now = time.monotonic()
        if known is None or now - known[0] >= self.sources_refresh_secs:
            instances = await self.indexer.workers(*key)
            sources = {(info.instance_id, rank.dp_rank): rank.source for info in instances for rank in info.ranks}
            known = (now, sources)
            self._sources[key] = known
        sources = known[1]
        # An empty partition is one the indexer does not know: nothing to record into.
        return bool(sources) and sources.get((decision.worker_id, decision.dp_rank)) != "events"


# NoWorkerAvailable, AllBusy and RankCost, which `select` raises and returns, are importable from
# here too; they are `dynamo_lite.routing.scheduling`'s, and listed there.
__all__ = ["DEFAULT_SOURCES_REFRESH_SECS", "Decision", "KvRouter", "RankReadings", "RequestHandle", "RouterConfig",
           "read_ranks"]
