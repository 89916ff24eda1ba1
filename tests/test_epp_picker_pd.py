"""The picker's per-request hints and prefill/decode disaggregation, in process (`LocalState`:
the picker's own slot tracker and indexer, every booking call made at once), no Envoy.

- `nvext.agent_hints.osl` reaches the scheduling request and the slot tracker's `/add`;
- with `role: prefill` endpoints in the pool, a prompt with many uncached tokens on the chosen
  decode endpoint is prefilled on a prefill endpoint (`x-prefiller-host-port`), both ranks
  booked until the decode engine's first token (prefill) and the answer's end (decode); short
  prompts, a busy prefill pool or no prefill endpoint: aggregated on the decode endpoint.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dynamo_lite.epp.disagg import (
    DISAGGREGATED,
    NO_PREFILL,
    PREFILL_BUSY,
    SHORT,
    DisaggSettings,
    PrefillRank,
    choose_prefill,
)
from dynamo_lite.epp.endpoint import PoolEndpoint
from dynamo_lite.epp.metrics import EppMetrics
from dynamo_lite.epp.picker import PREFILL_BOOKING_SUFFIX, KvPicker, PickerSettings, expected_output_tokens
from dynamo_lite.epp.prompt import PromptReader
from dynamo_lite.epp.protocol import Pick, PickError, RequestInfo
from dynamo_lite.epp.registration import indexer_rank, tracker_workers
from dynamo_lite.epp.state import LocalState
from dynamo_lite.routing.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

MODEL = "mock"
BLOCK = 16


def endpoint(worker_id: int, **fields: Any) -> PoolEndpoint:
    return PoolEndpoint(address=f"127.0.0.1:{18000 + worker_id}", worker_id=worker_id, model=MODEL,
                        block_size=BLOCK, **fields)


async def picker_on(pool: list[PoolEndpoint], **settings: Any) -> tuple[KvPicker, LocalState]:
    state = LocalState()
    for worker in tracker_workers(pool):
        assert await state.registrar.register_tracker_worker(worker)
    for ep in pool:
        assert await state.registrar.register_indexer_rank(indexer_rank(ep))
    picker = KvPicker(pool=pool, prompts=PromptReader(tokenizer=Tokenizer.load()),
                      metrics=EppMetrics(CollectorRegistry()), settings=PickerSettings(seed=0, **settings),
                      state=state)
    return picker, state


def request(request_id: str, prompt: list[int], **body: Any) -> RequestInfo:
    data = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    return RequestInfo(request_id, "POST", "/v1/completions", {}, json.dumps(data).encode(), None)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def idle(state: LocalState) -> bool:
    """No booking left, no load on any rank."""
    return not list(state.tracker.active_requests()) and all(
        (load.active_prefill_tokens, load.active_decode_blocks) == (0, 0) for load in state.tracker.loads())


def first_token_and_end(pick: Pick) -> None:
    pick.tracker.response_headers(200, {"content-type": "text/event-stream"})
    pick.tracker.response_chunk(b'data: {"choices":[{"text":"x"}]}\n\n')
    pick.tracker.end("complete")


# --- nvext.agent_hints.osl -------------------------------------------------------------------------


def test_osl_is_read_from_nvext_agent_hints() -> None:
    assert expected_output_tokens({"model": "m"}) is None
    assert expected_output_tokens({"nvext": {"agent_hints": {"osl": 300}}}) == 300
    assert expected_output_tokens({"nvext": {"agent_hints": {"osl": None}}}) is None
    assert expected_output_tokens({"nvext": {"agent_hints": {}}}) is None
    assert expected_output_tokens({"nvext": "x"}) is None
    for bad in (-1, 1.5, "300", True, 1 << 32, [3]):
        with pytest.raises(PickError) as refused:
            expected_output_tokens({"nvext": {"agent_hints": {"osl": bad}}})
        assert refused.value.status == 400 and "osl" in refused.value.message


def test_osl_goes_to_the_scheduler_and_the_slot_tracker_add() -> None:
    async def scenario() -> None:
        picker, state = await picker_on([endpoint(1)])
        scheduled: list[int | None] = []
        schedule = picker.scheduler.schedule

        def spy(req: Any, *args: Any, **kwargs: Any) -> Any:
            scheduled.append(req.expected_output_tokens)
            return schedule(req, *args, **kwargs)

        picker.scheduler.schedule = spy  # type: ignore[method-assign]
        pick = await picker.pick(request("r-osl", list(range(64)), nvext={"agent_hints": {"osl": 256}}))
        booked = state.tracker.request(MODEL, "default", "r-osl")
        assert booked is not None and booked.expected_output_tokens == 256
        first_token_and_end(pick)
        plain = await picker.pick(request("r-plain", list(range(64))))
        booked = state.tracker.request(MODEL, "default", "r-plain")
        assert booked is not None and booked.expected_output_tokens is None
        first_token_and_end(plain)
        assert scheduled == [256, None]
        with pytest.raises(PickError) as refused:
            await picker.pick(request("r-bad", list(range(64)), nvext={"agent_hints": {"osl": "long"}}))
        assert refused.value.status == 400
        assert idle(state)
        await picker.settle()
        await picker.aclose()
        await state.aclose()

    run(scenario)


# --- disaggregation: the decision alone ------------------------------------------------------------


def prefill_rank(worker_id: int, cached: int = 0, booked: int = 0, budget: int = 8192) -> PrefillRank:
    return PrefillRank(endpoint(worker_id, role="prefill", max_num_batched_tokens=budget), cached, booked)


def test_the_decision() -> None:
    settings = DisaggSettings(min_uncached_tokens=2048, prefill_busy_frac=1.0)
    ranks = [prefill_rank(1), prefill_rank(2)]
    # No prefill endpoint: aggregated, whatever the prompt.
    assert choose_prefill(10_000, 10_000, [], settings) == (None, NO_PREFILL)
    # At most the threshold uncached on the decode rank (a short or mostly cached prompt): aggregated.
    assert choose_prefill(1_000, 1_000, ranks, settings) == (None, SHORT)
    assert choose_prefill(10_000, 2048, ranks, settings) == (None, SHORT)
    choice, reason = choose_prefill(10_000, 2049, ranks, settings)
    assert reason == DISAGGREGATED and choice is not None and choice.endpoint.worker_id == 1
    assert choice.uncached_tokens == 10_000
    # The least predicted prefill work: uncached tokens there plus the prefill booked there.
    choice, _ = choose_prefill(10_000, 9_000, [prefill_rank(1, booked=4000), prefill_rank(2, cached=3000)], settings)
    assert choice is not None and choice.endpoint.worker_id == 2 and choice.uncached_tokens == 7_000
    choice, _ = choose_prefill(10_000, 9_000, [prefill_rank(1, booked=500), prefill_rank(2, cached=300, booked=1000)], settings)
    assert choice is not None and choice.endpoint.worker_id == 1
    # Busy: booked prefill at prefill_busy_frac x max_num_batched_tokens or more, or the
    # scheduler's verdict; the others still take it, all busy: aggregated.
    busy_one = [prefill_rank(1, booked=8192), prefill_rank(2, booked=8191)]
    choice, _ = choose_prefill(10_000, 10_000, busy_one, settings)
    assert choice is not None and choice.endpoint.worker_id == 2
    assert choose_prefill(10_000, 10_000, busy_one, settings, busy=lambda r: r.endpoint.worker_id == 2) == (
        None, PREFILL_BUSY)
    assert choose_prefill(10_000, 10_000, [prefill_rank(1, booked=100, budget=50)], settings) == (None, PREFILL_BUSY)
    unguarded = DisaggSettings(min_uncached_tokens=0, prefill_busy_frac=None)
    choice, _ = choose_prefill(10, 1, [prefill_rank(1, booked=10**6, budget=50)], unguarded)
    assert choice is not None


# --- disaggregation: the picker ---------------------------------------------------------------------

PREFILL_EP = endpoint(1, role="prefill", max_num_batched_tokens=256)
DECODE_EP = endpoint(2, role="decode")
SMALL = DisaggSettings(min_uncached_tokens=64, prefill_busy_frac=1.0)  # a prompt over 64 tokens disaggregates


def booked(state: LocalState, request_id: str) -> tuple[tuple[int, int], int, int] | None:
    """(rank, prefill tokens, prompt blocks) of a booking on the picker's slot tracker."""
    found = state.tracker.request(MODEL, "default", request_id)
    if found is None:
        return None
    return (found.slot.worker_id, found.slot.dp_rank), found.prefill_tokens, found.block_count


def disagg_count(picker: KvPicker, reason: str) -> float:
    return picker.metrics.disagg_decisions.labels(reason)._value.get()


def test_a_long_prompt_is_prefilled_on_the_prefill_endpoint_and_both_bookings_end() -> None:
    async def scenario() -> None:
        picker, state = await picker_on([PREFILL_EP, DECODE_EP], disagg=SMALL)
        pick = await picker.pick(request("r1", list(range(1000, 1200))))  # 200 tokens, 12 full blocks + 8
        assert pick.endpoints == [DECODE_EP.address]  # never a prefill endpoint as the destination
        assert pick.headers["x-prefiller-host-port"] == PREFILL_EP.address and pick.remove_headers == ()
        assert booked(state, "r1") == ((2, 0), 0, 12)  # decode: the prompt's blocks, no prefill
        assert booked(state, "r1" + PREFILL_BOOKING_SUFFIX) == ((1, 0), 200, 0)  # prefill: the whole prompt, no blocks (role prefill)
        assert picker.in_flight.get((1, 0)).prefill_tokens == 200 and picker.metrics.in_flight._value.get() == 1
        pick.tracker.response_headers(200, {"content-type": "text/event-stream"})
        pick.tracker.response_chunk(b'data: {"choices":[{"text":"x"}]}\n\n')  # the decode engine's first token
        assert booked(state, "r1" + PREFILL_BOOKING_SUFFIX) is None and booked(state, "r1") == ((2, 0), 0, 12)
        assert picker.in_flight.get((1, 0)).requests == 0
        pick.tracker.end("complete")
        assert idle(state) and not picker.prefill_bookings and not picker.bookings
        assert disagg_count(picker, DISAGGREGATED) == 1
        assert picker.metrics.ends.labels("complete")._value.get() == 1  # one request, one end
        await picker.settle()
        await picker.aclose()
        await state.aclose()

    run(scenario)


def test_a_request_cancelled_before_its_first_token_frees_both() -> None:
    async def scenario() -> None:
        picker, state = await picker_on([PREFILL_EP, DECODE_EP], disagg=SMALL)
        pick = await picker.pick(request("r1", list(range(1000, 1200))))
        assert booked(state, "r1" + PREFILL_BOOKING_SUFFIX) is not None
        pick.tracker.end("cancelled")
        assert idle(state) and not picker.prefill_bookings
        # And at shutdown: settle() ends what is open, prefill halves included.
        await picker.pick(request("r2", list(range(2000, 2200))))
        await picker.settle()
        assert idle(state) and not picker.prefill_bookings
        await picker.aclose()
        await state.aclose()

    run(scenario)


def test_short_prompts_busy_prefill_and_no_prefill_endpoint_run_aggregated() -> None:
    async def scenario() -> None:
        picker, state = await picker_on([PREFILL_EP, DECODE_EP], disagg=SMALL)
        short = await picker.pick(request("short", list(range(64))))  # 64 uncached: not over the threshold
        assert "x-prefiller-host-port" not in short.headers and short.endpoints == [DECODE_EP.address]
        assert booked(state, "short") == ((2, 0), 64, 4) and booked(state, "short" + PREFILL_BOOKING_SUFFIX) is None
        first_token_and_end(short)
        # The prefill endpoint busy: 300 tokens booked >= 1.0 x its 256-token budget.
        long = await picker.pick(request("long", list(range(1000, 1300))))
        assert long.headers["x-prefiller-host-port"] == PREFILL_EP.address
        other = await picker.pick(request("other", list(range(5000, 5300))))
        assert "x-prefiller-host-port" not in other.headers
        assert booked(state, "other") == ((2, 0), 300, 18)  # prefilled on the decode endpoint itself
        assert disagg_count(picker, PREFILL_BUSY) == 1 and disagg_count(picker, SHORT) == 1
        # A client's own x-prefiller-host-port is removed when the picker runs the request aggregated.
        spoofed = RequestInfo("spoofed", "POST", "/v1/completions", {"x-prefiller-host-port": "10.9.9.9:80"},
                              json.dumps({"model": MODEL, "prompt": list(range(10))}).encode(), None)
        spoofed_pick = await picker.pick(spoofed)
        assert spoofed_pick.remove_headers == ("x-prefiller-host-port",)
        for pick in (long, other, spoofed_pick):
            first_token_and_end(pick)
        assert idle(state)
        await picker.settle()
        await picker.aclose()
        await state.aclose()

    run(scenario)


def test_without_prefill_endpoints_nothing_changes_and_prefill_alone_serves_nothing() -> None:
    async def scenario() -> None:
        picker, state = await picker_on([endpoint(3), DECODE_EP], disagg=SMALL)
        pick = await picker.pick(request("r1", list(range(1000, 1200))))
        assert "x-prefiller-host-port" not in pick.headers
        assert booked(state, "r1") is not None and booked(state, "r1")[1] == 200  # type: ignore[index]
        assert disagg_count(picker, NO_PREFILL) == 0  # not counted: the model has no prefill endpoint
        first_token_and_end(pick)
        await picker.settle()
        await picker.aclose()
        await state.aclose()
        only_prefill, state = await picker_on([PREFILL_EP])
        with pytest.raises(PickError) as refused:
            await only_prefill.pick(request("r2", list(range(100))))
        assert refused.value.status == 503 and "only prefill" in refused.value.message
        await only_prefill.aclose()
        await state.aclose()

    run(scenario)
