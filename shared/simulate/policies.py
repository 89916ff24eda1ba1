"""Routing policies the simulator compares; each picks a (worker_id, dp_rank) for a request.

* `kv` - the gateway's KV selector (`dynamo_lite.routing.KvRouter`, the scheduling cycle the
  endpoint picker runs too): indexer overlap plus slot tracker loads, with the configured cost
  (default: predicted time to first token plus cache-write cost; or Dynamo's
  `overlap_weight * prefill_blocks + decode_blocks`); it learns from each request's simulated
  first token and end as a gateway does from the real ones;
* `kv_approx` - the same selector for engines that publish no KV events: the simulated engines
  send none, and the router records each decision on the indexer (`/routed`), which assumes
  the prompt's blocks stay on the chosen rank for its `--approx-ttl-secs`;
* `round_robin` - ranks in turn, blind to cache and load;
* `random` - a seeded uniform choice, blind to cache and load;
* `least_loaded` - fewest active decode blocks, read from the slot tracker's
  `/potential_loads` queried with no hashes (so the answer is each rank's current load, not the
  load after placing this request); ties go to fewer active requests, then a seeded choice.

Every policy reports the cached tokens it expected on the chosen rank (only `kv` knows; the
others say 0), which the engine passes on to `/add` as `new_isl_tokens = input - expected`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Final

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.hashing import to_signed_list
from dynamo_lite.routing import Decision, KvRouter
from dynamo_lite.routing.scheduling import SchedulerConfig

from .fleet import RankKey
from .trace import SimRequest

POLICY_NAMES: Final = ("kv", "kv_approx", "round_robin", "random", "least_loaded")


@dataclass(frozen=True, slots=True)
class Placement:
    rank: RankKey
    expected_cached_tokens: int
    decision: Decision | None = None  # the kv policies' decision, for what the scheduler learns


class Policy(ABC):
    name: str
    publishes_events = True  # whether the simulated engines send the indexer their KV events

    @abstractmethod
    async def place(self, request: SimRequest, signed_sequence_hashes: list[int]) -> Placement:
        """Choose a rank for `request` (its sequence hashes already signed for the services)."""

    # What a gateway learns from: the policies blind to the fleet (round robin, random) ignore it.
    def booked(self, request: SimRequest, placement: Placement) -> None:  # noqa: B027
        """The engine booked `request` where `placement` says."""

    def first_token(self, request: SimRequest, rank: RankKey, seconds: float) -> None:  # noqa: B027
        """`request`'s first token came `seconds` (simulated) after its arrival."""

    def ended(self, request: SimRequest, rank: RankKey) -> None:  # noqa: B027
        """`request`'s answer ended (all its output tokens generated)."""


class KvPolicy(Policy):
    name = "kv"

    def __init__(
        self,
        slot_tracker: AsyncSlotTrackerClient,
        indexer: AsyncIndexerClient,
        model_name: str,
        block_size: int,
        config: SchedulerConfig,
        seed: int,
    ) -> None:
        self.model_name = model_name
        self.block_size = block_size
        self.router = KvRouter(slot_tracker, indexer, block_size=block_size, config=config, seed=seed)
        self._decisions: dict[int, Decision] = {}

    async def place(self, request: SimRequest, signed_sequence_hashes: list[int]) -> Placement:
        decision = await self.router.select(
            self.model_name,
            isl_tokens=request.input_length,
            local_hashes=to_signed_list(request.local_hashes),
            sequence_hashes=signed_sequence_hashes,
        )
        if not self.publishes_events:
            # The engine books the request itself (/add), not the router's `commit`, so the
            # router records the decision here, as `commit` would for these ranks.
            await self.router.record(decision)
        return Placement((decision.worker_id, decision.dp_rank), decision.chosen.cached_tokens, decision)

    def booked(self, request: SimRequest, placement: Placement) -> None:
        decision = placement.decision
        if decision is not None:
            self.router.scheduler.booked(decision.selection, decision.request, rank=placement.rank)
            self._decisions[request.index] = decision

    def first_token(self, request: SimRequest, rank: RankKey, seconds: float) -> None:
        decision = self._decisions.get(request.index)
        if decision is not None:
            self.router.scheduler.first_token(decision.chosen, seconds)

    def ended(self, request: SimRequest, rank: RankKey) -> None:
        if self._decisions.pop(request.index, None) is not None:
            self.router.scheduler.ended(rank, request.output_length, self.block_size)


class KvApproxPolicy(KvPolicy):
    name = "kv_approx"
    publishes_events = False


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, ranks: list[RankKey]) -> None:
        self.ranks = sorted(ranks)
        self.turn = 0

    async def place(self, request: SimRequest, signed_sequence_hashes: list[int]) -> Placement:
        rank = self.ranks[self.turn % len(self.ranks)]
        self.turn += 1
        return Placement(rank, 0)


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, ranks: list[RankKey], seed: int) -> None:
        self.ranks = sorted(ranks)
        self.rng = random.Random(seed)

    async def place(self, request: SimRequest, signed_sequence_hashes: list[int]) -> Placement:
        return Placement(self.rng.choice(self.ranks), 0)


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def __init__(self, slot_tracker: AsyncSlotTrackerClient, model_name: str, seed: int) -> None:
        self.slot_tracker = slot_tracker
        self.model_name = model_name
        self.rng = random.Random(seed)

    async def place(self, request: SimRequest, signed_sequence_hashes: list[int]) -> Placement:
        loads = await self.slot_tracker.potential_loads(self.model_name, [], 0)
        if not loads:
            raise RuntimeError(f"the slot tracker has no ranks for model {self.model_name!r}")
        best = min((load.potential_decode_blocks, load.active_requests) for load in loads)
        candidates = sorted(
            (load.worker_id, load.dp_rank)
            for load in loads
            if (load.potential_decode_blocks, load.active_requests) == best
        )
        return Placement(self.rng.choice(candidates), 0)


def make_policy(
    name: str,
    *,
    slot_tracker: AsyncSlotTrackerClient,
    indexer: AsyncIndexerClient,
    model_name: str,
    ranks: list[RankKey],
    block_size: int,
    router_config: SchedulerConfig,
    seed: int,
) -> Policy:
    if name == "kv":
        return KvPolicy(slot_tracker, indexer, model_name, block_size, router_config, seed)
    if name == "kv_approx":
        return KvApproxPolicy(slot_tracker, indexer, model_name, block_size, router_config, seed)
    if name == "round_robin":
        return RoundRobinPolicy(ranks)
    if name == "random":
        return RandomPolicy(ranks, seed)
    if name == "least_loaded":
        return LeastLoadedPolicy(slot_tracker, model_name, seed)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
