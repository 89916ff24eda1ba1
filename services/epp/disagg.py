"""Whether a request is worth disaggregating, and on which prefill endpoint (docs/disaggregation.md).

The picker first chooses the destination among the model's `decode` and `aggregated` endpoints,
as for any request. Then, when the pool has `prefill` endpoints for the model, `choose_prefill`
decides:

- **aggregated** (`short`) when the prompt's uncached tokens on the chosen decode rank are
  `min_uncached_tokens` or fewer (Dynamo's effective-ISL threshold, 2,048): a short or mostly
  cached prompt costs the decode engine little, less than moving its blocks;
- **aggregated** (`prefill_busy`) when every prefill rank is busy: its booked prefill tokens are
  `prefill_busy_frac` times its `max_num_batched_tokens` or more, or the scheduler's busy
  thresholds take it out (the decode-blocks threshold does not apply: a prefill engine holds a
  prompt's blocks only until the decode engine has read them);
- **disaggregated** otherwise, on the prefill rank with the least predicted prefill work: the
  prompt's tokens it does not cache plus the prefill tokens booked there (cache overlap and
  prefill load only; ties go to the first in the order given, which the picker rotates).

The picker then sends `x-prefiller-host-port` with that endpoint's address (the P/D sidecar
beside the decode engine reads it) and books both ranks (see `KvPicker._book`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .endpoint import PoolEndpoint

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's: the prefill engine's host:port, for the sidecar
DEFAULT_MIN_UNCACHED_TOKENS = 2048  # Dynamo's conditional disaggregation: effective ISL threshold
DEFAULT_PREFILL_BUSY_FRAC = 2.0  # as --router-queue-threshold: x max_num_batched_tokens of booked prefill

SHORT = "short"
NO_PREFILL = "no_prefill"
PREFILL_BUSY = "prefill_busy"
DISAGGREGATED = "disaggregated"
REASONS = (SHORT, NO_PREFILL, PREFILL_BUSY, DISAGGREGATED)


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    min_uncached_tokens: int = DEFAULT_MIN_UNCACHED_TOKENS
    # A prefill rank with this fraction of its max_num_batched_tokens booked is busy; None: only
    # the scheduler's busy thresholds count.
    prefill_busy_frac: float | None = DEFAULT_PREFILL_BUSY_FRAC


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """A prefill endpoint as the pick found it: the prompt's tokens it caches, its booked prefill."""

    endpoint: PoolEndpoint
    cached_tokens: int
    prefill_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    endpoint: PoolEndpoint
    uncached_tokens: int  # the prompt's tokens it computes: its booked prefill load


def choose_prefill(isl: int, uncached_on_decode: int, ranks: Sequence[PrefillRank], settings: DisaggSettings,
                   busy: Callable[[PrefillRank], bool] = lambda rank: False) -> tuple[PrefillChoice | None, str]:
    """The prefill rank for a request of `isl` prompt tokens, `uncached_on_decode` of them not
    cached on the chosen decode rank; None to run it aggregated. The second value is the reason
    (one of `REASONS`). `busy`: the scheduler's busy verdict on a rank, besides the fraction."""
    if not ranks:
        return None, NO_PREFILL
    if uncached_on_decode <= settings.min_uncached_tokens:
        return None, SHORT
    frac = settings.prefill_busy_frac
    open_ranks = [rank for rank in ranks
                  if not (frac is not None and rank.prefill_tokens >= frac * rank.endpoint.max_num_batched_tokens)
                  and not busy(rank)]
    if not open_ranks:
        return None, PREFILL_BUSY
    best = min(open_ranks, key=lambda rank: max(isl - rank.cached_tokens, 0) + rank.prefill_tokens)
    return PrefillChoice(best.endpoint, max(isl - best.cached_tokens, 0)), DISAGGREGATED


__all__ = [
    "DEFAULT_MIN_UNCACHED_TOKENS", "DEFAULT_PREFILL_BUSY_FRAC", "DISAGGREGATED", "NO_PREFILL", "PREFILLER_HEADER",
    "PREFILL_BUSY", "REASONS", "SHORT", "DisaggSettings", "PrefillChoice", "PrefillRank", "choose_prefill",
]
