"""`sequencing.Sequencer` alone: which batches are due, what is held back, the gaps."""

from __future__ import annotations

import pytest

from dynamo_lite.slot_tracker.ops import Batch, Heartbeat, Unregister
from dynamo_lite.slot_tracker.sequencing import Due, Gap, SequenceCounts, Sequencer

pytestmark = pytest.mark.unit


def batch(origin: int, first_seq: int, size: int = 1) -> Batch:
    return Batch(origin, first_seq, 0.0, [Unregister("m", "default", seq) for seq in range(first_seq, first_seq + size)])


def sequencer() -> Sequencer:
    return Sequencer(1, SequenceCounts())


def test_batches_in_order_are_due_at_once_and_advance_the_vector() -> None:
    s = sequencer()
    first, second = batch(7, 1, 2), batch(7, 3)
    assert s.receive(first, 0.0) == ([Due(first, 0)], None)
    assert s.receive(second, 0.0) == ([Due(second, 0)], None)
    assert s.vector == {1: 0, 7: 3} and s.heard == {7: 0.0}


def test_a_batch_past_a_gap_is_held_until_the_gap_fills() -> None:
    s = sequencer()
    later = batch(7, 3)
    assert s.receive(later, 0.0) == ([], Gap(7, 1, 2))
    assert s.held == {7: [later]} and s.counts.gaps == 1
    missing = batch(7, 1, 2)
    assert s.receive(missing, 0.0) == ([Due(missing, 0), Due(later, 0)], None)
    assert s.held == {} and s.vector[7] == 3 and s.counts.gaps == 1


def test_overlapping_and_repeated_batches_skip_what_was_applied() -> None:
    s = sequencer()
    s.receive(batch(7, 1, 2), 0.0)
    overlapping = batch(7, 2, 2)
    assert s.receive(overlapping, 0.0) == ([Due(overlapping, 1)], None)
    assert s.receive(batch(7, 1, 3), 0.0) == ([], None)
    assert s.counts.duplicates == 1 + 3


def test_a_heartbeat_shows_a_gap_at_the_end_of_a_burst() -> None:
    s = sequencer()
    s.receive(batch(7, 1), 0.0)
    assert s.receive(Heartbeat(7, 3, 0.0), 0.0) == ([], Gap(7, 2, 3))
    assert s.receive(Heartbeat(7, 3, 0.0), 0.0) == ([], Gap(7, 2, 3)) and s.counts.gaps == 1


def test_skipping_a_gap_counts_it_lost_and_releases_what_was_held() -> None:
    s = sequencer()
    later = batch(7, 4)
    s.receive(later, 0.0)
    assert s.skip(7) == (3, [Due(later, 0)])
    assert s.counts.lost == 3 and s.vector[7] == 4 and s.gap(7) is None
    assert s.skip(7) == (0, [])


def test_loading_a_vector_hands_back_the_held_batches_and_forgetting_drops_silent_origins() -> None:
    s = sequencer()
    held = batch(7, 5)
    s.receive(held, 0.0)
    assert s.load({7: 2, 9: 4}, 10.0) == [held]
    assert s.vector == {7: 2, 9: 4, 1: 0} and s.held == {} and s.known_last == {7: 5, 9: 4}
    s.forget_unheard(10.0)
    assert s.vector == {1: 0} and s.heard == {} and s.known_last == {}
