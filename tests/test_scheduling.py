"""The scheduling cycle (`dynamo_lite.routing.scheduling`): each part as a pure unit, the whole cycle's
properties over generated inputs, and `--cost dynamo` against Dynamo's formula written out here."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.routing.scheduling import (
    AllBusy,
    BusyThresholds,
    NoWorkerAvailable,
    RankInfo,
    RankState,
    Scheduler,
    SchedulerConfigError,
    SchedulingRequest,
    dynamo_config,
    parse_config,
    ttft_config,
)
from dynamo_lite.routing.scheduling.learning import RateEstimate, SessionTable, WriteWindow
from dynamo_lite.routing.scheduling.parts import (
    RankView,
    cache_pressure,
    decode_blocks,
    decode_interference,
    over_kv_capacity,
    prefill_blocks,
    prefill_time,
)

pytestmark = pytest.mark.unit

BLOCK = 16
TIMING = TimingModel(prefill_secs_per_token=1e-4, decode_step_secs=4e-3, decode_secs_per_running=1e-4)


def view(*, cached: int = 0, isl: int = 320, queued: int = 0, running: int = 0, decode: int = 20,
         turnover: float = 0.0, budget: int = 8192, capacity: int | None = None) -> RankView:
    load = RankState(1, 0, cached, queued, decode, running)
    return RankView(load, RankInfo(1, 0, capacity, budget), TIMING, cached, isl - cached, queued + isl - cached, BLOCK,
                    turnover)


# --- scorers -------------------------------------------------------------------------------------


def test_prefill_time_is_the_queue_ahead_plus_the_uncached_prompt_at_the_prefill_rate() -> None:
    assert prefill_time(view(cached=64, isl=320, queued=100)) == pytest.approx((100 + 256) * 1e-4)


def test_decode_interference_is_one_decode_step_per_prefill_step_with_the_running_batch() -> None:
    assert decode_interference(view(running=0)) == 0.0  # nothing decoding: prefill steps only
    assert decode_interference(view(running=1)) == pytest.approx(4e-3)
    assert decode_interference(view(running=11)) == pytest.approx(4e-3 + 10 * 1e-4)
    # 20,000 tokens with an 8,192-token step budget take 3 steps, each with the batch's decode.
    assert decode_interference(view(isl=20_000, running=1)) == pytest.approx(3 * 4e-3)


def test_cache_pressure_values_the_uncached_tokens_by_the_rank_s_turnover() -> None:
    assert cache_pressure(view(cached=64, isl=320, turnover=0.0)) == 0.0
    assert cache_pressure(view(cached=64, isl=320, turnover=1.0)) == pytest.approx(256 * 1e-4)
    assert cache_pressure(view(cached=64, isl=320, turnover=3.0)) == pytest.approx(3 * 256 * 1e-4)


def test_dynamo_scorers_are_blocks() -> None:
    assert prefill_blocks(view(cached=64, isl=320, queued=32)) == (32 + 256) / BLOCK
    assert decode_blocks(view(decode=37)) == 37


def test_kv_capacity_filter_compares_the_blocks_in_use_with_the_capacity() -> None:
    assert not over_kv_capacity(view(decode=100, capacity=None))
    assert not over_kv_capacity(view(decode=100, capacity=100))
    assert over_kv_capacity(view(decode=101, capacity=100))


# --- configuration -------------------------------------------------------------------------------


def test_the_default_cost_is_the_predicted_time_plus_cache_pressure() -> None:
    config = ttft_config()
    assert config.cost == "ttft"
    assert config.weights == {"prefill_time": 1.0, "decode_interference": 1.0, "cache_pressure": 1.0}
    assert config.predicts_time and config.learn_rates and config.kv_capacity_filter
    dynamo = dynamo_config(4.0, 0.2)
    assert dynamo.weights == {"prefill_blocks": 4.0, "decode_blocks": 1.0}
    assert (dynamo.temperature, dynamo.overlap_score_weight, dynamo.predicts_time) == (0.2, 4.0, False)


def test_a_yaml_document_names_parts_weights_and_settings() -> None:
    config = parse_config({"scorers": {"prefill_time": 1, "cache_pressure": 2}, "temperature": 0.1,
                           "busy": {"active_decode_blocks_threshold": 900}, "kv_capacity_filter": False,
                           "sessions": {"ttl_secs": 60, "max_entries": 10},
                           "timing": {"prefill_secs_per_token": 1e-4, "learn": False}})
    assert config.cost == "custom" and config.scorers == (("prefill_time", 1.0), ("cache_pressure", 2.0))
    assert config.temperature == 0.1 and config.busy.active_decode_blocks_threshold == 900
    assert (config.kv_capacity_filter, config.session_ttl_secs, config.session_max_entries) == (False, 60.0, 10)
    assert config.timing.prefill_secs_per_token == 1e-4 and not config.learn_rates
    assert parse_config({"cost": "dynamo"}).cost == "dynamo"
    assert parse_config(None) == ttft_config()


@pytest.mark.parametrize("document, message", [
    ({"scorer": {}}, "unknown key(s) scorer"),
    ({"cost": "cheapest"}, "unknown cost 'cheapest'"),
    ({"scorers": {"prefill_tim": 1}}, "unknown scorer 'prefill_tim'"),
    ({"scorers": {"prefill_time": -1}}, "must be a finite number >= 0"),
    ({"scorers": {"prefill_time": 1, "decode_blocks": 1}}, "mix units"),
    ({"scorers": {}}, "non-empty mapping"),
    ({"busy": {"active_decode_blocks_threshold": 1.5}}, "integer"),
    ({"timing": {"decode_step": 1}}, "unknown key(s) decode_step"),
    ({"temperature": "warm"}, "temperature must be a finite number"),
    (["prefill_time"], "must be a mapping"),
])
def test_a_bad_document_is_refused_naming_the_key(document: object, message: str) -> None:
    with pytest.raises(SchedulerConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(document, source="scheduler.yaml")


# --- what it learns ----------------------------------------------------------------------------------


def test_the_rate_estimate_converges_to_the_engine_s_true_rates() -> None:
    true = TimingModel(4e-4, 12e-3, 0.0)
    estimate = RateEstimate(TimingModel())  # starts from the stand-in's defaults, 32 us / token
    rng = random.Random(0)
    for _ in range(300):
        tokens = rng.randrange(16, 4000)
        steps = rng.choice([0.0, 1.0, 2.0])
        estimate.observe_ttft(tokens, steps, 0.005 + tokens * true.prefill_secs_per_token
                              + steps * true.decode_step_secs)
    learned = estimate.timing()
    assert learned.prefill_secs_per_token == pytest.approx(4e-4, rel=0.05)
    assert learned.decode_step_secs == pytest.approx(12e-3, rel=0.2)
    assert estimate.overhead_secs == pytest.approx(0.005, abs=0.003)


def test_the_rate_estimate_ignores_nonsense_and_stays_near_its_prior() -> None:
    estimate = RateEstimate(TimingModel())
    for value in (float("nan"), float("inf"), -1.0):
        estimate.observe_ttft(100, 1.0, value)
    assert estimate.observations == 0
    for _ in range(50):  # absurd observations move it at most CLAMP times off the prior
        estimate.observe_ttft(1, 0.0, 1e6)
    assert estimate.timing().prefill_secs_per_token <= 50 * TimingModel().prefill_secs_per_token


def test_the_write_window_keeps_the_most_recent_writes_up_to_its_size() -> None:
    window = WriteWindow()
    window.add((1, 0), 600, window_blocks=1000)
    window.add((2, 0), 600, window_blocks=1000)  # 1,200 written: scaled back to 1,000
    assert window.total == pytest.approx(1000)
    assert window.written((1, 0)) == pytest.approx(500) and window.written((2, 0)) == pytest.approx(500)
    for _ in range(100):
        window.add((2, 0), 100, window_blocks=1000)
    assert window.written((1, 0)) < 1 and window.written((2, 0)) == pytest.approx(1000, rel=0.01)
    window.forget([(2, 0)])
    assert window.written((2, 0)) == 0 and window.total < 1


def test_sessions_expire_and_the_oldest_go_first() -> None:
    table = SessionTable(ttl_secs=10, max_entries=2)
    table.pin("a", (1, 0), 100, now=0)
    table.pin("b", (2, 0), 200, now=1)
    assert table.get("a", now=5) == ((1, 0), 100)
    table.pin("c", (3, 0), 300, now=2)  # a third: "a", pinned first, goes
    assert table.get("a", now=3) is None and len(table) == 2
    assert table.get("b", now=11.5) is None  # expired
    table.drop_rank([(3, 0)])
    assert table.get("c", now=3) is None


# --- the cycle ----------------------------------------------------------------------------------------


def loads(*rows: tuple[int, int, int, int]) -> list[RankState]:
    """(worker, cached tokens, active prefill tokens, active requests) per rank."""
    return [RankState(worker, 0, cached, prefill, 10 + requests, requests) for worker, cached, prefill, requests in rows]


def scheduler(**changes: object) -> Scheduler:
    return Scheduler(ttft_config(timing=TIMING, **changes), seed=0)


def test_a_continuation_stays_where_its_prompt_is_cached_despite_a_running_batch() -> None:
    # Dynamo's cost sends it to the idle rank (one running request's decode blocks outweigh the
    # prefill it saves); in predicted time the cached rank is far cheaper.
    selection = scheduler().schedule(SchedulingRequest(1600, BLOCK), loads((1, 1440, 0, 3), (2, 0, 0, 0)))
    assert selection.chosen.worker_id == 1
    assert selection.chosen.predicted_ttft_secs == pytest.approx(160 * 1e-4 + (4e-3 + 2 * 1e-4))
    dynamo = Scheduler(dynamo_config(), seed=0).schedule(
        SchedulingRequest(1600, BLOCK), [RankState(1, 0, 1440, 0, 200, 3), RankState(2, 0, 0, 0, 100, 0)])
    assert dynamo.chosen.worker_id == 2


def test_new_conversations_spread_over_the_fleet_instead_of_herding_on_the_shared_prefix() -> None:
    cycle = scheduler()
    infos = {(w, 0): RankInfo(w, 0, 512) for w in range(1, 5)}
    picks = []
    for conversation in range(8):
        # Every rank that served one caches the 64-token system prompt: a new conversation
        # saves 64 tokens there. Without the cache pressure it would go there every time.
        served = set(picks)
        request = SchedulingRequest(160, BLOCK, session_id=f"c{conversation}")
        rows = [RankState(w, 0, 64 if w in served else 0, 0, 10, 1 if w in served else 0) for w in range(1, 5)]
        selection = cycle.schedule(request, rows, infos)
        cycle.booked(selection, request, infos)
        picks.append(selection.chosen.worker_id)
    assert sorted(set(picks)) == [1, 2, 3, 4], picks
    herd = Scheduler(ttft_config(timing=TIMING, scorers=(("prefill_time", 1.0), ("decode_interference", 1.0))), seed=0)
    first = herd.schedule(SchedulingRequest(160, BLOCK), loads((1, 64, 0, 1), (2, 0, 0, 0)))
    assert first.chosen.worker_id == 1  # the herd the cache pressure breaks


def test_the_session_s_rank_is_believed_to_cache_its_prompt_until_the_indexer_knows() -> None:
    cycle = scheduler()
    request = SchedulingRequest(800, BLOCK, session_id="s")
    first = cycle.schedule(request, loads((1, 0, 0, 0), (2, 0, 0, 0)))
    cycle.booked(first, request)
    pinned = first.chosen.worker_id
    other = 3 - pinned
    follow_up = SchedulingRequest(960, BLOCK, session_id="s")
    # Its KV events have not arrived: the indexer reports nothing anywhere.
    selection = cycle.schedule(follow_up, loads((pinned, 0, 0, 2), (other, 0, 0, 0)))
    assert selection.chosen.worker_id == pinned and selection.session_hit
    assert selection.chosen.cached_tokens == 800
    # The indexer says the prompt was evicted there (it knows some of it): it is believed.
    selection = cycle.schedule(follow_up, loads((pinned, 32, 0, 2), (other, 320, 0, 0)))
    assert selection.chosen.worker_id == other


def test_a_rank_over_its_kv_capacity_is_only_a_last_resort() -> None:
    cycle = scheduler()
    infos = {(1, 0): RankInfo(1, 0, 100), (2, 0): RankInfo(2, 0, 100)}
    rows = [RankState(1, 0, 800, 0, 101, 1), RankState(2, 0, 0, 0, 60, 1)]
    selection = cycle.schedule(SchedulingRequest(800, BLOCK), rows, infos)
    assert selection.chosen.worker_id == 2
    assert [c.filtered for c in selection.costs] == ["kv_capacity", None]
    over = [RankState(1, 0, 800, 0, 101, 1), RankState(2, 0, 0, 0, 150, 1)]
    assert cycle.schedule(SchedulingRequest(800, BLOCK), over, infos).chosen.worker_id == 1


def test_saturated_and_busy_ranks_are_filtered_and_all_of_them_raise_all_busy() -> None:
    cycle = Scheduler(ttft_config(busy=BusyThresholds(active_decode_blocks_threshold=50)), saturation_threshold=1.0)
    rows = [RankState(1, 0, 0, 9000, 10, 1), RankState(2, 0, 0, 0, 60, 1), RankState(3, 0, 0, 0, 10, 1)]
    selection = cycle.schedule(SchedulingRequest(100, BLOCK), rows)
    assert [c.filtered for c in selection.costs] == ["saturated", "busy", None]
    with pytest.raises(AllBusy, match="busy or saturated"):
        cycle.schedule(SchedulingRequest(100, BLOCK), rows[:2])
    with pytest.raises(NoWorkerAvailable, match="none is registered"):
        cycle.schedule(SchedulingRequest(100, BLOCK), [])


def test_learning_from_first_tokens_moves_a_slow_engine_s_requests_elsewhere() -> None:
    cycle = scheduler()
    rng = random.Random(3)
    for _ in range(60):  # engine 2 prefills 5x slower than engine 1, which is as the prior says
        for worker, factor in ((1, 1.0), (2, 5.0)):
            request = SchedulingRequest(rng.randrange(200, 4000), BLOCK)
            selection = cycle.schedule(request, loads((worker, 0, 0, 0)))
            cycle.first_token(selection.chosen, factor * request.isl_tokens * TIMING.prefill_secs_per_token)
    fast, slow = (cycle.rates.timing((w, 0)).prefill_secs_per_token for w in (1, 2))
    assert 3.5 < slow / fast < 5.5
    # The fleet's own fit is their geometric mean: the prior's speed times sqrt(5).
    assert cycle.rates.fleet_timing().prefill_secs_per_token == pytest.approx(math.sqrt(5) * 1e-4, rel=0.15)
    # Now a request that has 500 tokens cached on the slow engine still goes to the fast one.
    request = SchedulingRequest(2000, BLOCK)
    assert cycle.schedule(request, loads((1, 0, 0, 0), (2, 500, 0, 0))).chosen.worker_id == 1


def test_observations_behind_a_queue_teach_nothing() -> None:
    cycle = scheduler()
    selection = cycle.schedule(SchedulingRequest(1000, BLOCK), loads((1, 0, 4000, 0)))
    cycle.first_token(selection.chosen, 10.0)  # behind 4,000 queued tokens: batching blurs it
    assert cycle.rates.speed((1, 0)) is None and cycle.rates.fleet.observations == 0


# --- properties --------------------------------------------------------------------------------------

ranks = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 20000), st.integers(0, 3000), st.integers(0, 64)),
                 min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(rows=ranks, isl=st.integers(1, 20000), temperature=st.sampled_from([0.0, 0.0, 0.3]),
       decode_threshold=st.none() | st.integers(0, 3000), saturation=st.none() | st.floats(0.1, 4.0),
       capacity=st.none() | st.integers(1, 4000), writes=st.lists(st.integers(0, 11), max_size=30),
       seed=st.integers(0, 3))
def test_any_input_ends_in_a_pick_among_open_ranks_or_a_clear_error(
        rows: list[tuple[int, int, int, int]], isl: int, temperature: float, decode_threshold: int | None,
        saturation: float | None, capacity: int | None, writes: list[int], seed: int) -> None:
    cycle = Scheduler(ttft_config(temperature=temperature, busy=BusyThresholds(decode_threshold)), seed=seed,
                      saturation_threshold=saturation)
    loads_ = [RankState(w, 0, cached, prefill, decode, requests)
              for w, (cached, prefill, decode, requests) in enumerate(rows)]
    infos = {(w, 0): RankInfo(w, 0, capacity) for w in range(len(rows))}
    for worker in writes:  # history: some ranks took more of the recent writes
        if worker < len(rows):
            selection = cycle.schedule(SchedulingRequest(isl, BLOCK), [loads_[worker]], infos) \
                if not cycle.busy(infos[(worker, 0)], loads_[worker].active_prefill_tokens,
                                  loads_[worker].potential_decode_blocks) else None
            if selection is not None:
                cycle.booked(selection, SchedulingRequest(isl, BLOCK), infos)
    try:
        selection = cycle.schedule(SchedulingRequest(isl, BLOCK), loads_, infos)
    except AllBusy as busy:
        assert all(c.filtered in ("busy", "saturated") for c in busy.costs)
        return
    assert len(selection.costs) == len(rows)
    assert all(math.isfinite(c.cost) and c.cost >= 0 for c in selection.costs)
    chosen = selection.chosen
    assert chosen.filtered is None
    assert set(selection.ordered) == {c for c in selection.costs if c.filtered is None}
    assert 0 <= chosen.cached_tokens <= isl and chosen.uncached_tokens == isl - chosen.cached_tokens
    if temperature == 0:
        assert chosen.cost == min(c.cost for c in selection.ordered)


@settings(max_examples=200, deadline=None)
@given(busy=st.lists(st.tuples(st.integers(0, 20000), st.integers(1, 20000), st.integers(1, 64)), min_size=1,
                     max_size=7),
       idle_cached=st.integers(0, 20000), isl=st.integers(1, 20000))
def test_an_idle_rank_is_chosen_unless_another_s_cache_makes_it_cheaper_in_predicted_time(
        busy: list[tuple[int, int, int]], idle_cached: int, isl: int) -> None:
    """With one engine idle and the others loaded (prefill queued, requests running), the idle one
    is chosen unless some other one's cache makes it cheaper in predicted time."""
    cycle = scheduler()
    rows = [RankState(0, 0, idle_cached, 0, 10, 0)]
    rows += [RankState(w + 1, 0, cached, prefill, 10 + requests, requests) for w, (cached, prefill, requests) in enumerate(busy)]
    selection = cycle.schedule(SchedulingRequest(isl, BLOCK), rows)
    idle = next(c for c in selection.costs if c.worker_id == 0)
    chosen = selection.chosen
    if chosen.worker_id != 0:
        assert chosen.predicted_ttft_secs is not None and idle.predicted_ttft_secs is not None
        assert chosen.predicted_ttft_secs <= idle.predicted_ttft_secs
        assert chosen.cached_tokens > min(idle_cached, isl)


def dynamo_formula(rows: list[RankState], isl: int, weight: float,
                   decode_threshold: int | None, prefill_threshold: int | None) -> tuple[set[int], set[int]]:
    """Dynamo 1.6.1's KV router, written out from the router guide: (busy ranks, cheapest ranks)."""
    busy = {r.worker_id for r in rows
            if (decode_threshold is not None and r.potential_decode_blocks > decode_threshold)
            or (prefill_threshold is not None and r.active_prefill_tokens > prefill_threshold)}
    costs = {r.worker_id: weight * (r.active_prefill_tokens + isl - min(r.cached_tokens, isl)) / BLOCK
             + r.potential_decode_blocks for r in rows if r.worker_id not in busy}
    best = min(costs.values(), default=math.inf)
    return busy, {w for w, c in costs.items() if math.isclose(c, best, rel_tol=1e-12, abs_tol=1e-12)}


@settings(max_examples=300, deadline=None)
@given(rows=ranks, isl=st.integers(1, 20000), weight=st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]),
       decode_threshold=st.none() | st.integers(0, 3000), prefill_threshold=st.none() | st.integers(0, 20000),
       seed=st.integers(0, 5))
def test_cost_dynamo_picks_what_dynamo_s_formula_picks(rows: list[tuple[int, int, int, int]], isl: int, weight: float,
                                                     decode_threshold: int | None, prefill_threshold: int | None,
                                                     seed: int) -> None:
    loads_ = [RankState(w, 0, cached, prefill, decode, requests) for w, (cached, prefill, decode, requests) in enumerate(rows)]
    busy, cheapest = dynamo_formula(loads_, isl, weight, decode_threshold, prefill_threshold)
    cycle = Scheduler(dynamo_config(weight, busy=BusyThresholds(decode_threshold, prefill_threshold)), seed=seed)
    if len(busy) == len(rows):
        with pytest.raises(AllBusy):
            cycle.schedule(SchedulingRequest(isl, BLOCK), loads_)
        return
    selection = cycle.schedule(SchedulingRequest(isl, BLOCK), loads_)
    assert {c.worker_id for c in selection.costs if c.busy} == busy
    assert selection.chosen.worker_id in cheapest


def test_the_worked_example_of_docs_routing_md() -> None:
    """docs/routing.md's table, computed by the cycle: the benchmark's engines, a conversation's
    10th turn on engine A (1,440 of 1,600 tokens cached, 3 running, 20 % of the recent writes)
    against idle engine B (nothing cached, 5 % of the writes), 8 ranks of 512 blocks."""
    timing = TimingModel(2.56e-4, 6.8e-3, 0.06e-3).scaled(2.0)
    cycle = Scheduler(ttft_config(timing=timing, learn_rates=False), seed=0)
    infos = {(w, 0): RankInfo(w, 0, 512) for w in range(8)}
    for _ in range(200):  # many full windows written, in these shares
        for worker, share in enumerate((0.20, 0.05, 0.15, 0.15, 0.15, 0.10, 0.10, 0.10)):
            cycle.writes.add((worker, 0), share * 100, 8 * 512)
    others = [RankState(w, 0, 0, 0, 200, 0) for w in range(2, 8)]
    rows = [RankState(0, 0, 1440, 0, 400, 3), RankState(1, 0, 0, 0, 200, 0), *others]
    costs = {c.worker_id: c for c in cycle.schedule(SchedulingRequest(1600, BLOCK), rows, infos).costs}
    turnover = lambda share: (share + 0.02 / 8) / (1 + 0.02) * 8  # noqa: E731 - the 2 % prior of the window
    assert dict(costs[0].terms) == pytest.approx({"prefill_time": 0.02048, "decode_interference": 0.00346,
                                                  "cache_pressure": 0.02048 * turnover(0.20)}, rel=2e-2)
    assert costs[0].cost == pytest.approx(0.0567, abs=0.001)
    assert costs[1].cost == pytest.approx(0.2048 * (1 + turnover(0.05)), rel=2e-2)
    assert costs[1].cost == pytest.approx(0.2867, abs=0.003)
    new = {c.worker_id: c.cost for c in cycle.schedule(SchedulingRequest(160, BLOCK),
                                                      [RankState(0, 0, 64, 0, 310, 3), RankState(1, 0, 0, 0, 10, 0),
                                                       *others], infos).costs}
    assert new[0] == pytest.approx(0.0354, abs=0.001) and new[1] == pytest.approx(0.0287, abs=0.001)
