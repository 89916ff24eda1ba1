"""The pipelined transport (`dynamo_lite.pipelined`) the endpoint picker calls the services with:
the same answers and errors as the httpx transport, concurrency over pipelined connections, and
what it does when a connection is closed under it or an answer never comes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from support.reference_server import free_port, running_service

from dynamo_lite.client import AsyncSlotTrackerClient, CallTimeout, ConnectError, ServiceCallError, ServiceStatusError
from dynamo_lite.pipelined import PipelinedTransport


@pytest.fixture(scope="module")
def slot_tracker() -> Iterator[str]:
    with running_service("slot_tracker") as url:
        yield url


def test_same_answers_and_errors_as_httpx(slot_tracker: str) -> None:
    async def scenario() -> None:
        for pipelined in (False, True):
            client = AsyncSlotTrackerClient(slot_tracker, pipelined=pipelined)
            await client.register(1, "m", block_size=16, dp_start=0, dp_size=2) if not pipelined else None
            await client.add("m", f"r-{pipelined}", 1, 1, [5, 6], 20)
            loads = await client.loads("m")
            assert {(load.dp_rank, load.active_prefill_tokens) for load in loads} >= {(1, 20)}
            with pytest.raises(ServiceCallError) as missing:
                await client.add("m", "x", 99, 0, [1], 1)
            assert missing.value.status == 404 and "worker" in missing.value.message.lower()
            assert isinstance(missing.value, ServiceStatusError)
            with pytest.raises(ServiceCallError) as bad:
                await client._transport.call("POST", "/add", {"model_name": 3})
            assert bad.value.status in (400, 422) and bad.value.path == "/add"
            await client.free("m", f"r-{pipelined}")
            await client.aclose()

    asyncio.run(scenario())


def test_many_concurrent_calls_pipeline_in_order(slot_tracker: str) -> None:
    async def scenario() -> None:
        client = AsyncSlotTrackerClient(slot_tracker, pipelined=True)
        ids = [f"c{i}" for i in range(300)]
        await asyncio.gather(*(client.add("m", rid, 1, 0, [i], i) for i, rid in enumerate(ids)))
        assert len(client._transport._connections) <= 4
        loads = {load.dp_rank: load for load in await client.loads("m")}
        assert loads[0].active_prefill_tokens >= sum(range(300))
        await asyncio.gather(*(client.free("m", rid) for rid in ids))
        await client.aclose()

    asyncio.run(scenario())


def test_no_service_is_status_0() -> None:
    async def scenario() -> None:
        transport = PipelinedTransport(f"http://127.0.0.1:{free_port()}", timeout=2)
        with pytest.raises(ServiceCallError) as refused:
            await transport.call("GET", "/loads")
        assert refused.value.status == 0 and "connect" in refused.value.message
        assert isinstance(refused.value, ConnectError)

    asyncio.run(scenario())


async def _server(handler) -> tuple[asyncio.AbstractServer, int]:  # type: ignore[no-untyped-def]
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_an_idle_connection_closed_by_the_service_is_retried_on_a_new_one() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n[]"

    async def scenario() -> None:
        served = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal served
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                served += 1
                if served == 2:
                    break  # the second request dies with its connection, unanswered
                writer.write(answer)
                await writer.drain()
            writer.close()

        server, port = await _server(handler)
        transport = PipelinedTransport(f"http://127.0.0.1:{port}", timeout=2)
        assert await transport.call("GET", "/loads") == []
        assert await transport.call("GET", "/loads") == []  # sent again after the close
        assert served == 3
        await transport.aclose()
        server.close()

    asyncio.run(scenario())


def test_an_answer_that_never_comes_times_out_as_status_0() -> None:
    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()

        server, port = await _server(handler)
        transport = PipelinedTransport(f"http://127.0.0.1:{port}", timeout=0.2)
        with pytest.raises(ServiceCallError) as slow:
            await transport.call("POST", "/free", {"request_id": "x"})
        assert slow.value.status == 0 and "timed out" in slow.value.message
        assert isinstance(slow.value, CallTimeout)
        await transport.aclose()
        server.close()

    asyncio.run(scenario())


def test_only_plain_http() -> None:
    with pytest.raises(ValueError):
        PipelinedTransport("https://example.invalid", timeout=1)

