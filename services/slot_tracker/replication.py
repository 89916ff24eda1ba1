"""What slot tracker replicas tell each other, and how a replica applies it: pure and
synchronous (no asyncio, no NATS). The NATS side is `nats_sync`.

Every write a replica accepts (`/register`, `/unregister`, `/add`, `/prefill_complete`,
`/output_blocks`, `/free`) is applied to its own `SlotTracker` as without replication, then
becomes an *op* with the replica's *origin* (a random 63-bit id drawn at start) and the next
number of the origin's *sequence*. Ops travel in `Batch`es, in sequence order; the other
replicas apply them. The *version vector* maps each origin to the last number of its sequence
applied here, so a re-delivered op is skipped, and a number beyond the next one is a *gap*
(NATS core is at-most-once): the batch is held back until the missing ops arrive (see
`Replica.receive`). `Heartbeat`s carry an origin's last number, so a gap at the end of a burst
shows too.

One request id, several adds. Each add is an *incarnation* of its request id, named by its
tag `(origin, seq)`. An add lists in `after` every tag of that request id its replica knew of
(earlier incarnations, frees, ...): those happened before it. Two incarnations neither of
which lists the other, from different origins, are *concurrent*: the same request id added
through two replicas at once (two gateways, or a gateway retrying elsewhere). For each request
id, every replica computes from the ops it received (never from their order):

* an incarnation is *dead* when a free names it or an incarnation concurrent with it (a free
  ends the request whichever replica's copy the gateway saw), when a later incarnation
  lists it or comes from the same origin with a higher number, or when a free of an id its
  replica did not hold (see below) covers it;
* of the incarnations not dead, which are pairwise concurrent, the one with the smallest
  origin is *the* request: its `/add` body, with the prefill completion and the largest output
  block count reported for it or for any incarnation concurrent with it. A losing copy is
  replaced by the winner; calls made on the losing copy count for the winner.

A `/free` of a request id the replica does not hold (a free that overtook the add replicating
from another replica, or a repeated free) is published with the replica's version vector
(`seen`): it kills every incarnation of that id from another origin that the vector does not
cover, whenever it arrives, unless that incarnation lists the free in `after` (its replica had
seen the free: a new request reusing the id).

So the state is a function of the set of ops received, and replicas that received the same
ops hold the same requests, whatever order the ops came in (tested with hypothesis in
`tests/test_slot_tracker_replication.py`). A replica keeps what it knows of each request id
(`History`, the *tombstone* once the request is gone) for the request TTL after its last op,
so an add arriving after its free is ignored for that long.

What is not ordered: registrations. `/register` and `/unregister` replicate in arrival order;
a worker registered on two replicas at once with different ranges keeps the first one each
replica saw (counted as a conflict). Orchestrators register a worker through one replica.
Expiry stays local: each replica frees a request `--request-ttl-secs` after it added it, which
differs between replicas by the replication delay.

Cost on a replica's own writes: one op struct, one `History` struct stored in an insertion-
ordered dict, one list append (about 1.5 us per write); nothing of it runs without `--nats`.
A request id is remembered for a TTL after its last op, about 370 B each (tracemalloc, 100,000
lifecycles), in structures the garbage collector does not track (see `Tag`).
"""

from __future__ import annotations

import secrets
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Union

import msgspec

from dynamo_lite.errors import ServiceError

from .core import Partition, SlotTracker
from .protocols import SlotTrackerDump


class Tag(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An op's name: its origin and sequence number (in `Free.seen`: an origin and the last
    number applied). A struct the garbage collector does not track, not a tuple: a replica
    keeps tags for a TTL, and tracked objects kept that long make young collections run, each
    traversing the tracker's newest hash sets (20-40 ms with 256-hash requests)."""

    origin: int
    seq: int


# --- ops: what a replica publishes for each write it accepted --------------------------------
# Compact on the wire: msgpack arrays, an integer tag first.


class Register(msgspec.Struct, array_like=True, frozen=True, tag=1):
    model_name: str
    tenant_id: str
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int


class Unregister(msgspec.Struct, array_like=True, frozen=True, tag=2):
    model_name: str
    tenant_id: str
    worker_id: int


class Add(msgspec.Struct, array_like=True, frozen=True, tag=3):
    model_name: str
    tenant_id: str
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: list[int]
    new_isl_tokens: int
    after: tuple[Tag, ...] = ()  # tags of this request id the publishing replica knew of


class PrefillComplete(msgspec.Struct, array_like=True, frozen=True, tag=4):
    model_name: str
    tenant_id: str
    request_id: str
    target: Tag  # the incarnation the publishing replica held


class OutputBlocks(msgspec.Struct, array_like=True, frozen=True, tag=5):
    model_name: str
    tenant_id: str
    request_id: str
    target: Tag
    output_blocks: int


class Free(msgspec.Struct, array_like=True, frozen=True, tag=6):
    model_name: str
    tenant_id: str
    request_id: str
    target: Tag | None  # None: the publishing replica held no such request
    seen: tuple[Tag, ...] = ()  # with no target: its version vector, as (origin, last seq) pairs


Op = Union[Register, Unregister, Add, PrefillComplete, OutputBlocks, Free]


class Batch(msgspec.Struct, array_like=True, frozen=True, tag=1):
    """Consecutive ops of one origin: `ops[i]` has sequence number `first_seq + i`."""

    origin: int
    first_seq: int
    accepted_at: float  # wall-clock time its first op was accepted: the replication delay starts there
    ops: list[Op]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.ops) - 1


class Heartbeat(msgspec.Struct, array_like=True, frozen=True, tag=2):
    """An origin is alive and has published up to `last_seq`."""

    origin: int
    last_seq: int
    sent_at: float


Message = Union[Batch, Heartbeat]

_encoder = msgspec.msgpack.Encoder()
_message_decoder = msgspec.msgpack.Decoder(Message)


def encode(value: object) -> bytes:
    return _encoder.encode(value)


def decode_message(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError (ValueError) for anything else."""
    return _message_decoder.decode(data)


# --- what a replica remembers of one request id --------------------------------------------------


class Incarnation(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One add of a request id. Its body is kept (`hashes`) only while this replica may still
    have to add it: the tracker holds the hashes of the one it placed."""

    origin: int
    seq: int
    after: tuple[Tag, ...]
    worker_id: int
    dp_rank: int
    new_isl_tokens: int
    hashes: tuple[int, ...] | None = None
    freed: bool = False  # a free named it

    @property
    def tag(self) -> Tag:
        return Tag(self.origin, self.seq)


class UnknownFree(msgspec.Struct, array_like=True, frozen=True, gc=False):
    origin: int
    seq: int
    seen: tuple[Tag, ...]


class Progress(msgspec.Struct, array_like=True, frozen=True, gc=False):
    target: Tag
    prefill: bool
    output_blocks: int


class History(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Every op received for one request id. Immutable (replaced on each op), so a state
    transfer can encode a copy in a thread while the event loop goes on; and untracked by the
    garbage collector down to its common case, one incarnation: see `Tag`."""

    touched: float  # the tracker clock at its last op; forgotten a request TTL later
    first: Incarnation | None = None
    others: tuple[Incarnation, ...] = ()  # more adds of the same id: a conflict, or a reuse
    freed: tuple[Tag, ...] = ()  # frees naming an incarnation not received here (yet)
    unknown_frees: tuple[UnknownFree, ...] = ()
    progress: tuple[Progress, ...] = ()  # one per target
    placed: Tag | None = None  # the incarnation this replica's tracker holds (or held until expiry)


def incarnations(history: History) -> tuple[Incarnation, ...]:
    first = history.first
    if first is None:
        return history.others
    return (first, *history.others) if history.others else (first,)


def _with_incarnation(history: History, incarnation: Incarnation) -> History:
    tag = incarnation.tag
    if tag in history.freed:  # its free came first
        incarnation = msgspec.structs.replace(incarnation, freed=True)
        history = msgspec.structs.replace(history, freed=tuple(t for t in history.freed if t != tag))
    if history.first is None:
        return msgspec.structs.replace(history, first=incarnation)
    return msgspec.structs.replace(history, others=history.others + (incarnation,))


def _replaced(history: History, old: Incarnation, new: Incarnation) -> History:
    if history.first is old:
        return msgspec.structs.replace(history, first=new)
    return msgspec.structs.replace(history, others=tuple(new if other is old else other for other in history.others))


def _with_free(history: History, target: Tag) -> History:
    """`history` with a free naming `target`."""
    known = _find(incarnations(history), target)
    if known is None:
        return msgspec.structs.replace(history, freed=history.freed + (target,))
    if known.freed:
        return history
    return _replaced(history, known, msgspec.structs.replace(known, freed=True))


def concurrent(a: Incarnation, b: Incarnation) -> bool:
    return a.origin != b.origin and b.tag not in a.after and a.tag not in b.after


def _find(candidates: Iterable[Incarnation], tag: Tag) -> Incarnation | None:
    for incarnation in candidates:
        if incarnation.origin == tag.origin and incarnation.seq == tag.seq:
            return incarnation
    return None


def _seen(pairs: tuple[Tag, ...], origin: int) -> int:
    for pair in pairs:
        if pair.origin == origin:
            return pair.seq
    return 0


def dead(incarnation: Incarnation, history: History) -> bool:
    """Whether the ops in `history` end `incarnation` (see the module docstring)."""
    tag = incarnation.tag
    candidates = incarnations(history)
    for other in candidates:
        if other is not incarnation and (
            (other.origin == incarnation.origin and other.seq > incarnation.seq) or tag in other.after
        ):
            return True
    return freed(incarnation, history)


def freed(incarnation: Incarnation, history: History) -> bool:
    """Whether a free in `history` ends `incarnation`."""
    if incarnation.freed or incarnation.tag in history.freed:
        return True
    for other in incarnations(history):
        if other.freed and concurrent(other, incarnation):
            return True
    for free in history.unknown_frees:
        if (free.origin != incarnation.origin and Tag(free.origin, free.seq) not in incarnation.after
                and incarnation.seq > _seen(free.seen, incarnation.origin)):
            return True
    return False


def winner(history: History) -> Incarnation | None:
    """The incarnation that is the request, or None when every one is dead."""
    best = None
    for incarnation in incarnations(history):
        if (best is None or incarnation.origin < best.origin) and not dead(incarnation, history):
            best = incarnation
    return best


def progress_of(incarnation: Incarnation, history: History) -> tuple[bool, int]:
    """(prefill completed, output blocks) reported for `incarnation` or its concurrent copies."""
    tags = {incarnation.tag}
    tags.update(other.tag for other in incarnations(history) if concurrent(other, incarnation))
    prefill, output_blocks = False, 0
    for progress in history.progress:
        if progress.target in tags:
            prefill = prefill or progress.prefill
            output_blocks = max(output_blocks, progress.output_blocks)
    return prefill, output_blocks


def _referenced(history: History) -> tuple[Tag, ...]:
    """Every tag a history names: a new add of its request id comes after all of them."""
    tags = dict.fromkeys(incarnation.tag for incarnation in incarnations(history))
    tags.update(dict.fromkeys(history.freed))
    tags.update(dict.fromkeys(Tag(free.origin, free.seq) for free in history.unknown_frees))
    tags.update(dict.fromkeys(progress.target for progress in history.progress))
    return tuple(tags)


def _with_progress(
    progress: tuple[Progress, ...], target: Tag, prefill: bool, output_blocks: int
) -> tuple[Progress, ...]:
    for index, known in enumerate(progress):
        if known.target == target:
            merged = Progress(target, known.prefill or prefill, max(known.output_blocks, output_blocks))
            return progress[:index] + (merged,) + progress[index + 1:]
    return progress + (Progress(target, prefill, output_blocks),)


# --- the state a running replica hands to a joining one ------------------------------------------


class StateHeader(msgspec.Struct, array_like=True):
    """Everything of a replica's state but the tracker's (`SlotTrackerDump`, sent beside it)."""

    origin: int
    clock: float  # the responder's tracker clock when collected: `History.touched` is relative to it
    vector: dict[int, int]
    histories: list[tuple[str, str, str, History]]


_header_decoder = msgspec.msgpack.Decoder(StateHeader)


def decode_header(data: bytes) -> StateHeader:
    return _header_decoder.decode(data)


# --- counters ---------------------------------------------------------------------------------

# Upper bounds in seconds of the replication delay histogram: from an op's acceptance on one
# replica to its application on another.
DELAY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ReplicationCounts:
    published: int = 0  # ops of this replica sent to NATS (counted by the shell)
    applied: int = 0  # ops of other replicas applied
    duplicates: int = 0  # ops received again and skipped
    conflicts: int = 0  # adds of a request id another replica added concurrently
    late_adds: int = 0  # adds that arrived after their request was freed (a tombstone ignored them)
    unplaced: int = 0  # winning adds this tracker refused (unknown worker or rank)
    topology_conflicts: int = 0  # registrations refused here (the worker or block size differs)
    gaps: int = 0  # jumps in an origin's sequence numbers: ops lost on the way
    lost: int = 0  # ops given up on: no replica could send them again
    delay_buckets: list[int] = field(default_factory=lambda: [0] * (len(DELAY_BUCKETS) + 1))
    delay_sum: float = 0.0
    last_delay: float = 0.0

    def record_delay(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # clocks of two hosts may disagree by a little
        self.delay_buckets[bisect_left(DELAY_BUCKETS, seconds)] += 1
        self.delay_sum += seconds
        self.last_delay = seconds


@dataclass(frozen=True)
class Gap:
    """Ops `first` .. `last` of `origin` are missing here."""

    origin: int
    first: int
    last: int


def new_origin() -> int:
    return secrets.randbits(63) | 1


class Replica:
    """One replica's side of replication around its `SlotTracker`.

    The routes call the write methods (`register` ... `free`) instead of the tracker's: each
    applies the write to the tracker exactly as without replication (raising the same errors,
    then nothing is published) and queues the op in `outbox`, which the shell publishes in
    order (`take_outbox`). The shell hands every message received to `receive`, and moves
    whole states with `collect_state` / `load_state`. Not thread-safe, like the tracker.
    """

    def __init__(
        self,
        tracker: SlotTracker,
        *,
        origin: int | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.tracker = tracker
        self.origin = origin if origin is not None else new_origin()
        self.wall_clock = wall_clock
        self.seq = 0  # the last sequence number given to an op of this replica
        self.vector: dict[int, int] = {self.origin: 0}
        # Per (model_name, tenant_id), by request id, least recently touched first.
        self.histories: dict[tuple[str, str], OrderedDict[str, History]] = {}
        self.outbox: list[Op] = []
        self.outbox_first_seq = 1
        self.outbox_accepted_at = 0.0
        self.held: dict[int, list[Batch]] = {}  # batches past a gap, per origin, by first_seq
        self.known_last: dict[int, int] = {}  # the highest sequence number an origin is known to have used
        self.heard: dict[int, float] = {}  # tracker clock of each origin's last message
        self.open_gaps: set[int] = set()  # origins with ops missing
        self.counts = ReplicationCounts()

    # --- this replica's writes ------------------------------------------------------------------

    def register(self, worker_id: int, model_name: str, tenant_id: str, block_size: int, dp_start: int,
                 dp_size: int) -> None:
        self.tracker.register(worker_id, model_name, tenant_id, block_size, dp_start, dp_size)
        self._queue(Register(model_name, tenant_id, worker_id, block_size, dp_start, dp_size))

    def unregister(self, worker_id: int, model_name: str, tenant_id: str) -> None:
        self.tracker.unregister(worker_id, model_name, tenant_id)
        self._queue(Unregister(model_name, tenant_id, worker_id))

    def add(self, model_name: str, tenant_id: str, request_id: str, worker_id: int, dp_rank: int,
            sequence_hashes: list[int], new_isl_tokens: int = 0) -> None:
        self.tracker.add(model_name, tenant_id, request_id, worker_id, dp_rank, sequence_hashes, new_isl_tokens)
        known = self.history(model_name, tenant_id, request_id)
        after = _referenced(known) if known is not None else ()
        seq = self._queue(Add(model_name, tenant_id, request_id, worker_id, dp_rank, sequence_hashes,
                              new_isl_tokens, after))
        incarnation = Incarnation(self.origin, seq, after, worker_id, dp_rank, new_isl_tokens)
        now = self.tracker.clock()
        if known is None:
            history = History(now, incarnation, placed=incarnation.tag)
        else:
            history = msgspec.structs.replace(_with_incarnation(known, incarnation), touched=now,
                                              placed=incarnation.tag)
        self._store(model_name, tenant_id, request_id, history)

    def prefill_complete(self, model_name: str, tenant_id: str, request_id: str) -> None:
        self.tracker.prefill_complete(model_name, tenant_id, request_id)
        self._progress(model_name, tenant_id, request_id, True, 0)

    def set_output_blocks(self, model_name: str, tenant_id: str, request_id: str, output_blocks: int) -> None:
        self.tracker.set_output_blocks(model_name, tenant_id, request_id, output_blocks)
        self._progress(model_name, tenant_id, request_id, False, output_blocks)

    def free(self, model_name: str, tenant_id: str, request_id: str) -> None:
        partition = self.tracker.partitions.get((model_name, tenant_id))
        held = partition is not None and request_id in partition.requests
        self.tracker.free(model_name, tenant_id, request_id)
        known = self.history(model_name, tenant_id, request_id) or History(self.tracker.clock())
        if held:
            target = self._placed(known)
            self._queue(Free(model_name, tenant_id, request_id, target))
            history = _tombstone(_with_free(known, target))
        else:
            seen = tuple(Tag(origin, seq) for origin, seq in self.vector.items())
            seq = self._queue(Free(model_name, tenant_id, request_id, None, seen))
            unknown_frees = known.unknown_frees + (UnknownFree(self.origin, seq, seen),)
            history = msgspec.structs.replace(known, unknown_frees=unknown_frees)
        self._store(model_name, tenant_id, request_id, msgspec.structs.replace(history, touched=self.tracker.clock()))

    def _progress(self, model_name: str, tenant_id: str, request_id: str, prefill: bool, output_blocks: int) -> None:
        known = self.history(model_name, tenant_id, request_id) or History(self.tracker.clock())
        target = self._placed(known)
        if prefill:
            self._queue(PrefillComplete(model_name, tenant_id, request_id, target))
        else:
            self._queue(OutputBlocks(model_name, tenant_id, request_id, target, output_blocks))
        progress = _with_progress(known.progress, target, prefill, output_blocks)
        self._store(model_name, tenant_id, request_id,
                    msgspec.structs.replace(known, touched=self.tracker.clock(), progress=progress))

    def _placed(self, known: History) -> Tag:
        # Every request the tracker holds was placed through a history (its add, a state
        # transfer, or `adopt_tracker` after a snapshot), so this fallback is never the rule.
        return known.placed if known.placed is not None else Tag(self.origin, 0)

    def _queue(self, op: Op) -> int:
        if not self.outbox:
            self.outbox_first_seq = self.seq + 1
            self.outbox_accepted_at = self.wall_clock()
        self.outbox.append(op)
        self.seq += 1
        self.vector[self.origin] = self.seq
        return self.seq

    def history(self, model_name: str, tenant_id: str, request_id: str) -> History | None:
        """What this replica remembers of a request id."""
        partition = self.histories.get((model_name, tenant_id))
        return partition.get(request_id) if partition is not None else None

    def remembered(self) -> int:
        """How many request ids this replica remembers (active ones, and tombstones)."""
        return sum(map(len, self.histories.values()))

    def _store(self, model_name: str, tenant_id: str, request_id: str, history: History) -> None:
        partition = self.histories.get((model_name, tenant_id))
        if partition is None:
            partition = self.histories[(model_name, tenant_id)] = OrderedDict()
        partition[request_id] = history
        partition.move_to_end(request_id)

    def take_outbox(self) -> Batch | None:
        """The ops queued since the last call, as one batch (None: nothing queued)."""
        if not self.outbox:
            return None
        batch = Batch(self.origin, self.outbox_first_seq, self.outbox_accepted_at, self.outbox)
        self.outbox = []
        return batch

    def heartbeat(self, last_seq: int) -> Heartbeat:
        """`last_seq`: the last op published (not merely queued)."""
        return Heartbeat(self.origin, last_seq, self.wall_clock())

    # --- other replicas' ops ----------------------------------------------------------------------

    def receive(self, message: Message) -> Gap | None:
        """Apply the ops of `message` not applied yet, in order. A message past a gap is held
        back until the ops before it arrive (through `receive` again) or are given up on
        (`skip`); the gap is returned, for the shell to ask for the missing ops."""
        origin = message.origin
        if origin == self.origin:
            return None  # this replica's own ops, echoed: applied when accepted
        self.heard[origin] = self.tracker.clock()
        if isinstance(message, Heartbeat):
            if message.last_seq > self.known_last.get(origin, 0):
                self.known_last[origin] = message.last_seq
            return self._gap(origin)
        batch = message
        if batch.last_seq > self.known_last.get(origin, 0):
            self.known_last[origin] = batch.last_seq
        expected = self.vector.get(origin, 0) + 1
        if batch.last_seq < expected:
            self.counts.duplicates += len(batch.ops)
            return None
        if batch.first_seq > expected:
            self._hold(batch)
            return self._gap(origin)
        self._apply_batch(batch, expected)
        return self._drain(origin)

    def gap(self, origin: int) -> Gap | None:
        """What is still missing of `origin`, if anything."""
        return self._gap(origin)

    def skip(self, origin: int) -> int:
        """Give up on the ops missing before what is known of `origin`; returns how many."""
        expected = self.vector.get(origin, 0) + 1
        held = self.held.get(origin)
        last = held[0].first_seq - 1 if held else self.known_last.get(origin, 0)
        if last < expected:
            return 0
        lost = last - expected + 1
        self.counts.lost += lost
        self.vector[origin] = last
        self._drain(origin)
        return lost

    def _gap(self, origin: int) -> Gap | None:
        expected = self.vector.get(origin, 0) + 1
        held = self.held.get(origin)
        last = held[0].first_seq - 1 if held else self.known_last.get(origin, 0)
        if last < expected:
            self.open_gaps.discard(origin)
            return None
        if origin not in self.open_gaps:
            self.open_gaps.add(origin)
            self.counts.gaps += 1
        return Gap(origin, expected, last)

    def _hold(self, batch: Batch) -> None:
        held = self.held.setdefault(batch.origin, [])
        if any(known.first_seq == batch.first_seq for known in held):
            self.counts.duplicates += len(batch.ops)
            return
        held.append(batch)
        if len(held) > 1 and held[-2].first_seq > batch.first_seq:
            held.sort(key=lambda known: known.first_seq)

    def _drain(self, origin: int) -> Gap | None:
        held = self.held.get(origin)
        while held:
            expected = self.vector.get(origin, 0) + 1
            batch = held[0]
            if batch.first_seq > expected:
                return self._gap(origin)
            held.pop(0)
            if batch.last_seq >= expected:
                self._apply_batch(batch, expected)
            else:
                self.counts.duplicates += len(batch.ops)
        self.held.pop(origin, None)
        return self._gap(origin)

    def _apply_batch(self, batch: Batch, expected: int) -> None:
        origin = batch.origin
        skipped = expected - batch.first_seq
        self.counts.duplicates += skipped
        seq = expected
        for op in batch.ops[skipped:] if skipped else batch.ops:
            self._apply(origin, seq, op)
            seq += 1
        self.vector[origin] = batch.last_seq
        self.counts.applied += len(batch.ops) - skipped
        self.counts.record_delay(self.wall_clock() - batch.accepted_at)

    def _apply(self, origin: int, seq: int, op: Op) -> None:
        if isinstance(op, Add):
            self._apply_add(origin, seq, op)
        elif isinstance(op, Free):
            self._apply_free(origin, seq, op)
        elif isinstance(op, (PrefillComplete, OutputBlocks)):
            known = self.history(op.model_name, op.tenant_id, op.request_id) or History(0.0)
            prefill = isinstance(op, PrefillComplete)
            output_blocks = op.output_blocks if isinstance(op, OutputBlocks) else 0
            progress = _with_progress(known.progress, op.target, prefill, output_blocks)
            self._settle(op.model_name, op.tenant_id, op.request_id,
                         msgspec.structs.replace(known, progress=progress))
        elif isinstance(op, Register):
            self._apply_register(op)
        elif isinstance(op, Unregister):
            try:
                self.tracker.unregister(op.worker_id, op.model_name, op.tenant_id)
            except ServiceError:
                pass  # already gone here: unregistering is idempotent across replicas

    def _apply_add(self, origin: int, seq: int, op: Add) -> None:
        known = self.history(op.model_name, op.tenant_id, op.request_id) or History(0.0)
        previous = incarnations(known)
        if _find(previous, Tag(origin, seq)) is not None:
            self.counts.duplicates += 1
            return
        incarnation = Incarnation(origin, seq, op.after, op.worker_id, op.dp_rank, op.new_isl_tokens,
                                  tuple(op.sequence_hashes))
        if any(concurrent(other, incarnation) and not dead(other, known) for other in previous):
            self.counts.conflicts += 1
        history = _with_incarnation(known, incarnation)
        added = _find(incarnations(history), incarnation.tag)
        assert added is not None  # `_with_incarnation` put it there (or it was already known)
        if freed(added, history):
            self.counts.late_adds += 1  # its free came first: the tombstone keeps it out
        self._settle(op.model_name, op.tenant_id, op.request_id, history)

    def _apply_free(self, origin: int, seq: int, op: Free) -> None:
        known = self.history(op.model_name, op.tenant_id, op.request_id) or History(0.0)
        if op.target is not None:
            history = _with_free(known, op.target)
        else:
            free = UnknownFree(origin, seq, op.seen)
            history = msgspec.structs.replace(known, unknown_frees=known.unknown_frees + (free,))
        self._settle(op.model_name, op.tenant_id, op.request_id, history)

    def _apply_register(self, op: Register) -> None:
        partition = self.tracker.partitions.get((op.model_name, op.tenant_id))
        worker = partition.workers.get(op.worker_id) if partition is not None else None
        if worker is not None and (worker.block_size, worker.dp_start, worker.dp_size) == (
                op.block_size, op.dp_start, op.dp_size):
            return  # registered here too (through this replica as well): the same worker
        try:
            self.tracker.register(op.worker_id, op.model_name, op.tenant_id, op.block_size, op.dp_start, op.dp_size)
        except ServiceError:
            self.counts.topology_conflicts += 1

    def _settle(self, model_name: str, tenant_id: str, request_id: str, history: History) -> None:
        """Make the tracker hold what `history` says of the request id, and store it."""
        tracker = self.tracker
        partition: Partition | None = tracker.partitions.get((model_name, tenant_id))
        request = partition.requests.get(request_id) if partition is not None else None
        best = winner(history)
        placed = history.placed
        if placed is not None and (best is None or best.tag != placed):
            # The copy this tracker holds lost: freed, superseded, or beaten by a smaller origin.
            if request is not None:
                history = _keep_body(history, placed, request.hashes)
                tracker.free(model_name, tenant_id, request_id)
                request = None
            placed = None
        if best is not None and placed is None:
            best = _find(incarnations(history), best.tag)
            assert best is not None
            if best.hashes is not None and request is None:
                try:
                    tracker.add(model_name, tenant_id, request_id, best.worker_id, best.dp_rank, best.hashes,
                                best.new_isl_tokens)
                except ServiceError:
                    self.counts.unplaced += 1
                else:
                    placed = best.tag
                    history = _keep_body(history, placed, None)
                    request = tracker.partitions[(model_name, tenant_id)].requests[request_id]
        if best is not None and placed == best.tag and request is not None:
            prefill, output_blocks = progress_of(best, history)
            if prefill and request.prefill_tokens:
                tracker.prefill_complete(model_name, tenant_id, request_id)
            if output_blocks > request.output_blocks:
                tracker.set_output_blocks(model_name, tenant_id, request_id, output_blocks)
        history = msgspec.structs.replace(history, touched=tracker.clock(), placed=placed)
        self._store(model_name, tenant_id, request_id, _tombstone(history))

    # --- whole states ----------------------------------------------------------------------------

    def adopt_tracker(self) -> int:
        """Give every request the tracker holds without a history (loaded from a snapshot) one,
        as an add of this replica numbered 0; returns how many."""
        now = self.tracker.clock()
        adopted = 0
        for (model_name, tenant_id), partition in self.tracker.partitions.items():
            for request in partition.requests.values():
                if self.history(model_name, tenant_id, request.request_id) is not None:
                    continue
                slot = request.slot
                incarnation = Incarnation(self.origin, 0, (), slot.worker_id, slot.dp_rank, request.prefill_tokens)
                self._store(model_name, tenant_id, request.request_id,
                            History(now, incarnation, placed=incarnation.tag))
                adopted += 1
        return adopted

    def collect_state(self, *, taken_at: float) -> tuple[StateHeader, SlotTrackerDump]:
        """This replica's whole state, consistent with its vector (call it on the event loop, in
        one step). The histories are immutable and the dump shares the tracker's hash tuples, so
        both can be encoded elsewhere while the tracker goes on."""
        histories = [(model_name, tenant_id, request_id, history)
                     for (model_name, tenant_id), partition in self.histories.items()
                     for request_id, history in partition.items()]
        header = StateHeader(self.origin, self.tracker.clock(), dict(self.vector), histories)
        return header, self.tracker.dump(taken_at=taken_at)

    def load_state(self, header: StateHeader, dump: SlotTrackerDump) -> list[Batch]:
        """Replace this replica's state with another's. Returns the batches that were held
        back here, for the caller to hand to `receive` again after its own ops (those of this
        replica the other had not applied yet: `vector[origin]` is now what it had).
        Raises ServiceError for a dump no tracker produces, changing nothing."""
        self.tracker.restore(dump)
        offset = self.tracker.clock() - header.clock
        self.histories = {}
        # Sent in each partition's order, which a restore keeps: least recently touched first.
        for model_name, tenant_id, request_id, history in header.histories:
            self._store(model_name, tenant_id, request_id,
                        msgspec.structs.replace(history, touched=history.touched + offset))
        self.vector = dict(header.vector)
        self.vector.setdefault(self.origin, 0)
        now = self.tracker.clock()
        self.heard = {origin: now for origin in self.vector if origin != self.origin}
        known_last = self.known_last
        self.known_last = {origin: max(seq, known_last.get(origin, 0))
                           for origin, seq in self.vector.items() if origin != self.origin}
        self.open_gaps = set()
        held = [batch for batches in self.held.values() for batch in batches]
        self.held = {}
        return held

    def own_ops(self, batches: Sequence[Batch]) -> None:
        """After `load_state`: re-apply the ops of this replica that the other one had not
        applied, from `batches` (what the shell published and still has) and the outbox; those
        in neither are counted as lost."""
        own = self.origin
        done = self.vector.get(own, 0)
        ops: dict[int, Op] = {}
        for batch in batches:
            if batch.origin == own and batch.last_seq > done:
                ops.update((batch.first_seq + index, op) for index, op in enumerate(batch.ops))
        ops.update((self.outbox_first_seq + index, op) for index, op in enumerate(self.outbox))
        expected = done + 1
        for seq in sorted(ops):
            if seq < expected:
                continue
            self.counts.lost += seq - expected
            self._apply(own, seq, ops[seq])
            expected = seq + 1
        self.counts.lost += max(0, self.seq + 1 - expected)
        self.vector[own] = self.seq

    def prune(self) -> int:
        """Forget the request ids whose last op is a request TTL old, and origins unheard of
        for that long; returns how many ids."""
        now = self.tracker.clock()
        deadline = now - self.tracker.request_ttl_secs
        forgotten = 0
        for key, partition in list(self.histories.items()):
            while partition:
                history = next(iter(partition.values()))
                if history.touched > deadline:
                    break
                partition.popitem(last=False)
                forgotten += 1
            if not partition:
                del self.histories[key]
        for origin, heard in list(self.heard.items()):
            if heard <= deadline and not self.held.get(origin):
                del self.heard[origin]
                self.vector.pop(origin, None)
                self.known_last.pop(origin, None)
                self.open_gaps.discard(origin)
        return forgotten


def _tombstone(history: History) -> History:
    """`history` without what no longer matters for the incarnations a free names: their progress
    (it counts only for them and the copies concurrent with them, which that free ends too) and
    their placement. A request id remembered after its free costs less."""
    if not history.progress and history.placed is None:
        return history
    targets = {incarnation.tag for incarnation in incarnations(history) if incarnation.freed}
    targets.update(history.freed)
    if not targets:
        return history
    progress = tuple(progress for progress in history.progress if progress.target not in targets)
    placed = None if history.placed in targets else history.placed
    return msgspec.structs.replace(history, progress=progress, placed=placed)


def _keep_body(history: History, tag: Tag, hashes: tuple[int, ...] | None) -> History:
    """`history` with the body of incarnation `tag` kept (`hashes`) or dropped (None): a copy
    that lost may win again (the one that beat it superseded), the placed one is in the tracker."""
    incarnation = _find(incarnations(history), tag)
    if incarnation is None:
        return history
    if hashes is not None and dead(incarnation, history):
        hashes = None  # it can never come back
    if incarnation.hashes is hashes:
        return history
    return _replaced(history, incarnation, msgspec.structs.replace(incarnation, hashes=hashes))
