"""The Endpoint Picker Protocol (GIE v1.0) over Envoy's `ExternalProcessor/Process` stream.

One gRPC stream is one HTTP request. Envoy is configured with FULL_DUPLEX_STREAMED bodies both
ways (deploy/envoy/envoy.yaml), so the stream goes:

  request headers   kept; answered at once (with the pick) only when they end the request (a GET)
  request body      buffered until end_of_stream; the JSON must carry a string `model` (else 400)
  → pick            Picker.pick(RequestInfo); PickError → ImmediateResponse {"error": ...}
  ← HeadersResponse clear_route_cache, x-gateway-destination-endpoint = the pick (+ the pick's
                    headers), client x-gateway-* removed, dynamic metadata
                    envoy.lb x-gateway-destination-endpoint = the pick and its fallbacks, joined by ","
  ← BodyResponse    the body re-sent as streamed_response chunks ≤ 62,000 bytes, end_of_stream last
  response headers  answered with an empty HeadersResponse; tracker.response_headers
  response body     every chunk handed back unchanged at once; tracker.response_chunk; end → "complete"
  trailers          TrailersResponse; response trailers end the request ("trailers")
  stream gone       tracker.end("cancelled") (exactly once, whatever happened)

A stream whose gRPC initial metadata says `x-dynamo-lite-answer-ends: access-log`
(envoy_config.access_log_ends) has its response body STREAMED: the picker answers the first
non-empty chunk (tracker.response_chunk: the first token), hands the tracker to the access log
(`access_log.AwaitingLog`, tracker.unobserved) and closes the stream, so Envoy relays the rest of
the answer without it; the end comes in Envoy's access log on this same gRPC port.

Messages flagged `observability_mode` get no reply. Such a stream never picks: it attaches to the
pick another (primary) stream made for the same `x-request-id` and drives that pick's tracker, so
an operator can run the response side as a second, observability-mode ext_proc filter placed after
the primary one (which then keeps its response modes at SKIP).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from .access_log import DEFAULT_SILENCE_SECS, AccessLogReceiver, AwaitingLog
from .grpc_tls import CertificateFiles
from .health import HealthService
from .metrics import EppMetrics
from .protocol import (
    ANSWER_ENDS_BY_ACCESS_LOG,
    ANSWER_ENDS_METADATA,
    DESTINATION_HEADER,
    DESTINATION_NAMESPACE,
    ENGINE_HEADER,
    GATEWAY_HEADER_PREFIX,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    Pick,
    Picker,
    PickError,
    RequestInfo,
    RequestTracker,
    error_body,
)

log = logging.getLogger(__name__)

MAX_CHUNK = 62_000  # the largest body chunk re-sent to Envoy (as GIE's EPP)
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_NO_BODY = 0  # ProcessingMode.BodySendMode.NONE
_STREAMED = 1  # ProcessingMode.BodySendMode.STREAMED: each chunk answered, unchanged or replaced


# -- protobuf helpers ----------------------------------------------------------------------------


def _header_items(header_map: base_pb2.HeaderMap) -> Iterable[tuple[str, str]]:
    for h in header_map.headers:
        raw = h.raw_value if h.raw_value else h.value.encode()
        yield h.key.lower(), raw.decode("utf-8", "replace")


def _header_dict(header_map: base_pb2.HeaderMap) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in _header_items(header_map):
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def _set_headers(headers: dict[str, str]) -> list[base_pb2.HeaderValueOption]:
    # raw_value only: `value` alone sets an empty header in Envoy 1.40, both together are rejected.
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()), append_action=_OVERWRITE
        )
        for k, v in headers.items()
    ]


def _streamed_body(data: bytes, end_of_stream: bool, *, request: bool) -> pb.ProcessingResponse:
    body = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=end_of_stream)
            )
        )
    )
    return pb.ProcessingResponse(request_body=body) if request else pb.ProcessingResponse(response_body=body)


def immediate_response(status: int, message: str, headers: dict[str, str] | None = None,
                       code: str | None = None) -> pb.ProcessingResponse:
    """An answer Envoy sends the client itself, in OpenAI's error shape (`protocol.error_body`)."""
    all_headers = {"content-type": "application/json"}
    all_headers.update({k.lower(): v for k, v in (headers or {}).items()})
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=_set_headers(all_headers)),
            body=error_body(status, message, code),
            details=f"epp_{status}",
        )
    )


def _subset(metadata: base_pb2.Metadata) -> tuple[str, ...] | None:
    """The subset hint: a list of "ip:port" (or one comma-separated string); None when absent."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: list[str] = []
        for v in value.list_value.values:
            if v.WhichOneof("kind") == "string_value":
                items.extend(s.strip() for s in v.string_value.split(","))
        return tuple(s for s in items if s)
    if kind == "string_value":
        return tuple(s.strip() for s in value.string_value.split(",") if s.strip())
    return ()


def _served(metadata: base_pb2.Metadata) -> str | None:
    if DESTINATION_NAMESPACE not in metadata.filter_metadata:
        return None
    value = metadata.filter_metadata[DESTINATION_NAMESPACE].fields.get(SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value or None


# -- the tracker, guarded ------------------------------------------------------------------------


class _Tracked:
    """A pick's tracker: every call guarded (a raising tracker never breaks the stream), `end`
    exactly once, nothing after it; `served` once."""

    def __init__(self, tracker: RequestTracker, request_id: str):
        self.tracker = tracker
        self.request_id = request_id
        self.ended = False
        self.served_reported = False
        self.engine = ""  # the endpoint picked, then the one Envoy reports it served the request
        self.observers = 0  # observability-mode streams driving this tracker

    def _call(self, name: str, *args: Any) -> None:
        try:
            getattr(self.tracker, name)(*args)
        except Exception:
            log.exception("request %s: tracker.%s raised", self.request_id, name)

    def response_headers(self, status: int, headers: dict[str, str]) -> None:
        if not self.ended:
            self._call("response_headers", status, headers)

    def served(self, endpoint: str) -> None:
        if not self.ended and not self.served_reported:
            self.served_reported = True
            self.engine = endpoint
            self._call("served", endpoint)

    def response_chunk(self, data: bytes) -> None:
        if not self.ended and data:
            self._call("response_chunk", data)

    def end(self, reason: str) -> None:
        if not self.ended:
            self.ended = True
            self._call("end", reason)

    def unobserved(self) -> None:
        # Optional in RequestTracker: a tracker without it just sees no more chunks.
        if not self.ended and hasattr(self.tracker, "unobserved"):
            self._call("unobserved")


# -- one stream ----------------------------------------------------------------------------------


class _Stream:
    """The state of one `Process` stream (one HTTP request)."""

    def __init__(self, picker: Picker, live: dict[str, _Tracked], awaiting: AwaitingLog | None = None):
        self.picker = picker
        self.live = live
        self.awaiting = awaiting  # not None: the access log reports the answer's end (see the module docstring)
        self.handed_over = False  # the answer's end was handed to the access log: the stream is done
        self.headers: pb.HttpHeaders | None = None
        self.header_dict: dict[str, str] = {}
        self.metadata = base_pb2.Metadata()
        self.request_id = ""
        self.body = bytearray()
        self.decided = False  # a pick was made or the request was answered
        self.finished = False  # an ImmediateResponse went out: the stream is over
        self.tracked: _Tracked | None = None
        self.owner = False  # this stream made the pick (else it observes another stream's)
        self.observer = False
        self.response_body_mode: int | None = None  # from protocol_config (first message)

    # The replies to one message (possibly none).
    async def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if msg.observability_mode:
            self.observer = True
        if msg.HasField("protocol_config"):
            self.response_body_mode = msg.protocol_config.response_body_mode
        if kind == "request_headers":
            return await self._request_headers(msg)
        if kind == "request_body":
            return await self._request_body(msg)
        if kind == "request_trailers":
            return await self._request_trailers(msg)
        self._attach()
        self._note_served(msg)
        if kind == "response_headers":
            return self._response_headers(msg)
        if kind == "response_body":
            return self._response_body(msg)
        if kind == "response_trailers":
            if self.tracked is not None:
                self.tracked.end("trailers")
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        log.warning("unexpected ext_proc message %r", kind)
        return []

    async def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = msg.request_headers
        self.metadata = msg.metadata_context
        self.header_dict = _header_dict(msg.request_headers.headers)  # read once: the pick reads it again
        self.request_id = self.header_dict.get("x-request-id") or uuid.uuid4().hex
        if msg.observability_mode:
            self._attach()
            return []
        if msg.request_headers.end_of_stream:  # no body (a GET): pick and answer at once
            return await self._decide(b"", has_body=False)
        return []

    async def _request_body(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.observability_mode:
            return []
        if self.decided or self.headers is None:  # not expected: pass it on unchanged
            return [_streamed_body(msg.request_body.body, msg.request_body.end_of_stream, request=True)]
        self.body += msg.request_body.body
        if not msg.request_body.end_of_stream:
            return []
        return await self._body_complete(trailers=False)

    async def _request_trailers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.observability_mode:
            return []
        replies: list[pb.ProcessingResponse] = []
        if not self.decided and self.headers is not None:
            # Trailers end a body that never said end_of_stream: decide now, and leave the
            # re-sent body open for the trailers that follow it.
            replies = await self._body_complete(trailers=True)
            if self.finished:
                return replies
        replies.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        return replies

    async def _body_complete(self, *, trailers: bool) -> list[pb.ProcessingResponse]:
        """The whole body is in: it must be a JSON object with a string `model` (else 400)."""
        body = bytes(self.body)
        self.body = bytearray()
        try:
            parsed = json.loads(body)
        except ValueError:
            return self._finish(immediate_response(400, "the request body is not valid JSON", code="invalid_json"))
        if not isinstance(parsed, dict) or "model" not in parsed:
            return self._finish(immediate_response(400, "model not found in request body", code="model_missing"))
        if not isinstance(parsed["model"], str):
            return self._finish(immediate_response(400, "model must be a string"))
        return await self._decide(body, has_body=True, trailers=trailers)

    def _finish(self, reply: pb.ProcessingResponse) -> list[pb.ProcessingResponse]:
        self.decided = self.finished = True
        return [reply]

    async def _decide(self, body: bytes, *, has_body: bool, trailers: bool = False) -> list[pb.ProcessingResponse]:
        assert self.headers is not None
        self.decided = True
        pseudo: dict[str, str] = {}
        headers: dict[str, str] = {}
        client_gateway: list[str] = []
        for key, value in self.header_dict.items():
            if key.startswith(":"):
                pseudo[key] = value
            elif key.startswith(GATEWAY_HEADER_PREFIX):
                client_gateway.append(key)
            else:
                headers[key] = value
        request = RequestInfo(
            request_id=self.request_id,
            method=pseudo.get(":method", ""),
            path=pseudo.get(":path", ""),
            headers=headers,
            body=body,
            subset=_subset(self.metadata),
        )
        try:
            pick = await self.picker.pick(request)
        except PickError as e:
            log.debug("request %s: %r", self.request_id, e)
            return self._finish(immediate_response(e.status, e.message, e.headers, e.code))
        except Exception:
            log.exception("request %s: the picker failed", self.request_id)
            return self._finish(immediate_response(500, "the endpoint picker failed"))
        endpoints = [e for e in pick.endpoints if e]
        if not endpoints:
            _Tracked(pick.tracker, self.request_id).end("error")
            log.error("request %s: the picker returned no endpoint", self.request_id)
            return self._finish(immediate_response(503, "no ready endpoint"))
        self.tracked = _Tracked(pick.tracker, self.request_id)
        self.tracked.engine = endpoints[0]
        self.owner = True
        self.live[self.request_id] = self.tracked
        return self._routed(pick, endpoints, body, has_body=has_body, trailers=trailers, client_gateway=client_gateway)

    def _routed(
        self, pick: Pick, endpoints: list[str], body: bytes, *, has_body: bool, trailers: bool, client_gateway: list[str]
    ) -> list[pb.ProcessingResponse]:
        # The header carries the pick alone: Envoy's ORIGINAL_DST cluster reads it as one
        # address, and a comma-separated list there gets 503 "no healthy upstream" (Envoy 1.40).
        # The envoy.lb metadata carries the pick then the fallbacks, comma-separated (GIE v1.0),
        # for a load balancer that can fall back (e.g. Envoy's override_host policy).
        destination = ",".join(endpoints)
        set_headers = {k.lower(): v for k, v in pick.headers.items()}
        set_headers[DESTINATION_HEADER] = endpoints[0]
        if pick.body is not None:
            body = pick.body
        # No content-length: with a full-duplex streamed body Envoy 1.40 removes it (whatever is
        # set here) and sends the body upstream with transfer-encoding: chunked.
        metadata = struct_pb2.Struct()
        metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
        replies = [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(
                        clear_route_cache=True,
                        header_mutation=pb.HeaderMutation(
                            set_headers=_set_headers(set_headers),
                            remove_headers=[k for k in (*client_gateway, *pick.remove_headers)
                                            if k not in set_headers],
                        ),
                    )
                ),
                dynamic_metadata=metadata,
            )
        ]
        if has_body:
            if not body:
                replies.append(_streamed_body(b"", not trailers, request=True))
            for start in range(0, len(body), MAX_CHUNK):
                last = start + MAX_CHUNK >= len(body)
                replies.append(_streamed_body(body[start : start + MAX_CHUNK], last and not trailers, request=True))
        return replies

    # -- the response side --------------------------------------------------------------------

    def _attach(self) -> None:
        """An observability-mode stream adopts the tracker of the pick made for its request id."""
        if self.tracked is None and self.observer and self.request_id:
            tracked = self.live.get(self.request_id)
            if tracked is not None:
                self.tracked = tracked
                tracked.observers += 1

    def _note_served(self, msg: pb.ProcessingRequest) -> None:
        if self.tracked is not None and not self.tracked.served_reported:
            served = _served(msg.metadata_context)
            if served:
                self.tracked.served(served)

    def _response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.tracked is not None:
            headers = _header_dict(msg.response_headers.headers)
            try:
                status = int(headers.pop(":status", "0"))
            except ValueError:
                status = 0
            self.tracked.response_headers(status, {k: v for k, v in headers.items() if not k.startswith(":")})
            if msg.response_headers.end_of_stream:  # an answer without body
                self.tracked.end("complete")
            if self.tracked.engine and not self.observer:
                # The client learns which engine answered (its logs, a support ticket).
                mutation = pb.HeaderMutation(set_headers=_set_headers({ENGINE_HEADER: self.tracked.engine}))
                return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(header_mutation=mutation)))]
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _response_body(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = msg.response_body
        streamed = self.response_body_mode == _STREAMED
        # STREAMED: Envoy holds each chunk for an answer; an empty one passes it on unchanged.
        unchanged = pb.ProcessingResponse(response_body=pb.BodyResponse())
        tracked = self.tracked
        if streamed and self.awaiting is not None and (chunk.body or chunk.end_of_stream):
            # The first token is out (or the whole answer, a short one): the log tells how it
            # ends (its status too: this filter sees no response headers). Handed over before
            # the stream closes, so no log entry for it can arrive first.
            if tracked is not None:
                tracked.response_chunk(chunk.body)
            self._hand_over(first_token=not chunk.end_of_stream)
            # Mid-answer the stream closes unanswered: a server's OK close ends Envoy's
            # processing, and Envoy passes the chunks it holds on unchanged, this one first
            # (Envoy 1.40; tests/test_epp_protocol.py checks every byte). One message saved.
            return [unchanged] if chunk.end_of_stream else []
        if tracked is not None:
            tracked.response_chunk(chunk.body)
            if chunk.end_of_stream:
                tracked.end("complete")
        if streamed:
            return [unchanged]
        return [_streamed_body(chunk.body, chunk.end_of_stream, request=False)]

    def _hand_over(self, *, first_token: bool) -> None:
        """From here the access log reports how the request ends; after the first token the
        tracker no longer sees the answer (`unobserved`)."""
        assert self.awaiting is not None
        self.handed_over = True
        tracked = self.tracked
        if tracked is None or tracked.ended:
            return
        if self.live.get(self.request_id) is tracked:
            del self.live[self.request_id]
        if first_token:
            tracked.unobserved()
        self.awaiting.hand_over(self.request_id, tracked)

    def close(self, reason: str, *, handoff: float) -> None:
        """The stream is over: ended by Envoy (half-closed, or reset: Envoy 1.40 half-closes also
        when the client hangs up, and may reset right after), or by our own failure ("error")."""
        tracked = self.tracked
        if tracked is None or self.handed_over:
            return
        if self.awaiting is not None and reason != "error" and not tracked.ended:
            # The stream closed before the first chunk (a client gone during the prefill, an
            # answer without body): the access log still says how the request ended.
            self._hand_over(first_token=False)
            return
        if not self.owner:
            tracked.observers -= 1
            if self.live.get(self.request_id) is tracked and not tracked.observers:
                del self.live[self.request_id]
            tracked.end(reason)
            return
        if tracked.observers:  # an observability-mode stream reports the end
            return
        if reason != "error" and not tracked.ended and handoff > 0 and self.response_body_mode == _NO_BODY:
            # This filter does not see the response body (protocol_config said so) and Envoy
            # closed the stream once the request side was done. An observability-mode filter
            # placed after this one may process the response (its request headers arrive just
            # after this close): keep the tracker for it a little while.
            asyncio.get_running_loop().call_later(handoff, self._expire, tracked)
            return
        if self.live.get(self.request_id) is tracked:
            del self.live[self.request_id]
        tracked.end(reason)

    def _expire(self, tracked: _Tracked) -> None:
        if tracked.observers or tracked.ended:
            return
        if self.live.get(self.request_id) is tracked:
            del self.live[self.request_id]
        log.warning(
            "request %s: the ext_proc stream closed before the answer ended and no observability-mode "
            "stream took it over; is the response side configured?",
            self.request_id,
        )
        tracked.end("cancelled")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor`, asking `picker` where each request goes."""

    def __init__(self, picker: Picker, *, handoff_timeout: float = 5.0, awaiting: AwaitingLog | None = None):
        """`handoff_timeout`: how long the tracker of a stream that Envoy closed before the answer
        ended waits for an observability-mode stream to take it over (then: "cancelled").
        `awaiting`: where streams whose end the access log reports hand their tracker (None:
        such streams are relayed to their end like any other)."""
        self.picker = picker
        self.handoff_timeout = handoff_timeout
        self.awaiting = awaiting
        self._live: dict[str, _Tracked] = {}  # request id → the tracker of its pick, while it lasts

    async def Process(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream(self.picker, self._live, self.awaiting if self._ends_by_log(context) else None)
        reason = "cancelled"
        try:
            async for msg in request_iterator:
                try:
                    replies = await stream.handle(msg)
                except Exception:
                    reason = "error"
                    log.exception("request %s: ext_proc message handling failed", stream.request_id or "?")
                    raise
                if not msg.observability_mode:
                    for reply in replies:
                        yield reply
                if stream.finished or stream.handed_over:
                    break  # returning closes the stream (gRPC OK): Envoy goes on without it
        finally:
            stream.close(reason, handoff=self.handoff_timeout)

    def _ends_by_log(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether Envoy's filter announced that its access log reports this answer's end."""
        if self.awaiting is None:
            return False
        return any(key == ANSWER_ENDS_METADATA and value == ANSWER_ENDS_BY_ACCESS_LOG
                   for key, value in context.invocation_metadata() or ())


# -- the server ----------------------------------------------------------------------------------


class EppServer:
    """The gRPC server: the ext_proc service, the access log service (answers' ends) and gRPC
    health on one port."""

    def __init__(
        self,
        picker: Picker,
        *,
        host: str = "0.0.0.0",
        port: int = 9002,
        cert: str | bytes | None = None,
        key: str | bytes | None = None,
        client_ca: str | bytes | None = None,
        ready: Callable[[], bool] = lambda: True,
        access_log_silence_secs: float = DEFAULT_SILENCE_SECS,
        metrics: EppMetrics | None = None,
    ):
        self.awaiting = AwaitingLog(access_log_silence_secs, metrics)
        self.processor = ExternalProcessor(picker, awaiting=self.awaiting)
        self.access_log = AccessLogReceiver(self.awaiting, metrics)
        self.health = HealthService(ready)
        self.host, self.port = host, port
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self.server: grpc.aio.Server | None = None

    def _credentials(self) -> grpc.ServerCredentials | None:
        cert, key, client_ca = self._cert, self._key, self._client_ca
        if cert is None or key is None:
            if client_ca is not None:
                raise ValueError("a client CA needs a server certificate and key (TLS)")
            return None
        if isinstance(cert, str) and isinstance(key, str) and not isinstance(client_ca, bytes):
            return CertificateFiles(cert, key, client_ca).credentials()  # files: reloaded when they change
        return grpc.ssl_server_credentials(
            [(_read(key), _read(cert))], root_certificates=None if client_ca is None else _read(client_ca),
            require_client_auth=client_ca is not None)

    async def start(self) -> EppServer:
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),  # a port already taken is an error, not a shared port
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, server)
        self.health.add_to_server(server)
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        address = f"{host}:{self.port}"
        credentials = self._credentials()
        if credentials is not None:
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self.server = server
        log.info("endpoint picker listening on %s:%d", self.host, self.port)
        return self

    async def stop(self, grace: float | None = 5.0) -> None:
        """Health turns NOT_SERVING, new streams are refused, open ones get `grace` seconds."""
        self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        self.awaiting.close()

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()


def _read(value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


async def serve(
    picker: Picker,
    *,
    host: str = "0.0.0.0",
    port: int = 9002,
    cert: str | bytes | None = None,
    key: str | bytes | None = None,
    client_ca: str | bytes | None = None,
    ready: Callable[[], bool] = lambda: True,
) -> EppServer:
    """Start the endpoint picker's gRPC server (ext_proc, Envoy's access log service, health);
    `port=0` picks a free one.

    `cert`/`key` (PEM paths or bytes) turn TLS on; given as paths, the files are read again when
    they change. `client_ca` (PEM) makes callers present a certificate it signed (mutual TLS).
    Stop it with `await server.stop(grace)`.
    """
    return await EppServer(picker, host=host, port=port, cert=cert, key=key, client_ca=client_ca, ready=ready).start()


__all__ = ["ENGINE_HEADER", "MAX_CHUNK", "EppServer", "ExternalProcessor", "immediate_response", "serve"]
