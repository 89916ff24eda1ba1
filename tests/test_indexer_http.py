"""Every route, status code and error shape of the indexer, in process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient
from support.http_support import JSON, assert_error, post

from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed
from dynamo_lite.indexer.app import IndexerConfig, create_app

pytestmark = pytest.mark.unit

TOKENS = list(range(1, 65))
LOCAL = local_block_hashes(TOKENS, 16)  # the reference's range(1, 65) / 16 vector


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app()) as client:
        yield client






def stored(worker: int, event_id: int, externals: list[int], locals_: list[int], parent: int | None = None,
           dp_rank: int = 0, tier: str = "device") -> dict:
    return {"worker_id": worker, "storage_tier": tier, "event": {"event_id": event_id, "dp_rank": dp_rank, "data": {
        "stored": {"parent_hash": parent, "blocks": [
            {"block_hash": e, "tokens_hash": h} for e, h in zip(externals, locals_)]}}}}


def removed(worker: int, event_id: int, externals: list[int], dp_rank: int = 0) -> dict:
    return {"worker_id": worker, "event": {"event_id": event_id, "dp_rank": dp_rank,
                                           "data": {"removed": {"block_hashes": externals}}}}


def document(*events: dict, key: str = "llama:default", block_size: int = 16) -> dict:
    return {key: {"block_size": block_size, "events": list(events)}}


def query(client: TestClient, hashes: list[int], model: str = "llama") -> dict:
    response = post(client, "/query_by_hash", {"model_name": model, "block_hashes": [to_signed(h) for h in hashes]})
    assert response.status_code == 200, response.text
    return response.json()


def test_reference_dump_example(client: TestClient) -> None:
    """Section 9.2 of the reference notes: the same events give the same scores and dump."""
    report = post(client, "/events", document(
        stored(7, 0, [161, 162, 163, 164], LOCAL), stored(8, 0, [161, 162], LOCAL[:2]), removed(7, 1, [164]),
    ))
    assert report.json() == {"applied": 3, "skipped": 0, "rejected": 0, "unknown_removals": 0, "gap_count": 0,
                             "rejections": [], "gaps": []}
    answer = query(client, LOCAL)
    assert answer["scores"] == {"7": {"0": 48}, "8": {"0": 32}}
    assert answer["frequencies"] == []
    assert answer["instances"]["7"] == {"longest_matched": 48, "gpu": 48, "dp": {"0": 48}, "cpu": 48, "disk": 48}
    by_tokens = post(client, "/query", {"model_name": "llama", "token_ids": TOKENS + [5, 5, 5]})
    assert by_tokens.json() == answer
    dump = client.get("/dump").json()
    assert list(dump) == ["llama:default"] and dump["llama:default"]["block_size"] == 16
    events = dump["llama:default"]["events"]
    assert [(e["worker_id"], [b["block_hash"] for b in e["event"]["data"]["stored"]["blocks"]]) for e in events] == [
        (7, [161, 162, 163]), (8, [161, 162])]
    assert events[0]["event"]["data"]["stored"]["blocks"][0]["tokens_hash"] == 16863443419780771464
    assert all(e["storage_tier"] == "device" and e["residency_domain"] == "worker" for e in events)


def test_signed_and_unsigned_hashes_are_the_same_block(client: TestClient) -> None:
    post(client, "/events", document(stored(1, 0, [2**64 - 5], LOCAL[:1])))
    post(client, "/events", document(removed(1, 1, [-5])))
    assert post(client, "/query_by_hash", {"model_name": "llama", "block_hashes": [to_signed(LOCAL[0])]}).json()[
        "scores"] == {}


def test_lower_tiers_extend_the_device_match(client: TestClient) -> None:
    post(client, "/events", document(
        stored(11, 0, [1, 2], LOCAL[:2]),
        stored(11, 1, [3], LOCAL[2:3], parent=2, tier="host_pinned"),
        stored(11, 2, [4], LOCAL[3:4], parent=3, tier="disk"),
    ))
    answer = query(client, LOCAL)
    assert answer["scores"] == {"11": {"0": 32}}
    assert answer["instances"]["11"] == {"longest_matched": 64, "gpu": 32, "dp": {"0": 32}, "cpu": 48, "disk": 64}


def test_watermarks_skip_redeliveries_and_report_gaps(client: TestClient) -> None:
    first = post(client, "/events", document(stored(1, 0, [1], LOCAL[:1]))).json()
    assert first["applied"] == 1
    again = post(client, "/events", document(stored(1, 0, [1], LOCAL[:1]), stored(1, 3, [2], LOCAL[1:2], parent=1)))
    body = again.json()
    assert (body["applied"], body["skipped"], body["gap_count"]) == (1, 1, 1)
    assert body["gaps"] == [{"worker_id": 1, "dp_rank": 0, "expected": 1, "got": 3}]
    assert query(client, LOCAL)["scores"] == {"1": {"0": 32}}


def test_unknown_parent_is_rejected_and_reported(client: TestClient) -> None:
    body = post(client, "/events", document(stored(1, 0, [1], LOCAL[:1]), stored(2, 0, [2], LOCAL[1:2], parent=1))).json()
    assert (body["applied"], body["rejected"]) == (1, 1)
    assert body["rejections"][0]["partition"] == "llama:default" and body["rejections"][0]["index"] == 1
    assert "parent" in body["rejections"][0]["reason"]


def test_a_bad_document_applies_nothing_and_names_the_event(client: TestClient) -> None:
    bad = document(stored(1, 0, [1], LOCAL[:1]), stored(1, 1, ["x"], LOCAL[1:2], parent=1))
    response = post(client, "/events", bad)
    assert_error(response, 422)
    assert "events[1]" in response.json()["error"]
    assert_error(post(client, "/query_by_hash", {"model_name": "llama", "block_hashes": []}), 404,
                 "no indexer for model=llama tenant_id=default")


def test_register_workers_and_unregister(client: TestClient) -> None:
    # Nobody publishes there: the listener stays "connecting", nothing blocks.
    register = {"instance_id": 301, "model_name": "m5", "block_size": 4, "dp_rank": 1,
                "endpoint": "ipc:///nonexistent/engine"}
    assert post(client, "/register", register).status_code == 201
    assert_error(post(client, "/register", register), 409, "instance 301 dp_rank 1 already registered")
    assert_error(post(client, "/register", {**register, "dp_rank": 0, "block_size": 8}), 409,
                 "block_size mismatch for model=m5 tenant_id=default: existing=4, requested=8")
    assert_error(post(client, "/register", {**register, "model_name": "other"}), 409,
                 "instance 301 is already registered for model=m5 tenant_id=default")
    assert_error(post(client, "/register", {**register, "instance_id": 9, "model_name": "new", "block_size": 0}), 400,
                 "block_size must be greater than 0")
    assert_error(post(client, "/register", {**register, "instance_id": 9, "tenant_id": "a:b"}), 400)
    assert post(client, "/register", {**register, "dp_rank": 0}).status_code == 201
    workers = client.get("/workers?model_name=m5").json()
    listeners = [rank.pop("listener") for rank in workers[0]["ranks"]]
    assert workers == [{"instance_id": 301, "model_name": "m5", "tenant_id": "default", "block_size": 4, "ranks": [
        {"dp_rank": 0, "source": "events", "registered": True, "endpoint": "ipc:///nonexistent/engine", "blocks": 0,
         "lower_tier_blocks": 0, "approximate_blocks": 0, "last_event_id": None, "replay_endpoint": None},
        {"dp_rank": 1, "source": "events", "registered": True, "endpoint": "ipc:///nonexistent/engine", "blocks": 0,
         "lower_tier_blocks": 0, "approximate_blocks": 0, "last_event_id": None, "replay_endpoint": None}]}]
    assert [(listener["status"], listener["endpoint"], listener["batches"]) for listener in listeners] == [
        ("connecting", "ipc:///nonexistent/engine", 0)] * 2
    assert client.get("/workers?tenant_id=nope").json() == []
    assert_error(post(client, "/unregister", {"instance_id": 401, "model_name": "m5"}), 404, "instance 401 not found")
    assert_error(post(client, "/unregister", {"instance_id": 301, "model_name": "m9"}), 404,
                 "instance 301 is registered for model=m5 tenant_id=default")
    assert post(client, "/unregister", {"instance_id": 301, "model_name": "m5", "dp_rank": 1}).status_code == 200
    assert [r["dp_rank"] for r in client.get("/workers").json()[0]["ranks"]] == [0]
    assert post(client, "/unregister", {"instance_id": 301, "model_name": "m5"}).status_code == 200
    assert client.get("/workers").json() == []
    assert_error(post(client, "/query_by_hash", {"model_name": "m5", "block_hashes": []}), 404)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"endpoint": "nonsense"}, "invalid ZMQ endpoint `nonsense`: missing scheme"),
        ({"endpoint": "tcp://host"}, "invalid ZMQ endpoint `tcp://host`: expected tcp://host:port with a port in 1..65535"),
        ({"endpoint": "tcp://host:0"}, "invalid ZMQ endpoint `tcp://host:0`: expected tcp://host:port with a port in 1..65535"),
        ({"endpoint": "tcp://*:5557"}, "invalid ZMQ endpoint `tcp://*:5557`: expected tcp://host:port with a port in 1..65535"),
        ({"endpoint": "udp://h:1"}, "invalid ZMQ endpoint `udp://h:1`: scheme must be tcp, ipc or inproc"),
        ({"endpoint": "ipc://"}, "invalid ZMQ endpoint `ipc://`: empty ipc address"),
        ({"endpoint": "tcp://h:1", "replay_endpoint": "bogus"}, "invalid replay endpoint `bogus`: missing scheme"),
        ({"replay_endpoint": "tcp://h:2"}, "replay_endpoint needs an endpoint to subscribe to"),
    ],
)
def test_register_checks_endpoints(client: TestClient, fields: dict[str, str], message: str) -> None:
    body = {"instance_id": 5, "model_name": "m", "block_size": 4, **fields}
    assert_error(post(client, "/register", body), 400, message)
    assert client.get("/workers").json() == []


def test_unregister_drops_the_workers_blocks(client: TestClient) -> None:
    post(client, "/events", document(stored(1, 0, [1, 2], LOCAL[:2]), stored(2, 0, [1], LOCAL[:1])))
    assert post(client, "/unregister", {"instance_id": 1, "model_name": "llama"}).status_code == 200
    assert query(client, LOCAL)["scores"] == {"2": {"0": 16}}


def test_routing_group_alias_and_cache_salt(client: TestClient) -> None:
    post(client, "/events", document(stored(1, 0, [1], LOCAL[:1]), key="llama:g"))
    ok = post(client, "/query_by_hash", {"model_name": "llama", "routing_group": "g",
                                         "block_hashes": [to_signed(LOCAL[0])], "cache_salt": None})
    assert ok.json()["scores"] == {"1": {"0": 16}}
    assert_error(post(client, "/query_by_hash", {"model_name": "llama", "tenant_id": "g", "block_hashes": [],
                                                 "cache_salt": "s"}), 400)
    assert_error(post(client, "/query_by_hash", {"model_name": "llama", "tenant_id": "g", "routing_group": "h",
                                                 "block_hashes": []}), 400)


def test_query_hashes_with_lora_and_salt(client: TestClient) -> None:
    salted = local_block_hashes(list(range(16)), 16, cache_salt="tenant-a")
    assert salted == [2130915519417463704]
    post(client, "/events", document(stored(1, 0, [1], salted)))
    assert post(client, "/query", {"model_name": "llama", "token_ids": list(range(16)),
                                   "cache_salt": "tenant-a"}).json()["scores"] == {"1": {"0": 16}}
    assert post(client, "/query", {"model_name": "llama", "token_ids": list(range(16))}).json()["scores"] == {}
    assert post(client, "/query", {"model_name": "llama", "token_ids": list(range(16)), "lora_name": "my-lora",
                                   "cache_salt": None}).json()["scores"] == {}


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], ["1"], [True], None, "abc"])
def test_bad_token_ids_are_422(client: TestClient, tokens: object) -> None:
    post(client, "/events", document(stored(1, 0, [1], LOCAL[:1])))
    assert_error(post(client, "/query", {"model_name": "llama", "token_ids": tokens}), 422)


@pytest.mark.parametrize("hashes", [[2**63], [1.0], ["1"], [None], None, {}])
def test_bad_query_hashes_are_422(client: TestClient, hashes: object) -> None:
    assert_error(post(client, "/query_by_hash", {"model_name": "llama", "block_hashes": hashes}), 422)


def test_peers_routes(client: TestClient) -> None:
    assert client.get("/peers").json() == []
    assert post(client, "/register_peer", {"url": "http://a:1/"}).status_code == 201
    assert post(client, "/register_peer", {"url": "http://a:1"}).status_code == 201
    assert client.get("/peers").json() == ["http://a:1"]
    assert_error(post(client, "/register_peer", {"url": "a:1"}), 400)
    assert_error(post(client, "/register_peer", {}), 422)
    assert post(client, "/deregister_peer", {"url": "http://a:1"}).status_code == 200
    assert_error(post(client, "/deregister_peer", {"url": "http://a:1"}), 404, "peer not found")


def test_body_limits(client: TestClient) -> None:
    big_query = {"model_name": "llama", "token_ids": [1] * 1_200_000}  # ~3.6 MB: over 2 MiB, under 8 MiB
    assert_error(post(client, "/query", big_query), 404)  # read and parsed, then: no partition
    assert_error(post(client, "/query_by_hash", {"model_name": "llama", "block_hashes": [1] * 1_200_000}), 413)
    assert_error(client.post("/events", content=b" " * (8 * 1024 * 1024 + 1), headers=JSON), 413)


def test_http_conventions(client: TestClient) -> None:
    assert client.get("/health").status_code == 200 and client.get("/health").content == b""
    assert_error(client.get("/nope"), 404, "route not found")
    assert_error(client.get("/dump/"), 404, "route not found")
    response = client.post("/dump")
    assert_error(response, 405, "method not allowed")
    assert response.headers["allow"] == "GET, HEAD"
    assert_error(client.post("/events", content=b"{}", headers={"content-type": "text/plain"}), 415)
    assert_error(client.post("/events", content=b"{", headers=JSON), 400)
    assert_error(post(client, "/events", []), 422)
    assert post(client, "/events", {}).json()["applied"] == 0
    assert client.get("/openapi.json").json()["openapi"].startswith("3.1")


def test_dump_then_events_on_a_fresh_instance_answers_the_same() -> None:
    prefixes = [local_block_hashes(list(range(p * 1000, p * 1000 + 16 * 8)), 16) for p in range(3)]
    events, next_id = [], {}
    for worker in range(4):
        for p, chain in enumerate(prefixes):
            if (worker + p) % 2 == 0:
                externals = sequence_hashes(chain)
                events.append(stored(worker, next_id.setdefault(worker, 0), externals[:6], chain[:6]))
                next_id[worker] += 1
                events.append(removed(worker, next_id[worker], externals[4 + worker % 2:6]))
                next_id[worker] += 1
    with TestClient(create_app()) as source, TestClient(create_app()) as copy:
        post(source, "/events", document(*events))
        dump = source.get("/dump").json()
        report = post(copy, "/events", dump).json()
        assert report["rejected"] == 0
        for chain in prefixes:
            for length in range(len(chain) + 1):
                assert query(copy, chain[:length]) == query(source, chain[:length])
        assert copy.get("/dump").json() == dump


def test_full_garbage_collections_run_on_a_timer() -> None:
    """The indexer collects only young objects on its own (a full scan of a large index pauses
    every request); the app runs the full collections."""
    import gc
    import time

    before = gc.get_stats()[2]["collections"]
    with TestClient(create_app(IndexerConfig(full_gc_interval_secs=0.05))):
        # Two timer periods suffice; a loaded machine may stall the app's thread for seconds.
        deadline = time.monotonic() + 20
        while gc.get_stats()[2]["collections"] < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert gc.get_stats()[2]["collections"] >= before + 2
