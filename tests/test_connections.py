"""Connection limits against real service processes: request-head timeouts, the connection cap,
keep-alive between requests, HTTP/1.0 keep-alive, and their counters in /metrics."""

from __future__ import annotations

import re
import resource
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from support.reference_server import running_service

pytestmark = pytest.mark.process

SLOW_CLIENTS = 500


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def read_answer(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one answer with a content-length."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), head, body


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    with running_service("slot_tracker", "--header-timeout-secs", "1", "--keep-alive-secs", "2",
                         "--max-connections", "900") as url:
        yield str(url)


def test_slow_heads_are_closed_with_408_while_others_are_served(service: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < SLOW_CLIENTS + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, SLOW_CLIENTS + 400), hard))
    with httpx.Client(base_url=service) as client:
        idle = [client.get("/health").elapsed.total_seconds() for _ in range(50)]
    slow = [socket.create_connection(_address(service)) for _ in range(SLOW_CLIENTS)]
    started = time.monotonic()
    try:
        for index, sock in enumerate(slow):  # half send part of a head, half nothing at all
            if index % 2:
                sock.sendall(b"POST /add HTTP/1.1\r\nHost: test\r\nContent-Le")
        busy: list[float] = []
        with httpx.Client(base_url=service) as client:
            while time.monotonic() - started < 0.8:  # before the slow ones time out
                busy.append(client.get("/health").elapsed.total_seconds())
        answers: list[int] = []

        def collect(sock: socket.socket) -> None:
            status, head, body = read_answer(sock, timeout=5)
            assert b"connection: close" in head and b"request head not complete within 1 s" in body
            answers.append(status)

        threads = [threading.Thread(target=collect, args=(sock,)) for sock in slow]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        waited = time.monotonic() - started
    finally:
        for sock in slow:
            sock.close()
    assert answers == [408] * SLOW_CLIENTS
    assert waited < 4, f"the slow clients were closed after {waited:.1f} s (timeout 1 s)"
    assert statistics.median(busy) < max(0.05, 5 * statistics.median(idle)), (statistics.median(busy), idle)
    assert metric(service, "dynamo_lite_http_header_timeouts_total") >= SLOW_CLIENTS


def test_a_complete_head_is_not_timed_out(service: str) -> None:
    """The timeout is for the head: a body may take longer (it is bounded by its size)."""
    with socket.create_connection(_address(service)) as sock:
        sock.sendall(b"POST /register HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 90\r\n\r\n{")
        time.sleep(1.5)
        sock.sendall(b' "worker_id": 1, "model_name": "slow", "block_size": 16, "dp_start": 0, "dp_size": 1}'
                     .ljust(89))
        status, _, body = read_answer(sock)
    assert status == 201, body


def test_keep_alive_reuses_a_connection_until_it_idles_out(service: str) -> None:
    with socket.create_connection(_address(service)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_answer(sock)[0] == 200
        time.sleep(1.2)  # idle, under --keep-alive-secs 2 (and past the head timeout: not a head)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_answer(sock)[0] == 200
        assert not closed_by_server(sock, timeout=1.0)  # idle well under --keep-alive-secs 2: kept
        assert closed_by_server(sock, timeout=10)  # and closed once the idle time passes it


def test_http_1_0_keep_alive_is_honoured_when_asked(service: str) -> None:
    with socket.create_connection(_address(service)) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            status, head, _ = read_answer(sock)
            assert status == 200 and b"connection: keep-alive" in head.lower()
    with socket.create_connection(_address(service)) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        status, head, _ = read_answer(sock)
        assert status == 200 and b"connection: close" in head.lower()
        assert closed_by_server(sock, timeout=2)


def test_connections_beyond_the_cap_get_503_at_once() -> None:
    with running_service("indexer", "--max-connections", "20") as url:
        held = [socket.create_connection(_address(url)) for _ in range(20)]
        try:
            for sock in held:  # every one of them is served
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                assert read_answer(sock)[0] == 200
            with socket.create_connection(_address(url)) as extra:
                status, head, body = read_answer(extra, timeout=2)
                assert status == 503 and b"too many open connections" in body
                assert closed_by_server(extra, timeout=2)
        finally:
            for sock in held[:5]:
                sock.close()
        time.sleep(0.2)
        with httpx.Client(base_url=str(url)) as client:  # room again
            assert client.get("/health").status_code == 200
            assert client.get("/metrics").status_code == 200
        for sock in held[5:]:
            sock.close()
        assert metric(str(url), "dynamo_lite_http_refused_connections_total") == 1
        assert metric(str(url), "dynamo_lite_http_max_connections") == 20
