"""What indexer replicas share through the JetStream stream, and how a replica applies it.

Every write goes through one stream, one subject per kind (`<prefix>.<kind>`), and every
replica applies the stream in order, so all replicas hold the same index. This module is the
pure part: the message types, their encoding, and `apply`, which turns one message into calls
on the `Indexer`. The NATS side (connecting, publishing, consuming, snapshots) is
`dynamo_lite.indexer.nats_replica`.

Kinds:

* `events`: an `/events` document, the bytes as posted (checked by the replica that took it).
* `batch`: one engine batch a replica's ZMQ listener received: the msgpack payload as the
  engine sent it, with its rank and sequence number. Every replica listening to the engine
  publishes it under the same message id, so JetStream keeps one (see `batch_message_id`).
* `reset`: an engine restarted (its sequence numbers went back): forget what its ranks held.
* `register`, `unregister`: `/register` and `/unregister` (a registration with an endpoint
  makes every replica subscribe to the engine).
* `routed`: `/routed`, as local block hashes (hashed by the replica that took token ids).

Snapshots (`Snapshot`) hold the index as `/dump` shows it, the ranks (registrations,
endpoints and event-id watermarks, which a dump does not carry) and the stream sequence they
cover.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Union

import msgspec
import orjson
import xxhash

from dynamo_lite.base.errors import ServiceError

from .core import ApplyReport, Indexer, RankState
from .engine_events import MalformedBatch, decode_batch
from .listeners import Subscription
from .protocols import PartitionEvents, decode_events_document
from .snapshot import encode_partitions
from .tree import WorkerKey

EVENTS: Final = "events"
BATCH: Final = "batch"
RESET: Final = "reset"
REGISTER: Final = "register"
UNREGISTER: Final = "unregister"
ROUTED: Final = "routed"
KINDS: Final = (EVENTS, BATCH, RESET, REGISTER, UNREGISTER, ROUTED)


class Register(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    tenant_id: str
    block_size: int
    instance_id: int
    dp_rank: int
    endpoint: str | None = None
    replay_endpoint: str | None = None


class Unregister(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    tenant_id: str
    instance_id: int
    dp_rank: int | None = None


class Routed(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    tenant_id: str
    instance_id: int
    dp_rank: int
    block_hashes: list[int]


class Batch(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    tenant_id: str
    block_size: int
    worker_id: int
    dp_rank: int
    seq: int
    payload: bytes


class Reset(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    tenant_id: str
    ranks: list[tuple[int, int]]
    cause: int  # the sequence number that showed the restart, for the log


Operation = Union[Register, Unregister, Routed, Batch, Reset]
_SUBJECT_KIND: Final = {Register: REGISTER, Unregister: UNREGISTER, Routed: ROUTED, Batch: BATCH, Reset: RESET}
_encoder = msgspec.msgpack.Encoder()
_decoders: Final = {kind: msgspec.msgpack.Decoder(type_) for type_, kind in _SUBJECT_KIND.items()}


def encode(operation: Operation) -> tuple[str, bytes]:
    """(kind, message body)."""
    return _SUBJECT_KIND[type(operation)], _encoder.encode(operation)


def batch_message_id(batch: Batch) -> str:
    """The same for one engine batch whichever replica publishes it: the replicas subscribed to
    one engine all receive its batches, byte for byte, and JetStream keeps the first message of
    an id within its duplicate window (the stream's `duplicate_window`)."""
    digest = xxhash.xxh3_128()
    digest.update(orjson.dumps([batch.model_name, batch.tenant_id, batch.worker_id, batch.dp_rank, batch.seq]))
    digest.update(batch.payload)
    return f"batch-{digest.hexdigest()}"


def reset_message_id(reset: Reset, cause_payload: bytes) -> str:
    """One reset per restart, whichever replica noticed it: named after the batch that showed it."""
    digest = xxhash.xxh3_128()
    digest.update(orjson.dumps([reset.model_name, reset.tenant_id, reset.ranks, reset.cause]))
    digest.update(cause_payload)
    return f"reset-{digest.hexdigest()}"


@dataclass
class Applied:
    """What one message did, for the replica's shell and for a client waiting on it."""

    kind: str
    error: ServiceError | None = None  # the message was refused whole (nothing changed)
    report: Any = None  # ApplyReport (events, batch) or RoutedReport (routed)
    subscribe: list[Subscription] = field(default_factory=list)  # engines to listen to now
    unsubscribe: list[WorkerKey] = field(default_factory=list)  # ranks whose listeners stop
    listener: WorkerKey | None = None  # a batch: the rank whose engine listener received it


def apply(indexer: Indexer, kind: str, data: bytes) -> Applied:
    """Apply one stream message. Deterministic: every replica applying the same messages in the
    same order ends with the same index (up to `--max-blocks` eviction, whose recency counts each
    replica's own queries, and approximations, which expire on each replica's own clock)."""
    applied = Applied(kind)
    try:
        if kind == EVENTS:
            applied.report = indexer.apply_events(decode_events_document(data))
        elif kind == BATCH:
            batch = _decoders[BATCH].decode(data)
            applied.listener = (batch.worker_id, batch.dp_rank)
            applied.report = _apply_batch(indexer, batch)
        elif kind == RESET:
            reset = _decoders[RESET].decode(data)
            for worker_id, dp_rank in reset.ranks:
                indexer.reset_rank(reset.model_name, reset.tenant_id, worker_id, dp_rank)
        elif kind == REGISTER:
            op = _decoders[REGISTER].decode(data)
            indexer.register(op.instance_id, op.model_name, op.tenant_id, op.block_size, op.dp_rank, op.endpoint,
                             op.replay_endpoint)
            if op.endpoint:
                applied.subscribe.append(Subscription(op.model_name, op.tenant_id, op.block_size, op.instance_id,
                                                      op.dp_rank, op.endpoint, op.replay_endpoint))
        elif kind == UNREGISTER:
            op = _decoders[UNREGISTER].decode(data)
            applied.unsubscribe = indexer.unregister(op.instance_id, op.model_name, op.tenant_id, op.dp_rank)
        elif kind == ROUTED:
            op = _decoders[ROUTED].decode(data)
            applied.report = indexer.record_routed(op.model_name, op.tenant_id, op.instance_id, op.dp_rank,
                                                   op.block_hashes)
        else:
            applied.error = ServiceError(f"unknown message kind {kind!r}")
    except ServiceError as error:
        applied.error = error
    except (msgspec.DecodeError, ValueError) as error:
        applied.error = ServiceError(f"undecodable {kind} message: {error}")
    return applied


def _apply_batch(indexer: Indexer, batch: Batch) -> ApplyReport:
    try:
        decoded = decode_batch(batch.payload, worker_id=batch.worker_id, dp_rank=batch.dp_rank, seq=batch.seq,
                               block_size=batch.block_size)
    except MalformedBatch as error:
        raise ServiceError(f"engine batch seq {batch.seq} of worker {batch.worker_id}: {error}") from None
    # A copy JetStream did not catch (published after its duplicate window, by a replica that
    # was stalled that long) carries a seq the rank has passed: skip it. An engine restart is
    # a `reset` message first, which clears the watermark, so a new count is never mistaken.
    watermark = indexer.watermark(batch.model_name, batch.tenant_id, batch.worker_id, decoded.dp_rank)
    if watermark is not None and batch.seq <= watermark:
        return indexer.skip_batch(len(decoded.events))
    return indexer.apply_batch(batch.model_name, batch.tenant_id, decoded.events)


# --- snapshots ------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """The index at one stream sequence: what a new replica loads before it consumes the rest."""

    sequence: int  # the last stream message applied
    ranks: list[RankState]
    partitions: list[PartitionEvents]  # the index as `/dump` holds it


def collect(indexer: Indexer, sequence: int) -> Snapshot:
    """On the event loop: fresh objects that later changes of the index do not touch."""
    return Snapshot(sequence, indexer.rank_states(), indexer.dump_partitions())


def encode_snapshot(snapshot: Snapshot) -> Iterator[bytes]:
    """JSON `{"sequence": S, "ranks": [...], "index": <the /dump document>}`, in pieces (in a
    worker thread: the encoders hold the GIL, the pieces let the event loop in between)."""
    yield b'{"sequence":%d,"ranks":%s,"index":' % (snapshot.sequence, msgspec.json.encode(snapshot.ranks))
    yield from encode_partitions(snapshot.partitions)
    yield b"}"


class _SnapshotDocument(msgspec.Struct):
    sequence: int
    ranks: list[RankState]
    index: msgspec.Raw


def load_snapshot(indexer: Indexer, data: bytes) -> tuple[int, list[Subscription]]:
    """Load a snapshot into an empty index; returns the sequence it covers and the engines its
    registrations subscribe to. Raises ValueError or ServiceError for a snapshot it cannot use."""
    document = msgspec.json.decode(data, type=_SnapshotDocument)
    indexer.load_sections(decode_events_document(bytes(document.index)))
    states = document.ranks
    indexer.restore_rank_states(states)
    subscriptions = [Subscription(s.model_name, s.tenant_id, s.block_size, s.instance_id, s.dp_rank, s.endpoint,
                                  s.replay_endpoint) for s in states if s.registered and s.endpoint]
    return document.sequence, subscriptions


def describe(snapshot_ranks: Iterable[RankState]) -> str:
    ranks = list(snapshot_ranks)
    return f"{len(ranks)} ranks, {sum(1 for r in ranks if r.registered)} registered"
