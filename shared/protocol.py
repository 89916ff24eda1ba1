"""uvicorn's httptools protocol with a bound on the size of a request head.

httptools (llhttp) sets no limit on the request line and headers: uvicorn keeps every byte of
an unfinished head in memory, so one client streaming an endless header line grows the
process by as much as it sends (200 MB sent, 280 MB more RSS). This protocol counts the bytes
that arrive while a head is incomplete and, past `MAX_REQUEST_HEAD`, answers 431 in the
services' JSON error shape and closes the connection. Bodies are bounded by the routes
themselves (413).
"""

from __future__ import annotations

from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .http import error_body

# nginx's default large_client_header_buffers allow 32 KiB; requests to these services carry a
# few short headers, so anything near this is hostile.
MAX_REQUEST_HEAD: Final = 64 * 1024

_TOO_LARGE_BODY: Final = error_body(f"request line and headers exceed {MAX_REQUEST_HEAD} bytes")
_TOO_LARGE: Final = b"".join(
    [
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(_TOO_LARGE_BODY)).encode("ascii") + b"\r\n",
        b"connection: close\r\n",
        b"\r\n",
        _TOO_LARGE_BODY,
    ]
)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` that refuses request heads larger than `MAX_REQUEST_HEAD` bytes.

    The count starts when a head starts (a new connection, or the end of the previous
    request's body) and covers every byte received until the head is complete, so it is
    exact for one request per connection and at most one read short for pipelined ones.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > MAX_REQUEST_HEAD and not self.transport.is_closing():
            self.logger.warning("Request head over %d bytes from %s; closing.", MAX_REQUEST_HEAD, self.client)
            self.transport.write(_TOO_LARGE)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading_head = True
        super().on_message_complete()


__all__ = ["MAX_REQUEST_HEAD", "BoundedHttpToolsProtocol"]
