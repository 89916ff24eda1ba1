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
import contextlib
import dataclasses
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any, Union
from urllib.parse import parse_qsl

import orjson
import yaml
from prometheus_client import generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .errors import (
    MalformedRequest,
    PayloadTooLarge,
    ServiceError,
    UnsupportedMediaType,
)
from .logs import AccessLog
from .metrics import DISCONNECTED, UNMATCHED_ROUTE, RequestMetrics, RouteSeries, new_registry

logger = logging.getLogger("dynamo_lite.http")

DEFAULT_MAX_BODY = 2 * 1024 * 1024

JsonPayload = Any
HandlerResult = tuple[int, JsonPayload]
BodyHandler = Callable[[Any], Union[HandlerResult, Awaitable[HandlerResult]]]
QueryHandler = Callable[["QueryParams"], Union[HandlerResult, Awaitable[HandlerResult]]]

_JSON_HEADERS = b"application/json"


class ClientDisconnected(Exception):
    """The client went away before its body arrived; there is nobody to answer."""


def encode(payload: JsonPayload) -> bytes:
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
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def is_json_content_type(value: bytes | None) -> bool:
    """`application/json` or any `application/*+json`, parameters allowed, case-insensitive."""
    if not value:
        return False
    media_type = value.split(b";", 1)[0].strip().lower()
    if media_type == b"application/json":
        return True
    return media_type.startswith(b"application/") and media_type.endswith(b"+json")


async def read_json_body(scope: Scope, receive: Receive, max_body: int) -> Any:
    """Content type, then size, then syntax: the order in which Dynamo's services reject bodies."""
    if not is_json_content_type(_header(scope, b"content-type")):
        raise UnsupportedMediaType("Expected request with `Content-Type: application/json`")
    declared = _header(scope, b"content-length")
    if declared is not None:
        try:
            declared_length = int(declared)
        except ValueError:
            raise MalformedRequest("invalid Content-Length header") from None
        if declared_length > max_body:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_body} bytes")
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
                raise PayloadTooLarge(f"request body exceeds the limit of {max_body} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedRequest(f"Failed to parse the request body as JSON: {exc}") from None


class QueryParams(Mapping[str, str]):
    """Form-decoded query parameters in which a known parameter may appear at most once."""

    def __init__(self, raw: bytes, known: frozenset[str]) -> None:
        values: dict[str, str] = {}
        try:
            pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8")
        except ValueError as exc:
            raise MalformedRequest(f"invalid query string: {exc}") from None
        for key, value in pairs:
            if key not in known:
                continue
            if key in values:
                raise MalformedRequest(f"Failed to deserialize query string: duplicate field `{key}`")
            values[key] = value
        self._values = values

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


async def _call(handler: Callable[[Any], Any], argument: Any, is_async: bool) -> HandlerResult:
    if is_async:
        return await handler(argument)  # type: ignore[no-any-return]
    return handler(argument)  # type: ignore[no-any-return]


async def _answer_failure(send: Send, exc: BaseException, head: bool) -> int:
    if isinstance(exc, ServiceError):
        await send_bytes(send, exc.status, error_body(exc.message), head=head)
        return exc.status
    logger.exception("unhandled error while serving a request")
    await send_bytes(send, 500, error_body("internal error; see the service log"), head=head)
    return 500


class DirectEndpoint(abc.ABC):
    """An ASGI endpoint that answers every request itself (failures included) and returns the
    status it sent: `Service` dispatches to it directly and records that status."""

    @abc.abstractmethod
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int: ...


class JsonBodyEndpoint(DirectEndpoint):
    """ASGI endpoint of a POST route: bounded JSON body in, `handler(body) -> (status, payload)`."""

    def __init__(self, handler: BodyHandler, *, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.handler = handler
        self.max_body = max_body
        self._is_async = inspect.iscoroutinefunction(handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        try:
            body = await read_json_body(scope, receive, self.max_body)
            status, payload = await _call(self.handler, body, self._is_async)
        except ClientDisconnected:
            return DISCONNECTED
        except Exception as exc:  # noqa: BLE001 - every failure must still be a JSON answer
            return await _answer_failure(send, exc, head=False)
        await send_bytes(send, status, encode(payload))
        return status


class JsonQueryEndpoint(DirectEndpoint):
    """ASGI endpoint of a GET route: query parameters in, `handler(params) -> (status, payload)`."""

    def __init__(self, handler: QueryHandler, *, parameters: frozenset[str] = frozenset()) -> None:
        self.handler = handler
        self.parameters = parameters
        self._is_async = inspect.iscoroutinefunction(handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        head = scope["method"] == "HEAD"
        try:
            params = QueryParams(scope.get("query_string", b""), self.parameters)
            status, payload = await _call(self.handler, params, self._is_async)
        except Exception as exc:  # noqa: BLE001
            return await _answer_failure(send, exc, head=head)
        await send_bytes(send, status, encode(payload), head=head)
        return status


class StaticEndpoint(DirectEndpoint):
    """ASGI endpoint answering GET and HEAD with fixed bytes (a class: Starlette treats plain
    functions as request/response handlers)."""

    def __init__(self, body: bytes, content_type: bytes | None = _JSON_HEADERS) -> None:
        self.body = body
        self.content_type = content_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        await send_bytes(
            send, 200, self.body, content_type=self.content_type, head=scope["method"] == "HEAD"
        )
        return 200


# The text format `generate_latest` writes; every Prometheus version reads it under this type
# (prometheus-client's own server still answers it by default).
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class MetricsEndpoint(DirectEndpoint):
    """`GET /metrics`: the registry in Prometheus text format, collected at each scrape."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        await send_bytes(
            send, 200, generate_latest(self.registry), content_type=METRICS_CONTENT_TYPE,
            head=scope["method"] == "HEAD",
        )
        return 200


READY_BODY = encode({"status": "ready"})
NOT_READY_BODY = error_body("not ready: start-up has not finished, or shutdown has begun")


class ReadyEndpoint(DirectEndpoint):
    """`GET /ready`: 200 once `state.ready` is true, 503 before (and from shutdown on)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> int:
        status, body = (200, READY_BODY) if getattr(self.state, "ready", False) else (503, NOT_READY_BODY)
        await send_bytes(send, status, body, head=scope["method"] == "HEAD")
        return status


def post(path: str, handler: BodyHandler, *, max_body: int = DEFAULT_MAX_BODY) -> Route:
    return Route(path, JsonBodyEndpoint(handler, max_body=max_body), methods=["POST"])


def get(path: str, handler: QueryHandler, *, parameters: frozenset[str] = frozenset()) -> Route:
    return Route(path, JsonQueryEndpoint(handler, parameters=parameters), methods=["GET"])


def health_route() -> Route:
    """Liveness only: 200 with an empty body as soon as the listener answers."""
    return Route("/health", StaticEndpoint(b"", content_type=None), methods=["GET"])


def openapi_route(spec_path: Path) -> Route:
    """Serve the service's OpenAPI YAML document as JSON, converted once at start-up."""
    document = orjson.dumps(yaml.safe_load(spec_path.read_text(encoding="utf-8")))
    return Route("/openapi.json", StaticEndpoint(document), methods=["GET"])


_ROUTING_MESSAGES = {404: "route not found", 405: "method not allowed"}


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 decisions, in the service's JSON error shape."""
    assert isinstance(exc, HTTPException)
    message = _ROUTING_MESSAGES.get(exc.status_code, exc.detail)
    headers = dict(exc.headers or {})
    if "Allow" in headers:  # Starlette builds it from a set; keep it stable for clients and caches
        headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))
    return Response(
        error_body(message),
        status_code=exc.status_code,
        headers=headers,
        media_type="application/json",
    )


async def server_error_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error while serving %s %s", request.method, request.url.path)
    return Response(error_body("internal error; see the service log"), status_code=500,
                    media_type="application/json")


EXCEPTION_HANDLERS = {HTTPException: http_exception_handler, Exception: server_error_handler}


Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[Any]]


class Service(Starlette):
    """A Starlette app whose own JSON routes skip Starlette's per-request machinery.

    A request whose exact path and method belong to a `DirectEndpoint` (which turns every
    failure into a JSON answer itself) is handed straight to it: no middleware stack, no route
    matching. Everything else (unknown paths, wrong methods, lifespan) takes the ordinary
    Starlette path, so 404/405 answers and start-up/shutdown are unchanged.

    Beside the given routes it serves `/ready` and `/metrics`. `state.ready` turns true when
    the lifespan's start-up part (everything before its `yield`: recovery, loading) has
    returned, and false again when shutdown begins. `collectors` add the core's metrics to the
    app's own registry (`metrics_registry`). Every request's status and latency are recorded
    per route; `access_log`, when set (see `dynamo_lite.cli.serve`), is called once per request.
    """

    def __init__(
        self,
        *,
        routes: list[Route],
        lifespan: Lifespan | None = None,
        collectors: Iterable[Collector] = (),
        **kwargs: Any,
    ) -> None:
        self.request_metrics = RequestMetrics()
        self.metrics_registry = new_registry(self.request_metrics)
        for collector in collectors:
            self.metrics_registry.register(collector)
        super().__init__(routes=routes, exception_handlers=EXCEPTION_HANDLERS,
                         lifespan=self._readiness(lifespan), **kwargs)
        self.state.ready = False
        self.router.routes.append(Route("/ready", ReadyEndpoint(self.state), methods=["GET"]))
        self.router.routes.append(Route("/metrics", MetricsEndpoint(self.metrics_registry), methods=["GET"]))
        self.router.redirect_slashes = False  # paths match exactly, as in Dynamo: /health/ is a 404
        self._paths = {route.path for route in self.routes if isinstance(route, Route)}
        self._direct = {
            route.path: (frozenset(route.methods or ()), route.endpoint, self.request_metrics.route(route.path))
            for route in self.routes
            if isinstance(route, Route) and isinstance(route.endpoint, DirectEndpoint)
        }
        self.access_log: AccessLog | None = None

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
        if scope["type"] == "http":
            direct = self._direct.get(scope["path"])
            if direct is not None and scope["method"] in direct[0]:
                start = perf_counter()
                status = await direct[1](scope, receive, send)
                self._record(scope, direct[2], status, perf_counter() - start)
                return
            await self._serve_routed(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _serve_routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Starlette's path (404, 405, any non-direct route), measured through `send`."""
        status = 500  # when the app raises before answering
        start = perf_counter()

        async def capture_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await super().__call__(scope, receive, capture_status)
        finally:
            path = scope["path"]
            route = self.request_metrics.route(path if path in self._paths else UNMATCHED_ROUTE)
            self._record(scope, route, status, perf_counter() - start)

    def _record(self, scope: Scope, route: RouteSeries, status: int, seconds: float) -> None:
        route.record(status, seconds)
        if self.access_log is not None:
            self.access_log(scope, status, seconds)


__all__ = [
    "DEFAULT_MAX_BODY",
    "EXCEPTION_HANDLERS",
    "DirectEndpoint",
    "JsonBodyEndpoint",
    "JsonQueryEndpoint",
    "QueryParams",
    "Service",
    "get",
    "health_route",
    "openapi_route",
    "post",
]
