"""Raw HTTP/1.1 over a socket to a running service: a Connection, and one-request get/post byte strings."""

from __future__ import annotations

import socket


class Connection:
    """A raw client connection that reads answers one at a time, keeping what follows."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the server; unread: {self.buffer!r}")
        self.buffer += chunk

    def answer(self, head_only: bool = False) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {name.lower(): value for name, value in (line.split(b": ", 1) for line in lines[1:])}
        length = 0 if head_only else int(headers.get(b"content-length", b"0"))
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split(b" ")[1]), headers, body

    def closed(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(65536) == b""
        except ConnectionError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def post(path: str, body: bytes, content_type: str = "application/json", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()
