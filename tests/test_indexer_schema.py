"""schemathesis against openapi/indexer.yaml on the in-process app: no 5xx, and every response
(status, content type, body) is one the document allows."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from support.schema_support import documented_routes, load, served_routes

from dynamo_lite.hashing import local_block_hashes
from dynamo_lite.indexer.app import create_app
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document

pytestmark = pytest.mark.unit


def seeded_app():
    """A partition with blocks on two tiers and a rank approximated by `/routed`, so generated
    queries can match something and `/dump` has every part of its document."""
    indexer = Indexer()
    local = local_block_hashes(list(range(32)), 16)
    indexer.register(1, "", "default", 16)
    indexer.apply_events(parse_events_document({"m:default": {"block_size": 16, "events": [
        {"worker_id": 2, "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
            "parent_hash": None, "blocks": [{"block_hash": 0, "tokens_hash": local[0]}]}}}},
        {"worker_id": 2, "storage_tier": "host_pinned", "event": {"event_id": 1, "dp_rank": 0, "data": {"stored": {
            "parent_hash": 0, "blocks": [{"block_hash": 1, "tokens_hash": local[1]}]}}}},
    ]}}))
    indexer.record_routed("m", "default", 3, 0, local)
    return create_app(indexer=indexer)


schema = load("indexer.yaml", seeded_app())


@schema.parametrize()
@settings(max_examples=60, suppress_health_check=list(HealthCheck), deadline=None)
def test_app_conforms_to_its_openapi_document(case: schemathesis.Case) -> None:
    case.call_and_validate()


def test_document_lists_exactly_the_app_routes() -> None:
    assert served_routes(create_app()) == documented_routes(schema)
