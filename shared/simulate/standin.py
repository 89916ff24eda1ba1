"""A fleet of engine stand-ins in simulated time, in one process: the routing benchmark's twin.

`python -m bench.gateway` runs real processes (Envoy, the picker, both services, the engine
stand-ins) on the real clock; this runs the same parts' cores on a simulated one, in seconds:

* each engine rank is the stand-in's own scheduler and prefix cache
  (`dynamo_lite.mock_engine.scheduler.Scheduler`, `.cache.PrefixCache`) with the same timing
  model, stepped as its event loop steps it (a step takes `Step.seconds`);
* the routers read what a gateway reads: each rank's cached prefix (exact and without delay:
  what the indexer knows once the KV events arrive) and the slot tracker's `/potential_loads`
  (the pure `dynamo_lite.slot_tracker.core.SlotTracker`, fed `/add`, `/prefill_complete`,
  `/output_blocks` and `/free` exactly as the picker's bookings feed it);
* `SchedulerRouter` runs the scheduling cycle (`dynamo_lite.routing.scheduling.Scheduler`) the picker
  runs, and feeds it what the picker feeds it (the booking, the first token, the end);
  `RoundRobinRouter` and `LeastRequestRouter` do what Envoy's ROUND_ROBIN and LEAST_REQUEST do
  (the latter: the fewer active requests of two ranks drawn at random).

What it leaves out, so where its numbers differ from a real run: no network, HTTP, Envoy or
Python scheduling delays (a real time to first token carries a few milliseconds more, the same
for every policy, which moves ratios toward 1); KV events arrive at once (a real indexer hears of
a block a moment after it is stored); the engine's clock never drifts (a real stand-in's steps
run a little late under load).

    arrivals = [Arrival(at=0.0, prompt=[...], max_tokens=64), ...]
    result = simulate(arrivals, FleetShape(engines=8, num_blocks=512), SchedulerRouter())
    summary = summarise(result)
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list
from dynamo_lite.mock_engine.cache import PrefixCache
from dynamo_lite.mock_engine.scheduler import EngineRequest, Scheduler, Step
from dynamo_lite.routing.scheduling import RankInfo, RankState, SchedulerConfig, SchedulingRequest, Selection
from dynamo_lite.routing.scheduling import Scheduler as Cycle
from dynamo_lite.slot_tracker.core import SlotTracker

from .calls import percentile

MODEL = "standin"
TENANT = "default"
WORKER = 1  # one worker id, a data-parallel rank per engine: the ranks are the engines


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload. `after`: the index of the request whose answer must have ended
    before this one goes (a conversation's previous turn; it then goes at `at` or at that end,
    whichever is later); `session`: its conversation, for session affinity."""

    at: float
    prompt: list[int]
    max_tokens: int
    after: int | None = None
    session: str | None = None


@dataclass(frozen=True, slots=True)
class FleetShape:
    """The engines: `num_blocks` and `timing` per engine (one value for all, or one each)."""

    engines: int = 8
    num_blocks: int | tuple[int, ...] = 8192
    block_size: int = 16
    timing: TimingModel | tuple[TimingModel, ...] = TimingModel()
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def blocks_of(self, engine: int) -> int:
        return self.num_blocks if isinstance(self.num_blocks, int) else self.num_blocks[engine]

    def timing_of(self, engine: int) -> TimingModel:
        return self.timing if isinstance(self.timing, TimingModel) else self.timing[engine]


@dataclass(slots=True)
class Outcome:
    """One request as a client would have seen it (simulated seconds)."""

    index: int
    engine: int
    sent: float
    first_token: float | None = None
    ended: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


class Fleet:
    """The engines and the slot tracker's state, as the routers may read them."""

    def __init__(self, shape: FleetShape) -> None:
        self.shape = shape
        self.now = 0.0
        self.caches = [PrefixCache(shape.blocks_of(e), shape.block_size, hash_seed="standin")
                       for e in range(shape.engines)]
        self.engines = [Scheduler(cache, shape.timing_of(e), max_num_seqs=shape.max_num_seqs,
                                  max_num_batched_tokens=shape.max_num_batched_tokens, next_token=_filler)
                        for e, cache in enumerate(self.caches)]
        self.tracker = SlotTracker(clock=lambda: self.now, request_ttl_secs=1e12)
        self.tracker.register(WORKER, MODEL, TENANT, shape.block_size, 0, shape.engines)
        self.active = [0] * shape.engines  # requests in flight per engine, as Envoy counts them

    def cached_tokens(self, prompt: list[int]) -> list[int]:
        """Each engine's cached prefix of `prompt`, in tokens (full blocks; what the indexer
        matches)."""
        hashes = self.caches[0].prompt_hashes(prompt)  # one hash seed: the same chain everywhere
        size = self.shape.block_size
        return [cache.held_prefix_blocks(hashes) * size for cache in self.caches]

    def loads(self, sequence: list[int], cached: list[int]) -> list[RankState]:
        rows = self.tracker.potential_load_rows(MODEL, TENANT, sequence, 0)
        return [RankState(WORKER, row["dp_rank"], cached[row["dp_rank"]], row["potential_prefill_tokens"],
                         row["potential_decode_blocks"], row["active_requests"]) for row in rows]


class Router:
    """A routing policy: `pick` an engine for a request; the hooks say what happened to it."""

    name = "router"

    def attach(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def pick(self, index: int, arrival: Arrival, sequence: list[int]) -> tuple[int, int]:
        """(engine, the cached tokens it expects there: what `/add` books as not to prefill)."""
        raise NotImplementedError

    def first_token(self, index: int, engine: int, seconds: float) -> None:
        pass

    def ended(self, index: int, engine: int, output_tokens: int) -> None:
        pass


class RoundRobinRouter(Router):
    name = "round_robin"

    def attach(self, fleet: Fleet) -> None:
        super().attach(fleet)
        self.turn = 0

    def pick(self, index: int, arrival: Arrival, sequence: list[int]) -> tuple[int, int]:
        engine = self.turn % self.fleet.shape.engines
        self.turn += 1
        return engine, 0


class LeastRequestRouter(Router):
    """Envoy's LEAST_REQUEST with equal weights: of two engines drawn at random, the one with
    fewer requests in flight."""

    name = "least_request"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def attach(self, fleet: Fleet) -> None:
        super().attach(fleet)
        self.rng = random.Random(self.seed)

    def pick(self, index: int, arrival: Arrival, sequence: list[int]) -> tuple[int, int]:
        engines = self.fleet.shape.engines
        if engines == 1:
            return 0, 0
        first, second = self.rng.sample(range(engines), 2)
        active = self.fleet.active
        return (first if active[first] <= active[second] else second), 0


class SchedulerRouter(Router):
    """The scheduling cycle, fed as the picker feeds it; `sessions`: pass each arrival's session."""

    def __init__(self, config: SchedulerConfig | None = None, *, seed: int = 0, sessions: bool = True,
                 name: str = "scheduler") -> None:
        self.config = config
        self.seed = seed
        self.sessions = sessions
        self.name = name

    def attach(self, fleet: Fleet) -> None:
        super().attach(fleet)
        self.cycle = Cycle(self.config, seed=self.seed, clock=lambda: fleet.now)
        shape = fleet.shape
        self.infos = {(WORKER, e): RankInfo(WORKER, e, shape.blocks_of(e), shape.max_num_batched_tokens)
                      for e in range(shape.engines)}
        self.selections: dict[int, Selection] = {}

    def pick(self, index: int, arrival: Arrival, sequence: list[int]) -> tuple[int, int]:
        fleet = self.fleet
        loads = fleet.loads(sequence, fleet.cached_tokens(arrival.prompt))
        request = SchedulingRequest(len(arrival.prompt), fleet.shape.block_size,
                                    session_id=arrival.session if self.sessions else None)
        selection = self.cycle.schedule(request, loads, self.infos)
        self.cycle.booked(selection, request, self.infos)
        self.selections[index] = selection
        return selection.chosen.dp_rank, selection.chosen.cached_tokens

    def first_token(self, index: int, engine: int, seconds: float) -> None:
        selection = self.selections.get(index)
        if selection is not None:
            self.cycle.first_token(selection.chosen, seconds)

    def ended(self, index: int, engine: int, output_tokens: int) -> None:
        self.selections.pop(index, None)
        self.cycle.ended((WORKER, engine), output_tokens, self.fleet.shape.block_size)


def _filler(request: EngineRequest, index: int) -> int:
    """Generated tokens: distinct per request and position (never a prompt's ids, which are below
    50,000 in every workload here), so an answer's blocks are cached but never hit."""
    return 50_000 + hash((request.request_id, index)) % 10_000


_ARRIVE, _STEP = 1, 0  # at one instant, engine steps finish before new requests arrive


def simulate(arrivals: Sequence[Arrival], shape: FleetShape, router: Router) -> list[Outcome]:
    """Replay `arrivals` on a fresh fleet routed by `router`; one `Outcome` per arrival, in order."""
    fleet = Fleet(shape)
    router.attach(fleet)
    outcomes = [Outcome(index, -1, 0.0, prompt_tokens=len(arrival.prompt)) for index, arrival in enumerate(arrivals)]
    heap: list[tuple[float, int, int, int]] = []
    order = 0
    followers: dict[int, list[int]] = {}
    for index, arrival in enumerate(arrivals):
        if arrival.after is None:
            heap.append((arrival.at, _ARRIVE, order, index))
            order += 1
        else:
            followers.setdefault(arrival.after, []).append(index)
    heapq.heapify(heap)
    steps: list[Step | None] = [None] * shape.engines
    requests: dict[int, tuple[int, EngineRequest]] = {}  # id(engine request) -> (index, engine)
    last_token: dict[int, float] = {}
    reported_blocks: dict[int, int] = {}
    tracker = fleet.tracker
    block_size = shape.block_size

    def kick(engine: int) -> None:
        nonlocal order
        if steps[engine] is not None:
            return
        step = fleet.engines[engine].plan()
        if step is not None:
            steps[engine] = step
            heapq.heappush(heap, (fleet.now + step.seconds, _STEP, order, engine))
            order += 1

    while heap:
        when, kind, _, subject = heapq.heappop(heap)
        fleet.now = when
        if kind == _ARRIVE:
            arrival = arrivals[subject]
            local = local_block_hashes(arrival.prompt, block_size)
            sequence = to_signed_list(sequence_hashes(local))
            engine, expected_cached = router.pick(subject, arrival, sequence)
            outcome = outcomes[subject]
            outcome.engine, outcome.sent = engine, when
            request = EngineRequest(str(subject), list(arrival.prompt), arrival.max_tokens, when)
            requests[id(request)] = (subject, request)
            tracker.add(MODEL, TENANT, str(subject), WORKER, engine, sequence,
                        max(0, len(arrival.prompt) - expected_cached))
            fleet.active[engine] += 1
            fleet.engines[engine].add(request)
            kick(engine)
            continue
        engine = subject
        step = steps[engine]
        assert step is not None
        steps[engine] = None
        for output in fleet.engines[engine].finish(step, when):
            entry = requests.get(id(output.request))
            if entry is None:
                continue
            index, request = entry
            outcome = outcomes[index]
            if output.token_id is not None:
                outcome.output_tokens += 1
                if outcome.first_token is None:
                    outcome.first_token = when
                    outcome.cached_tokens = max(request.cached_tokens, 0)
                    tracker.prefill_complete(MODEL, TENANT, str(index))
                    router.first_token(index, engine, when - outcome.sent)
                else:
                    outcome.token_gaps.append(when - last_token[index])
                last_token[index] = when
                blocks = outcome.output_tokens // block_size
                if blocks > reported_blocks.get(index, 0):
                    reported_blocks[index] = blocks
                    tracker.set_output_blocks(MODEL, TENANT, str(index), blocks)
            if output.finished is not None:
                outcome.ended = when
                if outcome.first_token is None:  # refused by the engine (never fits its cache)
                    outcome.first_token = when
                tracker.free(MODEL, TENANT, str(index))
                fleet.active[engine] -= 1
                router.ended(index, engine, outcome.output_tokens)
                del requests[id(output.request)]
                last_token.pop(index, None)
                reported_blocks.pop(index, None)
                for follower in followers.pop(index, []):
                    heapq.heappush(heap, (max(when, arrivals[follower].at), _ARRIVE, order, follower))
                    order += 1
        kick(engine)
    return outcomes


@dataclass(frozen=True, slots=True)
class Summary:
    """A run in the gateway benchmark's columns (milliseconds, tokens/s, shares)."""

    requests: int
    hit_ratio: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    output_tokens_per_s: float
    engine_shares: tuple[float, ...]


def summarise(outcomes: Sequence[Outcome], engines: int) -> Summary:
    prompt = sum(o.prompt_tokens for o in outcomes)
    ttfts = [1000 * t for o in outcomes if (t := o.ttft) is not None]
    gaps = [1000 * gap for o in outcomes for gap in o.token_gaps]
    ended = [o.ended for o in outcomes if o.ended is not None]
    span = (max(ended) - min(o.sent for o in outcomes)) if ended else 0.0
    shares = [0] * engines
    for o in outcomes:
        if o.engine >= 0:
            shares[o.engine] += 1
    return Summary(
        requests=len(outcomes), hit_ratio=sum(o.cached_tokens for o in outcomes) / prompt if prompt else 0.0,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99), itl_p50_ms=percentile(gaps, 50),
        output_tokens_per_s=sum(o.output_tokens for o in outcomes) / span if span > 0 else 0.0,
        engine_shares=tuple(count / len(outcomes) for count in shares) if outcomes else (),
    )


def endless_cache_hits(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """The cached tokens each prompt would find in one endless cache fed every prompt in order
    (the bound no routing beats): its longest prefix of full blocks seen before, counted as an
    engine counts (the last prompt token is always computed)."""
    seen: set[int] = set()
    hits = []
    for prompt in prompts:
        key = 0
        blocks = 0
        hitting = True
        reusable = (len(prompt) - 1) // block_size
        for block in range(len(prompt) // block_size):
            key = hash((key, tuple(prompt[block * block_size:(block + 1) * block_size])))
            if hitting and key in seen and block < reusable:
                blocks += 1
            else:
                hitting = False
            seen.add(key)
        hits.append(blocks * block_size)
    return hits


__all__ = [
    "Arrival", "Fleet", "FleetShape", "LeastRequestRouter", "Outcome", "RoundRobinRouter", "Router", "SchedulerRouter",
    "Summary", "endless_cache_hits", "simulate", "summarise",
]
