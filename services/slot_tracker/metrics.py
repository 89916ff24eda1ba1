"""The slot tracker's own Prometheus metrics, read from `SlotTracker` at each scrape.

Totals over all (model_name, tenant_id) partitions, without partition labels: tenants are
chosen by the callers, so labelling by them would let clients grow the series without bound.
Reading costs O(partitions + worker ranks) per scrape and nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_lite.web.metrics import PREFIX

from .core import SlotTracker

if TYPE_CHECKING:  # replication is imported only with --nats
    from .nats_replica import NatsReplication

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


class ReplicationCollector(Collector):
    """`dynamo_lite_slot_tracker_replication_*` (with `--nats`), and the connection's own
    `dynamo_lite_nats_*`. Read from the replica's counters at each scrape."""

    def __init__(self, sync: NatsReplication) -> None:
        self.sync = sync

    def collect(self) -> Iterator[Metric]:
        from dynamo_lite.durability.nats_connection import NatsCollector

        from .replication import DELAY_BUCKETS

        sync = self.sync
        replica = sync.replica
        counts, shell = replica.counts, sync.counts
        name = NAMESPACE + "replication_"
        for metric, value, text in (
            ("ops_published", counts.published, "ops of this replica's writes published to NATS"),
            ("ops_applied", counts.applied, "ops of other replicas applied here"),
            ("ops_duplicate", counts.duplicates, "ops received again (already applied) and skipped"),
            ("conflicts", counts.conflicts,
             "adds of a request id another replica added at the same time; the smaller origin's add was kept"),
            ("late_adds", counts.late_adds, "adds that arrived after their request's free and were ignored"),
            ("unplaced_adds", counts.unplaced, "adds this replica could not apply (unknown worker or rank here)"),
            ("topology_conflicts", counts.topology_conflicts,
             "registrations of other replicas refused here (the worker exists with other ranks, "
             "or the block size differs)"),
            ("gaps", counts.gaps, "jumps in another replica's sequence numbers: ops lost on the way"),
            ("replays", shell.replays_requested, "requests to another replica to publish lost ops again"),
            ("replays_answered", shell.replays_answered, "such requests of other replicas this replica answered"),
            ("resyncs", shell.resyncs, "whole states loaded after the start, because lost ops could not be replayed"),
            ("lost_ops", counts.lost, "ops given up on: no replica could send them again"),
            ("states_sent", shell.states_sent, "whole states sent to joining or resyncing replicas"),
            ("unconfirmed_answers", shell.unconfirmed,
             "writes answered before the NATS server acknowledged their publication (disconnected, or past "
             "--nats-publish-timeout-secs)"),
            ("publish_failures", shell.publish_failures,
             "batches the NATS client refused (its buffer full while disconnected)"),
            ("undecodable_messages", shell.undecodable,
             "messages on the replicas' subjects that are no batch or heartbeat"),
        ):
            yield CounterMetricFamily(name + metric, text, value)
        yield GaugeMetricFamily(name + "origins", "other replicas heard from", len(replica.vector) - 1)
        yield GaugeMetricFamily(name + "remembered_request_ids",
                                "request ids whose ops this replica remembers (active ones, and tombstones for a TTL)",
                                replica.remembered())
        yield GaugeMetricFamily(name + "resyncing", "1 while a whole state is being loaded", int(sync.resyncing))
        yield GaugeMetricFamily(name + "last_delay_seconds",
                                "from the acceptance of the last batch applied here to its application",
                                counts.last_delay)
        buckets = []
        running = 0
        for bound, count in zip([repr(bound) for bound in DELAY_BUCKETS] + ["+Inf"], counts.delay_buckets):
            running += count
            buckets.append((bound, running))
        yield HistogramMetricFamily(name + "delay_seconds",
                                    "from a batch's acceptance on another replica to its application here",
                                    buckets=buckets, sum_value=counts.delay_sum)
        yield from NatsCollector(sync.client, sync.connection_counts).collect()


__all__ = ["ReplicationCollector", "SlotTrackerCollector"]
