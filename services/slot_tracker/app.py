"""HTTP shell of the slot tracker: parse and validate, call `SlotTracker`, serialise.

Routes, status codes and messages follow Dynamo 1.6.1's standalone slot tracker, with
`tenant_id` as the partition field (`routing_group` accepted as its input alias).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from dynamo_lite import http, validation
from dynamo_lite.http import HandlerResult, QueryParams
from dynamo_lite.validation import expect_object

from .core import SlotTracker
from .metrics import SlotTrackerCollector

logger = logging.getLogger("dynamo_lite.slot_tracker")

OPENAPI_PATH = Path(__file__).with_name("openapi.yaml")
DEFAULT_SWEEP_INTERVAL_SECS = 1.0

OK = {"status": "ok"}
_FILTERS = frozenset({"model_name", "tenant_id", "routing_group"})


class SlotTrackerRoutes:
    """One method per route; each returns (status, JSON-serialisable payload)."""

    def __init__(self, tracker: SlotTracker) -> None:
        self.tracker = tracker

    def register(self, body: Any) -> HandlerResult:
        body = expect_object(body, "RegisterRequest")
        self.tracker.register(
            validation.u64(body, "worker_id"),
            validation.string(body, "model_name"),
            validation.tenant(body),
            validation.u32(body, "block_size"),
            validation.u32(body, "dp_start"),
            validation.u32(body, "dp_size"),
        )
        return 201, OK

    def unregister(self, body: Any) -> HandlerResult:
        body = expect_object(body, "UnregisterRequest")
        self.tracker.unregister(
            validation.u64(body, "worker_id"),
            validation.string(body, "model_name"),
            validation.tenant(body),
        )
        return 200, OK

    def workers(self, params: QueryParams) -> HandlerResult:
        model_name, tenant_id = _filters(params)
        return 200, self.tracker.workers(model_name, tenant_id)

    def add(self, body: Any) -> HandlerResult:
        body = expect_object(body, "AddRequest")
        self.tracker.add(
            validation.string(body, "model_name"),
            validation.tenant(body),
            validation.string(body, "request_id"),
            validation.u64(body, "worker_id"),
            validation.u32(body, "dp_rank"),
            validation.i64_list(body, "sequence_hashes"),
            validation.u64(body, "new_isl_tokens", 0),
        )
        return 201, OK

    def prefill_complete(self, body: Any) -> HandlerResult:
        body = expect_object(body, "PrefillCompleteRequest")
        self.tracker.prefill_complete(
            validation.string(body, "model_name"),
            validation.tenant(body),
            validation.string(body, "request_id"),
        )
        return 200, OK

    def free(self, body: Any) -> HandlerResult:
        body = expect_object(body, "FreeRequest")
        self.tracker.free(
            validation.string(body, "model_name"),
            validation.tenant(body),
            validation.string(body, "request_id"),
        )
        return 200, OK

    def loads(self, params: QueryParams) -> HandlerResult:
        model_name, tenant_id = _filters(params)
        return 200, self.tracker.loads(model_name, tenant_id)

    def potential_loads(self, body: Any) -> HandlerResult:
        body = expect_object(body, "PotentialLoadsRequest")
        return 200, self.tracker.potential_loads(
            validation.string(body, "model_name"),
            validation.tenant(body),
            validation.i64_list(body, "sequence_hashes"),
            validation.u64(body, "new_isl_tokens", 0),
        )


def _filters(params: QueryParams) -> tuple[str | None, str | None]:
    tenant = None
    if "tenant_id" in params or "routing_group" in params:
        tenant = validation.resolve_tenant(params.get("tenant_id"), params.get("routing_group"))
    return params.get("model_name"), tenant


async def _sweep_forever(tracker: SlotTracker, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        expired = tracker.expire()
        if expired:
            logger.info("expired %d stale requests older than %ss", expired, tracker.request_ttl_secs)


def create_app(
    tracker: SlotTracker | None = None, *, sweep_interval_secs: float = DEFAULT_SWEEP_INTERVAL_SECS
) -> Starlette:
    tracker = tracker if tracker is not None else SlotTracker()
    routes = SlotTrackerRoutes(tracker)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep_forever(tracker, sweep_interval_secs))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper

    app = http.Service(
        routes=[
            http.health_route(),
            http.post("/register", routes.register),
            http.post("/unregister", routes.unregister),
            http.get("/workers", routes.workers, parameters=_FILTERS),
            http.post("/add", routes.add),
            http.post("/prefill_complete", routes.prefill_complete),
            http.post("/free", routes.free),
            http.get("/loads", routes.loads, parameters=_FILTERS),
            http.post("/potential_loads", routes.potential_loads),
            http.openapi_route(OPENAPI_PATH),
        ],
        lifespan=lifespan,
        collectors=[SlotTrackerCollector(tracker)],
    )
    app.state.tracker = tracker
    return app
