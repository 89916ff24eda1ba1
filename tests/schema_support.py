"""schemathesis set-up shared by the per-service schema tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import schemathesis
from starlette.applications import Starlette
from starlette.routing import Route

OPENAPI_DIR = Path(__file__).resolve().parents[1] / "openapi"

# Schema-valid requests may still be refused with 400 for what a JSON schema cannot say (a DP
# range that overflows u32, tenant_id and routing_group that disagree, a non-null cache_salt),
# 404 for names that do not exist, and 409 for conflicts with the current state.
CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ["2XX", 400, 404, 409]}}}
)


def _has_integral_float(value: object) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(map(_has_integral_float, value.values()))
    if isinstance(value, list):
        return any(map(_has_integral_float, value))
    return False


def load(document: str, app: Starlette) -> Any:
    """The service's OpenAPI document, bound to the in-process `app`."""
    schema = schemathesis.openapi.from_path(OPENAPI_DIR / document, config=CONFIG)
    schema.app = app

    @schema.hook
    def filter_body(ctx: schemathesis.HookContext, body: object) -> bool:
        """JSON Schema calls 404.0 an integer; the services, like Dynamo's serde, answer 422 to
        any number written with a fraction or exponent (tested in the HTTP tests)."""
        return not _has_integral_float(body)

    return schema


def served_routes(app: Starlette) -> dict[str, set[str]]:
    return {route.path: set(route.methods or ()) - {"HEAD"} for route in app.routes if isinstance(route, Route)}


def documented_routes(schema: Any) -> dict[str, set[str]]:
    return {path: {method.upper() for method in item} for path, item in schema.raw_schema["paths"].items()}
