"""Indexer replicas on NATS JetStream (`--nats URL`): one stream of writes, one consumer per
replica, snapshots in the object store.

* Every write a replica takes (`/events`, `/register`, `/unregister`, `/routed`, and the batches
  its ZMQ listeners receive) is published to the stream `--nats-stream` (subjects
  `<--nats-subject-prefix>.<kind>`, see `replication`), file-backed, messages kept
  `--nats-retention-secs`. Nothing is applied where it was taken: every replica, the one that
  took it included, applies the stream in stream order through its own durable consumer, so
  all replicas hold the same index.
* Engine batches: every replica subscribed to an engine publishes each batch it receives under
  a message id derived from the batch's bytes; JetStream drops the copies that arrive within
  its duplicate window (`DUPLICATE_WINDOW_SECS`), so a batch is in the stream once however many
  replicas listen, and keeps arriving while any one of them runs.
* Snapshots: a replica puts the index, tagged with the last stream sequence applied, into the
  object store bucket `<stream>_snapshots` when `--nats-snapshot-threshold` messages were applied
  since the stored one, or `--nats-snapshot-interval-secs` passed and anything was. A replica
  starting (or restarting) loads the newest snapshot, then consumes from the next sequence: so
  it needs no message older than the snapshot, and a replica down for longer than the
  retention comes back whole as long as snapshots are taken more often than messages expire
  (checked at start-up).
* Readiness: `/ready` answers 200 once the snapshot is loaded and the replica is within
  `--nats-ready-max-lag` messages of the stream's end, and 503 whenever it falls further behind.

`--reset-state` purges the stream and deletes the snapshot before the replica starts. As the
seed documents warn for Dynamo's `--router-reset-states`: do that only when starting the first
replica; replicas already running keep their index and diverge from the new ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, NamedTuple

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    ObjectMeta,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.object_store import ObjectStore

from dynamo_lite.base.errors import PayloadTooLarge, ServiceError, Unavailable
from dynamo_lite.durability.nats_connection import ConnectionCounts, NatsSecurity, connect, flush
from dynamo_lite.durability.snapshots import SnapshotError

from . import replication
from .core import Indexer
from .listeners import Listeners, Subscription
from .pull import Puller
from .replication import Applied, Batch, Reset

logger = logging.getLogger("dynamo_lite.indexer.nats_replica")

DEFAULT_SUBJECT_PREFIX: Final = "dynamo_lite.indexer"
DEFAULT_STREAM: Final = "DYNAMO_LITE_INDEXER"
DEFAULT_RETENTION_SECS: Final = 3600.0  # as Dynamo's KV event stream
DEFAULT_SNAPSHOT_INTERVAL_SECS: Final = 60.0
DEFAULT_SNAPSHOT_THRESHOLD: Final = 100_000
DEFAULT_READY_MAX_LAG: Final = 1_000
DEFAULT_PUBLISH_TIMEOUT_SECS: Final = 5.0
DUPLICATE_WINDOW_SECS: Final = 120.0  # JetStream's default: longer than any replica lags behind an engine
SNAPSHOT_OBJECT: Final = "index"
FETCH_BATCH: Final = 512
FETCH_TIMEOUT_SECS: Final = 1.0
APPLY_SLICE_SECS: Final = 0.002  # applying hands the event loop back to requests this often
RETRY_SECS: Final = 0.5
INACTIVE_CONSUMER_SECS: Final = 3600.0  # the consumer of a replica gone for good is deleted after this
KEPT_OUTCOMES: Final = 4096  # registration outcomes kept for `publish_and_apply`
VERIFY_SECS: Final = 5.0  # while idle, how often a replica checks that its stream and consumer still exist


@dataclass(frozen=True)
class StreamSettings:
    url: str
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    stream: str = DEFAULT_STREAM
    retention_secs: float = DEFAULT_RETENTION_SECS
    snapshot_interval_secs: float = DEFAULT_SNAPSHOT_INTERVAL_SECS
    snapshot_threshold: int = DEFAULT_SNAPSHOT_THRESHOLD
    ready_max_lag: int = DEFAULT_READY_MAX_LAG
    replica_name: str | None = None  # the durable consumer's name; default: host, pid and a random part
    reset_state: bool = False
    publish_timeout_secs: float = DEFAULT_PUBLISH_TIMEOUT_SECS
    security: NatsSecurity = NatsSecurity()  # --nats-creds, --nats-tls-*

    def check(self) -> None:
        """Settings that cannot work together: ValueError naming them."""
        if self.snapshot_interval_secs * 2 > self.retention_secs:
            raise ValueError(
                f"--nats-snapshot-interval-secs {self.snapshot_interval_secs:g} must be at most half of "
                f"--nats-retention-secs {self.retention_secs:g}: a replica starting from the newest snapshot "
                "needs every message after it still in the stream"
            )
        if not self.stream or any(c in self.stream for c in ".*> \t"):
            raise ValueError(f"--nats-stream {self.stream!r}: a JetStream stream name has no '.', '*', '>' or spaces")


@dataclass
class ReplicaCounts:
    published: int = 0  # messages this replica published (its routes and listeners)
    duplicates: int = 0  # engine batches another replica had published first
    applied: int = 0  # stream messages applied
    refused: int = 0  # stream messages the index refused whole (a conflict since publication...)
    skipped_sequences: int = 0  # stream messages gone (retention) before this replica read them
    snapshots_written: int = 0
    snapshot_seconds: float = 0.0  # of the last one written
    publish_failures: int = 0


def default_replica_name() -> str:
    return f"indexer-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}".replace(".", "-")


class StreamReplica:
    """One indexer replica's side of the stream: publish, consume, snapshot, say how far behind."""

    def __init__(self, indexer: Indexer, listeners: Listeners, settings: StreamSettings) -> None:
        settings.check()
        self.indexer = indexer
        self.listeners = listeners
        self.settings = settings
        self.name = settings.replica_name or default_replica_name()
        self.prefix = settings.subject_prefix
        self.counts = ReplicaCounts()
        self.connection_counts = ConnectionCounts()
        self.client: Client | None = None
        self.applied_sequence = 0  # the last stream message applied (or covered by the snapshot loaded)
        self.snapshot_sequence = 0  # covered by the snapshot this replica loaded or last wrote
        self.lag: int | None = None  # messages in the stream after the last one applied; None: not known yet
        self._js: JetStreamContext | None = None
        self._store: ObjectStore | None = None
        self._outcomes = Outcomes(KEPT_OUTCOMES)
        self._tasks: list[asyncio.Task[None]] = []
        self._consumer_config: ConsumerConfig | None = None
        self._stopping = False
        self._verify_at = 0.0  # loop time of the next look at whether the stream and consumer exist
        self._stream_id = ""  # the incarnation of the stream this replica's sequence numbers are of
        self._puller: Puller | None = None

    # --- start and stop -----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, create the stream and bucket when missing, load the newest snapshot, then
        start consuming after it. Raises when NATS is unreachable or the snapshot unusable."""
        self.client, self.connection_counts = await connect(self.settings.url, name=self.name, security=self.settings.security)
        self._js = self.client.jetstream(timeout=self.settings.publish_timeout_secs)
        self._stream_id = await self._ensure_stream()
        self._store = await self._ensure_bucket()
        if self.settings.reset_state:
            await self._reset()
        await self._load_snapshot()
        await self._subscribe()
        self._tasks = [asyncio.create_task(self._consume(), name="jetstream-consumer"),
                       asyncio.create_task(self._snapshot_periodically(), name="jetstream-snapshots")]

    async def stop(self) -> None:
        # The flag too: on Python 3.11 `asyncio.wait_for` inside nats-py can swallow a
        # cancellation that coincides with a message, and the loops would go on.
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=FETCH_TIMEOUT_SECS * 3)
        logger.debug("shutdown: consumer and snapshot tasks stopped")
        self._outcomes.cancel()
        if self.client is not None:
            try:
                # Not drain(): the consumer is stopped, and what this replica published was
                # acknowledged before it answered; a pull request left on the server would keep
                # a drain waiting for its timeout.
                await flush(self.client, 2.0)
            except Exception as exc:  # noqa: BLE001 - NATS may be away: closing must still finish
                logger.debug("flushing the NATS connection: %s", exc)
            await self.client.close()

    async def _ensure_stream(self) -> str:
        """Create or adjust the stream; returns its incarnation (when it was created): sequence
        numbers and snapshots only mean something within one incarnation."""
        assert self._js is not None
        config = StreamConfig(
            name=self.settings.stream,
            subjects=[f"{self.prefix}.>"],
            storage=StorageType.FILE,
            max_age=self.settings.retention_secs,
            duplicate_window=min(DUPLICATE_WINDOW_SECS, self.settings.retention_secs),
            description="dynamo_lite indexer writes (KV events, registrations, routing decisions)",
        )
        try:
            info = await self._js.stream_info(self.settings.stream)
        except nats.js.errors.NotFoundError:
            info = await self._js.add_stream(config)
            logger.info("created stream %s (subjects %s.>, retention %gs)", config.name, self.prefix,
                        self.settings.retention_secs)
            return _incarnation(info)
        if (info.config.max_age, info.config.subjects, info.config.duplicate_window) != (
                config.max_age, config.subjects, config.duplicate_window):
            await self._js.update_stream(config)
            logger.info("updated stream %s: subjects %s.>, retention %gs", config.name, self.prefix,
                        self.settings.retention_secs)
        return _incarnation(info)

    @property
    def bucket(self) -> str:
        """The object store bucket of the stream's snapshots."""
        return f"{self.settings.stream}_snapshots"

    async def _ensure_bucket(self) -> ObjectStore:
        assert self._js is not None
        bucket = self.bucket
        try:
            return await self._js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            from nats.js.api import ObjectStoreConfig

            return await self._js.create_object_store(bucket, ObjectStoreConfig(
                bucket=bucket, description="dynamo_lite indexer snapshots", storage=StorageType.FILE))

    async def _reset(self) -> None:
        assert self._js is not None and self._store is not None
        logger.warning(
            "--reset-state: purging stream %s and deleting its snapshot. Replicas still running keep their "
            "index and no longer agree with new ones: restart them too", self.settings.stream)
        await self._js.purge_stream(self.settings.stream)
        try:
            await self._store.delete(SNAPSHOT_OBJECT)
        except nats.js.errors.ObjectNotFoundError:
            pass

    async def _load_snapshot(self) -> None:
        assert self._store is not None and self._js is not None
        started = time.perf_counter()
        try:
            result = await self._store.get(SNAPSHOT_OBJECT)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            first = (await self._js.stream_info(self.settings.stream)).state.first_seq
            logger.info("no snapshot in the object store yet: consuming stream %s from its start (seq %d)",
                        self.settings.stream, first)
            self.applied_sequence = max(0, first - 1)
            return
        data = result.data or b""
        try:
            sequence, subscriptions = replication.load_snapshot(self.indexer, data)
        except (ValueError, ServiceError) as exc:
            raise SnapshotError(
                f"the snapshot in bucket {self.bucket} is not usable ({getattr(exc, 'message', exc)}); "
                "delete it (and let a replica write a new one) or start with --reset-state") from None
        for subscription in subscriptions:
            self._listen(subscription)
        first = (await self._js.stream_info(self.settings.stream)).state.first_seq
        taken_of = _parse_description(result.info.description).stream
        if taken_of != self._stream_id:
            logger.error(
                "the snapshot was taken of an earlier stream %s (this one was created %s): its history is gone. "
                "Loading the snapshot's index and applying the new stream from its start", self.settings.stream,
                self._stream_id)
            sequence = max(0, first - 1)
        self.applied_sequence = self.snapshot_sequence = sequence
        if first > sequence + 1:
            self.counts.skipped_sequences += first - sequence - 1
            logger.error(
                "snapshot covers seq %d but the stream starts at %d: messages %d..%d expired before any replica "
                "snapshotted them (is --nats-snapshot-interval-secs well below --nats-retention-secs on every "
                "replica?); what they changed is missing", sequence, first, sequence + 1, first - 1)
        logger.info("loaded snapshot at stream seq %d (%d bytes) in %.2fs", sequence, len(data),
                    time.perf_counter() - started)

    async def _subscribe(self) -> None:
        """This replica's durable consumer, from the message after what it holds. A consumer of
        the same name left by an earlier process is replaced: the index it fed is gone."""
        assert self._js is not None
        try:
            await self._js.delete_consumer(self.settings.stream, self.name)
        except nats.js.errors.NotFoundError:
            pass
        self._consumer_config = ConsumerConfig(
            durable_name=self.name,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.applied_sequence + 1,
            ack_policy=AckPolicy.ALL,
            ack_wait=30.0,
            max_ack_pending=-1,
            inactive_threshold=INACTIVE_CONSUMER_SECS,
            description="one dynamo_lite indexer replica",
        )
        await self._js.add_consumer(self.settings.stream, self._consumer_config)
        if self._puller is None:
            assert self.client is not None
            self._puller = Puller(self.client, self.settings.stream, self.name, self._apply, batch=FETCH_BATCH,
                                  expires_secs=FETCH_TIMEOUT_SECS, slice_secs=APPLY_SLICE_SECS)
            await self._puller.subscribe()

    # --- publishing -----------------------------------------------------------------------------

    async def publish(self, kind: str, data: bytes, *, message_id: str | None = None) -> int:
        """Publish one write; returns its stream sequence once JetStream has stored it (0 for an
        engine batch another replica published first). Unavailable when it did not in time."""
        assert self._js is not None and self.client is not None
        if len(data) > self.client.max_payload:
            raise PayloadTooLarge(
                f"{len(data)} bytes exceed the NATS server's max_payload of {self.client.max_payload}: "
                "raise max_payload in its configuration (8MB allows every document /events accepts), "
                "or post smaller documents")
        if not self.client.is_connected:
            # nats-py would buffer it until a reconnection, after the client was told 503.
            self.counts.publish_failures += 1
            raise Unavailable("not connected to the NATS server (reconnecting): nothing was done, try again")
        headers = {"Nats-Msg-Id": message_id} if message_id is not None else None
        try:
            ack = await self._js.publish(f"{self.prefix}.{kind}", data, headers=headers)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            self.counts.publish_failures += 1
            self._verify_at = 0.0  # the stream may be gone: the consumer loop looks at once
            raise Unavailable(
                f"the NATS server did not acknowledge the write in time ({type(exc).__name__}): it may or may "
                "not be applied; repeating it is safe (event ids already applied are skipped, a routing report "
                "only refreshes, a registration answers 409)") from None
        if ack.duplicate:
            self.counts.duplicates += 1
            return 0
        self.counts.published += 1
        return ack.seq

    async def publish_and_apply(self, kind: str, data: bytes) -> Applied:
        """Publish, then wait until this replica has applied the message (a write whose answer
        depends on the index: a registration may conflict). A replica further behind than the
        publish timeout answers Unavailable, though the write is in the stream and will apply."""
        sequence = await self.publish(kind, data)
        try:
            return await self._outcomes.wait(sequence, sequence <= self.applied_sequence,
                                             self.settings.publish_timeout_secs)
        except asyncio.TimeoutError:
            raise Unavailable(
                f"stored in the stream (seq {sequence}) but not applied by this replica within "
                f"{self.settings.publish_timeout_secs:g}s (it is {self.lag} messages behind): it will apply; "
                "do not repeat the call") from None

    # The ZMQ listeners' side (`listeners.BatchPublisher`): retried until stored, so a listener
    # waits (and its engine's socket queues) while NATS is unreachable.

    async def publish_batch(self, subscription: Subscription, seq: int, payload: bytes) -> None:
        batch = Batch(subscription.model_name, subscription.tenant_id, subscription.block_size,
                      subscription.worker_id, subscription.dp_rank, seq, payload)
        kind, data = replication.encode(batch)
        await self._publish_until_stored(kind, data, replication.batch_message_id(batch))

    async def publish_reset(self, subscription: Subscription, ranks: list[tuple[int, int]], seq: int,
                            payload: bytes) -> None:
        reset = Reset(subscription.model_name, subscription.tenant_id, sorted(ranks), seq)
        kind, data = replication.encode(reset)
        await self._publish_until_stored(kind, data, replication.reset_message_id(reset, payload))

    async def _publish_until_stored(self, kind: str, data: bytes, message_id: str) -> None:
        warned = False
        while True:
            try:
                await self.publish(kind, data, message_id=message_id)
                if warned:
                    logger.info("engine batches are stored in the stream again")
                return
            except Unavailable as exc:
                if not warned:
                    logger.warning("cannot store an engine batch (%s); retrying every %.1fs", exc.message, RETRY_SECS)
                    warned = True
                await asyncio.sleep(RETRY_SECS)

    # --- consuming ----------------------------------------------------------------------------

    async def _consume(self) -> None:
        """Pull and apply (`pull.Puller`) until stopped; between pull requests, look after the
        lag and whether the stream and consumer still exist."""
        assert self.client is not None and self._puller is not None
        loop = asyncio.get_running_loop()
        while not self._stopping:
            pulled = await self._puller.pull()
            if not pulled.answered:
                await asyncio.sleep(RETRY_SECS if not self.client.is_connected else 0)
                self._verify_at = 0.0
            if pulled.count == 0 and pulled.status in ("404", "408"):
                self.lag = 0  # nothing pending: caught up, or the stream is gone (a pull cannot tell)
            if pulled.status == "409" or (pulled.count == 0 and loop.time() >= self._verify_at):
                self._verify_at = loop.time() + VERIFY_SECS
                await self._resubscribe_if_lost()

    def _apply(self, message: Msg) -> None:
        metadata = message.metadata
        sequence = metadata.sequence.stream
        if sequence <= self.applied_sequence:
            return  # redelivered (an ack lost in a reconnection)
        if sequence != self.applied_sequence + 1:
            missing = sequence - self.applied_sequence - 1
            self.counts.skipped_sequences += missing
            logger.error("stream messages %d..%d expired before this replica read them: what they changed is "
                         "missing here", self.applied_sequence + 1, sequence - 1)
        kind = message.subject[len(self.prefix) + 1:]
        applied = replication.apply(self.indexer, kind, message.data)
        self.applied_sequence = sequence
        self.lag = metadata.num_pending
        self.counts.applied += 1
        if applied.error is not None:
            self.counts.refused += 1
            # A refused registration was answered to its client already (it waited for it).
            level = logging.INFO if kind in (replication.REGISTER, replication.UNREGISTER) else logging.WARNING
            if self.counts.refused <= 10 or self.counts.refused % 1000 == 0:
                logger.log(level, "stream seq %d (%s) refused: %s", sequence, kind, applied.error.message)
        if applied.listener is not None and applied.report is not None:
            self.listeners.count_applied(applied.listener, applied.report)  # /workers as without NATS
        for subscription in applied.subscribe:
            self._listen(subscription)
        if applied.unsubscribe:
            self.listeners.stop(applied.unsubscribe)
        self._outcomes.settle(sequence, applied, keep=kind in (replication.REGISTER, replication.UNREGISTER))

    def _listen(self, subscription: Subscription) -> None:
        if self.listeners.get(subscription.key) is None:
            self.listeners.start(subscription)
            logger.info("worker %d dp_rank %d: subscribing to %s", subscription.worker_id, subscription.dp_rank,
                        subscription.endpoint)

    async def _resubscribe_if_lost(self) -> None:
        """After a NATS server came back without its store (or someone deleted the stream or this
        consumer): create what is missing and carry on from where this replica is. A stream that
        starts over has lost its history; every replica keeps the index it holds and applies
        the new stream from its start, so they still agree with each other."""
        assert self._js is not None
        try:
            await self._js.consumer_info(self.settings.stream, self.name)
            return
        except nats.js.errors.NotFoundError:
            pass
        except Exception:  # noqa: BLE001 - still disconnected: the fetch loop retries
            return
        history_lost = False
        try:
            incarnation = await self._ensure_stream()
            self._store = await self._ensure_bucket()
            if incarnation != self._stream_id:
                state = (await self._js.stream_info(self.settings.stream)).state
                logger.error(
                    "stream %s starts over (created %s; this replica applied seq %d of the one created %s): its "
                    "history is gone. Keeping the index held here and applying the new stream from its start",
                    self.settings.stream, incarnation, self.applied_sequence, self._stream_id)
                self._stream_id = incarnation
                self.applied_sequence = max(0, state.first_seq - 1)
                self.snapshot_sequence = 0
                history_lost = True
            logger.warning("consumer %s is gone from the server: creating it again from seq %d", self.name,
                           self.applied_sequence + 1)
            await self._subscribe()
        except Exception as exc:  # noqa: BLE001 - retried at the next failure
            logger.warning("recreating the stream or the consumer: %s: %s", type(exc).__name__, exc)
            return
        if history_lost:
            try:
                await self._keep_history()
            except Exception as exc:  # noqa: BLE001 - consuming goes on; the periodic check writes one later
                logger.warning("snapshot of the history the stream lost not written: %s: %s (the periodic check "
                               "writes one after the first new message)", type(exc).__name__, exc)

    async def _keep_history(self) -> None:
        """Right after the stream started over: put what this replica holds into the object store
        at once, as of the new stream's start, unless a replica did so already. Replicas started
        from then on load the history the stream lost; the periodic check would wait for the first
        new message, which on a quiet fleet may never come."""
        assert self._store is not None
        try:
            stored = _parse_description((await self._store.get_info(SNAPSHOT_OBJECT)).description)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            stored = None
        if stored is not None and stored.stream == self._stream_id:
            return  # another survivor was first
        snapshot = replication.collect(self.indexer, self.applied_sequence)
        if snapshot.ranks or snapshot.partitions:
            await self.write_snapshot(snapshot)

    # --- readiness and snapshots --------------------------------------------------------------

    def not_ready(self) -> str | None:
        """Why `/ready` is 503, or None when the replica is within the lag bound."""
        if self.lag is None:
            return "not ready: catching up with the stream"
        if self.lag > self.settings.ready_max_lag:
            return f"not ready: {self.lag} stream messages behind (--nats-ready-max-lag {self.settings.ready_max_lag})"
        return None

    async def _snapshot_periodically(self) -> None:
        """Look every few seconds (jittered, so replicas rarely write at once) whether the stored
        snapshot is due for renewal, and write it when so."""
        check_every = min(5.0, self.settings.snapshot_interval_secs / 2)
        while not self._stopping:
            await asyncio.sleep(check_every * random.uniform(0.5, 1.5))
            try:
                if await self._snapshot_due():
                    await self.write_snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS may be away: try again later
                logger.warning("snapshot not written: %s: %s", type(exc).__name__, exc)

    async def _snapshot_due(self) -> bool:
        assert self._store is not None and self._js is not None
        if _incarnation(await self._js.stream_info(self.settings.stream)) != self._stream_id:
            self._verify_at = 0.0  # a new stream: the consumer loop starts over first
            return False
        try:
            info = await self._store.get_info(SNAPSHOT_OBJECT)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return self.applied_sequence > 0
        return snapshot_due(_parse_description(info.description), self._stream_id, self.applied_sequence,
                            self.settings, time.time())

    async def write_snapshot(self, snapshot: replication.Snapshot | None = None) -> int:
        """Put the index as of now (or `snapshot`, collected now) into the object store; returns
        the sequence it covers."""
        assert self._store is not None
        started = time.perf_counter()
        if snapshot is None:
            snapshot = replication.collect(self.indexer, self.applied_sequence)
        data = await asyncio.to_thread(lambda: b"".join(replication.encode_snapshot(snapshot)))
        await self._store.put(SNAPSHOT_OBJECT, data, meta=ObjectMeta(
            name=SNAPSHOT_OBJECT,
            description=f"sequence={snapshot.sequence} time={time.time():.3f} stream={self._stream_id} by={self.name}"))
        self.snapshot_sequence = snapshot.sequence
        self.counts.snapshots_written += 1
        self.counts.snapshot_seconds = time.perf_counter() - started
        logger.info("wrote snapshot at stream seq %d: %d bytes, %s, %.2fs", snapshot.sequence, len(data),
                    replication.describe(snapshot.ranks), self.counts.snapshot_seconds)
        return snapshot.sequence


class Outcomes:
    """What applying stream messages did, for the writers waiting on it (`publish_and_apply`):
    each waiter gets the outcome of its sequence; the last `keep` registrations' outcomes are
    kept too (they are rare: a few per worker), for a writer the consumer overtook."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._waiters: dict[int, asyncio.Future[Applied]] = {}
        self._kept: OrderedDict[int, Applied] = OrderedDict()

    def settle(self, sequence: int, applied: Applied, *, keep: bool) -> None:
        if keep:
            self._kept[sequence] = applied
            if len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        waiter = self._waiters.get(sequence)
        if waiter is not None and not waiter.done():
            waiter.set_result(applied)

    async def wait(self, sequence: int, applied_already: bool, timeout: float) -> Applied:
        """The outcome of `sequence`; asyncio.TimeoutError when it is not applied within `timeout`."""
        if applied_already:
            # The consumer may take the message before the writer resumes from the ack.
            outcome = self._kept.get(sequence)
            if outcome is not None:
                return outcome
        waiter = self._waiters[sequence] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        finally:
            self._waiters.pop(sequence, None)

    def cancel(self) -> None:
        for waiter in self._waiters.values():
            waiter.cancel()


def snapshot_due(stored: SnapshotTag, stream_id: str, applied_sequence: int, settings: StreamSettings,
                 now: float) -> bool:
    """Whether a replica that applied up to `applied_sequence` of the stream `stream_id` should
    replace the stored snapshot `stored` (its tag) at Unix time `now`."""
    if stored.stream != stream_id:
        return True  # of an earlier stream
    ahead = applied_sequence - stored.sequence
    if ahead <= 0:
        return False
    return ahead >= settings.snapshot_threshold or now - stored.time >= settings.snapshot_interval_secs


class SnapshotTag(NamedTuple):
    sequence: int  # the last stream message the snapshot covers
    time: float  # Unix time it was written
    stream: str  # the incarnation of the stream it was taken of


def _parse_description(description: str | None) -> SnapshotTag:
    fields = dict(part.partition("=")[::2] for part in (description or "").split())
    try:
        return SnapshotTag(int(fields.get("sequence", 0)), float(fields.get("time", 0.0)), fields.get("stream", ""))
    except ValueError:
        return SnapshotTag(0, 0.0, "")


def _incarnation(info: StreamInfo) -> str:
    return info.created.isoformat() if info.created is not None else ""


__all__ = ["StreamReplica", "StreamSettings"]
