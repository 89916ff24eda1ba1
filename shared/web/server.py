"""The services' HTTP/1.1 server: an asyncio protocol on httptools (llhttp) and uvloop that
calls a `Service`'s endpoints synchronously from its parser callbacks.

Why not an ASGI server: per request, uvicorn builds a scope and message dicts, starts a Task and
runs the app's coroutines, more than the whole time in which Dynamo answers a request
(bench/ANALYSIS.md, "Figures behind the code"). Here a request is parsed in C, routed with one
dict lookup, answered by the endpoint's `respond(query_string, body)`, all inside
`data_received`; pipelined requests are answered in order for the same reason (see "Writes"
below for when answers are written). The app stays an ASGI app too (`Service`), for the test
client and for embedding; both paths run the same endpoints.

What a server on a shared network needs, and what this one does:

* **Request head size.** llhttp sets no limit on the request line and headers. Past
  `MAX_REQUEST_HEAD` bytes the answer is a JSON 431 and the connection is closed. A read that
  holds a whole head (TLS delivers all it decrypted at once) is parsed in pieces, so that such
  a head is refused too, not served.
* **Request head time.** A head not complete within `header_timeout_secs` of its first byte (or
  of the connection, for a client that sends nothing) gets a JSON 408 and the connection is
  closed: clients that send half a head cannot hold file descriptors for good.
* **Bodies.** Content type (415) and declared size (413) are judged from the head, before any
  body byte is read or a `100 Continue` is sent; a body growing past the route's limit is a 413.
  After such an early answer the rest of the body is read and dropped, so the connection stays
  usable (it is closed instead when the client waits for `100 Continue`, as it sends no body).
* **Connections.** Beyond `max_connections` open connections, a new one gets a JSON 503 at
  once and is closed. Idle keep-alive connections close after `keep_alive_secs`. HTTP/1.0
  clients keep the connection when they ask (`Connection: keep-alive`).
* **Back-pressure.** A client that does not read its answers stops being read from.
* **Answers that wait.** An endpoint may answer with a future (a replica waiting for NATS to
  acknowledge a publish). The connection then stops reading, queues the answers of requests
  already parsed behind it, and writes them all in request order once it completes. An
  endpoint with `cancel_on_disconnect` (an engine's generation, a proxy) keeps its connection
  reading while its future waits alone in the queue, so that a client that hangs up is noticed
  (`connection_lost`) and the future cancelled; a request pipelined behind it stops the reading.
* **Streams.** An endpoint may answer with a `StreamAnswer` (Server-Sent Events), at once or as
  the result of such a future: only that path knows of streams. Its head goes out with
  `transfer-encoding: chunked`, then a task (`_pump`) writes each chunk its async generator
  yields as one HTTP chunk, and `0\r\n\r\n` at the end. Meanwhile the connection's queue stays
  blocked (answers of pipelined requests wait, in order) and reading paused; the connection
  then goes on as after any answer. The pump asks the generator for nothing more while the
  transport is paused (a client that does not read), so a stream holds at most one chunk
  over the transport's high-water mark. A client that hangs up cancels the pump, which
  closes the generator (its `finally` runs: how the producer learns to stop). A generator
  that raises is logged and its connection closed with the chunked body unfinished, which
  clients see as an error. HTTP/1.0 clients get the body unframed and the connection closed.
* **Request headers.** Only `on_header`'s few headers are kept per request, unless the app has
  an endpoint with `wants_headers`: its connections (`_HeadersConnection`) then keep every
  request's headers and call such endpoints' `respond_with_headers`.
* **Writes.** The first answer of a turn of the event loop is written at once; the answers
  of the other requests that turn handles are kept until the turn ends, then written with one
  `transport.write` per connection (`HttpServer.send_all`). Writing to a client whose process
  sleeps (waiting for its answer) wakes it; on a virtual machine that wake-up is an
  inter-processor interrupt that costs the writer several microseconds. Written in a burst,
  the answers find their clients awake: under `python -m bench`'s load, `/potential_loads`
  serves ~18 % more requests and the lifecycle mix ~10 % more (bench/ANALYSIS.md, "Figures
  behind the code"). A lone request (c=1) is written at once.
* **API keys.** With keys (`Service.protect`), connections are `_Keyed`: they keep each
  request's `Authorization` header, and a route that is not open answers a JSON 401/403 from
  the head (`dynamo_lite.web.auth`), its body read and dropped as after any early answer. Without
  keys no request runs any of it.
* **TLS.** With `tls` the listener speaks TLS (`dynamo_lite.web.tls`); the handshake must finish
  within the head timeout, and the connection cap counts connections once it has. Certificates
  and key files are read again on SIGHUP and on change (`dynamo_lite.web.reloading`).
* **Shutdown.** On SIGTERM/SIGINT the listener closes, idle connections close, requests in
  flight are answered and streams finish (up to `GRACEFUL_SHUTDOWN_SECS`, after which the
  connections left are aborted and their streams closed), then the app's lifespan shutdown runs
  (the indexer's final snapshot) and the process exits with status 0.

`ConnectionLimits` holds the settings and the counters, which `/metrics` reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from functools import partial
from http import HTTPStatus
from time import perf_counter, time
from typing import TYPE_CHECKING, Any, Final, NamedTuple, cast, final
from urllib.parse import unquote

import httptools
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .http import (
    NOT_ALLOWED_BODY,
    NOT_FOUND_BODY,
    Answer,
    DirectEndpoint,
    Headers,
    LaterAnswer,
    Service,
    StreamAnswer,
    allow_header,
    body_refusal,
    error_body,
    failure_answer,
    too_large,
)
from .logs import AccessLog
from .metrics import DISCONNECTED, RouteSeries
from .reloading import Reloadable, watch
from .tls import ReloadingContext

logger = logging.getLogger("dynamo_lite.server")

# nginx's default large_client_header_buffers allow 32 KiB; requests to these services carry a
# few short headers, so anything near this is hostile.
MAX_REQUEST_HEAD: Final = 64 * 1024
DEFAULT_HEADER_TIMEOUT_SECS: Final = 10.0
DEFAULT_KEEP_ALIVE_SECS: Final = 95.0
GRACEFUL_SHUTDOWN_SECS: Final = 10.0
SWEEP_INTERVAL_SECS: Final = 0.25  # timeouts fire this much late at most
BACKLOG: Final = 2048
STARTUP_FAILED_EXIT_STATUS: Final = 3

_STATUS_LINES: Final = {status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode("ascii")
                        for status in HTTPStatus}
_JSON: Final = b"application/json"
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE: Final = b"connection: close\r\n"
_KEEP_ALIVE: Final = b"connection: keep-alive\r\n"
_CHUNKED: Final = b"transfer-encoding: chunked\r\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"
# Reads larger than this that start in a request head are parsed this much at a time; a head
# is then refused within this many bytes past MAX_REQUEST_HEAD.
_HEAD_PIECE: Final = 16 * 1024
_STREAM_CLOSE_SECS: Final = 1.0  # after a shutdown's aborts, how long closing generators may take


def _closing_answer(status: int, message: str) -> bytes:
    body = error_body(message)
    return b"".join([
        _STATUS_LINES[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        _CLOSE,
        b"\r\n",
        body,
    ])


_TOO_LARGE: Final = _closing_answer(431, f"request line and headers exceed {MAX_REQUEST_HEAD} bytes")
_TOO_MANY: Final = _closing_answer(503, "too many open connections; try again, or reuse a connection")
_GARBAGE: Final = _closing_answer(400, "invalid HTTP request")


@dataclass
class ConnectionLimits:
    """The limits every connection of one server obeys, and what they did."""

    header_timeout_secs: float = DEFAULT_HEADER_TIMEOUT_SECS  # 0: no limit
    max_connections: int = 0  # 0: no limit
    keep_alive_secs: float = DEFAULT_KEEP_ALIVE_SECS
    open_connections: int = 0
    head_timeouts: int = 0  # connections closed with a 408
    refused_connections: int = 0  # connections closed with a 503 at once

    def timeout_answer(self) -> bytes:
        return _closing_answer(408, f"request head not complete within {self.header_timeout_secs:g} s")


class HttpServer:
    """What the connections of one listening socket share: the app, the limits, the date."""

    def __init__(self, app: Service, limits: ConnectionLimits, access_log: AccessLog | None = None) -> None:
        self.app = app
        self.limits = limits
        self.access_log = access_log
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        self.shutting_down = False
        self.unsent: list[HttpConnection] = []  # connections holding answers until `send_all`
        self.in_turn = False  # an answer was written in this turn of the loop: hold the others
        self.date_line = b""
        self._date_second = -1
        self.protocol = _connection_class(app)
        self._tick()

    def _tick(self) -> None:
        """Every `SWEEP_INTERVAL_SECS`: time out heads and idle connections, renew the Date.

        One sweep over the connections instead of a timer per request: two `call_later` and
        two `cancel` per request cost a tenth of a `/health` answer.
        """
        now = self.loop.time()
        header_timeout = self.limits.header_timeout_secs
        keep_alive = self.limits.keep_alive_secs
        for connection in list(self.connections):
            if connection.head_since is not None:
                if header_timeout > 0 and now - connection.head_since >= header_timeout:
                    connection.head_timed_out()
            elif connection.idle_since is not None and now - connection.idle_since >= keep_alive:
                connection.close()
        second = int(time())
        if second != self._date_second:
            self._date_second = second
            self.date_line = b"date: %s\r\n" % formatdate(second, usegmt=True).encode("ascii")
        self._sweeper = self.loop.call_later(SWEEP_INTERVAL_SECS, self._tick)

    def send_all(self) -> None:
        """Write what the connections answered during the loop's turn that just ended."""
        self.in_turn = False
        unsent = self.unsent
        if unsent:
            self.unsent = []
            for connection in unsent:
                connection.send_now()

    def __call__(self) -> HttpConnection:
        return self.protocol(self)

    async def shut_down(self, grace_secs: float = GRACEFUL_SHUTDOWN_SECS) -> None:
        """Close idle connections now and the others once their request is answered (or their
        stream has ended); abort those left after `grace_secs`."""
        self.shutting_down = True
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = self.loop.time() + grace_secs
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        streams = [connection.stream for connection in self.connections if connection.stream is not None]
        for connection in list(self.connections):
            connection.transport.abort()
        if streams:
            # Their `connection_lost` cancels them: give their generators' `finally` a moment.
            await asyncio.wait(streams, timeout=_STREAM_CLOSE_SECS)
        self._sweeper.cancel()


@final  # told from bytes in the queue with `type(x) is`, which mypy narrows both ways for a final class
class _Waiting(NamedTuple):
    """An answer still to come, with what its response head and its metrics need."""

    future: LaterAnswer
    keep_alive: bool
    http_1_0: bool
    method: str
    path: str
    started: float
    series: RouteSeries
    trace_id: bytes | None
    cancel_on_disconnect: bool = False


class HttpConnection(asyncio.Protocol):
    """One client connection. Per request: head (bounded in size and time), then the body
    (bounded by the route), then the endpoint's answer, written at once."""

    __slots__ = (
        "server", "limits", "transport", "parser", "client", "counted", "head_bytes", "reading_head",
        "head_since", "idle_since", "url", "content_type", "content_length", "expect", "trace_id",
        "keep_alive", "http_1_0", "method", "path", "query_string", "endpoint", "series", "body",
        "body_size", "answered", "started", "paused", "queue", "closing", "unsent", "stream", "drained",
        "authorization",
    )
    # Set by `_Keyed` connections, the only ones whose routes check it (`on_headers_complete`).
    authorization: bytes | None

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.client: str | None = None
        self.counted = False
        self.head_bytes = 0
        self.reading_head = True
        # Loop times at which the current head started and the connection fell idle (None: not
        # reading a head / not idle); `HttpServer._tick` closes the late ones.
        self.head_since: float | None = None
        self.idle_since: float | None = None
        self.paused = False
        # Answers written in request order behind one that waits (None: nothing waits), and
        # whether to close once they are written.
        self.queue: deque[bytes | _Waiting] | None = None
        self.closing = False
        self.unsent: bytes | None = None  # answers not yet written (see `send`)
        # The task writing a streamed answer (`_pump`), and the future it awaits while the
        # transport is paused, which `resume_writing` completes.
        self.stream: asyncio.Task[int] | None = None
        self.drained: asyncio.Future[None] | None = None
        self._reset_request()

    def _reset_request(self) -> None:
        self.url = b""
        self.content_type: bytes | None = None
        self.content_length: bytes | None = None
        self.expect: bytes | None = None
        self.trace_id: bytes | None = None
        self.endpoint: DirectEndpoint | None = None
        self.series: RouteSeries | None = None
        self.body: list[bytes] = []
        self.body_size = 0
        self.answered = False

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (`create_server`), which asyncio's protocol signature does not say.
        self.transport = cast(asyncio.Transport, transport)
        limits = self.limits
        if self.server.shutting_down or (limits.max_connections and limits.open_connections >= limits.max_connections):
            limits.refused_connections += 1
            self.transport.write(_TOO_MANY)
            self.transport.close()
            return
        limits.open_connections += 1
        self.counted = True
        self.server.connections.add(self)
        if self.server.access_log is not None:
            peer = transport.get_extra_info("peername")
            self.client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else None
        self.head_since = self.server.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.limits.open_connections -= 1
            self.counted = False
            self.server.connections.discard(self)
        if self.stream is not None:
            self.stream.cancel()  # closes the generator: the producer learns the client left
        if self.queue:
            for entry in self.queue:
                if type(entry) is _Waiting and entry.cancel_on_disconnect and not entry.future.done():
                    entry.future.cancel()  # the work behind it stops; `_write_ready` records it
        if self.series is not None and not self.answered:
            # Left before its body arrived: nobody to answer, but the route saw the request.
            self._record(DISCONNECTED)

    def data_received(self, data: bytes) -> None:
        if len(data) > _HEAD_PIECE and self.reading_head:
            self._received_in_pieces(data)
            return
        self.idle_since = None
        if self.reading_head:
            if self.head_since is None:
                self.head_since = self.server.loop.time()  # the first byte of the next request's head
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Answered as plain HTTP/1.1 (no 101); what follows is not HTTP any more.
            self.close()
            return
        except httptools.HttpParserError:
            if not self.transport.is_closing():
                self.send(_GARBAGE)
                self.close()
            return
        if self.transport.is_closing():
            return
        if self.reading_head:
            if self.head_bytes > MAX_REQUEST_HEAD:
                logger.warning("Request head over %d bytes from %s; closing.", MAX_REQUEST_HEAD, self.client or "a client")
                self.send(_TOO_LARGE)
                self.close()
            elif self.head_bytes == 0 and self.queue is None:
                self.idle_since = self.server.loop.time()

    def _received_in_pieces(self, data: bytes) -> None:
        """One read may hold a whole head larger than `MAX_REQUEST_HEAD` (TLS hands over all it
        decrypted at once; a fast client on a local socket too): fed in pieces while a head is
        read, so that the bound is checked as the head grows, not after it was served."""
        view = memoryview(data)
        start = 0
        while start < len(data):
            if not self.reading_head:
                self.data_received(bytes(view[start:]))  # a body: at once, as any read
                return
            self.data_received(bytes(view[start : start + _HEAD_PIECE]))
            start += _HEAD_PIECE
            if self.transport.is_closing():
                return

    def pause_writing(self) -> None:
        self.paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        drained = self.drained
        if drained is not None:
            self.drained = None
            if not drained.done():
                drained.set_result(None)
        if not self.transport.is_closing() and self.queue is None:
            self.transport.resume_reading()

    # --- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        # A head that follows a pipelined request in the same read starts its clock here; on
        # its own it would not until its next byte arrived, and the client could hold the
        # connection with half a head until the keep-alive timeout.
        if self.head_since is None:
            self.head_since = self.server.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name == b"content-length":
            self.content_length = value
        elif name == b"expect":
            self.expect = value
        elif self.server.access_log is not None and name == self.server.access_log.trace_id_header:
            self.trace_id = value

    def on_headers_complete(self) -> None:
        self.reading_head = False
        self.head_bytes = 0
        self.head_since = None
        self.started = perf_counter()
        parser = self.parser
        self.keep_alive = parser.should_keep_alive() and not self.server.shutting_down
        self.http_1_0 = parser.get_http_version() == "1.0"
        self.method = method = parser.get_method().decode("ascii")
        url = self.url
        if url[:1] == b"/":
            raw_path, _, self.query_string = url.partition(b"?")
        else:  # absolute form, as a proxy would send
            parsed = httptools.parse_url(url)
            raw_path, self.query_string = parsed.path or b"/", parsed.query or b""
        sent = raw_path.decode("latin-1")
        self.path = path = unquote(sent) if "%" in sent else sent
        route = self.server.app.endpoint(path, method, sent if path is not sent else None)
        if route is None:
            self.series = self.server.app.unmatched_route
            self._answer_early(404, NOT_FOUND_BODY, _JSON)
            return
        methods, endpoint, self.series, access = route
        if method not in methods:
            self._answer_early(405, NOT_ALLOWED_BODY, _JSON, b"allow: %s\r\n" % allow_header(methods))
            return
        if access:  # API keys configured (only then is a route not OPEN): a `_KeyedConnection`
            api_keys = self.server.app.api_keys
            if TYPE_CHECKING:  # a route that is not OPEN means keys are configured
                assert api_keys is not None
            denied = api_keys.check(self.authorization, access)
            if denied is not None:
                self._answer_early(denied.status, denied.body, _JSON, denied.header)
                return
        self.endpoint = endpoint
        if endpoint.max_body:
            refusal = body_refusal(self.content_type, self.content_length, endpoint.max_body, endpoint.optional_body)
            if refusal is not None:
                self._answer_early(*failure_answer(refusal))
                return
            if self.expect is not None and self.expect.lower() == b"100-continue":
                self.send(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self.answered:
            return  # the rest of a refused body
        endpoint = self.endpoint
        if endpoint is not None and not endpoint.max_body:
            return  # a route without a body (GET) ignores one sent anyway, as Dynamo 1.6.1 does
        self.body_size += len(body)
        if endpoint is not None and self.body_size > endpoint.max_body:
            self._answer_early(*failure_answer(too_large(endpoint.max_body)))
            self.body = []
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.answered:
            body = self.body
            payload = body[0] if len(body) == 1 else b"".join(body)
            endpoint = self.endpoint
            if TYPE_CHECKING:  # a request not answered early found its route
                assert endpoint is not None
            answer = endpoint.answer(self.query_string, payload)
            if type(answer) is tuple:
                self._answer(*answer)
            else:
                if TYPE_CHECKING:  # mypy narrows `type(x) is C` the other way for a final C only
                    assert not isinstance(answer, tuple)
                self._answer_later(answer)
        self._reset_request()
        self.reading_head = True
        if not self.keep_alive:
            self._close_after_answers()

    # --- answers --------------------------------------------------------------------------

    def _answer_early(self, status: int, body: bytes, content_type: bytes | None, extra: bytes = b"") -> None:
        """Answer before the body is read; a client waiting for `100 Continue` sends none, so
        its connection cannot carry another request."""
        waiting_for_continue = self.expect is not None and self.expect.lower() == b"100-continue"
        if waiting_for_continue:
            self.keep_alive = False
        self._answer(status, body, content_type, extra)
        if waiting_for_continue:
            self._close_after_answers()

    def _answer(self, status: int, body: bytes, content_type: bytes | None, extra: bytes = b"") -> None:
        self.answered = True
        data = self._response(status, body, content_type, extra, self.keep_alive, self.http_1_0, self.method)
        if self.queue is not None:
            self.queue.append(data)
            self.transport.pause_reading()  # behind an answer that waits (reading, if it watches)
        elif not self.transport.is_closing():
            self.send(data)
        self._record(status)

    def _response(self, status: int, body: bytes, content_type: bytes | None, extra: bytes, keep_alive: bool,
                  http_1_0: bool, method: str) -> bytes:
        if keep_alive:
            connection = _KEEP_ALIVE if http_1_0 else b""
        else:
            connection = _CLOSE
        head = b"%s%s%s%s%s%s\r\n" % (
            _STATUS_LINES[status],
            b"content-length: %d\r\n" % len(body) if status != 204 else b"",
            b"content-type: %s\r\n" % content_type if content_type is not None else b"",
            self.server.date_line,
            connection,
            extra,
        )
        return head if method == "HEAD" else head + body

    def _record(self, status: int) -> None:
        series = self.series
        if TYPE_CHECKING:  # set by the route lookup, before any answer (`connection_lost` checks)
            assert series is not None
        self._record_request(status, self.started, series, self.method, self.path, self.trace_id)

    def _record_request(self, status: int, started: float, series: RouteSeries, method: str, path: str,
                        trace_id: bytes | None) -> None:
        seconds = perf_counter() - started
        series.record(status, seconds)
        access_log = self.server.access_log
        if access_log is not None:
            access_log(self.client, method, path, status, seconds, trace_id)

    # --- answers that wait ------------------------------------------------------------------

    def _answer_later(self, future: LaterAnswer | StreamAnswer) -> None:
        """Queue this request's answer until `future` completes; stop reading meanwhile, so a
        pipelining client cannot pile up requests behind it. A `StreamAnswer` given at once is
        queued as a future already done."""
        self.answered = True
        watch = False
        if type(future) is StreamAnswer:
            ready: LaterAnswer = self.server.loop.create_future()
            ready.set_result(future)
            future = ready
        else:
            endpoint = self.endpoint
            watch = endpoint is not None and endpoint.cancel_on_disconnect
        if self.queue is None:
            self.queue = deque()
            self.idle_since = None
            if not watch:
                self.transport.pause_reading()
        else:
            self.transport.pause_reading()  # pipelined behind an answer that waits (reading, if it watches)
        series = self.series
        if TYPE_CHECKING:  # set by the route lookup, before any answer
            assert series is not None
        self.queue.append(_Waiting(future, self.keep_alive, self.http_1_0, self.method, self.path, self.started,
                                   series, self.trace_id, watch))
        future.add_done_callback(self._write_ready)

    def _write_ready(self, _: object = None) -> None:
        """Write the queued answers up to the first one still waiting (or streaming), in
        request order."""
        queue = self.queue
        if queue is None or self.stream is not None:
            return
        closed = self.transport.is_closing()
        while queue:
            entry = queue[0]
            if type(entry) is not _Waiting:
                data = entry
            else:
                if not entry.future.done():
                    return
                if entry.future.cancelled():  # the client hung up (`cancel_on_disconnect`)
                    queue.popleft()
                    self._record_request(DISCONNECTED, entry.started, entry.series, entry.method, entry.path,
                                         entry.trace_id)
                    continue
                answer: Answer | StreamAnswer = entry.future.result()
                if type(answer) is StreamAnswer:
                    queue.popleft()
                    self._stream(answer, entry, closed)
                    return
                status, body, content_type = answer
                data = self._response(status, body, content_type, b"", entry.keep_alive, entry.http_1_0,
                                      entry.method)
                self._record_request(status if not closed else DISCONNECTED, entry.started, entry.series,
                                     entry.method, entry.path, entry.trace_id)
            queue.popleft()
            if not closed:
                self.send(data)
        self.queue = None
        if self.closing:
            self.close()
        elif not closed:
            if self.reading_head and self.head_bytes == 0:
                self.idle_since = self.server.loop.time()
            if not self.paused:
                self.transport.resume_reading()

    def _close_after_answers(self) -> None:
        if self.queue is None:
            self.close()
        else:
            self.closing = True

    # --- streams ----------------------------------------------------------------------------

    def _stream(self, answer: StreamAnswer, entry: _Waiting, closed: bool) -> None:
        """Write the head of a streamed answer now and its body from a task (`_pump`); the
        queue stays blocked, and reading paused, until the task ends (`_stream_ended`)."""
        status = answer.status
        bodiless = status == 204 or status == 304
        # HTTP/1.0 knows no chunked encoding: the body runs until the connection closes.
        keep_alive = entry.keep_alive and not entry.http_1_0
        if not closed:
            self.send(b"%s%s%s%s%s%s\r\n" % (
                _STATUS_LINES[status],
                _CHUNKED if not entry.http_1_0 and not bodiless else b"",
                b"content-type: %s\r\n" % answer.content_type if answer.content_type is not None else b"",
                self.server.date_line,
                b"" if keep_alive else _CLOSE,
                answer.headers,
            ))
        write = not closed and not bodiless and entry.method != "HEAD"
        pump = self._pump(answer.chunks, entry, status if not closed else DISCONNECTED, write, not entry.http_1_0)
        self.stream = stream = self.server.loop.create_task(pump)
        stream.add_done_callback(partial(self._stream_ended, entry, keep_alive))

    async def _pump(self, chunks: AsyncIterator[bytes], entry: _Waiting, status: int, write: bool,
                    chunked: bool) -> int:
        """Write what `chunks` yields (when `write`), then close it; the status to record:
        `status`, or `DISCONNECTED` when the client left, or 500 when the generator failed."""
        transport = self.transport
        try:
            if write:
                self.send_now()  # the head, if held until the end of the turn
                if self.paused:
                    await self._drained()
                async for chunk in chunks:
                    if not chunk:
                        continue
                    if transport.is_closing():
                        return DISCONNECTED
                    transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if self.paused:
                        await self._drained()
                if transport.is_closing():
                    return DISCONNECTED
                if chunked:
                    transport.write(_LAST_CHUNK)
        except Exception:
            logger.exception("The stream answering %s %s failed; closing its connection.", entry.method, entry.path)
            self.close()  # the chunked body stays unfinished: the client sees the failure
            return 500
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    logger.exception("Closing the stream answering %s %s failed.", entry.method, entry.path)
        return status

    def _drained(self) -> asyncio.Future[None]:
        """A future `resume_writing` completes: the client does not keep up, so the pump asks
        the generator for nothing more until it has read."""
        self.drained = drained = self.server.loop.create_future()
        return drained

    def _stream_ended(self, entry: _Waiting, keep_alive: bool, stream: asyncio.Task[int]) -> None:
        """Record the streamed request, then go on with the queue (or close)."""
        self.stream = None
        self.drained = None
        status = DISCONNECTED if stream.cancelled() else stream.result()
        self._record_request(status, entry.started, entry.series, entry.method, entry.path, entry.trace_id)
        if not keep_alive:
            self.close()
        self._write_ready()

    # --- shutdown, timeouts, closing ---------------------------------------------------------

    def close_when_idle(self) -> None:
        """Shutdown: close now unless a request is under way, which closes after its answer."""
        if self.reading_head and self.head_bytes == 0:
            self._close_after_answers()
        else:
            self.keep_alive = False

    def send(self, data: bytes) -> None:
        """Write `data`: at once if it is the first answer of this turn of the loop, else at
        the end of the turn (`HttpServer.send_all`), after what this connection sent before;
        `close` writes what is held first."""
        server = self.server
        if not server.in_turn:
            server.in_turn = True
            server.loop.call_soon(server.send_all)
            self.transport.write(data)
            return
        unsent = self.unsent
        if unsent is None:
            self.unsent = data
            server.unsent.append(self)
        else:
            self.unsent = unsent + data  # pipelined answers: one write for all

    def send_now(self) -> None:
        unsent = self.unsent
        if unsent is not None:
            self.unsent = None
            if not self.transport.is_closing():
                self.transport.write(unsent)

    def close(self) -> None:
        self.send_now()
        if not self.transport.is_closing():
            self.transport.close()

    def head_timed_out(self) -> None:
        self.head_since = None
        if not self.reading_head or self.transport.is_closing():
            return
        if self.paused or self.queue is not None:
            self.head_since = self.server.loop.time()  # still writing the previous answer: wait for it
            return
        self.limits.head_timeouts += 1
        self.send(self.limits.timeout_answer())
        self.close()


class _HeadersConnection(HttpConnection):
    """A connection of an app with an endpoint that `wants_headers`: it keeps every request's
    headers and calls those endpoints' `respond_with_headers`. A class of its own, so that the
    connections of other apps do no more per request than before."""

    __slots__ = ("headers",)

    def _reset_request(self) -> None:
        HttpConnection._reset_request(self)
        self.headers: Headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        HttpConnection.on_header(self, name, value)
        self.headers.append((name.lower(), value))

    def on_message_complete(self) -> None:
        endpoint = self.endpoint
        if not self.answered and endpoint is not None and endpoint.wants_headers:
            body = self.body
            payload = body[0] if len(body) == 1 else b"".join(body)
            answer = endpoint.answer_with_headers(self.query_string, payload, self.headers)
            if type(answer) is tuple:
                self._answer(*answer)
            else:
                if TYPE_CHECKING:  # mypy narrows `type(x) is C` the other way for a final C only
                    assert not isinstance(answer, tuple)
                self._answer_later(answer)
        HttpConnection.on_message_complete(self)  # answered above: only resets and closes


class _Keyed(HttpConnection):
    """With API keys (`Service.protect`): also keeps each request's `Authorization` header,
    which `on_headers_complete` hands to `ApiKeys.check`. A class of its own, so that without
    keys no request pays for it."""

    __slots__ = ()

    def _reset_request(self) -> None:
        HttpConnection._reset_request(self)
        self.authorization: bytes | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 13 and name.lower() == b"authorization":
            self.authorization = value
        else:
            HttpConnection.on_header(self, name, value)  # not super(): a tenth of a microsecond a header


class _KeyedHeadersConnection(_Keyed, _HeadersConnection):
    """`_Keyed` for an app whose endpoints read headers: they see `Authorization` too."""

    __slots__ = ()

    def _reset_request(self) -> None:
        _HeadersConnection._reset_request(self)
        self.authorization = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 13 and name.lower() == b"authorization":
            self.authorization = value
        _HeadersConnection.on_header(self, name, value)


def _connection_class(app: Service) -> type[HttpConnection]:
    if app.api_keys is None:
        return _HeadersConnection if app.wants_headers else HttpConnection
    return _KeyedHeadersConnection if app.wants_headers else _Keyed


class ConnectionCollector(Collector):
    """`/metrics` view of a server's `ConnectionLimits`."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits

    def collect(self) -> Iterator[Metric]:
        limits = self.limits
        yield GaugeMetricFamily("dynamo_lite_http_open_connections", "client connections open now",
                                limits.open_connections)
        yield GaugeMetricFamily("dynamo_lite_http_max_connections",
                                "the --max-connections limit (0: none)", limits.max_connections)
        yield CounterMetricFamily(
            "dynamo_lite_http_header_timeouts",
            "connections closed with a 408: a request head not complete within --header-timeout-secs",
            limits.head_timeouts,
        )
        yield CounterMetricFamily(
            "dynamo_lite_http_refused_connections",
            "connections answered 503 and closed at once: --max-connections were open",
            limits.refused_connections,
        )


class StartupFailed(Exception):
    """The app could not start: its lifespan's start-up raised, or the port cannot be bound."""


async def serve_app(
    app: Service, host: str, port: int, limits: ConnectionLimits, access_log: AccessLog | None = None,
    tls: ReloadingContext | None = None, reloadables: Sequence[Reloadable] = (),
) -> None:
    """Start the app (its lifespan's start-up), listen until SIGINT/SIGTERM, drain, shut down.
    With `tls`, connections are TLS (see `dynamo_lite.web.tls`). `tls` and `reloadables` (API key
    files) are read again on SIGHUP and when their files change (`dynamo_lite.web.reloading`)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    lifespan = app.router.lifespan_context(app)
    try:
        await lifespan.__aenter__()
    except Exception as exc:
        raise StartupFailed("start-up failed") from exc
    try:
        server = HttpServer(app, limits, access_log)
        try:
            if tls is None:
                listener = await loop.create_server(server, host, port, backlog=BACKLOG)
            else:
                # A handshake is part of the head: bounded by the same timeout.
                listener = await loop.create_server(server, host, port, backlog=BACKLOG, ssl=tls.listener,
                                                    ssl_handshake_timeout=limits.header_timeout_secs or None)
        except OSError as exc:
            # An expected failure (a port in use, an address not on this host): one line, no traceback.
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartupFailed(f"cannot listen on {host}:{port}: {reason}") from None
        watched = [*reloadables, *([tls] if tls is not None else [])]
        watcher = loop.create_task(watch(watched)) if watched else None
        logger.info("listening on %s://%s:%d%s", "https" if tls else "http", host if ":" not in host else f"[{host}]",
                    port, " (client certificates required)" if tls and tls.files.ca_certs else "")
        await stop.wait()
        logger.info("shutting down: answering the requests in flight")
        listener.close()
        if watcher is not None:
            watcher.cancel()
        await server.shut_down()
    except BaseException:
        if not await lifespan.__aexit__(*sys.exc_info()):
            raise
    else:
        await lifespan.__aexit__(None, None, None)
    logger.info("stopped")


def run(app: Service, host: str, port: int, limits: ConnectionLimits, access_log: AccessLog | None = None,
        tls: ReloadingContext | None = None, reloadables: Sequence[Reloadable] = ()) -> None:
    """`serve_app` on uvloop (the asyncio loop where uvloop is missing). A start-up failure (a
    bad snapshot, a port in use) is logged and ends the process with status 3, as uvicorn's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency wherever it builds
        new_loop = asyncio.new_event_loop
    else:
        new_loop = uvloop.new_event_loop
    if sys.version_info >= (3, 11):
        runner = asyncio.Runner(loop_factory=new_loop)
    else:
        runner = _runner(new_loop)
    with runner:
        try:
            runner.run(serve_app(app, host, port, limits, access_log, tls, reloadables))
        except StartupFailed as exc:
            logger.error("%s", exc, exc_info=exc.__cause__)
            raise SystemExit(STARTUP_FAILED_EXIT_STATUS) from None


class _runner:
    """`asyncio.Runner` for Python 3.10."""

    def __init__(self, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.loop = new_loop()

    def __enter__(self) -> _runner:
        asyncio.set_event_loop(self.loop)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self.loop.run_until_complete(coroutine)


__all__ = [
    "DEFAULT_HEADER_TIMEOUT_SECS",
    "DEFAULT_KEEP_ALIVE_SECS",
    "MAX_REQUEST_HEAD",
    "ConnectionCollector",
    "ConnectionLimits",
    "HttpServer",
    "StartupFailed",
    "run",
    "serve_app",
]
