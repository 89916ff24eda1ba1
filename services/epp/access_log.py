"""Answers whose end Envoy's gRPC access log reports (`envoy.service.accesslog.v3`).

With `envoy_config.access_log_ends` (deploy/envoy/envoy-access-log.yaml) Envoy hands the picker an
answer's response headers and its first body chunk (the first token: the prefill is done); the
picker then closes the ext_proc stream and Envoy relays the rest of the answer without it, so
nothing per chunk reaches Python. The end comes in the access log Envoy streams to the picker's
gRPC port (`AccessLogService/StreamAccessLogs`): one entry per request as its stream ends,
batched by the logger's `buffer_flush_interval`, carrying the request's x-request-id, its status,
the engine that served it and whether the client or an upstream cut it.

`AwaitingLog` holds the trackers handed over, by request id, until their entry arrives. An entry
can be lost: Envoy drops entries it cannot send (a picker that cannot keep up, a log stream that
reconnects). Envoy's periodic entries for streams still running (the connection manager's
`access_log_flush_interval`) show which answers are alive; a tracker not heard of for
`silence_secs` is ended "lost", so no booking outlives its answer by more than that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from .metrics import EppMetrics
from .protocol import DESTINATION_NAMESPACE, SERVED_KEY

log = logging.getLogger(__name__)

DEFAULT_SILENCE_SECS = 30.0  # three of the shipped configuration's 10 s periodic entries
# A final entry for a request not (yet) handed over is kept this long, at most this many: a
# stream whose client left during the prefill can be handed over after its entry came (a picker
# lagging behind Envoy's 0.05 s batches), and must end then, not "lost" 30 s later.
UNCLAIMED_SECS = 5.0
UNCLAIMED_MAX = 65_536

_FINAL_TYPES = (accesslog_pb2.AccessLogType.DownstreamEnd, accesslog_pb2.AccessLogType.NotSet)
_PERIODIC = accesslog_pb2.AccessLogType.DownstreamPeriodic
# Response flags that mean the answer was cut short (by the client, an upstream, Envoy itself),
# not delivered whole: the booking ends "cancelled", as when a full-duplex stream breaks.
_CUT_FLAGS = frozenset(("downstream_connection_termination", "downstream_remote_reset", "downstream_protocol_error",
              "upstream_remote_reset", "upstream_connection_termination", "upstream_protocol_error",
              "local_reset", "stream_idle_timeout", "upstream_request_timeout", "duration_timeout",
              "upstream_max_stream_duration_reached", "overload_manager"))


@dataclass(frozen=True, slots=True)
class LogEntry:
    """What the picker reads of one access log entry."""

    request_id: str
    final: bool  # the stream's end; False: a periodic entry of a stream still running
    reason: str  # final entries: "complete", "cancelled" (cut short) or "error_status" (>= 400)
    status: int  # the response code (0: none was sent)
    served: str | None  # the engine that answered ("ip:port"), when Envoy reached one


def read_entry(entry: accesslog_pb2.HTTPAccessLogEntry) -> LogEntry | None:
    """The entry as the picker reads it; None for an entry of another kind (upstream logs)."""
    common = entry.common_properties
    if common.intermediate_log_entry or common.access_log_type == _PERIODIC:
        final = False
    elif common.access_log_type in _FINAL_TYPES:
        final = True
    else:
        return None
    status = entry.response.response_code.value
    # The flags set, not every flag read: most entries have none.
    if any(field.name in _CUT_FLAGS for field, value in common.response_flags.ListFields() if value):
        reason = "cancelled"
    elif status >= 400:
        reason = "error_status"
    else:
        reason = "complete"
    return LogEntry(entry.request.request_id, final, reason, status, _served(common))


def _served(common: accesslog_pb2.AccessLogCommon) -> str | None:
    """Where Envoy sent the request: the override-host balancer's report (what the full-duplex
    path reads), else the upstream's address."""
    metadata = common.metadata.filter_metadata
    if DESTINATION_NAMESPACE in metadata:
        value = metadata[DESTINATION_NAMESPACE].fields.get(SERVED_KEY)
        if value is not None and value.string_value:
            return value.string_value
    if not common.HasField("upstream_remote_address"):
        return None
    socket = common.upstream_remote_address.socket_address
    if not socket.address:
        return None
    host = f"[{socket.address}]" if ":" in socket.address else socket.address
    return f"{host}:{socket.port_value}"


class Awaited(Protocol):
    """A tracker handed over to the access log (the protocol layer's guarded tracker)."""

    def served(self, endpoint: str) -> None: ...

    def end(self, reason: str) -> None: ...


class AwaitingLog:
    """Trackers waiting for their request's access log entry (see the module docstring)."""

    def __init__(self, silence_secs: float = DEFAULT_SILENCE_SECS, metrics: EppMetrics | None = None) -> None:
        """`silence_secs`: how long a tracker waits without hearing of its stream before it ends
        "lost" (0: forever; it must exceed Envoy's access_log_flush_interval)."""
        self.silence_secs = silence_secs
        self.metrics = metrics
        self._awaited: dict[str, tuple[Awaited, float]] = {}  # request id -> (tracker, last heard)
        self._unclaimed: dict[str, tuple[LogEntry, float]] = {}  # final entries before their hand-over, oldest first
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._awaited)

    def hand_over(self, request_id: str, tracker: Awaited) -> None:
        loop = asyncio.get_running_loop()
        early = self._unclaimed.pop(request_id, None) if self._unclaimed else None
        if early is not None and loop.time() - early[1] <= UNCLAIMED_SECS:
            _apply(tracker, early[0])  # its entry came first: it ends now
            return
        earlier = self._awaited.get(request_id)
        if earlier is not None and earlier[0] is not tracker:
            # Two answers with one x-request-id (a client's own, kept by Envoy): the log cannot
            # tell their entries apart, and the earlier tracker would never end.
            log.warning("request %s: another answer with the same x-request-id awaits its access log entry: "
                        "the earlier one is ended as lost", request_id)
            earlier[0].end("lost")
        self._awaited[request_id] = (tracker, loop.time())
        self._gauge()
        if self.silence_secs > 0 and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = loop.create_task(self._sweep(), name="access-log-silence")

    def receive(self, entry: LogEntry) -> str:
        """Apply one entry; what it was: "ended", "alive" (a periodic entry) or "not_awaited"
        (a request the picker did not hand over: refused, without body, or ended already)."""
        item = self._awaited.get(entry.request_id)
        if item is None:
            if entry.final:
                self._keep_unclaimed(entry)
            return "not_awaited"
        tracker, _ = item
        if not entry.final:
            self._awaited[entry.request_id] = (tracker, asyncio.get_running_loop().time())
            return "alive"
        del self._awaited[entry.request_id]
        self._gauge()
        _apply(tracker, entry)
        return "ended"

    def _keep_unclaimed(self, entry: LogEntry) -> None:
        """Keep a final entry nobody awaits for UNCLAIMED_SECS (see there); the oldest go first."""
        now = asyncio.get_running_loop().time()
        unclaimed = self._unclaimed
        while unclaimed:
            oldest = next(iter(unclaimed))
            if now - unclaimed[oldest][1] <= UNCLAIMED_SECS and len(unclaimed) < UNCLAIMED_MAX:
                break
            del unclaimed[oldest]
        unclaimed.pop(entry.request_id, None)  # re-inserted: newest last
        unclaimed[entry.request_id] = (entry, now)

    def expire(self, now: float) -> int:
        """End the trackers not heard of for `silence_secs` ("lost"); how many (none when
        `silence_secs` is 0: never)."""
        if self.silence_secs <= 0:
            return 0
        silent = [request_id for request_id, (_, heard) in self._awaited.items() if now - heard > self.silence_secs]
        for request_id in silent:
            tracker, _ = self._awaited.pop(request_id)
            log.warning("request %s: no access log entry for %.0f s after its first chunk: ended as lost (is Envoy's "
                        "access logger pointed at this picker, with an access_log_flush_interval below "
                        "--access-log-silence-secs?)", request_id, self.silence_secs)
            tracker.end("lost")
        if silent:
            self._gauge()
        return len(silent)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while self._awaited:
            await asyncio.sleep(self.silence_secs / 4)
            self.expire(loop.time())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.awaiting_log.set(len(self._awaited))


def _apply(tracker: Awaited, entry: LogEntry) -> None:
    if entry.served:
        tracker.served(entry.served)
    tracker.end(entry.reason)


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """`envoy.service.accesslog.v3.AccessLogService`: the entries Envoy streams, applied to
    `awaiting`. One long-lived stream per Envoy worker thread."""

    def __init__(self, awaiting: AwaitingLog, metrics: EppMetrics | None = None) -> None:
        self.awaiting = awaiting
        self.metrics = metrics

    async def StreamAccessLogs(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        counted = self.metrics.access_log_entries if self.metrics is not None else None
        async for message in request_iterator:
            for raw in message.http_logs.log_entry:
                entry = read_entry(raw)
                if entry is None:
                    continue
                outcome = self.awaiting.receive(entry)
                if counted is not None:
                    counted.labels(outcome).inc()
        return als_pb2.StreamAccessLogsResponse()


__all__ = ["DEFAULT_SILENCE_SECS", "AccessLogReceiver", "AwaitingLog", "LogEntry", "read_entry"]
