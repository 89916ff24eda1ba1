"""Every route, status code and error shape of the slot tracker, in process."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from starlette.testclient import TestClient
from support.http_support import JSON, assert_error, post

from dynamo_lite.slot_tracker.app import create_app
from dynamo_lite.slot_tracker.core import SlotTracker

pytestmark = pytest.mark.unit

REGISTER = {"worker_id": 7, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app()) as client:
        yield client






def test_health_is_empty_200(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 200 and response.content == b""
    assert "content-type" not in response.headers
    assert client.head("/health").status_code == 200


def test_full_lifecycle(client: TestClient) -> None:
    assert post(client, "/register", REGISTER).status_code == 201
    add = {"model_name": "m", "request_id": "r", "worker_id": 7, "dp_rank": 0,
           "sequence_hashes": [101, -22, 303], "new_isl_tokens": 48}
    response = post(client, "/add", add)
    assert (response.status_code, response.json()) == (201, {"status": "ok"})
    assert client.get("/loads").json() == [
        {"model_name": "m", "tenant_id": "default", "worker_id": 7, "dp_rank": 0,
         "active_prefill_tokens": 48, "active_decode_blocks": 3},
        {"model_name": "m", "tenant_id": "default", "worker_id": 7, "dp_rank": 1,
         "active_prefill_tokens": 0, "active_decode_blocks": 0},
    ]
    projected = post(client, "/potential_loads",
                     {"model_name": "m", "sequence_hashes": [101, -22, 303, 404], "new_isl_tokens": 48})
    assert projected.status_code == 200
    assert sorted(projected.json(), key=lambda item: item["dp_rank"]) == [
        {"worker_id": 7, "dp_rank": 0, "potential_prefill_tokens": 96, "potential_decode_blocks": 4,
         "active_requests": 1},
        {"worker_id": 7, "dp_rank": 1, "potential_prefill_tokens": 48, "potential_decode_blocks": 4,
         "active_requests": 0},
    ]
    ref = {"model_name": "m", "request_id": "r"}
    assert post(client, "/prefill_complete", ref).json() == {"status": "ok"}
    assert post(client, "/prefill_complete", ref).status_code == 200
    assert client.get("/loads").json()[0]["active_prefill_tokens"] == 0
    assert post(client, "/free", ref).status_code == 200
    assert post(client, "/free", ref).status_code == 200
    assert all(item["active_decode_blocks"] == 0 for item in client.get("/loads").json())
    assert client.get("/workers").json() == [
        {"worker_id": 7, "model_name": "m", "tenant_id": "default", "block_size": 16, "dp_start": 0, "dp_size": 2}]
    assert post(client, "/unregister", {"worker_id": 7, "model_name": "m"}).status_code == 200
    assert client.get("/workers").json() == []


def test_routing_group_is_an_alias_of_tenant_id(client: TestClient) -> None:
    assert post(client, "/register", {**REGISTER, "routing_group": "g"}).status_code == 201
    assert client.get("/workers?tenant_id=g").json()[0]["tenant_id"] == "g"
    assert len(client.get("/loads?routing_group=g").json()) == 2
    assert client.get("/loads?tenant_id=other").json() == []
    assert post(client, "/add", {"model_name": "m", "tenant_id": "g", "routing_group": "g", "request_id": "x",
                                 "worker_id": 7, "dp_rank": 1, "sequence_hashes": []}).status_code == 201
    assert_error(post(client, "/free", {"model_name": "m", "tenant_id": "g", "routing_group": "h", "request_id": "x"}), 400)
    assert_error(client.get("/loads?tenant_id=g&routing_group=h"), 400)
    assert_error(post(client, "/free", {"model_name": "m", "request_id": "x"}), 404,
                 "no slot tracker for model=m tenant_id=default")


def test_service_errors(client: TestClient) -> None:
    assert_error(post(client, "/register", {**REGISTER, "block_size": 0}), 400, "block_size must be greater than 0")
    assert_error(post(client, "/register", {**REGISTER, "dp_size": 4097}), 400, "dp_size 4097 exceeds the maximum 4096")
    assert_error(post(client, "/register", {**REGISTER, "dp_start": 4294967295, "dp_size": 1}), 400,
                 "dp range overflows u32: start=4294967295 size=1")
    assert post(client, "/register", REGISTER).status_code == 201
    assert_error(post(client, "/register", REGISTER), 409, "worker 7 already registered for model=m tenant_id=default")
    assert_error(post(client, "/register", {**REGISTER, "worker_id": 8, "block_size": 32}), 409,
                 "block_size mismatch for model=m tenant_id=default: existing=16, requested=32")
    assert_error(post(client, "/unregister", {"worker_id": 9, "model_name": "m"}), 404,
                 "worker 9 not found for model=m tenant_id=default")
    add = {"model_name": "m", "request_id": "a", "worker_id": 7, "dp_rank": 5, "sequence_hashes": []}
    assert_error(post(client, "/add", add), 404, "worker 7 dp_rank 5 is not registered for this model and tenant")
    assert post(client, "/add", {**add, "dp_rank": 1}).status_code == 201
    assert_error(post(client, "/add", {**add, "dp_rank": 0}), 409,
                 "request a already exists (assigned to worker 7 dp_rank 1)")
    assert_error(post(client, "/prefill_complete", {"model_name": "m", "request_id": "zz"}), 404, "request zz not found")
    assert_error(post(client, "/potential_loads", {"model_name": "x", "sequence_hashes": []}), 404,
                 "no slot tracker for model=x tenant_id=default")


def test_output_blocks(client: TestClient) -> None:
    ref = {"model_name": "m", "request_id": "r"}
    assert_error(post(client, "/output_blocks", {**ref, "output_blocks": 1}), 404,
                 "no slot tracker for model=m tenant_id=default")
    assert post(client, "/register", REGISTER).status_code == 201
    assert_error(post(client, "/output_blocks", {**ref, "output_blocks": 1}), 404, "request r not found")
    add = {**ref, "worker_id": 7, "dp_rank": 1, "sequence_hashes": [1, 2, 3], "new_isl_tokens": 16}
    assert post(client, "/add", add).status_code == 201
    for _ in range(2):  # a retried count changes nothing
        response = post(client, "/output_blocks", {**ref, "routing_group": "default", "output_blocks": 4})
        assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert [row["active_decode_blocks"] for row in client.get("/loads").json()] == [0, 7]
    projected = post(client, "/potential_loads", {"model_name": "m", "sequence_hashes": [1, 9]}).json()
    assert sorted((row["dp_rank"], row["potential_decode_blocks"]) for row in projected) == [(0, 2), (1, 8)]
    assert_error(post(client, "/output_blocks", {**ref, "output_blocks": 3}), 409,
                 "request r already holds 4 output blocks; the count cannot shrink to 3")
    assert post(client, "/output_blocks", {**ref, "output_blocks": 2**32 - 1}).status_code == 200
    assert client.get("/loads").json()[1]["active_decode_blocks"] == 2**32 + 2
    assert_error(post(client, "/output_blocks", {**ref, "tenant_id": "a", "routing_group": "b", "output_blocks": 5}),
                 400)
    assert_error(client.post("/output_blocks", content=orjson.dumps({**ref, "output_blocks": 5})), 415)
    assert post(client, "/free", ref).status_code == 200
    assert [row["active_decode_blocks"] for row in client.get("/loads").json()] == [0, 0]
    assert_error(post(client, "/output_blocks", {**ref, "output_blocks": 5}), 404, "request r not found")


@pytest.mark.parametrize(("body", "message"), [
    ({"model_name": "m", "request_id": "r"}, "missing field `output_blocks`"),
    ({"model_name": "m", "output_blocks": 1}, "missing field `request_id`"),
    ({"request_id": "r", "output_blocks": 1}, "missing field `model_name`"),
    ({"model_name": "m", "request_id": "r", "output_blocks": -1},
     "output_blocks: invalid value: integer `-1`, expected u32"),
    ({"model_name": "m", "request_id": "r", "output_blocks": 2**32},
     "output_blocks: invalid value: integer `4294967296`, expected u32"),
    ({"model_name": "m", "request_id": "r", "output_blocks": 1.0},
     "output_blocks: invalid type: floating point number, expected u32"),
    ({"model_name": "m", "request_id": "r", "output_blocks": True},
     "output_blocks: invalid type: boolean, expected u32"),
    ({"model_name": "m", "request_id": "r", "output_blocks": "1"},
     "output_blocks: invalid type: string, expected u32"),
    ({"model_name": "m", "request_id": "r", "output_blocks": None},
     "output_blocks: invalid type: null, expected u32"),
    ({"model_name": "m", "request_id": 1, "output_blocks": 1},
     "request_id: invalid type: integer 1, expected a string"),
    ([], "invalid type: array, expected a JSON object (OutputBlocksRequest)"),
])
def test_output_blocks_wrong_shape_is_422(client: TestClient, body: object, message: str) -> None:
    assert post(client, "/register", REGISTER).status_code == 201
    assert_error(post(client, "/output_blocks", body), 422, message)


@pytest.mark.parametrize("path", ["/nope", "/health/", "/Health", "//health", "/"])
def test_unknown_routes_are_json_404(client: TestClient, path: str) -> None:
    assert_error(client.get(path), 404, "route not found")


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("POST", "/health", "GET, HEAD"), ("PUT", "/loads", "GET, HEAD"), ("GET", "/add", "POST"),
    ("DELETE", "/register", "POST"), ("OPTIONS", "/free", "POST"), ("GET", "/output_blocks", "POST"),
])
def test_wrong_method_is_json_405_with_allow(client: TestClient, method: str, path: str, allow: str) -> None:
    response = client.request(method, path)
    assert_error(response, 405, "method not allowed")
    assert response.headers["allow"] == allow


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "json", "application/jsonx",
                                          "application/x-www-form-urlencoded"])
def test_wrong_content_type_is_415(client: TestClient, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    assert_error(client.post("/register", content=orjson.dumps(REGISTER), headers=headers), 415,
                 "expected request with `Content-Type: application/json`")


@pytest.mark.parametrize("content_type", ["Application/JSON", "application/json; charset=utf-8",
                                          "application/problem+json"])
def test_json_content_type_variants_are_accepted(client: TestClient, content_type: str) -> None:
    assert post(client, "/register", REGISTER, {"content-type": content_type}).status_code == 201


def test_body_limit_is_2_mib(client: TestClient) -> None:
    assert post(client, "/register", REGISTER).status_code == 201
    base = orjson.dumps({"model_name": "m", "sequence_hashes": []})
    padded = base[:-1] + b',"pad":"' + b"x" * (2 * 1024 * 1024 - len(base) - 9) + b'"}'
    assert len(padded) == 2 * 1024 * 1024
    assert client.post("/potential_loads", content=padded, headers=JSON).status_code == 200
    too_big = padded[:-2] + b'x"}'
    assert_error(client.post("/potential_loads", content=too_big, headers=JSON), 413)

    def chunks():  # no content-length: the limit holds while streaming too
        for _ in range(3):
            yield b" " * (1024 * 1024)
    assert_error(client.post("/potential_loads", content=chunks(), headers=JSON), 413)


@pytest.mark.parametrize("body", [b"", b"{", b"\xef\xbb\xbf{}", b"garbage", b'{"a":1,}', b"NaN",
                                  b"{'a': 1}", b'{"a": "\xff"}', b"{} trailing"])
def test_malformed_json_is_400(client: TestClient, body: bytes) -> None:
    assert_error(client.post("/register", content=body, headers=JSON), 400)


@pytest.mark.parametrize("body", [
    {k: v for k, v in REGISTER.items() if k != "worker_id"},
    {**REGISTER, "worker_id": -1},
    {**REGISTER, "worker_id": 2**64},
    {**REGISTER, "worker_id": 1.0},
    {**REGISTER, "worker_id": True},
    {**REGISTER, "worker_id": "7"},
    {**REGISTER, "block_size": 2**32},
    {**REGISTER, "model_name": None},
    {**REGISTER, "model_name": 5},
    {**REGISTER, "tenant_id": None},
    {**REGISTER, "routing_group": 1},
    None, True, 5, "register", [],
])
def test_wrong_shape_is_422(client: TestClient, body: object) -> None:
    assert_error(post(client, "/register", body), 422)


@pytest.mark.parametrize("hashes", [None, {}, "abc", [2**63], [-(2**63) - 1], [1.0], ["1"], [None], [[1]], [True]])
def test_bad_hashes_are_422(client: TestClient, hashes: object) -> None:
    assert post(client, "/register", REGISTER).status_code == 201
    assert_error(post(client, "/potential_loads", {"model_name": "m", "sequence_hashes": hashes}), 422)
    assert_error(post(client, "/add", {"model_name": "m", "request_id": "a", "worker_id": 7, "dp_rank": 0,
                                       "sequence_hashes": hashes}), 422)


def test_extreme_hashes_and_unknown_fields_are_accepted(client: TestClient) -> None:
    assert post(client, "/register", {**REGISTER, "extra": {"deep": [[[1]]]}}).status_code == 201
    response = post(client, "/potential_loads", {"model_name": "m", "sequence_hashes": [-(2**63), 2**63 - 1],
                                                 "new_isl_tokens": 2**64 - 1})
    assert response.status_code == 200
    assert response.json()[0]["potential_prefill_tokens"] == 2**64 - 1


def test_query_strings(client: TestClient) -> None:
    assert post(client, "/register", {**REGISTER, "model_name": "a b"}).status_code == 201
    assert post(client, "/register", {**REGISTER, "model_name": "é"}).status_code == 201
    assert [w["model_name"] for w in client.get("/workers").json()] == ["a b", "é"]
    assert len(client.get("/workers?model_name=a+b").json()) == 1
    assert len(client.get("/workers?model_name=%C3%A9&&unknown=1&unknown=2").json()) == 1
    assert client.get("/workers?model_name=%ZZ").json() == []
    assert client.get("/workers?model_name").json() == []
    assert_error(client.get("/workers?model_name=a&model_name=b"), 400,
                 "failed to deserialize query string: duplicate field `model_name`")
    assert_error(client.get("/loads?tenant_id=a&tenant_id=a"), 400)


def test_head_on_get_routes_has_headers_and_no_body(client: TestClient) -> None:
    assert post(client, "/register", REGISTER).status_code == 201
    full = client.get("/loads")
    head = client.head("/loads")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == full.headers["content-length"]


def test_openapi_document_is_served(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert {"/register", "/unregister", "/workers", "/add", "/prefill_complete", "/output_blocks", "/free",
            "/loads", "/potential_loads", "/health"} <= set(document["paths"])


def test_integers_out_of_range_are_named_as_such(client: TestClient) -> None:
    """Errors worded for a person: what was sent, what is expected, and how to fix it."""
    register = {"model_name": "m", "worker_id": 2**64, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert_error(post(client, "/register", register), 422,
                 "worker_id: invalid type: an integer beyond the 64-bit range (about 1.845e+19), expected u64")
    assert post(client, "/register", {**register, "worker_id": 1}).status_code == 201
    add = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [5, 2**63]}
    assert_error(post(client, "/add", add), 422,
                 "sequence_hashes[1]: invalid value: integer `9223372036854775808`, expected i64 (hashes travel "
                 "signed: write a u64 above 2**63 - 1 as value - 2**64, e.g. dynamo_lite.hashing.to_signed, "
                 "here -9223372036854775808)")
    assert_error(post(client, "/add", {**add, "sequence_hashes": [-(2**64)]}), 422,
                 "sequence_hashes[0]: invalid type: an integer beyond the 64-bit range (about -1.845e+19), "
                 "expected i64")
    assert_error(post(client, "/add", {**add, "sequence_hashes": [1.5]}), 422,
                 "sequence_hashes[0]: invalid type: floating point number, expected i64")


def test_loads_answers_are_reused_only_while_nothing_changed() -> None:
    """`/loads` is encoded once per tracker state; every kind of write must show in the next one."""
    tracker = SlotTracker(request_ttl_secs=60, clock=lambda: now[0])
    now = [0.0]
    app = create_app(tracker=tracker)
    with TestClient(app) as client:
        seen = []

        def loads(query: str = "") -> list:
            answer = client.get("/loads" + query)
            assert answer.status_code == 200
            seen.append(answer.content)
            return answer.json()

        assert loads() == []
        post(client, "/register", REGISTER)
        assert len(loads()) == 2
        add = {"model_name": "m", "request_id": "r", "worker_id": 7, "dp_rank": 1, "sequence_hashes": [1, 2],
               "new_isl_tokens": 32}
        post(client, "/add", add)
        assert [row["active_decode_blocks"] for row in loads()] == [0, 2]
        assert loads("?model_name=m") == loads() and loads("?model_name=x") == []
        post(client, "/prefill_complete", {"model_name": "m", "request_id": "r"})
        assert [row["active_prefill_tokens"] for row in loads()] == [0, 0]
        post(client, "/add", {**add, "request_id": "s", "sequence_hashes": [3]})
        assert [row["active_decode_blocks"] for row in loads()] == [0, 3]
        post(client, "/output_blocks", {"model_name": "m", "request_id": "r", "output_blocks": 2})
        assert [row["active_decode_blocks"] for row in loads()] == [0, 5]
        post(client, "/free", {"model_name": "m", "request_id": "r"})
        assert [row["active_decode_blocks"] for row in loads()] == [0, 1]
        now[0] = 61.0
        assert tracker.expire() == 1
        assert [row["active_decode_blocks"] for row in loads()] == [0, 0]
        post(client, "/unregister", {"worker_id": 7, "model_name": "m"})
        assert loads() == [] and loads() == []
        assert seen[-1] == seen[-2] == b"[]"
