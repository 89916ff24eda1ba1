"""schemathesis against openapi/slot_tracker.yaml on the in-process app: no 5xx, and every
response (status, content type, body) is one the document allows."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from support.schema_support import documented_routes, load, served_routes

from dynamo_lite.slot_tracker.app import create_app
from dynamo_lite.slot_tracker.core import SlotTracker

pytestmark = pytest.mark.unit


def seeded_app():
    """Some known state, so that generated lifecycle calls can also succeed, not only 404."""
    tracker = SlotTracker()
    tracker.register(0, "", "default", 1, 0, 2)
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "", 1, 0, [0, 1, -1], 5)
    return create_app(tracker=tracker)


schema = load("slot_tracker.yaml", seeded_app())


@schema.parametrize()
@settings(max_examples=60, suppress_health_check=list(HealthCheck), deadline=None)
def test_app_conforms_to_its_openapi_document(case: schemathesis.Case) -> None:
    case.call_and_validate()


def test_document_lists_exactly_the_app_routes() -> None:
    assert served_routes(create_app()) == documented_routes(schema)
