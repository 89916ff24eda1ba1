"""HTTP shell of the indexer: parse and validate, call `Indexer`, shape its results
(`answers.py` for the query routes), serialise.

The query routes answer exactly as Dynamo 1.6.1's indexer does; `/events` takes the very
document `/dump` produces, so two indexers (ours or Dynamo's) can recover from each other.
`/routed` records a routing decision for ranks whose engines publish no KV events.

With replicas (`--nats`, `ReplicatedRoutes`) the write routes publish to the stream instead of
applying: `/events` and `/routed` answer 202 once JetStream stored the write, `/register` and
`/unregister` once this replica applied it (their answer depends on the index).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from msgspec import UNSET, UnsetType

from dynamo_lite.base.errors import AlreadyRegistered, InvalidArgument, InvalidShape
from dynamo_lite.web import http, validation
from dynamo_lite.web.auth import Access
from dynamo_lite.web.credentials import ClientCredentials
from dynamo_lite.web.http import HandlerResult, QueryParams
from dynamo_lite.web.validation import I64, U32, U64, RequestBody, tenant_of

from . import replication
from .answers import query_answer
from .approx import DEFAULT_MAX_BLOCKS as DEFAULT_APPROX_MAX_BLOCKS
from .approx import DEFAULT_TTL_SECS as DEFAULT_APPROX_TTL_SECS
from .core import Indexer
from .endpoints import EndpointRules
from .listeners import DEFAULT_REPLAY_TIMEOUT_SECS, Listeners, Subscription, validate_endpoint
from .metrics import IndexerCollector, ListenerCollector, ReplicationCollector
from .nats_replica import StreamReplica, StreamSettings
from .peers import PeerList, recover
from .protocols import EventsDocument, read_events_document
from .snapshot import Snapshots

logger = logging.getLogger("dynamo_lite.indexer")

OPENAPI_PATH = Path(__file__).with_name("openapi.yaml")
LARGE_BODY = 8 * 1024 * 1024  # /events, /query and /routed carry whole prompts or event batches
APPROX_SWEEP_INTERVAL_SECS = 1.0  # expired approximations of partitions nobody writes to or queries

OK = {"status": "ok"}
_FILTERS = frozenset({"model_name", "tenant_id", "routing_group"})


Tenant = Union[str, UnsetType]


# --- request types: the schema of each POST body (see `dynamo_lite.web.validation.RequestBody`) ----
# Fields are declared in the order Dynamo checks them, so the first problem a body has is the one
# reported; `routing_group` is `tenant_id`'s input alias, checked with it.


class RegisterRequest(RequestBody, kw_only=True):
    """A rank to index; with `endpoint`, the engine's KV event publisher to subscribe to."""

    instance_id: U64
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    block_size: U32
    dp_rank: U32 = 0
    endpoint: str | None = None
    replay_endpoint: str | None = None

    def check(self) -> None:
        # Shape first (422), then values (400), as Dynamo checks them.
        if self.endpoint is not None:
            validate_endpoint(self.endpoint)
        if self.replay_endpoint is not None:
            if self.endpoint is None:
                raise InvalidArgument("replay_endpoint needs an endpoint to subscribe to")
            validate_endpoint(self.replay_endpoint, "replay endpoint")


class UnregisterRequest(RequestBody, kw_only=True):
    """A whole instance, or one of its ranks."""

    dp_rank: U32 | None = None
    instance_id: U64
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET


def _no_cache_salt(body: dict[str, Any]) -> None:
    if body.get("cache_salt") is not None:
        raise InvalidArgument(
            "cache_salt is not accepted by /query_by_hash; block_hashes must already include "
            "the intended cache salt"
        )


class QueryByHashRequest(RequestBody, kw_only=True):
    checks_before = {"cache_salt": _no_cache_salt}

    cache_salt: None = None  # hashes are salted already
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    block_hashes: list[I64]


class QueryRequest(RequestBody, kw_only=True):
    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    token_ids: list[U32]
    lora_name: str | None = None
    cache_salt: str | None = None


def _one_prompt(has_hashes: bool, has_tokens: bool) -> None:
    if has_hashes == has_tokens:
        raise InvalidShape("give exactly one of block_hashes and token_ids")


class RoutedRequest(RequestBody, kw_only=True):
    """A routing decision: the prompt as local hashes (i64, as `/query_by_hash` takes them)
    or as token ids (hashed as `/query` hashes them); exactly one of the two."""

    checks_before = {"lora_name": lambda body: _one_prompt("block_hashes" in body, "token_ids" in body)}

    model_name: str
    tenant_id: Tenant = UNSET
    routing_group: Tenant = UNSET
    instance_id: U64
    dp_rank: U32 = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    token_ids: Union[list[U32], UnsetType] = UNSET
    block_hashes: Union[list[I64], UnsetType] = UNSET

    def check(self) -> None:
        _one_prompt(self.block_hashes is not UNSET, self.token_ids is not UNSET)
        if self.block_hashes is not UNSET and (self.lora_name is not None or self.cache_salt is not None):
            raise InvalidArgument(
                "lora_name and cache_salt go with token_ids; block_hashes must already include them"
            )


class PeerRequest(RequestBody, kw_only=True):
    """Another indexer to recover from (`/register_peer`, `/deregister_peer`)."""

    url: str

    def check(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InvalidArgument(f"peer url `{self.url}` must start with http:// or https://")


class IndexerRoutes:
    """One method per route; each returns (status, JSON-serialisable payload)."""

    # `--allowed-endpoints`: the engine endpoints `/register` may subscribe to (None: any).
    allowed_endpoints: EndpointRules | None = None

    def __init__(self, indexer: Indexer, peers: PeerList, listeners: Listeners) -> None:
        self.indexer = indexer
        self.peers = peers
        self.listeners = listeners

    def register(self, request: RegisterRequest) -> Any:
        return self.subscribe(self._registration(request), 201)

    def _registration(self, request: RegisterRequest) -> Subscription:
        if self.allowed_endpoints is not None:
            if request.endpoint is not None:
                self.allowed_endpoints.check(request.endpoint)
            if request.replay_endpoint is not None:
                self.allowed_endpoints.check(request.replay_endpoint, "replay endpoint")
        return Subscription(request.model_name, tenant_of(request.tenant_id, request.routing_group),
                            request.block_size, request.instance_id, request.dp_rank, request.endpoint or "",
                            request.replay_endpoint)

    def subscribe(self, subscription: Subscription, status: int = 201) -> Any:
        """Register the rank; with an endpoint, start listening to its engine."""
        sub = subscription
        self.indexer.register(
            sub.worker_id, sub.model_name, sub.tenant_id, sub.block_size, sub.dp_rank,
            sub.endpoint or None, sub.replay_endpoint,
        )
        if sub.endpoint:
            self.listeners.start(sub)
            logger.info("worker %d dp_rank %d of model=%s tenant_id=%s: subscribing to %s%s", sub.worker_id,
                        sub.dp_rank, sub.model_name, sub.tenant_id, sub.endpoint,
                        f" (replay: {sub.replay_endpoint})" if sub.replay_endpoint else "")
        return status, OK

    def unregister(self, request: UnregisterRequest) -> Any:
        dropped = self.indexer.unregister(*_unregistration(request))
        self.listeners.stop(dropped)
        return 200, OK

    def workers(self, params: QueryParams) -> HandlerResult:
        tenant = None
        if "tenant_id" in params or "routing_group" in params:
            tenant = validation.resolve_tenant(params.get("tenant_id"), params.get("routing_group"))
        workers = self.indexer.workers(params.get("model_name"), tenant)
        if len(self.listeners):
            for worker in workers:
                for rank in worker.ranks:
                    listener = self.listeners.get((worker.instance_id, rank.dp_rank))
                    if listener is not None:
                        rank.listener = listener.info()
        return 200, workers

    def events(self, document: EventsDocument) -> Any:
        return 200, self.indexer.apply_events(document.sections)

    def query_by_hash(self, request: QueryByHashRequest) -> HandlerResult:
        return 200, query_answer(self.indexer.query(
            request.model_name, tenant_of(request.tenant_id, request.routing_group), request.block_hashes
        ))

    def query(self, request: QueryRequest) -> HandlerResult:
        return 200, query_answer(self.indexer.query_tokens(
            request.model_name, tenant_of(request.tenant_id, request.routing_group), request.token_ids,
            lora_name=request.lora_name, cache_salt=request.cache_salt,
        ))

    def routed(self, request: RoutedRequest) -> Any:
        tenant_id = tenant_of(request.tenant_id, request.routing_group)
        if isinstance(request.block_hashes, list):
            return 200, self.indexer.record_routed(
                request.model_name, tenant_id, request.instance_id, request.dp_rank, request.block_hashes
            )
        assert isinstance(request.token_ids, list)  # `RoutedRequest` holds exactly one of the two
        return 200, self.indexer.record_routed_tokens(
            request.model_name, tenant_id, request.instance_id, request.dp_rank, request.token_ids,
            lora_name=request.lora_name, cache_salt=request.cache_salt,
        )

    def dump(self, params: QueryParams) -> HandlerResult:
        return 200, self.indexer.dump()

    def list_peers(self, params: QueryParams) -> HandlerResult:
        return 200, self.peers.urls()

    def register_peer(self, request: PeerRequest) -> HandlerResult:
        self.peers.add(request.url)
        return 201, OK

    def deregister_peer(self, request: PeerRequest) -> HandlerResult:
        self.peers.remove(request.url)
        return 200, OK


class ReplicatedRoutes(IndexerRoutes):
    """The write routes of a replica (`--nats`): validated here against this replica's index,
    then published to the stream, which every replica applies (this one too)."""

    def __init__(self, indexer: Indexer, peers: PeerList, listeners: Listeners, replica: StreamReplica) -> None:
        super().__init__(indexer, peers, listeners)
        self.replica = replica

    def subscribe(self, subscription: Subscription, status: int = 201) -> Any:
        sub = subscription
        operation = replication.Register(sub.model_name, sub.tenant_id, sub.block_size, sub.worker_id, sub.dp_rank,
                                         sub.endpoint or None, sub.replay_endpoint)
        return self._publish_and_apply(operation, status)

    def unregister(self, request: UnregisterRequest) -> Any:
        instance_id, model_name, tenant_id, dp_rank = _unregistration(request)
        return self._publish_and_apply(replication.Unregister(model_name, tenant_id, instance_id, dp_rank), 200)

    async def _publish_and_apply(self, operation: replication.Operation, status: int) -> HandlerResult:
        applied = await self.replica.publish_and_apply(*replication.encode(operation))
        if applied.error is not None:
            raise applied.error
        return status, OK

    def events(self, document: EventsDocument) -> Any:
        self.indexer.check_events(document.sections)
        return self._accepted(replication.EVENTS, document.body)

    def routed(self, request: RoutedRequest) -> Any:
        tenant_id = tenant_of(request.tenant_id, request.routing_group)
        self.indexer.check_routed(request.model_name, tenant_id, request.instance_id)
        if isinstance(request.block_hashes, list):
            hashes = request.block_hashes
        else:
            assert isinstance(request.token_ids, list)  # `RoutedRequest` holds exactly one of the two
            hashes = self.indexer.hash_tokens(request.model_name, tenant_id, request.token_ids,
                                              lora_name=request.lora_name, cache_salt=request.cache_salt)
        operation = replication.Routed(request.model_name, tenant_id, request.instance_id, request.dp_rank, hashes)
        return self._accepted(*replication.encode(operation))

    async def _accepted(self, kind: str, data: bytes) -> HandlerResult:
        sequence = await self.replica.publish(kind, data)
        return 202, {"status": "accepted", "stream_sequence": sequence}


def _unregistration(request: UnregisterRequest) -> tuple[int, str, str, int | None]:
    return (request.instance_id, request.model_name, tenant_of(request.tenant_id, request.routing_group),
            request.dp_rank)


async def _log_evictions(indexer: Indexer, interval_secs: float = 60.0) -> None:
    """One line per interval with evictions, never one per block."""
    logged = indexer.evicted_blocks_total
    while True:
        await asyncio.sleep(interval_secs)
        total = indexer.evicted_blocks_total
        if total != logged:
            logger.info(
                "evicted %d blocks in the last %.0fs (--max-blocks %d per partition; %d since start-up)",
                total - logged, interval_secs, indexer.max_blocks, total,
            )
            logged = total


async def _expire_approximations(indexer: Indexer, interval_secs: float) -> None:
    """Writes and queries of a partition expire its approximations; this catches the rest."""
    while True:
        await asyncio.sleep(interval_secs)
        indexer.expire_approximations()


async def _collect_garbage(interval_secs: float) -> None:
    """A full garbage collection every `interval_secs`: the process collects only young objects
    on its own (see `dynamo_lite.web.cli.tune_garbage_collector`)."""
    while True:
        await asyncio.sleep(interval_secs)
        started = time.perf_counter()
        found = gc.collect()
        logger.info("full garbage collection: %d unreachable objects, %.0f ms", found,
                    (time.perf_counter() - started) * 1000)


@dataclass(frozen=True)
class IndexerConfig:
    """Everything the indexer app is started with (`python -m dynamo_lite.indexer` builds it
    from its flags; the defaults are the flags' defaults, except `full_gc_interval_secs`,
    which is 0 (no periodic full collection) for an app embedded without `serve`)."""

    max_blocks: int = 0  # per partition; 0: unbounded
    approx_ttl_secs: float = DEFAULT_APPROX_TTL_SECS  # how long a /routed block counts
    approx_max_blocks: int = DEFAULT_APPROX_MAX_BLOCKS  # per partition, (rank, block) approximations; 0: unbounded
    peers: tuple[str, ...] = ()  # indexers to recover from at start-up, first reachable wins
    recovery_deadline_secs: float = 10.0
    snapshot: str | None = None  # file loaded at start-up, rewritten periodically and at shutdown
    snapshot_interval_secs: float = 30.0
    ignore_bad_snapshot: bool = False
    workers: tuple[Subscription, ...] = ()  # engines to subscribe to at start-up
    replay_timeout_secs: float = DEFAULT_REPLAY_TIMEOUT_SECS
    full_gc_interval_secs: float = 0.0
    nats: StreamSettings | None = None  # replicas: the index lives in a JetStream stream (`--nats`)
    peer_credentials: ClientCredentials = ClientCredentials()  # what `peers` want (`/dump`: a full API key)
    allowed_endpoints: EndpointRules | None = None  # engine endpoints `/register` may subscribe to; None: any


def create_app(config: IndexerConfig = IndexerConfig(), indexer: Indexer | None = None) -> http.Service:
    """The indexer app. Start-up loads the `snapshot` file (when given), then recovers from the
    first reachable of `peers`, before the server accepts connections (the server opens the port
    after the lifespan starts), and subscribes to the engines of `workers` (`--workers`). While
    serving, the snapshot is rewritten every `snapshot_interval_secs`, and once more at
    shutdown, after the requests in flight and after every engine listener has closed.

    With `nats` (`--nats`) the app is one replica: start-up connects, loads the newest snapshot
    from the object store and starts consuming the stream (`/ready` waits until it has caught
    up); the write routes publish instead of applying (`ReplicatedRoutes`)."""
    max_blocks, snapshot, full_gc_interval_secs = config.max_blocks, config.snapshot, config.full_gc_interval_secs
    workers, recovery_deadline_secs = config.workers, config.recovery_deadline_secs
    if indexer is None:
        indexer = Indexer(max_blocks, approx_ttl_secs=config.approx_ttl_secs,
                          approx_max_blocks=config.approx_max_blocks)
    peer_list = PeerList(list(config.peers))
    listeners = Listeners(indexer, replay_timeout_secs=config.replay_timeout_secs)
    replica = StreamReplica(indexer, listeners, config.nats) if config.nats is not None else None
    if replica is not None:
        if snapshot or config.peers:
            raise ValueError("with NATS the index is in the stream and its object store: no --snapshot or --peers")
        listeners.publisher = replica
        routes: IndexerRoutes = ReplicatedRoutes(indexer, peer_list, listeners, replica)
    else:
        routes = IndexerRoutes(indexer, peer_list, listeners)
    routes.allowed_endpoints = config.allowed_endpoints
    snapshots = (Snapshots(indexer, snapshot, config.snapshot_interval_secs, ignore_bad=config.ignore_bad_snapshot)
                 if snapshot else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: http.Service) -> AsyncIterator[None]:
        if snapshots is not None:
            snapshots.restore()
        await recover(indexer, peer_list.urls(), deadline_secs=recovery_deadline_secs,
                      credentials=config.peer_credentials)
        if replica is not None:
            await replica.start()
            app.state.not_ready = replica.not_ready
            await _register_workers(routes, workers)
        else:
            for subscription in workers:
                routes.subscribe(subscription)
        tasks = [asyncio.create_task(_log_evictions(indexer)),
                 asyncio.create_task(_expire_approximations(indexer, APPROX_SWEEP_INTERVAL_SECS))]
        if full_gc_interval_secs > 0:
            tasks.append(asyncio.create_task(_collect_garbage(full_gc_interval_secs)))
        if snapshots is not None:
            tasks.append(asyncio.create_task(snapshots.run_periodically()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await listeners.close()
            logger.debug("shutdown: engine listeners closed")
            if replica is not None:
                await replica.stop()
                logger.debug("shutdown: replica stopped")
            if snapshots is not None:
                await snapshots.save_final()

    app = http.Service(
        routes=[
            http.health_route(),
            http.post("/register", routes.register, request_type=RegisterRequest),
            http.post("/unregister", routes.unregister, request_type=UnregisterRequest),
            http.get("/workers", routes.workers, parameters=_FILTERS),
            http.post("/events", routes.events, max_body=LARGE_BODY, read=read_events_document),
            http.post("/query_by_hash", routes.query_by_hash, request_type=QueryByHashRequest, access=Access.READ),
            http.post("/query", routes.query, request_type=QueryRequest, max_body=LARGE_BODY, access=Access.READ),
            http.post("/routed", routes.routed, request_type=RoutedRequest, max_body=LARGE_BODY),
            http.get("/dump", routes.dump, access=Access.WRITE),  # the whole index: replicas, not gateways
            http.get("/peers", routes.list_peers),
            http.post("/register_peer", routes.register_peer, request_type=PeerRequest),
            http.post("/deregister_peer", routes.deregister_peer, request_type=PeerRequest),
            http.openapi_route(OPENAPI_PATH),
        ],
        lifespan=lifespan,
        collectors=[IndexerCollector(indexer), ListenerCollector(listeners)]
        + ([ReplicationCollector(replica)] if replica is not None else []),
    )
    app.state.indexer = indexer
    app.state.peers = peer_list
    app.state.listeners = listeners
    app.state.replica = replica
    return app


async def _register_workers(routes: IndexerRoutes, workers: tuple[Subscription, ...]) -> None:
    """`--workers` of a replica: published like `/register`; a rank another replica registered
    first (they share one `--workers` list) is already what was asked."""
    for subscription in workers:
        try:
            await routes.subscribe(subscription)
        except AlreadyRegistered:
            logger.info("worker %d dp_rank %d: already registered by another replica", subscription.worker_id,
                        subscription.dp_rank)
