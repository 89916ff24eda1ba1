"""The scheduling cycle every entry point runs: `KvRouter`, the endpoint picker, the simulator.

    scheduler = Scheduler(ttft_config(), seed=0)
    selection = scheduler.schedule(request, loads, infos)   # filters, scorers, picker
    scheduler.booked(selection, request)                     # the pick was booked there
    scheduler.first_token(selection, seconds)                # learn the engine's speed
    scheduler.ended(rank, output_tokens)                     # its answer's blocks were written

Pure and synchronous: the caller reads the services (and owns every clock but `clock`, which
only ages sessions), the scheduler decides and learns. One instance serves every model of a
gateway; what it learns is keyed by (worker_id, dp_rank).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from .config import SchedulerConfig, ttft_config
from .learning import EngineRates, SessionTable, WriteWindow
from .model import AllBusy, NoWorkerAvailable, RankCost, RankInfo, RankKey, RankState, SchedulingRequest, Selection
from .parts import SCORERS, BusyThresholds, RankView, over_kv_capacity, pick_lowest, pick_softmax, saturated

# When no rank's KV capacity is known, the write window assumes this many blocks per rank (an
# 8B model's cache on one 80 GB GPU at 16 tokens per block holds about 30,000).
DEFAULT_WINDOW_BLOCKS_PER_RANK = 16_384
# The write turnover's prior: each rank starts as if this fraction of its capacity had been
# written (2 %: the simulator's workloads, docs/routing.md, change little between 0 and 5 %).
TURNOVER_PRIOR = 0.02

FILTER_BUSY = "busy"
FILTER_SATURATED = "saturated"
FILTER_KV_CAPACITY = "kv_capacity"


class Scheduler:
    """Filters, scorers and a picker over one request's candidate ranks (see the module
    docstring), plus what it learns between requests.

    `saturation_threshold`: Dynamo's `--router-queue-threshold` (a rank with more active prefill
    than this x its step budget is saturated; None: never). `seed` makes tie-breaking and
    sampling reproducible; `clock` (monotonic seconds) ages sessions.
    """

    def __init__(self, config: SchedulerConfig | None = None, *, seed: int | None = None,
                 saturation_threshold: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ttft_config()
        self.rng = random.Random(seed)
        self.saturation_threshold = saturation_threshold
        self.clock = clock
        self.rates = EngineRates(self.config.timing, learn=self.config.learn_rates)
        self.writes = WriteWindow()
        self.sessions = SessionTable(self.config.session_ttl_secs, self.config.session_max_entries)
        self.capacities: dict[RankKey, int] = {}  # learned from engine metrics
        self._scorers = [(SCORERS[name][0], name, weight) for name, weight in self.config.scorers]
        self._turnover = any(name == "cache_pressure" and weight for name, weight in self.config.scorers)
        self._window_blocks = 0.0  # the write window of the last booking: the candidates' capacity

    # --- configuration at run time ----------------------------------------------------------------

    def set_busy_thresholds(self, **thresholds: int | float | None) -> BusyThresholds:
        """Change busy thresholds (`POST /busy_threshold`); ValueError/TypeError for a bad one."""
        busy = replace(self.config.busy, **thresholds)  # type: ignore[arg-type]
        self.config = replace(self.config, busy=busy)
        return busy

    def set_capacity(self, rank: RankKey, blocks: int | None) -> None:
        """A rank's KV capacity in blocks, as its engine reports it (vLLM's num_gpu_blocks)."""
        if blocks is None or blocks <= 0:
            self.capacities.pop(rank, None)
        else:
            self.capacities[rank] = blocks

    def forget(self, ranks: Iterable[RankKey]) -> None:
        """Ranks that left the fleet: drop what was learned of them."""
        ranks = list(ranks)
        self.rates.forget(ranks)
        self.writes.forget(ranks)
        self.sessions.drop_rank(ranks)
        for rank in ranks:
            self.capacities.pop(rank, None)

    # --- the cycle ----------------------------------------------------------------------------------

    def busy(self, info: RankInfo, active_prefill_tokens: int, decode_blocks: int) -> bool:
        """The hard filters' verdict from a rank's load alone (a gateway's queue asks this while
        requests wait): over a busy threshold, or saturated."""
        return (self.config.busy.busy(info, active_prefill_tokens, decode_blocks)
                or saturated(info, active_prefill_tokens, self.saturation_threshold))

    def schedule(self, request: SchedulingRequest, loads: Sequence[RankState],
                 infos: Mapping[RankKey, RankInfo] | None = None) -> Selection:
        """Choose a rank for `request` among `loads` (one per candidate rank, from the services);
        `infos` holds what is known of each rank (capacity, step budget; missing: defaults).

        Raises `NoWorkerAvailable` when there is no candidate, `AllBusy` when every candidate is
        over a busy threshold or saturated.
        """
        if not loads:
            raise NoWorkerAvailable("no rank can take the request: none is registered")
        config = self.config
        block_size = max(1, request.block_size)
        infos = infos or {}
        views = self._views(request, loads, infos, block_size)
        session_rank = views[1]
        views_list = views[0]
        busy_thresholds = config.busy
        threshold = self.saturation_threshold
        check_busy = busy_thresholds.any
        scorers = self._scorers
        weights = self._weights(request)
        predicts_time = config.predicts_time
        unit = "seconds" if predicts_time else "blocks"
        costs: list[RankCost] = []
        open_costs: list[RankCost] = []
        over_capacity: list[RankCost] = []
        weighted = [(score, name, weight) for (score, name, _), weight in zip(scorers, weights)]
        capacity_filter = config.kv_capacity_filter
        for view in views_list:
            load = view.load
            filtered = None
            if check_busy and busy_thresholds.busy(view.info, load.active_prefill_tokens, load.potential_decode_blocks):
                filtered = FILTER_BUSY
            elif threshold is not None and saturated(view.info, load.active_prefill_tokens, threshold):
                filtered = FILTER_SATURATED
            terms = []
            total = 0.0
            for score, name, weight in weighted:
                value = weight * score(view)
                terms.append((name, value))
                total += value
            cost = RankCost(load.worker_id, load.dp_rank, view.cached_tokens, view.uncached_tokens,
                            view.prefill_tokens, load.potential_decode_blocks, load.active_requests, tuple(terms),
                            total, filtered, view.predicted_ttft() if predicts_time else None, view.decode_steps, unit)
            if filtered is None:
                if capacity_filter and over_kv_capacity(view):
                    over_capacity.append(cost)
                else:
                    open_costs.append(cost)
            costs.append(cost)
        if over_capacity:
            if open_costs:
                # Ranks that fit the request in memory exist: the others only as a last resort.
                marked = {id(c) for c in over_capacity}
                costs = [replace(c, filtered=FILTER_KV_CAPACITY) if id(c) in marked else c for c in costs]
            else:
                open_costs = over_capacity
        if not open_costs:
            reasons = sorted({c.filtered for c in costs if c.filtered})
            raise AllBusy(f"no rank can take the request: all {len(costs)} candidate ranks are "
                          f"{' or '.join(reasons)}", costs)
        temperature = config.temperature if request.temperature is None else request.temperature
        chosen = pick_softmax(open_costs, temperature, self.rng) if temperature > 0 else pick_lowest(open_costs, self.rng)
        rest = sorted((c for c in open_costs if c is not chosen), key=lambda c: (c.cost, c.worker_id, c.dp_rank))
        return Selection([chosen, *rest], costs, session_hit=session_rank == chosen.key)

    def _weights(self, request: SchedulingRequest) -> list[float]:
        weights = [weight for _, _, weight in self._scorers]
        if request.overlap_score_weight is not None:
            weights = [request.overlap_score_weight if name == "prefill_blocks" else weight
                       for (_, name, _), weight in zip(self._scorers, weights)]
        return weights

    def _views(self, request: SchedulingRequest, loads: Sequence[RankState], infos: Mapping[RankKey, RankInfo],
               block_size: int) -> tuple[list[RankView], RankKey | None]:
        isl = request.isl_tokens
        session = None
        if request.session_id is not None and self.config.session_ttl_secs > 0:
            session = self.sessions.get(request.session_id, self.clock())
        capacities = self.capacities
        rates = self.rates
        views: list[RankView] = []
        for load in loads:
            key = (load.worker_id, load.dp_rank)
            info = infos.get(key)
            if info is None:
                info = RankInfo(load.worker_id, load.dp_rank, capacities.get(key))
            elif info.kv_capacity_blocks is None and key in capacities:
                info = replace(info, kv_capacity_blocks=capacities[key])
            cached = min(max(load.cached_tokens, 0), isl)
            if session is not None and session[0] == key and cached == 0:
                # The session's last prompt went here and the indexer knows nothing of it there:
                # its KV events have not arrived yet, or the engine publishes none (and the
                # indexer's approximation expired). Believe the prompt is still cached. When the
                # indexer does know something, it knows better (it also sees evictions).
                cached = min(session[1], isl) // block_size * block_size
            uncached = isl - cached
            views.append(RankView(load, info, rates.timing(key), cached, uncached,
                                  max(0, load.active_prefill_tokens) + uncached, block_size))
        if self._turnover:
            self._set_turnover(views)
        return views, (session[0] if session is not None else None)

    def _set_turnover(self, views: list[RankView]) -> None:
        written = [self.writes.written(view.load.key) for view in views]
        total_written = sum(written)
        if total_written <= 0:
            return
        capacities = self._capacities([view.info for view in views])
        total_capacity = sum(capacities)
        # Every rank counts as if TURNOVER_PRIOR of its capacity had been written already: the
        # first few writes of a fresh fleet say little about turnover (one request on one rank
        # would otherwise make that rank's turnover the fleet's whole).
        total = total_written + TURNOVER_PRIOR * total_capacity
        for view, share, capacity in zip(views, written, capacities):
            view.turnover = ((share + TURNOVER_PRIOR * capacity) / total) / (capacity / total_capacity)

    @staticmethod
    def _capacities(infos: Sequence[RankInfo]) -> list[float]:
        """Each rank's capacity; unknown ones count as the mean of the known (or all as equal)."""
        known = [info.kv_capacity_blocks for info in infos if info.kv_capacity_blocks]
        fill = sum(known) / len(known) if known else float(DEFAULT_WINDOW_BLOCKS_PER_RANK)
        return [float(info.kv_capacity_blocks or fill) for info in infos]

    # --- feedback -----------------------------------------------------------------------------------

    def booked(self, selection: Selection, request: SchedulingRequest, infos: Mapping[RankKey, RankInfo] | None = None,
               *, rank: RankKey | None = None) -> None:
        """The request was booked on `rank` (default: the pick): its uncached blocks are written
        there, and its session is pinned there."""
        chosen = selection.chosen if rank is None else next((c for c in selection.costs if c.key == rank), None)
        if chosen is None:
            return
        key = chosen.key
        if self._turnover:
            self._window_blocks = self._window(selection, infos)
            self.writes.add(key, chosen.uncached_tokens / max(1, request.block_size), self._window_blocks)
        if request.session_id is not None:
            self.sessions.pin(request.session_id, key, request.isl_tokens, self.clock())

    def ended(self, rank: RankKey, output_tokens: int, block_size: int) -> None:
        """A request on `rank` ended after `output_tokens` tokens: the engine cached its answer's
        full blocks too."""
        if self._turnover and output_tokens >= block_size > 0 and self._window_blocks:
            self.writes.add(rank, output_tokens // block_size, self._window_blocks)

    def first_token(self, cost: RankCost, seconds: float) -> None:
        """The request booked with `cost` saw its first token after `seconds` (from the pick).

        Only a request with nothing queued ahead of it teaches the rate: behind a queue, engine
        steps batch several prompts together and the queue's tokens are not all ahead of it, an
        error that grows with the load. Fitted in, it would make the busiest engines look the
        fastest, and draw still more requests to them."""
        if cost.prefill_tokens != cost.uncached_tokens:
            return
        self.rates.observe_ttft(cost.key, cost.prefill_tokens, cost.decode_steps, seconds)

    def observe_decode_step(self, rank: RankKey, seconds: float, running: float) -> None:
        """An engine's mean inter-token latency with `running` requests (from its metrics)."""
        self.rates.observe_decode_step(rank, seconds, running)

    def _window(self, selection: Selection, infos: Mapping[RankKey, RankInfo] | None) -> float:
        infos = infos or {}
        ranks = [infos.get(c.key) or RankInfo(c.worker_id, c.dp_rank, self.capacities.get(c.key)) for c in selection.costs]
        return sum(self._capacities(ranks))


__all__ = ["DEFAULT_WINDOW_BLOCKS_PER_RANK", "FILTER_BUSY", "FILTER_KV_CAPACITY", "FILTER_SATURATED", "Scheduler"]
