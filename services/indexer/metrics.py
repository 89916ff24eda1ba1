"""The indexer's own Prometheus metrics, read from `Indexer` at each scrape.

Totals over all (model_name, tenant_id) partitions, without partition labels: tenants are
chosen by the callers, so labelling by them would let clients grow the series without bound.
Reading costs O(partitions + worker ranks x tiers) per scrape and nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_lite.metrics import PREFIX

from .protocols import STORAGE_TIERS
from .state import Indexer

NAMESPACE = PREFIX + "indexer_"


class IndexerCollector(Collector):
    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer

    def collect(self) -> Iterator[Metric]:
        indexer = self.indexer
        partitions = list(indexer.partitions.values())
        instances = ranks = 0
        held = dict.fromkeys(STORAGE_TIERS, 0)
        for partition in partitions:
            instances += len({instance_id for instance_id, _ in partition.ranks})
            ranks += len(partition.ranks)
            tree = partition.tree
            for key in partition.ranks:
                for tier in STORAGE_TIERS:
                    held[tier] += tree.block_count(key, tier)
        yield GaugeMetricFamily(NAMESPACE + "partitions", "(model_name, tenant_id) partitions", len(partitions))
        yield GaugeMetricFamily(NAMESPACE + "workers", "worker instances, registered or seen in events", instances)
        yield GaugeMetricFamily(NAMESPACE + "ranks", "(instance, dp_rank) pairs, registered or seen in events", ranks)
        blocks = GaugeMetricFamily(
            NAMESPACE + "blocks",
            "blocks held per storage tier, summed over ranks (a block two ranks hold counts twice)",
            labels=["tier"],
        )
        for tier, count in held.items():
            blocks.add_metric([tier], count)
        yield blocks
        events = CounterMetricFamily(
            NAMESPACE + "events",
            "events of /events documents by outcome: applied, skipped (event_id already seen: a "
            "re-delivery) or rejected (refused by the index, e.g. an unknown parent)",
            labels=["outcome"],
        )
        events.add_metric(["applied"], indexer.events_applied_total)
        events.add_metric(["skipped"], indexer.events_skipped_total)
        events.add_metric(["rejected"], indexer.events_rejected_total)
        yield events
        yield CounterMetricFamily(
            NAMESPACE + "event_gaps",
            "events whose event_id skipped ahead of the rank's last one + 1 (events were lost)",
            indexer.event_gaps_total,
        )
        yield CounterMetricFamily(
            NAMESPACE + "evicted_blocks",
            "blocks evicted, least recently used first, to keep a partition within --max-blocks",
            getattr(indexer, "evicted_blocks_total", 0),
        )


__all__ = ["IndexerCollector"]
