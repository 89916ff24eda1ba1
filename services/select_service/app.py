"""HTTP shell of the selection service: decode the request type, call `SelectionCore`, shape the
answer; subscribe to the engines a catalog change names (`ListenerChanges`).

Routes, bodies, answers and status codes follow Dynamo 1.6.1's `dynamo.select_service`
(docs/select-service.md; the differences are in docs/differences.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Route

from dynamo_lite.base.errors import InvalidArgument, NotFound, ServiceError
from dynamo_lite.base.integers import U64_MAX
from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.indexer.listeners import DEFAULT_REPLAY_TIMEOUT_SECS, Listeners
from dynamo_lite.indexer.metrics import ListenerCollector
from dynamo_lite.indexer.peers import recover
from dynamo_lite.web import http
from dynamo_lite.web.auth import Access
from dynamo_lite.web.credentials import ClientCredentials
from dynamo_lite.web.http import Answer, HandlerResult, LaterResult, PathParams, QueryParams
from dynamo_lite.web.metrics import PREFIX

from .core import (
    ListenerChanges,
    Partition,
    Readings,
    Reservation,
    SelectionCore,
    SelectionSettings,
    output_after_block,
    round_half_away,
)
from .protocols import (
    OutputBlockRequest,
    QueryRequest,
    ReservationRequest,
    SelectRequest,
    WorkerPatch,
    WorkerRequest,
    optional_reader,
    reader,
)
from .remote import SharedState, Unavailable

if TYPE_CHECKING:  # nats-py is imported only with --nats
    from .replicas import Replicas, ReplicaSettings, SharedBooking

logger = logging.getLogger("dynamo_lite.select_service")

OPENAPI_PATH = Path(__file__).with_name("openapi.yaml")
# Dynamo's body limit: a 4M-token prompt's ids fit (its JSON is about 8 bytes a token).
MAX_BODY = 8 * 1024 * 1024
DEFAULT_SWEEP_INTERVAL_SECS = 1.0
DEFAULT_CATALOG_DEADLINE_SECS = 30.0  # --nats: reading the shared catalog at start-up
DEFAULT_RECOVERY_DEADLINE_SECS = 10.0
OK = http.Encoded(b'{"status":"ok"}')
_FILTERS = frozenset({"model_name", "routing_group", "tenant_id"})


@dataclass(frozen=True)
class SelectServiceConfig:
    """Everything the app is started with (`python -m dynamo_lite.select_service` builds it from
    its flags; the defaults are the flags' defaults)."""

    selection: SelectionSettings = field(default_factory=SelectionSettings)
    indexer_peers: tuple[str, ...] = ()  # selection services or indexers whose /dump seeds the index
    recovery_deadline_secs: float = DEFAULT_RECOVERY_DEADLINE_SECS
    replay_timeout_secs: float = DEFAULT_REPLAY_TIMEOUT_SECS
    sweep_interval_secs: float = DEFAULT_SWEEP_INTERVAL_SECS
    peer_credentials: ClientCredentials = ClientCredentials()
    workers: tuple[WorkerRequest, ...] = ()  # registered at start-up, after the peers' index (--workers)
    # Remote mode: the slot tracker and indexer shared with other selectors (both or neither).
    slot_tracker_url: str | None = None
    indexer_url: str | None = None
    service_timeout_secs: float = 2.0
    replicas: ReplicaSettings | None = None  # --nats: share the catalog and bookings with other replicas (remote mode)

    @property
    def remote(self) -> bool:
        return self.slot_tracker_url is not None


def load_workers(path: Path) -> tuple[WorkerRequest, ...]:
    """`--workers FILE`: a JSON or YAML list of `POST /workers` bodies (or `{"workers": [...]}`);
    ValueError naming the entry that cannot be read."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if isinstance(document, dict) and "workers" in document:
        document = document["workers"]
    if not isinstance(document, list):
        raise ValueError(f"{path}: expected a list of worker records (or {{\"workers\": [...]}})")
    read = reader(WorkerRequest)
    workers = []
    for index, entry in enumerate(document):
        try:
            workers.append(read(orjson.dumps(entry)))
        except (ServiceError, TypeError) as exc:
            raise ValueError(f"{path}: worker {index}: {getattr(exc, 'message', exc)}") from None
    return tuple(workers)


def _worker_id(params: PathParams) -> int:
    text = params["worker_id"]
    if not text.isdigit() or int(text) > U64_MAX:
        raise InvalidArgument(f"Invalid URL: Cannot parse `{text}` to a `u64`")
    return int(text)


class SelectRoutes:
    """One method per route; each returns (status, JSON-serialisable payload), or a coroutine of
    them (`RemoteSelectRoutes`)."""

    def __init__(self, core: SelectionCore, listeners: Listeners) -> None:
        self.core = core
        self.listeners = listeners

    def _apply(self, changes: ListenerChanges) -> None:
        self.listeners.stop(changes.stop)
        for subscription in changes.start:
            self.listeners.start(subscription)
            logger.info("worker %d dp_rank %d of model=%s routing_group=%s: subscribing to %s%s",
                        subscription.worker_id, subscription.dp_rank, subscription.model_name,
                        subscription.tenant_id, subscription.endpoint,
                        f" (replay: {subscription.replay_endpoint})" if subscription.replay_endpoint else "")

    # --- the catalog ----------------------------------------------------------------------------

    def upsert_worker(self, request: WorkerRequest) -> HandlerResult | LaterResult:
        record, changes = self.core.upsert_worker(request)
        self._apply(changes)
        _log_record("registered", record)
        return 201, record

    def patch_worker(self, params: PathParams, patch: WorkerPatch) -> HandlerResult | LaterResult:
        record, changes = self.core.patch_worker(_worker_id(params), patch)
        self._apply(changes)
        _log_record("patched", record)
        return 200, record

    def delete_worker(self, params: PathParams, query: QueryParams) -> HandlerResult | LaterResult:
        record, changes = self.core.delete_worker(_worker_id(params))
        self._apply(changes)
        logger.info("worker %d removed", record["worker_id"])
        return 200, record

    def workers(self, params: QueryParams) -> HandlerResult:
        model_name, routing_group = _filters(params)
        return 200, self.core.workers(model_name, routing_group)

    # --- selection ------------------------------------------------------------------------------

    def select(self, request: SelectRequest) -> HandlerResult | LaterResult:
        return 200, self.core.select(request)

    def select_and_reserve(self, request: SelectRequest) -> HandlerResult | LaterResult:
        return 200, self.core.select_and_reserve(request)

    def reserve(self, request: ReservationRequest) -> HandlerResult | LaterResult:
        return 201, self.core.reserve(request)

    def prefill_complete(self, params: PathParams, body: Any) -> HandlerResult | LaterResult:
        self.core.prefill_complete(params["selection_id"])
        return 200, OK

    def output_block(self, params: PathParams, request: OutputBlockRequest | None) -> HandlerResult | LaterResult:
        self.core.output_block(params["selection_id"], request)
        return 200, OK

    def free(self, params: PathParams, query: QueryParams) -> HandlerResult | LaterResult:
        self.core.free(params["selection_id"])
        return 200, OK

    # --- reads ----------------------------------------------------------------------------------

    def loads(self, params: QueryParams) -> HandlerResult | LaterResult:
        return 200, self.core.loads(*_filters(params))

    def potential_loads(self, request: QueryRequest) -> HandlerResult | LaterResult:
        return 200, self.core.potential_loads(request)

    def overlap_scores(self, request: QueryRequest) -> HandlerResult | LaterResult:
        return 200, self.core.overlap_scores(request)

    def dump(self, params: QueryParams) -> HandlerResult | LaterResult:
        return 200, self.core.dump()


class RemoteSelectRoutes(SelectRoutes):
    """The routes of a selector in remote mode (`remote`): the same core calls, with the reads
    and bookings on the shared slot tracker and indexer."""

    def __init__(self, core: SelectionCore, listeners: Listeners, shared: SharedState,
                 replicas: Replicas | None = None) -> None:
        super().__init__(core, listeners)
        self.shared = shared
        self.replicas = replicas

    # --- the catalog: registered with both services, or not kept ----------------------------------

    async def _register(self, worker_id: int, record: dict[str, Any], changes: ListenerChanges) -> None:
        current = self.core.catalog.get(worker_id)
        if current is not None and current.schedulable:
            changes.ensure(current)
        problems = await self.shared.apply(changes)
        if problems and worker_id in self.core.catalog and record["lifecycle"] == "schedulable":
            self.core.delete_worker(worker_id)  # not kept half-registered: registering it again retries all
            raise Unavailable(f"worker {worker_id} not registered: {'; '.join(problems)}")
        for problem in problems:  # a removal the services did not take: their TTLs and owners clean up
            logger.warning("%s", problem)
        if self.replicas is not None:
            await self.replicas.record_changed(worker_id, record if worker_id in self.core.catalog else None)

    async def upsert_worker(self, request: WorkerRequest) -> HandlerResult:
        record, changes = self.core.upsert_worker(request)
        await self._register(record["worker_id"], record, changes)
        _log_record("registered", record)
        return 201, record

    async def patch_worker(self, params: PathParams, patch: WorkerPatch) -> HandlerResult:
        record, changes = self.core.patch_worker(_worker_id(params), patch)
        await self._register(record["worker_id"], record, changes)
        _log_record("patched", record)
        return 200, record

    async def delete_worker(self, params: PathParams, query: QueryParams) -> HandlerResult:
        record, changes = self.core.delete_worker(_worker_id(params))
        await self._register(record["worker_id"], record, changes)
        logger.info("worker %d removed", record["worker_id"])
        return 200, record

    # --- selection ------------------------------------------------------------------------------

    async def _readings(self, request: SelectRequest | QueryRequest) -> Readings:
        prompt = self.core.prompt_of(request)
        block_size = self.core.partitions[request.partition].block_size
        return await self.shared.read(request.partition, prompt, block_size)

    async def select(self, request: SelectRequest) -> HandlerResult:
        return 200, self.core.select(request, await self._readings(request))

    async def select_and_reserve(self, request: SelectRequest) -> HandlerResult:
        readings = await self._readings(request)
        answer = self.core.select_and_reserve(request, readings)
        await self._add(answer["selection_id"])
        return 200, answer

    async def reserve(self, request: ReservationRequest) -> HandlerResult:
        answer = self.core.reserve(request)
        await self._add(request.selection_id)
        return 201, answer

    async def _add(self, selection_id: str) -> None:
        reservation = self.core.reservations[selection_id]
        try:
            await self.shared.add(reservation)
        except ServiceError:
            self.core.free(selection_id)  # booked nowhere, then
            raise
        self._announce("book", selection_id, reservation)

    async def prefill_complete(self, params: PathParams, body: Any) -> HandlerResult:
        selection_id = params["selection_id"]
        reservation = self.core.reservations.get(selection_id)
        if reservation is None:
            shared = self._shared_booking(selection_id)
            if shared is None:
                await self.shared.foreign_prefill_complete(sorted(self.core.partitions), selection_id)
                return 200, OK
            await self._lifecycle(selection_id, shared.partition, self.shared.prefill_complete(shared.partition,
                                                                                              selection_id))
            shared.prefilled = True
            self._announce("progress", selection_id, shared)
            return 200, OK
        await self._lifecycle(selection_id, reservation.partition,
                              self.shared.prefill_complete(reservation.partition, selection_id))
        self.core.prefill_complete(selection_id)
        self._announce("progress", selection_id, reservation)
        return 200, OK

    async def output_block(self, params: PathParams, request: OutputBlockRequest | None) -> HandlerResult:
        selection_id = params["selection_id"]
        fraction = request.decay_fraction if request is not None else None
        held: Reservation | SharedBooking | None = self.core.reservations.get(selection_id)
        if held is None:
            held = self._shared_booking(selection_id)
            if held is None:
                raise NotFound(f"reservation {selection_id} not found")
            held.output_blocks, held.output_load = output_after_block(
                held.output_blocks, held.output_load, fraction, held.expected_output_tokens, held.block_size)
        else:
            self.core.output_block(selection_id, request)
        # The shared slot tracker was told the expected length at `/add` and decays the raw count
        # itself; otherwise it is sent the weighed count, which only grows there (a decay by a
        # `decay_fraction` stays local).
        count = held.output_blocks if held.expected_output_tokens is not None else round_half_away(held.output_load)
        if count > held.reported_output_blocks:
            await self._lifecycle(selection_id, held.partition,
                                  self.shared.output_blocks(held.partition, selection_id, count))
            held.reported_output_blocks = count
        self._announce("progress", selection_id, held)
        return 200, OK

    async def free(self, params: PathParams, query: QueryParams) -> HandlerResult:
        selection_id = params["selection_id"]
        reservation = self.core.reservations.get(selection_id)
        if reservation is None:
            shared = self._shared_booking(selection_id)
            if shared is None:
                await self.shared.foreign_free(sorted(self.core.partitions), selection_id)
                return 200, OK
            await self._lifecycle(selection_id, shared.partition, self.shared.free(shared.partition, selection_id))
            self._forget(selection_id, shared)
            return 200, OK
        await self._lifecycle(selection_id, reservation.partition, self.shared.free(reservation.partition,
                                                                                  selection_id))
        self.core.free(selection_id)
        self._announce("end", selection_id, reservation)
        return 200, OK

    async def _lifecycle(self, selection_id: str, partition: Partition, call: Awaitable[None]) -> None:
        """One lifecycle call on the slot tracker; a booking it no longer holds (TTL, its worker
        left) ends here too, and the answer is its 404."""
        try:
            await call
        except NotFound:
            if selection_id in self.core.reservations:
                reservation = self.core.reservations[selection_id]
                self.core.free(selection_id)
                self._announce("end", selection_id, reservation)
            elif (shared := self._shared_booking(selection_id)) is not None:
                self._forget(selection_id, shared)
            raise

    # --- replicas: bookings made by another replica ------------------------------------------------

    def _shared_booking(self, selection_id: str) -> SharedBooking | None:
        return self.replicas.foreign.get(selection_id) if self.replicas is not None else None

    def _forget(self, selection_id: str, shared: SharedBooking) -> None:
        assert self.replicas is not None
        self.replicas.foreign.pop(selection_id, None)
        self._announce("end", selection_id, shared)

    def _announce(self, kind: str, selection_id: str, held: Reservation | SharedBooking) -> None:
        if self.replicas is not None:
            self.replicas.announce(kind, selection_id, held)

    # --- reads ----------------------------------------------------------------------------------

    async def loads(self, params: QueryParams) -> HandlerResult:
        return 200, await self.shared.loads(self.core, *_filters(params))

    async def potential_loads(self, request: QueryRequest) -> HandlerResult:
        return 200, self.core.potential_loads(request, await self._readings(request))

    async def overlap_scores(self, request: QueryRequest) -> HandlerResult:
        return 200, self.core.overlap_scores(request, await self._readings(request))

    async def dump(self, params: QueryParams) -> HandlerResult:
        return 200, await self.shared.dump()


def _filters(params: QueryParams) -> tuple[str | None, str | None]:
    group = params.get("routing_group")
    tenant = params.get("tenant_id")
    if group is not None and tenant is not None and group != tenant:
        raise InvalidArgument(f"tenant_id `{tenant}` and its alias routing_group `{group}` differ; send one")
    return params.get("model_name"), group if group is not None else tenant


def _log_record(what: str, record: dict[str, Any]) -> None:
    reasons = record.get("not_schedulable_reasons")
    logger.info("worker %d %s for model=%s routing_group=%s: %s%s", record["worker_id"], what, record["model_name"],
                record["routing_group"], record["lifecycle"], f" ({'; '.join(reasons)})" if reasons else "")


class ReadyEndpoint(http.DirectEndpoint):
    """`GET /ready`: 200 when a worker is schedulable, 503 otherwise (and while starting or
    stopping), with the catalog either way, as Dynamo answers it."""

    access = Access.OPEN

    def __init__(self, core: SelectionCore) -> None:
        self.core = core
        self.started = False  # set once the start-up (peer recovery) is over

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        ready, answer = self.core.ready()
        if not self.started:
            ready = answer["ready"] = False
        return (200 if ready else 503), http.encode(answer), b"application/json"


class SelectCollector(Collector):
    def __init__(self, core: SelectionCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        namespace = PREFIX + "select_"
        lifecycles = GaugeMetricFamily(namespace + "workers", "workers in the catalog, by lifecycle",
                                       labels=["lifecycle"])
        counts = dict.fromkeys(("incomplete", "schedulable"), 0)
        for record in self.core.catalog.values():
            counts[record.lifecycle] = counts.get(record.lifecycle, 0) + 1
        for lifecycle, count in counts.items():
            lifecycles.add_metric([lifecycle], count)
        yield lifecycles
        yield GaugeMetricFamily(namespace + "reservations", "bookings in flight (reserved and not yet freed)",
                                len(self.core.reservations))
        pending = self.core.pending
        yield GaugeMetricFamily(namespace + "pending_selections", "selections kept for a later /reservations",
                                len(pending))
        yield GaugeMetricFamily(namespace + "pending_selection_bytes", "their estimated size", pending.bytes)
        yield CounterMetricFamily(namespace + "pending_selections_evicted", "pushed out by the count or byte bound",
                                  pending.evicted_total)
        yield CounterMetricFamily(namespace + "pending_selections_expired", "dropped after their TTL",
                                  pending.expired_total)
        if self.core.sessions is not None:
            yield GaugeMetricFamily(namespace + "session_bindings", "sessions bound to a rank",
                                    len(self.core.sessions))


def _open(endpoint: http.DirectEndpoint) -> http.DirectEndpoint:
    endpoint.access = Access.OPEN  # probes carry no key
    return endpoint


async def _sweep_forever(core: SelectionCore, interval: float, replicas: Replicas | None = None) -> None:
    while True:
        await asyncio.sleep(interval)
        if replicas is not None:
            replicas.expire()
        expired = core.expire()
        if expired:
            logger.info("expired %d bookings older than %ss", expired, core.settings.request_ttl_secs)
        if core.sessions is not None:
            core.sessions.sweep()


async def _register_workers(routes: SelectRoutes, workers: tuple[WorkerRequest, ...], retry_secs: float) -> None:
    """`--workers`: register each; in remote mode one the services refuse for now (unreachable)
    is tried again every `retry_secs` until it is registered."""
    todo = list(workers)
    while todo:
        failed = []
        for worker in todo:
            try:
                result = routes.upsert_worker(worker)
                if not isinstance(result, tuple):
                    await result
            except ServiceError as exc:
                logger.warning("worker %d from --workers: %s (retrying in %ss)", worker.worker_id, exc.message,
                               retry_secs)
                failed.append(worker)
        todo = failed
        if todo:
            await asyncio.sleep(retry_secs)


def create_app(config: SelectServiceConfig = SelectServiceConfig(), core: SelectionCore | None = None) -> http.Service:
    """The selection service app. Start-up merges the first reachable `indexer_peers`' dump into
    the index (workers are not recovered: register them again); shutdown refuses new selections,
    then closes the engine subscriptions."""
    core = core if core is not None else SelectionCore(config.selection)
    listeners = Listeners(core.indexer, replay_timeout_secs=config.replay_timeout_secs)
    shared: SharedState | None = None
    replicas: Replicas | None = None
    replica_collectors: list[Collector] = []
    routes: SelectRoutes
    if config.remote:
        assert config.slot_tracker_url is not None and config.indexer_url is not None
        lean = all(url.startswith("http://") for url in (config.slot_tracker_url, config.indexer_url))
        shared = SharedState(
            AsyncSlotTrackerClient(config.slot_tracker_url, timeout=config.service_timeout_secs, lean=lean,
                                   credentials=config.peer_credentials),
            AsyncIndexerClient(config.indexer_url, timeout=config.service_timeout_secs, lean=lean,
                               credentials=config.peer_credentials))
        if config.replicas is not None:
            from .replicas import ReplicaCollector, Replicas

            replicas = Replicas(config.replicas, core)
            replica_collectors.append(ReplicaCollector(replicas))
        routes = RemoteSelectRoutes(core, listeners, shared, replicas)
    else:
        routes = SelectRoutes(core, listeners)
    readiness = ReadyEndpoint(core)

    @contextlib.asynccontextmanager
    async def lifespan(app: http.Service) -> AsyncIterator[None]:
        if config.indexer_peers:
            await recover(core.indexer, list(config.indexer_peers), deadline_secs=config.recovery_deadline_secs,
                          credentials=config.peer_credentials)
        if replicas is not None:
            await replicas.start()
            await asyncio.wait_for(replicas.caught_up.wait(), DEFAULT_CATALOG_DEADLINE_SECS)
        registering = asyncio.create_task(_register_workers(routes, config.workers, config.sweep_interval_secs))
        if not config.remote:
            await registering  # in one process nothing can fail for a while
        sweeper = asyncio.create_task(_sweep_forever(core, config.sweep_interval_secs, replicas))
        readiness.started = True
        try:
            yield
        finally:
            core.shutting_down = True
            readiness.started = False
            sweeper.cancel()
            registering.cancel()
            await asyncio.gather(sweeper, registering, return_exceptions=True)
            await listeners.close()
            if replicas is not None:
                await replicas.close()
            if shared is not None:
                await shared.aclose()

    read_output_block = optional_reader(OutputBlockRequest)
    app = http.Service(
        routes=[
            Route("/health", _open(http.StaticEndpoint(OK)), methods=["GET"]),
            Route("/ready", readiness, methods=["GET"]),
            http.post("/workers", routes.upsert_worker, read=reader(WorkerRequest)),
            http.get("/workers", routes.workers, parameters=_FILTERS),
            http.post("/workers/{worker_id}", routes.patch_worker, read=reader(WorkerPatch), method="PATCH"),
            http.get("/workers/{worker_id}", routes.delete_worker, method="DELETE"),
            http.post("/select", routes.select, read=reader(SelectRequest), max_body=MAX_BODY, access=Access.READ),
            http.post("/select_and_reserve", routes.select_and_reserve, read=reader(SelectRequest),
                      max_body=MAX_BODY),
            http.post("/reservations", routes.reserve, read=reader(ReservationRequest), max_body=MAX_BODY),
            http.post("/reservations/{selection_id}/prefill_complete", routes.prefill_complete,
                      read=lambda body: body, optional_body=True),
            http.post("/reservations/{selection_id}/output_block", routes.output_block, read=read_output_block,
                      optional_body=True),
            http.get("/reservations/{selection_id}", routes.free, method="DELETE"),
            http.post("/potential_loads", routes.potential_loads, read=reader(QueryRequest), max_body=MAX_BODY,
                      access=Access.READ),
            http.post("/overlap_scores", routes.overlap_scores, read=reader(QueryRequest), max_body=MAX_BODY,
                      access=Access.READ),
            http.get("/loads", routes.loads, parameters=_FILTERS),
            http.get("/dump", routes.dump, access=Access.WRITE),  # the whole index: peers, not gateways
            http.openapi_route(OPENAPI_PATH),
        ],
        lifespan=lifespan,
        collectors=[SelectCollector(core), ListenerCollector(listeners), *replica_collectors],
    )
    app.state.core = core
    app.state.listeners = listeners
    return app


__all__ = ["MAX_BODY", "RemoteSelectRoutes", "SelectRoutes", "SelectServiceConfig", "create_app", "load_workers"]
