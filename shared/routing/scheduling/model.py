"""What a scheduling cycle reads and what it answers: plain values, no behaviour.

One request is scheduled over *candidates*: the data-parallel ranks that serve its model, each
with what the services said about it for this request (`RankState`: the indexer's cached tokens,
the slot tracker's `/potential_loads` row) and what is known of it for good (`RankInfo`: the KV
capacity and the step token budget, from the pool file or the engine's metrics). The cycle
answers a `Selection`: every candidate's cost broken into its terms, and the order to try them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RankKey = tuple[int, int]
"""(worker_id, dp_rank)."""

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""A rank's step token budget when nothing says otherwise (vLLM's default with chunked prefill)."""


class NoWorkerAvailable(Exception):
    """No rank can take the request: none is registered for its model, or every one is over a
    busy threshold.

    Raised by `KvRouter.select` (and `Scheduler.schedule`); the message says which. `AllBusy`, a
    subclass, is the second case: busy thresholds and a saturated prefill queue clear by
    themselves, so a gateway may queue the request and ask again.
    """


class AllBusy(NoWorkerAvailable):
    """Every candidate rank is over a busy threshold or saturated; `Selection.costs` of the
    exception say which filter took each one out."""

    def __init__(self, message: str, costs: list[RankCost]) -> None:
        super().__init__(message)
        self.costs = costs


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What is known of a rank beyond one request. `kv_capacity_blocks` None: unknown (the pool
    file did not say and the engine's metrics have not been read)."""

    worker_id: int
    dp_rank: int
    kv_capacity_blocks: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    @property
    def key(self) -> RankKey:
        """(worker_id, dp_rank): the rank's key everywhere the scheduler keeps state."""
        return (self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank as the services see it for one request.

    `cached_tokens`: the prompt's longest cached prefix there (indexer); `active_prefill_tokens`:
    prompt tokens booked there and not yet past their first token, i.e. the prefill queued ahead
    (slot tracker, `potential_prefill_tokens` of `/potential_loads` with `new_isl_tokens` 0);
    `potential_decode_blocks`: its KV blocks in use with this request added; `active_requests`:
    requests booked there.
    """

    worker_id: int
    dp_rank: int
    cached_tokens: int = 0
    active_prefill_tokens: int = 0
    potential_decode_blocks: int = 0
    active_requests: int = 0

    @property
    def key(self) -> RankKey:
        """(worker_id, dp_rank): the rank's key everywhere the scheduler keeps state."""
        return (self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """The request being scheduled, as far as the cycle cares.

    `session_id`: a conversation's id (session affinity); `expected_output_tokens`: how long its
    answer will be, if the client knows (`max_tokens` is an upper bound, not an expectation);
    `temperature` and `overlap_score_weight`: per-request overrides of the configuration (the
    second applies to the `dynamo` cost only).
    """

    isl_tokens: int
    block_size: int
    session_id: str | None = None
    expected_output_tokens: int | None = None
    temperature: float | None = None
    overlap_score_weight: float | None = None


@dataclass(frozen=True, slots=True)
class RankCost:
    """One candidate's cost for one request, term by term.

    `terms` holds each scorer's weighted contribution (name, value), in the order configured;
    `cost` is their sum. `uncached_tokens` is the prompt minus what the rank caches (what `/add`
    books as new prefill tokens when the rank is chosen). `filtered` names the filter that took
    the rank out (None: a candidate); `predicted_ttft_secs` is the default cost's estimate of the
    time to first token there (None for costs that predict no time).
    """

    worker_id: int
    dp_rank: int
    cached_tokens: int
    uncached_tokens: int
    prefill_tokens: int
    decode_blocks: int
    active_requests: int
    terms: tuple[tuple[str, float], ...]
    cost: float
    filtered: str | None = None
    predicted_ttft_secs: float | None = None
    decode_steps: float = 0.0  # decode steps interleaved before its first token (one-request units)
    unit: str = "blocks"  # of `cost` and the terms: "seconds" for the default cost

    @property
    def key(self) -> RankKey:
        """(worker_id, dp_rank): the rank's key everywhere the scheduler keeps state."""
        return (self.worker_id, self.dp_rank)

    @property
    def busy(self) -> bool:
        """Taken out by a filter (kept for the callers of the former `score_ranks`)."""
        return self.filtered is not None

    def formula(self) -> str:
        """The cost written out for logs: `worker 3 rank 0: 4.210 ms = prefill_time 3.000 ms +
        ...` (seconds shown in milliseconds), or `worker 3 rank 0: 23 = prefill_blocks 18 + ...`."""
        show = _milliseconds if self.unit == "seconds" else _plain
        parts = " + ".join(f"{name} {show(value)}" for name, value in self.terms) or "0"
        status = f", filtered: {self.filtered}" if self.filtered else ""
        return (f"worker {self.worker_id} rank {self.dp_rank}: {show(self.cost)} = {parts} "
                f"(cached tokens: {self.cached_tokens}{status})")


def _milliseconds(seconds: float) -> str:
    return f"{1000 * seconds:.3f} ms"


def _plain(value: float) -> str:
    return f"{value:.4g}"


@dataclass(slots=True)
class Selection:
    """The cycle's answer: `ordered[0]` is the pick, the rest the next best candidates, cheapest
    first (a gateway's fallbacks); `costs` holds every rank the cycle saw, filtered ones too."""

    ordered: list[RankCost]
    costs: list[RankCost]
    session_hit: bool = False  # the pick is the rank the request's session was pinned to
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def chosen(self) -> RankCost:
        """The pick: `ordered[0]`."""
        return self.ordered[0]


__all__ = [
    "AllBusy", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "NoWorkerAvailable", "RankCost", "RankInfo", "RankKey", "RankState",
    "SchedulingRequest", "Selection",
]
