"""KV-aware worker selection for a gateway, on top of the two services.

Per LLM request a gateway makes two reads, concurrently, then one write:

1. indexer `POST /query_by_hash` with the prompt's local block hashes → cached tokens per
   (instance, dp_rank);
2. slot tracker `POST /potential_loads` with the prompt's chained sequence hashes → each rank's
   active prefill tokens and projected decode blocks;
3. slot tracker `POST /add` on the chosen rank (then `/prefill_complete` at the first output
   token, `/output_blocks` every `block_size` generated tokens and `/free` at the end, through
   the returned `RequestHandle`); when the chosen rank's engine publishes no KV events, indexer
   `POST /routed` with the prompt's local hashes at the same time (approximate indexing).

The cost of Dynamo's KV router decides (lower is better):
`cost = overlap_score_weight * prefill_blocks + decode_blocks`, where
`prefill_blocks = (active_prefill_tokens + isl_tokens - cached_tokens) / block_size` and
`decode_blocks = potential_decode_blocks`. Temperature 0 takes the cheapest rank (ties broken
by the seeded random generator); a positive temperature samples from a softmax over the costs
normalised to [0, 1], as Dynamo's `softmax_sample` does.

`score_ranks` and `choose` are pure functions; `KvRouter` only adds the HTTP calls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from .client import AsyncIndexerClient, AsyncSlotTrackerClient, PotentialLoad, ServiceStatusError
from .hashing import local_block_hashes, sequence_hashes, to_signed

_logger = logging.getLogger("dynamo_lite.routing")

DEFAULT_SOURCES_REFRESH_SECS = 5.0
"""How long `KvRouter` trusts what the indexer's `/workers` said about each rank's `source`."""


class NoWorkerAvailable(Exception):
    """No registered rank can take the request (none registered, or all over a busy threshold).

    Raised by `KvRouter.select` (and `choose`) when no rank of the model is registered with
    the slot tracker, or every one is over a `RouterConfig` busy threshold; the message says
    which.
    """


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How `KvRouter` weighs cached tokens against load, and when a rank counts as busy.

    `overlap_score_weight` multiplies the prefill blocks in the cost (0 ignores the cache);
    `router_temperature` 0 takes the cheapest rank, higher values spread requests more
    randomly. Both must be finite and >= 0 (ValueError otherwise).
    """

    overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    # A rank is busy, so not a candidate, when its decode blocks with this request would exceed
    # the first threshold or its active prefill tokens exceed the second (None: no limit).
    active_decode_blocks_threshold: int | None = None
    active_prefill_tokens_threshold: int | None = None
    # ... or, as Dynamo's --active-prefill-tokens-threshold-frac, when its active prefill tokens
    # exceed this fraction of the rank's max_num_batched_tokens (`score_ranks`' `capacities`).
    active_prefill_tokens_threshold_frac: float | None = None

    def __post_init__(self) -> None:
        if self.overlap_score_weight < 0 or not math.isfinite(self.overlap_score_weight):
            raise ValueError("overlap_score_weight must be a finite number >= 0")
        if self.router_temperature < 0 or not math.isfinite(self.router_temperature):
            raise ValueError("router_temperature must be a finite number >= 0")
        frac = self.active_prefill_tokens_threshold_frac
        if frac is not None and (frac < 0 or not math.isfinite(frac)):
            raise ValueError("active_prefill_tokens_threshold_frac must be a finite number >= 0")


@dataclass(frozen=True, slots=True)
class RankCost:
    """One candidate's cost breakdown, for logging and for the simulator's reports."""

    worker_id: int
    dp_rank: int
    cached_tokens: int
    prefill_tokens: int
    prefill_blocks: float
    decode_blocks: int
    cost: float
    busy: bool

    def formula(self, weight: float) -> str:
        """The cost written out for logs: `cost = weight * prefill_blocks + decode_blocks`."""
        return (
            f"worker {self.worker_id} rank {self.dp_rank}: {self.cost:.3f} = {weight:g} * "
            f"{self.prefill_blocks:.3f} + {self.decode_blocks} (cached tokens: {self.cached_tokens})"
        )


def score_ranks(
    potential_loads: Sequence[PotentialLoad],
    cached_tokens: dict[tuple[int, int], int],
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    capacities: Mapping[tuple[int, int], int] | None = None,
) -> list[RankCost]:
    """Cost of each rank, given `/potential_loads` answered with `new_isl_tokens=0` and the
    indexer's matched tokens per (worker, rank). A rank unknown to the indexer has nothing
    cached; ranks only the indexer knows cannot be booked and are not candidates.

    `capacities`: each rank's max_num_batched_tokens, for the fractional prefill threshold (a
    rank without one is judged by the absolute thresholds only)."""
    frac = config.active_prefill_tokens_threshold_frac
    costs = []
    for load in potential_loads:
        rank = (load.worker_id, load.dp_rank)
        cached = min(cached_tokens.get(rank, 0), isl_tokens)
        active_prefill = load.potential_prefill_tokens  # new_isl_tokens was 0
        prefill_tokens = active_prefill + isl_tokens - cached
        prefill_blocks = prefill_tokens / block_size
        decode_blocks = load.potential_decode_blocks
        busy = (
            config.active_decode_blocks_threshold is not None
            and decode_blocks > config.active_decode_blocks_threshold
        ) or (
            config.active_prefill_tokens_threshold is not None
            and active_prefill > config.active_prefill_tokens_threshold
        ) or (
            frac is not None and capacities is not None and rank in capacities
            and active_prefill > frac * capacities[rank]
        )
        cost = config.overlap_score_weight * prefill_blocks + decode_blocks
        costs.append(RankCost(load.worker_id, load.dp_rank, cached, prefill_tokens, prefill_blocks,
                              decode_blocks, cost, busy))
    return costs


def choose(costs: Sequence[RankCost], temperature: float, rng: random.Random) -> RankCost:
    """Lowest cost at temperature 0, else a softmax sample over costs scaled to [0, 1]."""
    candidates = sorted((c for c in costs if not c.busy), key=lambda c: (c.worker_id, c.dp_rank))
    if not candidates:
        if not costs:
            raise NoWorkerAvailable("no rank can take the request: none is registered")
        raise NoWorkerAvailable(
            f"no rank can take the request: all {len(costs)} registered ranks are over a busy threshold"
        )
    if temperature == 0:
        best = min(c.cost for c in candidates)
        return rng.choice([c for c in candidates if c.cost == best])
    low = min(c.cost for c in candidates)
    high = max(c.cost for c in candidates)
    if low == high:
        return rng.choice(candidates)
    weights = [math.exp(-(c.cost - low) / ((high - low) * temperature)) for c in candidates]
    return rng.choices(candidates, weights=weights)[0]


@dataclass(slots=True)
class Decision:
    """The rank `KvRouter.select` chose, with what `commit` needs to book it.

    `costs` holds every candidate's breakdown, `config` the settings the choice used (per-call
    overrides applied) and `lookup_secs` how long the two service reads took.
    """

    model_name: str
    tenant_id: str
    worker_id: int
    dp_rank: int
    isl_tokens: int
    sequence_hashes: list[int]
    costs: list[RankCost]
    config: RouterConfig
    lookup_secs: float
    local_hashes: list[int] = field(default_factory=list)  # what /routed records, if it is called

    @property
    def chosen(self) -> RankCost:
        """The cost breakdown of the chosen rank."""
        return next(c for c in self.costs if (c.worker_id, c.dp_rank) == (self.worker_id, self.dp_rank))


@dataclass(slots=True)
class RequestHandle:
    """A booked request: call `prefill_complete()` at the first output token, `output_blocks(n)`
    each time its output fills a block, `free()` at the end."""

    slot_tracker: AsyncSlotTrackerClient
    decision: Decision
    request_id: str
    prefilled: bool = field(default=False)
    freed: bool = field(default=False)

    async def prefill_complete(self) -> None:
        """Tell the slot tracker the first token is out (once; a no-op after `free()`)."""
        if not self.prefilled and not self.freed:
            await self.slot_tracker.prefill_complete(
                self.decision.model_name, self.request_id, tenant_id=self.decision.tenant_id
            )
            self.prefilled = True

    async def output_blocks(self, count: int) -> None:
        """Tell the slot tracker the request has generated `count` full blocks so far (call it
        every `block_size` tokens; a no-op after `free()`)."""
        if not self.freed:
            await self.slot_tracker.output_blocks(
                self.decision.model_name, self.request_id, count, tenant_id=self.decision.tenant_id
            )

    async def free(self) -> None:
        """Tell the slot tracker the request ended (once); call it on errors and cancellation too."""
        if not self.freed:
            await self.slot_tracker.free(self.decision.model_name, self.request_id, tenant_id=self.decision.tenant_id)
            self.freed = True


class KvRouter:
    """Selects a (worker_id, dp_rank) per request from the indexer's and slot tracker's answers.

    `block_size` is the model's tokens per KV block (as its workers registered); `seed` makes
    the tie-breaking and sampling reproducible. The router holds no state per request: one
    instance serves all of a gateway's concurrent requests for that block size.

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
        config: RouterConfig | None = None,
        seed: int | None = None,
        record_routes: bool | None = None,
        sources_refresh_secs: float = DEFAULT_SOURCES_REFRESH_SECS,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if not sources_refresh_secs >= 0:
            raise ValueError("sources_refresh_secs must be >= 0")
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self.block_size = block_size
        self.config = config or RouterConfig()
        self.rng = random.Random(seed)
        self.record_routes = record_routes
        self.sources_refresh_secs = sources_refresh_secs
        # (model_name, tenant_id) -> (read at, monotonic; {(instance_id, dp_rank): source})
        self._sources: dict[tuple[str, str], tuple[float, dict[tuple[int, int], str]]] = {}

    def hashes_for(
        self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[list[int], list[int]]:
        """(local hashes for the indexer, chained sequence hashes for the slot tracker), signed."""
        local = local_block_hashes(token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt)
        return [to_signed(h) for h in local], [to_signed(h) for h in sequence_hashes(local)]

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
    ) -> Decision:
        """Query both services concurrently and pick a rank. Overrides apply to this call only.

        Raises `NoWorkerAvailable` when no rank of the model is registered or all are busy, a
        `TransportError` when a service cannot be reached, and a `ServiceStatusError` when one
        answers another error (both are `ServiceCallError`s).
        """
        config = self.config
        if overlap_score_weight is not None or router_temperature is not None:
            config = replace(
                config,
                overlap_score_weight=config.overlap_score_weight if overlap_score_weight is None else overlap_score_weight,
                router_temperature=config.router_temperature if router_temperature is None else router_temperature,
            )
        started = time.perf_counter()
        cached, loads = await asyncio.gather(
            self._cached_tokens(model_name, tenant_id, local_hashes),
            self._potential_loads(model_name, tenant_id, sequence_hashes),
        )
        lookup_secs = time.perf_counter() - started
        costs = score_ranks(loads, cached, isl_tokens, self.block_size, config)
        chosen = choose(costs, config.router_temperature, self.rng)
        return Decision(model_name, tenant_id, chosen.worker_id, chosen.dp_rank, isl_tokens,
                        list(sequence_hashes), costs, config, lookup_secs, list(local_hashes))

    async def commit(self, decision: Decision, request_id: str) -> RequestHandle:
        """Book the chosen rank with `/add` (new prefill tokens = the prompt minus its cached part),
        and record the decision on the indexer (`record`) at the same time.

        A `ServiceStatusError` with status 404 from `/add` means the rank left since `select`:
        select again.
        """
        add = self.slot_tracker.add(
            decision.model_name, request_id, decision.worker_id, decision.dp_rank,
            decision.sequence_hashes, decision.isl_tokens - decision.chosen.cached_tokens,
            tenant_id=decision.tenant_id,
        )
        await asyncio.gather(add, self.record(decision))
        return RequestHandle(self.slot_tracker, decision, request_id)

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
            sources = {(info["instance_id"], rank["dp_rank"]): rank["source"]
                       for info in instances for rank in info["ranks"]}
            known = (now, sources)
            self._sources[key] = known
        sources = known[1]
        # An empty partition is one the indexer does not know: nothing to record into.
        return bool(sources) and sources.get((decision.worker_id, decision.dp_rank)) != "events"

    async def _potential_loads(
        self, model_name: str, tenant_id: str, sequence_hashes: Sequence[int]
    ) -> list[PotentialLoad]:
        try:
            return await self.slot_tracker.potential_loads(model_name, sequence_hashes, 0, tenant_id=tenant_id)
        except ServiceStatusError as error:
            if error.status != 404:
                raise
            # The slot tracker knows no worker of this model: nothing registered to route to.
            raise NoWorkerAvailable(
                f"no rank can take the request: no worker of model {model_name!r} (tenant {tenant_id!r}) "
                "is registered with the slot tracker"
            ) from error

    async def _cached_tokens(
        self, model_name: str, tenant_id: str, local_hashes: Sequence[int]
    ) -> dict[tuple[int, int], int]:
        try:
            overlap = await self.indexer.query_by_hash(model_name, local_hashes, tenant_id=tenant_id)
        except ServiceStatusError as exc:
            if exc.status == 404:  # no worker published anything for this model yet
                return {}
            raise
        return overlap.scores
