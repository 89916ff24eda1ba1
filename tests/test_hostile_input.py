"""Hostile input against both services running as real processes (the native server).

Every class of bad input (bodies at and over the size limits, deep nesting, huge arrays,
numbers JSON allows but the API does not, odd strings as ids, trailing garbage, wrong content
types, oversized request heads, slow clients, thousands of connections) must get a JSON 4xx
or be served, and the process must still answer `/health` afterwards. Requests go over raw
sockets, so nothing in a client library tidies them up first. Socket timeouts are generous
stall detectors, not speed requirements.

Every test runs twice: on plain HTTP, and on TLS (`--ssl-certfile`, a CA made for the run),
where the same limits must hold.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
from support.reference_server import ServerURL, free_port, running_server
from support.tls_support import Authority

from dynamo_lite.indexer.app import LARGE_BODY
from dynamo_lite.web.http import DEFAULT_MAX_BODY
from dynamo_lite.web.server import MAX_REQUEST_HEAD

pytestmark = pytest.mark.process

STALL = 30.0  # seconds without an answer that count as a stalled process
MODEL = "hostile"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


def _address(base: str) -> tuple[str, int]:
    parts = urlsplit(base)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def raw_request(method: str, path: str, body: bytes = b"", content_type: str | None = "application/json",
            headers: tuple[tuple[str, str], ...] = (), *, length: bool = True) -> bytes:
    """An HTTP/1.1 request as bytes; `length=False` sends the body chunked (no Content-Length)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{name}: {value}" for name, value in headers]
    if length:
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    lines.append("Transfer-Encoding: chunked")
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in _pieces(body, 64 * 1024))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + chunked + b"0\r\n\r\n"


def _pieces(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def read_answer(sock: socket.socket) -> Answer:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a complete answer: {buffer[:200]!r}"
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of a body"
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body[:length])


def connect(base: str) -> socket.socket:
    """A connection to the service, TLS when it serves https (the `ServerURL`'s `tls` context)."""
    sock = socket.create_connection(_address(base), timeout=STALL)
    context = getattr(base, "tls", None)
    return context.wrap_socket(sock, server_hostname="127.0.0.1") if context is not None else sock


def http_client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=STALL, verify=getattr(base, "tls", None) or True)


def exchange(base: str, data: bytes) -> Answer:
    with connect(base) as sock:
        sock.sendall(data)
        return read_answer(sock)


def assert_json_error(answer: Answer, *statuses: int) -> None:
    assert answer.status in statuses, (answer.status, answer.body[:300])
    assert answer.headers["content-type"] == "application/json", answer.headers
    body = answer.json()
    assert isinstance(body, dict) and list(body) == ["error"] and body["error"], body


def assert_healthy(server: ServerURL) -> None:
    assert server.alive(), server.log_text()
    assert exchange(server, raw_request("GET", "/health", content_type=None)).status == 200
    log = server.log_text(200_000)
    assert "Traceback" not in log and "unhandled error" not in log, log


@pytest.fixture(scope="module", params=["http", "https"])
def scheme(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.create(tmp_path_factory.mktemp("hostile-tls"))


@contextlib.contextmanager
def _started(module: str, scheme: str, authority: Authority) -> Iterator[ServerURL]:
    port = free_port()
    # The 2,000 idle connections below are opened one by one, TLS handshakes included: on a
    # loaded machine that takes longer than the default 10 s head timeout, which would answer
    # the first ones 408 before they ask (the timeout has tests of its own, test_connections.py).
    argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--header-timeout-secs", "300"]
    context = None
    if scheme == "https":
        server = authority.issue(module.rsplit(".", 1)[1])
        argv += ["--ssl-certfile", str(server.certfile), "--ssl-keyfile", str(server.keyfile)]
        context = authority.client_context()
    with running_server(argv, port, scheme=scheme, verify=context or True) as url:
        url.tls = context  # type: ignore[attr-defined]
        yield url


@pytest.fixture(scope="module")
def slot_tracker(scheme: str, authority: Authority) -> Iterator[ServerURL]:
    with _started("dynamo_lite.slot_tracker", scheme, authority) as url:
        register = {"worker_id": 1, "model_name": MODEL, "block_size": 16, "dp_start": 0, "dp_size": 2}
        assert exchange(url, raw_request("POST", "/register", json.dumps(register).encode())).status == 201
        yield url
        assert_healthy(url)  # at teardown, whichever tests ran, in any order: all left it serving


@pytest.fixture(scope="module")
def indexer(scheme: str, authority: Authority) -> Iterator[ServerURL]:
    with _started("dynamo_lite.indexer", scheme, authority) as url:
        register = {"instance_id": 1, "model_name": MODEL, "block_size": 16}
        assert exchange(url, raw_request("POST", "/register", json.dumps(register).encode())).status == 201
        yield url
        assert_healthy(url)  # at teardown, whichever tests ran, in any order: all left it serving


def padded(document: object, size: int) -> bytes:
    """`document` as JSON followed by spaces (valid JSON whitespace) to exactly `size` bytes."""
    text = json.dumps(document, separators=(",", ":")).encode()
    assert len(text) <= size
    return text + b" " * (size - len(text))


def hashes_filling(size: int, key: str, extra: dict[str, object]) -> bytes:
    """A body whose array `key` of distinct 19-digit integers makes it exactly `size` bytes."""
    skeleton = len(json.dumps({**extra, key: []}, separators=(",", ":")))
    count = (size - skeleton) // 20  # 19 digits and a comma each
    values = list(range(10**18, 10**18 + count))
    return padded({**extra, key: values}, size)


# --------------------------------------------------------------------------------------------
# Body size
# --------------------------------------------------------------------------------------------


def test_slot_tracker_body_at_the_limit_is_served_and_one_byte_more_is_413(slot_tracker: ServerURL) -> None:
    body = hashes_filling(DEFAULT_MAX_BODY, "sequence_hashes", {"model_name": MODEL, "new_isl_tokens": 1})
    answer = exchange(slot_tracker, raw_request("POST", "/potential_loads", body))
    assert answer.status == 200, answer.body[:300]
    rows = answer.json()
    assert isinstance(rows, list) and len(rows) == 2
    assert rows[0]["potential_decode_blocks"] > 100_000
    assert_json_error(exchange(slot_tracker, raw_request("POST", "/potential_loads", body + b" ")), 413)
    # Without Content-Length the limit is enforced while the chunks stream in.
    assert_json_error(exchange(slot_tracker, raw_request("POST", "/add", body + b" ", length=False)), 413)
    assert exchange(slot_tracker, raw_request("POST", "/potential_loads", body, length=False)).status == 200
    # A declared length far over the limit is refused before a byte of body is sent.
    huge = raw_request("POST", "/add", b"")[: -len(b"Content-Length: 0\r\n\r\n")] + b"Content-Length: 99999999999\r\n\r\n"
    assert_json_error(exchange(slot_tracker, huge), 413)
    assert_healthy(slot_tracker)


def test_indexer_large_routes_take_8_mib_and_the_others_2_mib(indexer: ServerURL) -> None:
    tokens = padded({"model_name": MODEL, "token_ids": [7] * ((LARGE_BODY - 100) // 2)}, LARGE_BODY)
    answer = exchange(indexer, raw_request("POST", "/query", tokens))
    assert answer.status == 200, answer.body[:300]
    assert_json_error(exchange(indexer, raw_request("POST", "/query", tokens + b" ")), 413)
    events = padded({f"{MODEL}:default": {"block_size": 16, "events": []}}, LARGE_BODY)
    assert exchange(indexer, raw_request("POST", "/events", events)).status == 200
    assert_json_error(exchange(indexer, raw_request("POST", "/events", events + b" ")), 413)
    by_hash = hashes_filling(DEFAULT_MAX_BODY, "block_hashes", {"model_name": MODEL})
    assert exchange(indexer, raw_request("POST", "/query_by_hash", by_hash)).status == 200
    assert_json_error(exchange(indexer, raw_request("POST", "/query_by_hash", by_hash + b" ")), 413)
    assert_json_error(exchange(indexer, raw_request("POST", "/register", by_hash + b" ")), 413)
    assert_healthy(indexer)


# --------------------------------------------------------------------------------------------
# JSON the parser or the API refuses
# --------------------------------------------------------------------------------------------

ADD = f'{{"model_name": "{MODEL}", "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2], '

MALFORMED = {
    "nested arrays 100k deep": b"[" * 100_000 + b"]" * 100_000,
    "nested objects 5k deep": b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    "NaN": (ADD + '"new_isl_tokens": NaN}').encode(),
    "Infinity": (ADD + '"new_isl_tokens": Infinity}').encode(),
    "-Infinity": (ADD + '"new_isl_tokens": -Infinity}').encode(),
    "number overflowing a double": (ADD + '"new_isl_tokens": 1e400}').encode(),
    "integer with 5000 digits": (ADD + '"new_isl_tokens": ' + "9" * 5000 + "}").encode(),
    "trailing garbage": (ADD + '"new_isl_tokens": 1} x').encode(),
    "two documents": (ADD + '"new_isl_tokens": 1}{}').encode(),
    "trailing NUL": (ADD + '"new_isl_tokens": 1}\x00').encode(),
    "lone surrogate escape": b'{"model_name": "\\ud800", "request_id": "r"}',
    "invalid UTF-8": b'{"model_name": "\xff\xfe", "request_id": "r"}',
    "raw control character in a string": b'{"model_name": "a\x01b", "request_id": "r"}',
    "unterminated": b'{"model_name": "hostile", "request_id": ',
    "empty body": b"",
    "single quotes": b"{'model_name': 'hostile'}",
    "comment": b'{"model_name": "hostile" /* x */}',
}

WRONG_SHAPE = {
    "integer above u64": (ADD + '"new_isl_tokens": 18446744073709551616}').encode(),
    "integer with 300 digits": (ADD + '"new_isl_tokens": ' + "9" * 300 + "}").encode(),
    "negative integer": (ADD + '"new_isl_tokens": -1}').encode(),
    "hash above i64": ADD.replace("[1, 2]", "[9223372036854775808]").encode() + b'"new_isl_tokens": 1}',
    "hash below i64": ADD.replace("[1, 2]", "[-9223372036854775809]").encode() + b'"new_isl_tokens": 1}',
    "float": (ADD + '"new_isl_tokens": 1.5}').encode(),
    "integral float": (ADD + '"new_isl_tokens": 1.0}').encode(),
    "exponent": (ADD + '"new_isl_tokens": 1e3}').encode(),
    "negative zero float": (ADD + '"new_isl_tokens": -0.0}').encode(),
    "boolean": (ADD + '"new_isl_tokens": true}').encode(),
    "null": (ADD + '"new_isl_tokens": null}').encode(),
    "string number": (ADD + '"new_isl_tokens": "1"}').encode(),
    "array body": b"[1, 2, 3]",
    "string body": b'"hostile"',
    "number as model name": b'{"model_name": 7, "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": []}',
    "object as request id": b'{"model_name": "m", "request_id": {}, "worker_id": 1, "dp_rank": 0, "sequence_hashes": []}',
    "hashes as object": ADD.replace("[1, 2]", '{"0": 1}').encode() + b'"new_isl_tokens": 1}',
    "hash as string": ADD.replace("[1, 2]", '["1"]').encode() + b'"new_isl_tokens": 1}',
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=list(MALFORMED))
def test_malformed_json_is_400(slot_tracker: ServerURL, indexer: ServerURL, body: bytes) -> None:
    assert_json_error(exchange(slot_tracker, raw_request("POST", "/add", body)), 400)
    assert_json_error(exchange(indexer, raw_request("POST", "/query_by_hash", body)), 400)


@pytest.mark.parametrize("body", WRONG_SHAPE.values(), ids=list(WRONG_SHAPE))
def test_valid_json_of_the_wrong_shape_is_422(slot_tracker: ServerURL, body: bytes) -> None:
    assert_json_error(exchange(slot_tracker, raw_request("POST", "/add", body)), 422)


def test_indexer_numbers_out_of_range_are_422(indexer: ServerURL) -> None:
    cases = [
        {"instance_id": 2**64, "model_name": MODEL, "block_size": 16},
        {"instance_id": -1, "model_name": MODEL, "block_size": 16},
        {"instance_id": 1.0, "model_name": MODEL, "block_size": 16},
        {"instance_id": 2, "model_name": MODEL, "block_size": 2**32},
        {"instance_id": 2, "model_name": MODEL, "block_size": 16, "dp_rank": 2**32},
    ]
    for case in cases:
        assert_json_error(exchange(indexer, raw_request("POST", "/register", json.dumps(case).encode())), 422)
    for hashes in ([2**64], [-(2**63) - 1], [1.5], [10**30]):
        body = json.dumps({"model_name": MODEL, "block_hashes": hashes}).encode()
        assert_json_error(exchange(indexer, raw_request("POST", "/query_by_hash", body)), 422)
    event = {"worker_id": 1, "event": {"event_id": 2**64, "data": "cleared"}}
    body = json.dumps({f"{MODEL}:default": {"block_size": 16, "events": [event]}}).encode()
    assert_json_error(exchange(indexer, raw_request("POST", "/events", body)), 422)
    body = json.dumps({"model_name": MODEL, "token_ids": [2**32]}).encode()
    assert_json_error(exchange(indexer, raw_request("POST", "/query", body)), 422)
    assert_healthy(indexer)


# --------------------------------------------------------------------------------------------
# Strings as ids
# --------------------------------------------------------------------------------------------

ODD_NAMES = ["", " ", "模型", "🦙 llama", "a\u0000b", "\u202eevil", "%2F..%2F", "x" * 100_000, "line\nbreak", '"quoted"']


def _filter(model_name: str, tenant_id: str) -> dict[str, str]:
    """Query-string filters, except for names too long for a request head (listed unfiltered)."""
    return {"model_name": model_name, "tenant_id": tenant_id} if len(model_name) < 1000 else {}


@pytest.mark.parametrize("name", ODD_NAMES, ids=[repr(name[:12]) for name in ODD_NAMES])
def test_any_string_is_an_id_and_comes_back_unchanged(slot_tracker: ServerURL, indexer: ServerURL, name: str) -> None:
    register = {"worker_id": 9, "model_name": name, "tenant_id": name, "block_size": 4, "dp_start": 0, "dp_size": 1}
    assert exchange(slot_tracker, raw_request("POST", "/register", json.dumps(register).encode())).status == 201
    add = {"model_name": name, "tenant_id": name, "request_id": name, "worker_id": 9, "dp_rank": 0,
           "sequence_hashes": [5], "new_isl_tokens": 3}
    assert exchange(slot_tracker, raw_request("POST", "/add", json.dumps(add).encode())).status == 201
    with http_client(slot_tracker) as client:
        loads = [row for row in client.get("/loads", params=_filter(name, name)).json() if row["model_name"] == name]
        assert loads == [{"model_name": name, "tenant_id": name, "worker_id": 9, "dp_rank": 0,
                          "active_prefill_tokens": 3, "active_decode_blocks": 1}]
    ref = {"model_name": name, "tenant_id": name, "request_id": name}
    assert exchange(slot_tracker, raw_request("POST", "/free", json.dumps(ref).encode())).status == 200
    unregister = {"worker_id": 9, "model_name": name, "tenant_id": name}
    assert exchange(slot_tracker, raw_request("POST", "/unregister", json.dumps(unregister).encode())).status == 200

    tenant = name.replace(":", "")  # a tenant may not contain ":" in the indexer (dump keys)
    register = {"instance_id": 9, "model_name": name, "tenant_id": tenant, "block_size": 4}
    assert exchange(indexer, raw_request("POST", "/register", json.dumps(register).encode())).status == 201
    with http_client(indexer) as client:
        workers = [w for w in client.get("/workers", params=_filter(name, tenant)).json() if w["model_name"] == name]
        assert [(w["instance_id"], w["model_name"], w["tenant_id"]) for w in workers] == [(9, name, tenant)]
        assert f"{name}:{tenant}" in client.get("/dump").json()
    unregister = {"instance_id": 9, "model_name": name, "tenant_id": tenant}
    assert exchange(indexer, raw_request("POST", "/unregister", json.dumps(unregister).encode())).status == 200


def test_indexer_tenant_with_a_colon_is_400(indexer: ServerURL) -> None:
    body = json.dumps({"instance_id": 3, "model_name": MODEL, "tenant_id": "a:b", "block_size": 16}).encode()
    assert_json_error(exchange(indexer, raw_request("POST", "/register", body)), 400)


# --------------------------------------------------------------------------------------------
# Content types and HTTP framing
# --------------------------------------------------------------------------------------------

REFUSED_TYPES = [None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/jsonx", "application/json-seq", "text/json", "application", "*/*"]
ACCEPTED_TYPES = ["application/json; charset=utf-8", "APPLICATION/JSON", "application/problem+json",
                  "application/json;charset=latin-1"]


@pytest.mark.parametrize("content_type", REFUSED_TYPES)
def test_non_json_content_types_are_415(slot_tracker: ServerURL, indexer: ServerURL, content_type: str | None) -> None:
    body = json.dumps({"model_name": MODEL, "sequence_hashes": []}).encode()
    assert_json_error(exchange(slot_tracker, raw_request("POST", "/potential_loads", body, content_type)), 415)
    body = json.dumps({"model_name": MODEL, "block_hashes": []}).encode()
    assert_json_error(exchange(indexer, raw_request("POST", "/query_by_hash", body, content_type)), 415)


@pytest.mark.parametrize("content_type", ACCEPTED_TYPES)
def test_json_content_types_are_served(slot_tracker: ServerURL, content_type: str) -> None:
    body = json.dumps({"model_name": MODEL, "sequence_hashes": []}).encode()
    assert exchange(slot_tracker, raw_request("POST", "/potential_loads", body, content_type)).status == 200


def test_request_head_over_the_bound_is_431_and_under_it_is_served(slot_tracker: ServerURL, indexer: ServerURL) -> None:
    for server in (slot_tracker, indexer):
        under = raw_request("GET", "/health", content_type=None, headers=(("X-Pad", "a" * (MAX_REQUEST_HEAD - 200)),))
        assert exchange(server, under).status == 200
        # Never finished: the bound, not the end of the head, decides.
        unfinished = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * (MAX_REQUEST_HEAD + 1000)
        assert_json_error(exchange(server, unfinished), 431)
        many = raw_request("GET", "/health", content_type=None, headers=(("X-A", "b"),) * 20_000)
        assert_json_error(exchange(server, many), 431)
        long_url = raw_request("GET", "/workers?model_name=" + "a" * (2 * MAX_REQUEST_HEAD), content_type=None)
        assert_json_error(exchange(server, long_url), 431)
        # The bound is per request: a body far larger than it is fine.
        body = padded({"model_name": MODEL, "sequence_hashes": [], "block_hashes": []}, 4 * MAX_REQUEST_HEAD)
        path = "/potential_loads" if server is slot_tracker else "/query_by_hash"
        assert exchange(server, raw_request("POST", path, body)).status == 200
        assert_healthy(server)


def test_protocol_garbage_closes_the_connection_and_nothing_else(slot_tracker: ServerURL) -> None:
    for garbage in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n",  # TLS hello
                    b"NOT HTTP AT ALL\r\n\r\n",
                    b"POST /add HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
                    b"POST /add HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"):
        answer = exchange(slot_tracker, garbage)
        assert answer.status == 400  # the server's own answer: the app never sees these
    assert_healthy(slot_tracker)


# --------------------------------------------------------------------------------------------
# Slow clients and many connections
# --------------------------------------------------------------------------------------------


def test_a_trickled_request_does_not_block_other_clients(slot_tracker: ServerURL) -> None:
    """One client sends a request a byte at a time and stops one byte short; meanwhile other
    clients (and 200 connections holding half a request head) are served, then it finishes."""
    add = {"model_name": MODEL, "request_id": "trickled", "worker_id": 1, "dp_rank": 1,
           "sequence_hashes": [11, 12, 13], "new_isl_tokens": 16}
    data = raw_request("POST", "/add", json.dumps(add).encode())
    halfway = threading.Event()
    others_done = threading.Event()
    answers: list[Answer] = []

    def trickle() -> None:
        with connect(slot_tracker) as sock:
            for index in range(len(data) - 1):
                sock.sendall(data[index : index + 1])
                if index == len(data) // 2:
                    halfway.set()
            others_done.wait(STALL)
            sock.sendall(data[-1:])
            answers.append(read_answer(sock))

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    assert halfway.wait(STALL)
    stalled = [connect(slot_tracker) for _ in range(200)]
    try:
        for sock in stalled:
            sock.sendall(b"POST /add HTTP/1.1\r\nHost: test\r\nContent-Le")
        with http_client(slot_tracker) as client:
            for _ in range(20):
                assert client.get("/loads", params={"model_name": MODEL}).status_code == 200
        assert thread.is_alive() and not answers  # the trickled request is still unfinished
    finally:
        others_done.set()
        for sock in stalled:
            sock.close()
    thread.join(STALL)
    assert [answer.status for answer in answers] == [201]
    free = json.dumps({"model_name": MODEL, "request_id": "trickled"}).encode()
    assert exchange(slot_tracker, raw_request("POST", "/free", free)).status == 200
    assert_healthy(slot_tracker)


CONNECTIONS = 2000


def _ensure_open_files(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


@pytest.mark.parametrize("service", ["slot_tracker", "indexer"])
def test_thousands_of_open_connections_are_all_served(request: pytest.FixtureRequest, service: str,
                                                      scheme: str) -> None:
    server: ServerURL = request.getfixturevalue(service)  # `scheme`: the request runs on http and https
    available = _ensure_open_files(CONNECTIONS + 200)
    if available < CONNECTIONS + 200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {available} is below {CONNECTIONS + 200}")
    sockets: list[socket.socket] = []
    try:
        for _ in range(CONNECTIONS):
            sockets.append(connect(server))
        # Every connection is open and idle: a new client is still served at once.
        with http_client(server) as client:
            assert client.get("/workers").status_code == 200
        # Then all of them ask at once, each on its own connection.
        probe = raw_request("GET", "/workers?model_name=" + MODEL, content_type=None)
        for sock in sockets:
            sock.sendall(probe)
        statuses = [read_answer(sock).status for sock in sockets]
        assert statuses == [200] * CONNECTIONS
    finally:
        for sock in sockets:
            sock.close()
    assert_healthy(server)


def test_token_sums_past_2_64_are_exact_not_a_500(slot_tracker: ServerURL) -> None:
    """Each `new_isl_tokens` is a u64 but their sum is not bounded; orjson cannot write it."""
    top = 2**64 - 1
    for request_id in ("big-1", "big-2"):
        add = {"model_name": MODEL, "request_id": request_id, "worker_id": 1, "dp_rank": 0,
               "sequence_hashes": [], "new_isl_tokens": top}
        assert exchange(slot_tracker, raw_request("POST", "/add", json.dumps(add).encode())).status == 201
    loads = exchange(slot_tracker, raw_request("GET", f"/loads?model_name={MODEL}", content_type=None))
    assert loads.status == 200, loads.body
    assert json.loads(loads.body)[0]["active_prefill_tokens"] == 2 * top
    body = json.dumps({"model_name": MODEL, "sequence_hashes": [], "new_isl_tokens": top}).encode()
    projected = exchange(slot_tracker, raw_request("POST", "/potential_loads", body))
    assert projected.status == 200, projected.body
    assert json.loads(projected.body)[0]["potential_prefill_tokens"] == 3 * top
    for request_id in ("big-1", "big-2"):
        free = json.dumps({"model_name": MODEL, "request_id": request_id}).encode()
        assert exchange(slot_tracker, raw_request("POST", "/free", free)).status == 200
    assert_healthy(slot_tracker)


def test_serve_raises_the_soft_open_file_limit_to_the_hard_one() -> None:
    """Each connection is a file descriptor: a soft limit of 1024 would refuse the 2,000 above."""
    script = (
        "import resource\n"
        "from dynamo_lite.web.cli import raise_open_file_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "raised = raise_open_file_limit()\n"
        "print(raised == resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=STALL)
    assert done.stdout.strip() == "True", done.stdout + done.stderr
