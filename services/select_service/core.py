"""The selection core: one call per request chooses a worker and, when asked, books it.

Built on the cores of the other two services, in the same process: an `Indexer` (which ranks
cache which prompt blocks, fed by the engines' KV events) and a `SlotTracker` (the load booked
on each rank), plus the `Scheduler` of `dynamo_lite.routing.scheduling`, which decides. It adds what
Dynamo's selection service has around them: a worker catalog (`catalog`), pending selections
(`pending`), session affinity (`affinity`) and the reservations in flight.

Pure and synchronous, as the other cores: the HTTP shell (`app`) decodes requests, calls a
method, and applies the `ListenerChanges` upserts return (subscribing to engines is I/O).
Partitions are (model_name, routing_group): the other services' (model_name, tenant_id).

What a selection reads per candidate rank: the prompt's cached blocks there per tier (device,
then host-pinned, then disk, as the indexer reports them), and the rank's booked prefill tokens,
decode blocks with this prompt added, and requests in flight. Cached blocks below the device
tier count 0.75 (host) and 0.25 (disk) of a device block, as in Dynamo.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_lite.base.errors import Conflict, InvalidArgument, NotFound, ServiceError
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list
from dynamo_lite.indexer.core import Indexer, QueryResult
from dynamo_lite.indexer.listeners import Subscription
from dynamo_lite.routing.registrar import IndexedRank, TrackerWorker
from dynamo_lite.routing.scheduling import (
    AllBusy,
    NoWorkerAvailable,
    RankCost,
    RankInfo,
    RankState,
    Scheduler,
    SchedulerConfig,
    SchedulingRequest,
    Selection,
    ttft_config,
)
from dynamo_lite.routing.scheduling.model import DEFAULT_MAX_NUM_BATCHED_TOKENS
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.protocols import AGGREGATED, PREFILL

from .affinity import SessionAffinity, check_session_id
from .catalog import WorkerRecord, endpoint_problem
from .pending import PendingSelection, SelectionCache
from .protocols import (
    OutputBlockRequest,
    PromptFields,
    QueryRequest,
    ReservationRequest,
    SelectRequest,
    WorkerPatch,
    WorkerRequest,
)

HOST_CACHE_HIT_WEIGHT = 0.75
DISK_CACHE_HIT_WEIGHT = 0.25
DEFAULT_REQUEST_TTL_SECS = 300.0
# An advisory `/select`'s prefill capacity of a worker that did not declare max_num_batched_tokens.
ADVISORY_CAPACITY = 10_000_000

Partition = tuple[str, str]
RankKey = tuple[int, int]


class NotReady(ServiceError):
    """No schedulable worker for the request's partition (or the service is stopping)."""

    status = 503


class NoCandidate(ServiceError):
    """Workers exist, but none may take this request (its allowed ids, pinned worker or
    required taints rule them all out)."""

    status = 503


class Overloaded(ServiceError):
    """Every candidate rank is over a busy threshold: retry later."""

    status = 429


@dataclass(frozen=True, slots=True)
class SelectionSettings:
    """How the core selects and how long things live (the flags of `python -m
    dynamo_lite.select_service`)."""

    scheduler: SchedulerConfig = field(default_factory=ttft_config)
    selection_cache_ttl_secs: float = 120.0
    selection_cache_max_entries: int = 4096
    selection_cache_max_bytes: int = 256 * 1024 * 1024
    session_affinity_ttl_secs: float | None = None  # None: no session affinity
    request_ttl_secs: float = DEFAULT_REQUEST_TTL_SECS  # a booking never freed is dropped after this
    track_prefill_tokens: bool = True
    assume_kv_reuse: bool = True
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Registration:
    """A catalog change as one call on a service that holds the state (what a selector in
    remote mode sends): `register` or not (unregister) `unit`, a slot tracker worker or an
    indexer rank."""

    register: bool
    unit: TrackerWorker | IndexedRank


@dataclass(slots=True)
class ListenerChanges:
    """What the shell must do after a catalog change: the engine subscriptions to stop and
    start (one process), or the registrations to send, in order (remote mode)."""

    start: list[Subscription] = field(default_factory=list)
    stop: list[RankKey] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)

    def track(self, record: WorkerRecord, register: bool = True) -> None:
        ranks = record.ranks()
        assert record.block_size is not None
        self.registrations.append(Registration(register, TrackerWorker(
            record.worker_id, *record.partition, record.block_size, ranks.start, len(ranks), tracked_role(record))))

    def index(self, record: WorkerRecord, rank: int, endpoint: str | None, register: bool = True) -> None:
        assert record.block_size is not None
        self.registrations.append(Registration(register, IndexedRank(
            record.worker_id, rank, *record.partition, record.block_size, endpoint, record.replay_endpoint or None)))

    def ensure(self, record: WorkerRecord) -> None:
        """Register every unit of a schedulable record, not only the changed ones: the services a
        selector shares may have lost them (another selector removed the worker)."""
        wanted = ListenerChanges()
        wanted.track(record)
        for rank, endpoint in sorted(record.listener_endpoints().items()):
            if rank in record.ranks():
                wanted.index(record, rank, endpoint)
        sent = {r.unit for r in self.registrations if r.register}
        self.registrations.extend(r for r in wanted.registrations if r.unit not in sent)


@dataclass(frozen=True, slots=True)
class Readings:
    """What a selection reads, read by the shell from the services that hold the state (remote
    mode) rather than from this core's own indexer and slot tracker: the prompt (`prompt_of`),
    its cached blocks per rank and tier, and every rank's load with the prompt added (the rows
    of `/potential_loads` with no new prefill tokens)."""

    prompt: Prompt
    cached: QueryResult
    loads: list[dict[str, int]]


@dataclass(slots=True)
class Reservation:
    """A booking in flight, under its selection id (ids are unique service-wide)."""

    selection_id: str
    partition: Partition
    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]
    prefill_tokens: int  # booked as prefill until the first token
    block_size: int
    booked_at: float
    cost: RankCost | None  # the scheduler's estimate: the first token's delay teaches it
    session_id: str | None = None
    expected_output_tokens: int | None = None  # without a decay_fraction, output decays toward it
    prefilled: bool = False
    output_blocks: int = 0
    output_load: float = 0.0  # the output blocks weighed by the last decay fraction
    reported_output_blocks: int = 0  # remote mode: the count the shared slot tracker holds (it only grows)

    @property
    def rank(self) -> RankKey:
        return (self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt in the partition's block size: local block hashes (for the index),
    sequence hashes (for bookings, signed) and its length in tokens."""

    local_hashes: list[int]
    sequence_hashes: list[int]
    isl_tokens: int


@dataclass(slots=True)
class _Tiers:
    """One rank's cached blocks for a prompt: device, then what host-pinned and disk add."""

    device: int = 0
    host: int = 0
    disk: int = 0

    def weighted_blocks(self, device_credit: float = 1.0) -> float:
        return device_credit * self.device + HOST_CACHE_HIT_WEIGHT * self.host + DISK_CACHE_HIT_WEIGHT * self.disk


class SelectionCore:
    """Everything `python -m dynamo_lite.select_service` serves, minus HTTP and sockets."""

    def __init__(self, settings: SelectionSettings = SelectionSettings(), *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.indexer = Indexer()
        self.tracker = SlotTracker(request_ttl_secs=settings.request_ttl_secs, clock=clock)
        self.scheduler = Scheduler(settings.scheduler, seed=settings.seed, clock=clock)
        self.catalog: dict[int, WorkerRecord] = {}
        self.partitions: dict[Partition, _PartitionState] = {}
        self.pending = SelectionCache(ttl_secs=settings.selection_cache_ttl_secs,
                                      max_entries=settings.selection_cache_max_entries,
                                      max_bytes=settings.selection_cache_max_bytes, clock=clock)
        self.sessions = (SessionAffinity(settings.session_affinity_ttl_secs, clock=clock)
                         if settings.session_affinity_ttl_secs is not None else None)
        self.reservations: OrderedDict[str, Reservation] = OrderedDict()  # booking order = expiry order
        self.shutting_down = False
        self._random = random.Random(settings.seed)

    # --- the catalog ----------------------------------------------------------------------------

    def upsert_worker(self, request: WorkerRequest) -> tuple[dict[str, Any], ListenerChanges]:
        """`POST /workers`: the record replaces any previous one of the worker (its partition may
        change); returns the record as answered and the subscriptions to change."""
        return self._reconcile(WorkerRecord.from_request(request))

    def patch_worker(self, worker_id: int, patch: WorkerPatch) -> tuple[dict[str, Any], ListenerChanges]:
        old = self.catalog.get(worker_id)
        if old is None:
            raise NotFound(f"worker {worker_id} not found")
        record = WorkerRecord(**{name: _copy(getattr(old, name)) for name in WorkerRecord.__slots__})
        record.apply(patch)
        return self._reconcile(record)

    def delete_worker(self, worker_id: int) -> tuple[dict[str, Any], ListenerChanges]:
        record = self.catalog.get(worker_id)
        if record is None:
            raise NotFound(f"worker {worker_id} not found")
        changes = ListenerChanges()
        if record.schedulable:
            self._withdraw(record, changes)
        del self.catalog[worker_id]
        record.lifecycle = "unschedulable"
        record.not_schedulable_reasons = []
        return record.answer(), changes

    def workers(self, model_name: str | None = None, routing_group: str | None = None) -> list[dict[str, Any]]:
        records = sorted(self.catalog.values(), key=lambda r: (r.model_name, r.routing_group, r.worker_id))
        return [r.answer() for r in records
                if (model_name is None or r.model_name == model_name)
                and (routing_group is None or r.routing_group == routing_group)]

    def ready(self) -> tuple[bool, dict[str, Any]]:
        schedulable = sum(1 for record in self.catalog.values() if record.schedulable)
        ready = schedulable > 0 and not self.shutting_down
        return ready, {"ready": ready, "schedulable_workers": schedulable, "workers": self.workers()}

    def _reconcile(self, record: WorkerRecord) -> tuple[dict[str, Any], ListenerChanges]:
        changes = ListenerChanges()
        old = self.catalog.get(record.worker_id)
        reasons = record.missing()
        if not reasons:
            reasons = self._conflicts(record)
        record.not_schedulable_reasons = reasons
        record.lifecycle = "incomplete" if reasons else "schedulable"
        if old is not None and old.schedulable:
            if (record.schedulable and old.partition == record.partition and old.block_size == record.block_size
                    and bool(old.is_eagle) == bool(record.is_eagle)):
                self._change_ranks(old, record, changes)
                self.catalog[record.worker_id] = record
                return record.answer(), changes
            self._withdraw(old, changes)
        if record.schedulable:
            self._enlist(record, changes)
        self.catalog[record.worker_id] = record
        return record.answer(), changes

    def _conflicts(self, record: WorkerRecord) -> list[str]:
        """What stops a complete record from joining its partition (Dynamo's `reconciliation
        failed` reasons): a block size or EAGLE setting other than the partition's, a KV-event
        endpoint a socket cannot connect to."""
        model_name, routing_group = record.partition
        failed = "reconciliation failed: "
        if ":" in routing_group:
            return [f"{failed}routing_group `{routing_group}` must not contain `:`"]
        state = self.partitions.get(record.partition)
        if state is not None and not (state.workers.keys() - {record.worker_id}):
            state = None  # the worker alone in its partition may change its settings
        where = f"model={model_name} routing_group={routing_group}"
        indexed = self.indexer.partitions.get(record.partition)  # recovered from a peer, say
        existing = state.block_size if state is not None else (indexed.block_size if indexed is not None else None)
        if existing is not None and existing != record.block_size:
            return [f"{failed}block_size mismatch for {where}: existing={existing} requested={record.block_size}"]
        if state is not None and state.is_eagle != bool(record.is_eagle):
            return [f"{failed}is_eagle mismatch for {where}: existing={state.is_eagle} "
                    f"requested={bool(record.is_eagle)}"]
        for rank, endpoint in sorted(record.listener_endpoints().items()):
            problem = endpoint_problem(endpoint) if rank in record.ranks() else None
            if problem is not None:
                return [f"{failed}invalid kv_events endpoint for worker {record.worker_id} dp_rank {rank}: "
                        f"invalid ZMQ endpoint `{endpoint}`: {problem}"]
        if record.replay_endpoint and (problem := endpoint_problem(record.replay_endpoint)) is not None:
            return [f"{failed}invalid replay endpoint for worker {record.worker_id}: "
                    f"invalid ZMQ endpoint `{record.replay_endpoint}`: {problem}"]
        return []

    def _enlist(self, record: WorkerRecord, changes: ListenerChanges) -> None:
        """Index, track and listen to every rank of a schedulable record."""
        model_name, routing_group = record.partition
        block_size = record.block_size
        assert block_size
        state = self.partitions.setdefault(record.partition, _PartitionState(block_size, bool(record.is_eagle)))
        state.set_worker(record)
        ranks = record.ranks()
        self.tracker.register(record.worker_id, model_name, routing_group, block_size, ranks.start, len(ranks),
                              tracked_role(record))
        changes.track(record)
        endpoints = record.listener_endpoints()
        for rank in ranks:
            self._index_rank(record, rank, endpoints[rank], changes)
        self._capacity(record)

    def _index_rank(self, record: WorkerRecord, rank: int, endpoint: str, changes: ListenerChanges) -> None:
        model_name, routing_group = record.partition
        replay = record.replay_endpoint or None
        assert record.block_size
        self.indexer.register(record.worker_id, model_name, routing_group, record.block_size, rank, endpoint, replay)
        changes.start.append(Subscription(model_name, routing_group, record.block_size, record.worker_id, rank,
                                          endpoint, replay))
        changes.index(record, rank, endpoint)

    def _capacity(self, record: WorkerRecord) -> None:
        for rank in record.ranks():
            self.scheduler.set_capacity((record.worker_id, rank), record.total_kv_blocks)

    def _withdraw(self, record: WorkerRecord, changes: ListenerChanges) -> None:
        """Stop indexing, tracking and listening to a schedulable record's ranks; its bookings
        end with them, and its partition's settings with its last worker."""
        model_name, routing_group = record.partition
        doomed = {(record.worker_id, rank) for rank in record.ranks()}
        for key in sorted(doomed):
            self.indexer.unregister(record.worker_id, model_name, routing_group, key[1])
            changes.stop.append(key)
            changes.index(record, key[1], None, register=False)
        self.tracker.unregister(record.worker_id, model_name, routing_group)
        changes.track(record, register=False)
        self._drop_bookings(doomed)
        self.scheduler.forget(doomed)
        state = self.partitions[record.partition]
        state.drop_worker(record.worker_id)
        if not state.workers:
            del self.partitions[record.partition]

    def _drop_bookings(self, ranks: set[RankKey]) -> None:
        """Forget the reservations and session bindings of ranks that left (the tracker dropped
        their bookings)."""
        for reservation in [r for r in self.reservations.values() if r.rank in ranks]:
            del self.reservations[reservation.selection_id]
            if self.sessions is not None:
                self.sessions.release(reservation.selection_id)
        if self.sessions is not None:
            self.sessions.forget_ranks(ranks)

    def _change_ranks(self, old: WorkerRecord, new: WorkerRecord, changes: ListenerChanges) -> None:
        """A schedulable worker stays schedulable in its partition: ranks whose KV-event and
        replay endpoints are unchanged keep their subscription, cached blocks and bookings."""
        model_name, routing_group = new.partition
        old_endpoints, new_endpoints = old.listener_endpoints(), new.listener_endpoints()
        replay_same = (old.replay_endpoint or None) == (new.replay_endpoint or None)
        kept = {rank for rank in new.ranks()
                if rank in old.ranks() and replay_same and old_endpoints.get(rank) == new_endpoints.get(rank)}
        for rank in sorted(set(old.ranks()) - kept):
            self.indexer.unregister(old.worker_id, model_name, routing_group, rank)
            changes.stop.append((old.worker_id, rank))
            changes.index(old, rank, None, register=False)
        dropped = {(old.worker_id, rank) for rank in set(old.ranks()) - set(new.ranks())}
        if old.ranks() != new.ranks() or tracked_role(old) != tracked_role(new):
            survivors = [r for r in self.reservations.values()
                         if r.worker_id == old.worker_id and r.rank not in dropped]
            self._drop_bookings(dropped)
            self.tracker.unregister(old.worker_id, model_name, routing_group)
            changes.track(old, register=False)
            ranks = new.ranks()
            assert new.block_size
            self.tracker.register(new.worker_id, model_name, routing_group, new.block_size, ranks.start, len(ranks),
                                  tracked_role(new))
            changes.track(new)
            self._rebook(survivors)
            self.scheduler.forget(dropped)
        for rank in sorted(set(new.ranks()) - kept):
            self._index_rank(new, rank, new_endpoints[rank], changes)
        self.partitions[new.partition].set_worker(new)
        self._capacity(new)

    def _rebook(self, reservations: Sequence[Reservation]) -> None:
        """Book again, in their order, reservations whose worker was re-registered with the
        tracker (a changed rank range): the same hashes, prefill state and output load."""
        for reservation in reservations:
            model_name, routing_group = reservation.partition
            self.tracker.add(model_name, routing_group, reservation.selection_id, reservation.worker_id,
                             reservation.dp_rank, reservation.sequence_hashes, reservation.prefill_tokens)
            if reservation.prefilled:
                self.tracker.prefill_complete(model_name, routing_group, reservation.selection_id)
            if reservation.output_load:
                self.tracker.set_output_blocks(model_name, routing_group, reservation.selection_id,
                                               round_half_away(reservation.output_load))

    # --- selection ------------------------------------------------------------------------------

    def prompt_of(self, request: PromptFields, *, for_selection: bool = True) -> Prompt:
        """The request's prompt in its partition's block size (the partition must be ready):
        what a shell in remote mode reads the services for before it calls `select`,
        `select_and_reserve`, `potential_loads` or `overlap_scores` with `Readings`."""
        state = self._ready(request.partition)
        return self._prompt(request, state.block_size, for_selection=for_selection)

    def select(self, request: SelectRequest, readings: Readings | None = None) -> dict[str, Any]:
        """`POST /select`: the best rank, nothing booked; with a `selection_id`, the choice is kept
        for a `POST /reservations` to book it."""
        partition = request.partition
        state = self._ready(partition)
        session = request.session
        if session is not None and self.sessions is not None:
            check_session_id(session)
        prompt = readings.prompt if readings is not None else self._prompt(request, state.block_size,
                                                                           for_selection=True)
        tracking = self._tracking(request)
        steered = self._steered(request)
        bound = self.sessions.bound(partition, steered) if self.sessions is not None and steered else None
        chosen, selection, tiers, record, rows = self._choose(request, state, prompt, tracking, bound, readings)
        answer = self._answer(request, partition, record, chosen, tiers, prompt, state.block_size, tracking)
        if request.selection_id is not None:
            answer = {"selection_id": request.selection_id, **answer}
            self.pending.put((*partition, request.selection_id), PendingSelection(
                chosen.worker_id, chosen.dp_rank, tuple(prompt.sequence_hashes), prompt.isl_tokens,
                answer["effective_prefill_tokens"], tracking, request.expected_output_tokens, request.lora_name,
                steered, chosen))
        if request.advisory:
            # A rank's potential prefill with no new tokens is its active prefill, whatever the prompt.
            active = rows[chosen.key]["potential_prefill_tokens"]
            load: dict[str, Any] = {"active_prefill_tokens": active,
                                    "prefill_token_capacity": record.max_num_batched_tokens or ADVISORY_CAPACITY}
            if record.total_kv_blocks is not None:
                load["total_kv_blocks"] = record.total_kv_blocks
            answer["worker_load"] = load
        return answer

    def select_and_reserve(self, request: SelectRequest, readings: Readings | None = None) -> dict[str, Any]:
        """`POST /select_and_reserve`: the best rank, booked under `selection_id` (a new UUID when
        the request has none)."""
        partition = request.partition
        state = self._ready(partition)
        selection_id = request.selection_id if request.selection_id is not None else str(uuid.UUID(
            int=self._random.getrandbits(128), version=4))
        self._unclaimed(selection_id)
        session = request.session
        if session is not None and self.sessions is not None:
            check_session_id(session)
        prompt = readings.prompt if readings is not None else self._prompt(request, state.block_size,
                                                                           for_selection=True)
        tracking = self._tracking(request)
        steered = self._steered(request)
        bound = None
        if self.sessions is not None and steered:
            bound = self.sessions.bound(partition, steered)
            if bound is not None and not self._schedulable_rank(partition, bound):
                self.sessions.invalidate(partition, steered)
                bound = None
        chosen, selection, tiers, record, _ = self._choose(request, state, prompt, tracking, bound, readings)
        answer = self._answer(request, partition, record, chosen, tiers, prompt, state.block_size, tracking)
        self._book(selection_id, partition, chosen.worker_id, chosen.dp_rank, prompt.sequence_hashes,
                   answer["effective_prefill_tokens"] if tracking else 0, state.block_size, chosen, steered,
                   request.expected_output_tokens)
        scheduling = SchedulingRequest(prompt.isl_tokens, state.block_size, session, request.expected_output_tokens)
        self.scheduler.booked(selection, scheduling, rank=chosen.key)
        return {"selection_id": selection_id, "sequence_hashes": prompt.sequence_hashes,
                "isl_tokens": prompt.isl_tokens, "track_prefill_tokens": tracking, **answer}

    def reserve(self, request: ReservationRequest) -> dict[str, Any]:
        """`POST /reservations`: book the prompt on `worker_id` (explicit form), or book what a
        `/select` with this `selection_id` chose (replay form)."""
        if request.worker_id is None:
            return self._replay(request)
        partition = request.partition
        model_name, routing_group = partition
        self.pending.discard((*partition, request.selection_id))
        state = self._ready(partition)
        prompt = self._prompt(request, state.block_size, for_selection=False)
        effective = request.effective_prefill_tokens
        if effective is not None and effective > prompt.isl_tokens:
            raise InvalidArgument(f"effective_prefill_tokens ({effective}) must not exceed isl_tokens "
                                  f"({prompt.isl_tokens})")
        record = state.workers.get(request.worker_id)
        if record is None:
            raise NotFound(f"schedulable worker {request.worker_id} not found for model={model_name} "
                           f"routing_group={routing_group}")
        if request.dp_rank not in record.ranks():
            raise NotFound(f"worker {request.worker_id} has no dp_rank {request.dp_rank} "
                           f"(its ranks: {_describe_ranks(record)})")
        self._unclaimed(request.selection_id)
        # The caller chose the worker, so only the caller knows what is left to prefill there:
        # nothing is booked as prefill unless it says (Dynamo's rule), and `track_prefill_tokens`
        # false books nothing even then.
        prefill = effective if effective is not None and request.track_prefill_tokens is not False else 0
        self._book(request.selection_id, partition, record.worker_id, request.dp_rank, prompt.sequence_hashes,
                   prefill, state.block_size, None, None, request.expected_output_tokens)
        return {"selection_id": request.selection_id, "model_name": model_name, "routing_group": routing_group,
                "worker_id": record.worker_id, "dp_rank": request.dp_rank, "endpoint": record.endpoint}

    def _replay(self, request: ReservationRequest) -> dict[str, Any]:
        partition = request.partition
        model_name, routing_group = partition
        key = (*partition, request.selection_id)
        pending = self.pending.peek(key)
        if pending is None:
            raise NotFound(f"no pending selection {request.selection_id} for model={model_name} "
                           f"routing_group={routing_group} (expired, already used, or never selected)")
        state = self._ready(partition)
        record = state.workers.get(pending.worker_id)
        if record is None or pending.dp_rank not in record.ranks():
            raise NotFound(f"schedulable worker {pending.worker_id} (dp_rank {pending.dp_rank}) not found for "
                           f"model={model_name} routing_group={routing_group}")
        self._unclaimed(request.selection_id)
        session = pending.session_id if self.sessions is not None else None
        if session is not None and self.sessions is not None:
            bound = self.sessions.bound(partition, session)
            if bound is not None and bound != (pending.worker_id, pending.dp_rank):
                self.pending.discard(key)
                raise InvalidArgument(f"session {session} is bound to worker {bound[0]}, not {pending.worker_id}")
        cost = pending.cost if isinstance(pending.cost, RankCost) else None
        self._book(request.selection_id, partition, pending.worker_id, pending.dp_rank,
                   list(pending.sequence_hashes),
                   pending.effective_prefill_tokens if pending.track_prefill_tokens else 0, state.block_size, cost,
                   session, pending.expected_output_tokens)
        self.pending.discard(key)
        return {"selection_id": request.selection_id, "model_name": model_name, "routing_group": routing_group,
                "worker_id": record.worker_id, "dp_rank": pending.dp_rank, "endpoint": record.endpoint}

    def _book(self, selection_id: str, partition: Partition, worker_id: int, dp_rank: int,
              hashes: Sequence[int], prefill_tokens: int, block_size: int, cost: RankCost | None,
              session: str | None, expected_output_tokens: int | None) -> None:
        model_name, routing_group = partition
        self.tracker.add(model_name, routing_group, selection_id, worker_id, dp_rank, hashes, prefill_tokens)
        self.reservations[selection_id] = Reservation(selection_id, partition, worker_id, dp_rank, tuple(hashes),
                                                      prefill_tokens, block_size, self.clock(), cost, session,
                                                      expected_output_tokens)
        if session is not None and self.sessions is not None:
            self.sessions.bind(partition, session, (worker_id, dp_rank), selection_id)

    def _steered(self, request: SelectRequest) -> str | None:
        """The session whose binding steers the request: none with session affinity off, or
        when the request names its worker itself (a pin or an affinity target)."""
        if self.sessions is None or request.pinned_worker is not None or request.affinity_target is not None:
            return None
        return request.session

    def _unclaimed(self, selection_id: str) -> None:
        if selection_id in self.reservations:
            raise Conflict(f"selection {selection_id} is already reserved or being reserved")

    def _ready(self, partition: Partition) -> _PartitionState:
        if self.shutting_down:
            raise NotReady("selection service is shutting down")
        state = self.partitions.get(partition)
        if state is None or not state.workers:
            if not any(record.schedulable for record in self.catalog.values()):
                raise NotReady("no schedulable workers are available")
            raise NotReady(f"no schedulable workers for model={partition[0]} routing_group={partition[1]}")
        return state

    def _schedulable_rank(self, partition: Partition, rank: RankKey) -> bool:
        state = self.partitions.get(partition)
        record = state.workers.get(rank[0]) if state is not None else None
        return record is not None and rank[1] in record.ranks()

    def _tracking(self, request: PromptFields) -> bool:
        override = request.router_config_override
        if override is not None and override.track_prefill_tokens is not None:
            return override.track_prefill_tokens
        return self.settings.track_prefill_tokens

    def _prompt(self, request: PromptFields, block_size: int, *, for_selection: bool) -> Prompt:
        """The prompt's hashes and length, from its tokens or its hash form (Dynamo's checks, in
        its order)."""
        tokens: list[int] | None = None
        if request.mm_routing_info is not None and request.mm_routing_info.routing_token_ids:
            tokens = request.mm_routing_info.routing_token_ids
        elif request.token_ids is not None:
            tokens = request.token_ids
        reuse = self.settings.assume_kv_reuse
        override = request.router_config_override
        if override is not None and override.assume_kv_reuse is not None:
            reuse = override.assume_kv_reuse
        if tokens is not None:
            local = local_block_hashes(tokens, block_size, lora_name=request.lora_name, cache_salt=request.cache_salt)
            chained = to_signed_list(sequence_hashes(local)) if reuse else self._random_hashes(len(local))
            return Prompt(local, chained, len(tokens))
        if for_selection and request.block_hashes is None:
            raise InvalidArgument("block_hashes is required without token_ids")
        if request.sequence_hashes is None:
            raise InvalidArgument("sequence_hashes is required without token_ids")
        if request.isl_tokens is None:
            raise InvalidArgument("isl_tokens is required without token_ids")
        if for_selection and request.isl_tokens == 0:
            raise InvalidArgument("isl_tokens must be greater than 0")
        local = request.block_hashes or []
        if for_selection and len(local) != len(request.sequence_hashes):
            raise InvalidArgument(f"block_hashes length {len(local)} must match sequence_hashes length "
                                  f"{len(request.sequence_hashes)}")
        chained = request.sequence_hashes if reuse else self._random_hashes(len(request.sequence_hashes))
        return Prompt(local, chained, request.isl_tokens)

    def _random_hashes(self, count: int) -> list[int]:
        """`assume_kv_reuse` off: every block of the request counts as its own."""
        return [self._random.getrandbits(64) - 2**63 for _ in range(count)]

    def _read(self, partition: Partition, prompt: Prompt,
              readings: Readings | None) -> tuple[QueryResult, list[dict[str, int]]]:
        if readings is not None:
            return readings.cached, readings.loads
        return (self.indexer.query(*partition, prompt.local_hashes),
                self.tracker.potential_load_rows(*partition, prompt.sequence_hashes, 0))

    def _choose(self, request: SelectRequest, state: _PartitionState, prompt: Prompt, tracking: bool,
                bound: RankKey | None, readings: Readings | None = None,
                ) -> tuple[RankCost, Selection, dict[RankKey, _Tiers], WorkerRecord, dict[RankKey, dict[str, int]]]:
        candidates = self._candidates(request, state, bound)
        if not candidates:
            raise NoCandidate("no endpoints available to route work")
        overlap, load_rows = self._read(request.partition, prompt, readings)
        tiers = self._tiers(overlap)
        rows = {(row["worker_id"], row["dp_rank"]): row for row in load_rows}
        if readings is not None:
            # The shared slot tracker may not hold a rank this catalog has (another selector
            # removed its worker): such a rank cannot be booked, so it is no candidate.
            candidates = [candidate for candidate in candidates if candidate[2] in rows]
            if not candidates:
                model_name, routing_group = request.partition
                raise NotReady(f"the slot tracker holds none of the candidate ranks of model={model_name} "
                               f"routing_group={routing_group}")
        override = request.router_config_override
        credit = 1.0
        weight: float | None = None
        temperature: float | None = None
        if override is not None:
            if override.overlap_score_credit is not None:
                credit = override.overlap_score_credit
            if override.overlap_score_weight is not None:
                weight = override.overlap_score_weight
                if weight == 0:
                    credit = 0.0
            if override.prefill_load_scale is not None:
                weight = override.prefill_load_scale
            temperature = override.router_temperature
        block_size = state.block_size
        isl = prompt.isl_tokens
        loads: list[RankState] = []
        infos: dict[RankKey, RankInfo] = {}
        for worker_id, rank, key, info in candidates:
            row = rows[key]
            cached = tiers.get(key)
            cached_tokens = min(isl, round_half_away(cached.weighted_blocks(credit) * block_size)) if cached else 0
            loads.append(RankState(worker_id, rank, cached_tokens,
                                   row["potential_prefill_tokens"] if tracking else 0,
                                   row["potential_decode_blocks"], row["active_requests"]))
            infos[key] = info
        scheduling = SchedulingRequest(isl, block_size, request.session, request.expected_output_tokens,
                                       temperature, weight)
        try:
            selection = self.scheduler.schedule(scheduling, loads, infos)
        except AllBusy as exc:
            raise Overloaded(str(exc)) from None
        except NoWorkerAvailable as exc:
            raise NoCandidate(str(exc)) from None
        chosen = selection.chosen
        return chosen, selection, tiers, state.workers[chosen.worker_id], rows

    def _candidates(self, request: SelectRequest, state: _PartitionState,
                    bound: RankKey | None) -> list[_Candidate]:
        """The ranks that may take the request: a pinned worker alone; else a valid affinity
        target, or the session's bound rank, alone; else every schedulable rank, less those
        outside `allowed_worker_ids` or lacking a required taint."""
        candidates = self._candidate_ranks(request, state, bound)
        if candidates is None:
            return state.candidates()
        return [_candidate(record, rank) for record, rank in candidates]

    def _candidate_ranks(self, request: SelectRequest, state: _PartitionState,
                         bound: RankKey | None) -> list[tuple[WorkerRecord, int]] | None:
        """`_candidates` as (worker, rank)s; None: every schedulable rank (the partition keeps
        those, in (worker, rank) order)."""
        workers = state.workers
        allowed = set(request.allowed_worker_ids) if request.allowed_worker_ids is not None else None
        pinned = request.pinned_worker
        if pinned is not None:
            if allowed is not None and pinned.worker_id not in allowed:
                raise InvalidArgument(f"pinned worker {pinned.worker_id} is not in allowed worker set")
            record = workers.get(pinned.worker_id)
            return [(record, pinned.dp_rank)] if record is not None and pinned.dp_rank in record.ranks() else []
        target = request.affinity_target
        if target is not None and (allowed is None or target.worker_id in allowed):
            record = workers.get(target.worker_id)
            if record is not None and (target.dp_rank is None or target.dp_rank in record.ranks()):
                ranks = record.ranks() if target.dp_rank is None else [target.dp_rank]
                return [(record, rank) for rank in ranks]  # an invalid target is ignored, as in Dynamo
        if bound is not None and (allowed is None or bound[0] in allowed):
            record = workers.get(bound[0])
            if record is not None and bound[1] in record.ranks():
                return [(record, bound[1])]
        required = set(request.routing_constraints.required_taints)
        if allowed is None and not required:
            return None
        return [(record, rank) for worker_id, record in sorted(workers.items())
                if (allowed is None or worker_id in allowed) and required.issubset(record.taints)
                for rank in record.ranks()]

    @staticmethod
    def _tiers(result: QueryResult) -> dict[RankKey, _Tiers]:
        tiers: dict[RankKey, _Tiers] = {}
        for key, blocks in result.device.items():
            tiers[key] = _Tiers(device=blocks)
        for key, blocks in result.host_pinned.items():
            tiers.setdefault(key, _Tiers()).host = blocks
        for key, blocks in result.disk.items():
            tiers.setdefault(key, _Tiers()).disk = blocks
        return tiers

    def _answer(self, request: SelectRequest, partition: Partition, record: WorkerRecord, chosen: RankCost,
                tiers: dict[RankKey, _Tiers], prompt: Prompt, block_size: int, tracking: bool) -> dict[str, Any]:
        """Dynamo's answer for the pick: the worker's overlap over all its ranks, the prompt
        tokens left to prefill there and its decode blocks with the request added."""
        isl = prompt.isl_tokens
        own = tiers.get(chosen.key)
        cached = min(isl, round_half_away(own.weighted_blocks() * block_size)) if own is not None else 0
        gpu = cpu = disk = 0
        per_rank: dict[str, int] = {}
        for rank in record.ranks():
            rank_tiers = tiers.get((record.worker_id, rank)) or _Tiers()
            per_rank[str(rank)] = rank_tiers.device * block_size
            gpu = max(gpu, rank_tiers.device * block_size)
            cpu = max(cpu, (rank_tiers.device + rank_tiers.host) * block_size)
            disk = max(disk, (rank_tiers.device + rank_tiers.host + rank_tiers.disk) * block_size)
        partial_blocks = max(0, math.ceil(isl / block_size) - len(prompt.sequence_hashes))
        return {"model_name": partition[0], "routing_group": partition[1], "worker_id": chosen.worker_id,
                "dp_rank": chosen.dp_rank, "endpoint": record.endpoint, "block_size": block_size,
                "overlap": {"longest_matched": max(gpu, cpu, disk), "gpu": gpu, "dp": per_rank, "cpu": cpu,
                            "disk": disk},
                "effective_prefill_tokens": isl - cached,
                "potential_decode_blocks": chosen.decode_blocks + partial_blocks}

    # --- the reservation lifecycle --------------------------------------------------------------

    def prefill_complete(self, selection_id: str) -> None:
        reservation = self._reservation(selection_id)
        self.tracker.prefill_complete(*reservation.partition, selection_id)
        if not reservation.prefilled:
            reservation.prefilled = True
            if reservation.cost is not None:
                self.scheduler.first_token(reservation.cost, self.clock() - reservation.booked_at)

    def output_block(self, selection_id: str, request: OutputBlockRequest | None) -> None:
        """One more output block; a `decay_fraction` weighs every output block of the request
        from then on (the router guide's decay toward the expected output length: a request
        near its end will soon free them). Without one, a reservation booked with
        `expected_output_tokens` decays by itself, as the slot tracker's `/add` does."""
        fraction = request.decay_fraction if request is not None else None
        reservation = self._reservation(selection_id)
        reservation.output_blocks, reservation.output_load = output_after_block(
            reservation.output_blocks, reservation.output_load, fraction, reservation.expected_output_tokens,
            reservation.block_size)
        self.tracker.set_output_blocks(*reservation.partition, selection_id, round_half_away(reservation.output_load),
                                       may_shrink=True)

    def free(self, selection_id: str) -> None:
        reservation = self._reservation(selection_id)
        self.tracker.free(*reservation.partition, selection_id)
        del self.reservations[selection_id]
        self.scheduler.ended(reservation.rank, reservation.output_blocks * reservation.block_size,
                             reservation.block_size)
        if self.sessions is not None:
            self.sessions.release(selection_id)

    def _reservation(self, selection_id: str) -> Reservation:
        reservation = self.reservations.get(selection_id)
        if reservation is None:
            raise NotFound(f"reservation {selection_id} not found")
        return reservation

    def expire(self) -> int:
        """Drop the bookings older than the request TTL (a gateway that never freed them);
        returns how many."""
        expired = self.tracker.expire()
        if not expired:
            return 0
        while self.reservations:
            reservation = next(iter(self.reservations.values()))
            if self.tracker.request(*reservation.partition, reservation.selection_id) is not None:
                break
            del self.reservations[reservation.selection_id]
            if self.sessions is not None:
                self.sessions.release(reservation.selection_id)
        return expired

    # --- reads ----------------------------------------------------------------------------------

    def loads(self, model_name: str | None = None, routing_group: str | None = None) -> list[dict[str, Any]]:
        """`GET /loads`: per partition, every schedulable rank's booked load."""
        answer = []
        for (model, group) in sorted(self.tracker.partitions):
            if (model_name is not None and model != model_name) or (routing_group is not None and group != routing_group):
                continue
            rows = self.tracker.potential_load_rows(model, group, [], 0)
            answer.append({"model_name": model, "routing_group": group, "loads": rows,
                           "pending_count": 0, "pending_isl_tokens": 0})
        return answer

    def potential_loads(self, request: QueryRequest, readings: Readings | None = None) -> list[dict[str, Any]]:
        """`POST /potential_loads`: every schedulable rank's load with the prompt added there."""
        partition = request.partition
        state = self._ready(partition)
        prompt = readings.prompt if readings is not None else self._prompt(request, state.block_size,
                                                                           for_selection=True)
        tracking = self._tracking(request)
        overlap, loads = self._read(partition, prompt, readings)
        tiers = self._tiers(overlap)
        rows = [dict(row) for row in loads] if readings is not None else loads
        if tracking:
            isl = prompt.isl_tokens
            for row in rows:
                cached = tiers.get((row["worker_id"], row["dp_rank"]))
                cached_tokens = min(isl, round_half_away(cached.weighted_blocks() * state.block_size)) if cached else 0
                row["potential_prefill_tokens"] += isl - cached_tokens
        return rows

    def overlap_scores(self, request: QueryRequest, readings: Readings | None = None) -> dict[str, Any]:
        """`POST /overlap_scores`: the prompt's cached blocks on every schedulable rank, per tier."""
        partition = request.partition
        state = self._ready(partition)
        prompt = readings.prompt if readings is not None else self._prompt(request, state.block_size,
                                                                           for_selection=True)
        tiers = self._tiers(readings.cached if readings is not None else
                            self.indexer.query(*partition, prompt.local_hashes))
        keys = {(worker_id, rank) for worker_id, record in state.workers.items() for rank in record.ranks()}
        keys.update(tiers)
        rows = []
        for key in sorted(keys):
            rank = tiers.get(key) or _Tiers()
            rows.append({"worker_id": key[0], "dp_rank": key[1], "device_blocks": rank.device,
                         "host_pinned_blocks": rank.device + rank.host,
                         "disk_blocks": rank.device + rank.host + rank.disk,
                         "host_pinned_extension_blocks": rank.host, "disk_extension_blocks": rank.disk,
                         "shared_beyond_device_blocks": None})
        return {"block_size": state.block_size, "num_blocks": len(prompt.local_hashes), "workers": rows,
                "shared_cache": {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None}}

    def dump(self) -> dict[str, Any]:
        """`GET /dump`: the index as the indexer's `/dump` writes it (what `--indexer-peers`
        recovery reads)."""
        return self.indexer.dump()


# A candidate rank as a selection reads it: (worker_id, dp_rank, its key, what the scheduler
# knows of it from the worker's record).
_Candidate = tuple[int, int, RankKey, RankInfo]


def _candidate(record: WorkerRecord, rank: int) -> _Candidate:
    return (record.worker_id, rank, (record.worker_id, rank),
            RankInfo(record.worker_id, rank, record.total_kv_blocks,
                     record.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS))


@dataclass(slots=True)
class _PartitionState:
    """A partition's fixed settings (its first schedulable worker's) and its schedulable workers
    (changed through `set_worker` and `drop_worker` only: they keep `candidates` current)."""

    block_size: int
    is_eagle: bool
    workers: dict[int, WorkerRecord] = field(default_factory=dict)
    _candidates: list[_Candidate] | None = None

    def set_worker(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record
        self._candidates = None

    def drop_worker(self, worker_id: int) -> None:
        self.workers.pop(worker_id, None)
        self._candidates = None

    def candidates(self) -> list[_Candidate]:
        """Every schedulable rank in (worker, rank) order, worked out once per change of the
        workers rather than per selection (records are replaced, never changed, while listed)."""
        if self._candidates is None:
            self._candidates = [_candidate(record, rank) for _, record in sorted(self.workers.items())
                                for rank in record.ranks()]
        return self._candidates


def tracked_role(record: WorkerRecord) -> str:
    """The slot tracker's role for a worker: `router_hint_worker_type` "prefill" tracks only its
    prefill tokens (Dynamo's prefill router runs with track_active_blocks=false); any other
    type, or none, everything."""
    return PREFILL if record.router_hint_worker_type == PREFILL else AGGREGATED


def output_after_block(blocks: int, load: float, fraction: float | None, expected_output_tokens: int | None = None,
                       block_size: int = 1) -> tuple[int, float]:
    """A reservation's output blocks and output load after one more block: each block counts 1,
    or, given a decay fraction, every block counts that fraction from then on. With no fraction
    sent but an expected output length, the fraction falls linearly from 1 to 0 as the output
    reaches that length (the slot tracker's `decayed_output`, so both services weigh alike)."""
    blocks += 1
    if fraction is None and expected_output_tokens is not None:
        fraction = max(0.0, 1.0 - blocks * block_size / expected_output_tokens) if expected_output_tokens > 0 else 0.0
    return blocks, (load + 1.0 if fraction is None else blocks * fraction)


def round_half_away(value: float) -> int:
    """Half away from zero (Rust's `f64::round`), not Python's half to even: 2.5 -> 3."""
    return math.floor(value + 0.5)


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _describe_ranks(record: WorkerRecord) -> str:
    ranks = record.ranks()
    return f"{ranks.start}..{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)


__all__ = [
    "DEFAULT_REQUEST_TTL_SECS", "ListenerChanges", "NoCandidate", "NotReady", "Overloaded", "Prompt", "Readings",
    "Registration", "Reservation", "SelectionCore", "SelectionSettings", "output_after_block", "round_half_away",
    "tracked_role",
]
