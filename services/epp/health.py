"""gRPC health checking (`grpc.health.v1.Health`) without grpcio-health-checking.

The two messages are one field each, so they are encoded by hand:
  HealthCheckRequest  { string service = 1; }
  HealthCheckResponse { ServingStatus status = 1; }  UNKNOWN=0 SERVING=1 NOT_SERVING=2 SERVICE_UNKNOWN=3

Services (GIE Endpoint Picker Protocol, "Health Checking"): "" and `liveness` are SERVING while the
server runs; `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` are SERVING only while
`ready()` says so. Everything turns NOT_SERVING once shutdown begins. An unknown service is
NOT_FOUND for Check and SERVICE_UNKNOWN for Watch, as grpc's reference servicer answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3
STATUS_NAMES = {UNKNOWN: "UNKNOWN", SERVING: "SERVING", NOT_SERVING: "NOT_SERVING", SERVICE_UNKNOWN: "SERVICE_UNKNOWN"}


# -- wire format ---------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> dict[int, int | bytes]:
    """Field number → last value (varints as int, length-delimited as bytes); others skipped."""
    out: dict[int, int | bytes] = {}
    i = 0
    while i < len(data):
        tag, i = _read_varint(data, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            out[number], i = _read_varint(data, i)
        elif wire == 2:
            size, i = _read_varint(data, i)
            if i + size > len(data):
                raise ValueError("truncated field")
            out[number] = data[i : i + size]
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if i > len(data):
        raise ValueError("truncated field")
    return out


def encode_request(service: str) -> bytes:
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_request(data: bytes) -> str:
    value = _fields(data).get(1, b"")
    return value.decode() if isinstance(value, bytes) else ""


def encode_response(status: int) -> bytes:
    return b"\x08" + _varint(status) if status else b""


def decode_response(data: bytes) -> int:
    value = _fields(data).get(1, 0)
    return value if isinstance(value, int) else UNKNOWN


# -- the service ---------------------------------------------------------------------------------


class HealthService:
    """The `grpc.health.v1.Health` servicer; `add_to_server` registers it."""

    def __init__(self, ready: Callable[[], bool], *, watch_interval: float = 0.5):
        self._ready = ready
        self._watch_interval = watch_interval
        self._shutting_down = False

    def status(self, service: str) -> int | None:
        """The serving status of a service, None for one this server does not know."""
        if service in ("", "liveness"):
            return NOT_SERVING if self._shutting_down else SERVING
        if service in ("readiness", EXT_PROC_SERVICE):
            if self._shutting_down:
                return NOT_SERVING
            try:
                return SERVING if self._ready() else NOT_SERVING
            except Exception:
                log.exception("the readiness callback raised")
                return NOT_SERVING
        return None

    def enter_graceful_shutdown(self) -> None:
        """From now on every service answers NOT_SERVING (Envoy stops sending new streams)."""
        self._shutting_down = True

    async def check(self, service: str, context: grpc.aio.ServicerContext) -> int:
        status = self.status(service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
            raise AssertionError("unreachable: abort raises")
        return status

    async def watch(self, service: str, context: grpc.aio.ServicerContext) -> AsyncIterator[int]:
        last: int | None = None
        while True:
            status = self.status(service)
            current = SERVICE_UNKNOWN if status is None else status
            if current != last:
                last = current
                yield current
            await asyncio.sleep(self._watch_interval)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            HEALTH_SERVICE,
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self.check, request_deserializer=decode_request, response_serializer=encode_response
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch, request_deserializer=decode_request, response_serializer=encode_response
                ),
            },
        )

    def add_to_server(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((self.handler(),))


async def check(channel: grpc.aio.Channel, service: str = "", *, timeout: float = 5.0) -> int:
    """Ask a server's `Health/Check` (a client helper: tests, probes). Raises grpc.aio.AioRpcError."""
    call = channel.unary_unary(
        f"/{HEALTH_SERVICE}/Check", request_serializer=encode_request, response_deserializer=decode_response
    )
    return await call(service, timeout=timeout)


def watch(channel: grpc.aio.Channel, service: str = "") -> grpc.aio.UnaryStreamCall:
    """Open a `Health/Watch` stream: iterate it for statuses."""
    call = channel.unary_stream(
        f"/{HEALTH_SERVICE}/Watch", request_serializer=encode_request, response_deserializer=decode_response
    )
    return call(service)
