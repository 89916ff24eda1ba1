"""Remote mode: a selector that keeps no index or load of its own, but reads and books on a slot
tracker and an indexer it shares with other selectors (`--slot-tracker URL --indexer URL`).

The selection itself is the same `SelectionCore` call as in one process, given `Readings`: the
prompt's cached blocks come from the indexer's `/query_by_hash` and every rank's load from the
slot tracker's `/potential_loads`, read together (one round trip, two requests). A booking is the
core's, then the slot tracker's `/add`; the reservation lifecycle goes to the slot tracker the
same way. The catalog stays the selector's own: `POST /workers` registers the worker with both
services (idempotently: another selector may have registered it already), and the indexer
subscribes to the engine's KV events, so every selector sees the same blocks.

What a selector keeps for itself: its catalog, its reservations (lifecycle calls for a selection
go to the selector that booked it), pending selections and session bindings. What it cannot
know exactly: lower-tier (host, disk) cache hits of a worker with several ranks (the indexer's
answer gives them per worker; they are credited to its ranks with the longest device match).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from dynamo_lite.base.errors import Conflict, NotFound
from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    OverlapScores,
    PotentialLoad,
    ServiceCallError,
    ServiceStatusError,
)
from dynamo_lite.hashing import to_signed_list
from dynamo_lite.indexer.core import QueryResult
from dynamo_lite.routing.registrar import INDEXER, SLOT_TRACKER, IndexedRank, Registrar, TrackerWorker

from .core import ListenerChanges, NotReady, Partition, Prompt, Readings, Reservation, SelectionCore

logger = logging.getLogger("dynamo_lite.select_service")

T = TypeVar("T")


class Unavailable(NotReady):
    """A service the selector reads or books on did not answer, or refused: 503, try again."""


class SharedState:
    """The slot tracker and the indexer a selector in remote mode works on."""

    def __init__(self, slot_tracker: AsyncSlotTrackerClient, indexer: AsyncIndexerClient) -> None:
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self.registrar = Registrar(slot_tracker, indexer, logger=logger)

    async def aclose(self) -> None:
        await asyncio.gather(self.slot_tracker.aclose(), self.indexer.aclose())

    # --- the catalog ----------------------------------------------------------------------------

    async def apply(self, changes: ListenerChanges) -> list[str]:
        """Send a catalog change's registrations (removals first); what failed, as sentences."""
        removals = [r.unit for r in changes.registrations if not r.register]
        additions = [r.unit for r in changes.registrations if r.register]
        problems: list[str] = []
        for units, register in ((removals, False), (additions, True)):
            results = await asyncio.gather(*(self._registration(unit, register) for unit in units))
            problems.extend(problem for problem in results if problem is not None)
        return problems

    async def _registration(self, unit: TrackerWorker | IndexedRank, register: bool) -> str | None:
        registrar = self.registrar
        identity: tuple[Any, ...]
        if isinstance(unit, TrackerWorker):
            service, identity = SLOT_TRACKER, unit.identity
            done = await (registrar.register_tracker_worker(unit) if register
                          else registrar.unregister_tracker_worker(unit))
        else:
            service, identity = INDEXER, unit.identity
            done = await (registrar.register_indexer_rank(unit) if register
                          else registrar.unregister_indexer_rank(unit))
        if done:
            return None
        reason = registrar.failing.get(service) or registrar.conflicts.get((service, identity)) or "see the log"
        return f"{service}: could not {'register' if register else 'unregister'} {unit.describe()}: {reason}"

    # --- reads ----------------------------------------------------------------------------------

    async def read(self, partition: Partition, prompt: Prompt, block_size: int) -> Readings:
        """The prompt's cached blocks and every rank's load with it added, read together."""
        model_name, routing_group = partition
        loads_call = self.slot_tracker.potential_loads(model_name, prompt.sequence_hashes, 0, tenant_id=routing_group)
        if not prompt.local_hashes:  # shorter than a block: nothing can be cached
            return Readings(prompt, QueryResult(block_size, {}, {}, {}), _rows(await _read(SLOT_TRACKER, loads_call)))
        overlap_call = self.indexer.query_by_hash(model_name, to_signed_list(prompt.local_hashes),
                                                  tenant_id=routing_group)
        results = await asyncio.gather(_read(INDEXER, overlap_call, empty_on_404=True),
                                       _read(SLOT_TRACKER, loads_call), return_exceptions=True)
        for result in results:  # both awaited to the end, the first failure told
            if isinstance(result, BaseException):
                raise result
        overlap, loads = results
        assert not isinstance(overlap, BaseException) and not isinstance(loads, BaseException)
        return Readings(prompt, _query_result(overlap, block_size), _rows(loads))

    async def loads(self, core: SelectionCore, model_name: str | None,
                    routing_group: str | None) -> list[dict[str, Any]]:
        """`GET /loads` over the shared slot tracker, for this selector's partitions."""
        partitions = sorted(partition for partition in core.partitions
                            if (model_name is None or partition[0] == model_name)
                            and (routing_group is None or partition[1] == routing_group))
        rows = await asyncio.gather(*(_read(SLOT_TRACKER, self.slot_tracker.potential_loads(
            model, [], 0, tenant_id=group)) for model, group in partitions))
        return [{"model_name": model, "routing_group": group, "loads": _rows(partition_rows),
                 "pending_count": 0, "pending_isl_tokens": 0}
                for (model, group), partition_rows in zip(partitions, rows)]

    async def dump(self) -> dict[str, Any]:
        return await _read(INDEXER, self.indexer.dump())

    # --- bookings -------------------------------------------------------------------------------

    async def add(self, reservation: Reservation) -> None:
        model_name, routing_group = reservation.partition
        await _book(self.slot_tracker.add(model_name, reservation.selection_id, reservation.worker_id,
                                          reservation.dp_rank, reservation.sequence_hashes,
                                          reservation.prefill_tokens, tenant_id=routing_group,
                                          expected_output_tokens=reservation.expected_output_tokens),
                    reservation.selection_id)

    async def prefill_complete(self, partition: Partition, selection_id: str) -> None:
        model_name, routing_group = partition
        await _book(self.slot_tracker.prefill_complete(model_name, selection_id, tenant_id=routing_group),
                    selection_id)

    async def output_blocks(self, partition: Partition, selection_id: str, count: int) -> None:
        model_name, routing_group = partition
        await _book(self.slot_tracker.output_blocks(model_name, selection_id, count, tenant_id=routing_group),
                    selection_id)

    async def free(self, partition: Partition, selection_id: str) -> None:
        model_name, routing_group = partition
        await _book(self.slot_tracker.free(model_name, selection_id, tenant_id=routing_group), selection_id)

    # --- another selector's bookings (it is gone, or the gateway asked the wrong one) -------------

    async def foreign_prefill_complete(self, partitions: list[Partition], selection_id: str) -> None:
        """`prefill_complete` for a booking this selector did not make: sent to the slot tracker in
        each partition of the catalog until one holds it; NotFound when none does."""
        for model_name, routing_group in partitions:
            try:
                await _book(self.slot_tracker.prefill_complete(model_name, selection_id, tenant_id=routing_group),
                            selection_id)
            except NotFound:
                continue
            return
        raise NotFound(f"reservation {selection_id} not found")

    async def foreign_free(self, partitions: list[Partition], selection_id: str) -> None:
        """`DELETE` for a booking this selector did not make: the slot tracker's `/free` is
        idempotent, so it goes to every partition of the catalog."""
        if not partitions:
            raise NotFound(f"reservation {selection_id} not found")
        await asyncio.gather(*(_book(self.slot_tracker.free(model_name, selection_id, tenant_id=routing_group),
                                     selection_id) for model_name, routing_group in partitions))


async def _read(service: str, call: Awaitable[T], *, empty_on_404: bool = False) -> T:
    """One read; a 404 (the partition has no worker there) is `NotReady`, or None for the indexer
    (nothing cached yet), anything else that fails `Unavailable`."""
    try:
        return await call
    except ServiceStatusError as exc:
        if exc.status == 404:
            if empty_on_404:
                return None  # type: ignore[return-value]  # the indexer knows nothing of the partition yet
            raise NotReady(f"{service}: {exc.message}") from None
        raise Unavailable(f"{service} refused the read: {exc.status} {exc.message}") from None
    except ServiceCallError as exc:
        raise Unavailable(f"{service} unavailable: {exc.message}") from None


async def _book(call: Awaitable[None], selection_id: str) -> None:
    try:
        await call
    except ServiceStatusError as exc:
        if exc.status == 409:
            raise Conflict(f"selection {selection_id} is already booked on the slot tracker: {exc.message}") from None
        if exc.status == 404:
            raise NotFound(f"reservation {selection_id} is not held by the slot tracker (expired, or its worker "
                           f"left): {exc.message}") from None
        raise Unavailable(f"slot tracker refused the booking: {exc.status} {exc.message}") from None
    except ServiceCallError as exc:
        raise Unavailable(f"slot tracker unavailable: {exc.message}") from None


def _rows(loads: list[PotentialLoad]) -> list[dict[str, int]]:
    return [{"worker_id": row.worker_id, "dp_rank": row.dp_rank,
             "potential_prefill_tokens": row.potential_prefill_tokens,
             "potential_decode_blocks": row.potential_decode_blocks, "active_requests": row.active_requests}
            for row in loads]


def _query_result(overlap: OverlapScores | None, block_size: int) -> QueryResult:
    """The indexer's answer as the core's `QueryResult`. Device blocks are per rank; the host and
    disk blocks the answer gives per worker go to its ranks with the longest device match."""
    result = QueryResult(block_size, {}, {}, {})
    if overlap is None:
        return result
    for key, tokens in overlap.scores.items():
        if tokens:
            result.device[key] = tokens // block_size
    for instance_id, detail in overlap.instances.items():
        gpu, cpu, disk = detail.get("gpu", 0), detail.get("cpu", 0), detail.get("disk", 0)
        host_blocks, disk_blocks = (cpu - gpu) // block_size, (disk - cpu) // block_size
        if host_blocks <= 0 and disk_blocks <= 0:
            continue
        best = [int(rank) for rank, tokens in detail.get("dp", {}).items() if tokens == gpu] or [0]
        for rank in best:
            if host_blocks > 0:
                result.host_pinned[(instance_id, rank)] = host_blocks
            if disk_blocks > 0:
                result.disk[(instance_id, rank)] = disk_blocks
    return result


__all__ = ["SharedState", "Unavailable"]
