"""The indexer's own Prometheus metrics, read from `Indexer` at each scrape.

Totals over all (model_name, tenant_id) partitions, without partition labels: tenants are
chosen by the callers, so labelling by them would let clients grow the series without bound.
Reading costs O(partitions + worker ranks x tiers) per scrape and nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_lite.web.metrics import PREFIX

from .core import Indexer
from .engine_events import IGNORE_REASONS
from .listeners import Listeners
from .protocols import STORAGE_TIERS

if TYPE_CHECKING:  # replication is imported only with --nats
    from .nats_replica import StreamReplica

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
            "events of /events documents and engine batches by outcome: applied, skipped (in a "
            "batch already seen: a re-delivery) or rejected (refused by the index, e.g. an "
            "unknown parent)",
            labels=["outcome"],
        )
        events.add_metric(["applied"], indexer.events_applied_total)
        events.add_metric(["skipped"], indexer.events_skipped_total)
        events.add_metric(["rejected"], indexer.events_rejected_total)
        yield events
        yield CounterMetricFamily(
            NAMESPACE + "event_gaps",
            "/events batches whose event_id skipped ahead of the rank's last one + 1 (events were lost)",
            indexer.event_gaps_total,
        )
        yield CounterMetricFamily(
            NAMESPACE + "evicted_blocks",
            "blocks evicted, least recently used first, to keep a partition within --max-blocks",
            getattr(indexer, "evicted_blocks_total", 0),
        )
        yield GaugeMetricFamily(
            NAMESPACE + "approximate_blocks",
            "(rank, block) approximations held now: blocks of requests reported to /routed, per rank",
            indexer.approximate_blocks(),
        )
        yield CounterMetricFamily(
            NAMESPACE + "approximate_blocks_expired",
            "approximations dropped because their TTL (--approx-ttl-secs) ran out",
            indexer.approx_totals.expired,
        )
        yield CounterMetricFamily(
            NAMESPACE + "approximate_blocks_evicted",
            "approximations dropped, first to expire first, to keep a partition within --approx-max-blocks",
            indexer.approx_totals.evicted,
        )
        yield GaugeMetricFamily(
            NAMESPACE + "approximate_ttl_seconds", "the configured --approx-ttl-secs", indexer.approx_ttl_secs
        )


class ListenerCollector(Collector):
    """Totals of every ZMQ listener since start-up (listeners of unregistered ranks included),
    and how many listeners are in each state now."""

    def __init__(self, listeners: Listeners) -> None:
        self.listeners = listeners

    def collect(self) -> Iterator[Metric]:
        totals = self.listeners.totals
        zmq = NAMESPACE + "zmq_"
        states = GaugeMetricFamily(zmq + "listeners", "engine listeners by state", labels=["status"])
        for status, count in self.listeners.status_counts().items():
            states.add_metric([status], count)
        yield states
        for name, value, text in (
            ("batches", totals.batches, "engine batches applied, live or replayed"),
            ("events", totals.events, "events of those batches applied to the index"),
            ("rejected_events", totals.rejected, "stores of those batches the index refused (e.g. unknown parent)"),
            ("decode_failures", totals.decode_failures,
             "engine messages dropped whole: undecodable payload, wrong frame count or seq length"),
            ("gaps", totals.gaps, "jumps in an engine's batch sequence numbers"),
            ("lost_batches", totals.lost_batches, "batches of those jumps that no replay delivered"),
            ("replays", totals.replays, "replay requests sent to engines, repeated ones included"),
            ("replayed_batches", totals.replayed_batches, "batches applied from replays"),
            ("replay_failures", totals.replay_failures,
             "replays given up: every request of one left unfinished for --replay-timeout-secs"),
            ("restarts", totals.restarts, "engine restarts detected (sequence numbers back to 0)"),
        ):
            yield CounterMetricFamily(zmq + name, text, value)
        ignored = CounterMetricFamily(
            zmq + "ignored_events",
            "engine events received but not indexed, by reason (unknown medium, another KV-cache "
            "group, block size mismatch, no full block, Ignored tag)",
            labels=["reason"],
        )
        for reason in IGNORE_REASONS:
            ignored.add_metric([reason], totals.ignored.get(reason, 0))
        yield ignored




_COUNTER_HELP: Final = {
    "published": "writes this replica published to the stream (its routes and its ZMQ listeners)",
    "duplicates": "engine batches this replica published that another replica had published first",
    "applied": "stream messages this replica applied",
    "refused": "stream messages the index refused whole (e.g. a registration that conflicts)",
    "skipped_sequences": "stream messages that expired before this replica read them",
    "snapshots_written": "snapshots this replica put into the object store",
    "publish_failures": "writes the NATS server did not store in time (answered 503, or retried for engines)",
}


class ReplicationCollector(Collector):
    """`dynamo_lite_indexer_replica_*`: how far behind this replica is and what it published;
    `dynamo_lite_nats_*`: its connection."""

    def __init__(self, replica: StreamReplica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        from dynamo_lite.durability.nats_connection import NatsCollector

        replica = self.replica
        for name, text in _COUNTER_HELP.items():
            yield CounterMetricFamily(f"dynamo_lite_indexer_replica_{name}", text, getattr(replica.counts, name))
        yield GaugeMetricFamily("dynamo_lite_indexer_replica_applied_sequence",
                                "the last stream sequence this replica applied", replica.applied_sequence)
        yield GaugeMetricFamily("dynamo_lite_indexer_replica_lag",
                                "stream messages after the last one applied (-1: not known yet)",
                                -1 if replica.lag is None else replica.lag)
        yield GaugeMetricFamily("dynamo_lite_indexer_replica_snapshot_sequence",
                                "the stream sequence of the snapshot this replica loaded or last wrote",
                                replica.snapshot_sequence)
        yield GaugeMetricFamily("dynamo_lite_indexer_replica_snapshot_seconds",
                                "time the last snapshot this replica wrote took", replica.counts.snapshot_seconds)
        yield from NatsCollector(replica.client, replica.connection_counts).collect()


__all__ = ["IndexerCollector", "ListenerCollector", "ReplicationCollector"]
