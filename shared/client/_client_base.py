"""What the async and the sync clients share: errors, answer types, transports and lifecycles.

The route methods live in `_async_client.py` (written by hand) and `_sync_client.py` (generated
from it by `scripts/generate_sync_client.py`); everything here is written once per flavour where
the flavours differ (an `httpx.AsyncClient` or an `httpx.Client` under the calls) and once for
both where they do not. `dynamo_lite.client` is the public face.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx
import msgspec
import orjson

from dynamo_lite.slot_tracker.protocols import PotentialLoad, RankLoad, WorkerInfo
from dynamo_lite.web.credentials import Cert, ClientCredentials, Verify, client_credentials

DEFAULT_TIMEOUT_SECS = 5.0
"""Seconds a client waits for each call (connect, read, write) unless told otherwise."""
DEFAULT_TENANT = "default"
"""The `tenant_id` the clients send when none is given, as the services assume."""


# --- errors: httpx's split (transport, timeout, status) under the name callers already catch ---


class ServiceCallError(Exception):
    """A call that failed: the base of the client's errors, so `except ServiceCallError` catches all.

    `message` is the service's `{"error": ...}` text or what went wrong on the way; `method`
    and `path` name the call (`"POST"`, `"/add"`); `status` is the HTTP status of an error
    answer (`ServiceStatusError`), 0 when there was no answer (`TransportError`).
    """

    def __init__(self, status: int, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path} -> {status}: {message}" if method else f"{status}: {message}")
        self.status = status
        self.message = message
        self.method = method
        self.path = path


class TransportError(ServiceCallError):
    """No answer came: the connection failed, broke or timed out (`status` is 0).

    Nothing says whether the service did the call. Raised as such for a lost connection;
    `ConnectError`, `CallTimeout` and `InvalidAnswer` say more.
    """

    def __init__(self, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(0, message, method=method, path=path)


class ConnectError(TransportError):
    """No connection could be opened (refused, unknown host, TLS handshake failed): the call was
    not sent."""


class CallTimeout(TransportError):
    """No answer within the client's `timeout`."""


class InvalidAnswer(TransportError):
    """An answer came but does not read: not JSON, cut short, another shape than the route's,
    or larger than the client takes. Nothing says whether the service did the call."""


class ServiceStatusError(ServiceCallError):
    """The service answered with an error status (>= 400): `status`, and its `{"error": ...}`
    text as `message` (400/422 a malformed call, 404 unknown, 409 conflict, 503 unavailable)."""


def status_error(status: int, content: bytes, method: str, path: str) -> ServiceStatusError:
    """The error for an answer with status >= 400: its `{"error": ...}` text, else its body."""
    try:
        message = orjson.loads(content)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = content.decode("utf-8", "replace") or str(status)
    return ServiceStatusError(status, message, method=method, path=path)


def transport_error(error: httpx.TransportError, method: str, path: str) -> TransportError:
    """httpx's transport failure as ours, keeping its name in the message."""
    kind = (CallTimeout if isinstance(error, httpx.TimeoutException)
            else ConnectError if isinstance(error, httpx.ConnectError) else TransportError)
    return kind(f"{type(error).__name__}: {error}", method=method, path=path)


# --- answers: typed, decoded in one pass, unknown fields ignored ---------------------------------
# A service release that adds a field to an answer breaks no deployed client; an answer that
# does not read is an `InvalidAnswer`.


@dataclass(frozen=True, slots=True)
class IndexerRank:
    """One rank of an indexer instance, as `GET /workers` lists it: how it is indexed (`source`:
    `events`, `approximate` or `none`), whether it is registered, the engine's KV-event
    `endpoint` (and `replay_endpoint`, and its listener's state), its device / lower-tier /
    approximated block counts and its event watermark."""

    dp_rank: int
    source: str
    registered: bool = True
    endpoint: str | None = None
    blocks: int = 0
    lower_tier_blocks: int = 0
    approximate_blocks: int = 0
    last_event_id: int | None = None
    replay_endpoint: str | None = None
    listener: dict[str, Any] | None = None  # the ZMQ listener's state, for a rank with an endpoint


@dataclass(frozen=True, slots=True)
class IndexerWorker:
    """One instance the indexer knows (`GET /workers`), with its ranks."""

    instance_id: int
    model_name: str
    tenant_id: str
    block_size: int
    ranks: list[IndexerRank] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class IngestReport:
    """What `POST /events` did: events applied, skipped (re-deliveries), rejected; removals of
    blocks the worker did not hold; gaps in event ids; the first rejections and gaps, as the
    service describes them."""

    applied: int
    skipped: int
    rejected: int
    unknown_removals: int = 0
    gap_count: int = 0
    rejections: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RoutedReport:
    """What `POST /routed` recorded: blocks recorded, of which new, and approximations evicted."""

    recorded: int
    new: int
    evicted: int


class _OverlapAnswer(msgspec.Struct):
    scores: dict[str, dict[str, int]]
    instances: dict[str, dict[str, Any]] = {}


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

    @classmethod
    def _from_answer(cls, answer: _OverlapAnswer) -> OverlapScores:
        try:
            scores = {(int(instance), int(rank)): tokens
                      for instance, ranks in answer.scores.items() for rank, tokens in ranks.items()}
            instances = {int(instance): detail for instance, detail in answer.instances.items()}
        except ValueError as exc:
            raise msgspec.ValidationError(f"an instance or rank key is not an integer: {exc}") from None
        return cls(scores, instances)


class Answer(Protocol):
    """How a transport turns an answer body into a route's result (`decode`); `ValueError` (or
    msgspec's `DecodeError`, a `ValueError`) for one that does not read."""

    def decode(self, content: bytes) -> Any: ...


class _Typed:
    """An answer decoded by msgspec into `type_` (unknown fields ignored), then `then`."""

    __slots__ = ("_decoder", "_then")

    def __init__(self, type_: Any, then: Any = None) -> None:
        self._decoder = msgspec.json.Decoder(type_)
        self._then = then

    def decode(self, content: bytes) -> Any:
        value = self._decoder.decode(content)
        return value if self._then is None else self._then(value)


WORKERS = _Typed(list[WorkerInfo])
LOADS = _Typed(list[RankLoad])
POTENTIAL_LOADS = _Typed(list[PotentialLoad])
DOCUMENT = _Typed(dict[str, Any])
INDEXER_WORKERS = _Typed(list[IndexerWorker])
INGEST_REPORT = _Typed(IngestReport)
ROUTED_REPORT = _Typed(RoutedReport)
OVERLAP = _Typed(_OverlapAnswer, OverlapScores._from_answer)
URLS = _Typed(list[str])


def decode_answer(answer: Answer | None, content: bytes, method: str, path: str) -> Any:
    """The route's result from a 2xx body; None without an `answer` (routes that return nothing
    read no body); `InvalidAnswer` for one that does not read."""
    if answer is None:
        return None
    try:
        return answer.decode(content)
    except ValueError as exc:
        raise InvalidAnswer(f"the answer does not read: {exc}", method=method, path=path) from None


def filters(model_name: str | None, tenant_id: str | None) -> dict[str, str]:
    """The query string of `GET /workers` and `GET /loads`."""
    params = {}
    if model_name is not None:
        params["model_name"] = model_name
    if tenant_id is not None:
        params["tenant_id"] = tenant_id
    return params


# --- transports: one JSON call each, errors as above ---------------------------------------------


class _Calls:
    """What both httpx transports do around the call: options, body and headers, the answer.

    A client passed in keeps its own settings; the key still goes with every call."""

    def __init__(self, client_given: bool, credentials: ClientCredentials) -> None:
        key_headers = credentials.headers() if client_given else {}
        self.json_headers = {"content-type": "application/json", **key_headers}
        self.plain_headers = key_headers or None

    @staticmethod
    def options(base_url: str, timeout: float, credentials: ClientCredentials) -> dict[str, Any]:
        """Keyword arguments of the `httpx.AsyncClient` / `httpx.Client` a transport makes."""
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        return {"base_url": base_url, "timeout": timeout, "limits": limits, **credentials.httpx_options()}

    def request(self, body: Any) -> tuple[bytes | None, dict[str, str] | None]:
        """The content and headers of a call with this JSON body (None: no body)."""
        if body is None:
            return None, self.plain_headers
        return orjson.dumps(body), self.json_headers

    @staticmethod
    def answer(response: httpx.Response, method: str, path: str, answer: Answer | None) -> Any:
        """The route's result, or the `ServiceStatusError`."""
        if response.status_code >= 400:
            raise status_error(response.status_code, response.content, method, path)
        return decode_answer(answer, response.content, method, path)


class AsyncTransport(Protocol):
    """What the async clients call through: httpx's pool or the lean transport."""

    async def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                   answer: Answer | None = None) -> Any: ...

    async def aclose(self) -> None: ...


class _AsyncHTTPTransport:
    """One pooled `httpx.AsyncClient` to one service."""

    def __init__(self, base_url: str, timeout: float, client: httpx.AsyncClient | None,
                 credentials: ClientCredentials) -> None:
        self._owns_client = client is None
        self._calls = _Calls(client is not None, credentials)
        self._client = client or httpx.AsyncClient(**_Calls.options(base_url, timeout, credentials))

    async def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                   answer: Answer | None = None) -> Any:
        content, headers = self._calls.request(body)
        try:
            response = await self._client.request(method, path, content=content, headers=headers, params=params)
        except httpx.TransportError as exc:
            raise transport_error(exc, method, path) from exc
        return self._calls.answer(response, method, path, answer)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


class _HTTPTransport:
    """One pooled `httpx.Client` to one service."""

    def __init__(self, base_url: str, timeout: float, client: httpx.Client | None,
                 credentials: ClientCredentials) -> None:
        self._owns_client = client is None
        self._calls = _Calls(client is not None, credentials)
        self._client = client or httpx.Client(**_Calls.options(base_url, timeout, credentials))

    def call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
             answer: Answer | None = None) -> Any:
        content, headers = self._calls.request(body)
        try:
            response = self._client.request(method, path, content=content, headers=headers, params=params)
        except httpx.TransportError as exc:
            raise transport_error(exc, method, path) from exc
        return self._calls.answer(response, method, path, answer)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()


# --- lifecycles: construction, context managers, /health ---------------------------------------

_A = TypeVar("_A", bound="_AsyncServiceClient")
_S = TypeVar("_S", bound="_ServiceClient")


class _AsyncServiceClient:
    """Connection pool and lifecycle of both async clients."""

    DEFAULT_URL = ""
    """The base URL a client calls when given none: the service's default address."""

    def __init__(self, base_url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_SECS,
                 client: httpx.AsyncClient | None = None, lean: bool = False, api_key: str | None = None,
                 verify: Verify = True, cert: Cert = None, credentials: ClientCredentials | None = None) -> None:
        if credentials is None:
            credentials = client_credentials(api_key, verify, cert)
        self.credentials = credentials
        base_url = self.DEFAULT_URL if base_url is None else base_url
        self._transport: AsyncTransport
        if lean:
            if client is not None:
                raise ValueError("lean=True makes its own connections: pass no httpx client")
            from .lean_http import LeanTransport  # imports this module's errors

            self._transport = LeanTransport(base_url, timeout, api_key=credentials.api_key)
        else:
            self._transport = _AsyncHTTPTransport(base_url, timeout, client, credentials)

    async def __aenter__(self: _A) -> _A:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (not an `httpx.AsyncClient` passed in: its owner closes it)."""
        await self._transport.aclose()

    async def health(self) -> None:
        """`GET /health`: returns if the service answers, raises `ServiceCallError` otherwise."""
        await self._transport.call("GET", "/health")


class _ServiceClient:
    """Connection pool and lifecycle of both sync clients."""

    DEFAULT_URL = ""
    """The base URL a client calls when given none: the service's default address."""

    def __init__(self, base_url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_SECS,
                 client: httpx.Client | None = None, api_key: str | None = None, verify: Verify = True,
                 cert: Cert = None, credentials: ClientCredentials | None = None) -> None:
        if credentials is None:
            credentials = client_credentials(api_key, verify, cert)
        self.credentials = credentials
        base_url = self.DEFAULT_URL if base_url is None else base_url
        self._transport = _HTTPTransport(base_url, timeout, client, credentials)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool (not an `httpx.Client` passed in: its owner closes it)."""
        self._transport.close()

    def health(self) -> None:
        """`GET /health`: returns if the service answers, raises `ServiceCallError` otherwise."""
        self._transport.call("GET", "/health")
