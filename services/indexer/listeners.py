"""Subscribing to engines: one ZMQ listener per registered (instance, dp_rank) with an endpoint.

A listener connects a SUB socket (empty subscription: every topic) to the engine's PUB socket
and applies each batch to the `Indexer` on the event loop, between HTTP requests, so the index
is never touched from two threads. Reading is asynchronous (zmq.asyncio): a dead, slow or
unreachable engine only leaves its own listener waiting. Applying takes turns: one batch at a
time across all listeners, one per turn of the event loop, so HTTP requests are served between
any two batches and queries keep their latency however many engines publish.

Sequence numbers (one per batch, counting from 0 per publisher socket) decide what a batch is:

* the next one (last + 1) is applied;
* a jump is a gap. With a `replay_endpoint` the listener asks the engine's ROUTER socket for
  the missing batches (a DEALER sends `[b"", start_seq as 8 bytes BE]`; the engine answers
  `[b"", seq, payload]` (older vLLM) or `[b"", topic, seq, payload]` (vLLM 0.33, SGLang) per
  buffered batch, then an end marker of seq -1 with an empty payload), applies them in order,
  then the live batch. Whatever the engine no longer has, or everything without a replay
  endpoint, is counted as lost. The replay deadline (`replay_timeout_secs`) runs from the last
  answer received, and only while this process runs: a listener paused (SIGSTOP, a VM
  migration, memory pressure) for longer finds the answers waiting and reads them. An engine
  that stays silent that long is asked again from the first batch still missing, a few times
  with backoff (`REPLAY_ATTEMPTS`), before what it did not deliver is counted as lost;
* a number at or below the last one applied cannot be a repeat (PUB/SUB does not deliver a
  message twice): the engine restarted and counts from 0 again. Its old blocks are gone with
  it, so every rank this listener feeds is reset (blocks and watermark) and rebuilt from what
  the new engine sends, replaying its first batches when they were missed. (Dynamo 1.6.1
  drops every batch of a restarted engine until its count passes the old one, and keeps the
  stale blocks.)
* the first batch a listener receives may have any number: an engine that ran before the
  indexer subscribed. With a replay endpoint, what the engine still buffers from seq 0 on is
  replayed first; either way it is not a gap in what this listener followed.

A batch that does not decode is dropped whole and counted; it still advances the count (a
replay would only deliver it again). Counters per listener show in `/workers`, their totals in
`/metrics`.

Status: `connecting` until the engine has answered the ZMQ handshake (an open TCP connection is
not an engine: anything may accept it), `active` from then on (or from the first batch), back
to `connecting` while ZMQ reconnects, with the reason in `error` (refused, handshake failed,
disconnected) until the engine answers again; `error` when the listener stopped. Each change
is logged once, not every reconnection attempt.

With replicas (`--nats`), a listener applies nothing itself: it hands each batch it decoded,
and each restart it noticed, to a `BatchPublisher` (the replica's stream), and every replica
applies them from there. It decides what is new, replays and counts exactly as above, except
`events` and `rejected`: only the index can tell them apart, so each replica counts them
when it applies the batch from the stream (`Listeners.count_applied`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dynamo_lite.base.errors import InvalidArgument, NotFound

from .core import ApplyReport, Indexer
from .engine_events import DecodedBatch, MalformedBatch, decode_batch
from .tree import WorkerKey

logger = logging.getLogger("dynamo_lite.indexer.listeners")

Status = Literal["connecting", "active", "error", "closed"]
STATUSES: Final[tuple[Status, ...]] = ("connecting", "active", "error", "closed")

END_OF_REPLAY: Final = b"\xff" * 8  # seq -1 as 8 bytes, signed big-endian
DEFAULT_REPLAY_TIMEOUT_SECS: Final = 5.0
REPLAY_ATTEMPTS: Final = 3  # requests for one gap before the batches still missing count as lost
REPLAY_BACKOFF_SECS: Final = 0.5  # before the second request; doubled before each next one
# The replay deadline advances in slices of waiting: a slice that took longer than this (the
# process was stopped in it) counts for no more, so a pause never uses the deadline up.
REPLAY_WAIT_SLICE_SECS: Final = 0.1
# A ZMQ peer answers the handshake at once; a TCP listener that says nothing for this long is
# not an engine publisher (libzmq's default is 30 s).
HANDSHAKE_TIMEOUT_MS: Final = 5_000
MONITOR_EVERY: Final = 256  # live batches between two looks at the connection events while busy
# A SUB socket's queue while the loop is busy elsewhere (a replay, a burst of queries): as deep
# as vLLM's and SGLang's own publisher high-water mark, so a burst is queued, not dropped.
RECEIVE_HIGH_WATER_MARK: Final = 100_000
_HANDSHAKE_FAILED: Final = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                             | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MONITORED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
              | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)

_TCP: Final = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]\s]+):(\d{1,5})$")


def validate_endpoint(endpoint: str, what: str = "ZMQ endpoint") -> str:
    """`endpoint` when a SUB or DEALER socket can connect to it (tcp://host:port, ipc://path,
    inproc://name); InvalidArgument (400) naming the problem otherwise."""
    scheme, separator, address = endpoint.partition("://")
    if not separator:
        raise InvalidArgument(f"invalid {what} `{endpoint}`: missing scheme")
    if scheme == "tcp":
        match = _TCP.match(endpoint)
        if match is None or not 0 < int(match.group(2)) <= 65535 or match.group(1) == "*":
            raise InvalidArgument(f"invalid {what} `{endpoint}`: expected tcp://host:port with a port in 1..65535")
    elif scheme in ("ipc", "inproc"):
        if not address:
            raise InvalidArgument(f"invalid {what} `{endpoint}`: empty {scheme} address")
    else:
        raise InvalidArgument(f"invalid {what} `{endpoint}`: scheme must be tcp, ipc or inproc")
    return endpoint


def _handshake_failure(event: int, value: int) -> str:
    """What a HANDSHAKE_FAILED_* monitor event's value means."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"authentication refused (status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"ZMTP protocol error {value:#x}"
    # libzmq's handshake timer expired: it reports EAGAIN, ETIMEDOUT or (seen on CI) EINPROGRESS.
    if value in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINPROGRESS):
        return f"no answer within {HANDSHAKE_TIMEOUT_MS / 1000:g} s"
    return os.strerror(value) if value else "the connection closed"


@dataclass(slots=True)
class ListenerCounts:
    """What listeners saw; one per listener, and one for the totals since start-up."""

    batches: int = 0  # applied, live or replayed
    events: int = 0  # indexed events of those batches
    ignored: Counter[str] = field(default_factory=Counter)  # received, not indexed, by reason
    rejected: int = 0  # stores the index refused (unknown parent, ...)
    decode_failures: int = 0  # batches dropped whole: undecodable payload or wrong frames
    gaps: int = 0  # jumps in the sequence
    lost_batches: int = 0  # batches of those jumps that no replay delivered
    replays: int = 0  # replay requests sent
    replayed_batches: int = 0
    replay_failures: int = 0  # replays given up: REPLAY_ATTEMPTS requests left unfinished
    restarts: int = 0  # engine restarts detected


@dataclass(slots=True)
class ReplayDeadline:
    """When one replay request stops waiting for its engine: the pure part of
    `EngineListener._request_replay`, which does the reading and waiting it decides.

    The deadline runs from the last answer received, not from the request, and counts only
    time this process ran: each wait counts for at most the slice it was asked to last, so a
    process stopped in the middle of one (SIGSTOP, a debugger, a paused VM) finds the deadline
    where it was. An answer that has arrived is always read, whatever the deadline says."""

    timeout_secs: float
    quiet_secs: float = 0.0  # waited since the last answer (or the request), pauses not counted

    def next_wait(self, answer_waiting: bool) -> float | None:
        """0.0: read the answer waiting; seconds: wait that long for one; None: give up."""
        if answer_waiting:
            return 0.0
        if self.quiet_secs >= self.timeout_secs:
            return None
        return min(REPLAY_WAIT_SLICE_SECS, self.timeout_secs - self.quiet_secs)

    def waited(self, asked_secs: float, took_secs: float) -> None:
        """A wait asked to last `asked_secs` returned after `took_secs` (more: the process was
        stopped in it)."""
        self.quiet_secs += min(took_secs, asked_secs)

    def answered(self) -> None:
        self.quiet_secs = 0.0


class BatchPublisher(Protocol):
    """Where listeners send what they receive when the index is replicated (`--nats`)."""

    async def publish_batch(self, subscription: Subscription, seq: int, payload: bytes) -> None: ...

    async def publish_reset(self, subscription: Subscription, ranks: list[WorkerKey], seq: int,
                            payload: bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class Subscription:
    """Where one rank's engine publishes, and the partition its events belong to."""

    model_name: str
    tenant_id: str
    block_size: int
    worker_id: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)


class EngineListener:
    """One engine publisher socket, applied to the index by one asyncio task."""

    def __init__(
        self,
        indexer: Indexer,
        subscription: Subscription,
        context: zmq.asyncio.Context,
        totals: ListenerCounts,
        turn: asyncio.Lock,
        *,
        replay_timeout_secs: float = DEFAULT_REPLAY_TIMEOUT_SECS,
        publisher: BatchPublisher | None = None,
    ) -> None:
        """`turn` is shared by every listener of the process: held while a batch is applied.
        With a `publisher`, batches and restarts go to it instead of the index."""
        self.indexer = indexer
        self.publisher = publisher
        self.turn = turn
        self.subscription = subscription
        self.context = context
        self.totals = totals
        self.replay_timeout_secs = replay_timeout_secs
        self.status: Status = "connecting"
        self.error: str | None = None
        self.counts = ListenerCounts()
        self.last_seq: int | None = None
        self.first_seq: int | None = None  # the first sequence number received
        self.last_batch_at: float | None = None  # time.time() of the last applied batch
        self._fed: set[WorkerKey] = {subscription.key}  # ranks this listener's batches named
        self._tcp_up = False  # a TCP connection opened since the last reconnection attempt
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"zmq-listener-{self.subscription.worker_id}-{self.subscription.dp_rank}"
        )

    def cancel(self) -> None:
        """Stop now: no batch is applied after this returns (the task only runs again to close
        its sockets)."""
        if self._task is not None:
            self._task.cancel()
        self.status = "closed"

    async def close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.status = "closed"

    def info(self) -> dict[str, Any]:
        counts = self.counts
        return {
            "status": self.status,
            "error": self.error,
            "endpoint": self.subscription.endpoint,
            "replay_endpoint": self.subscription.replay_endpoint,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "last_batch_at": self.last_batch_at,
            "batches": counts.batches,
            "events": counts.events,
            "ignored_events": dict(counts.ignored),
            "rejected_events": counts.rejected,
            "decode_failures": counts.decode_failures,
            "gaps": counts.gaps,
            "lost_batches": counts.lost_batches,
            "replays": counts.replays,
            "replayed_batches": counts.replayed_batches,
            "replay_failures": counts.replay_failures,
            "restarts": counts.restarts,
        }

    # --- the receive loop -------------------------------------------------------------------

    async def _run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        monitor = sub.get_monitor_socket(_MONITORED)
        # The asyncio sockets wait; reads go through plain shadows of them, which return frames
        # (or raise Again) instead of a Future per message.
        sub_reader: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        monitor_reader: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        try:
            sub.connect(self.subscription.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            received = 0
            while True:
                try:
                    frames = sub_reader.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    # Idle: wait for the next message or connection event.
                    ready = dict(await poller.poll())
                    if monitor in ready:
                        self._read_monitor(monitor_reader)
                    continue
                await self._receive(frames)
                received += 1
                if received % MONITOR_EVERY == 0:
                    self._read_monitor(monitor_reader)
                # With no other listener waiting for `turn`, this one would go on without
                # handing the loop back: yield once per batch.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except NotFound:
            # The partition went away under us (its last worker was unregistered).
            self.status = "closed"
        except Exception as exc:  # noqa: BLE001 - a listener must say why it stopped, never vanish
            self.status = "error"
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception(
                "listener of worker %d dp_rank %d (%s) stopped",
                self.subscription.worker_id, self.subscription.dp_rank, self.subscription.endpoint,
            )
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)
                self._dealer = None

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = parse_monitor_message(frames)
            self._on_connection_event(message["event"], message["value"])

    def _on_connection_event(self, event: int, value: int) -> None:
        endpoint = self.subscription.endpoint
        if event == zmq.EVENT_CONNECTED:
            self._tcp_up = True  # not yet an engine: `active` waits for the handshake
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._set_state("active", None)
        elif event & _HANDSHAKE_FAILED:
            self._set_state("connecting", f"no ZMQ handshake with {endpoint} (is it an engine's publisher?): "
                                          f"{_handshake_failure(event, value)}")
        elif event == zmq.EVENT_DISCONNECTED:
            if self.status == "active":
                self._set_state("connecting", f"{endpoint} closed the connection; reconnecting")
        elif event == zmq.EVENT_CONNECT_RETRIED:
            if not self._tcp_up:
                self._set_state("connecting", f"cannot connect to {endpoint}: refused or unreachable; retrying")
            self._tcp_up = False

    def _set_state(self, status: Status, error: str | None) -> None:
        """Change the connection state, logging only a change (ZMQ retries every few hundred ms)."""
        if self.status == "error" or (status, error) == (self.status, self.error):
            return  # a stopped listener keeps the reason it stopped
        self.status, self.error = status, error
        sub = self.subscription
        if error is None:
            logger.info("worker %d dp_rank %d: %s is %s", sub.worker_id, sub.dp_rank, sub.endpoint, status)
        else:
            logger.warning("worker %d dp_rank %d: %s", sub.worker_id, sub.dp_rank, error)

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count_failure(f"unexpected message: {len(frames)} frames"
                                + (f", a {len(frames[1])}-byte seq frame" if len(frames) == 3 else ""))
            return
        if self.status != "active":
            self._set_state("active", None)  # a batch arrived before its handshake event was read
        seq = int.from_bytes(frames[1], "big")
        if self.first_seq is None:
            await self._join(seq)
        else:
            if self.last_seq is not None and seq <= self.last_seq:
                await self._restart(seq, frames[2])
            expected = 0 if self.last_seq is None else self.last_seq + 1
            if seq > expected:
                await self._gap(expected, seq)
        await self._ingest(seq, frames[2])

    async def _join(self, seq: int) -> None:
        """The first batch this listener receives: the engine may have published long before."""
        sub = self.subscription
        self.first_seq = seq
        if not seq:
            return
        logger.info(
            "worker %d dp_rank %d: subscribed at seq %d; %s", sub.worker_id, sub.dp_rank, seq,
            "replaying what the engine still buffers" if sub.replay_endpoint
            else "blocks it stored before are unknown until it stores them again",
        )
        if sub.replay_endpoint:
            await self._replay(0, seq, count_lost=False)

    async def _restart(self, seq: int, payload: bytes) -> None:
        sub = self.subscription
        if self.publisher is not None:
            await self.publisher.publish_reset(sub, sorted(self._fed), seq, payload)
            dropped = "dropping"
        else:
            dropped = f"dropped {sum(self.indexer.reset_rank(sub.model_name, sub.tenant_id, *key) for key in self._fed)}"
        logger.warning(
            "worker %d dp_rank %d restarted: seq %d after %s; %s its device blocks, rebuilding from "
            "what it sends now", sub.worker_id, sub.dp_rank, seq, self.last_seq, dropped,
        )
        self.last_seq = None
        self._count("restarts")

    async def _gap(self, expected: int, seq: int) -> None:
        sub = self.subscription
        self._count("gaps")
        if sub.replay_endpoint:
            await self._replay(expected, seq)
        # Batches the replay did not end with (holes inside it are counted by `_replay`).
        resumed = expected if self.last_seq is None or self.last_seq < expected else self.last_seq + 1
        lost = seq - resumed
        if lost > 0:
            self._count("lost_batches", lost)
            logger.warning(
                "worker %d dp_rank %d: expected seq %d, got %d: %d batches lost%s", sub.worker_id, sub.dp_rank,
                expected, seq, lost, "" if sub.replay_endpoint else " (no replay_endpoint registered)",
            )

    async def _ingest(self, seq: int, payload: bytes) -> None:
        """Decode, then apply, one batch: two turns of the event loop, each holding `turn`, so
        an HTTP request waits for at most half a batch's work."""
        async with self.turn:
            batch = self._decode(seq, payload)
        if batch is not None and self.publisher is not None:
            await self.publisher.publish_batch(self.subscription, seq, payload)
            self._counted(batch, 0)  # its events are counted when the stream applies it (`Listeners.count_applied`)
        elif batch is not None:
            await asyncio.sleep(0)
            async with self.turn:
                self._commit(batch)
        # Only now: /workers must not report a batch as applied while it waits for its turn.
        self.last_seq = seq

    def _decode(self, seq: int, payload: bytes) -> DecodedBatch | None:
        sub = self.subscription
        try:
            return decode_batch(payload, worker_id=sub.worker_id, dp_rank=sub.dp_rank, seq=seq,
                                block_size=sub.block_size)
        except MalformedBatch as error:
            self._count_failure(f"seq {seq}: {error}")
            return None

    def _commit(self, batch: DecodedBatch) -> None:
        sub = self.subscription
        report = self.indexer.apply_batch(sub.model_name, sub.tenant_id, batch.events)
        if report.rejected:
            self._count("rejected", report.rejected)
        self._counted(batch, report.applied)

    def _counted(self, batch: DecodedBatch, events: int) -> None:
        sub = self.subscription
        if batch.dp_rank != sub.dp_rank:
            self._fed.add((sub.worker_id, batch.dp_rank))
        self.last_batch_at = time.time()
        # Every batch: plain increments rather than `_count`'s getattr and setattr by name.
        counts, totals = self.counts, self.totals
        counts.batches += 1
        totals.batches += 1
        counts.events += events
        totals.events += events
        if batch.ignored:
            self.counts.ignored.update(batch.ignored)
            self.totals.ignored.update(batch.ignored)

    def _count(self, name: str, amount: int = 1) -> None:
        setattr(self.counts, name, getattr(self.counts, name) + amount)
        setattr(self.totals, name, getattr(self.totals, name) + amount)

    def _count_failure(self, detail: str) -> None:
        self._count("decode_failures")
        count = self.counts.decode_failures
        if count <= 3 or count % 1000 == 0:  # a broken engine must not flood the log
            logger.warning("worker %d dp_rank %d: dropped a batch (%d so far): %s", self.subscription.worker_id,
                           self.subscription.dp_rank, count, detail)

    # --- replay -----------------------------------------------------------------------------

    async def _replay(self, start: int, end: int, *, count_lost: bool = True) -> None:
        """Apply the engine's buffered batches numbered start..end-1 that are still new. Those
        the engine no longer has are counted as lost (when `count_lost`; not for the history of
        an engine that ran before this listener subscribed), and so are those it did not deliver
        in `REPLAY_ATTEMPTS` requests."""
        sub = self.subscription
        backoff = REPLAY_BACKOFF_SECS
        for attempt in range(1, REPLAY_ATTEMPTS + 1):
            first = self._first_missing(start)
            if first >= end:
                return  # every batch arrived; only the end marker did not
            self._count("replays")
            if await self._request_replay(first, end, count_lost):
                return
            if attempt < REPLAY_ATTEMPTS:
                logger.warning("worker %d dp_rank %d: no answer from %s for %.1f s to a replay from seq %d; "
                               "asking again in %.1f s", sub.worker_id, sub.dp_rank, sub.replay_endpoint,
                               self.replay_timeout_secs, first, backoff)
                await asyncio.sleep(backoff)
                backoff *= 2
        self._count("replay_failures")
        logger.warning("worker %d dp_rank %d: %s did not finish a replay from seq %d in %d requests; what it did "
                       "not deliver counts as lost", sub.worker_id, sub.dp_rank, sub.replay_endpoint,
                       self._first_missing(start), REPLAY_ATTEMPTS)

    def _first_missing(self, start: int) -> int:
        return start if self.last_seq is None or self.last_seq < start else self.last_seq + 1

    async def _request_replay(self, start: int, end: int, count_lost: bool) -> bool:
        """One request from `start`; True once the engine's end marker arrived, False when it
        sent nothing for `replay_timeout_secs` of this process's running time."""
        sub = self.subscription
        assert sub.replay_endpoint is not None
        if self._dealer is None:
            self._dealer = self.context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(sub.replay_endpoint)
        dealer = self._dealer
        reader: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        applied = 0
        deadline = ReplayDeadline(self.replay_timeout_secs)
        while True:
            wait = deadline.next_wait(bool(cast(int, reader.get(zmq.EVENTS)) & zmq.POLLIN))
            if wait is None:
                # A late answer must not be read as the answer to the next request.
                self._dealer.close(0)
                self._dealer = None
                return False
            if wait:
                waited_from = time.monotonic()
                await dealer.poll(int(wait * 1000) + 1)  # POLLIN, the default
                deadline.waited(wait, time.monotonic() - waited_from)
                continue
            try:
                frames = reader.recv_multipart(zmq.NOBLOCK)  # POLLIN: a whole message is queued
            except zmq.Again:
                continue
            deadline.answered()
            if frames and not frames[0]:
                frames = frames[1:]  # the envelope delimiter
            if len(frames) == 3:
                frames = frames[1:]  # [topic, seq, payload]: vLLM 0.33 and SGLang name the topic
            if len(frames) != 2 or len(frames[0]) != 8:
                self._count_failure(f"unexpected replay message: {len(frames)} frames")
                continue
            seq_frame, payload = frames
            if seq_frame == END_OF_REPLAY or not payload:
                logger.info("worker %d dp_rank %d: replayed %d batches from seq %d", sub.worker_id, sub.dp_rank,
                            applied, start)
                return True
            seq = int.from_bytes(seq_frame, "big")
            if seq < start or seq >= end or (self.last_seq is not None and seq <= self.last_seq):
                continue  # older than asked, or the live stream delivers it
            expected = self._first_missing(start)
            if seq > expected and count_lost:
                self._count("lost_batches", seq - expected)  # the engine's buffer no longer has them
            await self._ingest(seq, payload)
            self._count("replayed_batches")
            applied += 1


class Listeners:
    """Every listener of the process, keyed by (instance_id, dp_rank)."""

    def __init__(self, indexer: Indexer, *, replay_timeout_secs: float = DEFAULT_REPLAY_TIMEOUT_SECS,
                 publisher: BatchPublisher | None = None) -> None:
        self.indexer = indexer
        self.replay_timeout_secs = replay_timeout_secs
        self.publisher = publisher  # with replicas: where batches go instead of the index
        self.totals = ListenerCounts()
        self._listeners: dict[WorkerKey, EngineListener] = {}
        self._context: zmq.asyncio.Context | None = None
        # One batch applied at a time, process-wide. asyncio.Lock wakes the next waiter only on
        # the loop's next iteration, after it has polled the sockets, so however many engines
        # are busy, a query waits for at most one batch (not one per busy engine).
        self._turn: asyncio.Lock | None = None

    def start(self, subscription: Subscription) -> EngineListener:
        """Subscribe to one engine; needs a running event loop. Replaces nothing: the caller
        has registered the rank, which fails for a rank registered already."""
        if self._context is None:
            self._context = zmq.asyncio.Context()
        if self._turn is None:
            self._turn = asyncio.Lock()
        listener = EngineListener(
            self.indexer, subscription, self._context, self.totals, self._turn,
            replay_timeout_secs=self.replay_timeout_secs, publisher=self.publisher,
        )
        self._listeners[subscription.key] = listener
        listener.start()
        return listener

    def stop(self, keys: Iterable[WorkerKey]) -> None:
        """Stop listening for these ranks now; their sockets close on the loop's next turn."""
        for key in keys:
            listener = self._listeners.pop(key, None)
            if listener is not None:
                listener.cancel()

    def get(self, key: WorkerKey) -> EngineListener | None:
        return self._listeners.get(key)

    def count_applied(self, key: WorkerKey, report: ApplyReport) -> None:
        """With replicas: what this replica's index made of a batch from rank `key`'s engine
        when it applied it from the stream (the listener only published it, and could not tell
        the events applied from those refused)."""
        listener = self._listeners.get(key)
        for counts in (self.totals,) if listener is None else (self.totals, listener.counts):
            counts.events += report.applied
            counts.rejected += report.rejected

    def __len__(self) -> int:
        return len(self._listeners)

    def status_counts(self) -> dict[Status, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for listener in self._listeners.values():
            counts[listener.status] += 1
        return counts

    async def close(self) -> None:
        listeners = list(self._listeners.values())
        self._listeners.clear()
        await asyncio.gather(*(listener.close() for listener in listeners), return_exceptions=True)
        if self._context is not None:
            self._context.term()
            self._context = None
