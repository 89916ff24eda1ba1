"""The order in which a slot tracker replica applies the others' ops: pure and synchronous.

The *version vector* maps each origin to the last number of its sequence applied here, so a
re-delivered op is skipped, and a number beyond the next one is a *gap* (NATS core is
at-most-once): the batch is held back until the missing ops arrive, or are given up on. A
`Heartbeat` carries an origin's last number, so a gap at the end of a burst shows too.
`Sequencer` decides which ops of which batch are due; `replication.Replica` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops import Batch, Heartbeat, Message


@dataclass(frozen=True)
class Gap:
    """Ops `first` .. `last` of `origin` are missing here."""

    origin: int
    first: int
    last: int


@dataclass(frozen=True)
class Due:
    """Apply `batch.ops[skip:]`: the ops before are applied already."""

    batch: Batch
    skip: int


@dataclass
class SequenceCounts:
    duplicates: int = 0  # ops received again and skipped
    gaps: int = 0  # jumps in an origin's sequence numbers: ops lost on the way
    lost: int = 0  # ops given up on: no replica could send them again


class Sequencer:
    """The version vector of one replica (`own` is its origin), the batches held back past a
    gap, and what is known of each origin. Each method returns the batches now due, in the
    order to apply them, and the gap still open, if any; the vector already counts the due
    batches as applied."""

    def __init__(self, own: int, counts: SequenceCounts) -> None:
        self.own = own
        self.counts = counts
        self.vector: dict[int, int] = {own: 0}
        self.held: dict[int, list[Batch]] = {}  # batches past a gap, per origin, by first_seq
        self.known_last: dict[int, int] = {}  # the highest sequence number an origin is known to have used
        self.heard: dict[int, float] = {}  # tracker clock of each origin's last message
        self.open_gaps: set[int] = set()  # origins with ops missing

    def receive(self, message: Message, now: float) -> tuple[list[Due], Gap | None]:
        """What of `message` (from another origin) to apply now."""
        origin = message.origin
        self.heard[origin] = now
        if isinstance(message, Heartbeat):
            if message.last_seq > self.known_last.get(origin, 0):
                self.known_last[origin] = message.last_seq
            return [], self.gap(origin)
        batch = message
        if batch.last_seq > self.known_last.get(origin, 0):
            self.known_last[origin] = batch.last_seq
        expected = self.vector.get(origin, 0) + 1
        if batch.last_seq < expected:
            self.counts.duplicates += len(batch.ops)
            return [], None
        if batch.first_seq > expected:
            self._hold(batch)
            return [], self.gap(origin)
        due = [self._due(batch, expected)]
        return due, self._drain(origin, due)

    def gap(self, origin: int) -> Gap | None:
        """What is still missing of `origin`, if anything."""
        expected = self.vector.get(origin, 0) + 1
        held = self.held.get(origin)
        last = held[0].first_seq - 1 if held else self.known_last.get(origin, 0)
        if last < expected:
            self.open_gaps.discard(origin)
            return None
        if origin not in self.open_gaps:
            self.open_gaps.add(origin)
            self.counts.gaps += 1
        return Gap(origin, expected, last)

    def skip(self, origin: int) -> tuple[int, list[Due]]:
        """Give up on the ops missing before what is known of `origin`: how many, and the
        batches held back that are now due."""
        expected = self.vector.get(origin, 0) + 1
        held = self.held.get(origin)
        last = held[0].first_seq - 1 if held else self.known_last.get(origin, 0)
        if last < expected:
            return 0, []
        lost = last - expected + 1
        self.counts.lost += lost
        self.vector[origin] = last
        due: list[Due] = []
        self._drain(origin, due)
        return lost, due

    def load(self, vector: dict[int, int], now: float) -> list[Batch]:
        """Take another replica's vector (a state transfer); returns the batches held back here."""
        self.vector = dict(vector)
        self.vector.setdefault(self.own, 0)
        self.heard = {origin: now for origin in self.vector if origin != self.own}
        known_last = self.known_last
        self.known_last = {origin: max(seq, known_last.get(origin, 0))
                           for origin, seq in self.vector.items() if origin != self.own}
        self.open_gaps = set()
        held = [batch for batches in self.held.values() for batch in batches]
        self.held = {}
        return held

    def forget_unheard(self, deadline: float) -> None:
        """Forget the origins not heard of since `deadline` (and with nothing held back)."""
        for origin, heard in list(self.heard.items()):
            if heard <= deadline and not self.held.get(origin):
                del self.heard[origin]
                self.vector.pop(origin, None)
                self.known_last.pop(origin, None)
                self.open_gaps.discard(origin)

    def _due(self, batch: Batch, expected: int) -> Due:
        skip = expected - batch.first_seq
        self.counts.duplicates += skip
        self.vector[batch.origin] = batch.last_seq
        return Due(batch, skip)

    def _hold(self, batch: Batch) -> None:
        held = self.held.setdefault(batch.origin, [])
        if any(known.first_seq == batch.first_seq for known in held):
            self.counts.duplicates += len(batch.ops)
            return
        held.append(batch)
        if len(held) > 1 and held[-2].first_seq > batch.first_seq:
            held.sort(key=lambda known: known.first_seq)

    def _drain(self, origin: int, due: list[Due]) -> Gap | None:
        held = self.held.get(origin)
        while held:
            expected = self.vector.get(origin, 0) + 1
            batch = held[0]
            if batch.first_seq > expected:
                return self.gap(origin)
            held.pop(0)
            if batch.last_seq >= expected:
                due.append(self._due(batch, expected))
            else:
                self.counts.duplicates += len(batch.ops)
        self.held.pop(origin, None)
        return self.gap(origin)
