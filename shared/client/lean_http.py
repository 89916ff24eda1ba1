"""A lean HTTP/1.1 transport for the async service clients: a pool of keep-alive connections,
one call in flight on each.

Why not httpx here: profiling the endpoint picker (bench/RESULTS.md, "Gateway") put 87 % of its
Python time in httpx, about 1 ms of CPU per call, and a picked request makes ten calls (two
reads at the pick, `/add`, `/prefill_complete`, `/output_blocks` as the answer grows, `/free`).
A call here is one `transport.write` of a prebuilt request, llhttp (httptools) parsing the answer
in C, and one future: tens of microseconds.

`LeanTransport.call` keeps the other transports' contract (`dynamo_lite.client`): the route's
result, decoded by its `answer`, `ServiceStatusError` with the status and the service's
`{"error": ...}` message for a status >= 400, and a `TransportError` for no answer at all
(`ConnectError` when no connection opens, `CallTimeout` past the timeout, `InvalidAnswer` for an
answer that does not read or is larger than `max_answer_bytes`). Plain `http://` only; use the
httpx transport for anything else.

**One call per connection.** A call takes an idle connection, or opens one while fewer than
`connections` are open, or waits for the first to come free; its timeout counts from the moment
it was made, the wait included. An answer that never comes fails that call alone: its
connection is closed (a late answer could not be told from the next call's), and the next
waiting call gets a new one. No call ever waits behind another's answer.

**Lost connections.** A connection the service closes before answering fails its call with a
`TransportError`, unless the call is safe to repeat: a `GET`, or a route whose repeat changes
nothing (`IDEMPOTENT`: the reads, `/free`, `/output_blocks` with its absolute count,
`/prefill_complete`); those are sent once more on another connection. `/add`, `/register` and
the other writes are not: the caller decides (the picker's booking retries `/add` and takes the
409 of a repeat as done). Idle connections older than `max_idle_secs` are closed rather than
reused, so a call seldom races the service closing an idle connection.

Every task the transport starts (connecting, a resend) is kept until it ends, and cancelled by
`aclose`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Final
from urllib.parse import urlencode, urlsplit

import httptools
import orjson

from ._client_base import Answer, CallTimeout, ConnectError, InvalidAnswer, TransportError, decode_answer, status_error

_JSON_HEADERS = b"content-type: application/json\r\n"
DEFAULT_CONNECTIONS: Final = 16
DEFAULT_MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024
DEFAULT_MAX_IDLE_SECS: Final = 30.0  # well under the services' 95 s keep-alive
IDEMPOTENT: Final = frozenset({
    "/query", "/query_by_hash", "/potential_loads", "/overlap_scores", "/free", "/output_blocks",
    "/prefill_complete",
})
"""POST routes a repeat of which changes nothing: sent again after a lost connection."""


class _Call:
    __slots__ = ("future", "request", "method", "path", "idempotent", "resent", "connection", "waiter", "timer",
                 "deadline")

    def __init__(self, future: asyncio.Future[tuple[int, bytes]], request: bytes, method: str, path: str) -> None:
        self.future = future
        self.request = request
        self.method = method
        self.path = path
        self.idempotent = method == "GET" or path in IDEMPOTENT
        self.resent = False
        self.connection: _Connection | None = None  # where it is in flight
        self.waiter: asyncio.Future[_Connection] | None = None  # while it waits for a connection
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one call at a time."""

    def __init__(self, owner: LeanTransport) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.call: _Call | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.size = 0
        self.closed = False
        self.counted = False  # holds one of the pool's slots (released when it closes)
        self.idle_since = 0.0

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        call = self.call
        if call is None:
            self.close()  # bytes nobody asked for: this connection can no longer be trusted
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(InvalidAnswer(f"unreadable answer: {exc}", method=call.method, path=call.path))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        call, self.call = self.call, None
        self.owner._lost(self, call, exc)

    # --- httptools callbacks ------------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        call = self.call
        if call is not None and self.size > self.owner.max_answer_bytes:
            self._fail(InvalidAnswer(f"answer larger than {self.owner.max_answer_bytes} bytes",
                                     method=call.method, path=call.path))
            self.close()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        call, self.call = self.call, None
        body = b"".join(self.body)
        self.body = []
        self.size = 0
        if call is None:
            return
        if not call.future.done():
            call.future.set_result((self.parser.get_status_code(), body))
        if self.parser.should_keep_alive():
            self.owner._release(self)
        else:
            self.close()

    # --- calls --------------------------------------------------------------------------------

    def send(self, call: _Call) -> None:
        assert self.transport is not None
        self.call = call
        call.connection = self
        self.transport.write(call.request)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _fail(self, error: TransportError) -> None:
        call, self.call = self.call, None
        if call is not None and not call.future.done():
            call.future.set_exception(error)


class LeanTransport:
    """JSON calls to one service over a pool of keep-alive connections (module docstring)."""

    def __init__(self, base_url: str, timeout: float, *, connections: int = DEFAULT_CONNECTIONS,
                 api_key: str | None = None, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
                 max_idle_secs: float = DEFAULT_MAX_IDLE_SECS) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the lean transport takes http://host:port URLs, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.max_connections = max(1, connections)
        self.max_answer_bytes = max_answer_bytes
        self.max_idle_secs = max_idle_secs
        host_header = parts.netloc.encode()
        self._head_tail = b" HTTP/1.1\r\nhost: " + host_header + b"\r\n"
        if api_key:
            self._head_tail += b"authorization: Bearer " + api_key.encode() + b"\r\n"
        self._idle: list[_Connection] = []
        self._connections: set[_Connection] = set()
        self._slots = 0  # connections open or opening
        self._waiting: deque[_Call] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections open or being opened."""
        return self._slots

    @property
    def waiting_calls(self) -> int:
        """Calls waiting for a connection."""
        return sum(1 for call in self._waiting if call.waiter is not None and not call.waiter.done())

    async def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                   answer: Answer | None = None) -> Any:
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
        call = _Call(loop.create_future(), request, method, path)
        call.deadline = loop.time() + self.timeout
        call.timer = loop.call_at(call.deadline, self._expire, call)
        try:
            status, content = await self._exchange(call)
        finally:
            call.timer.cancel()
        if status >= 400:
            raise status_error(status, content, method, path)
        return decode_answer(answer, content, method, path)

    async def aclose(self) -> None:
        """Close every connection and fail the calls still waiting or in flight."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for call in list(self._waiting):
            if call.waiter is not None and not call.waiter.done():
                call.waiter.set_exception(TransportError("the client is closed", method=call.method, path=call.path))
        self._waiting.clear()
        for connection in list(self._connections):
            connection.close()
        self._idle.clear()

    # --- internals ----------------------------------------------------------------------------

    async def _exchange(self, call: _Call) -> tuple[int, bytes]:
        try:
            while True:
                connection = await self._acquire(call)
                if call.future.done():  # expired while the connection was being opened
                    self._release(connection)
                    return call.future.result()  # raises its CallTimeout
                connection.send(call)
                try:
                    return await call.future
                except _Resend:
                    call.future = asyncio.get_running_loop().create_future()
                    call.connection = None
        except asyncio.CancelledError:
            self._abandon(call)  # the caller gave up: its connection cannot be reused
            raise

    async def _acquire(self, call: _Call) -> _Connection:
        if self._closed:
            raise TransportError("the client is closed", method=call.method, path=call.path)
        now = asyncio.get_running_loop().time()
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.max_idle_secs:
                return connection
            connection.close()  # stale: its slot comes back through connection_lost
        if self._slots < self.max_connections:
            self._slots += 1
            try:
                return await self._open(max(0.0, call.deadline - now))
            except (OSError, asyncio.TimeoutError) as exc:
                self._slots -= 1
                self._wake_opener()
                raise ConnectError(f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}",
                                   method=call.method, path=call.path) from None
            except BaseException:
                self._slots -= 1
                self._wake_opener()
                raise
        call.waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(call)
        try:
            return await call.waiter
        finally:
            call.waiter = None

    async def _open(self, timeout: float) -> _Connection:
        """A new connection, in the pool's count (the caller holds a slot for it)."""
        opening = asyncio.get_running_loop().create_connection(lambda: _Connection(self), self.host, self.port)
        _, connection = await asyncio.wait_for(opening, timeout)
        if self._closed:
            connection.close()
            raise OSError("the client is closed")
        connection.counted = True
        self._connections.add(connection)
        return connection

    def _release(self, connection: _Connection) -> None:
        """A connection free for the next call: to the first caller still waiting, or idle."""
        if self._closed or connection.closed:
            connection.close()
            return
        waiting = self._waiting
        while waiting:
            waiter = waiting.popleft().waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(connection)
                return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.append(connection)

    def _expire(self, call: _Call) -> None:
        """The call's time is up, wherever it is: waiting, connecting, or in flight."""
        error = CallTimeout(f"no answer within {self.timeout:g} s", method=call.method, path=call.path)
        if call.waiter is not None and not call.waiter.done():
            call.waiter.set_exception(error)
        self._abandon(call)
        if not call.future.done():
            call.future.set_exception(error)

    def _abandon(self, call: _Call) -> None:
        connection = call.connection
        if connection is not None and connection.call is call:
            # A late answer could not be told from the next call's: the connection goes.
            connection.call = None
            connection.close()

    def _lost(self, connection: _Connection, call: _Call | None, exc: Exception | None) -> None:
        """A connection closed (by either side): its slot frees, and the call in flight on it, if
        any, is sent again once when that is safe, else fails."""
        if connection.counted:
            connection.counted = False
            self._slots -= 1
        self._connections.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)
        if call is not None and not call.future.done():
            if call.idempotent and not call.resent and not self._closed:
                call.resent = True
                call.future.set_exception(_Resend())
            else:
                why = "not safe to repeat" if not call.idempotent else "lost again"
                call.future.set_exception(TransportError(
                    f"connection lost before the answer ({exc or 'closed by the service'}); not sent again: "
                    f"{why}", method=call.method, path=call.path))
        self._wake_opener()

    def _wake_opener(self) -> None:
        """A slot came free while calls wait: open a connection for the first of them."""
        if self._closed or self._slots >= self.max_connections:
            return
        if not any(call.waiter is not None and not call.waiter.done() for call in self._waiting):
            return
        self._slots += 1
        task = asyncio.get_running_loop().create_task(self._open_for_waiter())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_for_waiter(self) -> None:
        try:
            connection = await self._open(self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            self._slots -= 1
            while self._waiting:  # the first waiting call learns why
                call = self._waiting.popleft()
                if call.waiter is not None and not call.waiter.done():
                    call.waiter.set_exception(ConnectError(
                        f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}",
                        method=call.method, path=call.path))
                    break
            self._wake_opener()
            return
        self._release(connection)


class _Resend(Exception):
    """Internal: the connection was lost under a call safe to repeat; send it again."""


__all__ = ["DEFAULT_CONNECTIONS", "IDEMPOTENT", "LeanTransport"]
