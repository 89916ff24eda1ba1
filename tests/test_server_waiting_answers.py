"""Answers that wait (a handler returning a coroutine, as a NATS replica's writes do) on the
native server: written in request order behind pipelined requests, failures still JSON, the
connection closed after them when asked, and the same answers through the ASGI entry point."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient
from support.raw_http import Connection, get, post
from support.server_thread import ServerThread, body, make_app

from dynamo_lite.web import http

pytestmark = pytest.mark.unit


@pytest.fixture
def server() -> Iterator[ServerThread]:
    running = ServerThread()
    yield running
    running.stop()


def test_pipelined_answers_keep_request_order_behind_a_waiting_one(server: ServerThread) -> None:
    connection = Connection(server.url)
    connection.send(post("/wait", body(seconds=0.2, echo=1)) + post("/now", body(echo=2))
                    + post("/wait", body(seconds=0.05, echo=3)) + get("/health"))
    answers = [connection.answer() for _ in range(4)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 200]
    assert [orjson.loads(b)["echo"] for _, _, b in answers[:3]] == [1, 2, 3]
    # The connection goes on serving after the queue has drained.
    connection.send(post("/now", body(echo=4)))
    assert orjson.loads(connection.answer()[2]) == {"echo": 4}


def test_a_failing_waiting_handler_is_a_json_error(server: ServerThread) -> None:
    connection = Connection(server.url)
    connection.send(post("/wait", body(fail="conflict")) + post("/wait", body(fail="crash")))
    status, headers, payload = connection.answer()
    assert (status, orjson.loads(payload)) == (409, {"error": "taken"})
    assert headers[b"content-type"] == b"application/json"
    status, _, payload = connection.answer()
    assert status == 500 and "internal error" in orjson.loads(payload)["error"]


def test_http_1_0_closes_after_the_waiting_answer(server: ServerThread) -> None:
    connection = Connection(server.url)
    data = body(seconds=0.1, echo=5)
    connection.send(b"POST /wait HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(data), data))
    status, headers, payload = connection.answer()
    assert (status, orjson.loads(payload)) == (200, {"echo": 5})
    assert headers.get(b"connection") == b"close"
    assert connection.closed()


def test_shutdown_writes_the_waiting_answer_then_closes(server: ServerThread) -> None:
    connection = Connection(server.url)
    connection.send(post("/wait", body(seconds=0.5, echo=6)))
    shutdown = threading.Timer(0.1, server.shut_down)
    shutdown.start()
    status, _, payload = connection.answer()
    assert (status, orjson.loads(payload)) == (200, {"echo": 6})
    assert connection.closed()
    shutdown.join(10)
    assert not server.server.connections


def test_the_asgi_entry_point_awaits_the_same_answers() -> None:
    with TestClient(make_app()) as client:
        response = client.post("/wait", content=body(seconds=0.01, echo=7),
                               headers={"content-type": "application/json"})
        assert (response.status_code, response.json()) == (200, {"echo": 7})
        response = client.post("/wait", content=body(fail="conflict"), headers={"content-type": "application/json"})
        assert (response.status_code, response.json()) == (409, {"error": "taken"})


class _Watched(http.DirectEndpoint):
    """Waits `seconds`, recording whether it was cancelled (`cancel_on_disconnect`)."""

    max_body = 1024
    cancel_on_disconnect = True

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def respond(self, query_string: bytes, body: bytes):
        seconds = orjson.loads(body)["seconds"]

        async def wait():
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return 200, b'{"waited": true}', b"application/json"

        return asyncio.ensure_future(wait())


def test_a_client_that_hangs_up_cancels_a_watched_waiting_answer() -> None:
    watched = _Watched()
    app = http.Service(routes=[Route("/watched", watched, methods=["POST"]), http.health_route()])
    server = ServerThread(app)
    try:
        connection = Connection(server.url)
        connection.send(post("/watched", body(seconds=0.05)))
        assert connection.answer()[0] == 200  # answered as any waiting answer when the client waits
        connection.send(post("/watched", body(seconds=30)))
        time.sleep(0.1)
        connection.close()
        assert watched.cancelled.wait(5), "the hang-up did not cancel the waiting answer"
        # A pipelined request behind a watched answer still gets its answer, in order.
        other = Connection(server.url)
        other.send(post("/watched", body(seconds=0.1)) + get("/health"))
        assert [other.answer()[0] for _ in range(2)] == [200, 200]
    finally:
        server.stop()
