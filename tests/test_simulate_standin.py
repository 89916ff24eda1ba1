"""The simulator's fleet of engine stand-ins (`dynamo_lite.simulate.standin`): the scheduling
cycle against round robin on small workloads of the benchmark's shapes, in simulated time."""

from __future__ import annotations

import hashlib
import random

import pytest

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.routing.scheduling import dynamo_config
from dynamo_lite.simulate import standin
from dynamo_lite.simulate.standin import Arrival, FleetShape

pytestmark = pytest.mark.unit

TIMING = TimingModel(2.56e-4, 6.8e-3, 0.06e-3).scaled(2.0)  # the gateway benchmark's engines


def tokens(label: str, count: int) -> list[int]:
    digest = hashlib.shake_128(label.encode()).digest(2 * count)
    return [int.from_bytes(digest[i:i + 2], "little") % 4000 for i in range(0, 2 * count, 2)]


def chat(conversations: int, turns: int, rate: float, seed: int = 0) -> list[Arrival]:
    """Conversations that come back: each turn's prompt is the conversation so far."""
    rng = random.Random(seed)
    order = [c for _ in range(turns) for c in rng.sample(range(conversations), conversations)]
    arrivals: list[Arrival] = []
    latest: dict[int, int] = {}
    turn_of = [0] * conversations
    for slot, conversation in enumerate(order):
        turn_of[conversation] += 1
        prompt = tokens("system", 64)
        for turn in range(1, turn_of[conversation]):
            prompt += tokens(f"user:{conversation}:{turn}", 96) + tokens(f"reply:{conversation}:{turn}", 64)
        prompt += tokens(f"user:{conversation}:{turn_of[conversation]}", 96)
        arrivals.append(Arrival(slot / rate, prompt, 64, after=latest.get(conversation), session=f"c{conversation}"))
        latest[conversation] = len(arrivals) - 1
    return arrivals


def bound(arrivals: list[Arrival], block_size: int = 16) -> float:
    hits = standin.endless_cache_hits([arrival.prompt for arrival in arrivals], block_size)
    return sum(hits) / sum(len(arrival.prompt) for arrival in arrivals)


def run(arrivals: list[Arrival], shape: FleetShape, router: standin.Router) -> standin.Summary:
    return standin.summarise(standin.simulate(arrivals, shape, router), shape.engines)


def test_the_default_cost_beats_round_robin_and_dynamo_s_cost_on_chat() -> None:
    arrivals = chat(conversations=16, turns=6, rate=12.0)
    shape = FleetShape(engines=4, num_blocks=256, timing=TIMING)  # together ~1.4x the conversations' blocks
    ours = run(arrivals, shape, standin.SchedulerRouter())
    rr = run(arrivals, shape, standin.RoundRobinRouter())
    dynamo = run(arrivals, shape, standin.SchedulerRouter(dynamo_config()))
    assert ours.hit_ratio >= 0.85 * bound(arrivals)
    assert ours.hit_ratio > 2 * rr.hit_ratio and ours.hit_ratio > dynamo.hit_ratio
    assert ours.ttft_p50_ms <= 0.6 * rr.ttft_p50_ms and ours.ttft_p99_ms <= 0.9 * rr.ttft_p99_ms
    assert max(ours.engine_shares) < 0.5  # spread, not herded on the system prompt's first engine


def test_a_hot_shared_prefix_spreads_over_the_fleet_under_load() -> None:
    rng = random.Random(5)
    at = 0.0
    arrivals = []
    for index in range(300):  # one 2,000-token prefix, more load than one engine can prefill
        at += rng.expovariate(60.0)
        arrivals.append(Arrival(at, tokens("hot", 2000) + tokens(f"q{index}", 200), 32))
    shape = FleetShape(engines=4, num_blocks=1024, timing=TIMING)
    ours = run(arrivals, shape, standin.SchedulerRouter())
    assert sum(share > 0.1 for share in ours.engine_shares) >= 3, ours.engine_shares
    rr = run(arrivals, shape, standin.RoundRobinRouter())
    assert ours.ttft_p99_ms <= rr.ttft_p99_ms


def test_nothing_stays_booked_and_every_request_ends() -> None:
    arrivals = chat(conversations=6, turns=3, rate=20.0)
    shape = FleetShape(engines=3, num_blocks=128, timing=TIMING)
    router = standin.SchedulerRouter()
    outcomes = standin.simulate(arrivals, shape, router)
    assert all(o.ended is not None and o.output_tokens == 64 for o in outcomes)
    assert router.fleet.tracker.size() == (1, 0)  # the worker, no active request
    assert router.selections == {}


def test_least_request_draws_two_and_takes_the_less_busy() -> None:
    arrivals = [Arrival(i * 0.001, tokens(f"p{i}", 64), 200) for i in range(40)]
    summary = run(arrivals, FleetShape(engines=4, num_blocks=512, timing=TIMING), standin.LeastRequestRouter(seed=1))
    assert all(share == pytest.approx(0.25, abs=0.1) for share in summary.engine_shares)
