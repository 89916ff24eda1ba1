"""httpx clients for both services: one method per route, typed results, typed errors.

`AsyncSlotTrackerClient` / `AsyncIndexerClient` are the clients a gateway uses on its event
loop; `SlotTrackerClient` / `IndexerClient` are their synchronous twins for scripts and tests
(the same methods, written out, each returning its result). All share one `httpx.AsyncClient`
per instance (connection pooling, keep-alive) and a timeout per call.

Errors, as httpx's: every failed call raises a `ServiceCallError` (catch it for "anything went
wrong"); a non-2xx answer is a `ServiceStatusError` with the status and the service's
`{"error": ...}` message; no answer at all is a `ServiceTransportError` (status 0), more
precisely a `ServiceConnectError` (refused, unreachable) or a `ServiceTimeoutError`.

The public names are those of `__all__`, the ones the client reference lists; the rest of the
module may change without notice.

Services started with `--api-key` want `Authorization: Bearer KEY`: every client takes
`api_key=` (default: `DYNAMO_LITE_API_KEY`; `""` sends none), and for https:// URLs `verify=`
(True, a CA bundle path or an `ssl.SSLContext`) and `cert=` (a client certificate for mutual
TLS), as httpx does; or one `credentials=ClientCredentials(...)` for all three.

Answer rows of the slot tracker, re-exported here (they are the tracker core's own types, one
definition of the wire shape):

* `WorkerInfo`: one registered worker (`worker_id`, `model_name`, `tenant_id`, `block_size`,
  and its DP range `dp_start`, `dp_size`), as `workers()` lists them.
* `RankLoad`: one rank's current load (`active_prefill_tokens`, `active_decode_blocks`), as
  `loads()` lists them.
* `PotentialLoad`: one rank's load if a request were added there (`potential_prefill_tokens`,
  `potential_decode_blocks`, plus its `active_requests`), as `potential_loads()` lists them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson

from .credentials import Cert, ClientCredentials, Verify, client_credentials

# The slot tracker's answer rows are the core's own types: one definition of the wire shape.
from .slot_tracker.protocols import PotentialLoad, RankLoad, WorkerInfo

DEFAULT_TIMEOUT_SECS = 5.0
"""Seconds a client waits for each call (connect, read, write) unless told otherwise."""
DEFAULT_TENANT = "default"
"""The `tenant_id` the clients send when none is given, as the services assume."""

_T = TypeVar("_T")


class ServiceCallError(Exception):
    """A call the service answered with an error status, or could not be made at all: the base
    of the client's errors.

    `status` is the HTTP status of the answer, or 0 when there was no answer; `message` is the
    service's `{"error": ...}` text, or the transport error's name and text; `method` and
    `path` name the call (`"POST"`, `"/add"`).
    """

    def __init__(self, status: int, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path} -> {status}: {message}" if method else f"{status}: {message}")
        self.status = status
        self.message = message
        self.method = method
        self.path = path


class ServiceStatusError(ServiceCallError):
    """The service answered with an error status (4xx, 5xx): 404 an unknown model, rank or
    request, 409 a conflict with its state, 401/403 a missing or read-only key..."""


class ServiceTransportError(ServiceCallError):
    """No answer: the call could not be sent, or its answer not read (the connection was reset,
    the answer was cut short). `status` is 0."""

    def __init__(self, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(0, message, method=method, path=path)


class ServiceConnectError(ServiceTransportError):
    """The connection could not be opened: refused, unreachable, a failed TLS handshake."""


class ServiceTimeoutError(ServiceTransportError):
    """No answer within the client's `timeout` (connecting, sending or waiting for it)."""


def _transport_error(exc: httpx.TransportError, method: str, path: str) -> ServiceTransportError:
    """The client error for an httpx transport failure."""
    kind: type[ServiceTransportError] = ServiceTransportError
    if isinstance(exc, httpx.TimeoutException):
        kind = ServiceTimeoutError
    elif isinstance(exc, httpx.ConnectError):
        kind = ServiceConnectError
    return kind(f"{type(exc).__name__}: {exc}", method=method, path=path)


@dataclass(frozen=True, slots=True)
class OverlapScores:
    """The indexer's answer: matched tokens per (instance_id, dp_rank) on the device tier,
    plus the per-instance tier breakdown exactly as the service sends it."""

    scores: dict[tuple[int, int], int]
    instances: dict[int, dict[str, Any]]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> OverlapScores:
        """Parse a `/query` or `/query_by_hash` answer body (string keys become ints)."""
        scores = {
            (int(instance), int(rank)): tokens
            for instance, ranks in body["scores"].items()
            for rank, tokens in ranks.items()
        }
        instances = {int(instance): detail for instance, detail in body.get("instances", {}).items()}
        return cls(scores, instances)


class _Transport:
    """One pooled connection set to one service."""

    def __init__(self, base_url: str, timeout: float, client: httpx.AsyncClient | None,
                 credentials: ClientCredentials) -> None:
        self._owns_client = client is None
        # A client passed in keeps its own settings; the key still goes with every call.
        key_headers = credentials.headers() if client is not None else {}
        self._json_headers = {"content-type": "application/json", **key_headers}
        self._plain_headers = key_headers or None
        self._client = client or httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            **credentials.httpx_options(),
        )

    async def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None) -> Any:
        content = None if body is None else orjson.dumps(body)
        headers = self._json_headers if content is not None else self._plain_headers
        try:
            response = await self._client.request(method, path, content=content, headers=headers, params=params)
        except httpx.TransportError as exc:
            raise _transport_error(exc, method, path) from exc
        if response.status_code >= 400:
            try:
                message = orjson.loads(response.content)["error"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                message = response.text or response.reason_phrase
            raise ServiceStatusError(response.status_code, message, method=method, path=path)
        return orjson.loads(response.content) if response.content else None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _filters(model_name: str | None, tenant_id: str | None) -> dict[str, str]:
    params = {}
    if model_name is not None:
        params["model_name"] = model_name
    if tenant_id is not None:
        params["tenant_id"] = tenant_id
    return params


_C = TypeVar("_C", bound="_AsyncServiceClient")


class _AsyncServiceClient:
    """Connection pool and lifecycle shared by both async clients."""

    def __init__(self, base_url: str, *, timeout: float, client: httpx.AsyncClient | None,
                 pipelined: bool = False, api_key: str | None = None, verify: Verify = True, cert: Cert = None,
                 credentials: ClientCredentials | None = None) -> None:
        if credentials is None:
            credentials = client_credentials(api_key, verify, cert)
        self.credentials = credentials
        if pipelined:
            if client is not None:
                raise ValueError("pipelined=True makes its own connections: pass no httpx client")
            from .pipelined import PipelinedTransport  # imports ServiceCallError from here

            self._transport: Any = PipelinedTransport(base_url, timeout, api_key=credentials.api_key)
        else:
            self._transport = _Transport(base_url, timeout, client, credentials)

    async def __aenter__(self: _C) -> _C:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (not an `httpx.AsyncClient` passed in: its owner closes it)."""
        await self._transport.aclose()

    async def health(self) -> None:
        """`GET /health`: returns if the service answers, raises a `ServiceCallError` otherwise."""
        await self._transport.call("GET", "/health")


class AsyncSlotTrackerClient(_AsyncServiceClient):
    """Async client of the slot tracker (active requests and load per rank); one method per route.

    Pass `client` to share an `httpx.AsyncClient` (its base URL and timeout then apply), or
    `pipelined=True` for the lean pipelined HTTP/1.1 transport (`dynamo_lite.pipelined`: plain
    http only, a tenth of httpx's CPU per call); use it as
    `async with AsyncSlotTrackerClient(url) as tracker:` or call `aclose()` at the end.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8091",
        *,
        timeout: float = DEFAULT_TIMEOUT_SECS,
        client: httpx.AsyncClient | None = None,
        pipelined: bool = False,
        api_key: str | None = None,
        verify: Verify = True,
        cert: Cert = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        super().__init__(base_url, timeout=timeout, client=client, pipelined=pipelined, api_key=api_key,
                         verify=verify, cert=cert, credentials=credentials)

    async def register(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        *,
        dp_start: int = 0,
        dp_size: int = 1,
        tenant_id: str = DEFAULT_TENANT,
    ) -> None:
        """Register a worker with the DP ranks `dp_start` .. `dp_start + dp_size - 1`.

        The first worker of a (model, tenant) fixes its `block_size`; 409 if the worker is
        already registered or the block size differs.
        """
        await self._transport.call("POST", "/register", {
            "worker_id": worker_id, "model_name": model_name, "tenant_id": tenant_id,
            "block_size": block_size, "dp_start": dp_start, "dp_size": dp_size,
        })

    async def unregister(self, worker_id: int, model_name: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """Remove a worker with its ranks and their active requests; 404 if it is not registered."""
        await self._transport.call(
            "POST", "/unregister", {"worker_id": worker_id, "model_name": model_name, "tenant_id": tenant_id}
        )

    async def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerInfo]:
        """The registered workers, optionally of one model and/or tenant only."""
        items = await self._transport.call("GET", "/workers", params=_filters(model_name, tenant_id))
        return [WorkerInfo(**item) for item in items]

    async def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        tenant_id: str = DEFAULT_TENANT,
    ) -> None:
        """Book a request on a rank: its prompt's chained `sequence_hashes` and the
        `new_isl_tokens` still to prefill count in that rank's load until `free()`.

        404 if the model or the rank is unknown (the worker left: route again), 409 if the
        request id is already active.
        """
        await self._transport.call("POST", "/add", {
            "model_name": model_name, "tenant_id": tenant_id, "request_id": request_id,
            "worker_id": worker_id, "dp_rank": dp_rank, "sequence_hashes": list(sequence_hashes),
            "new_isl_tokens": new_isl_tokens,
        })

    async def prefill_complete(self, model_name: str, request_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """The request produced its first token: its prompt tokens stop counting as prefill load."""
        await self._transport.call(
            "POST", "/prefill_complete", {"model_name": model_name, "tenant_id": tenant_id, "request_id": request_id}
        )

    async def output_blocks(
        self, model_name: str, request_id: str, output_blocks: int, *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """The request has generated `output_blocks` full blocks so far (send it every `block_size`
        tokens): they count in its rank's decode blocks until `free()`.

        An absolute count, so a retry is harmless; 409 if it is smaller than the last one sent,
        404 if the request is not active (freed, expired, or its worker left).
        """
        await self._transport.call("POST", "/output_blocks", {
            "model_name": model_name, "tenant_id": tenant_id, "request_id": request_id,
            "output_blocks": output_blocks,
        })

    async def free(self, model_name: str, request_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """The request ended: drop it from its rank's load. Idempotent, so safe to retry."""
        await self._transport.call(
            "POST", "/free", {"model_name": model_name, "tenant_id": tenant_id, "request_id": request_id}
        )

    async def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[RankLoad]:
        """Current load of every rank (idle ones too), optionally of one model and/or tenant."""
        items = await self._transport.call("GET", "/loads", params=_filters(model_name, tenant_id))
        return [RankLoad(**item) for item in items]

    async def potential_loads(
        self,
        model_name: str,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        tenant_id: str = DEFAULT_TENANT,
    ) -> list[PotentialLoad]:
        """Each rank's load if this request were added there, without booking it.

        With `new_isl_tokens=0`, `potential_prefill_tokens` is the rank's active prefill, as
        `KvRouter` asks. 404 if no worker of the model is registered.
        """
        items = await self._transport.call("POST", "/potential_loads", {
            "model_name": model_name, "tenant_id": tenant_id,
            "sequence_hashes": list(sequence_hashes), "new_isl_tokens": new_isl_tokens,
        })
        return [PotentialLoad(**item) for item in items]

    async def dump(self) -> dict[str, Any]:
        """The whole state as a versioned document: every partition's workers and active requests
        with the TTL each has left, what `--snapshot` files hold and `--peers` start-up loads."""
        answer: dict[str, Any] = await self._transport.call("GET", "/dump")
        return answer


class AsyncIndexerClient(_AsyncServiceClient):
    """Async client of the KV-cache indexer (which blocks each rank holds); one method per route.

    Pass `client` to share an `httpx.AsyncClient` (its base URL and timeout then apply), or
    `pipelined=True` for the lean pipelined HTTP/1.1 transport (`dynamo_lite.pipelined`: plain
    http only, a tenth of httpx's CPU per call); use it as
    `async with AsyncIndexerClient(url) as indexer:` or call `aclose()` at the end.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8090",
        *,
        timeout: float = DEFAULT_TIMEOUT_SECS,
        client: httpx.AsyncClient | None = None,
        pipelined: bool = False,
        api_key: str | None = None,
        verify: Verify = True,
        cert: Cert = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        super().__init__(base_url, timeout=timeout, client=client, pipelined=pipelined, api_key=api_key,
                         verify=verify, cert=cert, credentials=credentials)

    async def register(
        self,
        instance_id: int,
        model_name: str,
        block_size: int,
        *,
        dp_rank: int = 0,
        tenant_id: str = DEFAULT_TENANT,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
    ) -> None:
        """Register one rank; with `endpoint` (the engine's ZMQ KV-event publisher) the indexer
        subscribes to it, and asks `replay_endpoint` for batches it missed."""
        body: dict[str, Any] = {
            "instance_id": instance_id, "model_name": model_name, "tenant_id": tenant_id,
            "block_size": block_size, "dp_rank": dp_rank,
        }
        if endpoint is not None:
            body["endpoint"] = endpoint
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        await self._transport.call("POST", "/register", body)

    async def unregister(
        self, instance_id: int, model_name: str, *, tenant_id: str = DEFAULT_TENANT, dp_rank: int | None = None
    ) -> None:
        """Remove one rank, or every rank of the instance when `dp_rank` is None, with their blocks."""
        body: dict[str, Any] = {"instance_id": instance_id, "model_name": model_name, "tenant_id": tenant_id}
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        await self._transport.call("POST", "/unregister", body)

    async def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """The known instances with, per rank, its block counts, event watermark and subscription."""
        answer: list[dict[str, Any]] = await self._transport.call("GET", "/workers", params=_filters(model_name, tenant_id))
        return answer

    async def events(self, document: dict[str, Any]) -> dict[str, Any]:
        """Post a `/dump`-shaped document of RouterEvents; returns the ingest report."""
        answer: dict[str, Any] = await self._transport.call("POST", "/events", document)
        return answer

    async def query_by_hash(
        self, model_name: str, block_hashes: Sequence[int], *, tenant_id: str = DEFAULT_TENANT
    ) -> OverlapScores:
        """Cached tokens per rank for a prompt given as its local block hashes (signed i64).

        404 if nothing is registered or cached for the model yet.
        """
        body = await self._transport.call("POST", "/query_by_hash", {
            "model_name": model_name, "tenant_id": tenant_id, "block_hashes": list(block_hashes),
        })
        return OverlapScores.from_json(body)

    async def query(
        self,
        model_name: str,
        token_ids: Sequence[int],
        *,
        tenant_id: str = DEFAULT_TENANT,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> OverlapScores:
        """`query_by_hash` for a prompt given as token ids: the indexer hashes its full blocks."""
        body: dict[str, Any] = {"model_name": model_name, "tenant_id": tenant_id, "token_ids": list(token_ids)}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return OverlapScores.from_json(await self._transport.call("POST", "/query", body))

    async def routed(
        self,
        instance_id: int,
        model_name: str,
        block_hashes: Sequence[int] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        dp_rank: int = 0,
        tenant_id: str = DEFAULT_TENANT,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """Record that a prompt was routed to this rank (approximate indexing, for engines that
        publish no KV events): its blocks count for the rank for the indexer's TTL. Give the
        prompt as local block hashes (signed i64, as for `query_by_hash`) or as `token_ids`
        (with `lora_name` / `cache_salt`), exactly one of the two. Returns `{"recorded",
        "new", "evicted"}`; 404 if the partition is unknown."""
        body: dict[str, Any] = {
            "instance_id": instance_id, "model_name": model_name, "tenant_id": tenant_id, "dp_rank": dp_rank,
        }
        if block_hashes is not None:
            body["block_hashes"] = list(block_hashes)
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        answer: dict[str, Any] = await self._transport.call("POST", "/routed", body)
        return answer

    async def dump(self) -> dict[str, Any]:
        """The whole index as an events document, which `events()` on another indexer ingests."""
        answer: dict[str, Any] = await self._transport.call("GET", "/dump")
        return answer

    async def peers(self) -> list[str]:
        """The base URLs of the peer indexers this indexer knows (`--peers`, `register_peer`)."""
        answer: list[str] = await self._transport.call("GET", "/peers")
        return answer

    async def register_peer(self, url: str) -> None:
        """Add a peer indexer's base URL to the list `peers()` returns."""
        await self._transport.call("POST", "/register_peer", {"url": url})

    async def deregister_peer(self, url: str) -> None:
        """Remove a peer indexer's base URL; 404 if it is not in the list."""
        await self._transport.call("POST", "/deregister_peer", {"url": url})


_B = TypeVar("_B", bound="_BlockingClient")


class _BlockingClient:
    """Runs an async client's coroutines to completion on a private event loop. Not for use
    inside a running event loop (use the async client there)."""

    def __init__(self, async_client: _AsyncServiceClient) -> None:
        self._async = async_client
        self._loop = asyncio.new_event_loop()

    def _run(self, coroutine: Awaitable[_T]) -> _T:
        return self._loop.run_until_complete(coroutine)

    def health(self) -> None:
        """`GET /health`: returns if the service answers, raises a `ServiceCallError` otherwise."""
        self._run(self._async.health())

    def close(self) -> None:
        """Close the async client's connections and this client's event loop (repeats are no-ops)."""
        if not self._loop.is_closed():
            self._run(self._async.aclose())
            self._loop.close()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SlotTrackerClient(_BlockingClient):
    """Synchronous slot tracker client: `SlotTrackerClient(url).loads()`.

    The methods and arguments of `AsyncSlotTrackerClient`, each returning its result; for
    scripts and tests, not inside a running event loop. Use `with` or call `close()`.
    """

    _async: AsyncSlotTrackerClient

    def __init__(self, base_url: str = "http://127.0.0.1:8091", *, timeout: float = DEFAULT_TIMEOUT_SECS,
                 api_key: str | None = None, verify: Verify = True, cert: Cert = None) -> None:
        super().__init__(AsyncSlotTrackerClient(base_url, timeout=timeout, api_key=api_key, verify=verify, cert=cert))

    def register(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        *,
        dp_start: int = 0,
        dp_size: int = 1,
        tenant_id: str = DEFAULT_TENANT,
    ) -> None:
        """`AsyncSlotTrackerClient.register`, blocking."""
        self._run(self._async.register(
            worker_id, model_name, block_size, dp_start=dp_start, dp_size=dp_size, tenant_id=tenant_id
        ))

    def unregister(self, worker_id: int, model_name: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """`AsyncSlotTrackerClient.unregister`, blocking."""
        self._run(self._async.unregister(worker_id, model_name, tenant_id=tenant_id))

    def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerInfo]:
        """`AsyncSlotTrackerClient.workers`, blocking."""
        return self._run(self._async.workers(model_name, tenant_id))

    def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        tenant_id: str = DEFAULT_TENANT,
    ) -> None:
        """`AsyncSlotTrackerClient.add`, blocking."""
        self._run(self._async.add(
            model_name, request_id, worker_id, dp_rank, sequence_hashes, new_isl_tokens, tenant_id=tenant_id
        ))

    def prefill_complete(self, model_name: str, request_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """`AsyncSlotTrackerClient.prefill_complete`, blocking."""
        self._run(self._async.prefill_complete(model_name, request_id, tenant_id=tenant_id))

    def output_blocks(
        self, model_name: str, request_id: str, output_blocks: int, *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """`AsyncSlotTrackerClient.output_blocks`, blocking."""
        self._run(self._async.output_blocks(model_name, request_id, output_blocks, tenant_id=tenant_id))

    def free(self, model_name: str, request_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """`AsyncSlotTrackerClient.free`, blocking."""
        self._run(self._async.free(model_name, request_id, tenant_id=tenant_id))

    def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[RankLoad]:
        """`AsyncSlotTrackerClient.loads`, blocking."""
        return self._run(self._async.loads(model_name, tenant_id))

    def potential_loads(
        self,
        model_name: str,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        tenant_id: str = DEFAULT_TENANT,
    ) -> list[PotentialLoad]:
        """`AsyncSlotTrackerClient.potential_loads`, blocking."""
        return self._run(self._async.potential_loads(model_name, sequence_hashes, new_isl_tokens, tenant_id=tenant_id))

    def dump(self) -> dict[str, Any]:
        """`AsyncSlotTrackerClient.dump`, blocking."""
        return self._run(self._async.dump())


class IndexerClient(_BlockingClient):
    """Synchronous indexer client: `IndexerClient(url).query_by_hash(model, hashes)`.

    The methods and arguments of `AsyncIndexerClient`, each returning its result; for scripts
    and tests, not inside a running event loop. Use `with` or call `close()`.
    """

    _async: AsyncIndexerClient

    def __init__(self, base_url: str = "http://127.0.0.1:8090", *, timeout: float = DEFAULT_TIMEOUT_SECS,
                 api_key: str | None = None, verify: Verify = True, cert: Cert = None) -> None:
        super().__init__(AsyncIndexerClient(base_url, timeout=timeout, api_key=api_key, verify=verify, cert=cert))

    def register(
        self,
        instance_id: int,
        model_name: str,
        block_size: int,
        *,
        dp_rank: int = 0,
        tenant_id: str = DEFAULT_TENANT,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
    ) -> None:
        """`AsyncIndexerClient.register`, blocking."""
        self._run(self._async.register(
            instance_id, model_name, block_size, dp_rank=dp_rank, tenant_id=tenant_id, endpoint=endpoint,
            replay_endpoint=replay_endpoint
        ))

    def unregister(
        self, instance_id: int, model_name: str, *, tenant_id: str = DEFAULT_TENANT, dp_rank: int | None = None
    ) -> None:
        """`AsyncIndexerClient.unregister`, blocking."""
        self._run(self._async.unregister(instance_id, model_name, tenant_id=tenant_id, dp_rank=dp_rank))

    def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """`AsyncIndexerClient.workers`, blocking."""
        return self._run(self._async.workers(model_name, tenant_id))

    def events(self, document: dict[str, Any]) -> dict[str, Any]:
        """`AsyncIndexerClient.events`, blocking."""
        return self._run(self._async.events(document))

    def query_by_hash(
        self, model_name: str, block_hashes: Sequence[int], *, tenant_id: str = DEFAULT_TENANT
    ) -> OverlapScores:
        """`AsyncIndexerClient.query_by_hash`, blocking."""
        return self._run(self._async.query_by_hash(model_name, block_hashes, tenant_id=tenant_id))

    def query(
        self,
        model_name: str,
        token_ids: Sequence[int],
        *,
        tenant_id: str = DEFAULT_TENANT,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> OverlapScores:
        """`AsyncIndexerClient.query`, blocking."""
        return self._run(self._async.query(
            model_name, token_ids, tenant_id=tenant_id, lora_name=lora_name, cache_salt=cache_salt
        ))

    def routed(
        self,
        instance_id: int,
        model_name: str,
        block_hashes: Sequence[int] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        dp_rank: int = 0,
        tenant_id: str = DEFAULT_TENANT,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """`AsyncIndexerClient.routed`, blocking."""
        return self._run(self._async.routed(
            instance_id, model_name, block_hashes, token_ids=token_ids, dp_rank=dp_rank, tenant_id=tenant_id,
            lora_name=lora_name, cache_salt=cache_salt
        ))

    def dump(self) -> dict[str, Any]:
        """`AsyncIndexerClient.dump`, blocking."""
        return self._run(self._async.dump())

    def peers(self) -> list[str]:
        """`AsyncIndexerClient.peers`, blocking."""
        return self._run(self._async.peers())

    def register_peer(self, url: str) -> None:
        """`AsyncIndexerClient.register_peer`, blocking."""
        self._run(self._async.register_peer(url))

    def deregister_peer(self, url: str) -> None:
        """`AsyncIndexerClient.deregister_peer`, blocking."""
        self._run(self._async.deregister_peer(url))


__all__ = [
    "DEFAULT_TENANT",
    "DEFAULT_TIMEOUT_SECS",
    "AsyncIndexerClient",
    "AsyncSlotTrackerClient",
    "ClientCredentials",
    "IndexerClient",
    "OverlapScores",
    "PotentialLoad",
    "RankLoad",
    "ServiceCallError",
    "ServiceConnectError",
    "ServiceStatusError",
    "ServiceTimeoutError",
    "ServiceTransportError",
    "SlotTrackerClient",
    "WorkerInfo",
]
