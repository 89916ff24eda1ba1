"""uvicorn's httptools protocol with the limits an operator needs on a shared network.

* **Request head size.** httptools (llhttp) sets no limit on the request line and headers:
  uvicorn keeps every byte of an unfinished head in memory, so one client streaming an endless
  header line grows the process by as much as it sends (200 MB sent, 280 MB more RSS). Past
  `MAX_REQUEST_HEAD` bytes the answer is a JSON 431 and the connection is closed.
* **Request head time.** uvicorn waits for an unfinished head forever (so did Dynamo 1.6.1): a
  few thousand clients that connect and send half a head, or nothing, hold as many file
  descriptors for good. A head not complete within `header_timeout_secs` of its first byte (or
  of the connection, for a client that sends nothing) gets a JSON 408 and the connection is
  closed. Idle keep-alive connections between requests are uvicorn's `timeout_keep_alive`.
* **Connections.** Beyond `max_connections` open connections, a new one gets a JSON 503 at
  once and is closed, instead of queueing in the kernel or exhausting file descriptors.
* **HTTP/1.0 keep-alive.** uvicorn closes every HTTP/1.0 connection after one answer; a client
  that asks for keep-alive (`Connection: keep-alive`) keeps it, and the answer says so.

`ConnectionLimits` holds the settings and the counters, which `/metrics` reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .http import error_body

# nginx's default large_client_header_buffers allow 32 KiB; requests to these services carry a
# few short headers, so anything near this is hostile.
MAX_REQUEST_HEAD: Final = 64 * 1024
DEFAULT_HEADER_TIMEOUT_SECS: Final = 10.0


def _closing_answer(status_line: bytes, message: str) -> bytes:
    body = error_body(message)
    return b"".join([
        status_line, b"\r\n",
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
        b"connection: close\r\n",
        b"\r\n",
        body,
    ])


_TOO_LARGE: Final = _closing_answer(b"HTTP/1.1 431 Request Header Fields Too Large",
                                    f"request line and headers exceed {MAX_REQUEST_HEAD} bytes")
_TOO_MANY: Final = _closing_answer(b"HTTP/1.1 503 Service Unavailable",
                                   "too many open connections; try again, or reuse a connection")


@dataclass
class ConnectionLimits:
    """The limits every connection of one server obeys, and what they did."""

    header_timeout_secs: float = DEFAULT_HEADER_TIMEOUT_SECS  # 0: no limit
    max_connections: int = 0  # 0: no limit
    open_connections: int = 0
    head_timeouts: int = 0  # connections closed with a 408
    refused_connections: int = 0  # connections closed with a 503 at once

    def timeout_answer(self) -> bytes:
        return _closing_answer(b"HTTP/1.1 408 Request Timeout",
                               f"request head not complete within {self.header_timeout_secs:g} s")


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with the limits of `limits` (see the module's docstring); `serve`
    uses `with_limits` to give each server its own.

    The head size is counted from when a head starts (a new connection, or the end of the
    previous request's body) over every byte received until the head is complete: exact for one
    request per connection, at most one read short for pipelined ones. The head timer starts
    with the connection and again with the first byte after a finished request.
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[BoundedHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        if limits.max_connections and limits.open_connections >= limits.max_connections:
            limits.refused_connections += 1
            transport.write(_TOO_MANY)
            transport.close()
            return
        limits.open_connections += 1
        self._counted = True
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._counted:
            self.limits.open_connections -= 1
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            if self._head_timer is None:
                self._start_head_timer()  # the first byte of the next request's head
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > MAX_REQUEST_HEAD and not self.transport.is_closing():
            self.logger.warning("Request head over %d bytes from %s; closing.", MAX_REQUEST_HEAD, self.client)
            self.transport.write(_TOO_LARGE)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        self._stop_head_timer()
        super().on_headers_complete()
        cycle = self.cycle
        # uvicorn ends every HTTP/1.0 exchange; keep the connection when the client asks.
        if cycle is not None and self.parser.get_http_version() == "1.0" and self.parser.should_keep_alive():
            cycle.keep_alive = True
            cycle.default_headers = [*cycle.default_headers, (b"connection", b"keep-alive")]

    def on_message_complete(self) -> None:
        self._reading_head = True
        super().on_message_complete()

    def _start_head_timer(self) -> None:
        timeout = self.limits.header_timeout_secs
        if timeout > 0 and self._head_timer is None:
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._reading_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._start_head_timer()  # still answering the previous request: wait for it
            return
        self.limits.head_timeouts += 1
        self.transport.write(self.limits.timeout_answer())
        self.transport.close()


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


__all__ = ["MAX_REQUEST_HEAD", "BoundedHttpToolsProtocol", "ConnectionCollector", "ConnectionLimits"]
