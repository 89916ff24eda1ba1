"""schemathesis against openapi/slot_tracker.yaml on the in-process app: no 5xx, and every
response (status, content type, body) is one the document allows."""

from __future__ import annotations

from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from starlette.routing import Route

from dynamo_lite.slot_tracker.app import create_app
from dynamo_lite.slot_tracker.core import SlotTracker

SPEC = Path(__file__).resolve().parents[1] / "openapi" / "slot_tracker.yaml"


def seeded_app():
    """Some known state, so that generated lifecycle calls can also succeed, not only 404."""
    tracker = SlotTracker()
    tracker.register(0, "", "default", 1, 0, 2)
    tracker.register(1, "m", "default", 16, 0, 1)
    tracker.add("m", "default", "", 1, 0, [0, 1, -1], 5)
    return create_app(tracker)


# Schema-valid requests may still be refused with 400 for what a JSON schema cannot say:
# a DP range that overflows u32, or tenant_id and routing_group that disagree.
CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ["2XX", 400, 404, 409]}}}
)
schema = schemathesis.openapi.from_path(SPEC, config=CONFIG)
schema.app = seeded_app()


def _has_integral_float(value: object) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(map(_has_integral_float, value.values()))
    if isinstance(value, list):
        return any(map(_has_integral_float, value))
    return False


@schema.hook
def filter_body(ctx: schemathesis.HookContext, body: object) -> bool:
    """JSON Schema calls 404.0 an integer; the service, like Dynamo's serde, answers 422 to any
    number written with a fraction or exponent. Such bodies are tested in the HTTP tests."""
    return not _has_integral_float(body)


@schema.parametrize()
@settings(max_examples=60, suppress_health_check=list(HealthCheck), deadline=None)
def test_app_conforms_to_its_openapi_document(case: schemathesis.Case) -> None:
    case.call_and_validate()


def test_document_lists_exactly_the_app_routes() -> None:
    app = create_app()
    served = {route.path: set(route.methods or ()) - {"HEAD"} for route in app.routes if isinstance(route, Route)}
    documented = {path: {method.upper() for method in item} for path, item in schema.raw_schema["paths"].items()}
    assert served == documented
