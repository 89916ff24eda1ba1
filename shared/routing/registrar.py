"""Registering workers with the slot tracker and the indexer, idempotently, from a process that
shares them with others: the endpoint picker (its pool) and a selection service in remote mode
(its catalog) both register the same engines the services may already know.

A slot tracker registration is a whole worker with its ranks as one range (`TrackerWorker`); an
indexer registration is one rank with its engine's KV-event endpoints (`IndexedRank`). Both are
`reconcile.Unit`s: `Registrar.tracker_registry` and `indexer_registry` let a `reconcile.Reconciler`
keep a wanted set of them registered.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from dynamo_lite.client._async_client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.client._client_base import IndexerWorker, ServiceCallError, ServiceStatusError, TransportError

from .reconcile import Registry

log = logging.getLogger("dynamo_lite.registrar")  # its name from before the move: log filters use it

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
    role: str = "aggregated"  # a prefill worker's ranks count its prefill tokens only

    @property
    def identity(self) -> tuple[int, str, str]:
        return (self.worker_id, self.model, self.tenant_id)

    @property
    def rank_keys(self) -> set[RankKey]:
        return {(self.worker_id, rank) for rank in range(self.dp_start, self.dp_start + self.dp_size)}

    def describe(self) -> str:
        last = self.dp_start + self.dp_size - 1
        ranks = f"dp_rank {self.dp_start}" if self.dp_size == 1 else f"dp_ranks {self.dp_start}..{last}"
        role = "" if self.role == "aggregated" else f", {self.role}"
        return f"worker {self.worker_id} ({ranks}{role}) of model={self.model} tenant_id={self.tenant_id}"

    def describe_registration(self) -> str:
        return self.describe()

    def settings(self) -> str:
        """What a registration sets beyond `describe()`, for a conflict's message."""
        return f"block_size {self.block_size}"

    def held_settings(self) -> str:
        """What a listed registration holds, for a conflict's message."""
        return f"block_size {self.block_size}, dp_ranks {self.dp_start}..{self.dp_start + self.dp_size - 1}"


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

    def describe_registration(self) -> str:
        return self.describe() + (f" (KV events from {self.endpoint})" if self.endpoint else "")

    def settings(self) -> str:
        """What a registration sets beyond `describe()`, for a conflict's message."""
        return f"block_size {self.block_size}, endpoint {self.endpoint}, replay_endpoint {self.replay_endpoint}"

    def held_settings(self) -> str:
        """What a listed registration holds, for a conflict's message."""
        return self.settings()


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


class _Unit(Protocol):
    """What the flows below read of a `TrackerWorker` or an `IndexedRank`."""

    def __hash__(self) -> int: ...

    @property
    def model(self) -> str: ...

    @property
    def tenant_id(self) -> str: ...

    @property
    def identity(self) -> tuple[Any, ...]: ...

    def describe(self) -> str: ...

    def describe_registration(self) -> str: ...

    def settings(self) -> str: ...

    def held_settings(self) -> str: ...


U = TypeVar("U", bound=_Unit)

SLOT_TRACKER = "slot tracker"
INDEXER = "indexer"


@dataclass(frozen=True)
class _Service(Generic[U]):
    """One service's calls by registration unit, so the register → 409 → list → compare flow,
    unregistering and listing are written once for both."""

    name: str
    register: Callable[[U], Awaitable[None]]
    unregister: Callable[[U], Awaitable[None]]
    listing: Callable[[str | None, str | None], Awaitable[set[U]]]
    """Its registrations, of one model and tenant or (None, None) all of them."""


class Registrar:
    """Registers workers with the slot tracker and the indexer, idempotently.

    Nothing here raises for a service that cannot be reached (transport errors, 5xx, 408, 429):
    the call reports the endpoint as not registered, a warning is logged once per failure streak
    of that service, and the caller tries again later. A 409 whose existing registration is
    exactly ours (another picker sharing the pool, or this one before a restart) is a success; a
    409 for anything else is a conflict, logged as an error (once while it lasts) and reported as
    not registered. At most `concurrency` calls are in flight at once.

    `tracker_registry` and `indexer_registry` are the two services as `reconcile.Registry`s.
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
        self._tracker = _Service[TrackerWorker](
            SLOT_TRACKER,
            register=lambda w: slot_tracker.register(w.worker_id, w.model, w.block_size, dp_start=w.dp_start,
                                                     dp_size=w.dp_size, tenant_id=w.tenant_id, role=w.role),
            unregister=lambda w: slot_tracker.unregister(w.worker_id, w.model, tenant_id=w.tenant_id),
            listing=self._tracker_units,
        )
        self._indexer = _Service[IndexedRank](
            INDEXER,
            register=lambda r: indexer.register(r.worker_id, r.model, r.block_size, dp_rank=r.dp_rank,
                                                tenant_id=r.tenant_id, endpoint=r.endpoint,
                                                replay_endpoint=r.replay_endpoint),
            unregister=lambda r: indexer.unregister(r.worker_id, r.model, tenant_id=r.tenant_id, dp_rank=r.dp_rank),
            listing=self._indexer_units,
        )
        self.tracker_registry = Registry[TrackerWorker](
            SLOT_TRACKER, lambda: self._listing(self._tracker), self.register_tracker_worker,
            self.unregister_tracker_worker)
        self.indexer_registry = Registry[IndexedRank](
            INDEXER, lambda: self._listing(self._indexer), self.register_indexer_rank, self.unregister_indexer_rank)

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
        tracker, indexer = await asyncio.gather(self._listing(self._tracker), self._listing(self._indexer))
        return tracker, indexer

    # --- one registration at a time -------------------------------------------------------------

    async def register_tracker_worker(self, worker: TrackerWorker) -> bool:
        """Register one worker with the slot tracker; True if it is registered exactly so now."""
        return await self._register(self._tracker, worker)

    async def register_indexer_rank(self, rank: IndexedRank) -> bool:
        """Register one rank with the indexer; True if it is registered exactly so now."""
        return await self._register(self._indexer, rank)

    async def unregister_tracker_worker(self, worker: TrackerWorker) -> bool:
        """Unregister a worker (by id, model and tenant) from the slot tracker; True once it is gone."""
        return await self._unregister(self._tracker, worker)

    async def unregister_indexer_rank(self, rank: IndexedRank) -> bool:
        """Unregister one rank from the indexer; True once it is gone."""
        return await self._unregister(self._indexer, rank)

    # --- the flows, once for both services ------------------------------------------------------

    async def _register(self, service: _Service[U], unit: U) -> bool:
        key = (service.name, unit.identity)
        try:
            await self._call(service.name, service.register(unit))
        except _SERVICE_ERRORS as exc:
            if transient(exc):
                return False
            if not (isinstance(exc, ServiceStatusError) and exc.status == 409):
                self._conflict(key, f"{service.name} refused to register {unit.describe()}: {exc}")
                return False
            # Someone registered this identity already: a success if exactly as we would have.
            try:
                listed = await self._call(service.name, service.listing(unit.model, unit.tenant_id))
            except _SERVICE_ERRORS as again:
                if not transient(again):
                    self._conflict(key, f"{service.name}: listing workers failed: {again}")
                return False
            if unit in listed:
                self._resolved(key)
                return True
            existing = next((held for held in listed if held.identity == unit.identity), None)
            found = "" if existing is None else f"; it has {existing.held_settings()}"
            self._conflict(key, f"{service.name}: cannot register {unit.describe()} with {unit.settings()}: "
                                f"{exc.message}{found}")
            return False
        self._resolved(key)
        return True

    async def _unregister(self, service: _Service[U], unit: U) -> bool:
        try:
            await self._call(service.name, service.unregister(unit))
        except _SERVICE_ERRORS as exc:
            if isinstance(exc, ServiceStatusError) and exc.status == 404:
                return True
            if not transient(exc):
                self._log.error("%s refused to unregister %s: %s", service.name, unit.describe(), exc)
            return False
        self._log.info("unregistered %s from the %s", unit.describe(), service.name)
        return True

    async def _listing(self, service: _Service[U]) -> set[U] | None:
        try:
            return await self._call(service.name, service.listing(None, None))
        except _SERVICE_ERRORS as exc:
            if not transient(exc):
                self._log.error("%s: listing workers failed: %s", service.name, exc)
            return None

    # --- plumbing -------------------------------------------------------------------------------

    async def _tracker_units(self, model: str | None, tenant_id: str | None) -> set[TrackerWorker]:
        return {_tracker_unit(info) for info in await self.slot_tracker.workers(model, tenant_id)}

    async def _indexer_units(self, model: str | None, tenant_id: str | None) -> set[IndexedRank]:
        return _indexer_units(await self.indexer.workers(model, tenant_id))

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
    return TrackerWorker(info.worker_id, info.model_name, info.tenant_id, info.block_size, info.dp_start, info.dp_size,
                         info.role)


def _indexer_units(infos: Sequence[IndexerWorker]) -> set[IndexedRank]:
    return {
        IndexedRank(info.instance_id, rank.dp_rank, info.model_name, info.tenant_id, info.block_size, rank.endpoint,
                    rank.replay_endpoint)
        for info in infos
        for rank in info.ranks
        if rank.registered
    }


__all__ = ["DEFAULT_CONCURRENCY", "INDEXER", "SLOT_TRACKER", "IndexedRank", "Registrar", "TrackerWorker", "transient"]
