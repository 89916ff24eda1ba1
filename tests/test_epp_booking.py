"""A picked request's bookkeeping (`dynamo_lite.epp.booking.Booking`) against a real slot tracker:
the calls a real answer's chunks lead to, in order, exactly once, and nothing left booked."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support.reference_server import free_port, running_server, running_service

from dynamo_lite.client import AsyncSlotTrackerClient
from dynamo_lite.epp.booking import Booking, BookingTarget, InFlight, estimated_output_tokens
from dynamo_lite.epp.metrics import EppMetrics

MODEL = "m"


@pytest.fixture(scope="module")
def slot_tracker() -> Iterator[str]:
    with running_service("slot_tracker") as url:
        for worker in (1, 2):
            answer = httpx.post(url + "/register", json={"worker_id": worker, "model_name": MODEL, "block_size": 4,
                                                         "dp_start": 0, "dp_size": 1})
            assert answer.status_code in (200, 201), answer.text
        yield url


def active(url: str) -> list[dict]:
    dump = httpx.get(url + "/dump").json()
    return [request for partition in dump["partitions"] for request in partition["requests"]]


def sse(tokens: int) -> bytes:
    return b"".join(b'data: {"choices":[{"text":"x"}]}\n\n' for _ in range(tokens))


async def booked(url: str, request_id: str, *, fallbacks: dict[str, BookingTarget] | None = None,
                 tracker: AsyncSlotTrackerClient | None = None, max_output_tokens: int | None = None,
                 unobserved: list[Booking] | None = None) -> tuple[Booking, InFlight, list[str]]:
    in_flight = InFlight()
    ended: list[str] = []
    booking = Booking(
        slot_tracker=tracker or AsyncSlotTrackerClient(url), metrics=EppMetrics(CollectorRegistry()),
        in_flight=in_flight, request_id=request_id, model=MODEL, tenant_id="default",
        target=BookingTarget(1, 0, "10.0.0.1:8000"), fallbacks=fallbacks or {}, sequence_hashes=[11, 12, 13],
        new_prefill_tokens=10, block_size=4, on_end=lambda: ended.append(request_id),
        max_output_tokens=max_output_tokens, on_unobserved=None if unobserved is None else unobserved.append,
    )
    return booking, in_flight, ended


@pytest.mark.process
def test_a_streamed_answer_is_added_prefilled_grown_and_freed(slot_tracker: str) -> None:
    async def scenario() -> None:
        booking, in_flight, ended = await booked(slot_tracker, "stream-1")
        booking.response_headers(200, {"content-type": "text/event-stream"})
        await booking.settled()
        [request] = active(slot_tracker)
        assert (request["request_id"], request["new_isl_tokens"], request["output_blocks"]) == ("stream-1", 10, 0)
        booking.response_chunk(b"")  # empty chunks are not the first token
        assert not booking.prefilled
        booking.response_chunk(sse(3))
        booking.response_chunk(sse(6) + b'data: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n')
        await booking.settled()
        [request] = active(slot_tracker)
        assert request["output_blocks"] == 2  # 9 tokens of 4: two full blocks
        assert in_flight.get((1, 0)).prefill_tokens == 0
        booking.end("complete")
        booking.end("cancelled")  # exactly once
        await booking.settled()
        assert active(slot_tracker) == [] and ended == ["stream-1"] and in_flight.total == 0

    asyncio.run(scenario())


@pytest.mark.process
def test_an_error_status_frees_at_once(slot_tracker: str) -> None:
    async def scenario() -> None:
        booking, in_flight, ended = await booked(slot_tracker, "error-1")
        booking.response_headers(503, {"content-type": "application/json"})
        await booking.settled()
        assert active(slot_tracker) == [] and booking.ended == "error_status" and in_flight.total == 0
        booking.response_chunk(b'{"error": "x"}')  # after the end: nothing more is sent
        booking.end("complete")
        await booking.settled()
        assert ended == ["error-1"]

    asyncio.run(scenario())


@pytest.mark.process
def test_a_fallback_moves_the_booking(slot_tracker: str) -> None:
    async def scenario() -> None:
        fallback = BookingTarget(2, 0, "10.0.0.2:8000")
        booking, in_flight, _ = await booked(slot_tracker, "moved-1", fallbacks={fallback.address: fallback})
        booking.served("10.0.0.2:8000")
        await booking.settled()
        [request] = active(slot_tracker)
        assert request["worker_id"] == 2 and in_flight.get((2, 0)).requests == 1 and in_flight.get((1, 0)).requests == 0
        booking.response_chunk(sse(1))
        booking.end("complete")
        await booking.settled()
        assert active(slot_tracker) == []

    asyncio.run(scenario())


@pytest.mark.process
def test_a_slot_tracker_away_at_the_end_is_freed_when_it_is_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`/free` is retried until it lands: the slot tracker restarts (from its snapshot, so the
    request is still active there) while the answer ends."""
    port = free_port()
    snapshot = tmp_path / "slots.json"
    argv = [sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1", "--port", str(port),
            "--snapshot", str(snapshot), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        with running_server(argv, port):
            httpx.post(url + "/register", json={"worker_id": 1, "model_name": MODEL, "block_size": 4, "dp_start": 0,
                                               "dp_size": 1})
            booking, _, _ = await booked(url, "late-1")
            await booking.settled()
            assert [request["request_id"] for request in active(url)] == ["late-1"]
        booking.end("complete")  # the slot tracker is down: /free fails and is retried
        await asyncio.sleep(0.3)
        assert not booking._calls.done()
        with running_server(argv, port):
            await asyncio.wait_for(booking.settled(), timeout=10)
            assert active(url) == []

    asyncio.run(scenario())


# -- answers the gateway stops showing after their first chunk (the access-log configuration) ----


@pytest.mark.unit
def test_an_unseen_answer_grows_by_one_token_per_decode_step_up_to_its_max_tokens() -> None:
    assert estimated_output_tokens(1, 0.0, 0.01, None) == 1
    assert estimated_output_tokens(1, 0.095, 0.01, None) == 10  # 9 whole steps after the first token
    assert estimated_output_tokens(1, 10.0, 0.01, 64) == 64  # never past max_tokens
    assert estimated_output_tokens(3, 5.0, 0.01, 2) == 3  # what was counted stays counted
    assert estimated_output_tokens(1, -1.0, 0.01, None) == 1  # a clock read before the hand-over
    assert estimated_output_tokens(1, 5.0, 0.0, None) == 1  # no known step: no growth


@pytest.mark.process
def test_an_unseen_answer_books_its_estimated_output_and_frees_it_at_the_end(slot_tracker: str) -> None:
    async def scenario() -> None:
        unobserved: list[Booking] = []
        booking, in_flight, ended = await booked(slot_tracker, "unseen-1", max_output_tokens=30, unobserved=unobserved)
        booking.response_headers(200, {"content-type": "text/event-stream"})
        booking.response_chunk(sse(1))  # the first token: prefill complete
        booking.unobserved()
        booking.unobserved()  # once
        assert unobserved == [booking]
        since = booking.unobserved_since
        assert since is not None
        booking.estimate_output(since + 0.05, 0.01)  # 1 + 5 tokens: one block of 4
        await booking.settled()
        [request] = active(slot_tracker)
        assert (request["output_blocks"], in_flight.get((1, 0)).decode_blocks) == (1, 3 + 1)
        booking.estimate_output(since + 60.0, 0.01)  # capped at max_tokens: 30 tokens, 7 blocks
        await booking.settled()
        [request] = active(slot_tracker)
        assert request["output_blocks"] == 7 and booking.estimated_tokens(since + 60.0, 0.01) == 30
        booking.end("complete")
        booking.estimate_output(since + 90.0, 0.01)  # after the end: nothing more
        await booking.settled()
        assert active(slot_tracker) == [] and ended == ["unseen-1"] and in_flight.total == 0

    asyncio.run(scenario())


@pytest.mark.process
def test_a_whole_answer_unseen_after_its_first_chunk_is_not_estimated(slot_tracker: str) -> None:
    """A JSON answer's first chunk comes when it is written: nothing grows after it."""
    async def scenario() -> None:
        unobserved: list[Booking] = []
        booking, _, _ = await booked(slot_tracker, "whole-1", unobserved=unobserved)
        booking.response_headers(200, {"content-type": "application/json"})
        booking.response_chunk(b'{"choices": [{"text": "')
        booking.unobserved()
        assert unobserved == []
        since = booking.unobserved_since
        assert since is not None
        booking.estimate_output(since + 10.0, 0.01)
        await booking.settled()
        [request] = active(slot_tracker)
        assert request["output_blocks"] == 0
        booking.end("complete")
        await booking.settled()
        assert active(slot_tracker) == []

    asyncio.run(scenario())


@pytest.mark.process
def test_an_unseen_answer_whose_end_was_lost_is_freed_and_an_ended_one_stays_ended(slot_tracker: str) -> None:
    async def scenario() -> None:
        unobserved: list[Booking] = []
        booking, in_flight, ended = await booked(slot_tracker, "lost-1", unobserved=unobserved)
        booking.response_headers(200, {"content-type": "text/event-stream"})
        booking.response_chunk(sse(1))
        booking.unobserved()
        since = booking.unobserved_since
        assert since is not None
        booking.estimate_output(since + 0.2, 0.01)  # no max_tokens: 21 tokens, 5 blocks
        await booking.settled()
        [request] = active(slot_tracker)
        assert request["output_blocks"] == 5 and request["new_isl_tokens"] == 0  # prefilled: counted
        booking.end("lost")  # the access log never reported it (AwaitingLog's silence)
        await booking.settled()
        assert active(slot_tracker) == [] and ended == ["lost-1"] and in_flight.total == 0
        assert booking.metrics.ends.labels("lost")._value.get() == 1
        # Once ended, neither a late hand-over nor an estimate books anything.
        booking.unobserved()
        booking.estimate_output(since + 10.0, 0.01)
        assert booking.output_blocks == 5 and unobserved == [booking]

    asyncio.run(scenario())


@pytest.mark.process
def test_without_response_headers_a_json_first_chunk_is_a_whole_answer_and_sse_a_stream(slot_tracker: str) -> None:
    """The access-log configuration shows the picker no response headers: the first chunk says
    whether the answer is whole (JSON, nothing grows after it) or streamed (estimated)."""
    async def scenario() -> None:
        unobserved: list[Booking] = []
        whole, _, _ = await booked(slot_tracker, "whole-2", unobserved=unobserved)
        whole.response_chunk(b'  {"id": "cmpl-1", "choices": [{"text": "')
        whole.unobserved()
        streamed, _, _ = await booked(slot_tracker, "stream-2", unobserved=unobserved)
        streamed.response_chunk(sse(1))
        streamed.unobserved()
        assert unobserved == [streamed] and whole.prefilled and streamed.prefilled
        since = streamed.unobserved_since
        assert since is not None
        assert (whole.estimated_tokens(since + 1.0, 0.01), streamed.estimated_tokens(since + 1.0, 0.01)) == (0, 101)
        whole.end("complete")
        streamed.end("complete")
        await asyncio.gather(whole.settled(), streamed.settled())
        assert active(slot_tracker) == []

    asyncio.run(scenario())
