"""Registering workers with the slot tracker and the indexer, idempotently, from a process that
shares them with others: the endpoint picker (its pool) and a selection service in remote mode
(its catalog) both register the same engines the services may already know.

A slot tracker registration is a whole worker with its ranks as one range (`TrackerWorker`); an
indexer registration is one rank with its engine's KV-event endpoints (`IndexedRank`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ._async_client import AsyncIndexerClient, AsyncSlotTrackerClient
from ._client_base import IndexerWorker, ServiceCallError, ServiceStatusError, TransportError

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16

RankKey = tuple[int, int]


@dataclass(frozen=True)
class TrackerWorker:
    """One slot tracker registration: a worker with its ranks as one range."""

    worker_id: int
    model: str
    tenant_id: str
    block_size: int
    dp_start: int
    dp_size: int

    @property
    def identity(self) -> tuple[int, str, str]:
        return (self.worker_id, self.model, self.tenant_id)

    @property
    def rank_keys(self) -> set[RankKey]:
        return {(self.worker_id, rank) for rank in range(self.dp_start, self.dp_start + self.dp_size)}

    def describe(self) -> str:
        last = self.dp_start + self.dp_size - 1
        ranks = f"dp_rank {self.dp_start}" if self.dp_size == 1 else f"dp_ranks {self.dp_start}..{last}"
        return f"worker {self.worker_id} ({ranks}) of model={self.model} tenant_id={self.tenant_id}"


@dataclass(frozen=True)
class IndexedRank:
    """One indexer registration: a rank with its engine's KV-event endpoints."""

    worker_id: int
    dp_rank: int
    model: str
    tenant_id: str
    block_size: int
    endpoint: str | None
    replay_endpoint: str | None

    @property
    def identity(self) -> tuple[int, int, str, str]:
        return (self.worker_id, self.dp_rank, self.model, self.tenant_id)

    @property
    def rank_key(self) -> RankKey:
        return (self.worker_id, self.dp_rank)

    def describe(self) -> str:
        return f"worker {self.worker_id} dp_rank {self.dp_rank} of model={self.model} tenant_id={self.tenant_id}"


_TRANSIENT_STATUSES = frozenset({408, 429})


def transient(exc: BaseException) -> bool:
    """True when the call did not reach a service able to answer (retry later): no answer
    (`TransportError`), 408, 429, 5xx, or an answer that does not read."""
    if isinstance(exc, ServiceStatusError):
        return exc.status in _TRANSIENT_STATUSES or exc.status >= 500
    return isinstance(exc, TransportError)


# Every failure of a client call is a ServiceCallError (an unreadable answer too: InvalidAnswer).
_SERVICE_ERRORS = (ServiceCallError,)

T = TypeVar("T")

SLOT_TRACKER = "slot tracker"
INDEXER = "indexer"


class Registrar:
    """Registers workers with the slot tracker and the indexer, idempotently.

    Nothing here raises for a service that cannot be reached (transport errors, 5xx, 408, 429):
    the call reports the endpoint as not registered, a warning is logged once per failure streak
    of that service, and the caller tries again later. A 409 whose existing registration is
    exactly ours (another picker sharing the pool, or this one before a restart) is a success; a
    409 for anything else is a conflict, logged as an error (once while it lasts) and reported as
    not registered. At most `concurrency` calls are in flight at once.
    """

    def __init__(
        self,
        slot_tracker: AsyncSlotTrackerClient,
        indexer: AsyncIndexerClient,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        logger: logging.Logger = log,
    ) -> None:
        self._log = logger  # the picker's lines keep its own logger's name
        self.slot_tracker = slot_tracker
        self.indexer = indexer
        self._concurrency = concurrency
        self._semaphore: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._failing: dict[str, str] = {}  # service -> the error that started its failure streak
        self._conflicts: dict[tuple[Any, ...], str] = {}  # logged conflicts, until resolved

    # --- many at once ---------------------------------------------------------------------------

    async def register_all(self, workers: Sequence[TrackerWorker], ranks: Sequence[IndexedRank]) -> set[RankKey]:
        """Register `workers` with the slot tracker and `ranks` with the indexer; the rank keys
        now registered with both."""
        results = await asyncio.gather(
            *(self.register_tracker_worker(w) for w in workers),
            *(self.register_indexer_rank(r) for r in ranks),
        )
        return _with_both(workers, ranks, results)

    async def unregister_all(self, workers: Sequence[TrackerWorker], ranks: Sequence[IndexedRank]) -> set[RankKey]:
        """Unregister `workers` from the slot tracker and `ranks` from the indexer (one already
        gone is fine); the rank keys now gone from both."""
        results = await asyncio.gather(
            *(self.unregister_tracker_worker(w) for w in workers),
            *(self.unregister_indexer_rank(r) for r in ranks),
        )
        return _with_both(workers, ranks, results)

    async def known_all(self, workers: Iterable[TrackerWorker], ranks: Iterable[IndexedRank]) -> bool:
        """True when both services list every registration exactly so; False when they do not
        or cannot be asked."""
        tracker, indexer = await self.listed()
        if tracker is None or indexer is None:
            return False
        return all(w in tracker for w in workers) and all(r in indexer for r in ranks)

    async def listed(self) -> tuple[set[TrackerWorker] | None, set[IndexedRank] | None]:
        """What each service has registered now (None for one that cannot be asked). Indexer
        ranks only seen in events or `/routed` (not registered) are left out."""
        tracker, indexer = await asyncio.gather(self._tracker_listing(), self._indexer_listing())
        return tracker, indexer

    # --- one registration at a time -------------------------------------------------------------

    async def register_tracker_worker(self, worker: TrackerWorker) -> bool:
        """Register one worker with the slot tracker; True if it is registered exactly so now."""
        try:
            await self._call(SLOT_TRACKER, self.slot_tracker.register(
                worker.worker_id, worker.model, worker.block_size,
                dp_start=worker.dp_start, dp_size=worker.dp_size, tenant_id=worker.tenant_id,
            ))
        except _SERVICE_ERRORS as exc:
            if transient(exc):
                return False
            if not (isinstance(exc, ServiceStatusError) and exc.status == 409):
                self._conflict((SLOT_TRACKER, worker.identity), f"slot tracker refused to register {worker.describe()}: {exc}")
                return False
            try:
                infos = await self._call(SLOT_TRACKER, self.slot_tracker.workers(worker.model, worker.tenant_id))
            except _SERVICE_ERRORS as again:
                if not transient(again):
                    self._conflict((SLOT_TRACKER, worker.identity), f"slot tracker: listing workers failed: {again}")
                return False
            existing = next((info for info in infos if info.worker_id == worker.worker_id), None)
            if existing is not None and _tracker_unit(existing) == worker:
                self._resolved((SLOT_TRACKER, worker.identity))
                return True
            found = "" if existing is None else (
                f"; it has block_size {existing.block_size}, dp_ranks {existing.dp_start}.."
                f"{existing.dp_start + existing.dp_size - 1}"
            )
            self._conflict(
                (SLOT_TRACKER, worker.identity),
                f"slot tracker: cannot register {worker.describe()} with block_size {worker.block_size}: "
                f"{exc.message}{found}",
            )
            return False
        self._resolved((SLOT_TRACKER, worker.identity))
        return True

    async def register_indexer_rank(self, rank: IndexedRank) -> bool:
        """Register one rank with the indexer; True if it is registered exactly so now."""
        try:
            await self._call(INDEXER, self.indexer.register(
                rank.worker_id, rank.model, rank.block_size, dp_rank=rank.dp_rank, tenant_id=rank.tenant_id,
                endpoint=rank.endpoint, replay_endpoint=rank.replay_endpoint,
            ))
        except _SERVICE_ERRORS as exc:
            if transient(exc):
                return False
            if not (isinstance(exc, ServiceStatusError) and exc.status == 409):
                self._conflict((INDEXER, rank.identity), f"indexer refused to register {rank.describe()}: {exc}")
                return False
            try:
                infos = await self._call(INDEXER, self.indexer.workers(rank.model, rank.tenant_id))
            except _SERVICE_ERRORS as again:
                if not transient(again):
                    self._conflict((INDEXER, rank.identity), f"indexer: listing workers failed: {again}")
                return False
            listed = _indexer_units(infos)
            if rank in listed:
                self._resolved((INDEXER, rank.identity))
                return True
            existing = next((unit for unit in listed if unit.identity == rank.identity), None)
            found = "" if existing is None else (
                f"; it has block_size {existing.block_size}, endpoint {existing.endpoint}, "
                f"replay_endpoint {existing.replay_endpoint}"
            )
            self._conflict(
                (INDEXER, rank.identity),
                f"indexer: cannot register {rank.describe()} with block_size {rank.block_size}, endpoint "
                f"{rank.endpoint}, replay_endpoint {rank.replay_endpoint}: {exc.message}{found}",
            )
            return False
        self._resolved((INDEXER, rank.identity))
        return True

    async def unregister_tracker_worker(self, worker: TrackerWorker) -> bool:
        """Unregister a worker (by id, model and tenant) from the slot tracker; True once it is gone."""
        try:
            await self._call(SLOT_TRACKER, self.slot_tracker.unregister(
                worker.worker_id, worker.model, tenant_id=worker.tenant_id
            ))
        except _SERVICE_ERRORS as exc:
            if isinstance(exc, ServiceStatusError) and exc.status == 404:
                return True
            if not transient(exc):
                self._log.error("slot tracker refused to unregister %s: %s", worker.describe(), exc)
            return False
        self._log.info("unregistered %s from the slot tracker", worker.describe())
        return True

    async def unregister_indexer_rank(self, rank: IndexedRank) -> bool:
        """Unregister one rank from the indexer; True once it is gone."""
        try:
            await self._call(INDEXER, self.indexer.unregister(
                rank.worker_id, rank.model, tenant_id=rank.tenant_id, dp_rank=rank.dp_rank
            ))
        except _SERVICE_ERRORS as exc:
            if isinstance(exc, ServiceStatusError) and exc.status == 404:
                return True
            if not transient(exc):
                self._log.error("indexer refused to unregister %s: %s", rank.describe(), exc)
            return False
        self._log.info("unregistered %s from the indexer", rank.describe())
        return True

    # --- plumbing -------------------------------------------------------------------------------

    async def _tracker_listing(self) -> set[TrackerWorker] | None:
        try:
            infos = await self._call(SLOT_TRACKER, self.slot_tracker.workers())
        except _SERVICE_ERRORS as exc:
            if not transient(exc):
                self._log.error("slot tracker: listing workers failed: %s", exc)
            return None
        return {_tracker_unit(info) for info in infos}

    async def _indexer_listing(self) -> set[IndexedRank] | None:
        try:
            infos = await self._call(INDEXER, self.indexer.workers())
        except _SERVICE_ERRORS as exc:
            if not transient(exc):
                self._log.error("indexer: listing workers failed: %s", exc)
            return None
        return _indexer_units(infos)

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._semaphore[0] is not loop:
            self._semaphore = (loop, asyncio.Semaphore(self._concurrency))
        return self._semaphore[1]

    async def _call(self, service: str, call: Awaitable[T]) -> T:
        """Await one client call under the concurrency limit, keeping track of the service's
        failure streak (a warning when it starts, an info line when it ends)."""
        try:
            async with self._limit():
                result = await call
        except _SERVICE_ERRORS as exc:
            if transient(exc):
                if service not in self._failing:
                    self._failing[service] = str(exc)
                    self._log.warning("%s unavailable (%s): registrations will be retried", service, exc)
            else:
                self._reachable(service)
            raise
        except BaseException:
            if inspect.iscoroutine(call):
                call.close()
            raise
        self._reachable(service)
        return result

    def _reachable(self, service: str) -> None:
        if self._failing.pop(service, None) is not None:
            self._log.info("%s reachable again", service)

    @property
    def failing(self) -> dict[str, str]:
        """The services in a failure streak, with the error that started it."""
        return dict(self._failing)

    @property
    def conflicts(self) -> dict[tuple[Any, ...], str]:
        """The registrations refused for a reason other than an outage, by (service, identity),
        with the reason, until they succeed."""
        return dict(self._conflicts)

    def _conflict(self, key: tuple[Any, ...], message: str) -> None:
        if self._conflicts.get(key) != message:
            self._conflicts[key] = message
            self._log.error("%s (not registered; will retry)", message)

    def _resolved(self, key: tuple[Any, ...]) -> None:
        if self._conflicts.pop(key, None) is not None:
            self._log.info("%s %s: registered", key[0], key[1])


def _with_both(workers: Sequence[TrackerWorker], ranks: Sequence[IndexedRank], results: Sequence[bool]) -> set[RankKey]:
    tracker_ok = {w.worker_id for w, ok in zip(workers, results[:len(workers)]) if ok}
    indexer_ok = {r.rank_key for r, ok in zip(ranks, results[len(workers):]) if ok}
    return {r.rank_key for r in ranks if r.worker_id in tracker_ok and r.rank_key in indexer_ok}


def _tracker_unit(info: Any) -> TrackerWorker:
    return TrackerWorker(info.worker_id, info.model_name, info.tenant_id, info.block_size, info.dp_start, info.dp_size)


def _indexer_units(infos: Sequence[IndexerWorker]) -> set[IndexedRank]:
    return {
        IndexedRank(info.instance_id, rank.dp_rank, info.model_name, info.tenant_id, info.block_size, rank.endpoint,
                    rank.replay_endpoint)
        for info in infos
        for rank in info.ranks
        if rank.registered
    }



__all__ = ["DEFAULT_CONCURRENCY", "INDEXER", "SLOT_TRACKER", "IndexedRank", "Registrar", "TrackerWorker", "transient"]
