"""HTTP shell of the slot tracker: parse and validate, call `SlotTracker`, serialise.

Routes, status codes and messages follow Dynamo 1.6.1's standalone slot tracker, with
`tenant_id` as the partition field (`routing_group` accepted as its input alias).

With replicas (`--nats`, `ReplicatedRoutes`) the write routes apply the write here exactly as
without, then publish it (`nats_replica`); their answer waits until the NATS server has it. Without
`--nats` the routes are the plain `SlotTrackerRoutes`, untouched: no replication code runs on
a request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from msgspec import UNSET, UnsetType

from dynamo_lite.web import http, validation
from dynamo_lite.web.auth import Access
from dynamo_lite.web.credentials import ClientCredentials
from dynamo_lite.web.http import HandlerResult, QueryParams
from dynamo_lite.web.validation import I64, U32, U64, RequestBody, tenant_of

from .core import DEFAULT_REQUEST_TTL_SECS, SlotTracker
from .metrics import SlotTrackerCollector
from .peers import recover
from .protocols import AGGREGATED, WorkerInfo
from .snapshot import EMPTY, TrackerSnapshots, encode

if TYPE_CHECKING:  # imported only with --nats (see `create_app`)
    from .nats_replica import NatsReplication, NatsSettings
    from .replication import Replica

logger = logging.getLogger("dynamo_lite.slot_tracker")

OPENAPI_PATH = Path(__file__).with_name("openapi.yaml")
DEFAULT_SWEEP_INTERVAL_SECS = 1.0
DEFAULT_RECOVERY_DEADLINE_SECS = 10.0
# Short, as requests live seconds to minutes: a crash loses what changed since the last one.
# Only a changed state is written, mostly in a worker thread (10,000 requests of 256 hashes:
# 0.1-0.25 s, pausing the event loop 13-21 ms at most; see `snapshot`).
DEFAULT_SNAPSHOT_INTERVAL_SECS = 5.0

# Encoded once: every write route answers it, and `http.encode` passes it through as it is.
OK = http.Encoded(b'{"status":"ok"}')
_FILTERS = frozenset({"model_name", "tenant_id", "routing_group"})
_LOADS_CACHE_SIZE = 64

Tenant = Union[str, UnsetType]


# --- request types: the schema of each POST body (see `dynamo_lite.web.validation.RequestBody`) ----
# Fields are declared in the order Dynamo checks them, so the first problem a body has is the one
# reported; `routing_group` is `tenant_id`'s input alias, checked with it.


class RegisterRequest(RequestBody, kw_only=True):
    worker_id: U64
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    block_size: U32
    dp_start: U32
    dp_size: U32
    # Not in Dynamo's /register: "prefill" tracks only the prefill tokens of the worker's requests
    # (Dynamo's prefill router runs with track_active_blocks=false); "decode" or "aggregated" all.
    role: str = AGGREGATED


class UnregisterRequest(RequestBody, kw_only=True):
    worker_id: U64
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET


class AddRequest(RequestBody, kw_only=True):
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: list[I64]
    new_isl_tokens: U64 = 0
    # Not in Dynamo's /add: the output length the gateway expects (`nvext.agent_hints.osl`); the
    # request's output blocks then weigh less as its output nears it (router guide, decay).
    expected_output_tokens: U64 | None = None


class RequestIdRequest(RequestBody, kw_only=True):
    """`/prefill_complete` and `/free`."""

    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    request_id: str


class OutputBlocksRequest(RequestBody, kw_only=True):
    """`/output_blocks`, a route Dynamo's standalone tracker lacks: checked as `RequestIdRequest`
    is, then the count."""

    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    request_id: str
    output_blocks: U32


class PotentialLoadsRequest(RequestBody, kw_only=True):
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    sequence_hashes: list[I64]
    new_isl_tokens: U64 = 0


def _worker_row(worker: WorkerInfo) -> WorkerInfo | dict[str, Any]:
    """A `/workers` row: Dynamo's fields, and the role only when it is not the default."""
    if worker.role == AGGREGATED:
        return {"worker_id": worker.worker_id, "model_name": worker.model_name, "tenant_id": worker.tenant_id,
                "block_size": worker.block_size, "dp_start": worker.dp_start, "dp_size": worker.dp_size}
    return worker


def _tenant(request: Any) -> str:
    routing_group = request.routing_group
    if routing_group is UNSET:  # the alias not sent, as in most bodies: nothing to reconcile
        tenant_id = request.tenant_id
        return "default" if tenant_id is UNSET else tenant_id
    return tenant_of(request.tenant_id, routing_group)


class SlotTrackerRoutes:
    """One method per route; each returns (status, JSON-serialisable payload)."""

    def __init__(self, tracker: SlotTracker) -> None:
        self.tracker = tracker
        # /loads answers by filter, with the tracker version they were built at.
        self._loads: dict[tuple[str | None, str | None], tuple[int, http.Encoded]] = {}

    def register(self, request: RegisterRequest) -> HandlerResult:
        self.tracker.register(request.worker_id, request.model_name, _tenant(request), request.block_size,
                              request.dp_start, request.dp_size, request.role)
        return 201, OK

    def unregister(self, request: UnregisterRequest) -> HandlerResult:
        self.tracker.unregister(request.worker_id, request.model_name, _tenant(request))
        return 200, OK

    def workers(self, params: QueryParams) -> HandlerResult:
        model_name, tenant_id = _filters(params)
        return 200, [_worker_row(worker) for worker in self.tracker.workers(model_name, tenant_id)]

    def add(self, request: AddRequest) -> HandlerResult:
        self.tracker.add(request.model_name, _tenant(request), request.request_id, request.worker_id,
                         request.dp_rank, request.sequence_hashes, request.new_isl_tokens,
                         request.expected_output_tokens)
        return 201, OK

    def prefill_complete(self, request: RequestIdRequest) -> HandlerResult:
        self.tracker.prefill_complete(request.model_name, _tenant(request), request.request_id)
        return 200, OK

    def output_blocks(self, request: OutputBlocksRequest) -> HandlerResult:
        self.tracker.set_output_blocks(request.model_name, _tenant(request), request.request_id,
                                       request.output_blocks)
        return 200, OK

    def free(self, request: RequestIdRequest) -> HandlerResult:
        self.tracker.free(request.model_name, _tenant(request), request.request_id)
        return 200, OK

    def loads(self, params: QueryParams) -> HandlerResult:
        """Built once per state: gateways poll /loads far more often than loads change."""
        filters = _filters(params)
        version = self.tracker.version
        cached = self._loads.get(filters)
        if cached is not None and cached[0] == version:
            return 200, cached[1]
        answer = http.Encoded(http.encode(self.tracker.loads(*filters)))
        if len(self._loads) >= _LOADS_CACHE_SIZE:
            self._loads.clear()  # filters come from clients: keep the cache bounded
        self._loads[filters] = (version, answer)
        return 200, answer

    def potential_loads(self, request: PotentialLoadsRequest) -> HandlerResult:
        return 200, self.tracker.potential_load_rows(request.model_name, _tenant(request), request.sequence_hashes,
                                                     request.new_isl_tokens)

    def dump(self, params: QueryParams) -> HandlerResult:
        """The whole state, as a snapshot holds it: what a replica started with --peers loads."""
        return 200, http.Encoded(encode(self.tracker.dump(taken_at=time.time())))


class ReplicatedRoutes(SlotTrackerRoutes):
    """The write routes of a replica (`--nats`): applied through the `Replica`, which applies
    them to the tracker exactly as `SlotTrackerRoutes` does (same answers and errors) and queues
    them for the other replicas; answered once the NATS server has them. A write too large for
    one NATS message is refused (413) before it is applied."""

    def __init__(self, tracker: SlotTracker, replica: Replica, sync: NatsReplication) -> None:
        super().__init__(tracker)
        self.replica = replica
        self.sync = sync

    def register(self, request: RegisterRequest) -> Any:
        tenant_id = _tenant(request)
        self.sync.check_size(_size(request.model_name, tenant_id))
        self.replica.register(request.worker_id, request.model_name, tenant_id, request.block_size,
                              request.dp_start, request.dp_size, request.role)
        return self.sync.confirmed(201, OK)

    def unregister(self, request: UnregisterRequest) -> Any:
        tenant_id = _tenant(request)
        self.sync.check_size(_size(request.model_name, tenant_id))
        self.replica.unregister(request.worker_id, request.model_name, tenant_id)
        return self.sync.confirmed(200, OK)

    def add(self, request: AddRequest) -> Any:
        tenant_id = _tenant(request)
        self.sync.check_size(_size(request.model_name, tenant_id, request.request_id), len(request.sequence_hashes))
        self.replica.add(request.model_name, tenant_id, request.request_id, request.worker_id, request.dp_rank,
                         request.sequence_hashes, request.new_isl_tokens, request.expected_output_tokens)
        return self.sync.confirmed(201, OK)

    def prefill_complete(self, request: RequestIdRequest) -> Any:
        tenant_id = _tenant(request)
        self.sync.check_size(_size(request.model_name, tenant_id, request.request_id))
        self.replica.prefill_complete(request.model_name, tenant_id, request.request_id)
        return self.sync.confirmed(200, OK)

    def output_blocks(self, request: OutputBlocksRequest) -> Any:
        tenant_id = _tenant(request)
        self.sync.check_size(_size(request.model_name, tenant_id, request.request_id))
        self.replica.set_output_blocks(request.model_name, tenant_id, request.request_id, request.output_blocks)
        return self.sync.confirmed(200, OK)

    def free(self, request: RequestIdRequest) -> Any:
        tenant_id = _tenant(request)
        self.sync.check_size(_size(request.model_name, tenant_id, request.request_id))
        self.replica.free(request.model_name, tenant_id, request.request_id)
        return self.sync.confirmed(200, OK)


def _size(*strings: str) -> int:
    """An upper bound of the strings' UTF-8 size, without encoding them."""
    return 4 * sum(map(len, strings))


def _filters(params: QueryParams) -> tuple[str | None, str | None]:
    tenant = None
    if "tenant_id" in params or "routing_group" in params:
        tenant = validation.resolve_tenant(params.get("tenant_id"), params.get("routing_group"))
    return params.get("model_name"), tenant


async def _sweep_forever(tracker: SlotTracker, interval: float, replica: Replica | None = None) -> None:
    while True:
        await asyncio.sleep(interval)
        expired = tracker.expire()
        if expired:
            logger.info("expired %d stale requests older than %ss", expired, tracker.request_ttl_secs)
        if replica is not None:
            replica.prune()  # tombstones and silent replicas, a TTL after their last op


@dataclass(frozen=True)
class SlotTrackerConfig:
    """Everything the slot tracker app is started with (`python -m dynamo_lite.slot_tracker`
    builds it from its flags; the defaults are the flags' defaults)."""

    request_ttl_secs: float = DEFAULT_REQUEST_TTL_SECS  # of the tracker `create_app` makes when given none
    sweep_interval_secs: float = DEFAULT_SWEEP_INTERVAL_SECS  # how often requests past their TTL are freed
    peers: tuple[str, ...] = ()  # slot trackers to copy the state of at start-up, first reachable wins
    recovery_deadline_secs: float = DEFAULT_RECOVERY_DEADLINE_SECS
    snapshot: str | None = None  # file loaded at start-up, rewritten periodically and at shutdown
    snapshot_interval_secs: float = DEFAULT_SNAPSHOT_INTERVAL_SECS
    ignore_bad_snapshot: bool = False
    # Replicas sharing the state through a NATS server (`--nats`): a joining replica takes a
    # running one's state (then the snapshot is not loaded); `peers` must then be empty.
    nats: NatsSettings | None = None
    # What `peers` want to see (their `/dump` takes a full API key).
    peer_credentials: ClientCredentials = ClientCredentials()


def create_app(config: SlotTrackerConfig = SlotTrackerConfig(), tracker: SlotTracker | None = None) -> http.Service:
    """The slot tracker app. Start-up, before the server accepts connections, copies the state of
    the first reachable of `peers`, or else loads the `snapshot` file (a running peer's state is
    newer than any snapshot); with `nats`, it joins the other replicas instead, and loads the
    snapshot only when none answered. While serving, the snapshot is rewritten every
    `snapshot_interval_secs` when the state changed, and once more at shutdown, after the
    requests in flight have been answered."""
    tracker = tracker if tracker is not None else SlotTracker(request_ttl_secs=config.request_ttl_secs)
    snapshots = (TrackerSnapshots(tracker, config.snapshot, config.snapshot_interval_secs,
                                  ignore_bad=config.ignore_bad_snapshot)
                 if config.snapshot else None)
    replica = sync = None
    collectors: list[Any] = [SlotTrackerCollector(tracker)]
    routes: SlotTrackerRoutes
    if config.nats is None:
        routes = SlotTrackerRoutes(tracker)
    else:
        if config.peers:
            raise ValueError("peers and nats do not go together: a replica takes the state of the others through NATS")
        from .metrics import ReplicationCollector
        from .nats_replica import NatsReplication
        from .replication import Replica

        replica = Replica(tracker)
        sync = NatsReplication(replica, config.nats)
        routes = ReplicatedRoutes(tracker, replica, sync)
        collectors.append(ReplicationCollector(sync))

    @contextlib.asynccontextmanager
    async def lifespan(app: http.Service) -> AsyncIterator[None]:
        if snapshots is not None:
            snapshots.prepare()  # a snapshot directory that is missing fails now, not after the peers
        if sync is not None:
            await sync.start(fallback=snapshots.restore if snapshots is not None else None)
            app.state.not_ready = sync.not_ready
        else:
            peer = await recover(tracker, config.peers, deadline_secs=config.recovery_deadline_secs,
                                 credentials=config.peer_credentials,
                                 otherwise=EMPTY if snapshots is None else f"snapshot {snapshots.path}")
            if snapshots is not None:
                if peer is None:
                    snapshots.restore()
                else:
                    logger.info("snapshot %s not loaded: the state of peer %s is newer", snapshots.path, peer)
        tasks = [asyncio.create_task(_sweep_forever(tracker, config.sweep_interval_secs, replica))]
        if snapshots is not None:
            tasks.append(asyncio.create_task(snapshots.run_periodically()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if sync is not None:
                await sync.stop()
            if snapshots is not None:
                await snapshots.save_final()

    app = http.Service(
        routes=[
            http.health_route(),
            http.post("/register", routes.register, request_type=RegisterRequest),
            http.post("/unregister", routes.unregister, request_type=UnregisterRequest),
            http.get("/workers", routes.workers, parameters=_FILTERS),
            http.post("/add", routes.add, request_type=AddRequest),
            http.post("/prefill_complete", routes.prefill_complete, request_type=RequestIdRequest),
            http.post("/output_blocks", routes.output_blocks, request_type=OutputBlocksRequest),
            http.post("/free", routes.free, request_type=RequestIdRequest),
            http.get("/loads", routes.loads, parameters=_FILTERS),
            http.post("/potential_loads", routes.potential_loads, request_type=PotentialLoadsRequest,
                      access=Access.READ),
            http.get("/dump", routes.dump, access=Access.WRITE),  # the whole state: replicas, not gateways
            http.openapi_route(OPENAPI_PATH),
        ],
        lifespan=lifespan,
        collectors=collectors,
    )
    app.state.tracker = tracker
    app.state.replica = replica
    return app
