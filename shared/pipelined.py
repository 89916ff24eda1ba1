"""A lean HTTP/1.1 transport for the service clients: keep-alive connections, pipelined calls.

Why not httpx here: profiling the endpoint picker (bench/RESULTS.md, "Gateway") put 87 % of its
Python time in httpx, about 1 ms of CPU per call, and a picked request makes ten calls (two
reads at the pick, `/add`, `/prefill_complete`, `/output_blocks` as the answer grows, `/free`).
The services answer small JSON documents in request order on one connection, so a call here is
one `transport.write` of a prebuilt request, llhttp (httptools) parsing the answer in C, and one
future: tens of microseconds.

`PipelinedTransport.call` keeps `_Transport.call`'s contract (`dynamo_lite.client`): the decoded
JSON answer (None for an empty body), `ServiceStatusError` with the status and the service's
`{"error": ...}` message for a status >= 400, and a `TransportError` for no answer at all
(`ConnectError` when no connection opens, `CallTimeout` past the timeout). Plain `http://`
only; use the httpx transport for anything else.

Calls spread over up to `connections` connections, each carrying several pipelined requests;
a connection is opened when needed and reopened after it is lost. A call that was written to a
kept-alive connection which the service then closed without answering is sent once more on a
new connection (the service closes idle connections after its keep-alive time, and a call can
race that close); every route the clients call is safe to repeat (`/add` answers a repeat with
409, which the picker takes as done). A call that times out closes its connection: the answers
behind it on that connection could no longer be matched to their calls.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any
from urllib.parse import urlencode, urlsplit

import httptools
import orjson

from ._client_base import CallTimeout, ConnectError, TransportError, status_error

_JSON_HEADERS = b"content-type: application/json\r\n"


class _Pending:
    __slots__ = ("future", "request", "method", "path", "retried", "timer")

    def __init__(self, future: asyncio.Future[tuple[int, bytes]], request: bytes, method: str, path: str) -> None:
        self.future = future
        self.request = request
        self.method = method
        self.path = path
        self.retried = False
        self.timer: asyncio.TimerHandle | None = None


class _Connection(asyncio.Protocol):
    """One keep-alive connection; answers come back in the order the calls were written."""

    def __init__(self, owner: PipelinedTransport) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.pending: deque[_Pending] = deque()
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.closed = False

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail_all(f"unreadable answer: {exc}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.owner._forget(self)
        pending, self.pending = self.pending, deque()
        for call in pending:
            # Lost before its answer: most likely a kept-alive connection the service closed as
            # idle as the call went out, or a call pipelined behind one that timed out. Send it
            # once more, on another connection.
            if not call.future.done() and not call.retried:
                call.retried = True
                self.owner._resend(call)
            else:
                self._fail(call, f"connection lost: {exc or 'closed by the service'}")

    # --- httptools callbacks ----------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        body = b"".join(self.body)
        self.body = []
        if not self.pending:
            return  # an answer nobody asked for: dropped
        call = self.pending.popleft()
        if call.timer is not None:
            call.timer.cancel()
        if not call.future.done():
            call.future.set_result((status, body))
        if not self.parser.should_keep_alive():
            self.close()

    # --- calls ------------------------------------------------------------------------------

    def send(self, call: _Pending) -> None:
        assert self.transport is not None
        self.pending.append(call)
        self.transport.write(call.request)

    def timed_out(self, call: _Pending) -> None:
        if not call.future.done():
            self._fail(call, "timed out", CallTimeout)
            self.close()  # the answers behind it can no longer be matched

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _fail(self, call: _Pending, why: str, kind: type[TransportError] = TransportError) -> None:
        if call.timer is not None:
            call.timer.cancel()
        if not call.future.done():
            call.future.set_exception(kind(why, method=call.method, path=call.path))

    def _fail_all(self, why: str) -> None:
        pending, self.pending = self.pending, deque()
        for call in pending:
            self._fail(call, why)


class PipelinedTransport:
    """JSON calls to one service over a few pipelined keep-alive connections (module docstring)."""

    def __init__(self, base_url: str, timeout: float, *, connections: int = 4, api_key: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the pipelined transport takes http://host:port URLs, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.max_connections = max(1, connections)
        host_header = parts.netloc.encode()
        self._head_tail = b" HTTP/1.1\r\nhost: " + host_header + b"\r\n"
        if api_key:
            self._head_tail += b"authorization: Bearer " + api_key.encode() + b"\r\n"
        self._connections: list[_Connection] = []
        self._connecting: asyncio.Task[_Connection] | None = None
        self._closed = False

    async def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None) -> Any:
        target = self.prefix + path
        if params:
            target += "?" + urlencode(params)
        head = method.encode() + b" " + target.encode() + self._head_tail
        if body is None:
            request = head + b"content-length: 0\r\n\r\n" if method != "GET" else head + b"\r\n"
        else:
            content = orjson.dumps(body)
            request = head + _JSON_HEADERS + b"content-length: %d\r\n\r\n" % len(content) + content
        loop = asyncio.get_running_loop()
        call = _Pending(loop.create_future(), request, method, path)
        await self._send(call)
        status, answer = await call.future
        if status >= 400:
            raise status_error(status, answer, method, path)
        return orjson.loads(answer) if answer else None

    async def aclose(self) -> None:
        self._closed = True
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()

    # --- internals --------------------------------------------------------------------------

    async def _send(self, call: _Pending) -> None:
        connection = await self._connection(call)
        if connection is None:
            return
        loop = asyncio.get_running_loop()
        call.timer = loop.call_later(self.timeout, connection.timed_out, call)
        connection.send(call)

    def _resend(self, call: _Pending) -> None:
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        asyncio.get_running_loop().create_task(self._send(call))

    async def _connection(self, call: _Pending) -> _Connection | None:
        """The least busy open connection, or a new one while fewer than the maximum are open
        and every open one is busy. One connection opens at a time: calls that arrive meanwhile
        wait for it (or take a busy one) rather than opening one each."""
        if self._closed:
            call.future.set_exception(TransportError("the client is closed", method=call.method, path=call.path))
            return None
        best = min(self._connections, key=lambda c: len(c.pending), default=None)
        if best is not None and (not best.pending or len(self._connections) >= self.max_connections
                                 or self._connecting is not None):
            return best
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._open())
        connecting = self._connecting
        try:
            return await asyncio.wait_for(asyncio.shield(connecting), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            if best is not None:
                return best
            if not call.future.done():
                kind = CallTimeout if isinstance(exc, asyncio.TimeoutError) else ConnectError
                call.future.set_exception(kind(
                    f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}",
                    method=call.method, path=call.path))
            return None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        finally:
            self._connecting = None
        if self._closed:
            connection.close()
            raise OSError("the client is closed")
        self._connections.append(connection)
        return connection

    def _forget(self, connection: _Connection) -> None:
        if connection in self._connections:
            self._connections.remove(connection)


__all__ = ["PipelinedTransport"]
