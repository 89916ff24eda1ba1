"""The hit ratio no router can beat with the fleet's caches: one LRU cache as large as all of
them together, fed every request in arrival order.

A router can only split the fleet's memory into per-rank caches, so one shared cache of the
same total size, seeing every request, keeps at least as much reuse in the common case (what a
router loses is its choices of where to duplicate prefixes). It is the same `RankCache` model as
the ranks' (prefix-closed, least recently released leaf evicted first), with each request
released right after its admission: the bound ignores how long requests hold memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .fleet import FleetConfig, RankCache
from .trace import SimRequest


@dataclass(frozen=True, slots=True)
class CacheBound:
    capacity_blocks: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def fleet_lru_bound(requests: Sequence[SimRequest], config: FleetConfig) -> CacheBound:
    """Replays `requests` in arrival order (trace order at ties) through one fleet-sized LRU."""
    capacity = config.workers * config.dp_size * config.kv_blocks
    cache = RankCache(0, 0, capacity)
    cached_tokens = 0
    for request in sorted(requests, key=lambda r: r.arrival):
        admission = cache.admit(request.local_hashes, request.sequence_hashes)
        # Counted as the engine counts a rank's hits, so the ratios compare like for like.
        cached_tokens += admission.cached_blocks * config.block_size
        cache.release(request.sequence_hashes)
    return CacheBound(capacity, sum(r.input_length for r in requests), cached_tokens)
