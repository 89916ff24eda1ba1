"""Streamed answers (`http.StreamAnswer`) on the native server, byte by byte and through httpx:
chunked framing, request order with pipelined requests, keep-alive after a stream, a client that
hangs up (the generator is closed), a generator that fails (the body is cut short, the server
goes on), a client that does not read (the generator is held back), HEAD, HTTP/1.0, graceful
shutdown, request headers for `wants_headers` endpoints, and the same streams through the ASGI
entry point (Starlette's TestClient). Each test runs on asyncio's loop and on uvloop's."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvloop
from starlette.routing import Route
from starlette.testclient import TestClient
from support.raw_http import get

from dynamo_lite.web import http
from dynamo_lite.web.metrics import DISCONNECTED
from dynamo_lite.web.server import ConnectionLimits, HttpConnection, HttpServer

pytestmark = pytest.mark.unit

SSE = b"text/event-stream"


def chunk(index: int, size: int) -> bytes:
    """The `index`th chunk of a stream: told apart from the others, exactly `size` bytes (>= 8)."""
    label = b"%07d:" % index
    return label + bytes([97 + index % 26]) * (size - len(label))


class Track:
    """What one stream's generator did, for the test's thread to see."""

    def __init__(self) -> None:
        self.yielded = 0
        self.closed = threading.Event()  # the generator's `finally` ran
        self.generator: Any = None


class Probe:
    def __init__(self) -> None:
        self.tracks: dict[str, Track] = {}

    def track(self, tag: str) -> Track:
        return self.tracks.setdefault(tag, Track())


STREAM_PARAMETERS = frozenset({"n", "size", "delay", "fail", "empty", "later", "tag"})


class Chunks(http.DirectEndpoint):
    """`GET /stream?n=&size=`: `n` chunks (-1: for ever) of `size` bytes; `delay` seconds
    between them, an empty chunk before each with `empty`, a failure before chunk `fail`, the
    stream answered through a future after `later` seconds."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def respond(self, query_string: bytes, body: bytes) -> Any:
        query = http.QueryParams(query_string, STREAM_PARAMETERS)
        track = self.probe.track(query.get("tag", ""))
        fail = query.get("fail")
        track.generator = generator = self.chunks(
            track, int(query["n"]), int(query.get("size", 16)), float(query.get("delay", 0)),
            int(fail) if fail is not None else None, "empty" in query,
        )
        answer = http.StreamAnswer(200, SSE, generator, b"x-stream: yes\r\ncache-control: no-cache\r\n")
        later = query.get("later")
        if later is None:
            return answer
        return asyncio.ensure_future(self.after(float(later), answer))

    @staticmethod
    async def after(seconds: float, answer: http.StreamAnswer) -> http.StreamAnswer:
        await asyncio.sleep(seconds)
        return answer

    @staticmethod
    async def chunks(track: Track, n: int, size: int, delay: float, fail: int | None,
                     empty: bool) -> AsyncIterator[bytes]:
        try:
            index = 0
            while n < 0 or index < n:
                if index == fail:
                    raise RuntimeError("the engine failed")
                if empty:
                    yield b""
                track.yielded += 1
                yield chunk(index, size)
                index += 1
                if delay:
                    await asyncio.sleep(delay)
        finally:
            track.closed.set()


class Completions(http.HeadersEndpoint):
    """`POST /v1/completions` `{"n": 3}`: Server-Sent Events naming the request's x-request-id."""

    max_body = 4096

    def respond_with_headers(self, query_string: bytes, body: bytes, headers: http.Headers) -> http.StreamAnswer:
        request_id = (http.find_header(headers, b"x-request-id") or b"none").decode()
        count = orjson.loads(body)["n"]

        async def events() -> AsyncIterator[bytes]:
            for index in range(count):
                yield b"data: %s\n\n" % orjson.dumps({"id": request_id, "index": index})
            yield b"data: [DONE]\n\n"

        return http.StreamAnswer(200, SSE, events(), b"x-request-id: %s\r\n" % request_id.encode())


class EchoHeaders(http.HeadersEndpoint):
    """`GET /headers`: the request's headers as a JSON list of pairs."""

    def respond_with_headers(self, query_string: bytes, body: bytes, headers: http.Headers) -> http.Answer:
        return 200, orjson.dumps([[name.decode(), value.decode()] for name, value in headers]), b"application/json"


def make_app(probe: Probe) -> http.Service:
    return http.Service(routes=[
        Route("/stream", Chunks(probe), methods=["GET"]),
        Route("/v1/completions", Completions(), methods=["POST"]),
        Route("/headers", EchoHeaders(), methods=["GET"]),
        http.get("/now", lambda params: (200, {"now": True})),
        http.health_route(),
    ])


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop,
}


class StreamServer:
    """The native server with the streaming app, on its own event loop in a thread."""

    def __init__(self, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.probe = Probe()
        self.app = make_app(self.probe)
        self.loop = new_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.server = HttpServer(self.app, ConnectionLimits())
            self.listener = await self.loop.create_server(self.server, "127.0.0.1", 0)
            self.port = self.listener.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def shut_down(self, grace_secs: float) -> None:
        asyncio.run_coroutine_threadsafe(self.server.shut_down(grace_secs=grace_secs), self.loop).result(15)

    def recorded(self, path: str) -> dict[int, int]:
        """Requests recorded for `path`, by status."""
        series = self.app.request_metrics.routes.get(path, {})
        return {status: int(sum(counts[:-1])) for status, counts in list(series.items())}

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(params=sorted(LOOPS))
def server(request: pytest.FixtureRequest) -> Iterator[StreamServer]:
    running = StreamServer(LOOPS[request.param])
    yield running
    running.stop()


class Raw:
    """A raw client connection that reads heads, chunked and sized bodies, keeping what follows."""

    def __init__(self, server: StreamServer, receive_buffer: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", server.port))
        self.buffer = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise EOFError(bytes(self.buffer[:200]))
        self.buffer += data

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            self._fill()
        return self._take(end + 2)[:-2]

    def head(self) -> tuple[int, dict[bytes, bytes]]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        lines = self._take(self.buffer.index(b"\r\n\r\n") + 4)[:-4].split(b"\r\n")
        headers = {name.lower(): value for name, value in (line.split(b": ", 1) for line in lines[1:])}
        return int(lines[0].split(b" ")[1]), headers

    def chunk(self) -> bytes | None:
        """The next HTTP chunk's data; None for the last (empty) chunk."""
        size = int(self._line(), 16)
        if size == 0:
            assert self._line() == b""  # no trailers
            return None
        data = self._take(size + 2)
        assert data[-2:] == b"\r\n"
        return data[:-2]

    def chunks(self) -> tuple[list[bytes], bool]:
        """The chunks of a chunked body, and whether it ended with its last chunk (False: the
        connection closed before)."""
        chunks: list[bytes] = []
        try:
            while (data := self.chunk()) is not None:
                chunks.append(data)
        except EOFError:
            return chunks, False
        return chunks, True

    def answer(self) -> tuple[int, dict[bytes, bytes], bytes]:
        status, headers = self.head()
        return status, headers, self._take(int(headers[b"content-length"]))

    def rest(self) -> bytes:
        """Everything until the server closes the connection."""
        try:
            while True:
                self._fill()
        except EOFError:
            pass
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def closed(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            return not self.buffer and self.sock.recv(65536) == b""
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(10)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(server: StreamServer) -> Iterator[Raw]:
    connection = Raw(server)
    yield connection
    connection.close()


def wait_for(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def expected(n: int, size: int) -> list[bytes]:
    return [chunk(index, size) for index in range(n)]


# --- framing and order ----------------------------------------------------------------------


@pytest.mark.parametrize(("n", "size"), [(5, 16), (1, 200_000), (1000, 16), (3, 200_000)])
def test_chunks_arrive_in_order_and_intact_one_http_chunk_each(server: StreamServer, raw: Raw, n: int,
                                                               size: int) -> None:
    raw.send(get(f"/stream?n={n}&size={size}&empty=1"))  # the empty chunks are not sent
    status, headers = raw.head()
    assert status == 200
    assert headers[b"transfer-encoding"] == b"chunked" and b"content-length" not in headers
    assert headers[b"content-type"] == SSE
    assert (headers[b"x-stream"], headers[b"cache-control"]) == (b"yes", b"no-cache")
    assert b"date" in headers and b"connection" not in headers
    assert raw.chunks() == (expected(n, size), True)
    assert wait_for(lambda: server.recorded("/stream") == {200: 1})


def test_a_later_answer_may_be_a_stream(server: StreamServer, raw: Raw) -> None:
    raw.send(get("/stream?n=4&size=200000&later=0.05"))
    assert raw.head()[0] == 200
    assert raw.chunks() == (expected(4, 200_000), True)


def test_httpx_reads_the_streams(server: StreamServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for n, size in ((1000, 16), (2, 200_000)):
            with client.stream("GET", "/stream", params={"n": n, "size": size, "delay": 0.0005}) as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream"
                body = b"".join(response.iter_bytes())
            assert body == b"".join(expected(n, size))
        response = client.post("/v1/completions", json={"n": 3}, headers={"x-request-id": "req-7"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "req-7"
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        assert [orjson.loads(event) for event in events[:-1]] == [{"id": "req-7", "index": i} for i in range(3)]
        assert client.get("/now").json() == {"now": True}  # the same client goes on


def test_requests_pipelined_behind_a_stream_are_answered_after_it_in_order(server: StreamServer, raw: Raw) -> None:
    raw.send(get("/stream?n=5&size=32&delay=0.02") + get("/now") + get("/stream?n=3&size=16&later=0.05")
             + get("/health") + get("/stream?n=2&size=64"))
    assert raw.head()[0] == 200
    assert raw.chunks() == (expected(5, 32), True)
    assert raw.answer()[::2] == (200, b'{"now":true}')
    assert raw.head()[0] == 200
    assert raw.chunks() == (expected(3, 16), True)
    assert raw.answer()[::2] == (200, b"")
    assert raw.head()[0] == 200
    assert raw.chunks() == (expected(2, 64), True)
    assert not raw.closed(timeout=0.2)


def test_keep_alive_goes_on_after_a_stream(server: StreamServer, raw: Raw) -> None:
    for _ in range(3):
        raw.send(get("/stream?n=3&size=16&delay=0.01"))
        assert raw.head()[0] == 200
        assert raw.chunks() == (expected(3, 16), True)
        assert not raw.closed(timeout=0.1)
        raw.send(get("/now"))
        assert raw.answer()[::2] == (200, b'{"now":true}')
    assert wait_for(lambda: server.recorded("/stream") == {200: 3})


def test_connection_close_closes_after_the_stream(server: StreamServer, raw: Raw) -> None:
    raw.send(b"GET /stream?n=2&size=16 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    status, headers = raw.head()
    assert status == 200 and headers[b"connection"] == b"close"
    assert raw.chunks() == (expected(2, 16), True)
    assert raw.closed()


def test_http_1_0_gets_the_body_unframed_then_the_close(server: StreamServer, raw: Raw) -> None:
    raw.send(b"GET /stream?n=3&size=16 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    status, headers = raw.head()
    assert status == 200 and headers[b"connection"] == b"close" and b"transfer-encoding" not in headers
    assert raw.rest() == b"".join(expected(3, 16))


def test_head_gets_the_head_only_and_the_generator_is_closed(server: StreamServer, raw: Raw) -> None:
    track = server.probe.track("head")
    raw.send(get("/stream?n=3&size=16&tag=head", "HEAD") + get("/now"))
    status, headers = raw.head()
    assert status == 200 and headers[b"transfer-encoding"] == b"chunked"
    assert raw.answer()[::2] == (200, b'{"now":true}')  # right after the head
    assert track.yielded == 0
    assert wait_for(lambda: track.generator.ag_frame is None)  # closed, never started


# --- clients that leave, generators that fail, clients that do not read -----------------------


def test_a_client_that_hangs_up_mid_stream_closes_the_generator(server: StreamServer, raw: Raw) -> None:
    track = server.probe.track("gone")
    raw.send(get("/stream?n=-1&size=64&delay=0.01&tag=gone"))
    assert raw.head()[0] == 200
    assert [raw.chunk() for _ in range(3)] == expected(3, 64)
    raw.close()
    assert track.closed.wait(1.0)
    assert wait_for(lambda: server.recorded("/stream") == {DISCONNECTED: 1})
    assert wait_for(lambda: not server.server.connections)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/now").status_code == 200


def test_a_client_that_hangs_up_while_the_generator_is_held_back_closes_it(server: StreamServer) -> None:
    track = server.probe.track("held")
    slow = Raw(server, receive_buffer=64 * 1024)
    slow.send(get(f"/stream?n=-1&size={1 << 20}&tag=held"))
    assert wait_for(lambda: track.yielded > 0)
    time.sleep(0.3)  # the pump now waits for the client to read
    slow.close()
    assert track.closed.wait(1.0)


def test_a_failing_generator_cuts_the_body_short_and_the_server_goes_on(
    server: StreamServer, raw: Raw, caplog: pytest.LogCaptureFixture
) -> None:
    other = Raw(server)
    try:
        with caplog.at_level(logging.ERROR, logger="dynamo_lite.server"):
            raw.send(get("/stream?n=10&size=32&fail=3&tag=fail") + get("/now"))
            assert raw.head()[0] == 200
            chunks, complete = raw.chunks()
            assert (chunks, complete) == (expected(3, 32), False)  # no `0\r\n\r\n`, no answer to /now
            assert not raw.buffer
            assert server.probe.track("fail").closed.wait(1.0)
            assert wait_for(lambda: server.recorded("/stream") == {500: 1})
        assert any("failed" in record.getMessage() and record.exc_info for record in caplog.records)
        other.send(get("/now"))  # a connection open before
        assert other.answer()[::2] == (200, b'{"now":true}')
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                with client.stream("GET", "/stream", params={"n": 10, "size": 32, "fail": 2}) as response:
                    b"".join(response.iter_bytes())
            with client.stream("GET", "/stream", params={"n": 3, "size": 32}) as response:
                assert b"".join(response.iter_bytes()) == b"".join(expected(3, 32))
    finally:
        other.close()


def test_a_client_that_does_not_read_holds_the_generator_back(server: StreamServer) -> None:
    track = server.probe.track("slow")
    size, n = 1 << 20, 48
    slow = Raw(server, receive_buffer=64 * 1024)
    try:
        slow.send(get(f"/stream?n={n}&size={size}&tag=slow"))
        assert wait_for(lambda: track.yielded > 0)
        time.sleep(1.0)
        held = track.yielded
        # What the kernel's buffers take (the server's send buffer grows to a few MiB), the
        # transport's high-water mark and the chunk in hand: far from the whole stream.
        assert held <= 12, held
        time.sleep(0.3)
        assert track.yielded == held  # it waits, rather than creeping on
        assert slow.head()[0] == 200
        for index in range(n):
            assert slow.chunk() == chunk(index, size)
        assert slow.chunk() is None
        assert track.yielded == n
    finally:
        slow.close()


# --- shutdown ----------------------------------------------------------------------------------


def test_shutdown_lets_a_running_stream_finish_then_closes(server: StreamServer, raw: Raw) -> None:
    raw.send(get("/stream?n=10&size=16&delay=0.03"))
    assert raw.head()[0] == 200
    shutdown = threading.Thread(target=server.shut_down, args=(5.0,))
    shutdown.start()
    try:
        assert raw.chunks() == (expected(10, 16), True)
        assert raw.closed()
    finally:
        shutdown.join(10)
    assert not server.server.connections


def test_shutdown_past_its_grace_closes_the_stream(server: StreamServer, raw: Raw) -> None:
    track = server.probe.track("endless")
    raw.send(get("/stream?n=-1&size=16&delay=0.01&tag=endless"))
    assert raw.head()[0] == 200
    started = time.monotonic()
    server.shut_down(0.3)
    assert time.monotonic() - started < 3
    assert track.closed.is_set()  # shut_down waited for the generator to close
    assert raw.chunks()[1] is False


# --- request headers -------------------------------------------------------------------------


def test_request_headers_reach_an_endpoint_that_wants_them(server: StreamServer, raw: Raw) -> None:
    raw.send(b"GET /headers HTTP/1.1\r\nHost: t\r\nX-Request-Id: abc\r\nX-Dup: 1\r\nx-DUP: 2\r\n\r\n"
             b"GET /headers HTTP/1.1\r\nHost: u\r\n\r\n")
    assert orjson.loads(raw.answer()[2]) == [["host", "t"], ["x-request-id", "abc"], ["x-dup", "1"], ["x-dup", "2"]]
    assert orjson.loads(raw.answer()[2]) == [["host", "u"]]  # each request its own
    body = b'{"n": 2}'
    raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\nX-Request-Id: r-1\r\n\r\n%s" % (len(body), body))
    status, headers = raw.head()
    assert status == 200 and headers[b"x-request-id"] == b"r-1"
    assert raw.chunks() == ([b'data: {"id":"r-1","index":0}\n\n', b'data: {"id":"r-1","index":1}\n\n',
                             b"data: [DONE]\n\n"], True)


def test_only_apps_with_an_endpoint_wanting_headers_keep_them(server: StreamServer) -> None:
    assert server.server.protocol is not HttpConnection and issubclass(server.server.protocol, HttpConnection)

    async def plain_server() -> HttpServer:
        return HttpServer(http.Service(routes=[http.health_route()]), ConnectionLimits())

    plain = asyncio.run_coroutine_threadsafe(plain_server(), server.loop).result(5)
    server.loop.call_soon_threadsafe(plain._sweeper.cancel)
    assert plain.protocol is HttpConnection and type(plain()) is HttpConnection


# --- the ASGI entry point ----------------------------------------------------------------------


def test_the_asgi_entry_point_streams_too() -> None:
    probe = Probe()
    with TestClient(make_app(probe)) as client:
        with client.stream("GET", "/stream?n=1000&size=16") as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["x-stream"] == "yes"
            assert b"".join(response.iter_bytes()) == b"".join(expected(1000, 16))
        response = client.get("/stream?n=2&size=200000&later=0.01")
        assert response.content == b"".join(expected(2, 200_000))

        response = client.head("/stream?n=3&size=16&tag=head")
        assert (response.status_code, response.content) == (200, b"")
        assert probe.track("head").yielded == 0 and probe.track("head").generator.ag_frame is None

        response = client.post("/v1/completions", json={"n": 1}, headers={"x-request-id": "asgi"})
        assert response.text == 'data: {"id":"asgi","index":0}\n\ndata: [DONE]\n\n'
        assert response.headers["x-request-id"] == "asgi"
        assert ["x-request-id", "abc"] in client.get("/headers", headers={"x-request-id": "abc"}).json()

        track = probe.track("asgi-gone")
        with client.stream("GET", "/stream?n=-1&size=16&delay=0.01&tag=asgi-gone") as response:
            assert next(response.iter_bytes()).startswith(b"0000000:")
        assert track.closed.wait(1.0)

        with pytest.raises(RuntimeError, match="the engine failed"):
            client.get("/stream?n=5&size=16&fail=2")

        recorded = client.app.request_metrics.routes["/stream"]  # type: ignore[attr-defined]
        assert sum(recorded[200][:-1]) == 3


def test_the_asgi_path_closes_the_generator_when_send_fails() -> None:
    probe = Probe()
    app = make_app(probe)
    track = probe.track("send-fails")
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and len(sent) >= 3:
            raise ConnectionResetError("client gone")  # as ASGI servers do: an OSError
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/stream", "query_string": b"n=-1&size=16&tag=send-fails",
             "headers": []}
    asyncio.run(app(scope, receive, send))
    assert track.closed.is_set() and track.yielded == 3
    assert [message["type"] for message in sent] == ["http.response.start"] + ["http.response.body"] * 2
    assert all(message["more_body"] for message in sent[1:])
    assert sum(app.request_metrics.routes["/stream"][DISCONNECTED][:-1]) == 1
