"""Dynamo's cost through the scheduling cycle (`RouterConfig`, the `dynamo` cost), then
`KvRouter` wired to the in-process services."""

from __future__ import annotations

import math
import random
from collections import Counter

import httpx
import pytest

from dynamo_lite.client import ConnectError, ServiceStatusError
from dynamo_lite.routing import NoWorkerAvailable, RouterConfig
from dynamo_lite.routing.scheduling import AllBusy, RankCost, RankState, Scheduler, SchedulingRequest, Selection
from dynamo_lite.routing.scheduling.parts import pick_softmax

pytestmark = pytest.mark.unit

BLOCK = 16


def schedule(rows: list[tuple[int, int, int, int]], cached: dict[tuple[int, int], int], isl: int,
             config: RouterConfig = RouterConfig(), seed: int = 0) -> Selection:
    """(worker, rank, active prefill tokens, potential decode blocks) rows, as /potential_loads
    answers them for new_isl_tokens=0, scored with Dynamo's cost."""
    loads = [RankState(w, r, cached.get((w, r), 0), prefill, decode, 0) for w, r, prefill, decode in rows]
    return Scheduler(config.scheduler_config(), seed=seed).schedule(SchedulingRequest(isl, BLOCK), loads)


def test_cost_is_weighted_prefill_blocks_plus_decode_blocks() -> None:
    selection = schedule([(1, 0, 32, 10), (2, 0, 0, 5), (3, 0, 0, 9)], {(1, 0): 64, (2, 0): 16}, isl=160,
                         config=RouterConfig(overlap_score_weight=2.0))
    by_worker = {c.worker_id: c for c in selection.costs}
    assert by_worker[1].prefill_tokens == 32 + 160 - 64
    assert by_worker[1].cost == pytest.approx(2.0 * 128 / 16 + 10)
    assert by_worker[2].cost == pytest.approx(2.0 * 144 / 16 + 5)
    assert by_worker[3].cached_tokens == 0 and by_worker[3].cost == pytest.approx(2.0 * 10 + 9)
    assert selection.chosen.worker_id == 2
    assert [c.worker_id for c in selection.ordered] == [2, 1, 3]  # the fallbacks, cheapest first
    assert by_worker[2].formula() == ("worker 2 rank 0: 23 = prefill_blocks 18 + decode_blocks 5 "
                                      "(cached tokens: 16)")


def test_cached_tokens_are_capped_at_the_prompt() -> None:
    selection = schedule([(1, 0, 0, 0)], {(1, 0): 10_000}, 32)
    assert [(c.worker_id, c.cached_tokens, c.prefill_tokens) for c in selection.costs] == [(1, 32, 0)]


def test_zero_temperature_breaks_ties_with_the_seeded_generator() -> None:
    rows = [(1, 0, 0, 3), (2, 0, 0, 3), (3, 0, 0, 4)]
    picks = [schedule(rows, {}, 16, seed=seed).chosen.worker_id for seed in range(40)]
    assert set(picks) == {1, 2}
    assert picks == [schedule(rows, {}, 16, seed=seed).chosen.worker_id for seed in range(40)]


def cost(worker: int, value: float) -> RankCost:
    return RankCost(worker, 0, 0, 0, 0, 0, 0, (("prefill_blocks", value),), value)


def test_temperature_samples_a_softmax_over_normalised_costs() -> None:
    costs = [cost(w, c) for w, c in [(1, 0.0), (2, 3.0), (3, 9.0)]]
    rng = random.Random(42)
    counts = Counter(pick_softmax(costs, 1.0, rng).worker_id for _ in range(30_000))
    # Costs 0, 3, 9 normalise to 0, 1/3, 1: probabilities proportional to exp(-normalised / T).
    expected = [math.exp(-c / 9.0) for c in (0.0, 3.0, 9.0)]
    for worker, weight in zip((1, 2, 3), expected):
        assert counts[worker] / 30_000 == pytest.approx(weight / sum(expected), abs=0.02)
    equal = [cost(w, 5.0) for w in (1, 2)]
    assert {pick_softmax(equal, 0.5, random.Random(s)).worker_id for s in range(20)} == {1, 2}


def test_busy_thresholds_exclude_ranks_and_all_busy_raises() -> None:
    config = RouterConfig(active_decode_blocks_threshold=10, active_prefill_tokens_threshold=100)
    selection = schedule([(1, 0, 0, 11), (2, 0, 101, 0), (3, 0, 100, 10)], {}, 16, config)
    assert [c.worker_id for c in selection.costs if c.busy] == [1, 2]
    assert selection.chosen.worker_id == 3
    with pytest.raises(AllBusy, match="all 2 candidate ranks are busy") as failure:
        schedule([(1, 0, 0, 11), (2, 0, 101, 0)], {}, 16, config)
    assert [c.filtered for c in failure.value.costs] == ["busy", "busy"]
    with pytest.raises(NoWorkerAvailable, match="none is registered"):
        schedule([], {}, 16)


def test_select_for_a_model_nobody_registered_raises_no_worker_available() -> None:
    import asyncio

    from test_client import in_process

    from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
    from dynamo_lite.indexer.app import create_app as create_indexer
    from dynamo_lite.routing import KvRouter
    from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker

    async def scenario() -> None:
        async with AsyncSlotTrackerClient(client=in_process(create_slot_tracker())) as tracker, \
                AsyncIndexerClient(client=in_process(create_indexer())) as indexer:
            router = KvRouter(tracker, indexer, block_size=BLOCK)
            local, chained = router.hashes_for(list(range(64)))
            with pytest.raises(NoWorkerAvailable, match="no worker of model 'nobody' .* is registered"):
                await router.select("nobody", isl_tokens=64, local_hashes=local, sequence_hashes=chained)

    asyncio.run(scenario())


@pytest.mark.parametrize("tracker_answer, raised", [
    ((404, "no worker registered"), NoWorkerAvailable),
    ((422, "sequence_hashes[0]: expected an integer"), ServiceStatusError),
    (httpx.ConnectError("refused"), ConnectError),
])
def test_select_tells_no_worker_from_a_failed_call_by_the_error_kind(tracker_answer: object, raised: type) -> None:
    import asyncio

    from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
    from dynamo_lite.routing import KvRouter

    def tracker(request: httpx.Request) -> httpx.Response:
        if isinstance(tracker_answer, Exception):
            raise tracker_answer
        status, message = tracker_answer
        return httpx.Response(status, json={"error": message})

    def indexer(request: httpx.Request) -> httpx.Response:  # nothing indexed: a 404 too, not "no worker"
        return httpx.Response(404, json={"error": "no such model"})

    async def scenario() -> None:
        async with AsyncSlotTrackerClient(client=httpx.AsyncClient(
                    base_url="http://tracker", transport=httpx.MockTransport(tracker))) as slot_tracker, \
                AsyncIndexerClient(client=httpx.AsyncClient(
                    base_url="http://indexer", transport=httpx.MockTransport(indexer))) as index:
            router = KvRouter(slot_tracker, index, block_size=BLOCK)
            with pytest.raises(raised) as failure:
                await router.select("m", isl_tokens=16, local_hashes=[1], sequence_hashes=[1])
            assert type(failure.value) is raised
            if raised is not NoWorkerAvailable:
                assert failure.value.path == "/potential_loads"

    asyncio.run(scenario())


@pytest.mark.parametrize("kwargs", [{"overlap_score_weight": -1}, {"router_temperature": float("nan")}])
def test_config_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


def test_router_prefers_the_worker_holding_the_prefix_and_books_it() -> None:
    import asyncio

    import httpx

    from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
    from dynamo_lite.hashing import local_block_hashes, sequence_hashes
    from dynamo_lite.indexer.app import create_app as create_indexer
    from dynamo_lite.routing import KvRouter
    from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker

    def in_process(app) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service")

    async def scenario() -> None:
        slot_app, indexer_app = create_slot_tracker(), create_indexer()
        async with AsyncSlotTrackerClient(client=in_process(slot_app)) as slots, \
                AsyncIndexerClient(client=in_process(indexer_app)) as indexer:
            router = KvRouter(slots, indexer, block_size=BLOCK, config=RouterConfig(), seed=1)
            tokens = list(range(BLOCK * 8))
            local, chained = router.hashes_for(tokens)
            for worker in (1, 2, 3):
                await slots.register(worker, "m", BLOCK)
            assert (await router.select("m", isl_tokens=len(tokens), local_hashes=local,
                                        sequence_hashes=chained)).chosen.cached_tokens == 0  # 404: nothing cached
            unsigned = local_block_hashes(tokens, BLOCK)
            externals = sequence_hashes(unsigned)
            await indexer.events({"m:default": {"block_size": BLOCK, "events": [
                {"worker_id": 2, "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
                    "parent_hash": None, "blocks": [{"block_hash": e, "tokens_hash": h}
                                                    for e, h in zip(externals[:6], unsigned[:6])]}}}}]}})
            decision = await router.select("m", isl_tokens=len(tokens), local_hashes=local, sequence_hashes=chained)
            assert (decision.worker_id, decision.chosen.cached_tokens) == (2, 6 * BLOCK)
            assert {c.worker_id: c.prefill_tokens for c in decision.costs} == {1: 128, 2: 32, 3: 128}
            handle = await router.commit(decision, "req-1")
            loads = {(load.worker_id, load.dp_rank): load for load in await slots.loads()}
            assert (loads[(2, 0)].active_prefill_tokens, loads[(2, 0)].active_decode_blocks) == (32, 8)
            await handle.prefill_complete()
            await handle.output_blocks(3)
            loads = {(load.worker_id, load.dp_rank): load for load in await slots.loads()}
            assert (loads[(2, 0)].active_prefill_tokens, loads[(2, 0)].active_decode_blocks) == (0, 11)
            await handle.free()
            assert all(load.active_decode_blocks == 0 for load in await slots.loads())
            await handle.output_blocks(4)  # after free: a no-op, not a 404
            overridden = await router.select("m", isl_tokens=len(tokens), local_hashes=local,
                                             sequence_hashes=chained, overlap_score_weight=0.0)
            assert overridden.request.overlap_score_weight == 0.0
            assert all(c.cost == c.decode_blocks for c in overridden.costs)

    asyncio.run(scenario())


def test_router_records_routes_for_ranks_without_events_and_only_for_them() -> None:
    import asyncio

    import httpx

    from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
    from dynamo_lite.hashing import local_block_hashes, sequence_hashes
    from dynamo_lite.indexer.app import create_app as create_indexer
    from dynamo_lite.routing import KvRouter
    from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker

    def in_process(app) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service")

    async def approximate_blocks(indexer: AsyncIndexerClient) -> dict[tuple[int, int], tuple[str, int]]:
        return {(info.instance_id, rank.dp_rank): (rank.source, rank.approximate_blocks)
                for info in await indexer.workers("m") for rank in info.ranks}

    async def scenario() -> None:
        async with AsyncSlotTrackerClient(client=in_process(create_slot_tracker())) as slots, \
                AsyncIndexerClient(client=in_process(create_indexer())) as indexer:
            router = KvRouter(slots, indexer, block_size=BLOCK, seed=1, sources_refresh_secs=0)
            tokens = list(range(BLOCK * 8))
            local, chained = router.hashes_for(tokens)

            # The indexer knows no partition "m" yet: nothing to record into, and no call made.
            await slots.register(1, "m", BLOCK)
            decision = await router.select("m", isl_tokens=len(tokens), local_hashes=local, sequence_hashes=chained)
            assert not await router.record(decision)
            forced = KvRouter(slots, indexer, block_size=BLOCK, record_routes=True)
            assert not await forced.record(decision)  # 404 from /routed: logged, not raised

            # Workers 1 and 2 publish nothing: the chosen one is approximated, and the next
            # request with the same prefix goes there for its cache.
            await slots.register(2, "m", BLOCK)
            for worker in (1, 2):
                await indexer.register(worker, "m", BLOCK)
            decision = await router.select("m", isl_tokens=len(tokens), local_hashes=local, sequence_hashes=chained)
            assert decision.local_hashes == local
            handle = await router.commit(decision, "req-1")
            chosen = (decision.worker_id, decision.dp_rank)
            other = (3 - decision.worker_id, 0)
            assert (await approximate_blocks(indexer))[chosen] == ("approximate", 8)
            assert (await approximate_blocks(indexer))[other] == ("none", 0)
            await handle.free()
            again = await router.select("m", isl_tokens=len(tokens), local_hashes=local, sequence_hashes=chained)
            assert ((again.worker_id, again.dp_rank), again.chosen.cached_tokens) == (chosen, 8 * BLOCK)

            # A rank whose engine publishes events is indexed exactly: never recorded (unless
            # asked), and a router told never to record does not.
            unsigned = local_block_hashes(tokens, BLOCK)
            await indexer.events({"m:default": {"block_size": BLOCK, "events": [
                {"worker_id": other[0], "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
                    "parent_hash": None, "blocks": [{"block_hash": e, "tokens_hash": h}
                                                    for e, h in zip(sequence_hashes(unsigned)[:2], unsigned[:2])]}}}}]}})
            decision.worker_id = other[0]
            assert not await router.record(decision)
            assert await forced.record(decision)
            assert (await approximate_blocks(indexer))[other] == ("events", 8)
            never = KvRouter(slots, indexer, block_size=BLOCK, record_routes=False)
            decision.worker_id = chosen[0]
            assert not await never.record(decision)

    asyncio.run(scenario())
