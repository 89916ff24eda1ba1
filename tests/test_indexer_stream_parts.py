"""Pieces of `indexer.nats_replica.StreamReplica` that need no NATS server: the snapshot schedule
and the outcomes writers wait for."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_lite.indexer.nats_replica import Outcomes, SnapshotTag, StreamSettings, snapshot_due
from dynamo_lite.indexer.replication import Applied

pytestmark = pytest.mark.unit

SETTINGS = StreamSettings("nats://127.0.0.1:4222", snapshot_threshold=100, snapshot_interval_secs=60)


@pytest.mark.parametrize(("stored", "applied", "now", "due"), [
    (SnapshotTag(10, 1000.0, "s1"), 10, 5000.0, False),  # nothing applied since
    (SnapshotTag(10, 1000.0, "s1"), 109, 1010.0, False),  # neither enough messages nor time
    (SnapshotTag(10, 1000.0, "s1"), 110, 1010.0, True),  # the threshold
    (SnapshotTag(10, 1000.0, "s1"), 11, 1060.0, True),  # the interval, with anything applied
    (SnapshotTag(500, 1000.0, "s0"), 1, 1000.0, True),  # of an earlier stream
])
def test_snapshot_due(stored: SnapshotTag, applied: int, now: float, due: bool) -> None:
    assert snapshot_due(stored, "s1", applied, SETTINGS, now) is due


def test_a_waiter_gets_its_outcome_and_a_kept_one_serves_a_writer_the_consumer_overtook() -> None:
    async def scenario() -> None:
        outcomes = Outcomes(keep=1)
        first, second = Applied("register"), Applied("unregister")
        waiting = asyncio.ensure_future(outcomes.wait(5, False, 5.0))
        await asyncio.sleep(0)
        outcomes.settle(5, first, keep=False)
        assert await waiting is first
        outcomes.settle(6, first, keep=True)
        outcomes.settle(7, second, keep=True)  # keeps one: 6 goes
        assert await outcomes.wait(7, True, 5.0) is second
        with pytest.raises(asyncio.TimeoutError):
            await outcomes.wait(6, True, 0.01)

    asyncio.run(scenario())
