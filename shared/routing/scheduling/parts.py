"""The parts a scheduling cycle is made of: filters, scorers and pickers.

As in llm-d's scheduler, a cycle filters the candidates, lets every scorer score each one that
is left, sums the scores by the configured weights and lets a picker choose. Here a score is a
*cost* (lower is better) in the scorer's own unit, so that a sum means something: the default
cost's scorers are all in seconds (a prediction of the time to first token, plus the time the
request's cache writes will cost others), Dynamo's in KV blocks.

Each scorer reads a `RankView`: one candidate with what every scorer needs already worked out
once (uncached tokens, the prefill queued ahead, the rank's timing, its write turnover).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynamo_lite.base.timing import TimingModel

from .learning import decode_factor
from .model import RankCost, RankInfo, RankState


class RankView:
    """One candidate for one request (see the module docstring). A plain slotted class, worked
    out once per candidate: the cycle builds one per rank on every request.

    `cached_tokens`: what the cycle believes cached there (the indexer's, or the session's);
    `prefill_tokens`: queued ahead + uncached, what must be prefilled before its first token;
    `steps`: engine steps until then (the step budget takes the queue and it in turn);
    `decode_steps`: those steps, each carrying the rank's running decode batch, in one-request
    step units; `turnover`: the rank's share of the recent writes over its share of the capacity
    (1: even), set by the cycle.
    """

    __slots__ = ("load", "info", "timing", "cached_tokens", "uncached_tokens", "prefill_tokens", "block_size",
                 "turnover", "steps", "decode_steps")

    def __init__(self, load: RankState, info: RankInfo, timing: TimingModel, cached_tokens: int, uncached_tokens: int,
                 prefill_tokens: int, block_size: int, turnover: float = 0.0) -> None:
        self.load = load
        self.info = info
        self.timing = timing
        self.cached_tokens = cached_tokens
        self.uncached_tokens = uncached_tokens
        self.prefill_tokens = prefill_tokens
        self.block_size = block_size
        self.turnover = turnover
        budget = info.max_num_batched_tokens
        self.steps = -(-prefill_tokens // budget) if prefill_tokens > budget > 0 else 1
        running = load.active_requests
        self.decode_steps = self.steps * decode_factor(timing, running) if running > 0 else 0.0

    def predicted_ttft(self) -> float:
        timing = self.timing
        return self.prefill_tokens * timing.prefill_secs_per_token + self.decode_steps * timing.decode_step_secs


# --- scorers: a cost per candidate ------------------------------------------------------------------


Score = Callable[[RankView], float]


def prefill_time(view: RankView) -> float:
    """Seconds of prefill before this request's first token: the prompt tokens queued ahead on
    the rank plus its own uncached ones, at the rank's prefill rate."""
    return view.prefill_tokens * view.timing.prefill_secs_per_token


def decode_interference(view: RankView) -> float:
    """Seconds the rank's running decode batch adds to those prefill steps (each engine step
    also decodes one token for every running request)."""
    return view.decode_steps * view.timing.decode_step_secs


def cache_pressure(view: RankView) -> float:
    """Seconds the request's cache writes are expected to cost later requests: its uncached
    tokens evict as many cached ones, which someone may ask for again. Valued at what they cost
    to compute, scaled by how fast the rank turns its cache over (`RankView.turnover`: 1 at an
    even spread of the fleet's writes, more on a rank that took more than its share, 0 on one
    nothing was written to yet). This is what spreads a hot shared prefix and new conversations
    over the fleet instead of herding them onto the first rank that cached the prefix."""
    return view.uncached_tokens * view.timing.prefill_secs_per_token * view.turnover


def prefill_blocks(view: RankView) -> float:
    """Dynamo's prefill term: (active prefill tokens + prompt - cached) / block size."""
    return view.prefill_tokens / view.block_size


def decode_blocks(view: RankView) -> float:
    """Dynamo's decode term: the rank's KV blocks in use with this request added."""
    return float(view.load.potential_decode_blocks)


def active_requests(view: RankView) -> float:
    """Requests booked on the rank (least-request balancing, for custom configurations)."""
    return float(view.load.active_requests)


SCORERS: dict[str, tuple[Score, str]] = {
    "prefill_time": (prefill_time, "seconds"),
    "decode_interference": (decode_interference, "seconds"),
    "cache_pressure": (cache_pressure, "seconds"),
    "prefill_blocks": (prefill_blocks, "blocks"),
    "decode_blocks": (decode_blocks, "blocks"),
    "active_requests": (active_requests, "requests"),
}
"""Every scorer a configuration may name, with its unit."""


# --- filters: which candidates may take the request ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """Dynamo's busy thresholds (None: no limit). A rank is busy when its KV blocks with this
    request would exceed `active_decode_blocks_threshold`, or its active prefill tokens exceed
    `active_prefill_tokens_threshold` or that fraction of its step budget."""

    active_decode_blocks_threshold: int | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None

    def __post_init__(self) -> None:
        for name in ("active_decode_blocks_threshold", "active_prefill_tokens_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None")
        frac = self.active_prefill_tokens_threshold_frac
        if frac is not None and (frac < 0 or not math.isfinite(frac)):
            raise ValueError("active_prefill_tokens_threshold_frac must be a finite number >= 0")

    def busy(self, info: RankInfo, active_prefill_tokens: int, decode_blocks: int) -> bool:
        """Whether a rank with this load (its KV blocks in use with the request added) is busy."""
        decode = self.active_decode_blocks_threshold
        prefill = self.active_prefill_tokens_threshold
        frac = self.active_prefill_tokens_threshold_frac
        return bool(
            (decode is not None and decode_blocks > decode)
            or (prefill is not None and active_prefill_tokens > prefill)
            or (frac is not None and active_prefill_tokens > frac * info.max_num_batched_tokens))

    @property
    def any(self) -> bool:
        """Whether any threshold is set (none: nothing is ever busy)."""
        return (self.active_decode_blocks_threshold is not None or self.active_prefill_tokens_threshold is not None
                or self.active_prefill_tokens_threshold_frac is not None)


def saturated(info: RankInfo, active_prefill_tokens: int, threshold: float | None) -> bool:
    """Dynamo's `--router-queue-threshold`: more prefill queued than `threshold` x the rank's
    step budget (a gateway holds the request back while every candidate is)."""
    return threshold is not None and active_prefill_tokens > threshold * info.max_num_batched_tokens


def over_kv_capacity(view: RankView) -> bool:
    """The rank's KV blocks in use, with this request, exceed its capacity: the engine would make
    it wait for memory (or preempt). Only a preference: when every rank is over, all stay."""
    capacity = view.info.kv_capacity_blocks
    return capacity is not None and view.load.potential_decode_blocks > capacity


# --- pickers ----------------------------------------------------------------------------------------------


def pick_lowest(costs: Sequence[RankCost], rng: random.Random) -> RankCost:
    """The cheapest candidate; ties broken by the seeded generator over (worker, rank) order."""
    ordered = sorted(costs, key=lambda c: (c.worker_id, c.dp_rank))
    best = min(c.cost for c in ordered)
    return rng.choice([c for c in ordered if c.cost == best])


def pick_softmax(costs: Sequence[RankCost], temperature: float, rng: random.Random) -> RankCost:
    """Dynamo's `softmax_sample`: costs normalised to [0, 1], weights exp(-normalised / t)."""
    if temperature <= 0:
        return pick_lowest(costs, rng)
    ordered = sorted(costs, key=lambda c: (c.worker_id, c.dp_rank))
    low = min(c.cost for c in ordered)
    high = max(c.cost for c in ordered)
    if low == high:
        return rng.choice(ordered)
    weights = [math.exp(-(c.cost - low) / ((high - low) * temperature)) for c in ordered]
    return rng.choices(ordered, weights=weights)[0]


__all__ = [
    "BusyThresholds", "RankView", "SCORERS", "Score", "active_requests", "cache_pressure", "decode_blocks",
    "decode_interference", "over_kv_capacity", "pick_lowest", "pick_softmax", "prefill_blocks", "prefill_time",
    "saturated",
]
