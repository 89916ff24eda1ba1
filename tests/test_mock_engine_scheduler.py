"""The engine stand-in's scheduler on a simulated clock: what vLLM's step loop does with load,
cache hits and a full pool, exactly (no wall time involved)."""

from __future__ import annotations

import pytest

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.mock_engine.cache import PrefixCache
from dynamo_lite.mock_engine.scheduler import FINISHED_LENGTH, EngineRequest, Scheduler

pytestmark = pytest.mark.unit

TIMING = TimingModel(prefill_secs_per_token=0.001, decode_step_secs=0.01, decode_secs_per_running=0.002)


def scheduler(num_blocks: int = 256, max_num_seqs: int = 64, budget: int = 8192) -> Scheduler:
    return Scheduler(PrefixCache(num_blocks, 16, hash_seed="0"), TIMING, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, next_token=lambda request, index: 9000 + index)


def run(sched: Scheduler, until_done: list[EngineRequest], now: float = 0.0) -> float:
    """Step until every request in `until_done` finished; returns the simulated time."""
    while any(request.finished is None for request in until_done):
        step = sched.plan()
        assert step is not None
        now += step.seconds
        sched.finish(step, now)
    return now


def ttft(request: EngineRequest) -> float:
    assert request.first_token_at is not None
    return request.first_token_at - request.arrival


def prompt(family: int, length: int) -> list[int]:
    return [family * 1000 + index for index in range(length)]


def test_ttft_grows_with_the_uncached_prompt() -> None:
    sched = scheduler()
    short = EngineRequest("short", prompt(1, 100), 1, 0.0)
    sched.add(short)
    end = run(sched, [short])
    long = EngineRequest("long", prompt(2, 1000), 1, end)
    sched.add(long)
    run(sched, [long], end)
    assert ttft(short) == pytest.approx(TIMING.prefill_seconds(100))
    assert ttft(long) == pytest.approx(TIMING.prefill_seconds(1000))


def test_a_repeated_prompt_is_served_from_the_cache() -> None:
    sched = scheduler()
    first = EngineRequest("a", prompt(1, 1000), 4, 0.0)
    sched.add(first)
    end = run(sched, [first])
    again = EngineRequest("b", prompt(1, 1000), 4, end)
    sched.add(again)
    run(sched, [again], end)
    assert first.cached_tokens == 0 and again.cached_tokens == 992  # 62 of 62.5 blocks
    assert ttft(again) == pytest.approx(TIMING.prefill_seconds(1000 - 992))
    assert ttft(again) < ttft(first) / 50
    assert first.output_token_ids == again.output_token_ids == [9000, 9001, 9002, 9003]
    assert first.finished == FINISHED_LENGTH


def test_ttft_grows_with_the_running_batch() -> None:
    def ttft_behind(running: int) -> float:
        sched = scheduler()
        decoders = [EngineRequest(f"d{i}", prompt(10 + i, 32), 1000, 0.0) for i in range(running)]
        for request in decoders:
            sched.add(request)
        now = 0.0
        for _ in range(3 if running else 0):  # prefill them all and decode a little
            step = sched.plan()
            now += step.seconds
            sched.finish(step, now)
        probe = EngineRequest("probe", prompt(1, 200), 1, now)
        sched.add(probe)
        run(sched, [probe], now)
        return ttft(probe)

    alone, behind_8, behind_32 = ttft_behind(0), ttft_behind(8), ttft_behind(32)
    assert alone < behind_8 < behind_32
    # The probe's prefill shares its step with one decode step of the batch.
    assert behind_32 == pytest.approx(TIMING.prefill_seconds(200) + TIMING.decode_step_seconds(32))


def test_max_num_seqs_queues_and_the_queue_is_fcfs() -> None:
    sched = scheduler(max_num_seqs=2)
    requests = [EngineRequest(str(i), prompt(i, 40), 3, 0.0) for i in range(4)]
    for request in requests:
        sched.add(request)
    step = sched.plan()
    assert [request.request_id for request, _ in step.prefill] == ["0", "1"]
    assert len(sched.waiting) == 2
    run(sched, requests)
    assert [r.first_token_at for r in requests[:2]] < [r.first_token_at for r in requests[2:]]
    assert requests[2].first_token_at <= requests[3].first_token_at


def test_a_long_prompt_is_prefilled_in_chunks() -> None:
    sched = scheduler(budget=512)
    request = EngineRequest("long", prompt(1, 2000), 1, 0.0)
    sched.add(request)
    steps = 0
    while request.finished is None:
        step = sched.plan()
        steps += 1
        assert step.prefill_tokens <= 512
        sched.finish(step, 0.0)
    assert steps == 4


def test_a_full_pool_preempts_the_newest_and_everything_finishes() -> None:
    sched = scheduler(num_blocks=10)
    requests = [EngineRequest(str(i), prompt(i, 30), 40, 0.0) for i in range(3)]
    for request in requests:
        sched.add(request)
    run(sched, requests)
    assert sched.preemptions > 0
    assert all(len(request.output_token_ids) == 40 for request in requests)
    assert sched.cache.used_blocks == 0


def test_abort_frees_the_blocks() -> None:
    sched = scheduler()
    request = EngineRequest("a", prompt(1, 100), 50, 0.0)
    sched.add(request)
    sched.finish(sched.plan(), 0.1)
    assert sched.cache.used_blocks > 0
    sched.abort(request)
    assert sched.cache.used_blocks == 0 and not sched.has_work
