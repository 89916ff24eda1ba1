"""The lean transport (`dynamo_lite.client.lean_http`) the endpoint picker calls the services with: the
same answers and errors as the httpx transport; one stalled answer fails only its own call; a
lifecycle call is never applied twice after a lost connection; answers that do not read, are
cut short, carry extra fields or are too large come out as `ServiceCallError`s and nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
from support.reference_server import free_port, running_service

from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    CallTimeout,
    ConnectError,
    InvalidAnswer,
    ServiceCallError,
    ServiceStatusError,
    TransportError,
)
from dynamo_lite.client.lean_http import LeanTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n%s" % (len(body), body)


@pytest.fixture(scope="module")
def slot_tracker() -> Iterator[str]:
    with running_service("slot_tracker") as url:
        yield url


@pytest.mark.process
def test_same_answers_and_errors_as_httpx(slot_tracker: str) -> None:
    async def scenario() -> None:
        for lean in (False, True):
            client = AsyncSlotTrackerClient(slot_tracker, lean=lean)
            if not lean:
                await client.register(1, "m", block_size=16, dp_start=0, dp_size=2)
            await client.add("m", f"r-{lean}", 1, 1, [5, 6], 20)
            loads = await client.loads("m")
            assert {(load.dp_rank, load.active_prefill_tokens) for load in loads} >= {(1, 20)}
            with pytest.raises(ServiceStatusError) as missing:
                await client.add("m", "x", 99, 0, [1], 1)
            assert missing.value.status == 404 and "worker" in missing.value.message.lower()
            with pytest.raises(ServiceStatusError) as bad:
                await client._transport.call("POST", "/add", {"model_name": 3})
            assert bad.value.status in (400, 422) and bad.value.path == "/add"
            await client.free("m", f"r-{lean}")
            await client.aclose()

    asyncio.run(scenario())


@pytest.mark.process
def test_many_concurrent_calls_share_a_bounded_pool(slot_tracker: str) -> None:
    async def scenario() -> None:
        client = AsyncSlotTrackerClient(slot_tracker, lean=True)
        ids = [f"c{i}" for i in range(300)]
        await asyncio.gather(*(client.add("m", rid, 1, 0, [i], i) for i, rid in enumerate(ids)))
        transport = client._transport
        assert isinstance(transport, LeanTransport) and transport.open_connections <= transport.max_connections
        loads = {load.dp_rank: load for load in await client.loads("m")}
        assert loads[0].active_prefill_tokens >= sum(range(300))
        await asyncio.gather(*(client.free("m", rid) for rid in ids))
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.unit
def test_no_service_is_a_connect_error() -> None:
    async def scenario() -> None:
        transport = LeanTransport(f"http://127.0.0.1:{free_port()}", timeout=2)
        with pytest.raises(ConnectError) as refused:
            await transport.call("GET", "/loads")
        assert refused.value.status == 0 and "connect" in refused.value.message

    asyncio.run(scenario())


async def _serve(handler: Handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@pytest.mark.unit
def test_one_stalled_answer_fails_only_its_own_call() -> None:
    """Twenty concurrent calls, one of which the service answers after the timeout: only that one
    times out, whichever connection the others were given."""

    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    request = await _read_request(reader)
                    if b"/stall" in request:
                        await asyncio.sleep(0.6)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n[]")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server, url = await _serve(handler)
        for connections in (4, 16):  # the old pipelined transport's default, and the new one's
            transport = LeanTransport(url, timeout=0.5, connections=connections)
            calls = [transport.call("GET", "/stall" if i == 0 else f"/fine/{i}") for i in range(20)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(outcomes[0], CallTimeout), outcomes[0]
            assert all(outcome is None for outcome in outcomes[1:]), outcomes
            assert await transport.call("GET", "/after") is None  # the pool recovers
            await transport.aclose()
        server.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_a_lifecycle_call_is_never_applied_twice_after_a_lost_connection() -> None:
    """The service applies the call, then the connection drops before the answer: an `/add` (not
    safe to repeat) fails with a TransportError and is not sent again; a `/free` (safe) is sent
    again and succeeds."""

    async def scenario() -> None:
        applied: list[bytes] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await _read_request(reader)
            path = request.split(b" ", 2)[1]
            applied.append(path)
            if applied.count(path) == 1:
                writer.close()  # applied, then gone before the answer
                return
            writer.write(OK_EMPTY)
            await writer.drain()
            writer.close()

        server, url = await _serve(handler)
        transport = LeanTransport(url, timeout=2)
        with pytest.raises(TransportError, match="not safe to repeat"):
            await transport.call("POST", "/add", {"request_id": "r"})
        assert await transport.call("POST", "/free", {"request_id": "r"}) is None
        assert applied == [b"/add", b"/free", b"/free"]
        await transport.aclose()
        server.close()

    asyncio.run(scenario())


ANSWERS = {
    "not json": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
    "cut short": b"HTTP/1.1 200 OK\r\ncontent-length: 40\r\n\r\n[{\"worker_id\": 1",
    "another shape": b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\n{\"rows\": [1]}",
    "missing field": b"HTTP/1.1 200 OK\r\ncontent-length: 17\r\n\r\n[{\"worker_id\": 1}]",
    "not http": b"SMTP ready\r\n\r\n",
}
EXTRA_FIELD = (b'[{"worker_id": 1, "dp_rank": 0, "potential_prefill_tokens": 0, "potential_decode_blocks": 2, '
               b'"active_requests": 0, "a_field_of_the_next_release": {"x": 1}}]')


@pytest.mark.unit
@pytest.mark.parametrize("lean", [True, False])
def test_answers_that_do_not_read_are_service_call_errors_and_extra_fields_are_ignored(lean: bool) -> None:
    async def scenario() -> None:
        kind: dict[str, bytes] = {}

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await _read_request(reader)
                    writer.write(kind["answer"])
                    await writer.drain()
                    if kind.get("close"):
                        writer.close()
                        return
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server, url = await _serve(handler)
        for name, answer in ANSWERS.items():
            kind.update(answer=answer, close=True)
            client = AsyncSlotTrackerClient(url, lean=lean, timeout=2)
            with pytest.raises(ServiceCallError) as failure:
                await client.potential_loads("m", [1, 2])
            assert isinstance(failure.value, TransportError), (name, failure.value)
            if name in ("not json", "another shape", "missing field"):
                assert isinstance(failure.value, InvalidAnswer), (name, failure.value)
            await client.aclose()
        kind.update(answer=ok(EXTRA_FIELD), close=False)
        client = AsyncSlotTrackerClient(url, lean=lean, timeout=2)
        (row,) = await client.potential_loads("m", [1, 2])
        assert (row.worker_id, row.potential_decode_blocks) == (1, 2)
        await client.aclose()
        indexer = AsyncIndexerClient(url, lean=lean, timeout=2)
        kind.update(answer=ok(b'{"scores": {"7": {"0": 32}}, "new_thing": true}'))
        assert (await indexer.query_by_hash("m", [1])).scores == {(7, 0): 32}
        kind.update(answer=ok(b'{"scores": {"seven": {"0": 32}}}'))
        with pytest.raises(InvalidAnswer):
            await indexer.query_by_hash("m", [1])
        await indexer.aclose()
        server.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_an_answer_larger_than_the_limit_is_refused() -> None:
    async def scenario() -> None:
        big = b"[" + b"0," * 600_000 + b"0]"

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big))
            await writer.drain()
            writer.close()

        server, url = await _serve(handler)
        transport = LeanTransport(url, timeout=2, max_answer_bytes=1_000_000)
        with pytest.raises(InvalidAnswer, match="larger than 1000000 bytes"):
            await transport.call("GET", "/dump")
        await transport.aclose()
        server.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_an_idle_connection_closed_by_the_service_is_replaced() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(OK_EMPTY)  # keep-alive announced, then closed: a service's idle timeout
            await writer.drain()
            writer.close()

        server, url = await _serve(handler)
        transport = LeanTransport(url, timeout=2)
        for _ in range(3):
            assert await transport.call("POST", "/free", {}) is None
            await asyncio.sleep(0.05)
        assert await transport.call("POST", "/add", {}) is None  # on a fresh connection, once
        await transport.aclose()
        server.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_close_fails_waiting_calls_and_leaves_no_task() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)

        server, url = await _serve(handler)
        transport = LeanTransport(url, timeout=5, connections=1)
        calls = [asyncio.ensure_future(transport.call("GET", f"/{i}")) for i in range(3)]
        await asyncio.sleep(0.1)
        await transport.aclose()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(outcome, TransportError) for outcome in outcomes), outcomes
        assert not transport._tasks
        server.close()

    asyncio.run(scenario())
