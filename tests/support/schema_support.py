"""schemathesis set-up shared by the per-service schema tests."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyStrategyDefinition
from starlette.applications import Starlette
from starlette.routing import Route

from dynamo_lite.web.auth import ApiKeys

OPENAPI_DIR = Path(__file__).resolve().parents[2] / "openapi"

# The apps run with an API key, as the documents' `bearerKey` scheme says: schemathesis sends it,
# and also checks that requests without it, or with another, are refused.
SCHEMA_API_KEY = "schemathesis-key"
AUTH = {"openapi": {"bearerKey": {"bearer": SCHEMA_API_KEY}}}

# Schema-valid requests may still be refused with 400 for what a JSON schema cannot say (a DP
# range that overflows u32, tenant_id and routing_group that disagree, a non-null cache_salt),
# 404 for names that do not exist, and 409 for conflicts with the current state.
CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ["2XX", 400, 404, 409]}}, "auth": AUTH}
)


# JSON Schema calls 404.0 an integer; the services, like Dynamo's serde, answer 422 to any number
# written with a fraction or exponent (tested in the HTTP tests), so bodies holding one are not drawn.
def has_integral_float(value: object) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(map(has_integral_float, value.values()))
    if isinstance(value, list):
        return any(map(has_integral_float, value))
    return False


def protected(app: Any) -> Any:
    """`app` requiring `SCHEMA_API_KEY` (`--api-key`)."""
    if app.api_keys is None:
        app.protect(ApiKeys.from_texts([SCHEMA_API_KEY]))
    return app


def load(document: str, app: Starlette) -> Any:
    """The service's OpenAPI document, bound to the in-process `app`, which takes the key."""
    schema = schemathesis.openapi.from_path(OPENAPI_DIR / document, config=CONFIG)
    schema.app = protected(app)

    @schema.hook
    def filter_body(ctx: schemathesis.HookContext, body: object) -> bool:
        """JSON Schema calls 404.0 an integer; the services, like Dynamo's serde, answer 422 to
        any number written with a fraction or exponent (tested in the HTTP tests)."""
        return not has_integral_float(body)

    @schema.hook
    def map_body(ctx: schemathesis.HookContext, body: object) -> object:
        return align_dp_ranks(body) if ctx.operation is not None and ctx.operation.path == "/events" else body

    return schema


# Stateful runs follow only the documented links (schemathesis would also infer some from
# response schemas: here mostly GET /workers roots that crowd out the lifecycles).
# They always send the key: with the `Authorization` header generated as a parameter, a third of
# the steps (mostly `/register`) went out without a valid key and were refused with 401, which
# cut most lifecycles short. The per-operation runs (`load`) keep generating it, and
# test_api_keys checks every route without a key and with a wrong one.
STATEFUL_CONFIG = schemathesis.config.SchemathesisConfig.from_dict(
    {
        "checks": {"positive_data_acceptance": {"expected-statuses": ["2XX", 400, 404, 409]}},
        "phases": {"stateful": {"inference": {"algorithms": []}}},
        "generation": {"with-security-parameters": False},
        "auth": AUTH,
    }
)


def _integral_to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_to_int(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_to_int(item) for item in value]
    return value


def _drop_tenant(value: Any, kept: set[str]) -> None:
    """Three times in four (decided by the value itself, so replays agree), remove the generated
    tenant_id / routing_group from a dict, except those a link supplied (`kept`)."""
    generated = [key for key in ("tenant_id", "routing_group") if key in value and key not in kept]
    if generated and zlib.crc32(repr(sorted(value.items(), key=repr)).encode()) % 4:
        for key in generated:
            del value[key]


def _is_u32(value: Any) -> bool:
    return type(value) is int and 0 <= value <= 2**32 - 1


def align_dp_ranks(document: Any) -> Any:
    """An event's `dp_rank` beside `worker_id` is undeclared in the document (Dynamo writes it
    inside `event`), so schemathesis may generate anything under that name; the service takes
    it only as a u32 equal to `event.dp_rank` (422 otherwise, as documented). Generated copies
    are made to agree or dropped, which changes nothing about a case's validity."""
    sections = document.values() if isinstance(document, dict) else ()
    for section in sections:
        events = section.get("events") if isinstance(section, dict) else None
        for event in events if isinstance(events, list) else ():
            if not isinstance(event, dict) or "dp_rank" not in event:
                continue
            inner = event.get("event")
            nested = inner.get("dp_rank") if isinstance(inner, dict) else None
            if _is_u32(nested):
                event["dp_rank"] = nested
            elif nested is not None or not _is_u32(event["dp_rank"]):
                del event["dp_rank"]
    return document


def settle_positive_case(case: Any, linked: Any) -> None:
    """Make a positive (schema-valid) case more likely to reach existing state, leaving negative
    cases alone: integral floats in the body become integers (JSON Schema counts 404.0 as an
    integer; the services, like Dynamo's serde, answer 422), an event's two `dp_rank`s agree,
    and most generated tenants are dropped (links carry no tenant when the producing request
    had none, and a random tenant would make every follow-up a 404). `linked` are the
    (location, name) pairs a link supplied."""
    meta = getattr(case, "meta", None)
    if meta is None or not meta.generation.mode.is_positive:
        return
    if isinstance(case.body, (dict, list)):
        case.body = _integral_to_int(case.body)
    if case.operation.path == "/events":
        align_dp_ranks(case.body)
    kept = {str(name) for _, name in linked}
    for container in (case.body, case.query):
        if isinstance(container, dict):
            _drop_tenant(container, kept)


def load_stateful(document: str, app: Starlette) -> Any:
    """The service's OpenAPI document for a state machine run, bound to the in-process `app`.

    No `filter_body` hook as in `load`: a state machine step whose draws are filtered three
    times is thrown away whole, and most scenarios were lost that way. State machines call
    `settle_positive_case` on each step instead.

    `POST /register` always starts scenarios. schemathesis only starts from operations whose
    inputs it believes some response produces, and guesses that the indexer's `instance_id`
    names a resource nothing returns: left alone, the indexer's runs never register anyone."""
    schema = schemathesis.openapi.from_path(OPENAPI_DIR / document, config=STATEFUL_CONFIG)
    schema.app = protected(app)
    register = schema.analysis.dependency_graph.operations.get("POST /register")
    if register is not None:
        register.inputs = []  # the services take any new id at /register
    return schema


def served_routes(app: Starlette) -> dict[str, set[str]]:
    return {route.path: set(route.methods or ()) - {"HEAD"} for route in app.routes if isinstance(route, Route)}


def documented_routes(schema: Any) -> dict[str, set[str]]:
    return {path: {method.upper() for method in item} for path, item in schema.raw_schema["paths"].items()}


# --------------------------------------------------------------------------------------------
# Stateful runs (the `links` of the OpenAPI documents)
# --------------------------------------------------------------------------------------------

# Scenarios per service in the default and ci profiles: about 25-35 s each on one core.
STATEFUL_SCENARIOS = 150
# `pytest --hypothesis-profile=long` (or HYPOTHESIS_PROFILE=long) runs this many. A scenario
# makes 8-11 calls, so this is well over LONG_STATEFUL_CALLS cases per service (asserted).
LONG_STATEFUL_SCENARIOS = 2_000
LONG_STATEFUL_CALLS = 10_000


def is_long_profile() -> bool:
    return settings.get_current_profile_name() == "long"


def stateful_settings() -> settings:
    """Settings for a state machine run under the selected hypothesis profile: a bounded budget,
    or LONG_STATEFUL_SCENARIOS scenarios in the long profile."""
    return settings(
        max_examples=LONG_STATEFUL_SCENARIOS if is_long_profile() else STATEFUL_SCENARIOS,
        stateful_step_count=12,
        deadline=None,
        phases=[Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )


# Restarts allowed per run after hypothesis reports inconsistent data generation (see run_stateful).
MAX_RESTARTS = 5


# Further budgets a run may take while `covered` is false (see run_stateful).
MAX_EXTRA_BUDGETS = 3


def run_stateful(workflow: Any, stats: CallStats, covered: Callable[[], bool] = lambda: True) -> None:
    """Run a schemathesis state machine for the profile's budget of scenarios, then for up to
    MAX_EXTRA_BUDGETS more budgets while `covered()` is false.

    Whether a scenario follows a link is decided outside hypothesis' control (below), so the
    depth a budget reaches varies from run to run even when derandomized: in one CI run of 205
    slot tracker scenarios none reached `/output_blocks` for an active request (another reached
    11). A run whose links lead nowhere still fails: `covered()` stays false after every budget.

    schemathesis decides whether a link's values are used with `st.randoms(use_true_random=True)`,
    outside hypothesis' choice sequence, so a replayed sequence can take another path and
    hypothesis stops with `FlakyStrategyDefinition` (seen about once in 1,500 scenarios).
    schemathesis' own runner restarts in that case; so does this, with the rest of the budget.
    Failures are never retried. Each workflow's `teardown` counts `stats.notes["scenarios"]`."""
    per_budget = stateful_settings().max_examples
    for extra in range(MAX_EXTRA_BUDGETS + 1):
        _run_budget(workflow, stats, per_budget * (extra + 1))
        if covered():
            return
        stats.notes["extra budgets run for coverage"] += 1


def _run_budget(workflow: Any, stats: CallStats, budget: int) -> None:
    """Run `workflow` until `stats.notes["scenarios"]` reaches `budget`."""
    for _ in range(MAX_RESTARTS):
        remaining = budget - stats.notes["scenarios"]
        if remaining <= 0:
            return
        try:
            workflow.run(settings=settings(stateful_settings(), max_examples=remaining))
            return
        except FlakyStrategyDefinition:
            stats.notes["restarts after inconsistent generation"] += 1
    workflow.run(settings=settings(stateful_settings(), max_examples=max(1, budget - stats.notes["scenarios"])))


class CallStats:
    """Statuses seen per operation across a run, so a test can show (and require) that the links
    led somewhere: registered workers took requests, stored blocks were found again."""

    def __init__(self) -> None:
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.notes: Counter[str] = Counter()

    def record(self, label: str, status: int) -> None:
        self.statuses[(label, status)] += 1

    def count(self, label: str, status: int) -> int:
        return self.statuses[(label, status)]

    def calls(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> str:
        lines = [f"{self.calls()} calls"]
        lines += [f"  {label} -> {status}: {n}" for (label, status), n in sorted(self.statuses.items())]
        lines += [f"  {note}: {n}" for note, n in sorted(self.notes.items())]
        return "\n".join(lines)


def tenant_of(body: dict[str, Any]) -> str:
    """The tenant a body addresses (tenant_id, else its alias routing_group, else "default")."""
    tenant = body.get("tenant_id", body.get("routing_group", "default"))
    return tenant if isinstance(tenant, str) else "default"
