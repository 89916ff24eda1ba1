"""Load accounting in simulated time, with the slot tracker's definitions.

A rank's load is measured two ways, both from the request's `/add` (routing) until its `/free`
(end of decode), i.e. queued, prefilling and decoding requests all count:

* active requests;
* active decode blocks: distinct prompt blocks (sequence hashes) held by those requests plus
  the output blocks they have generated so far, which is the slot tracker's
  `active_decode_blocks` (with `/output_blocks`) and the decode term of the KV router's cost.

Each is integrated over simulated time, so a run reports per rank the time-averaged value and
the peak; across ranks the report gives the mean and the maximum of the time averages (a
balanced fleet has max close to mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class TimeWeighted:
    """A step function of simulated time: its integral and its peak."""

    __slots__ = ("value", "since", "area", "peak")

    def __init__(self, start: float) -> None:
        self.value = 0
        self.since = start
        self.area = 0.0
        self.peak = 0

    def set(self, now: float, value: int) -> None:
        self.area += self.value * (now - self.since)
        self.value = value
        self.since = now
        if value > self.peak:
            self.peak = value

    def average(self, start: float, end: float) -> float:
        """Mean over [start, end]; `end` must not precede the last change."""
        area = self.area + self.value * (end - self.since)
        return area / (end - start) if end > start else float(self.value)


@dataclass(frozen=True, slots=True)
class LoadSummary:
    mean: float  # mean over ranks of each rank's time average
    max: float  # largest time average of a rank
    peak: int  # largest instantaneous value on any rank


class RankLoad:
    """Active requests and active decode blocks of one rank."""

    def __init__(self, start: float) -> None:
        self.requests = TimeWeighted(start)
        self.blocks = TimeWeighted(start)
        self._refcounts: dict[int, int] = {}
        self._output_blocks = 0  # never shared between requests, so a plain sum

    def add(self, now: float, seq_hashes: Sequence[int]) -> None:
        refcounts = self._refcounts
        for seq in seq_hashes:
            refcounts[seq] = refcounts.get(seq, 0) + 1
        self.requests.set(now, self.requests.value + 1)
        self._update_blocks(now)

    def grow_output(self, now: float, blocks: int) -> None:
        self._output_blocks += blocks
        self._update_blocks(now)

    def remove(self, now: float, seq_hashes: Sequence[int], output_blocks: int) -> None:
        refcounts = self._refcounts
        for seq in seq_hashes:
            left = refcounts[seq] - 1
            if left:
                refcounts[seq] = left
            else:
                del refcounts[seq]
        self._output_blocks -= output_blocks
        self.requests.set(now, self.requests.value - 1)
        self._update_blocks(now)

    def _update_blocks(self, now: float) -> None:
        self.blocks.set(now, len(self._refcounts) + self._output_blocks)


def summarize(series: Sequence[TimeWeighted], start: float, end: float) -> LoadSummary:
    averages = [item.average(start, end) for item in series]
    return LoadSummary(
        sum(averages) / len(averages) if averages else 0.0,
        max(averages, default=0.0),
        max((item.peak for item in series), default=0),
    )
