"""Selection service replicas (`--nats URL`, remote mode): selectors that share their catalog and
their bookings through a NATS server, so a worker registered with any replica is routed to by
all, and any replica serves any reservation's lifecycle.

The state that routes (cached blocks, loads) is already shared: it lives in the slot tracker and
the indexer of remote mode, which replicate on NATS themselves (docs/replicas.md). What each
selector held alone was its catalog and its reservations; here:

* **The catalog** is a JetStream key-value bucket (`<--nats-stream>_catalog`, one key per worker
  id, the record as registered). A replica that changes a record writes it there after the
  services took the registration; every replica watches the bucket and applies each change to
  its own core, in the bucket's order; a replica that starts reads the whole bucket before it
  answers `/ready`. A change whose revision is not newer than what the replica applied (its own
  write, coming back) is skipped.
* **Bookings** are announced on NATS core subjects (`<prefix>.booking`, fire and forget, as the
  slot tracker's replicas replicate): when a replica books, counts a reservation's progress or
  frees it, the others learn the booking's partition, rank and counts, so a lifecycle call for it
  reaching another replica (its selector died, a load balancer in between) is served there with
  the same counts. A booking nobody frees is forgotten after the request TTL, as the slot
  tracker drops it.

Not shared: pending selections (a `/select` with a `selection_id` is booked by the replica that
answered it) and session bindings (each replica binds the sessions it sees; the cost still
follows the cache, wherever the session's earlier turns went).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_lite.base.errors import ServiceError
from dynamo_lite.durability.nats_connection import ConnectionCounts, NatsCollector, NatsSecurity, connect

from .core import Partition, Reservation, SelectionCore
from .protocols import WorkerRequest, reader

logger = logging.getLogger("dynamo_lite.select_service")

DEFAULT_SUBJECT_PREFIX = "dynamo_lite.select"
DEFAULT_BUCKET_PREFIX = "dynamo_lite_select"
_RECORD_ONLY = ("lifecycle", "not_schedulable_reasons")  # what an answer adds to a registered record


class CatalogNotShared(ServiceError):
    """A catalog change the bucket did not take (NATS away): 503, send it again."""

    status = 503


@dataclass(frozen=True)
class ReplicaSettings:
    url: str
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    bucket_prefix: str = DEFAULT_BUCKET_PREFIX
    security: NatsSecurity = field(default_factory=NatsSecurity)

    @property
    def bucket(self) -> str:
        return f"{self.bucket_prefix}_catalog"


class Booking(msgspec.Struct, array_like=True, frozen=True):
    """What a replica announces of a reservation: enough for another to serve its lifecycle."""

    kind: str  # "book", "progress" or "end"
    origin: str
    selection_id: str
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    prefilled: bool = False
    output_blocks: int = 0
    output_load: float = 0.0
    reported_output_blocks: int = 0
    # Last, with defaults: an announcement from a replica that predates them still decodes.
    expected_output_tokens: int | None = None
    block_size: int = 1


@dataclass(slots=True)
class SharedBooking:
    """Another replica's reservation as this one knows it (the counts of its last announcement)."""

    partition: Partition
    worker_id: int
    dp_rank: int
    seen_at: float
    prefilled: bool = False
    output_blocks: int = 0
    output_load: float = 0.0
    reported_output_blocks: int = 0
    expected_output_tokens: int | None = None
    block_size: int = 1


def record_document(answer: dict[str, Any]) -> bytes:
    """A catalog answer as the registration that makes it again (the bucket's value)."""
    return orjson.dumps({name: value for name, value in answer.items() if name not in _RECORD_ONLY})


class Replicas:
    """The NATS side of a replica: the catalog bucket's watcher and the booking announcements."""

    def __init__(self, settings: ReplicaSettings, core: SelectionCore) -> None:
        self.settings = settings
        self.core = core
        self.origin = secrets.token_hex(8)
        self.client: Client | None = None
        self.connection_counts = ConnectionCounts()
        self.kv: KeyValue | None = None
        self.foreign: OrderedDict[str, SharedBooking] = OrderedDict()  # announcement order = expiry order
        self.applied: dict[int, int] = {}  # worker id -> the bucket revision its record is at here
        self.caught_up = asyncio.Event()
        self.catalog_changes = 0
        self.announcements_received = 0
        self._read_record = reader(WorkerRequest)
        self._watching: asyncio.Task[None] | None = None
        self._pending_removals: dict[int, asyncio.Future[None]] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(Booking).decode

    # --- start and stop -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, subscribe to the announcements and start reading the catalog bucket (`caught_up`
        is set once the whole bucket is applied)."""
        self.client, self.connection_counts = await connect(self.settings.url, name=f"select-{self.origin}",
                                                            security=self.settings.security)
        await self.client.subscribe(f"{self.settings.subject_prefix}.booking", cb=self._announced)
        js = self.client.jetstream()
        try:
            self.kv = await js.key_value(self.settings.bucket)
        except BucketNotFoundError:
            self.kv = await js.create_key_value(bucket=self.settings.bucket, history=1)
        watcher = await self.kv.watchall()
        self._watching = asyncio.create_task(self._watch(watcher))

    async def close(self) -> None:
        for removal in self._pending_removals.values():
            removal.cancel()
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.drain()

    # --- the catalog ----------------------------------------------------------------------------

    async def record_changed(self, worker_id: int, answer: dict[str, Any] | None) -> None:
        """Write a record this replica changed (None: removed) to the bucket."""
        assert self.kv is not None
        key = str(worker_id)
        if answer is None:
            # A removal done here is not undone, and asked again it is a 404: the bucket gets it
            # in the background, however long NATS is away.
            self._pending_removals[worker_id] = asyncio.ensure_future(self._remove(worker_id))
            return
        removal = self._pending_removals.pop(worker_id, None)
        if removal is not None:
            removal.cancel()  # registered again before its removal reached the bucket
        try:
            revision = await self.kv.put(key, record_document(answer))
        except Exception as exc:  # noqa: BLE001 - any NATS failure (not connected, a timeout) is an outage
            # This replica and the services hold the record; the others do not yet. The same
            # request again (an upsert is idempotent) shares it once NATS answers.
            raise CatalogNotShared(f"worker {worker_id}: registered here, but not shared with the other replicas: "
                                   f"NATS: {type(exc).__name__}: {exc}; send the request again") from None
        self.applied[worker_id] = max(self.applied.get(worker_id, 0), revision)

    async def _remove(self, worker_id: int) -> None:
        assert self.kv is not None
        while True:
            try:
                await self.kv.delete(str(worker_id))  # comes back to this replica too: nothing left to remove
            except Exception as exc:  # noqa: BLE001 - retried until NATS answers
                logger.warning("worker %d: its removal is not shared yet (NATS: %s); retrying", worker_id, exc)
                await asyncio.sleep(1.0)
                continue
            self._pending_removals.pop(worker_id, None)
            return

    async def _watch(self, watcher: Any) -> None:
        async for entry in watcher:
            if entry is None:  # the bucket's records as of the watch's start are applied
                self.caught_up.set()
                continue
            try:
                self._apply(entry.key, entry.value, entry.operation, entry.revision)
            except Exception:  # noqa: BLE001 - one bad entry must not stop the watch
                logger.exception("catalog entry %s (revision %s) not applied", entry.key, entry.revision)

    def _apply(self, key: str, value: bytes | None, operation: str | None, revision: int) -> None:
        worker_id = int(key)
        if revision <= self.applied.get(worker_id, 0):
            return  # this replica's own write, or older than what it holds
        self.applied[worker_id] = revision
        self.catalog_changes += 1
        if operation in (KV_DEL, KV_PURGE):
            if worker_id in self.core.catalog:
                self.core.delete_worker(worker_id)
                logger.info("worker %d removed (by another replica)", worker_id)
            return
        assert value is not None
        record, _ = self.core.upsert_worker(self._read_record(value))
        logger.info("worker %d registered (by another replica): %s", worker_id, record["lifecycle"])

    # --- bookings -------------------------------------------------------------------------------

    def announce(self, kind: str, selection_id: str, reservation: Reservation | SharedBooking) -> None:
        """Tell the other replicas about a booking (fire and forget: a lost announcement only means
        another replica cannot serve that booking's lifecycle)."""
        if self.client is None or self.client.is_closed:
            return
        model_name, routing_group = reservation.partition
        message = Booking(kind, self.origin, selection_id, model_name, routing_group, reservation.worker_id,
                          reservation.dp_rank, reservation.prefilled, reservation.output_blocks,
                          reservation.output_load, reservation.reported_output_blocks,
                          reservation.expected_output_tokens, reservation.block_size)
        task = asyncio.ensure_future(self.client.publish(f"{self.settings.subject_prefix}.booking",
                                                         self._encode(message)))
        task.add_done_callback(_logged)

    async def _announced(self, msg: Msg) -> None:
        try:
            booking = self._decode(msg.data)
        except msgspec.DecodeError:
            logger.warning("an unreadable booking announcement on %s", msg.subject)
            return
        self.announcements_received += 1
        self.learn(booking)

    def learn(self, booking: Booking) -> None:
        """Apply another replica's announcement."""
        if booking.origin == self.origin:
            return
        selection_id = booking.selection_id
        own = self.core.reservations.get(selection_id)
        if own is not None:  # a booking of ours, served by another replica
            if booking.kind == "end":
                self.core.free(selection_id)
                return
            if booking.prefilled and not own.prefilled:
                self.core.prefill_complete(selection_id)
            own.output_blocks = max(own.output_blocks, booking.output_blocks)
            own.output_load = booking.output_load
            own.reported_output_blocks = max(own.reported_output_blocks, booking.reported_output_blocks)
            return
        if booking.kind == "end":
            self.foreign.pop(selection_id, None)
            return
        known = self.foreign.pop(selection_id, None)
        partition = (booking.model_name, booking.routing_group)
        shared = known or SharedBooking(partition, booking.worker_id, booking.dp_rank, self.core.clock(),
                                        expected_output_tokens=booking.expected_output_tokens,
                                        block_size=booking.block_size)
        shared.seen_at = self.core.clock()
        shared.prefilled = shared.prefilled or booking.prefilled
        shared.output_blocks = max(shared.output_blocks, booking.output_blocks)
        shared.output_load = booking.output_load
        shared.reported_output_blocks = max(shared.reported_output_blocks, booking.reported_output_blocks)
        self.foreign[selection_id] = shared

    def expire(self) -> int:
        """Forget other replicas' bookings not heard of for the request TTL (the slot tracker has
        dropped them by then); returns how many."""
        horizon = self.core.clock() - self.core.settings.request_ttl_secs
        expired = 0
        while self.foreign:
            selection_id, shared = next(iter(self.foreign.items()))
            if shared.seen_at > horizon:
                break
            del self.foreign[selection_id]
            expired += 1
        return expired


class ReplicaCollector(Collector):
    """`dynamo_lite_select_replica_*` and the NATS connection's `dynamo_lite_nats_*`."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        replicas = self.replicas
        yield from NatsCollector(replicas.client, replicas.connection_counts).collect()
        namespace = "dynamo_lite_select_replica_"
        yield CounterMetricFamily(namespace + "catalog_changes", "catalog changes applied from other replicas",
                                  replicas.catalog_changes)
        yield CounterMetricFamily(namespace + "announcements_received", "booking announcements of other replicas",
                                  replicas.announcements_received)
        yield GaugeMetricFamily(namespace + "shared_bookings", "other replicas' bookings this replica can serve",
                                len(replicas.foreign))


def _logged(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.warning("booking announcement not sent: %s", exc)


__all__ = ["Booking", "CatalogNotShared", "ReplicaCollector", "ReplicaSettings", "Replicas", "SharedBooking", "record_document"]
