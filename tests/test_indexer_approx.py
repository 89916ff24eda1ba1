"""Approximate indexing (`/routed`): the core with an injected clock, the HTTP route, the client.

The property-based comparison with a simple model is tests/test_indexer_approx_model.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest
from starlette.testclient import TestClient
from support.fake_clock import WALL, Clock
from support.http_support import JSON, assert_error, post
from support.indexer_events import L, apply, cleared, doc, removed, scores, stored
from support.reference_server import free_port, require_reference_or_skip, running_server, running_service

from dynamo_lite.base.errors import Conflict, NotFound
from dynamo_lite.client import AsyncIndexerClient, RoutedReport, ServiceCallError
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed, to_signed_list
from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.app import IndexerConfig, create_app
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import decode_events_document, parse_events_document
from dynamo_lite.indexer.snapshot import encode

TTL = 120.0


def make_indexer(clock: Clock, *, max_blocks: int = 0, ttl: float = TTL, tree_max_blocks: int = 0) -> Indexer:
    indexer = Indexer(tree_max_blocks, approx_ttl_secs=ttl, approx_max_blocks=max_blocks, clock=clock,
                      wall_clock=clock.wall)
    indexer.register(7, "llama", "default", 16)
    return indexer


@pytest.fixture
def clock() -> Clock:
    return Clock()


def rank_info(indexer: Indexer, instance_id: int, dp_rank: int = 0) -> tuple[str, bool, int, int]:
    """(source, registered, device blocks, approximate blocks) of one rank in `workers()`."""
    for worker in indexer.workers():
        for rank in worker.ranks:
            if (worker.instance_id, rank.dp_rank) == (instance_id, dp_rank):
                return rank.source, rank.registered, rank.blocks, rank.approximate_blocks
    raise AssertionError(f"no rank {instance_id}:{dp_rank}")


# --- TTL, refresh, bound ---------------------------------------------------------------------


@pytest.mark.unit
def test_routed_blocks_count_like_device_blocks_until_their_ttl_runs_out(clock: Clock) -> None:
    indexer = make_indexer(clock)
    report = indexer.record_routed("llama", "default", 7, 0, L)
    assert (report.recorded, report.new, report.evicted) == (4, 4, 0)
    answer = query_answer(indexer.query("llama", "default", L))
    assert answer == {"scores": {"7": {"0": 64}}, "frequencies": [], "instances": {"7": {
        "longest_matched": 64, "gpu": 64, "dp": {"0": 64}, "cpu": 64, "disk": 64}}}
    assert query_answer(indexer.query("llama", "default", to_signed_list(L))) == answer
    assert scores(indexer, L[:2] + [12345]) == {"7": {"0": 32}}
    assert rank_info(indexer, 7) == ("approximate", True, 0, 4)
    clock.now = TTL - 0.001
    assert scores(indexer, L) == {"7": {"0": 64}}
    clock.now = TTL
    assert scores(indexer, L) == {}  # expired by the query itself, without a sweep
    assert rank_info(indexer, 7) == ("approximate", True, 0, 0)
    assert indexer.approx_totals.expired == 4
    assert indexer.partitions[("llama", "default")].approx is None  # exact matching only again
    assert indexer.partitions[("llama", "default")].tree.slots.keys() == {(7, 0)}


@pytest.mark.unit
def test_routing_again_restarts_the_ttl_of_the_blocks_it_names(clock: Clock) -> None:
    indexer = make_indexer(clock)
    indexer.record_routed("llama", "default", 7, 0, L)
    clock.now = 100
    report = indexer.record_routed("llama", "default", 7, 0, L[:2])
    assert (report.recorded, report.new, report.evicted) == (2, 0, 0)
    clock.now = 150
    assert scores(indexer, L) == {"7": {"0": 32}}  # the first two were refreshed at 100
    clock.now = 220
    assert scores(indexer, L) == {}
    clock.now = 230
    report = indexer.record_routed("llama", "default", 7, 0, L[:3])  # after expiry: new again
    assert (report.recorded, report.new) == (3, 3)


@pytest.mark.unit
def test_a_new_tail_under_a_routed_prefix_extends_it(clock: Clock) -> None:
    indexer = make_indexer(clock)
    indexer.record_routed("llama", "default", 7, 0, L[:2])
    report = indexer.record_routed("llama", "default", 7, 0, L)
    assert (report.recorded, report.new) == (4, 2)
    assert scores(indexer, L) == {"7": {"0": 64}}
    other = [L[0], 999, 1000]  # a sibling branch under the first block
    assert indexer.record_routed("llama", "default", 7, 0, other).new == 2
    assert scores(indexer, other) == {"7": {"0": 48}}
    assert rank_info(indexer, 7)[3] == 6


@pytest.mark.unit
def test_the_bound_evicts_what_expires_first_deepest_first(clock: Clock) -> None:
    indexer = make_indexer(clock, max_blocks=5)
    indexer.record_routed("llama", "default", 7, 0, L[:3])
    clock.now = 1
    report = indexer.record_routed("llama", "default", 8, 0, L[:3])  # 6 > 5: rank 7's deepest goes
    assert (report.recorded, report.new, report.evicted) == (3, 3, 1)
    assert scores(indexer, L) == {"7": {"0": 32}, "8": {"0": 48}}
    clock.now = 2
    indexer.record_routed("llama", "default", 7, 0, L[:1])  # refreshed: now the last to expire
    report = indexer.record_routed("llama", "default", 9, 0, L[:2])
    assert report.evicted == 2  # rank 7's second block, then rank 8's third
    assert scores(indexer, L) == {"7": {"0": 16}, "8": {"0": 32}, "9": {"0": 32}}
    assert indexer.approx_totals.evicted == 3
    # A chain longer than the bound keeps its first blocks.
    indexer = make_indexer(clock, max_blocks=2)
    assert indexer.record_routed("llama", "default", 7, 0, L).evicted == 2
    assert scores(indexer, L) == {"7": {"0": 32}}


@pytest.mark.unit
def test_the_sweep_expires_every_partition(clock: Clock) -> None:
    indexer = make_indexer(clock)
    indexer.register(1, "other", "t", 4)
    indexer.record_routed("llama", "default", 7, 0, L)
    indexer.record_routed("other", "t", 1, 0, [5, 6])
    clock.now = 60
    indexer.record_routed("other", "t", 1, 0, [5])
    clock.now = TTL
    assert indexer.expire_approximations() == 5  # all of llama, and [5, 6]'s tail in other
    assert indexer.approximate_blocks() == 1
    assert query_answer(indexer.query("other", "t", [5, 6]))["scores"] == {"1": {"0": 4}}
    assert indexer.expire_approximations() == 0


# --- with events -----------------------------------------------------------------------------


@pytest.mark.unit
def test_events_and_approximations_coexist_and_a_rank_scores_the_longer(clock: Clock) -> None:
    indexer = make_indexer(clock)
    apply(indexer, doc(stored(7, 0, None, [1, 2], L[:2]), stored(8, 0, None, [11, 12, 13], L[:3])))
    indexer.record_routed("llama", "default", 7, 0, L)  # the rank is fed by events: still recorded
    indexer.record_routed("llama", "default", 8, 0, L[:1])
    indexer.record_routed("llama", "default", 9, 0, L[:3])  # an unknown rank, only approximated
    assert scores(indexer, L) == {"7": {"0": 64}, "8": {"0": 48}, "9": {"0": 48}}
    assert rank_info(indexer, 7) == ("events", True, 2, 4)
    assert rank_info(indexer, 9) == ("approximate", False, 0, 3)
    clock.now = TTL
    assert scores(indexer, L) == {"7": {"0": 32}, "8": {"0": 48}}


@pytest.mark.unit
def test_lower_tiers_count_past_the_longer_match(clock: Clock) -> None:
    indexer = make_indexer(clock)
    apply(indexer, doc(
        stored(7, 0, None, [1], L[:1]),
        stored(7, 1, 1, [2, 3], L[1:3], storage_tier="host_pinned"),
        stored(7, 2, 3, [4], L[3:4], storage_tier="disk"),
    ))
    assert query_answer(indexer.query("llama", "default", L))["instances"]["7"] == {
        "longest_matched": 64, "gpu": 16, "dp": {"0": 16}, "cpu": 48, "disk": 64}
    indexer.record_routed("llama", "default", 7, 0, L[:2])
    assert query_answer(indexer.query("llama", "default", L))["instances"]["7"] == {
        "longest_matched": 64, "gpu": 32, "dp": {"0": 32}, "cpu": 48, "disk": 64}
    indexer.record_routed("llama", "default", 7, 0, L)
    assert query_answer(indexer.query("llama", "default", L))["instances"]["7"] == {
        "longest_matched": 64, "gpu": 64, "dp": {"0": 64}, "cpu": 64, "disk": 64}


@pytest.mark.unit
def test_a_removed_event_drops_the_approximations_of_the_blocks_it_removes(clock: Clock) -> None:
    indexer = make_indexer(clock)
    apply(indexer, doc(stored(7, 0, None, [1, 2, 3], L[:3])))
    indexer.record_routed("llama", "default", 7, 0, L)
    indexer.record_routed("llama", "default", 8, 0, L)
    apply(indexer, doc(removed(7, 1, [2])))  # mid-chain: blocks 3 and 4 stop counting for rank 7
    assert scores(indexer, L) == {"7": {"0": 16}, "8": {"0": 64}}
    assert rank_info(indexer, 7)[2:] == (2, 3)  # below the gap still held, as for events
    indexer.record_routed("llama", "default", 7, 0, L[:2])  # routed again: the gap is filled
    assert scores(indexer, L) == {"7": {"0": 64}, "8": {"0": 64}}
    apply(indexer, doc(removed(7, 2, [3, 424242]), removed(7, 2, [3], storage_tier="host_pinned")))
    assert scores(indexer, L) == {"7": {"0": 32}, "8": {"0": 64}}
    assert rank_info(indexer, 7)[3] == 3


@pytest.mark.unit
def test_cleared_and_engine_restarts_drop_every_approximation_of_the_rank_only(clock: Clock) -> None:
    indexer = make_indexer(clock)
    for rank in (7, 8, 9):
        indexer.record_routed("llama", "default", rank, 0, L)
    apply(indexer, doc(cleared(7, 0)))
    assert scores(indexer, L) == {"8": {"0": 64}, "9": {"0": 64}}
    assert rank_info(indexer, 7) == ("events", True, 0, 0)
    assert indexer.reset_rank("llama", "default", 8, 0) == 0
    assert scores(indexer, L) == {"9": {"0": 64}}
    assert indexer.approximate_blocks() == 4


@pytest.mark.unit
def test_unregister_drops_the_approximations(clock: Clock) -> None:
    indexer = make_indexer(clock)
    indexer.register(7, "llama", "default", 16, dp_rank=1)
    indexer.record_routed("llama", "default", 7, 0, L)
    indexer.record_routed("llama", "default", 7, 1, L[:2])
    indexer.record_routed("llama", "default", 8, 0, L[:1])
    indexer.unregister(7, "llama", "default", 0)
    assert scores(indexer, L) == {"7": {"1": 32}, "8": {"0": 16}}
    indexer.unregister(7, "llama", "default")
    indexer.unregister(8, "llama", "default")
    assert ("llama", "default") not in indexer.partitions
    indexer.register(7, "llama", "default", 16)
    assert scores(indexer, L) == {}
    assert indexer.approximate_blocks() == 0


@pytest.mark.unit
def test_source_says_how_each_rank_is_indexed(clock: Clock) -> None:
    indexer = make_indexer(clock)
    assert rank_info(indexer, 7) == ("none", True, 0, 0)
    indexer.record_routed("llama", "default", 7, 0, [])  # records nothing, changes nothing
    assert rank_info(indexer, 7) == ("none", True, 0, 0)
    indexer.record_routed("llama", "default", 7, 0, L)
    assert rank_info(indexer, 7) == ("approximate", True, 0, 4)
    clock.now = TTL
    indexer.expire_approximations()
    assert rank_info(indexer, 7) == ("approximate", True, 0, 0)  # still a rank without events
    apply(indexer, doc(stored(7, 0, None, [1], L[:1])))
    assert rank_info(indexer, 7) == ("events", True, 1, 0)
    indexer.record_routed("llama", "default", 8, 0, L)
    indexer.register(8, "llama", "default", 16)  # registering adopts the rank, as after events
    assert rank_info(indexer, 8) == ("approximate", True, 0, 4)
    indexer.register(9, "llama", "default", 16, endpoint="tcp://engine:5557")
    assert rank_info(indexer, 9) == ("events", True, 0, 0)  # its engine publishes


@pytest.mark.unit
def test_unknown_partitions_and_foreign_instances_are_refused(clock: Clock) -> None:
    indexer = make_indexer(clock)
    indexer.register(3, "other", "default", 16)
    with pytest.raises(NotFound):
        indexer.record_routed("nope", "default", 7, 0, L)
    with pytest.raises(NotFound):
        indexer.record_routed("llama", "t2", 7, 0, L)
    with pytest.raises(Conflict, match="instance 3 is already registered for model=other"):
        indexer.record_routed("llama", "default", 3, 0, L)
    assert indexer.approximate_blocks() == 0


@pytest.mark.unit
def test_token_ids_are_hashed_as_query_hashes_them(clock: Clock) -> None:
    indexer = make_indexer(clock)
    tokens = list(range(1, 70))  # 4 full blocks and a partial one, ignored
    report = indexer.record_routed_tokens("llama", "default", 7, 0, tokens, lora_name="adapter")
    assert report.recorded == 4
    salted = local_block_hashes(tokens, 16, lora_name="adapter")
    assert scores(indexer, salted) == {"7": {"0": 64}}
    assert query_answer(indexer.query_tokens("llama", "default", tokens))["scores"] == {}
    indexer.record_routed_tokens("llama", "default", 8, 0, tokens[:40], cache_salt="s")
    assert query_answer(indexer.query_tokens("llama", "default", tokens, cache_salt="s"))["scores"] == {"8": {"0": 32}}


# --- dumps, snapshots, recovery --------------------------------------------------------------


@pytest.mark.unit
def test_dumps_carry_approximations_with_their_expiry_and_reload_them(clock: Clock) -> None:
    indexer = make_indexer(clock)
    apply(indexer, doc(stored(7, 0, None, [1, 2], L[:2])))
    assert "approximations" not in indexer.dump()["llama:default"]  # Dynamo's exact shape
    indexer.record_routed("llama", "default", 8, 0, L[:2])
    clock.now = 30
    indexer.record_routed("llama", "default", 8, 0, L)
    dump = indexer.dump()
    section = dump["llama:default"]
    assert [event["worker_id"] for event in section["events"]] == [7]  # no shadow leaks in
    names = sequence_hashes(L)
    assert section["approximations"] == [{"worker_id": 8, "dp_rank": 0, "parent_hash": None, "blocks": [
        {"block_hash": name, "tokens_hash": local, "expires_at": WALL + 150.0}
        for name, local in zip(names, L)]}]
    assert orjson.loads(encode(indexer)) == dump  # the snapshot file is the same document
    assert decode_events_document(orjson.dumps(dump)) == parse_events_document(dump)  # both parsers agree

    # Loaded 60 s later (a restart): the same answers, and each block expires when it said.
    clock.now = 90
    copy = Indexer(approx_ttl_secs=TTL, clock=clock, wall_clock=clock.wall)
    report = copy.load_dump(dump)
    assert (report.applied, report.rejected) == (1, 0)
    assert copy.dump() == indexer.dump()
    assert copy.query("llama", "default", L) == indexer.query("llama", "default", L)
    assert rank_info(copy, 8) == ("approximate", False, 0, 4)
    clock.now = 150
    assert scores(copy, L) == {"7": {"0": 32}}


@pytest.mark.unit
def test_loading_caps_the_ttl_drops_the_expired_and_keeps_the_later_expiry(clock: Clock) -> None:
    def entry(worker: int, expires_at: list[float], parent: int | None = None, locals_: list[int] = L) -> dict:
        names = sequence_hashes(locals_)[: len(expires_at)]
        return {"worker_id": worker, "parent_hash": parent, "blocks": [
            {"block_hash": name, "tokens_hash": local, "expires_at": at}
            for name, local, at in zip(names, locals_, expires_at)]}

    indexer = make_indexer(clock)
    indexer.record_routed("llama", "default", 9, 0, L[:1])  # expires at 120
    clock.now = 50
    document = {"llama:default": {"block_size": 16, "events": [], "approximations": [
        entry(8, [WALL + 10_000, WALL + 100, WALL + 40]),  # capped at 50 + TTL; the last one is gone
        entry(9, [WALL + 150]),  # later than what rank 9 has: kept
        entry(10, [WALL + 500], parent=424242),  # a parent the rank has no approximation of
    ]}}
    report = indexer.apply_events(parse_events_document(document))
    assert report.rejected == 1
    assert report.rejections[0].reason == (
        "approximations[2]: parent_hash 424242 is not an approximate block of worker 10 dp_rank 0")
    assert scores(indexer, L) == {"8": {"0": 32}, "9": {"0": 16}}
    clock.now = 100
    assert scores(indexer, L) == {"8": {"0": 16}, "9": {"0": 16}}
    clock.now = 150
    assert scores(indexer, L) == {"8": {"0": 16}}
    clock.now = 50 + TTL
    assert scores(indexer, L) == {}
    assert rank_info(indexer, 10) == ("approximate", False, 0, 0)


@pytest.mark.unit
def test_an_events_document_with_only_approximations_creates_its_partition(clock: Clock) -> None:
    indexer = Indexer(clock=clock, wall_clock=clock.wall)
    names = sequence_hashes(L[:1])
    document = {"m:t": {"block_size": 16, "events": [], "approximations": [
        {"worker_id": 4, "blocks": [
            {"block_hash": names[0], "tokens_hash": to_signed(L[0]), "expires_at": WALL + 1}]}]}}
    indexer.apply_events(parse_events_document(document))
    assert query_answer(indexer.query("m", "t", L))["scores"] == {"4": {"0": 16}}
    with pytest.raises(Conflict):  # instance 4 belongs to m:t
        indexer.apply_events(parse_events_document({**document, "m:other": document["m:t"]}))


@pytest.mark.unit
def test_approximations_are_validated_like_events() -> None:
    def refused(approximations: object) -> str:
        with pytest.raises(Exception) as failure:
            parse_events_document({"m:t": {"block_size": 16, "events": [], "approximations": approximations}})
        return str(failure.value)

    assert "approximations" in refused({})
    assert '"m:t".approximations[0].worker_id: expected an integer in the u64 range, got string' == refused(
        [{"worker_id": "7", "blocks": []}])
    assert "expires_at" in refused([{"worker_id": 7, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}])
    assert "m:t\".approximations[0].blocks[0].block_hash" in refused(
        [{"worker_id": 7, "blocks": [{"block_hash": 2**64, "tokens_hash": 2, "expires_at": 1}]}])
    assert "approximations[0].worker_id" in refused([{"worker_id": 2**64, "blocks": []}])


@pytest.mark.unit
def test_a_tree_bound_that_drops_approximated_blocks_leaves_harmless_timers(clock: Clock) -> None:
    indexer = make_indexer(clock, tree_max_blocks=4)
    indexer.record_routed("llama", "default", 7, 0, L)
    # 7 pairs > 4: the tree's least recently used go, the three deepest approximations.
    apply(indexer, doc(stored(8, 0, None, [1, 2, 3], [5, 6, 7])))
    assert indexer.approximate_blocks() == 1
    assert scores(indexer, L) == {"7": {"0": 16}}
    assert len(indexer.dump()["llama:default"]["approximations"][0]["blocks"]) == 1
    clock.now = TTL
    assert indexer.expire_approximations() == 1  # the timers of the dropped three lapse unnoticed
    assert indexer.approx_totals.expired == 1
    assert indexer.partitions[("llama", "default")].approx is None


# --- HTTP ------------------------------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(IndexerConfig(approx_max_blocks=6))) as client:
        yield client


def routed(client: TestClient, body: dict) -> httpx.Response:
    return post(client, "/routed", {"model_name": "llama", "instance_id": 7, **body})


@pytest.mark.unit
def test_routed_route_records_and_reports(client: TestClient) -> None:
    assert_error(routed(client, {"block_hashes": to_signed_list(L)}), 404,
                 "no indexer for model=llama tenant_id=default")
    assert post(client, "/register", {"instance_id": 7, "model_name": "llama", "block_size": 16}).status_code == 201
    response = routed(client, {"block_hashes": to_signed_list(L)})
    assert response.status_code == 200
    assert response.json() == {"recorded": 4, "new": 4, "evicted": 0}
    assert routed(client, {"token_ids": list(range(1, 33)), "dp_rank": 1, "routing_group": "default"}).json() == {
        "recorded": 2, "new": 2, "evicted": 0}
    assert routed(client, {"instance_id": 8, "block_hashes": []}).json() == {"recorded": 0, "new": 0, "evicted": 0}
    query = post(client, "/query_by_hash", {"model_name": "llama", "block_hashes": to_signed_list(L)}).json()
    assert query["scores"] == {"7": {"0": 64, "1": 32}}
    ranks = client.get("/workers").json()[0]["ranks"]
    assert [(r["dp_rank"], r["source"], r["registered"], r["approximate_blocks"]) for r in ranks] == [
        (0, "approximate", True, 4), (1, "approximate", False, 2)]
    assert routed(client, {"instance_id": 9, "block_hashes": [1, 2, 3]}).json()["evicted"] == 3
    metrics = client.get("/metrics").text
    assert "dynamo_lite_indexer_approximate_blocks 6.0" in metrics
    assert "dynamo_lite_indexer_approximate_blocks_evicted_total 3.0" in metrics
    assert "dynamo_lite_indexer_approximate_ttl_seconds 120.0" in metrics
    dump = client.get("/dump").json()
    assert len(dump["llama:default"]["approximations"]) == 3
    assert post(client, "/unregister", {"instance_id": 7, "model_name": "llama"}).status_code == 200
    assert post(client, "/query_by_hash", {"model_name": "llama", "block_hashes": [1, 2]}).json()["scores"] == {
        "9": {"0": 32}}


@pytest.mark.unit
def test_routed_route_refuses_bad_requests(client: TestClient) -> None:
    assert post(client, "/register", {"instance_id": 7, "model_name": "llama", "block_size": 16}).status_code == 201
    assert post(client, "/register", {"instance_id": 3, "model_name": "other", "block_size": 16}).status_code == 201
    exactly_one = "give exactly one of block_hashes and token_ids"
    assert_error(routed(client, {}), 422, exactly_one)
    assert_error(routed(client, {"block_hashes": [1], "token_ids": [1]}), 422, exactly_one)
    assert_error(routed(client, {"block_hashes": None}), 422)
    assert_error(routed(client, {"block_hashes": [2**63]}), 422)
    assert_error(routed(client, {"block_hashes": [1.0]}), 422)
    assert_error(routed(client, {"token_ids": [-1]}), 422)
    assert_error(routed(client, {"token_ids": [1], "dp_rank": 2**32}), 422)
    assert_error(routed(client, {"instance_id": 2**64, "token_ids": [1]}), 422)
    assert_error(routed(client, {"instance_id": True, "token_ids": [1]}), 422)
    assert_error(post(client, "/routed", {"instance_id": 7, "block_hashes": [1]}), 422, "missing field `model_name`")
    assert_error(post(client, "/routed", [1]), 422)
    assert_error(routed(client, {"block_hashes": [1], "cache_salt": "s"}), 400,
                 "lora_name and cache_salt go with token_ids; block_hashes must already include them")
    assert_error(routed(client, {"block_hashes": [1], "tenant_id": "a", "routing_group": "b"}), 400)
    assert_error(routed(client, {"instance_id": 3, "block_hashes": [1]}), 409,
                 "instance 3 is already registered for model=other tenant_id=default")
    assert_error(routed(client, {"block_hashes": [1], "tenant_id": "elsewhere"}), 404)
    assert_error(client.post("/routed", content=b"{", headers=JSON), 400)
    assert_error(client.post("/routed", content=b"{}", headers={"content-type": "text/plain"}), 415)
    assert_error(client.get("/routed"), 405)
    assert client.get("/workers").json()[0]["ranks"][0]["approximate_blocks"] == 0


@pytest.mark.unit
def test_routed_takes_bodies_up_to_8_mib_like_query(client: TestClient) -> None:
    assert post(client, "/register", {"instance_id": 7, "model_name": "llama", "block_size": 16}).status_code == 201
    big = {"model_name": "llama", "instance_id": 7, "token_ids": [], "lora_name": "x" * 3_000_000}  # > 2 MiB
    assert post(client, "/routed", big).json() == {"recorded": 0, "new": 0, "evicted": 0}
    assert_error(post(client, "/routed", {**big, "lora_name": "x" * (8 * 1024 * 1024)}), 413)


@pytest.mark.unit
def test_client_routed_round_trip() -> None:
    async def scenario() -> None:
        app = create_app()
        transport = httpx.ASGITransport(app=app)
        async with AsyncIndexerClient(client=httpx.AsyncClient(transport=transport, base_url="http://i")) as client:
            await client.register(7, "llama", 16)
            assert await client.routed(7, "llama", to_signed_list(L)) == RoutedReport(recorded=4, new=4, evicted=0)
            assert await client.routed(7, "llama", token_ids=list(range(1, 65)), dp_rank=1, lora_name="x") == \
                RoutedReport(recorded=4, new=4, evicted=0)
            assert (await client.query_by_hash("llama", to_signed_list(L))).scores == {(7, 0): 64}
            assert (await client.query("llama", list(range(1, 65)), lora_name="x")).scores == {(7, 1): 64}
            with pytest.raises(ServiceCallError) as failure:
                await client.routed(7, "llama")
            assert failure.value.status == 422
            with pytest.raises(ServiceCallError) as failure:
                await client.routed(7, "nope", [1])
            assert failure.value.status == 404

    asyncio.run(scenario())


@pytest.mark.unit
def test_cli_flags_reach_the_indexer() -> None:
    from dynamo_lite.indexer.__main__ import main

    seen: list[IndexerConfig] = []

    def fake_create_app(config: IndexerConfig) -> object:
        seen.append(config)
        return object()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dynamo_lite.indexer.__main__.create_app", fake_create_app)
        patch.setattr("dynamo_lite.indexer.__main__.serve", lambda app, args, **kwargs: None)
        patch.setattr("dynamo_lite.indexer.__main__.configure_logging", lambda *args: None)
        main(["--approx-ttl-secs", "30", "--approx-max-blocks", "0"])
        main([])
        patch.setenv("DYNAMO_LITE_APPROX_TTL_SECS", "5")
        main([])
        with pytest.raises(SystemExit) as refused:
            main(["--approx-ttl-secs", "0"])
        assert refused.value.code == 2
    assert [(config.approx_ttl_secs, config.approx_max_blocks) for config in seen] == [
        (30.0, 0), (120.0, 2**20), (5.0, 2**20)]


# --- processes: recovery from a peer ---------------------------------------------------------


def seed_peer(url: str) -> None:
    """Worker 7 stored two blocks (events); worker 8 was routed all four (approximations)."""
    with httpx.Client(base_url=url) as peer:
        assert peer.post("/register", json={"instance_id": 8, "model_name": "llama", "block_size": 16}).status_code == 201
        assert peer.post("/events", json=doc(stored(7, 0, None, [1, 2], L[:2]))).json()["applied"] == 1
        assert peer.post("/routed", json={"instance_id": 8, "model_name": "llama",
                                          "block_hashes": to_signed_list(L)}).json()["recorded"] == 4


def scores_at(url: str) -> dict:
    with httpx.Client(base_url=url) as client:
        return client.post("/query_by_hash", json={"model_name": "llama", "block_hashes": to_signed_list(L)}).json()[
            "scores"]


@pytest.mark.process
def test_an_indexer_recovering_from_a_peer_gets_its_approximations() -> None:
    with running_service("indexer") as peer:
        seed_peer(peer)
        with running_service("indexer", "--peers", peer) as recovered:
            assert scores_at(recovered) == scores_at(peer) == {"7": {"0": 32}, "8": {"0": 64}}
            ranks = {(w["instance_id"], r["source"], r["approximate_blocks"])
                     for w in httpx.get(f"{recovered}/workers").json() for r in w["ranks"]}
            assert ranks == {(7, "events", 0), (8, "approximate", 4)}


@pytest.mark.process
@pytest.mark.reference
@pytest.mark.reference
def test_dynamo_recovers_from_a_dump_with_approximations_and_ignores_them() -> None:
    python = require_reference_or_skip()
    with running_service("indexer") as peer:
        seed_peer(peer)
        port = free_port()
        with running_server([str(python), "-m", "dynamo.indexer", "--port", str(port), "--peers", peer], port) as ref:
            assert scores_at(ref) == {"7": {"0": 32}}
