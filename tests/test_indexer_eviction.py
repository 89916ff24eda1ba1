"""`--max-blocks`: the prefix tree against a model that applies the same LRU rules.

Model (device tier), per partition:

* each worker holds a set of chains (tuples of content ids), exactly as in
  `test_indexer_model`: a store is refused when its parent chain is not held, a removal deletes
  one chain (the chains below it stay held but cannot match), a clear deletes them all;
* recency is kept per chain held by anyone: a store touches the chains it stored, deepest
  first, then its parent; a query touches the chain of its best match and every prefix of it,
  deepest first;
* while more (worker, chain) pairs are held than the limit, the least recent chain goes, with
  every chain that extends it, for every worker.

After every step the tree must answer every query as the model does, hold the same pairs, keep
the same recency order and count the same evictions.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from starlette.testclient import TestClient
from support.eviction_machine import LOCALS, EvictionMachine

from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.app import IndexerConfig, create_app
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document
from dynamo_lite.indexer.tree import PrefixTree

pytestmark = pytest.mark.unit

TestEviction = EvictionMachine.TestCase
TestEviction.settings = settings(
    max_examples=max(150, settings.default.max_examples),  # HYPOTHESIS_PROFILE=long: 10,000
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_unlimited_tree_keeps_no_recency() -> None:
    tree = PrefixTree()
    tree.store((1, 0), None, [11, 12], [LOCALS[0], LOCALS[1]])
    assert tree.recent is None and tree.device_blocks == 2 and tree.evicted_blocks == 0


def test_lower_tier_drops_oldest_store_first() -> None:
    tree = PrefixTree(max_blocks=2)
    tree.store((1, 0), None, [11], [LOCALS[0]], "host_pinned")
    tree.store((1, 0), 11, [12], [LOCALS[1]], "host_pinned")
    tree.store((1, 0), 11, [12], [LOCALS[1]], "host_pinned")  # re-store: 12 is now the newest
    tree.store((2, 0), None, [21], [LOCALS[0]], "host_pinned")
    assert tree.block_count((1, 0), "host_pinned") == 1
    assert tree.block_count((2, 0), "host_pinned") == 1
    assert tree.evicted_blocks == 1
    assert tree.remove((1, 0), [11], "host_pinned") == 1  # evicted: an unknown removal
    assert [e.data.block_hashes for e in tree.dump()] == [[12], [21]]


def test_indexer_counts_evictions_per_partition_and_after_unregister() -> None:
    indexer = Indexer(max_blocks=4)

    def stored(model: str, worker: int, hashes: list[int]) -> dict:
        return {f"{model}:default": {"block_size": 16, "events": [{"worker_id": worker, "event": {
            "event_id": hashes[0], "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": h, "tokens_hash": h * 7} for h in hashes]}}}}]}}

    indexer.apply_events(parse_events_document(stored("a", 1, [1, 2, 3])))
    indexer.apply_events(parse_events_document(stored("a", 1, [10, 11, 12])))  # evicts 3, then 2
    indexer.apply_events(parse_events_document(stored("b", 2, [1, 2, 3, 4])))  # its own budget
    assert indexer.evicted_blocks_total == 2
    assert [w.ranks[0].blocks for w in indexer.workers()] == [4, 4]
    assert query_answer(indexer.query("a", "default", [7, 14, 21]))["scores"] == {"1": {"0": 16}}
    assert query_answer(indexer.query("a", "default", [70, 77, 84]))["scores"] == {"1": {"0": 48}}
    indexer.unregister(1, "a", "default")
    assert indexer.evicted_blocks_total == 2  # kept after its partition is gone


def test_evictions_show_in_metrics_and_workers() -> None:
    with TestClient(create_app(IndexerConfig(max_blocks=2))) as client:
        document = {"m:default": {"block_size": 4, "events": [{"worker_id": 1, "event": {
            "event_id": 0, "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": h, "tokens_hash": h} for h in (1, 2, 3)]}}}}]}}
        assert client.post("/events", json=document).json()["applied"] == 1
        assert client.get("/workers").json()[0]["ranks"][0]["blocks"] == 2
        assert "dynamo_lite_indexer_evicted_blocks_total 1.0" in client.get("/metrics").text
        removal = {"m:default": {"block_size": 4, "events": [{"worker_id": 1, "event": {
            "event_id": 1, "dp_rank": 0, "data": {"removed": {"block_hashes": [3]}}}}]}}
        assert client.post("/events", json=removal).json()["unknown_removals"] == 1
