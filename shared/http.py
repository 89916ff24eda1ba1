"""HTTP plumbing shared by both services.

Routes are Starlette `Route`s whose endpoints are small ASGI callables rather than
request/response functions: a hot route reads its bounded body straight from `receive`,
decodes it with orjson, calls a plain function of the core and writes one orjson-encoded
response. Starlette still does the routing, HEAD handling and 404/405 decisions.

Every failure, including unknown routes, wrong methods and unreadable bodies, is answered as
`{"error": "..."}` with the status of the `ServiceError` kind that describes it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Union
from urllib.parse import parse_qsl

import orjson
import yaml
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .errors import (
    MalformedRequest,
    PayloadTooLarge,
    ServiceError,
    UnsupportedMediaType,
)

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
    return orjson.dumps(payload)


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


async def _answer_failure(send: Send, exc: BaseException, head: bool) -> None:
    if isinstance(exc, ServiceError):
        await send_bytes(send, exc.status, error_body(exc.message), head=head)
        return
    logger.exception("unhandled error while serving a request")
    await send_bytes(send, 500, error_body("internal error; see the service log"), head=head)


class JsonBodyEndpoint:
    """ASGI endpoint of a POST route: bounded JSON body in, `handler(body) -> (status, payload)`."""

    def __init__(self, handler: BodyHandler, *, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.handler = handler
        self.max_body = max_body
        self._is_async = inspect.iscoroutinefunction(handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_json_body(scope, receive, self.max_body)
            status, payload = await _call(self.handler, body, self._is_async)
        except ClientDisconnected:
            return
        except Exception as exc:  # noqa: BLE001 - every failure must still be a JSON answer
            await _answer_failure(send, exc, head=False)
            return
        await send_bytes(send, status, encode(payload))


class JsonQueryEndpoint:
    """ASGI endpoint of a GET route: query parameters in, `handler(params) -> (status, payload)`."""

    def __init__(self, handler: QueryHandler, *, parameters: frozenset[str] = frozenset()) -> None:
        self.handler = handler
        self.parameters = parameters
        self._is_async = inspect.iscoroutinefunction(handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = scope["method"] == "HEAD"
        try:
            params = QueryParams(scope.get("query_string", b""), self.parameters)
            status, payload = await _call(self.handler, params, self._is_async)
        except Exception as exc:  # noqa: BLE001
            await _answer_failure(send, exc, head=head)
            return
        await send_bytes(send, status, encode(payload), head=head)


class StaticEndpoint:
    """ASGI endpoint answering GET and HEAD with fixed bytes (a class: Starlette treats plain
    functions as request/response handlers)."""

    def __init__(self, body: bytes, content_type: bytes | None = _JSON_HEADERS) -> None:
        self.body = body
        self.content_type = content_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(
            send, 200, self.body, content_type=self.content_type, head=scope["method"] == "HEAD"
        )


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


class Service(Starlette):
    """A Starlette app whose own JSON routes skip Starlette's per-request machinery.

    A request whose exact path and method belong to one of this module's endpoints (which turn
    every failure into a JSON answer themselves) is handed straight to it: no middleware stack,
    no route matching. Everything else (unknown paths, wrong methods, lifespan) takes the
    ordinary Starlette path, so 404/405 answers and start-up/shutdown are unchanged.
    """

    def __init__(self, *, routes: list[Route], **kwargs: Any) -> None:
        super().__init__(routes=routes, exception_handlers=EXCEPTION_HANDLERS, **kwargs)
        self.router.redirect_slashes = False  # paths match exactly, as in Dynamo: /health/ is a 404
        self._direct = {
            route.path: (frozenset(route.methods or ()), route.endpoint)
            for route in routes
            if isinstance(route.endpoint, (JsonBodyEndpoint, JsonQueryEndpoint, StaticEndpoint))
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            direct = self._direct.get(scope["path"])
            if direct is not None and scope["method"] in direct[0]:
                await direct[1](scope, receive, send)
                return
        await super().__call__(scope, receive, send)


__all__ = [
    "DEFAULT_MAX_BODY",
    "EXCEPTION_HANDLERS",
    "JsonBodyEndpoint",
    "JsonQueryEndpoint",
    "QueryParams",
    "get",
    "health_route",
    "openapi_route",
    "post",
]
