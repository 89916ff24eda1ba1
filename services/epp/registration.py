"""The pool's registrations with the slot tracker and the indexer: which registrations a pool
means (`tracker_workers`, `indexer_rank`), and `PoolRegistrar`, the shared `Registrar` by pool
endpoint.

The slot tracker registers a worker's ranks as one range (one registration per worker); the
indexer registers each rank, with the engine's KV-event endpoints. Several pickers may share one
pool and a restarting picker registers again, so a 409 whose registration is exactly ours counts
as success (`dynamo_lite.routing.registrar`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.routing.registrar import IndexedRank, Registrar, TrackerWorker

from .endpoint import PoolEndpoint, RankKey

# The pool's lines keep the logger name they had when the pool was one module (`pool.py`):
# logging configurations select them by it.
POOL_LOGGER = "dynamo_lite.epp.pool"
log = logging.getLogger(POOL_LOGGER)


class PoolRegistrar(Registrar):
    """The `Registrar` by pool endpoint: give every rank of a worker together, as the slot
    tracker registers a worker's ranks as one range, built from the ranks given. It logs as the
    pool (`POOL_LOGGER`)."""

    def __init__(self, slot_tracker: AsyncSlotTrackerClient, indexer: AsyncIndexerClient) -> None:
        super().__init__(slot_tracker, indexer, logger=log)

    async def register(self, endpoints: Iterable[PoolEndpoint]) -> set[RankKey]:
        """Register `endpoints` with both services; the rank_keys now registered with both."""
        endpoints = list(endpoints)
        return await self.register_all(tracker_workers(endpoints), [indexer_rank(ep) for ep in endpoints])

    async def unregister(self, endpoints: Iterable[PoolEndpoint]) -> set[RankKey]:
        """Unregister `endpoints` from both services (an endpoint already gone is fine); the
        rank_keys now gone from both. The slot tracker knows whole workers only: any rank given
        unregisters its worker there (register the worker's remaining ranks again)."""
        endpoints = list(endpoints)
        return await self.unregister_all(tracker_workers(endpoints), [indexer_rank(ep) for ep in endpoints])

    async def known(self, endpoints: Iterable[PoolEndpoint]) -> bool:
        """True when both services currently list every endpoint, registered exactly as the pool
        says (the picker's `readiness`); False when they do not or cannot be asked."""
        endpoints = list(endpoints)
        return await self.known_all(tracker_workers(endpoints), [indexer_rank(ep) for ep in endpoints])


def tracker_workers(endpoints: Iterable[PoolEndpoint]) -> list[TrackerWorker]:
    """The slot tracker registrations of these endpoints: one per worker_id, its listed ranks as
    one range (from the lowest to the highest; parse_pool guarantees there is no gap)."""
    grouped: dict[int, list[PoolEndpoint]] = {}
    for ep in endpoints:
        grouped.setdefault(ep.worker_id, []).append(ep)
    result = []
    for worker_id, eps in grouped.items():
        low = min(ep.dp_rank for ep in eps)
        high = max(ep.dp_rank for ep in eps)
        first = eps[0]
        result.append(TrackerWorker(worker_id, first.model, first.tenant_id, first.block_size, low, high - low + 1,
                                    first.role))
    return result


def indexer_rank(ep: PoolEndpoint) -> IndexedRank:
    """The indexer registration of one endpoint."""
    return IndexedRank(ep.worker_id, ep.dp_rank, ep.model, ep.tenant_id, ep.block_size,
                       ep.kv_events_endpoint, ep.replay_endpoint)


__all__ = ["POOL_LOGGER", "PoolRegistrar", "indexer_rank", "tracker_workers"]
