"""The scheduling cycle's CPU per request (issue 36's target: at most 100 µs for a 4,096-token
prompt over 8 engines, one core), for `python -m bench.cores`.

    python -m bench.scheduling_core      # a table

Three figures, each the best of five timings of many requests with random loads and cached
prefixes: the cycle alone (`Scheduler.schedule` + `booked`, default cost), the same with
Dynamo's cost, and what the picker spends per request around the two service reads: the
prompt's local and sequence hashes (signed), the rows joined into `RankState`s, the cycle.
"""

from __future__ import annotations

import random
import timeit
from collections.abc import Callable

from dynamo_lite.client import PotentialLoad
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed_list
from dynamo_lite.routing import RankReadings
from dynamo_lite.routing.scheduling import RankInfo, Scheduler, SchedulingRequest, dynamo_config, ttft_config

BLOCK = 16
PROMPT_TOKENS = 4096
RANKS = 8
REQUESTS = 400


def _inputs(seed: int) -> list[tuple[list[int], RankReadings]]:
    rng = random.Random(seed)
    inputs = []
    for _ in range(REQUESTS):
        prompt = [rng.randrange(32_000) for _ in range(PROMPT_TOKENS)]
        loads = [PotentialLoad(1, rank, rng.randrange(0, 16_000), rng.randrange(256, 20_000), rng.randrange(0, 64))
                 for rank in range(RANKS)]
        cached = {(1, rank): rng.randrange(0, PROMPT_TOKENS) // BLOCK * BLOCK for rank in range(RANKS) if rng.random() < 0.5}
        inputs.append((prompt, RankReadings(cached=cached, loads=loads)))
    return inputs


def _time(run: Callable[[], None], count: int) -> float:
    """Best of five, microseconds per request."""
    return min(timeit.repeat(run, number=1, repeat=5)) / count * 1e6


def measure() -> dict[str, float]:
    inputs = _inputs(0)
    infos = {(1, rank): RankInfo(1, rank, 30_000) for rank in range(RANKS)}
    request = SchedulingRequest(PROMPT_TOKENS, BLOCK)
    states = [readings.rank_loads() for _, readings in inputs]

    def cycle(scheduler: Scheduler) -> Callable[[], None]:
        def run() -> None:
            for loads in states:
                scheduler.booked(scheduler.schedule(request, loads, infos), request, infos)
        return run

    default = Scheduler(ttft_config(), seed=0)
    dynamo = Scheduler(dynamo_config(), seed=0)
    picker_side = Scheduler(ttft_config(), seed=0)

    def whole() -> None:
        for prompt, readings in inputs:
            local = local_block_hashes(prompt, BLOCK)
            to_signed_list(local)
            to_signed_list(sequence_hashes(local))
            scheduling = SchedulingRequest(len(prompt), BLOCK)
            picker_side.booked(picker_side.schedule(scheduling, readings.rank_loads(), infos), scheduling, infos)

    return {
        "scheduling cycle, 8 ranks (default cost)": _time(cycle(default), len(states)),
        "scheduling cycle, 8 ranks (--cost dynamo)": _time(cycle(dynamo), len(states)),
        "hashes + scheduling cycle, 4,096-token prompt, 8 ranks": _time(whole, len(inputs)),
    }


def main() -> None:
    from .cores import print_measured

    print_measured(measure(), width=58)


if __name__ == "__main__":
    main()
