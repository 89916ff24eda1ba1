"""Slot tracker replicas over NATS core (`--nats URL`): the shell around `replication.Replica`.

Subjects, under `--nats-subject-prefix` (default `dynamo_lite.slot_tracker`):

* `<prefix>.ops`: every replica publishes its writes there, as `Batch`es in sequence order, and
  a `Heartbeat` every `HEARTBEAT_SECS` (its last sequence number, so a loss at the end of a
  burst shows within a second).
* `<prefix>.discover`: a joining replica asks who can send it the state; one running replica
  of the queue group answers with its origin.
* `<prefix>.state.<origin>`: asks that replica for its whole state, sent to the reply inbox in
  chunks below the server's `max_payload` (a 10,000-request tracker is about 53 MB).
* `<prefix>.replay.<origin>`: asks that replica to publish again, to the reply inbox, its batches
  numbered `first` .. `last` (it keeps the last `LOG_BYTES` of them), then an empty message.

Every replica reads `<prefix>.>` through one subscription, so the state requests it answers
come in order with the ops: a state collected when the request is handled holds every op the
server delivered to it before the request, and the requester, subscribed before it asked,
receives every op after. It buffers those while the state travels, loads the state, then
applies the buffer, skipping what the state's version vector already covers.

Joining (start-up, before `/ready` answers 200): subscribe, ask `discover` until a replica
answers or `join_timeout_secs` pass; with an answer, load its state; without one, the caller's
fallback (the `--snapshot` file) or nothing. A replica answered but no state arrived within
`STATE_DEADLINE_SECS`: the start-up fails rather than start with a state the others do not
share.

Gaps (NATS core drops messages: a slow consumer, a server restart): the batches after the gap
are held back (see `Replica.receive`) and the missing ones are asked of their origin
(`replay`). An origin that cannot send them (gone, or they left its log) makes this replica
load a whole state again (a *resync*: from that origin when it answers, else from any replica),
re-applying its own ops the state lacks; what nobody could send is given up on and counted as
lost. `/ready` answers 503 during a resync.

Answers: a write is applied at once, and its answer waits until the NATS server has its batch
(a PING after the batch, answered), so an answered write survives this replica's crash; it
waits at most `publish_timeout_secs`, and not at all while the connection is down (the batch
is then sent when it is back: nats-py buffers it). With `publish_timeout_secs` 0 it does not
wait at all: cheaper, but a write answered in the last milliseconds before a crash may never
reach the others.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from dynamo_lite.base.errors import PayloadTooLarge
from dynamo_lite.durability.nats_connection import ConnectionCounts, NatsSecurity, connect, flush

from .protocols import SlotTrackerDump
from .replication import (
    Batch,
    Gap,
    Message,
    Replica,
    StateHeader,
    decode_header,
    decode_message,
    encode,
)
from .snapshot import decode as decode_dump
from .snapshot import describe, encode_pieces

logger = logging.getLogger("dynamo_lite.slot_tracker.replicas")

DEFAULT_SUBJECT_PREFIX: Final = "dynamo_lite.slot_tracker"
# The first replica waits this long for another before it starts alone: long enough for a
# running replica to answer through a busy NATS server, short enough not to slow a cold start.
DEFAULT_JOIN_TIMEOUT_SECS: Final = 2.0
DEFAULT_PUBLISH_TIMEOUT_SECS: Final = 1.0
QUEUE_GROUP: Final = "dynamo_lite_slot_tracker"
HEARTBEAT_SECS: Final = 1.0
REPLAY_TIMEOUT_SECS: Final = 2.0  # for each message of a replay
STATE_FIRST_CHUNK_SECS: Final = 5.0  # the responder encodes the state first (0.2-0.5 s for 53 MB)
STATE_CHUNK_TIMEOUT_SECS: Final = 10.0  # for each later chunk
FIRST_FLUSH_TIMEOUT_SECS: Final = 10.0  # the subscription reaching the server before the join asks anything (nats-py's default)
STATE_DEADLINE_SECS: Final = 60.0  # a replica answered `discover`: its state must arrive by then
LOG_BYTES: Final = 64 * 1024 * 1024  # this replica's published batches kept for replays
FLUSH_EVERY_BYTES: Final = 8 * 1024 * 1024  # a state is sent in steps of this, each acknowledged
PAYLOAD_MARGIN: Final = 4096  # below max_payload: the protocol's own bytes
CHUNK_HEAD = struct.Struct("<IB")  # chunk index, 1 on the last
LOG_EVERY_SECS: Final = 10.0
# An op of an /add costs at most 9 bytes per hash (msgpack's int64) plus its strings.
ADD_OVERHEAD_BYTES: Final = 256


@dataclass(frozen=True)
class NatsSettings:
    url: str
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    join_timeout_secs: float = DEFAULT_JOIN_TIMEOUT_SECS
    publish_timeout_secs: float = DEFAULT_PUBLISH_TIMEOUT_SECS
    security: NatsSecurity = NatsSecurity()  # --nats-creds, --nats-tls-*


@dataclass
class SyncCounts:
    unconfirmed: int = 0  # writes answered without the NATS server's acknowledgement
    publish_failures: int = 0  # batches nats-py refused (its buffer full while disconnected)
    undecodable: int = 0  # messages that are no batch or heartbeat
    replays_requested: int = 0
    replays_answered: int = 0
    resyncs: int = 0  # whole states loaded after the start
    states_sent: int = 0


class NatsReplication:
    """Connects one `Replica` to the others through a NATS server (see the module docstring)."""

    def __init__(self, replica: Replica, settings: NatsSettings, *,
                 drop: Callable[[Message], bool] | None = None) -> None:
        """`drop`: a message it returns True for is dropped on arrival, as NATS core may drop
        it (tests lose a chosen message with it)."""
        self.replica = replica
        self.settings = settings
        self.drop = drop
        prefix = settings.subject_prefix
        self.ops_subject = f"{prefix}.ops"
        self.discover_subject = f"{prefix}.discover"
        self.state_subject = _subject(prefix, "state", replica.origin)
        self.replay_subject = _subject(prefix, "replay", replica.origin)
        # The connection asks the server not to echo what it publishes (`no_echo`); should a
        # server echo anyway, this replica's own batches and heartbeats are recognised by their
        # origin (msgpack: array head, tag, then the origin) and dropped undecoded.
        self._own_origin = encode(replica.origin)
        self.counts = SyncCounts()
        self.connection_counts = ConnectionCounts()
        self.client: Client | None = None
        self.max_payload = 1024 * 1024  # the server's, once connected
        self.joined = False
        self.resyncing = False
        self._buffer: list[Message] | None = []  # ops received while a state is on its way
        self._wake = asyncio.Event()
        self._batch: asyncio.Future[None] | None = None  # resolved once the server has the batch being filled
        self._heartbeat_due = False
        self._published_seq = 0  # the last op handed to NATS
        self._stopping = False
        self._log: deque[tuple[int, int, bytes]] = deque()  # (first_seq, last_seq, the batch as published)
        self._log_bytes = 0
        self._discover_subscription: Any = None
        self._repairs: asyncio.Queue[int] = asyncio.Queue()
        self._repairing: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._reported_conflicts = 0

    # --- start and stop -----------------------------------------------------------------------

    async def start(self, fallback: Callable[[], None] | None = None) -> str:
        """Connect, then take the state of a running replica, or else call `fallback` (load
        the snapshot); returns where the state came from, for the log. Raises when NATS is
        unreachable, or a replica answered but its state never arrived."""
        replica = self.replica
        name = f"slot-tracker-{socket.gethostname()}-{replica.origin:016x}"
        self.client, self.connection_counts = await connect(self.settings.url, name=name, security=self.settings.security)
        self.max_payload = self.client.max_payload
        # One subscription for ops and requests: they are handled in the order the server sent them.
        await self.client.subscribe(f"{self.settings.subject_prefix}.>", cb=self._on_message, pending_bytes_limit=0)
        await flush(self.client, FIRST_FLUSH_TIMEOUT_SECS)
        started = time.perf_counter()
        loaded = await self._join()
        if loaded is None:
            if fallback is not None:
                fallback()
            adopted = replica.adopt_tracker()
            source = "no running replica" + (f"; {adopted} requests loaded here" if adopted else "")
        else:
            source = f"replica {loaded}"
        replica.own_ops([])
        buffer, self._buffer = self._buffer or [], None
        for message in buffer:
            self._receive(message)
        await self._answer_discovery(True)
        self.joined = True
        self._batch = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._publish_forever(), name="replication-publisher"),
                       asyncio.create_task(self._tick_forever(), name="replication-heartbeat"),
                       asyncio.create_task(self._repair_forever(), name="replication-repair")]
        logger.info("replica %016x joined in %.2fs from %s: %d workers, %d requests", replica.origin,
                    time.perf_counter() - started, source, *replica.tracker.size())
        return source

    async def stop(self) -> None:
        """Publish what is still queued, then close the connection."""
        publisher, others = (self._tasks[0], self._tasks[1:]) if self._tasks else (None, [])
        for task in [*others, *self._background]:
            task.cancel()
        await asyncio.gather(*others, *self._background, return_exceptions=True)
        if publisher is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(publisher, 10)
            except Exception as exc:  # noqa: BLE001 - closing must not fail the shutdown
                logger.warning("publishing the last ops: %s: %s", type(exc).__name__, exc)
        client = self.client
        if client is not None and not client.is_closed:
            try:
                if client.is_connected:
                    await asyncio.wait_for(client.drain(), 10)  # sends what is buffered first
                else:
                    logger.warning("stopping while NATS is unreachable: %d bytes of writes not sent yet never "
                                   "reach the other replicas", client.pending_data_size)
                    await client.close()
            except Exception as exc:  # noqa: BLE001 - closing must not fail the shutdown
                logger.warning("closing the NATS connection: %s: %s", type(exc).__name__, exc)

    def not_ready(self) -> str | None:
        return "not ready: resyncing with the other replicas" if self.resyncing else None

    # --- this replica's writes -------------------------------------------------------------------

    def check_size(self, strings: int, hashes: int = 0) -> None:
        """Refuse (413), before it is applied, a write whose op would not fit in one message."""
        size = strings + 9 * hashes + ADD_OVERHEAD_BYTES
        limit = self.max_payload - PAYLOAD_MARGIN
        if size > limit:
            raise PayloadTooLarge(
                f"this write would need {size} bytes to reach the other replicas, above the NATS server's "
                f"max_payload of {self.max_payload} bytes (less {PAYLOAD_MARGIN})"
            )

    def confirmed(self, status: int, payload: Any) -> tuple[int, Any] | Coroutine[Any, Any, tuple[int, Any]]:
        """The answer of a write just applied, once the NATS server has it (see the module
        docstring); at once with `publish_timeout_secs` 0."""
        self._wake.set()
        if self.settings.publish_timeout_secs <= 0:
            return status, payload
        return _after(self._batch, status, payload)

    async def _publish_forever(self) -> None:
        # One task publishes, so batches leave in sequence order; it is never cancelled in the
        # middle of a batch (`stop` asks it to finish).
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._publish_queued()
            if self._stopping:
                return

    async def _publish_queued(self) -> None:
        assert self.client is not None
        batch = self.replica.take_outbox()
        waiting, self._batch = self._batch, asyncio.get_running_loop().create_future()
        if batch is not None:
            for part, data in self._encode(batch):
                await self._publish(self.ops_subject, data)
                self._remember(part, data)
                self._published_seq = part.last_seq
            self.replica.counts.published += len(batch.ops)
            if self._stopping or self.settings.publish_timeout_secs <= 0:
                # Nobody waits: answered at once, or before the shutdown began.
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)
            else:
                self._spawn(self._confirm(waiting))
        elif waiting is not None and not waiting.done():
            waiting.set_result(None)
        if self._heartbeat_due:
            self._heartbeat_due = False
            await self._publish(self.ops_subject, encode(self.replica.heartbeat(self._published_seq)))

    def _encode(self, batch: Batch) -> Iterator[tuple[Batch, bytes]]:
        """`batch` as messages below the server's max_payload, halved until each fits."""
        data = encode(batch)
        if len(data) <= self.max_payload - PAYLOAD_MARGIN or len(batch.ops) == 1:
            yield batch, data
            return
        half = len(batch.ops) // 2
        yield from self._encode(Batch(batch.origin, batch.first_seq, batch.accepted_at, batch.ops[:half]))
        yield from self._encode(Batch(batch.origin, batch.first_seq + half, batch.accepted_at, batch.ops[half:]))

    async def _publish(self, subject: str, data: bytes, reply: str = "") -> None:
        assert self.client is not None
        try:
            await self.client.publish(subject, data, reply=reply)
        except (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionClosedError,
                nats.errors.MaxPayloadError) as exc:
            # The others see the gap and ask for these ops again: they stay in the log.
            self.counts.publish_failures += 1
            _log_limited("publish", logging.WARNING, "cannot publish to NATS (%s): the other replicas will "
                         "ask for these ops again", type(exc).__name__)

    def _remember(self, batch: Batch, data: bytes) -> None:
        self._log.append((batch.first_seq, batch.last_seq, data))
        self._log_bytes += len(data)
        while self._log_bytes > LOG_BYTES and len(self._log) > 1:
            self._log_bytes -= len(self._log.popleft()[2])

    async def _confirm(self, waiting: asyncio.Future[None] | None) -> None:
        client = self.client
        assert client is not None
        try:
            if client.is_connected:
                await asyncio.sleep(0)  # nats-py writes its PING at once: let its flusher send the batch first
                await flush(client, self.settings.publish_timeout_secs)
            else:
                self.counts.unconfirmed += 1
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
            self.counts.unconfirmed += 1
        finally:
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    async def _tick_forever(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(HEARTBEAT_SECS)
            self._heartbeat_due = True
            self._wake.set()
            ticks += 1
            if ticks * HEARTBEAT_SECS >= LOG_EVERY_SECS:
                ticks = 0
                conflicts = self.replica.counts.conflicts
                if conflicts > self._reported_conflicts:
                    logger.warning("%d request ids were added through two replicas at once in the last %.0fs; "
                                   "each replica kept the add of the smaller origin",
                                   conflicts - self._reported_conflicts, LOG_EVERY_SECS)
                    self._reported_conflicts = conflicts

    # --- the others' messages --------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        subject = msg.subject
        if subject == self.ops_subject:
            if msg.data[2:2 + len(self._own_origin)] == self._own_origin:
                return  # an echo of this replica's own batch or heartbeat: applied when accepted
            try:
                message = decode_message(msg.data)
            except ValueError as exc:
                self.counts.undecodable += 1
                _log_limited("decode", logging.WARNING, "dropped a message on %s that is no batch: %s",
                             subject, exc)
                return
            if self.drop is not None and self.drop(message):
                return
            if self._buffer is not None:
                self._buffer.append(message)
            else:
                self._receive(message)
        elif subject == self.state_subject and msg.reply and self.joined:
            # Collected now, in order with the ops received before the request (see the docstring).
            header, dump = self.replica.collect_state(taken_at=time.time())
            self._spawn(self._send_state(msg.reply, header, dump))
        elif subject == self.replay_subject and msg.reply:
            self._spawn(self._send_replay(msg.reply, msg.data))

    def _receive(self, message: Message) -> None:
        gap = self.replica.receive(message)
        if gap is not None:
            self._want_repair(gap)

    def _want_repair(self, gap: Gap) -> None:
        if gap.origin not in self._repairing:
            self._repairing.add(gap.origin)
            self._repairs.put_nowait(gap.origin)

    async def _on_discover(self, msg: Msg) -> None:
        if msg.reply:
            await self._publish(msg.reply, b"%016x" % self.replica.origin)

    async def _answer_discovery(self, answer: bool) -> None:
        """Join or leave the queue group of `discover`: NATS hands each request to one member,
        so a replica that should not answer (resyncing) must not be a member."""
        assert self.client is not None
        if answer and self._discover_subscription is None:
            self._discover_subscription = await self.client.subscribe(self.discover_subject, queue=QUEUE_GROUP,
                                                                      cb=self._on_discover)
        elif not answer and self._discover_subscription is not None:
            subscription, self._discover_subscription = self._discover_subscription, None
            await _unsubscribe(subscription)

    # --- answering another replica ------------------------------------------------------------------

    async def _send_state(self, reply: str, header: StateHeader, dump: SlotTrackerDump) -> None:
        assert self.client is not None
        started = time.perf_counter()
        chunk_size = self.max_payload - PAYLOAD_MARGIN
        chunks = await asyncio.to_thread(lambda: list(_chunks(_state_stream(header, dump), chunk_size)))
        unflushed = total = 0
        for chunk in chunks:
            await self._publish(reply, chunk)
            unflushed += len(chunk)
            total += len(chunk) - CHUNK_HEAD.size
            if unflushed >= FLUSH_EVERY_BYTES:
                unflushed = 0
                await flush(self.client, STATE_CHUNK_TIMEOUT_SECS)
        self.counts.states_sent += 1
        logger.info("sent the state to a joining replica: %s, %d bytes in %d chunks, %.2fs",
                    describe(dump), total, len(chunks), time.perf_counter() - started)

    async def _send_replay(self, reply: str, request: bytes) -> None:
        try:
            first, last = msgspec.msgpack.decode(request, type=tuple[int, int])
        except ValueError:
            return
        entries = [data for first_seq, last_seq, data in self._log if last_seq >= first and first_seq <= last]
        for data in entries:
            await self._publish(reply, data)
        await self._publish(reply, b"")
        self.counts.replays_answered += 1

    # --- healing gaps -----------------------------------------------------------------------------

    async def _repair_forever(self) -> None:
        while True:
            origin = await self._repairs.get()
            try:
                await self._repair(origin)
            except Exception:  # noqa: BLE001 - the next gap must still be repaired
                logger.exception("repairing the ops of replica %016x failed", origin)
            finally:
                self._repairing.discard(origin)
            gap = self.replica.gap(origin)
            if gap is not None:
                self._want_repair(gap)

    async def _repair(self, origin: int) -> None:
        replica = self.replica
        assert self.client is not None
        while not self.client.is_connected:
            await asyncio.sleep(0.1)  # nobody can be asked meanwhile: do not give up on the ops
        gap = replica.gap(origin)
        if gap is None:
            return
        answered = await self._replay(gap)
        gap = replica.gap(origin)
        if gap is None:
            return
        logger.warning("ops %d..%d of replica %016x are lost here and it %s: resyncing", gap.first, gap.last, origin,
                       "no longer has them" if answered else "does not answer")
        # A replica that answered is alive and holds all of its own ops: its state heals the gap.
        await self._resync(prefer=origin if answered else None)
        if replica.gap(origin) is not None:
            lost = replica.skip(origin)
            logger.error("gave up on %d ops of replica %016x: no replica could send them", lost, origin)

    async def _replay(self, gap: Gap) -> bool:
        """Ask `gap.origin` for the missing ops; True when it answered (with what it still had)."""
        assert self.client is not None
        self.counts.replays_requested += 1
        inbox = self.client.new_inbox()
        subscription = await self.client.subscribe(inbox, pending_bytes_limit=0)
        try:
            await self._publish(_subject(self.settings.subject_prefix, "replay", gap.origin),
                                encode((gap.first, gap.last)), reply=inbox)
            while True:
                msg = await subscription.next_msg(timeout=REPLAY_TIMEOUT_SECS)
                if not msg.data:
                    return True
                try:
                    message = decode_message(msg.data)
                except ValueError:
                    self.counts.undecodable += 1
                    continue
                if self._buffer is not None:
                    self._buffer.append(message)
                else:
                    self.replica.receive(message)
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
            return False
        finally:
            await _unsubscribe(subscription)

    async def _resync(self, *, prefer: int | None) -> bool:
        """Load a whole state again: from `prefer` if it answers, else from any replica."""
        replica = self.replica
        self._buffer = []
        self.resyncing = True
        await self._answer_discovery(False)
        held: list[Batch] = []
        try:
            loaded = None
            if prefer is not None:
                loaded = await self._fetch_state(prefer)
            if loaded is None:
                responder = await self._discover(time.monotonic() + self.settings.join_timeout_secs)
                if responder is not None:
                    loaded = await self._fetch_state(responder)
            if loaded is None:
                logger.warning("resync failed: no replica sent its state")
                return False
            header, dump = loaded
            held = replica.load_state(header, dump)
            replica.own_ops(self._own_batches(replica.vector.get(replica.origin, 0)))
            self.counts.resyncs += 1
            logger.warning("resynced from replica %016x: %s", header.origin, describe(dump))
            return True
        finally:
            buffer, self._buffer = self._buffer or [], None
            self.resyncing = False
            for message in [*held, *buffer]:
                self._receive(message)
            await self._answer_discovery(True)

    def _own_batches(self, after: int) -> list[Batch]:
        """This replica's logged batches numbered after `after`."""
        batches = []
        for _first_seq, last_seq, data in reversed(self._log):
            if last_seq <= after:
                break
            message = decode_message(data)
            if isinstance(message, Batch):
                batches.append(message)
        return batches[::-1]

    # --- fetching a state --------------------------------------------------------------------------

    async def _join(self) -> str | None:
        """Load the state of a running replica; its origin, or None when none answered in time."""
        give_up = time.monotonic() + STATE_DEADLINE_SECS
        while True:
            responder = await self._discover(time.monotonic() + self.settings.join_timeout_secs)
            if responder is None:
                logger.info("no replica answered within %.1fs: starting as the first",
                            self.settings.join_timeout_secs)
                return None
            loaded = await self._fetch_state(responder)
            if loaded is not None:
                header, dump = loaded
                held = self.replica.load_state(header, dump)
                self._buffer = [*held, *(self._buffer or [])]
                return f"{header.origin:016x}"
            if time.monotonic() >= give_up:
                raise RuntimeError(f"replicas answered on {self.discover_subject} but none sent its state "
                                   f"within {STATE_DEADLINE_SECS:.0f}s")
            await asyncio.sleep(0.5)

    async def _discover(self, deadline: float) -> int | None:
        """The origin of a running replica that answered, or None by `deadline`."""
        assert self.client is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                answer = await self.client.request(self.discover_subject, b"", timeout=left)
                return int(answer.data, 16)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(min(0.2, max(left, 0.0)))
            except nats.errors.TimeoutError:
                return None
            except ValueError:
                await asyncio.sleep(min(0.2, max(left, 0.0)))

    async def _fetch_state(self, responder: int) -> tuple[StateHeader, SlotTrackerDump] | None:
        assert self.client is not None
        started = time.perf_counter()
        inbox = self.client.new_inbox()
        subscription = await self.client.subscribe(inbox, pending_bytes_limit=0)
        pieces: list[bytes] = []
        try:
            await self._publish(_subject(self.settings.subject_prefix, "state", responder), b"", reply=inbox)
            while True:
                timeout = STATE_CHUNK_TIMEOUT_SECS if pieces else STATE_FIRST_CHUNK_SECS
                msg = await subscription.next_msg(timeout=timeout)
                index, last = CHUNK_HEAD.unpack_from(msg.data)
                if index != len(pieces):
                    logger.warning("state from replica %016x: chunk %d arrived instead of %d", responder, index,
                                   len(pieces))
                    return None
                pieces.append(msg.data[CHUNK_HEAD.size:])
                if last:
                    break
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, struct.error) as exc:
            logger.warning("no state from replica %016x (%s)", responder, type(exc).__name__)
            return None
        finally:
            await _unsubscribe(subscription)
        stream = b"".join(pieces)
        try:
            header, dump = await asyncio.to_thread(_decode_state, stream)
        except (ValueError, struct.error) as exc:
            logger.error("the state from replica %016x is unreadable: %s", responder, exc)
            return None
        logger.info("received the state of replica %016x: %d bytes in %.2fs", responder, len(stream),
                    time.perf_counter() - started)
        return header, dump

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


# --- the state on the wire: [u32 header size][header, msgpack][dump, JSON] --------------------------

_HEADER_SIZE = struct.Struct("<I")
# Histories encoded per piece: each piece holds the GIL for a millisecond or two at most.
_HISTORY_BATCH = 2048


def _state_stream(header: StateHeader, dump: SlotTrackerDump) -> Iterator[bytes]:
    """The state's bytes in pieces (runs in a worker thread; the encoders hold the GIL per piece).
    The histories are the header's last field: its encoding with none ends with an empty msgpack
    array, replaced by an array32 head and the entries encoded in batches."""
    histories = header.histories
    head = encode(msgspec.structs.replace(header, histories=[]))
    assert head.endswith(b"\x90")
    pieces = [head[:-1], b"\xdd" + len(histories).to_bytes(4, "big")]
    for start in range(0, len(histories), _HISTORY_BATCH):
        # An array of n entries is its head then the entries: drop the head of each batch's.
        items = encode(histories[start:start + _HISTORY_BATCH])
        pieces.append(items[_array_head_size(items):])
    size = sum(map(len, pieces))
    yield _HEADER_SIZE.pack(size)
    yield from pieces
    yield from encode_pieces(dump)


def _array_head_size(data: bytes) -> int:
    first = data[0]
    if 0x90 <= first <= 0x9F:
        return 1
    return 3 if first == 0xDC else 5


def _chunks(stream: Iterator[bytes], size: int) -> Iterator[bytes]:
    """The stream cut into messages of at most `size` bytes after the chunk head."""
    buffer = bytearray()
    index = 0
    for piece in stream:
        buffer += piece
        while len(buffer) > size:
            yield CHUNK_HEAD.pack(index, 0) + bytes(buffer[:size])
            del buffer[:size]
            index += 1
    yield CHUNK_HEAD.pack(index, 1) + bytes(buffer)


def _decode_state(stream: bytes) -> tuple[StateHeader, SlotTrackerDump]:
    (size,) = _HEADER_SIZE.unpack_from(stream)
    end = _HEADER_SIZE.size + size
    return decode_header(stream[_HEADER_SIZE.size:end]), decode_dump(stream[end:])


def _subject(prefix: str, kind: str, origin: int) -> str:
    return f"{prefix}.{kind}.{origin:016x}"


async def _after(batch: asyncio.Future[None] | None, status: int, payload: Any) -> tuple[int, Any]:
    if batch is not None:
        await batch
    return status, payload


async def _unsubscribe(subscription: Any) -> None:
    try:
        await subscription.unsubscribe()
    except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
        pass


_last_logged: dict[str, float] = {}


def _log_limited(kind: str, level: int, message: str, *args: object) -> None:
    """At most one line per `kind` every LOG_EVERY_SECS: a flapping connection must not flood the log."""
    now = time.monotonic()
    if now - _last_logged.get(kind, -LOG_EVERY_SECS) >= LOG_EVERY_SECS:
        _last_logged[kind] = now
        logger.log(level, message, *args)


__all__ = ["DEFAULT_SUBJECT_PREFIX", "NatsReplication", "NatsSettings"]
