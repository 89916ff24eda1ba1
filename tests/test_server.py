"""The native HTTP server (`dynamo_lite.web.server`) against a real slot tracker process, byte by
byte: pipelining, `Expect: 100-continue`, early answers that keep the connection usable, HEAD,
percent-encoded paths, and a graceful shutdown that answers the request in flight."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import orjson
import pytest
from support.raw_http import Connection, get, post
from support.reference_server import ServerURL, running_service

pytestmark = pytest.mark.process

REGISTER = orjson.dumps({"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2})


@pytest.fixture(scope="module")
def tracker() -> Iterator[ServerURL]:
    with running_service("slot_tracker") as url:
        yield url


@pytest.fixture
def connection(tracker: ServerURL) -> Iterator[Connection]:
    conn = Connection(tracker)
    yield conn
    conn.close()


def test_pipelined_requests_are_answered_in_order(connection: Connection) -> None:
    connection.send(get("/health") + post("/free", b'{"model_name": 1}') + get("/nope") + get("/loads?model_name=x"))
    assert connection.answer()[0] == 200
    status, _, body = connection.answer()
    assert status == 422 and b"model_name" in body
    assert connection.answer()[:1] == (404,)
    assert connection.answer()[::2] == (200, b"[]")


def test_expect_100_continue_is_honoured_before_the_body(connection: Connection) -> None:
    body = orjson.dumps({"model_name": "unknown", "request_id": "r"})
    head, _, rest = post("/free", body, extra="Expect: 100-continue\r\n").partition(b"\r\n\r\n")
    connection.send(head + b"\r\n\r\n")
    assert connection.answer(head_only=True)[0] == 100
    connection.send(rest)
    status, _, answer = connection.answer()
    assert status == 404 and b"no slot tracker" in answer
    connection.send(get("/health"))
    assert connection.answer()[0] == 200  # the connection goes on


def test_a_refused_body_is_not_asked_for_and_the_connection_closes(connection: Connection) -> None:
    head, _, _ = post("/add", b"{}", content_type="text/plain", extra="Expect: 100-continue\r\n").partition(b"\r\n\r\n")
    connection.send(head + b"\r\n\r\n")
    status, headers, _ = connection.answer()
    assert status == 415 and headers[b"connection"] == b"close"
    assert connection.closed()


def test_an_early_answer_drops_the_body_and_keeps_the_connection(connection: Connection) -> None:
    for refused in (post("/add", b'{"x": "' + b"a" * 50_000 + b'"}', content_type="text/plain"),
                    post("/nope", b'{"a": 1}'),
                    post("/loads", b'{"a": 1}')):
        connection.send(refused)
        assert connection.answer()[0] in (415, 404, 405)
        connection.send(get("/health"))
        assert connection.answer()[0] == 200


def test_a_chunked_body_past_the_limit_is_413_and_the_connection_goes_on(connection: Connection) -> None:
    chunk = b"x" * (1024 * 1024)
    connection.send(b"POST /add HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
    for _ in range(3):
        connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    connection.send(b"0\r\n\r\n")
    status, _, body = connection.answer()
    assert status == 413 and b"exceeds the limit" in body
    connection.send(get("/health"))
    assert connection.answer()[0] == 200


def test_a_get_with_a_body_is_answered_as_without_one(connection: Connection) -> None:
    """Dynamo 1.6.1 ignores a body sent with GET; so do we, on the same connection after it."""
    for method in ("GET", "HEAD"):
        for body in (b'{"model_name": "x"}', b"x" * 100_000):
            connection.send(f"{method} /loads?model_name=x HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status, _, answer = connection.answer(head_only=method == "HEAD")
            assert status == 200 and answer == (b"[]" if method == "GET" else b"")
    connection.send(get("/health"))
    assert connection.answer()[0] == 200


def test_an_unknown_query_parameter_is_400_naming_it_and_the_accepted_ones(connection: Connection) -> None:
    connection.send(get("/loads?model=x"))
    status, _, body = connection.answer()
    assert status == 400
    assert orjson.loads(body) == {"error": "unknown query parameter `model`; accepted: model_name, routing_group, tenant_id"}
    connection.send(get("/dump?anything=1"))  # a route that takes none refuses any (Dynamo ignores it)
    status, _, body = connection.answer()
    assert status == 400 and "this route takes none" in orjson.loads(body)["error"]


def test_head_answers_carry_the_length_but_no_body(connection: Connection) -> None:
    connection.send(get("/openapi.json", "HEAD") + get("/health"))
    status, headers, _ = connection.answer(head_only=True)
    assert status == 200 and int(headers[b"content-length"]) > 1000
    assert connection.answer()[0] == 200  # the next answer starts right after the head


def test_percent_encoded_paths_and_absolute_urls_are_routed(connection: Connection) -> None:
    connection.send(get("/h%65alth") + b"GET http://t/health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert connection.answer()[0] == 200
    assert connection.answer()[0] == 200


def test_answers_have_a_date_and_http_1_1_keeps_the_connection(connection: Connection) -> None:
    connection.send(get("/health"))
    status, headers, _ = connection.answer()
    assert status == 200 and re.fullmatch(rb"\w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", headers[b"date"])
    assert b"connection" not in headers
    connection.send(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert connection.answer()[1][b"connection"] == b"close"
    assert connection.closed()


def test_sigterm_answers_the_request_in_flight_then_exits_0() -> None:
    with running_service("slot_tracker") as url:
        busy = Connection(url)
        idle = Connection(url)
        idle.send(get("/health"))
        assert idle.answer()[0] == 200
        request = post("/register", REGISTER)
        busy.send(request[:-10])  # the head and most of the body: a request in flight
        time.sleep(0.2)
        url.process.send_signal(signal.SIGTERM)
        assert idle.closed()  # idle connections close at once
        time.sleep(0.3)
        busy.send(request[-10:])
        status, headers, _ = busy.answer()
        assert status == 201 and headers[b"connection"] == b"close"
        assert busy.closed()
        assert url.process.wait(timeout=15) == 0
