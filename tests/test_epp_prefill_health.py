"""Which prefill endpoints the picker names (`dynamo_lite.epp.prefill_health`): down from the
first probe a real loopback server does not answer 200, up again from the first it does;
endpoints of other roles are never asked, and one that leaves the pool is forgotten."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_lite.epp.endpoint import PoolEndpoint
from dynamo_lite.epp.prefill_health import PrefillHealth

pytestmark = pytest.mark.unit


class HealthServer:
    """A loopback HTTP/1.1 server answering `GET /health` with `status` (a real socket)."""

    def __init__(self) -> None:
        self.status = 200
        self.asked = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.asked += 1
        writer.write(f"HTTP/1.1 {self.status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        writer.close()


def endpoint(port: int, worker_id: int, role: str) -> PoolEndpoint:
    return PoolEndpoint(address=f"127.0.0.1:{port}", worker_id=worker_id, model="m", block_size=16, role=role)


def test_a_prefill_endpoint_is_down_while_it_does_not_answer_200_and_up_again_after() -> None:
    async def scenario() -> None:
        prefill, decode = HealthServer(), HealthServer()
        await prefill.start()
        await decode.start()
        pool = [endpoint(prefill.port, 1, "prefill"), endpoint(decode.port, 2, "decode")]
        health = PrefillHealth(lambda: pool, interval=0.05, timeout=1.0)
        address = pool[0].address
        assert health.up(address)  # never probed: named as the pool says
        await health.probe_once()
        assert health.up(address) and prefill.asked == 1 and decode.asked == 0  # only prefill endpoints
        prefill.status = 503
        await health.probe_once()
        assert not health.up(address)
        prefill.status = 200
        await health.probe_once()
        assert health.up(address)
        await prefill.stop()  # nothing listens: connection refused
        await health.probe_once()
        assert not health.up(address)
        pool[:] = pool[1:]  # it left the pool: forgotten, up if it ever comes back
        await health.probe_once()
        assert health.down == set()
        await health.aclose()
        await decode.stop()

    asyncio.run(scenario())
