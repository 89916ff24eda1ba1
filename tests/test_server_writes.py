"""The native server writes the first answer of a turn of its event loop at once and holds the
others until the turn ends, then writes each connection's in one `transport.write` (see
`dynamo_lite.web.server`, "Writes"), without changing what clients receive: pipelined answers in
order, an answer before the close that follows it, and the 408 of a head left unfinished behind
a pipelined request (whose clock once started only at the head's next byte)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.raw_http import Connection, get, post
from support.server_thread import ServerThread

from dynamo_lite.web import http
from dynamo_lite.web.server import ConnectionLimits, HttpConnection, HttpServer

pytestmark = pytest.mark.unit


class CountingTransport:
    """The connection's real transport, with its writes recorded."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(data)
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CountingServer(HttpServer):
    """An `HttpServer` whose connections record their writes in `writes`, one list each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[list[bytes]] = []

    def __call__(self) -> HttpConnection:
        writes: list[bytes] = []
        self.writes.append(writes)
        server = self

        class Counting(HttpConnection):
            __slots__ = ()

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(CountingTransport(transport, writes))  # type: ignore[arg-type]

        return Counting(server)


def echo_app() -> http.Service:
    def echo(body: Any) -> http.HandlerResult:
        return 200, {"echo": body["echo"]}

    return http.Service(routes=[http.post("/echo", echo), http.health_route()])


class CountingServerThread(ServerThread):
    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        super().__init__()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.server = CountingServer(echo_app(), self.limits)
            self.listener = await self.loop.create_server(self.server, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self.listener.sockets[0].getsockname()[1]}"
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()


@pytest.fixture
def server() -> Iterator[CountingServerThread]:
    running = CountingServerThread(ConnectionLimits(header_timeout_secs=0.3))
    yield running
    running.stop()


def test_pipelined_answers_go_out_in_order_the_first_at_once_the_rest_in_one_write(
    server: CountingServerThread,
) -> None:
    connection = Connection(server.url)
    try:
        # One send, so the server reads all four requests in one turn of its loop.
        connection.send(b"".join(post("/echo", b'{"echo": %d}' % n) for n in range(3)) + get("/health"))
        assert [connection.answer()[2] for _ in range(4)] == [
            b'{"echo":0}', b'{"echo":1}', b'{"echo":2}', b""
        ]
        writes = server.server.writes[-1]
        assert [write.count(b"HTTP/1.1 200 OK") for write in writes] == [1, 3]
        assert writes[0].endswith(b'{"echo":0}')
    finally:
        connection.close()


def test_an_answer_is_written_before_the_close_that_follows_it(server: CountingServerThread) -> None:
    connection = Connection(server.url)
    try:
        connection.send(post("/echo", b'{"echo": 7}', extra="Connection: close\r\n"))
        status, headers, body = connection.answer()
        assert (status, headers[b"connection"], body) == (200, b"close", b'{"echo":7}')
        assert connection.closed()
    finally:
        connection.close()


def test_a_head_timed_out_after_an_answer_gets_its_408_after_that_answer(server: CountingServerThread) -> None:
    connection = Connection(server.url)
    try:
        # A whole request, then half a head: the 408 comes once the timeout passes, after the 200.
        connection.send(post("/echo", b'{"echo": 1}') + b"GET /health HTTP/1.1\r\nHo")
        assert connection.answer()[::2] == (200, b'{"echo":1}')
        started = time.monotonic()
        status, _, body = connection.answer()
        assert status == 408 and b"error" in body and time.monotonic() - started < 5
        assert connection.closed()
    finally:
        connection.close()
