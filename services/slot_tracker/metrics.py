"""The slot tracker's own Prometheus metrics, read from `SlotTracker` at each scrape.

Totals over all (model_name, tenant_id) partitions, without partition labels: tenants are
chosen by the callers, so labelling by them would let clients grow the series without bound.
Reading costs O(partitions + worker ranks) per scrape and nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_lite.metrics import PREFIX

from .core import SlotTracker

NAMESPACE = PREFIX + "slot_tracker_"


class SlotTrackerCollector(Collector):
    def __init__(self, tracker: SlotTracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[Metric]:
        partitions = list(self.tracker.partitions.values())
        workers = ranks = requests = tracked = decode_blocks = output_blocks = prefill_tokens = 0
        for partition in partitions:
            workers += len(partition.workers)
            ranks += len(partition.slots)
            requests += len(partition.requests)
            tracked += len(partition.holders)
            for slot in partition.slots.values():
                decode_blocks += slot.blocks + slot.output_blocks
                output_blocks += slot.output_blocks
                prefill_tokens += slot.prefill_tokens
        yield GaugeMetricFamily(NAMESPACE + "partitions", "(model_name, tenant_id) partitions", len(partitions))
        yield GaugeMetricFamily(NAMESPACE + "workers", "registered workers", workers)
        yield GaugeMetricFamily(NAMESPACE + "ranks", "registered data-parallel ranks of all workers", ranks)
        yield GaugeMetricFamily(NAMESPACE + "active_requests", "requests added and not yet freed or expired", requests)
        yield GaugeMetricFamily(
            NAMESPACE + "tracked_blocks",
            "distinct block hashes held by active requests, counted once per partition",
            tracked,
        )
        yield GaugeMetricFamily(
            NAMESPACE + "active_decode_blocks",
            "the sum of every rank's active_decode_blocks in /loads",
            decode_blocks,
        )
        yield GaugeMetricFamily(
            NAMESPACE + "output_blocks",
            "output blocks set by /output_blocks for active requests, included in active_decode_blocks",
            output_blocks,
        )
        yield GaugeMetricFamily(
            NAMESPACE + "active_prefill_tokens",
            "the sum of every rank's active_prefill_tokens in /loads",
            prefill_tokens,
        )
        yield CounterMetricFamily(
            NAMESPACE + "expired_requests",
            "requests freed by the TTL sweep because no /free arrived in time",
            self.tracker.expired_total,
        )
        yield GaugeMetricFamily(
            NAMESPACE + "request_ttl_seconds", "age at which an unfreed request expires", self.tracker.request_ttl_secs
        )


__all__ = ["SlotTrackerCollector"]
