"""The seam between the ext_proc protocol layer (grpc_server) and the picking decision.

The protocol layer turns one Envoy ext_proc stream into one `RequestInfo`, asks a `Picker`
for a `Pick`, tells Envoy where to send the request, and then reports how the answer went to
the pick's `RequestTracker`. A picker never sees protobuf; the protocol layer never decides.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Protocol

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
GATEWAY_HEADER_PREFIX = "x-gateway-"
ENGINE_HEADER = "x-dynamo-lite-engine"  # response header naming the engine (ip:port) that served the request
# gRPC initial metadata of an ext_proc stream whose answer's end Envoy reports in its gRPC access
# log (envoy_config.access_log_ends): the picker hands such a stream back after the answer's
# first chunk and learns the end from the log.
ANSWER_ENDS_METADATA = "x-dynamo-lite-answer-ends"
ANSWER_ENDS_BY_ACCESS_LOG = "access-log"

# "lost": the access log never reported the end of an answer handed over to it.
END_REASONS = ("complete", "trailers", "cancelled", "error", "lost")


@dataclass(frozen=True)
class RequestInfo:
    request_id: str  # x-request-id, or a generated uuid4 hex when absent
    method: str  # :method
    path: str  # :path
    headers: dict[str, str]  # lower-cased names; pseudo-headers and client-supplied x-gateway-* removed
    body: bytes  # the whole request body
    subset: tuple[str, ...] | None  # the subset hint: None when the key is absent; () when empty


# OpenAI's error `type` per status (what OpenAI clients read besides the status), and the
# `code` when the picker gives none.
_ERROR_TYPES = {429: "rate_limit_error"}
_ERROR_CODES = {400: "invalid_request", 404: "not_found", 409: "conflict", 413: "request_too_large",
                429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """An error answer in OpenAI's shape, as the engines behind the gateway answer theirs:
    `{"error": {"message", "type", "param", "code"}}` (`type` `invalid_request_error` for a
    4xx, `rate_limit_error` for 429, `server_error` for a 5xx)."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code or _ERROR_CODES.get(status, str(status))}}).encode()


class PickError(Exception):
    """A request the picker will not place: answered as an ImmediateResponse in OpenAI's error
    shape (`error_body`), with `code` as its machine-readable reason."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.code = code

    def __repr__(self) -> str:
        return f"PickError({self.status}, {self.message!r}, {self.headers!r}, code={self.code!r})"


class RequestTracker(Protocol):
    """What happens to a picked request after the pick. Called from the event loop; must not block."""

    def response_headers(self, status: int, headers: dict[str, str]) -> None: ...

    # From metadata envoy.lb x-gateway-destination-endpoint-served; at most once, before the
    # response_headers of the message that carried it.
    def served(self, endpoint: str) -> None: ...

    def response_chunk(self, data: bytes) -> None: ...

    # Exactly once per picked request: "complete" (response end_of_stream), "trailers",
    # "cancelled" (stream broken/cancelled by Envoy or client), "error" (picker-side failure),
    # "lost" (handed to the access log, which never reported the end).
    def end(self, reason: str) -> None: ...

    # Optional (looked up, not required): from now on no response chunk is reported, the end
    # still is (the access log reports it); output the tracker counts must be estimated.
    # def unobserved(self) -> None: ...


@dataclass
class Pick:
    endpoints: list[str]  # "ip:port": the pick first, then fallbacks (never empty)
    headers: dict[str, str]  # extra request headers to set toward the engine
    tracker: RequestTracker
    body: bytes | None = None  # a replacement body (None: the original one is re-sent)
    remove_headers: tuple[str, ...] = ()  # request headers (lower-case) to remove toward the engine


class Picker(Protocol):
    async def pick(self, request: RequestInfo) -> Pick:  # raises PickError
        ...


class NullTracker:
    """A tracker that ignores everything."""

    def response_headers(self, status: int, headers: dict[str, str]) -> None:
        pass

    def served(self, endpoint: str) -> None:
        pass

    def response_chunk(self, data: bytes) -> None:
        pass

    def end(self, reason: str) -> None:
        pass


@dataclass
class RoundRobinPicker:
    """Each request to the next endpoint in turn, the following ones as fallbacks.

    Honours the subset hint: only endpoints in it are eligible; none eligible → 503.
    """

    endpoints: list[str]
    _turn: itertools.count = field(default_factory=itertools.count, init=False, repr=False)

    async def pick(self, request: RequestInfo) -> Pick:
        eligible = list(self.endpoints)
        if request.subset is not None:
            wanted = set(request.subset)
            eligible = [e for e in eligible if e in wanted]
        if not eligible:
            raise PickError(503, "no ready endpoint" if request.subset is None else "no ready endpoint in the subset")
        start = next(self._turn) % len(eligible)
        return Pick(endpoints=eligible[start:] + eligible[:start], headers={}, tracker=NullTracker())
