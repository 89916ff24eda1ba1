"""What the scheduler learns as requests go by: each engine's speed, where the recent cache
writes went, and which rank each conversation's session is pinned to.

All three are plain synchronous state, fed by the gateway (a booking, the first token it saw,
the end of an answer, an engine's metrics) and read by the scoring cycle.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from dynamo_lite.base.timing import TimingModel

from .model import RankKey

# --- engine speed ---------------------------------------------------------------------------------

# How fast old observations fade: each new one weighs 1, the one n observations ago 0.98^n
# (about the last 50 count).
FORGETTING = 0.98
# The prior's spread, as a factor of its value: the first observations move the estimate freely
# within about this factor, later ones anywhere.
PRIOR_SPREAD = 3.0
# The fixed delay every request sees (network, HTTP, the engine's tokenizer), prior 0 ± this.
PRIOR_OVERHEAD_SECS = 0.02
# A fitted fixed delay beyond this is the fit gone astray (it is used within it).
MAX_OVERHEAD_SECS = 1.0
# An observed time to first token is this noisy (seconds, standard deviation).
NOISE_SECS = 0.01
# The prefill rate is fitted per this many tokens.
TOKEN_UNIT = 1000.0
# Estimates are used within this factor of the prior (a diverging fit cannot send every request
# to one engine).
CLAMP = 50.0


def decode_factor(timing: TimingModel, running: int) -> float:
    """A decode step with `running` requests, in units of the step with one (0 with none)."""
    if running <= 0:
        return 0.0
    if timing.decode_step_secs <= 0:
        return 1.0
    return 1.0 + timing.decode_secs_per_running * (running - 1) / timing.decode_step_secs


class RateEstimate:
    """One rank's timing, fitted online to what the gateway observes.

    The model: time to first token = overhead + prefill_secs_per_token x (prefill queued ahead +
    the request's uncached tokens) + decode_step_secs x decode steps interleaved (weighted by the
    batch size as the prior's `decode_secs_per_running` says). Recursive least squares with
    forgetting over (overhead, prefill_secs_per_token, decode_step_secs), starting from the
    configured timing; an engine's own inter-token latency (its metrics) observes the decode step
    alone.
    """

    __slots__ = ("prior", "theta", "p", "observations")

    def __init__(self, prior: TimingModel) -> None:
        self.prior = prior
        # Fitted in seconds per thousand tokens: every parameter and feature then lies within a
        # few orders of magnitude of 1, which keeps the recursion well conditioned.
        self.theta = [0.0, prior.prefill_secs_per_token * TOKEN_UNIT, prior.decode_step_secs]
        self.p = [[self._spreads[i] if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.observations = 0

    @property
    def _spreads(self) -> tuple[float, float, float]:
        prior = self.prior
        return (PRIOR_OVERHEAD_SECS ** 2, (PRIOR_SPREAD * max(prior.prefill_secs_per_token, 1e-9) * TOKEN_UNIT) ** 2,
                (PRIOR_SPREAD * max(prior.decode_step_secs, 1e-9)) ** 2)

    def timing(self) -> TimingModel:
        """The estimate, clamped to within `CLAMP` of the prior (never negative)."""
        prior = self.prior
        prefill = _clamp(self.theta[1] / TOKEN_UNIT, prior.prefill_secs_per_token)
        step = _clamp(self.theta[2], prior.decode_step_secs)
        per_running = prior.decode_secs_per_running * (step / prior.decode_step_secs) if prior.decode_step_secs else 0.0
        return TimingModel(prefill, step, per_running)

    @property
    def overhead_secs(self) -> float:
        """The fixed delay every request sees, within [0, MAX_OVERHEAD_SECS]."""
        return min(max(0.0, self.theta[0]), MAX_OVERHEAD_SECS)

    def observe_ttft(self, prefill_tokens: int, decode_steps: float, seconds: float) -> None:
        """A request that had `prefill_tokens` to wait for (the queue ahead and its own uncached
        tokens) and `decode_steps` interleaved decode steps (in units of a one-request step) saw
        its first token after `seconds`."""
        self._update((1.0, prefill_tokens / TOKEN_UNIT, decode_steps), seconds)

    def observe_decode_step(self, seconds: float, running: float) -> None:
        """The engine reported a mean inter-token latency of `seconds` with `running` requests."""
        factor = decode_factor(self.prior, max(1, round(running)))
        self._update((0.0, 0.0, factor), seconds)

    def _update(self, x: tuple[float, float, float], y: float) -> None:
        if not (math.isfinite(y) and y >= 0):
            return
        p, theta = self.p, self.theta
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] for i in range(3)]
        denominator = FORGETTING * NOISE_SECS ** 2 + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        if denominator <= 0:
            return
        gain = [value / denominator for value in px]
        error = y - (theta[0] * x[0] + theta[1] * x[1] + theta[2] * x[2])
        for i in range(3):
            theta[i] += gain[i] * error
        for i in range(3):
            for j in range(i, 3):
                # Symmetric by construction: rounding cannot drift it away from a covariance.
                p[i][j] = p[j][i] = (p[i][j] - gain[i] * px[j]) / FORGETTING
        # Directions no observation excites grow by 1/FORGETTING each time ("wind-up"); never
        # let them grow past the prior's own spread.
        spreads = self._spreads
        for i in range(3):
            if p[i][i] > spreads[i]:
                scale = math.sqrt(spreads[i] / p[i][i])
                for j in range(3):
                    p[i][j] *= scale
                    p[j][i] *= scale
        self.observations += 1


def _clamp(value: float, prior: float) -> float:
    if prior <= 0:
        return max(0.0, value)
    return min(max(value, prior / CLAMP), prior * CLAMP)


# A rank's own speed factor counts as this many observations of "as fast as the fleet" until its
# own observations outweigh them: one unlucky first token does not make an engine look slow.
SPEED_PRIOR_OBSERVATIONS = 8.0


@dataclass(slots=True)
class RankSpeed:
    """How much slower (> 1) or faster (< 1) one rank is than the fleet's estimate says: its
    observed times over the predicted ones, summed with forgetting, shrunk toward 1 by
    `SPEED_PRIOR_OBSERVATIONS` pseudo-observations of an average prediction."""

    observed: float = 0.0
    predicted: float = 0.0
    weight: float = 0.0
    observations: int = 0

    @property
    def log_factor(self) -> float:
        """The log of the shrunk ratio of observed to predicted."""
        if self.weight <= 0 or self.predicted <= 0:
            return 0.0
        typical = self.predicted / self.weight
        prior = SPEED_PRIOR_OBSERVATIONS * typical
        return math.log((self.observed + prior) / (self.predicted + prior))

    def observe(self, observed: float, predicted: float) -> None:
        if not (observed >= 0 and predicted > 0 and math.isfinite(observed) and math.isfinite(predicted)):
            return
        self.observed = self.observed * FORGETTING + observed
        self.predicted = self.predicted * FORGETTING + predicted
        self.weight = self.weight * FORGETTING + 1.0
        self.observations += 1


class EngineRates:
    """The engines' timing, learned: one `RateEstimate` for the whole fleet (every rank's
    observations fit the same rates), and each rank's `RankSpeed` against it.

    Fitting each rank on its own lets load-dependent error become a rank's property (a busy
    engine's times, which the linear model fits worst, made it look the fastest and drew still
    more requests to it); the fleet's fit has every rank's observations, and a rank differs from
    it by one factor, shrunk toward 1 until its observations say otherwise. With `learn` off,
    the configured timing alone."""

    def __init__(self, prior: TimingModel, *, learn: bool = True) -> None:
        self.prior = prior
        self.learn = learn
        self.fleet = RateEstimate(prior)
        self._speeds: dict[RankKey, RankSpeed] = {}
        self._fleet_timing: TimingModel | None = None
        self._mean_log: float | None = None
        self._cached: dict[RankKey, TimingModel] = {}

    def timing(self, rank: RankKey) -> TimingModel:
        if not self.learn:
            return self.prior
        timing = self._cached.get(rank)
        if timing is None:
            fleet = self.fleet_timing()
            timing = self._cached[rank] = _scaled(fleet, self.factor(rank))
        return timing

    def factor(self, rank: RankKey) -> float:
        """How much slower than the fleet's average rank this one is (1: as fast; unknown: 1).
        The factors' geometric mean is kept at 1: the fleet's own fit carries the average speed
        (without this, the two could drift apart in opposite directions and fit as well)."""
        speed = self._speeds.get(rank)
        if speed is None:
            return 1.0
        if self._mean_log is None:
            self._mean_log = sum(s.log_factor for s in self._speeds.values()) / len(self._speeds)
        return math.exp(speed.log_factor - self._mean_log)

    def fleet_timing(self) -> TimingModel:
        if self._fleet_timing is None:
            self._fleet_timing = self.fleet.timing() if self.learn else self.prior
        return self._fleet_timing

    def speed(self, rank: RankKey) -> RankSpeed | None:
        return self._speeds.get(rank)

    def observe_ttft(self, rank: RankKey, prefill_tokens: int, decode_steps: float, seconds: float) -> None:
        if not self.learn:
            return
        fleet = self.fleet
        timing = self.fleet_timing()
        predicted = fleet.overhead_secs + timing.prefill_seconds(prefill_tokens) + decode_steps * timing.decode_step_secs
        factor = self.factor(rank)
        # The fleet learns from this rank's time as if the rank were average, the rank's factor
        # from how its time compares with the fleet's prediction.
        fleet.observe_ttft(prefill_tokens, decode_steps, seconds / factor)
        speed = self._speeds.get(rank)
        if speed is None:
            speed = self._speeds[rank] = RankSpeed()
        speed.observe(seconds, predicted)
        self._fleet_timing = self._mean_log = None
        self._cached.clear()

    def observe_decode_step(self, rank: RankKey, seconds: float, running: float) -> None:
        if not self.learn:
            return
        self.fleet.observe_decode_step(seconds / self.factor(rank), running)
        self._fleet_timing = None
        self._cached.clear()

    def forget(self, ranks: Iterable[RankKey]) -> None:
        for rank in ranks:
            self._speeds.pop(rank, None)
        self._mean_log = None
        self._cached.clear()

    def known(self) -> dict[RankKey, RankSpeed]:
        return dict(self._speeds)


def _scaled(timing: TimingModel, factor: float) -> TimingModel:
    factor = min(max(factor, 1 / CLAMP), CLAMP)
    return TimingModel(timing.prefill_secs_per_token * factor, timing.decode_step_secs * factor,
                       timing.decode_secs_per_running * factor)


# --- where the cache writes went --------------------------------------------------------------------


class WriteWindow:
    """The KV blocks written per rank (a request's uncached prompt, then its answer) over the
    fleet's most recent writes: the window holds as many blocks as the caches hold together, so
    what it counts is, roughly, what each rank's cache holds now that was written recently.

    A rank that took more than its share of the writes (relative to its share of the capacity)
    turns its cache over faster: what it evicts is younger, so more likely to be asked for again.
    `turnover` measures that: 1 at an even spread, 0 for a rank nothing was written to.

    Amortised O(1) per write: the counts are kept scaled by one shared factor.
    """

    def __init__(self) -> None:
        self._raw: dict[RankKey, float] = {}
        self._scale = 1.0
        self.total = 0.0

    def add(self, rank: RankKey, blocks: float, window_blocks: float) -> None:
        if blocks <= 0:
            return
        self._raw[rank] = self._raw.get(rank, 0.0) + blocks / self._scale
        self.total += blocks
        if self.total > window_blocks > 0:
            self._scale *= window_blocks / self.total
            self.total = float(window_blocks)
            if self._scale < 1e-200:  # renormalise before the factor underflows
                self._raw = {key: value * self._scale for key, value in self._raw.items()}
                self._scale = 1.0

    def written(self, rank: RankKey) -> float:
        return self._raw.get(rank, 0.0) * self._scale

    def forget(self, ranks: Iterable[RankKey]) -> None:
        for rank in ranks:
            value = self._raw.pop(rank, None)
            if value is not None:
                self.total = max(0.0, self.total - value * self._scale)


# --- sessions ----------------------------------------------------------------------------------------


class SessionTable:
    """Which rank each session (conversation) was last routed to, and how long its prompt was,
    for `ttl_secs` after its last request; at most `max_entries` sessions (the oldest go first)."""

    def __init__(self, ttl_secs: float, max_entries: int) -> None:
        self.ttl_secs = ttl_secs
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[RankKey, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str, now: float) -> tuple[RankKey, int] | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry[2] <= now:
            del self._entries[session_id]
            return None
        return entry[0], entry[1]

    def pin(self, session_id: str, rank: RankKey, tokens: int, now: float) -> None:
        if self.ttl_secs <= 0 or self.max_entries <= 0:
            return
        entries = self._entries
        entries.pop(session_id, None)
        entries[session_id] = (rank, tokens, now + self.ttl_secs)
        while entries:
            oldest = next(iter(entries.values()))
            if oldest[2] > now and len(entries) <= self.max_entries:
                break
            entries.popitem(last=False)

    def drop_rank(self, ranks: Iterable[RankKey]) -> None:
        gone = set(ranks)
        for session_id in [sid for sid, entry in self._entries.items() if entry[0] in gone]:
            del self._entries[session_id]


__all__ = ["EngineRates", "RankSpeed", "RateEstimate", "SessionTable", "WriteWindow", "decode_factor"]
