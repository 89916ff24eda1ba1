"""`partitions.py` directly: the ownership conflicts have one kind, ranks one creation point,
watermarks one rule."""

from __future__ import annotations

import pytest

from dynamo_lite.base.errors import Conflict, NotFound
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.partitions import EVENTS, NONE, AlreadyRegistered, Gap, Partitions, Rank, Watermarks
from dynamo_lite.indexer.protocols import parse_events_document

pytestmark = pytest.mark.unit


def stored_document(key: str, worker_id: int, event_id: int = 0) -> dict:
    event = {"event_id": event_id, "dp_rank": 0,
             "data": {"stored": {"parent_hash": None, "blocks": [{"block_hash": 1, "tokens_hash": 1}]}}}
    return {key: {"block_size": 16, "events": [{"worker_id": worker_id, "event": event}]}}


def test_every_registration_conflict_is_already_registered_and_nothing_else_is() -> None:
    indexer = Indexer()
    indexer.register(1, "m", "default", 16)
    with pytest.raises(AlreadyRegistered, match="^instance 1 dp_rank 0 already registered$"):
        indexer.register(1, "m", "default", 16)
    with pytest.raises(AlreadyRegistered, match="^instance 1 is already registered for model=m tenant_id=default$"):
        indexer.register(1, "other", "default", 16)
    indexer.register(2, "other", "default", 16)
    with pytest.raises(AlreadyRegistered, match="^instance 1 is already registered for model=m tenant_id=default$"):
        indexer.record_routed("other", "default", 1, 0, [5])
    with pytest.raises(AlreadyRegistered, match="^instance 1 is already registered for model=m tenant_id=default$"):
        indexer.check_routed("other", "default", 1)
    with pytest.raises(AlreadyRegistered, match="^instance 1 is already registered for model=m tenant_id=default$"):
        indexer.apply_events(parse_events_document(stored_document("other:default", 1)))
    with pytest.raises(AlreadyRegistered, match="^instance 7 is already registered for model=a tenant_id=default$"):
        indexer.apply_events(parse_events_document({**stored_document("a:default", 7),
                                                    **stored_document("b:default", 7)}))
    with pytest.raises(Conflict) as mismatch:
        indexer.register(3, "m", "default", 8)
    assert not isinstance(mismatch.value, AlreadyRegistered)  # a block size mismatch is another conflict


def test_ranks_own_their_instance_until_the_last_one_goes_and_the_partition_with_it() -> None:
    partitions = Partitions()
    partition = partitions.get_or_add("m", "t", 16)
    assert partitions.by_id == {("m", "t"): partition}
    first = partitions.add_rank(partition, (4, 0), NONE)
    partitions.add_rank(partition, (4, 1), EVENTS)
    assert first == Rank(NONE) and partitions.owner(4) is partition
    partitions.check_owner(4, ("m", "t"))
    partitions.drop_ranks(partition, [(4, 0)])
    assert partitions.owner(4) is partition
    partitions.drop_ranks(partition, [(4, 1)])
    assert partitions.owner(4) is None and partitions.by_id == {}
    with pytest.raises(NotFound, match="^no indexer for model=m tenant_id=t$"):
        partitions.existing("m", "t")


def test_watermarks_skip_redelivered_batches_and_count_gaps() -> None:
    rank = Rank(EVENTS)
    watermarks = Watermarks()
    key = (1, 0)
    assert [watermarks.admits(key, rank, event_id) for event_id in (0, 0, 1, 3, 3)] == [True] * 5
    assert rank.last_event_id == 3 and (watermarks.gap_count, watermarks.gaps) == (1, [Gap(1, 0, 2, 3)])
    again = Watermarks()
    assert [again.admits(key, rank, event_id) for event_id in (2, 3, 4)] == [False, False, True]
    assert again.skipped == 2 and rank.last_event_id == 4
