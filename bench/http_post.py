"""A minimal HTTP/1.1 keep-alive client for the ingest benchmark, cheap enough per request
that the server, not the client, sets the pace (httpx costs ~10x more per request).

Requests are complete byte strings built before the clock starts; responses are read by
Content-Length (both our server and the stub send it).
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    pass


def post_request(url: str, path: str, body: bytes) -> bytes:
    host = urlsplit(url).netloc
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


class Connection:
    def __init__(self, url: str, timeout: float = 60.0) -> None:
        parts = urlsplit(url)
        self._sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""

    def send(self, request: bytes) -> tuple[int, bytes]:
        """Send one prepared request; the response's status and body."""
        self._sock.sendall(request)
        while b"\r\n\r\n" not in self._buffer:
            self._fill()
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self._buffer) < length:
            self._fill()
        body, self._buffer = self._buffer[:length], self._buffer[length:]
        return status, body

    def _fill(self) -> None:
        chunk = self._sock.recv(1 << 20)
        if not chunk:
            raise HttpError("the server closed the connection")
        self._buffer += chunk

    def close(self) -> None:
        self._sock.close()
