"""Where the picker reads cached blocks and loads, and books: the two services, or its own process.

`--state services` (the default, `RemoteState`): per pick, the indexer's `/query_by_hash` and
the slot tracker's `/potential_loads` over HTTP, concurrently (`dynamo_lite.routing.read_ranks`);
bookings are slot tracker calls (`/add`, `/prefill_complete`, `/output_blocks`, `/free`) sent in
the background; the pool is registered with both services (`registration.PoolRegistrar`). Several
pickers (replicas) share one state that way, and a service away is a degraded mode.

`--state in-process` (`LocalState`): the picker holds the selection service's cores itself, an
`Indexer` fed by its own ZMQ listeners on the engines' KV events (`dynamo_lite.indexer.listeners`)
and a `SlotTracker`, as `python -m dynamo_lite.select_service` does. A pick reads both
synchronously (no HTTP, no task), a booking call is a call on the core made at once
(`LocalSlotTracker`: the `Booking` runs it to its end in place, `run_now`), and the pool
watcher registers ranks with the cores and starts and stops the listeners (`LocalRegistrar`).
Nothing can be away: the outcome is always `kv`. One picker holds the state: its bookings are
the only load it sees.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from prometheus_client.registry import Collector

from dynamo_lite.base.errors import NotFound, ServiceError
from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    RankLoad,
    ServiceStatusError,
)
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.listeners import DEFAULT_REPLAY_TIMEOUT_SECS, Listeners, Subscription
from dynamo_lite.indexer.metrics import ListenerCollector
from dynamo_lite.routing import RankReadings, read_ranks
from dynamo_lite.routing.reconcile import Registry
from dynamo_lite.routing.registrar import INDEXER, SLOT_TRACKER, IndexedRank, TrackerWorker
from dynamo_lite.slot_tracker.core import DEFAULT_REQUEST_TTL_SECS, SlotTracker
from dynamo_lite.slot_tracker.metrics import SlotTrackerCollector

from .endpoint import PoolEndpoint

logger = logging.getLogger("dynamo_lite.epp")

SERVICES = "services"
IN_PROCESS = "in-process"
STATES = (SERVICES, IN_PROCESS)


class SlotTrackerCalls(Protocol):
    """The slot tracker calls a `Booking` makes (`AsyncSlotTrackerClient`'s signatures)."""

    async def add(self, model_name: str, request_id: str, worker_id: int, dp_rank: int,
                  sequence_hashes: Sequence[int], new_isl_tokens: int = 0, *, tenant_id: str = ...,
                  expected_output_tokens: int | None = None) -> None: ...

    async def prefill_complete(self, model_name: str, request_id: str, *, tenant_id: str = ...) -> None: ...

    async def output_blocks(self, model_name: str, request_id: str, output_blocks: int, *,
                            tenant_id: str = ...) -> None: ...

    async def free(self, model_name: str, request_id: str, *, tenant_id: str = ...) -> None: ...


class PickerState(Protocol):
    """What `KvPicker` reads and books through."""

    in_process: bool
    booker: SlotTrackerCalls  # what a Booking calls

    async def read(self, model_name: str, tenant_id: str, local_hashes: Sequence[int],
                   sequence_hashes: Sequence[int]) -> RankReadings:
        """The prompt's cached tokens per rank and every rank's load with it added."""
        ...

    async def loads(self) -> list[RankLoad]:
        """Every rank's booked load (the queue's refresh)."""
        ...

    async def routed(self, endpoint: PoolEndpoint, local_hashes: list[int], tenant_id: str) -> None:
        """An engine without KV events was picked for these blocks (approximate indexing)."""
        ...

    async def aclose(self) -> None: ...


# --- the two services ------------------------------------------------------------------------------


class RemoteState:
    """The slot tracker and the indexer over HTTP: what the picker has always done."""

    in_process = False

    def __init__(self, slot_tracker: AsyncSlotTrackerClient, indexer: AsyncIndexerClient) -> None:
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self.booker: SlotTrackerCalls = slot_tracker

    async def read(self, model_name: str, tenant_id: str, local_hashes: Sequence[int],
                   sequence_hashes: Sequence[int]) -> RankReadings:
        return await read_ranks(self.slot_tracker, self.indexer, model_name, tenant_id, local_hashes, sequence_hashes)

    async def loads(self) -> list[RankLoad]:
        return await self.slot_tracker.loads()

    async def routed(self, endpoint: PoolEndpoint, local_hashes: list[int], tenant_id: str) -> None:
        await self.indexer.routed(endpoint.worker_id, endpoint.model, local_hashes, dp_rank=endpoint.dp_rank,
                                  tenant_id=tenant_id)

    async def aclose(self) -> None:
        await self.slot_tracker.aclose()
        await self.indexer.aclose()


# --- in this process -------------------------------------------------------------------------------


def _call_error(error: ServiceError, call: str) -> ServiceStatusError:
    """A core's refusal as the client would have raised it (the booking's rules read its status)."""
    return ServiceStatusError(error.status, error.message, method="local", path=call)


class LocalSlotTracker:
    """The `Booking`'s calls on the picker's own `SlotTracker`: each does its work before its
    first (and only) step, so `run_now` completes it in place; a refusal is the client's
    `ServiceStatusError` with the core's status (404 unknown, 409 conflict)."""

    immediate = True  # a Booking runs these calls at once, in order, not in a background task

    def __init__(self, tracker: SlotTracker) -> None:
        self.tracker = tracker

    async def add(self, model_name: str, request_id: str, worker_id: int, dp_rank: int,
                  sequence_hashes: Sequence[int], new_isl_tokens: int = 0, *, tenant_id: str = "default",
                  expected_output_tokens: int | None = None) -> None:
        try:
            self.tracker.add(model_name, tenant_id, request_id, worker_id, dp_rank, sequence_hashes, new_isl_tokens,
                             expected_output_tokens)
        except ServiceError as error:
            raise _call_error(error, "/add") from None

    async def prefill_complete(self, model_name: str, request_id: str, *, tenant_id: str = "default") -> None:
        try:
            self.tracker.prefill_complete(model_name, tenant_id, request_id)
        except ServiceError as error:
            raise _call_error(error, "/prefill_complete") from None

    async def output_blocks(self, model_name: str, request_id: str, output_blocks: int, *,
                            tenant_id: str = "default") -> None:
        try:
            self.tracker.set_output_blocks(model_name, tenant_id, request_id, output_blocks)
        except ServiceError as error:
            raise _call_error(error, "/output_blocks") from None

    async def free(self, model_name: str, request_id: str, *, tenant_id: str = "default") -> None:
        try:
            self.tracker.free(model_name, tenant_id, request_id)
        except ServiceError as error:
            raise _call_error(error, "/free") from None


def run_now(call: Awaitable[None]) -> None:
    """Run a call that never waits (a `LocalSlotTracker` call through the booking's retry
    rules) to its end, here and now. A call that did wait would be a bug: it is dropped and
    logged, as is any error it raises, so a stream's bookkeeping never breaks its answer."""
    steps = call.__await__()
    try:
        next(steps)
    except StopIteration:
        return
    except Exception:  # noqa: BLE001 - a bookkeeping bug must not fail the request it books
        logger.exception("a call on the in-process slot tracker failed")
        return
    steps.close()
    logger.error("a call on the in-process slot tracker waited; it was dropped")


class LocalState:
    """The picker's own `Indexer`, `SlotTracker` and engine listeners (see the module docstring).
    Build it anywhere; the listeners start with the first registration, on the running loop."""

    in_process = True

    def __init__(self, *, request_ttl_secs: float = DEFAULT_REQUEST_TTL_SECS,
                 replay_timeout_secs: float = DEFAULT_REPLAY_TIMEOUT_SECS) -> None:
        self.indexer = Indexer()
        self.tracker = SlotTracker(request_ttl_secs=request_ttl_secs)
        self.listeners = Listeners(self.indexer, replay_timeout_secs=replay_timeout_secs)
        self.booker: SlotTrackerCalls = LocalSlotTracker(self.tracker)
        self.registrar = LocalRegistrar(self)

    def collectors(self) -> list[Collector]:
        """/metrics: the listeners' series as the indexer exports them, the bookings' as the slot
        tracker does."""
        return [ListenerCollector(self.listeners), SlotTrackerCollector(self.tracker)]

    async def read(self, model_name: str, tenant_id: str, local_hashes: Sequence[int],
                   sequence_hashes: Sequence[int]) -> RankReadings:
        return self.read_now(model_name, tenant_id, local_hashes, sequence_hashes)

    def read_now(self, model_name: str, tenant_id: str, local_hashes: Sequence[int],
                 sequence_hashes: Sequence[int]) -> RankReadings:
        """`read`, synchronously: an unknown model is no overlap and no rank (the services' 404s)."""
        readings = RankReadings()
        try:
            found = self.indexer.query(model_name, tenant_id, local_hashes)
        except NotFound:
            pass
        else:
            block_size = found.block_size
            readings.cached = {key: blocks * block_size for key, blocks in found.device.items()}
        try:
            readings.loads = self.tracker.potential_loads(model_name, tenant_id, list(sequence_hashes), 0)
        except NotFound:
            pass
        return readings

    async def loads(self) -> list[RankLoad]:
        return self.tracker.loads()

    async def routed(self, endpoint: PoolEndpoint, local_hashes: list[int], tenant_id: str) -> None:
        try:
            self.indexer.record_routed(endpoint.model, tenant_id, endpoint.worker_id, endpoint.dp_rank, local_hashes)
        except ServiceError as error:
            raise _call_error(error, "/routed") from None

    async def aclose(self) -> None:
        await self.listeners.close()


class LocalRegistrar:
    """`PoolWatcher`'s registrations on the in-process cores: a worker's ranks with the slot
    tracker, each rank with the indexer and, when its engine publishes KV events, a listener
    subscribed to them. Nothing here can be away; a registration the cores refuse (a block size
    other than its model's) is logged once and reported as not registered."""

    def __init__(self, state: LocalState) -> None:
        self.state = state
        self._refused: dict[Any, str] = {}
        self.tracker_registry = Registry[TrackerWorker](
            SLOT_TRACKER, self._tracked, self.register_tracker_worker, self.unregister_tracker_worker)
        self.indexer_registry = Registry[IndexedRank](
            INDEXER, self._all_indexed, self.register_indexer_rank, self.unregister_indexer_rank)

    async def listed(self) -> tuple[set[TrackerWorker] | None, set[IndexedRank] | None]:
        return await self._tracked(), self._indexed()

    async def _tracked(self) -> set[TrackerWorker] | None:
        return {TrackerWorker(w.worker_id, w.model_name, w.tenant_id, w.block_size, w.dp_start, w.dp_size, w.role)
                for w in self.state.tracker.workers()}

    async def _all_indexed(self) -> set[IndexedRank] | None:
        return self._indexed()

    def _indexed(self, model_name: str | None = None, tenant_id: str | None = None) -> set[IndexedRank]:
        return {IndexedRank(w.instance_id, rank.dp_rank, w.model_name, w.tenant_id, w.block_size, rank.endpoint,
                            rank.replay_endpoint)
                for w in self.state.indexer.workers(model_name, tenant_id) for rank in w.ranks if rank.registered}

    async def register_tracker_worker(self, worker: TrackerWorker) -> bool:
        held = self.state.tracker.worker(worker.model, worker.tenant_id, worker.worker_id)
        if held is not None and (held.block_size, held.dp_start, held.dp_size, held.role) == (
                worker.block_size, worker.dp_start, worker.dp_size, worker.role):
            return True
        try:
            self.state.tracker.register(worker.worker_id, worker.model, worker.tenant_id, worker.block_size,
                                        worker.dp_start, worker.dp_size, worker.role)
        except ServiceError as error:
            return self._refusal(worker, f"cannot register {worker.describe()}: {error.message}")
        self._refused.pop(worker, None)
        logger.info("in-process: tracking %s", worker.describe())
        return True

    async def register_indexer_rank(self, rank: IndexedRank) -> bool:
        if rank in self._indexed(rank.model, rank.tenant_id):
            return True
        try:
            self.state.indexer.register(rank.worker_id, rank.model, rank.tenant_id, rank.block_size, rank.dp_rank,
                                        rank.endpoint, rank.replay_endpoint)
        except ServiceError as error:
            return self._refusal(rank, f"cannot index {rank.describe()}: {error.message}")
        self._refused.pop(rank, None)
        if rank.endpoint is not None:
            self.state.listeners.start(Subscription(rank.model, rank.tenant_id, rank.block_size, rank.worker_id,
                                                    rank.dp_rank, rank.endpoint, rank.replay_endpoint))
            logger.info("in-process: indexing %s from KV events at %s", rank.describe(), rank.endpoint)
        return True

    async def unregister_tracker_worker(self, worker: TrackerWorker) -> bool:
        """Its bookings go with it (their later calls are 404s, which end them quietly)."""
        try:
            self.state.tracker.unregister(worker.worker_id, worker.model, worker.tenant_id)
        except NotFound:
            pass
        logger.info("in-process: no longer tracking %s", worker.describe())
        return True

    async def unregister_indexer_rank(self, rank: IndexedRank) -> bool:
        self.state.listeners.stop([rank.rank_key])
        try:
            self.state.indexer.unregister(rank.worker_id, rank.model, rank.tenant_id, rank.dp_rank)
        except NotFound:
            pass
        logger.info("in-process: no longer indexing %s", rank.describe())
        return True

    def _refusal(self, unit: Any, message: str) -> bool:
        if self._refused.get(unit) != message:
            self._refused[unit] = message
            logger.error("%s (not registered; will retry)", message)
        return False


__all__ = [
    "IN_PROCESS", "SERVICES", "STATES", "LocalRegistrar", "LocalSlotTracker", "LocalState", "PickerState",
    "RemoteState", "SlotTrackerCalls", "run_now",
]
