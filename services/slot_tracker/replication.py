"""How a slot tracker replica takes its own writes and applies the others': pure and
synchronous (no asyncio, no NATS). The NATS side is `nats_replica`; what travels is `ops`; the
order ops are applied in is `sequencing`; which add of a request id wins is `merge`.

Every write a replica accepts is applied to its own `SlotTracker` as without replication, then
queued as an op with the replica's origin and the next number of its sequence. The other
replicas apply it as `merge` says: replicas that received the same ops hold the same requests,
whatever order the ops came in. A replica keeps what it knows of each request id (`History`,
the *tombstone* once the request is gone) for the request TTL after its last op, so an add
arriving after its free is ignored for that long.

What is not ordered: registrations. `/register` and `/unregister` replicate in arrival order;
a worker registered on two replicas at once with different ranges keeps the first one each
replica saw (counted as a conflict). Orchestrators register a worker through one replica.
Expiry stays local: each replica frees a request `--request-ttl-secs` after it added it, which
differs between replicas by the replication delay.

Cost on a replica's own writes: one op struct, one `History` struct stored in an insertion-
ordered dict, one list append (bench/ANALYSIS.md, "Figures behind the code"); nothing of it
runs without `--nats`.
A request id is remembered for a TTL after its last op, about 370 B each (tracemalloc, 100,000
lifecycles), in structures the garbage collector does not track (see `ops.Tag`).
"""

from __future__ import annotations

import secrets
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from dynamo_lite.base.errors import ServiceError

from .core import SlotTracker
from .merge import (
    History,
    Incarnation,
    UnknownFree,
    concurrent,
    dead,
    find,
    freed,
    incarnations,
    keep_body,
    progress_of,
    referenced,
    tombstone,
    winner,
    with_free,
    with_incarnation,
    with_progress,
)
from .ops import (
    Add,
    Batch,
    Free,
    Heartbeat,
    Message,
    Op,
    OutputBlocks,
    PrefillComplete,
    Register,
    Tag,
    Unregister,
    decode_message,
    encode,
)
from .protocols import AGGREGATED, SlotTrackerDump
from .sequencing import Due, Gap, SequenceCounts, Sequencer

# The names the shell and the tests take from here.
__all__ = [
    "DELAY_BUCKETS", "Add", "Batch", "Free", "Gap", "Heartbeat", "Message", "Op", "OutputBlocks",
    "PrefillComplete", "Register", "Replica", "ReplicationCounts", "StateHeader", "Tag", "Unregister",
    "decode_header", "decode_message", "encode", "new_origin",
]


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
class ReplicationCounts(SequenceCounts):
    published: int = 0  # ops of this replica sent to NATS (counted by the shell)
    applied: int = 0  # ops of other replicas applied
    conflicts: int = 0  # adds of a request id another replica added concurrently
    late_adds: int = 0  # adds that arrived after their request was freed (a tombstone ignored them)
    unplaced: int = 0  # winning adds this tracker refused (unknown worker or rank)
    topology_conflicts: int = 0  # registrations refused here (the worker or block size differs)
    delay_buckets: list[int] = field(default_factory=lambda: [0] * (len(DELAY_BUCKETS) + 1))
    delay_sum: float = 0.0
    last_delay: float = 0.0

    def record_delay(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # clocks of two hosts may disagree by a little
        self.delay_buckets[bisect_left(DELAY_BUCKETS, seconds)] += 1
        self.delay_sum += seconds
        self.last_delay = seconds



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
        # Per (model_name, tenant_id), by request id, least recently touched first.
        self.histories: dict[tuple[str, str], OrderedDict[str, History]] = {}
        self.outbox: list[Op] = []
        self.outbox_first_seq = 1
        self.outbox_accepted_at = 0.0
        self.counts = ReplicationCounts()
        self.sequencer = Sequencer(self.origin, self.counts)

    @property
    def vector(self) -> dict[int, int]:
        """The last op applied here of each origin."""
        return self.sequencer.vector

    @property
    def held(self) -> dict[int, list[Batch]]:
        """Batches held back past a gap, per origin."""
        return self.sequencer.held

    # --- this replica's writes ------------------------------------------------------------------

    def register(self, worker_id: int, model_name: str, tenant_id: str, block_size: int, dp_start: int,
                 dp_size: int, role: str = AGGREGATED) -> None:
        self.tracker.register(worker_id, model_name, tenant_id, block_size, dp_start, dp_size, role)
        self._queue(Register(model_name, tenant_id, worker_id, block_size, dp_start, dp_size, role))

    def unregister(self, worker_id: int, model_name: str, tenant_id: str) -> None:
        self.tracker.unregister(worker_id, model_name, tenant_id)
        self._queue(Unregister(model_name, tenant_id, worker_id))

    def add(self, model_name: str, tenant_id: str, request_id: str, worker_id: int, dp_rank: int,
            sequence_hashes: list[int], new_isl_tokens: int = 0, expected_output_tokens: int | None = None) -> None:
        self.tracker.add(model_name, tenant_id, request_id, worker_id, dp_rank, sequence_hashes, new_isl_tokens,
                         expected_output_tokens)
        known = self.history(model_name, tenant_id, request_id)
        after = referenced(known) if known is not None else ()
        seq = self._queue(Add(model_name, tenant_id, request_id, worker_id, dp_rank, sequence_hashes,
                              new_isl_tokens, after, expected_output_tokens))
        incarnation = Incarnation(self.origin, seq, after, worker_id, dp_rank, new_isl_tokens,
                                  expected_output_tokens=expected_output_tokens)
        now = self.tracker.clock()
        if known is None:
            history = History(now, incarnation, placed=incarnation.tag)
        else:
            history = msgspec.structs.replace(with_incarnation(known, incarnation), touched=now,
                                              placed=incarnation.tag)
        self._store(model_name, tenant_id, request_id, history)

    def prefill_complete(self, model_name: str, tenant_id: str, request_id: str) -> None:
        self.tracker.prefill_complete(model_name, tenant_id, request_id)
        self._progress(model_name, tenant_id, request_id, True, 0)

    def set_output_blocks(self, model_name: str, tenant_id: str, request_id: str, output_blocks: int) -> None:
        self.tracker.set_output_blocks(model_name, tenant_id, request_id, output_blocks)
        self._progress(model_name, tenant_id, request_id, False, output_blocks)

    def free(self, model_name: str, tenant_id: str, request_id: str) -> None:
        held = self.tracker.request(model_name, tenant_id, request_id) is not None
        self.tracker.free(model_name, tenant_id, request_id)
        known = self.history(model_name, tenant_id, request_id) or History(self.tracker.clock())
        if held:
            target = self._placed(known)
            self._queue(Free(model_name, tenant_id, request_id, target))
            history = tombstone(with_free(known, target))
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
        progress = with_progress(known.progress, target, prefill, output_blocks)
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
        if message.origin == self.origin:
            return None  # this replica's own ops, echoed: applied when accepted
        due, gap = self.sequencer.receive(message, self.tracker.clock())
        self._apply_due(due)
        return gap

    def gap(self, origin: int) -> Gap | None:
        """What is still missing of `origin`, if anything."""
        return self.sequencer.gap(origin)

    def skip(self, origin: int) -> int:
        """Give up on the ops missing before what is known of `origin`; returns how many."""
        lost, due = self.sequencer.skip(origin)
        self._apply_due(due)
        return lost

    def _apply_due(self, due: list[Due]) -> None:
        for item in due:
            batch, skip, origin = item.batch, item.skip, item.batch.origin
            seq = batch.first_seq + skip
            for op in batch.ops[skip:] if skip else batch.ops:
                self._apply(origin, seq, op)
                seq += 1
            self.counts.applied += len(batch.ops) - skip
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
            progress = with_progress(known.progress, op.target, prefill, output_blocks)
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
        if find(previous, Tag(origin, seq)) is not None:
            self.counts.duplicates += 1
            return
        incarnation = Incarnation(origin, seq, op.after, op.worker_id, op.dp_rank, op.new_isl_tokens,
                                  tuple(op.sequence_hashes), expected_output_tokens=op.expected_output_tokens)
        if any(concurrent(other, incarnation) and not dead(other, known) for other in previous):
            self.counts.conflicts += 1
        history = with_incarnation(known, incarnation)
        added = find(incarnations(history), incarnation.tag)
        assert added is not None  # `with_incarnation` put it there (or it was already known)
        if freed(added, history):
            self.counts.late_adds += 1  # its free came first: the tombstone keeps it out
        self._settle(op.model_name, op.tenant_id, op.request_id, history)

    def _apply_free(self, origin: int, seq: int, op: Free) -> None:
        known = self.history(op.model_name, op.tenant_id, op.request_id) or History(0.0)
        if op.target is not None:
            history = with_free(known, op.target)
        else:
            free = UnknownFree(origin, seq, op.seen)
            history = msgspec.structs.replace(known, unknown_frees=known.unknown_frees + (free,))
        self._settle(op.model_name, op.tenant_id, op.request_id, history)

    def _apply_register(self, op: Register) -> None:
        worker = self.tracker.worker(op.model_name, op.tenant_id, op.worker_id)
        if worker is not None and (worker.block_size, worker.dp_start, worker.dp_size, worker.role) == (
                op.block_size, op.dp_start, op.dp_size, op.role):
            return  # registered here too (through this replica as well): the same worker
        try:
            self.tracker.register(op.worker_id, op.model_name, op.tenant_id, op.block_size, op.dp_start, op.dp_size,
                                  op.role)
        except ServiceError:
            self.counts.topology_conflicts += 1

    def _settle(self, model_name: str, tenant_id: str, request_id: str, history: History) -> None:
        """Make the tracker hold what `history` says of the request id, and store it."""
        tracker = self.tracker
        request = tracker.request(model_name, tenant_id, request_id)
        best = winner(history)
        placed = history.placed
        if placed is not None and (best is None or best.tag != placed):
            # The copy this tracker holds lost: freed, superseded, or beaten by a smaller origin.
            if request is not None:
                history = keep_body(history, placed, request.hashes)
                tracker.free(model_name, tenant_id, request_id)
                request = None
            placed = None
        if best is not None and placed is None:
            best = find(incarnations(history), best.tag)
            assert best is not None
            if best.hashes is not None and request is None:
                try:
                    tracker.add(model_name, tenant_id, request_id, best.worker_id, best.dp_rank, best.hashes,
                                best.new_isl_tokens, best.expected_output_tokens)
                except ServiceError:
                    self.counts.unplaced += 1
                else:
                    placed = best.tag
                    history = keep_body(history, placed, None)
                    request = tracker.request(model_name, tenant_id, request_id)
        if best is not None and placed == best.tag and request is not None:
            prefill, output_blocks = progress_of(best, history)
            if prefill and request.prefill_tokens:
                tracker.prefill_complete(model_name, tenant_id, request_id)
            if output_blocks > request.output_blocks:
                tracker.set_output_blocks(model_name, tenant_id, request_id, output_blocks)
        history = msgspec.structs.replace(history, touched=tracker.clock(), placed=placed)
        self._store(model_name, tenant_id, request_id, tombstone(history))

    # --- whole states ----------------------------------------------------------------------------

    def adopt_tracker(self) -> int:
        """Give every request the tracker holds without a history (loaded from a snapshot) one,
        as an add of this replica numbered 0; returns how many."""
        now = self.tracker.clock()
        adopted = 0
        for model_name, tenant_id, request in self.tracker.active_requests():
            if self.history(model_name, tenant_id, request.request_id) is not None:
                continue
            slot = request.slot
            incarnation = Incarnation(self.origin, 0, (), slot.worker_id, slot.dp_rank, request.prefill_tokens,
                                      expected_output_tokens=request.expected_output_tokens)
            self._store(model_name, tenant_id, request.request_id, History(now, incarnation, placed=incarnation.tag))
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
        return self.sequencer.load(header.vector, self.tracker.clock())

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
        self.sequencer.forget_unheard(deadline)
        return forgotten
