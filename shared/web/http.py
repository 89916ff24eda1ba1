"""HTTP plumbing shared by both services.

Routes are Starlette `Route`s whose endpoints are small ASGI callables rather than
request/response functions: a hot route reads its bounded body straight from `receive`,
decodes it with orjson, calls a plain function of the core and writes one orjson-encoded
response. Starlette still does the routing, HEAD handling and 404/405 decisions.

Every failure, including unknown routes, wrong methods and unreadable bodies, is answered as
`{"error": "..."}` with the status of the `ServiceError` kind that describes it.

Every `Service` also serves `/metrics` (Prometheus text format, from its own registry) and
`/ready` (503 until its lifespan's start-up part has returned), records each request's status
and latency per route, and writes an access log line per request when enabled.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any, NamedTuple, cast, final
from urllib.parse import parse_qsl, unquote

import orjson
import yaml
from prometheus_client import generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from dynamo_lite.base.errors import (
    MalformedRequest,
    PayloadTooLarge,
    ServiceError,
    UnsupportedMediaType,
)

from .auth import Access, ApiKeys, ApiKeysCollector
from .logs import AccessLog
from .metrics import DISCONNECTED, UNMATCHED_ROUTE, RequestMetrics, RouteSeries, new_registry
from .validation import RequestBody, decode_json, decoder

logger = logging.getLogger("dynamo_lite.http")

DEFAULT_MAX_BODY = 2 * 1024 * 1024

JsonPayload = Any
HandlerResult = tuple[int, JsonPayload]
# A handler that must wait for something outside the process (a replica's NATS publish to be
# acknowledged) returns a coroutine of its result instead; the answer is then written when it
# completes, still in request order on its connection.
LaterResult = Coroutine[Any, Any, HandlerResult]
BodyHandler = Callable[[Any], HandlerResult | LaterResult]
QueryHandler = Callable[["QueryParams"], HandlerResult | LaterResult]

_JSON_HEADERS = b"application/json"


class ClientDisconnected(Exception):
    """The client went away before its body arrived; there is nobody to answer."""


class Encoded(bytes):
    """A payload already encoded as JSON (an answer built once and reused): sent as it is."""


def encode(payload: JsonPayload) -> bytes:
    if type(payload) is Encoded:
        return payload
    try:
        return orjson.dumps(payload)
    except TypeError:
        # orjson stops at 64-bit integers; token sums are exact by design and may pass 2**64.
        return json.dumps(payload, default=_plain, separators=(",", ":"), ensure_ascii=False).encode()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes | None = _JSON_HEADERS,
    head: bool = False,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-length", str(len(body)).encode("ascii"))]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    value: bytes
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def is_json_content_type(value: bytes | None) -> bool:
    """`application/json` or any `application/*+json`, parameters allowed, case-insensitive."""
    if not value:
        return False
    if value == _JSON_HEADERS:
        return True
    media_type = value.split(b";", 1)[0].strip().lower()
    if media_type == b"application/json":
        return True
    return media_type.startswith(b"application/") and media_type.endswith(b"+json")


def body_refusal(content_type: bytes | None, content_length: bytes | None, max_body: int,
                 optional: bool = False) -> ServiceError | None:
    """Why a body cannot be taken, judged from the head alone (content type, then declared
    size: the order in which Dynamo's services reject bodies), or None. `optional`: no body at
    all (no content type, no or zero length) is taken too."""
    if optional and content_type is None and content_length in (None, b"0"):
        return None
    if not is_json_content_type(content_type):
        return UnsupportedMediaType("expected request with `Content-Type: application/json`")
    if content_length is not None:
        try:
            declared_length = int(content_length)
        except ValueError:
            return MalformedRequest("invalid Content-Length header")
        if declared_length > max_body:
            return too_large(max_body)
    return None


def too_large(max_body: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds the limit of {max_body} bytes")


async def read_body(scope: Scope, receive: Receive, max_body: int, optional: bool = False) -> bytes:
    """The bounded body of an ASGI request (the native server reads its own)."""
    refusal = body_refusal(_header(scope, b"content-type"), _header(scope, b"content-length"), max_body, optional)
    if refusal is not None:
        raise refusal
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > max_body:
                raise too_large(max_body)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class QueryParams(Mapping[str, str]):
    """Form-decoded query parameters in which a known parameter may appear at most once.

    Every API route refuses a parameter it does not take, GET and POST alike: a typo
    (`?model=` for `?model_name=`) would otherwise filter nothing and answer every model's rows
    with a 200, and a gateway would route on the wrong fleet. Dynamo 1.6.1 ignores unknown
    parameters (a documented difference). The probes and `/metrics` ignore their query string.
    """

    def __init__(self, raw: bytes, known: frozenset[str]) -> None:
        values: dict[str, str] = {}
        self._values = values
        if not raw:
            return
        try:
            pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8")
        except ValueError as exc:
            raise MalformedRequest(f"invalid query string: {exc}") from None
        for key, value in pairs:
            if key not in known:
                accepted = f"accepted: {', '.join(sorted(known))}" if known else "this route takes none"
                raise MalformedRequest(f"unknown query parameter `{key}`; {accepted}")
            if key in values:
                raise MalformedRequest(f"failed to deserialize query string: duplicate field `{key}`")
            values[key] = value
        self._values = values

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


# What an endpoint answers: status, body, and the content type (None: no content-type header).
Answer = tuple[int, bytes, bytes | None]
# ... or, for a handler that returned a coroutine, a future of that answer (or of a
# `StreamAnswer`, declared below).
LaterAnswer = asyncio.Future["Answer | StreamAnswer"]
# The request headers an endpoint with `wants_headers` gets: (lower-cased name, value) pairs in
# request order, repeated names kept; the shape of an ASGI scope's "headers".
Headers = list[tuple[bytes, bytes]]


@final  # the native server tells it from a future with `type(x) is StreamAnswer`, which mypy narrows
@dataclasses.dataclass(frozen=True)
class StreamAnswer:
    """An answer whose body is written as `chunks` yields it (Server-Sent Events, say): the
    native server sends it with `transfer-encoding: chunked`, one HTTP chunk per non-empty
    bytes yielded, and waits while the client does not read (the generator is not asked for
    more meanwhile).

    Return it from `respond` (or let a later answer's future resolve to it). When the client
    hangs up mid-stream, the generator is closed (`aclose()`, or the cancellation of the task
    awaiting it): its `finally` is where to abort the work. A generator that has not started
    has no `finally` to run (a HEAD request, a client gone before the stream began), so set up
    what must be undone inside the generator. An exception from the generator truncates the
    body (no terminating chunk) and closes the connection; the client sees an incomplete
    answer. `headers`: extra raw header lines, each ending in CRLF.
    """

    status: int
    content_type: bytes | None  # None: no content-type header (a proxied answer without one)
    chunks: AsyncIterator[bytes]
    headers: bytes = b""


def find_header(headers: Headers, name: bytes) -> bytes | None:
    """The value of the first header `name` (lower-case) in `headers`, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def failure_answer(exc: BaseException) -> Answer:
    if isinstance(exc, ServiceError):
        return exc.status, error_body(exc.message), _JSON_HEADERS
    logger.error("unhandled error while serving a request", exc_info=exc)
    return 500, error_body("internal error; see the service log"), _JSON_HEADERS


class DirectEndpoint(abc.ABC):
    """An endpoint that answers every request itself, failures included, synchronously.

    `respond(query_string, body)` is the whole request: the native server (`dynamo_lite.web.server`)
    calls it straight from its protocol callbacks; `__call__` is the same endpoint for ASGI
    servers and the test client. A non-zero `max_body` means the route takes a JSON body of at
    most that many bytes, which the transport reads and bounds before `respond` sees it.

    `respond` answers with an `Answer`, a future of one (`LaterAnswer`), or a `StreamAnswer`
    (or a future of one) whose body an async generator yields. An endpoint that needs the
    request headers sets `wants_headers` (or subclasses `HeadersEndpoint`) and implements
    `respond_with_headers(query_string, body, headers)` instead.
    """

    max_body: int = 0
    # True: a request without a body (no Content-Type, no or zero Content-Length) is taken
    # and read as b"" (a POST whose body is all optional fields).
    optional_body: bool = False
    # True: the endpoint needs the request headers, and is called through
    # `respond_with_headers` instead of `respond` (see `HeadersEndpoint`). The native server
    # then keeps the headers of every request of its connections; apps without such an
    # endpoint pay nothing.
    wants_headers: bool = False
    # What a request's API key must reach when keys are configured (`Service.protect`); None:
    # READ for a GET route, WRITE for the others.
    access: Access | None = None
    # True: while this endpoint's answer is a future not yet done, the native server keeps
    # reading its connection, so that a client that hangs up is noticed, and cancels the
    # future (the work it stands for stops: an engine's generation, a proxy's upstream calls).
    # A client that half-closes its side while it waits counts as gone.
    cancel_on_disconnect: bool = False

    @abc.abstractmethod
    def respond(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer | StreamAnswer: ...

    def respond_with_headers(
        self, query_string: bytes, body: bytes, headers: Headers
    ) -> Answer | LaterAnswer | StreamAnswer:
        """`respond` for an endpoint with `wants_headers`; `headers` as in `Headers`."""
        return self.respond(query_string, body)

    def answer(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer | StreamAnswer:
        """The answer, or (from a handler that waits for something) a future of it, which
        never fails: a failure is its JSON answer too."""
        try:
            return self.respond(query_string, body)
        except Exception as exc:  # noqa: BLE001 - every failure must still be a JSON answer
            return failure_answer(exc)

    def answer_with_headers(
        self, query_string: bytes, body: bytes, headers: Headers
    ) -> Answer | LaterAnswer | StreamAnswer:
        """`answer` through `respond_with_headers`."""
        try:
            return self.respond_with_headers(query_string, body, headers)
        except Exception as exc:  # noqa: BLE001 - every failure must still be a JSON answer
            return failure_answer(exc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        body = b""
        if self.max_body:
            try:
                body = await read_body(scope, receive, self.max_body, self.optional_body)
            except ClientDisconnected:
                return DISCONNECTED
            except ServiceError as exc:
                status, payload, content_type = failure_answer(exc)
                await send_bytes(send, status, payload, content_type=content_type)
                return status
        if self.wants_headers:
            answer = self.answer_with_headers(scope.get("query_string", b""), body, scope["headers"])
        else:
            answer = self.answer(scope.get("query_string", b""), body)
        if isinstance(answer, asyncio.Future):
            answer = await answer
        if isinstance(answer, StreamAnswer):
            return await send_stream(send, answer, head=scope["method"] == "HEAD")
        status, payload, content_type = answer
        await send_bytes(send, status, payload, content_type=content_type, head=scope["method"] == "HEAD")
        return status


class HeadersEndpoint(DirectEndpoint):
    """An endpoint that reads request headers: implement `respond_with_headers`; `respond`
    (a call without a request) sees no headers."""

    wants_headers = True

    @abc.abstractmethod
    def respond_with_headers(
        self, query_string: bytes, body: bytes, headers: Headers
    ) -> Answer | LaterAnswer | StreamAnswer: ...

    def respond(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer | StreamAnswer:
        return self.respond_with_headers(query_string, body, [])


def _header_pairs(raw: bytes) -> Headers:
    """Raw header lines (`name: value`, each ending in CRLF) as (lower-cased name, value) pairs."""
    pairs = []
    for line in raw.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b":")
            pairs.append((name.strip().lower(), value.strip()))
    return pairs


async def send_stream(send: Send, answer: StreamAnswer, *, head: bool = False) -> int:
    """Send a `StreamAnswer` through ASGI: the start, one body message per chunk, an empty last
    one. The generator is closed whatever happens; a client gone (`send` raising `OSError`, as
    ASGI servers do) is recorded as `DISCONNECTED`, a failing generator propagates (the server
    then cuts the answer short)."""
    chunks = answer.chunks
    headers = [(b"content-type", answer.content_type)] if answer.content_type is not None else []
    if answer.headers:
        headers.extend(_header_pairs(answer.headers))
    try:
        if not await _sent(send, {"type": "http.response.start", "status": answer.status, "headers": headers}):
            return DISCONNECTED
        if not head:
            async for chunk in chunks:
                if chunk and not await _sent(send, {"type": "http.response.body", "body": chunk, "more_body": True}):
                    return DISCONNECTED
        if not await _sent(send, {"type": "http.response.body", "body": b""}):
            return DISCONNECTED
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    return answer.status


async def _sent(send: Send, message: Message) -> bool:
    """Send `message`; False when the client is gone (ASGI servers raise an `OSError`)."""
    try:
        await send(message)
    except OSError:
        return False
    return True


_NO_PARAMETERS: frozenset[str] = frozenset()


class JsonBodyEndpoint(DirectEndpoint):
    """A POST route: bounded JSON body in, `handler(read(body)) -> (status, payload)`; `read`
    is a `RequestBody` type's decoder, or plain JSON decoding."""

    def __init__(
        self, handler: BodyHandler, *, read: Callable[[bytes], Any] = decode_json, max_body: int = DEFAULT_MAX_BODY
    ) -> None:
        self.handler = handler
        self.read = read
        self.max_body = max_body

    def respond(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer:
        if query_string:
            QueryParams(query_string, _NO_PARAMETERS)  # refuses any parameter, as GET routes do
        return _answer(self.handler(self.read(body)))


async def _answer_later(result: Awaitable[HandlerResult]) -> Answer:
    try:
        status, payload = await result
        return status, encode(payload), _JSON_HEADERS
    except Exception as exc:  # noqa: BLE001 - every failure must still be a JSON answer
        return failure_answer(exc)


class JsonQueryEndpoint(DirectEndpoint):
    """A GET route: query parameters in, `handler(params) -> (status, payload)`."""

    def __init__(self, handler: QueryHandler, *, parameters: frozenset[str] = frozenset()) -> None:
        self.handler = handler
        self.parameters = parameters

    def respond(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer:
        return _answer(self.handler(QueryParams(query_string, self.parameters)))


# The parameters of a templated path (`/workers/{worker_id}` -> {"worker_id": "7"}), as sent:
# percent-decoded, not yet typed; the handler parses them.
PathParams = dict[str, str]


class PathEndpoint(DirectEndpoint):
    """An endpoint of a templated path (`/reservations/{selection_id}/prefill_complete`):
    `respond_at(params, query_string, body)` answers a request, and the router hands the
    server `bound(params)`, an endpoint for that one request."""

    @abc.abstractmethod
    def respond_at(self, params: PathParams, query_string: bytes, body: bytes) -> Answer | LaterAnswer: ...

    def respond(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer:
        return self.respond_at({}, query_string, body)

    def bound(self, params: PathParams) -> DirectEndpoint:
        return _BoundEndpoint(self, params)


class _BoundEndpoint(DirectEndpoint):
    """A `PathEndpoint` with one request's path parameters: what the servers call."""

    def __init__(self, endpoint: PathEndpoint, params: PathParams) -> None:
        self.endpoint = endpoint
        self.params = params
        self.max_body = endpoint.max_body
        self.access = endpoint.access
        self.optional_body = endpoint.optional_body

    def respond(self, query_string: bytes, body: bytes) -> Answer | LaterAnswer:
        return self.endpoint.respond_at(self.params, query_string, body)


PathBodyHandler = Callable[[PathParams, Any], HandlerResult | LaterResult]
PathQueryHandler = Callable[[PathParams, "QueryParams"], HandlerResult | LaterResult]


class PathBodyEndpoint(PathEndpoint):
    """A templated route with a JSON body: `handler(params, read(body))`. With
    `optional_body`, a request without a body (no `Content-Type`, nothing sent) reads as `b""`,
    which `read` must accept."""

    def __init__(self, handler: PathBodyHandler, *, read: Callable[[bytes], Any] = decode_json,
                 max_body: int = DEFAULT_MAX_BODY, optional_body: bool = False) -> None:
        self.handler = handler
        self.read = read
        self.max_body = max_body
        self.optional_body = optional_body

    def respond_at(self, params: PathParams, query_string: bytes, body: bytes) -> Answer | LaterAnswer:
        if query_string:
            QueryParams(query_string, _NO_PARAMETERS)
        return _answer(self.handler(params, self.read(body)))


class PathQueryEndpoint(PathEndpoint):
    """A templated route without a body (GET, DELETE): `handler(params, query parameters)`."""

    def __init__(self, handler: PathQueryHandler, *, parameters: frozenset[str] = frozenset()) -> None:
        self.handler = handler
        self.parameters = parameters

    def respond_at(self, params: PathParams, query_string: bytes, body: bytes) -> Answer | LaterAnswer:
        return _answer(self.handler(params, QueryParams(query_string, self.parameters)))


def _answer(result: HandlerResult | LaterResult) -> Answer | LaterAnswer:
    if type(result) is tuple:
        status, payload = result
        return status, encode(payload), _JSON_HEADERS
    return asyncio.ensure_future(_answer_later(cast(LaterResult, result)))


class StaticEndpoint(DirectEndpoint):
    """GET and HEAD answered with fixed bytes (a class: Starlette treats plain functions as
    request/response handlers)."""

    def __init__(self, body: bytes, content_type: bytes | None = _JSON_HEADERS) -> None:
        self._answer: Answer = (200, body, content_type)

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        return self._answer


# The text format `generate_latest` writes; every Prometheus version reads it under this type
# (prometheus-client's own server still answers it by default).
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class MetricsEndpoint(DirectEndpoint):
    """`GET /metrics`: the registry in Prometheus text format, collected at each scrape. With
    API keys, any key may scrape it, or anyone with `--public-metrics`."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        return 200, generate_latest(self.registry), METRICS_CONTENT_TYPE


READY_BODY = encode({"status": "ready"})
NOT_READY_BODY = error_body("not ready: start-up has not finished, or shutdown has begun")


class ReadyEndpoint(DirectEndpoint):
    """`GET /ready`: 200 once `state.ready` is true, 503 before (and from shutdown on). An app
    may also set `state.not_ready` to a function that says why it cannot serve yet (a replica
    catching up with its stream), or None when it can. Open to all: probes carry no key."""

    access = Access.OPEN

    def __init__(self, state: Any) -> None:
        self.state = state

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        if not getattr(self.state, "ready", False):
            return 503, NOT_READY_BODY, _JSON_HEADERS
        not_ready = getattr(self.state, "not_ready", None)
        reason = not_ready() if not_ready is not None else None
        if reason is not None:
            return 503, error_body(reason), _JSON_HEADERS
        return 200, READY_BODY, _JSON_HEADERS


def post(
    path: str,
    handler: Any,
    *,
    request_type: type[RequestBody] | None = None,
    read: Callable[[bytes], Any] | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    access: Access = Access.WRITE,
    method: str = "POST",
    optional_body: bool = False,
) -> Route:
    """A route with a JSON body (POST unless `method` says otherwise); the handler gets the
    body as `request_type` (see `RequestBody`), or as `read` returns it, or else as the decoded
    JSON document; on a templated path (`/workers/{worker_id}`) it gets the path's parameters
    first. `access`: READ for a query that changes nothing (a read-only key may call it)."""
    if read is None:
        read = decoder(request_type) if request_type is not None else decode_json
    endpoint: DirectEndpoint
    if "{" in path:
        endpoint = PathBodyEndpoint(handler, read=read, max_body=max_body, optional_body=optional_body)
    else:
        endpoint = JsonBodyEndpoint(handler, read=read, max_body=max_body)
        endpoint.optional_body = optional_body
    endpoint.access = access
    return Route(path, endpoint, methods=[method])


def get(path: str, handler: Any, *, parameters: frozenset[str] = frozenset(),
        access: Access | None = None, method: str = "GET") -> Route:
    """A route without a body (GET unless `method` says otherwise: DELETE); the handler gets
    the query parameters, after the path's on a templated path. `access`: by default READ for
    a GET, WRITE for another method; WRITE for a GET only a full key may call (`/dump`: the
    whole state)."""
    if access is None:
        access = Access.READ if method == "GET" else Access.WRITE
    endpoint: DirectEndpoint
    if "{" in path:
        endpoint = PathQueryEndpoint(handler, parameters=parameters)
    else:
        endpoint = JsonQueryEndpoint(handler, parameters=parameters)
    endpoint.access = access
    return Route(path, endpoint, methods=[method])


def health_route() -> Route:
    """Liveness only: 200 with an empty body as soon as the listener answers; open to all."""
    endpoint = StaticEndpoint(b"", content_type=None)
    endpoint.access = Access.OPEN
    return Route("/health", endpoint, methods=["GET"])


class OpenApiEndpoint(DirectEndpoint):
    """`GET /openapi.json`: the service's document as it runs. Started without a key, the
    document has no security requirement and no 401/403 answers (no call can get one); with
    keys (`Service.protect`), the whole document. Both converted once, at start-up."""

    def __init__(self, spec_path: Path) -> None:
        document = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
        self.keyed = orjson.dumps(document)
        self.open = orjson.dumps(unsecured(document))
        self.protected = False

    def respond(self, query_string: bytes, body: bytes) -> Answer:
        return 200, self.keyed if self.protected else self.open, _JSON_HEADERS


def unsecured(document: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI document without its security: no requirement (top level or per operation),
    no security schemes, no 401 and 403 answers."""
    document = copy.deepcopy(document)
    document.pop("security", None)
    components = document.get("components", {})
    components.pop("securitySchemes", None)
    for responses_name in ("Unauthorized", "ReadOnlyKey"):
        components.get("responses", {}).pop(responses_name, None)
    for item in document.get("paths", {}).values():
        for operation in item.values():
            if not isinstance(operation, dict):
                continue
            operation.pop("security", None)
            responses = operation.get("responses", {})
            for status in ("401", "403"):
                responses.pop(status, None)
    return document


def openapi_route(spec_path: Path) -> Route:
    """Serve the service's OpenAPI YAML document as JSON (`OpenApiEndpoint`)."""
    return Route("/openapi.json", OpenApiEndpoint(spec_path), methods=["GET"])


NOT_FOUND_BODY = error_body("route not found")
NOT_ALLOWED_BODY = error_body("method not allowed")


def allow_header(methods: Iterable[str]) -> bytes:
    """The `Allow` value of a 405, sorted so that clients and caches see it stable."""
    return ", ".join(sorted(methods)).encode("ascii")


Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[Any]]


class RouteEntry(NamedTuple):
    methods: frozenset[str]
    endpoint: DirectEndpoint
    series: RouteSeries
    # OPEN for every route until `Service.protect`: the servers check keys only when not OPEN.
    access: Access = Access.OPEN


class MethodRoutes:
    """The entries of a path that several endpoints serve, one per method (`POST /workers`
    and `GET /workers`); each entry's `methods` is the path's, for the 405's `Allow`."""

    __slots__ = ("by_method", "fallback")

    def __init__(self, by_method: dict[str, RouteEntry]) -> None:
        self.by_method = by_method
        self.fallback = next(iter(by_method.values()))

    def pick(self, method: str) -> RouteEntry:
        return self.by_method.get(method, self.fallback)

    def distinct(self) -> list[RouteEntry]:
        """One entry per endpoint, its `methods` the ones it answers (GET's and HEAD's are one)."""
        methods: dict[int, set[str]] = {}
        entries: dict[int, RouteEntry] = {}
        for method, entry in self.by_method.items():
            methods.setdefault(id(entry), set()).add(method)
            entries[id(entry)] = entry
        return [entry._replace(methods=frozenset(methods[key])) for key, entry in entries.items()]


PathRoutes = RouteEntry | MethodRoutes


def _path_routes(path: str, routes: list[Route], series: RouteSeries) -> PathRoutes:
    if len(routes) == 1:
        return RouteEntry(frozenset(routes[0].methods or ()), cast(DirectEndpoint, routes[0].endpoint), series)
    methods = frozenset(method for route in routes for method in route.methods or ())
    by_method: dict[str, RouteEntry] = {}
    for route in routes:
        entry = RouteEntry(methods, cast(DirectEndpoint, route.endpoint), series)
        for method in route.methods or ():
            if method in by_method:
                raise ValueError(f"two routes answer {method} {path}")
            by_method[method] = entry
    return MethodRoutes(by_method)


def route_access(entry: RouteEntry, public_metrics: bool) -> Access:
    """The level a request's key must reach to call `entry` (see `dynamo_lite.web.auth`)."""
    endpoint = entry.endpoint
    if type(endpoint) is MetricsEndpoint:
        return Access.OPEN if public_metrics else Access.READ
    if endpoint.access is not None:
        return endpoint.access
    return Access.READ if entry.methods <= {"GET", "HEAD"} else Access.WRITE


class Service(Starlette):
    """An ASGI app of `DirectEndpoint` routes that routes requests itself.

    Paths match exactly (as in Dynamo: `/health/` is a 404); a path that is no route is a JSON
    404, a known path with another method a JSON 405 with `Allow`. Starlette runs the lifespan
    and keeps `state`; no request goes through its middleware or router. The native server
    (`dynamo_lite.web.server`) routes with the same table (`endpoint`) and calls the same endpoints.

    Beside the given routes it serves `/ready` and `/metrics`. `state.ready` turns true when
    the lifespan's start-up part (everything before its `yield`: recovery, loading) has
    returned, and false again when shutdown begins. `collectors` add the core's metrics to the
    app's own registry (`metrics_registry`). Every request's status and latency are recorded
    per route; `access_log`, when set, is called once per request.
    """

    def __init__(
        self,
        *,
        routes: list[Route],
        lifespan: Lifespan | None = None,
        collectors: Iterable[Collector] = (),
    ) -> None:
        self.request_metrics = RequestMetrics()
        self.metrics_registry = new_registry(self.request_metrics)
        for collector in collectors:
            self.metrics_registry.register(collector)
        super().__init__(routes=routes, lifespan=self._readiness(lifespan))
        self.state.ready = False
        paths = {route.path for route in self.routes if isinstance(route, Route)}
        if "/ready" not in paths:  # an app may answer readiness itself
            self.router.routes.append(Route("/ready", ReadyEndpoint(self.state), methods=["GET"]))
        self.router.routes.append(Route("/metrics", MetricsEndpoint(self.metrics_registry), methods=["GET"]))
        by_path: dict[str, list[Route]] = {}
        for route in self.routes:
            if not isinstance(route, Route) or not isinstance(route.endpoint, DirectEndpoint):
                raise TypeError(f"route {getattr(route, 'path', route)!r} is not a DirectEndpoint route")
            by_path.setdefault(route.path, []).append(route)
        # Exact paths first (the hot routes: one dict lookup), then the templated ones in order.
        self._table: dict[str, PathRoutes] = {}
        self._templates: list[tuple[tuple[str, ...], PathRoutes]] = []
        for path, same_path in by_path.items():
            entries = _path_routes(path, same_path, self.request_metrics.route(path))
            if "{" in path:
                if not all(isinstance(route.endpoint, PathEndpoint) for route in same_path):
                    raise TypeError(f"templated route {path!r} needs PathEndpoint endpoints")
                self._templates.append((tuple(path.split("/")), entries))
            else:
                self._table[path] = entries
        self.unmatched_route = self.request_metrics.route(UNMATCHED_ROUTE)
        # Whether the native server must keep request headers for some route (`wants_headers`).
        self.wants_headers = any(entry.endpoint.wants_headers for _, entry in self.entries())
        self.access_log: AccessLog | None = None
        self.api_keys: ApiKeys | None = None

    def protect(self, api_keys: ApiKeys) -> None:
        """Require `api_keys` on every route but the probes (and `/metrics` with
        `public_metrics`); refusals are counted in `/metrics`."""
        self.api_keys = api_keys

        def protected(entries: PathRoutes) -> PathRoutes:
            if type(entries) is RouteEntry:
                return entries._replace(access=route_access(entries, api_keys.public_metrics))
            assert isinstance(entries, MethodRoutes)
            return MethodRoutes({method: cast(RouteEntry, protected(entry)) for method, entry in entries.by_method.items()})

        for _, entry in self.entries():
            if isinstance(entry.endpoint, OpenApiEndpoint):
                entry.endpoint.protected = True
        self._table = {path: protected(entries) for path, entries in self._table.items()}
        self._templates = [(template, protected(entries)) for template, entries in self._templates]
        self.metrics_registry.register(ApiKeysCollector(api_keys))

    def endpoint(self, path: str, method: str, raw_path: str | None = None) -> RouteEntry | None:
        """The path's methods, and the endpoint, metric series and access of `method` on it
        (a `method` the path does not take: another method's, and the server answers 405);
        None for a path that is no route. `path` is percent-decoded; `raw_path` (as sent, when
        it differs) lets a templated path's parameter hold an encoded `/` (`a%2Fb` is `a/b`)."""
        entries = self._table.get(path)
        if type(entries) is RouteEntry:
            return entries
        if entries is not None:
            return cast(MethodRoutes, entries).pick(method)
        return self._templated(raw_path if raw_path is not None else path, method) if self._templates else None

    def _templated(self, path: str, method: str) -> RouteEntry | None:
        segments = path.split("/")
        for template, entries in self._templates:
            if len(template) != len(segments):
                continue
            params: PathParams = {}
            for expected, segment in zip(template, segments):
                if expected[:1] == "{":
                    if not segment:
                        break
                    params[expected[1:-1]] = unquote(segment) if "%" in segment else segment
                elif expected != (unquote(segment) if "%" in segment else segment):
                    break
            else:
                entry = entries if type(entries) is RouteEntry else cast(MethodRoutes, entries).pick(method)
                assert isinstance(entry.endpoint, PathEndpoint)
                return entry._replace(endpoint=entry.endpoint.bound(params))
        return None

    def entries(self) -> Iterator[tuple[str, RouteEntry]]:
        """Every (path, entry) of the app, for introspection: one per endpoint of a path that
        several serve, its `methods` the ones it answers (templated paths as written:
        `/workers/{worker_id}`)."""
        tables = [*self._table.items(), *(("/".join(template), entries) for template, entries in self._templates)]
        for path, entries in tables:
            if type(entries) is RouteEntry:
                yield path, entries
            else:
                yield from ((path, entry) for entry in cast(MethodRoutes, entries).distinct())

    def _readiness(self, lifespan: Lifespan | None) -> Lifespan:
        @contextlib.asynccontextmanager
        async def ready_after_start_up(app: Any) -> AsyncIterator[Any]:
            async with (lifespan(app) if lifespan is not None else contextlib.nullcontext()) as state:
                self.state.ready = True
                try:
                    yield state
                finally:
                    self.state.ready = False

        return ready_after_start_up

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)  # the lifespan
            return
        start = perf_counter()
        raw_path = scope.get("raw_path")
        route = self.endpoint(scope["path"], scope["method"], raw_path.decode("latin-1") if raw_path else None)
        head = scope["method"] == "HEAD"
        if route is None:
            series, status = self.unmatched_route, 404
            await send_bytes(send, status, NOT_FOUND_BODY, head=head)
        elif scope["method"] not in route.methods:
            series, status = route.series, 405
            await send_bytes(send, status, NOT_ALLOWED_BODY, head=head,
                             extra_headers=[(b"allow", allow_header(route.methods))])
        elif (route.access and self.api_keys is not None
              and (refusal := self.api_keys.check(_header(scope, b"authorization"), route.access)) is not None):
            series, status = route.series, refusal.status
            await send_bytes(send, status, refusal.body, head=head, extra_headers=[refusal.header_pair])
        else:
            series = route.series
            status = await route.endpoint(scope, receive, send)
        series.record(status, perf_counter() - start)
        if self.access_log is not None:
            self.access_log.from_scope(scope, status, perf_counter() - start)


__all__ = [
    "DEFAULT_MAX_BODY",
    "MethodRoutes",
    "PathBodyEndpoint",
    "PathEndpoint",
    "PathParams",
    "PathQueryEndpoint",
    "DirectEndpoint",
    "Headers",
    "HeadersEndpoint",
    "JsonBodyEndpoint",
    "JsonQueryEndpoint",
    "QueryParams",
    "Service",
    "StreamAnswer",
    "find_header",
    "get",
    "health_route",
    "openapi_route",
    "post",
]
