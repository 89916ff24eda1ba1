"""Envoy's access log entries as the picker reads them (`dynamo_lite.epp.access_log`), and the
trackers waiting for them: ended by their entry, kept alive by periodic ones, "lost" after a
silence. The entries are Envoy's own protobuf messages, filled as Envoy 1.40 fills them (seen in
tests/test_epp_protocol.py's access-log tests through a real Envoy)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2, wrappers_pb2
from prometheus_client import CollectorRegistry

from dynamo_lite.epp import access_log
from dynamo_lite.epp.access_log import AwaitingLog, LogEntry, read_entry
from dynamo_lite.epp.grpc_server import EppServer
from dynamo_lite.epp.metrics import EppMetrics
from dynamo_lite.epp.protocol import RoundRobinPicker

pytestmark = pytest.mark.unit


def entry(request_id: str = "r-1", status: int = 200, *, kind: int = al.AccessLogType.DownstreamEnd,
          served: str | None = None, upstream: tuple[str, int] | None = None, **flags: bool) -> al.HTTPAccessLogEntry:
    common = al.AccessLogCommon(access_log_type=kind, response_flags=al.ResponseFlags(**flags),
                                intermediate_log_entry=kind == al.AccessLogType.DownstreamPeriodic)
    if served is not None:
        fields = struct_pb2.Struct()
        fields.update({"x-gateway-destination-endpoint-served": served})
        common.metadata.filter_metadata["envoy.lb"].CopyFrom(fields)
    if upstream is not None:
        common.upstream_remote_address.CopyFrom(address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address=upstream[0], port_value=upstream[1])))
    return al.HTTPAccessLogEntry(
        common_properties=common, request=al.HTTPRequestProperties(request_id=request_id),
        response=al.HTTPResponseProperties(response_code=wrappers_pb2.UInt32Value(value=status)))


def test_how_an_entry_says_a_request_ended() -> None:
    assert read_entry(entry(served="10.0.0.1:8000")) == LogEntry("r-1", True, "complete", 200, "10.0.0.1:8000")
    assert read_entry(entry(downstream_connection_termination=True)).reason == "cancelled"  # the client left
    assert read_entry(entry(downstream_remote_reset=True)).reason == "cancelled"
    assert read_entry(entry(upstream_remote_reset=True)).reason == "cancelled"  # the engine cut the answer
    assert read_entry(entry(status=503, upstream_connection_failure=True)).reason == "error_status"
    assert read_entry(entry(status=429)).reason == "error_status"
    periodic = read_entry(entry(kind=al.AccessLogType.DownstreamPeriodic))
    assert periodic is not None and not periodic.final
    assert read_entry(entry(kind=al.AccessLogType.UpstreamEnd)) is None  # an upstream log: not an end


def test_the_served_engine_is_the_balancers_report_else_the_upstream_address() -> None:
    assert read_entry(entry(served="10.0.0.2:8000", upstream=("10.0.0.1", 8000))).served == "10.0.0.2:8000"
    assert read_entry(entry(upstream=("10.0.0.1", 8000))).served == "10.0.0.1:8000"
    assert read_entry(entry(upstream=("fd00::1", 8000))).served == "[fd00::1]:8000"
    assert read_entry(entry()).served is None  # Envoy reached no engine


class Ending:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def served(self, endpoint: str) -> None:
        self.calls.append(("served", endpoint))

    def end(self, reason: str) -> None:
        self.calls.append(("end", reason))


def ended_by(awaiting: AwaitingLog, log_entry: al.HTTPAccessLogEntry) -> str:
    read = read_entry(log_entry)
    assert read is not None
    return awaiting.receive(read)


def test_an_entry_ends_its_tracker_a_periodic_one_keeps_it_and_silence_loses_it() -> None:
    async def scenario() -> None:
        metrics = EppMetrics(CollectorRegistry())
        awaiting = AwaitingLog(silence_secs=0.2, metrics=metrics)
        first, streaming, silent = Ending(), Ending(), Ending()
        awaiting.hand_over("a", first)
        awaiting.hand_over("b", streaming)
        awaiting.hand_over("c", silent)
        assert metrics.awaiting_log._value.get() == 3
        assert ended_by(awaiting, entry("zzz")) == "not_awaited"  # a request never handed over
        assert ended_by(awaiting, entry("a", served="10.0.0.1:8000")) == "ended"
        assert first.calls == [("served", "10.0.0.1:8000"), ("end", "complete")]
        assert ended_by(awaiting, entry("a")) == "not_awaited"  # ended once
        # "b" is still streaming: Envoy's periodic entries say so; "c" is never heard of again.
        for _ in range(4):
            await asyncio.sleep(0.1)
            assert ended_by(awaiting, entry("b", kind=al.AccessLogType.DownstreamPeriodic)) == "alive"
        assert silent.calls == [("end", "lost")]  # the sweeper's doing: silent past 0.2 s
        assert streaming.calls == [] and len(awaiting) == 1
        assert ended_by(awaiting, entry("b", downstream_connection_termination=True)) == "ended"
        assert streaming.calls == [("end", "cancelled")] and len(awaiting) == 0
        assert metrics.awaiting_log._value.get() == 0
        awaiting.close()

    asyncio.run(scenario())


def test_silence_secs_0_never_loses_a_tracker_and_a_reused_request_id_ends_the_earlier_one() -> None:
    async def scenario() -> None:
        awaiting = AwaitingLog(silence_secs=0)
        earlier, later = Ending(), Ending()
        awaiting.hand_over("same", earlier)
        assert awaiting.expire(asyncio.get_running_loop().time() + 3600) == 0  # 0: forever
        assert awaiting.expire(asyncio.get_running_loop().time() + 3600) == 0
        awaiting.hand_over("same", later)  # a client's x-request-id, sent twice
        assert earlier.calls == [("end", "lost")] and later.calls == [] and len(awaiting) == 1
        assert ended_by(awaiting, entry("same")) == "ended"
        assert later.calls == [("end", "complete")]
        awaiting.close()

    asyncio.run(scenario())


def test_expire_ends_only_trackers_silent_past_silence_secs() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        awaiting = AwaitingLog(silence_secs=10)
        old, young = Ending(), Ending()
        start = loop.time()
        awaiting.hand_over("old", old)
        awaiting.hand_over("young", young)
        awaiting.close()  # no sweeper: expire() by hand, at times of our own
        await asyncio.sleep(0.3)
        heard = loop.time()
        assert ended_by(awaiting, entry("young", kind=al.AccessLogType.DownstreamPeriodic)) == "alive"
        assert awaiting.expire(start + 9.9) == 0
        assert awaiting.expire(heard + 9.9) == 1  # "old" silent since its hand-over, past 10 s
        assert old.calls == [("end", "lost")] and young.calls == [] and len(awaiting) == 1
        assert awaiting.expire(heard + 10.1) == 1 and young.calls == [("end", "lost")]

    asyncio.run(scenario())


def test_an_entry_that_comes_before_its_hand_over_ends_the_tracker_at_the_hand_over(monkeypatch) -> None:
    """A client gone during the prefill: Envoy logs the request while the picker, lagging, has
    not handed its tracker over yet. The entry is kept a while and ends the tracker when it comes;
    an entry kept past UNCLAIMED_SECS, or beyond UNCLAIMED_MAX, is dropped."""
    monkeypatch.setattr(access_log, "UNCLAIMED_SECS", 0.2)
    monkeypatch.setattr(access_log, "UNCLAIMED_MAX", 3)

    async def scenario() -> None:
        awaiting = AwaitingLog(silence_secs=0)
        assert ended_by(awaiting, entry("early", downstream_remote_reset=True)) == "not_awaited"
        assert ended_by(awaiting, entry("early-periodic", kind=al.AccessLogType.DownstreamPeriodic)) == "not_awaited"
        early, periodic, late, crowded = Ending(), Ending(), Ending(), Ending()
        awaiting.hand_over("early", early)
        assert early.calls == [("end", "cancelled")] and len(awaiting) == 0
        awaiting.hand_over("early-periodic", periodic)  # a periodic entry says nothing of an end
        assert periodic.calls == [] and len(awaiting) == 1
        assert ended_by(awaiting, entry("late")) == "not_awaited"
        await asyncio.sleep(0.3)
        awaiting.hand_over("late", late)  # its entry is too old to be its own
        assert late.calls == [] and len(awaiting) == 2
        for request_id in ("crowded", "b", "c", "d"):  # three kept at most: "crowded" goes first
            assert ended_by(awaiting, entry(request_id)) == "not_awaited"
        awaiting.hand_over("crowded", crowded)
        assert crowded.calls == [] and len(awaiting) == 3

    asyncio.run(scenario())


# -- the gRPC service, as Envoy's logger streams to it -----------------------------------------------


def log_message(*entries: al.HTTPAccessLogEntry, first: bool = False) -> als_pb2.StreamAccessLogsMessage:
    message = als_pb2.StreamAccessLogsMessage(http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(
        log_entry=list(entries)))
    if first:  # Envoy sends its identifier in a stream's first message only
        message.identifier.node.id = "envoy-test"
        message.identifier.log_name = "dynamo-lite-epp"
    return message


def test_the_log_service_applies_entries_across_a_reconnecting_stream() -> None:
    """Envoy's logger keeps one stream per worker and opens a new one when it breaks: trackers
    handed over survive the broken stream and end by the entry the new stream brings; a final
    entry ends its tracker once, whichever stream carried it."""
    async def scenario() -> None:
        metrics = EppMetrics(CollectorRegistry())
        server = EppServer(RoundRobinPicker(["127.0.0.1:1"]), host="127.0.0.1", port=0, access_log_silence_secs=0,
                           metrics=metrics)
        await server.start()
        try:
            streaming, cut, whole = Ending(), Ending(), Ending()
            for request_id, tracker in (("s", streaming), ("c", cut), ("w", whole)):
                server.awaiting.hand_over(request_id, tracker)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = als_pb2_grpc.AccessLogServiceStub(channel)
                sent = asyncio.Queue[als_pb2.StreamAccessLogsMessage | None]()

                async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
                    while (message := await sent.get()) is not None:
                        yield message

                first = stub.StreamAccessLogs(messages())
                await sent.put(log_message(entry("w", served="10.0.0.1:8000"),
                                           entry("s", kind=al.AccessLogType.DownstreamPeriodic), first=True))
                await until(lambda: whole.calls != [])
                assert whole.calls == [("served", "10.0.0.1:8000"), ("end", "complete")]
                first.cancel()  # the stream breaks (Envoy restarting its logger, a network cut)
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await first
                await asyncio.sleep(0.05)
                assert streaming.calls == [] and cut.calls == [] and len(server.awaiting) == 2
                # The new stream: its own identifier, then the rest.
                second = stub.StreamAccessLogs(iter([
                    log_message(entry("w"), first=True),  # ended already: counted, not applied twice
                    log_message(entry("c", upstream_remote_reset=True), entry("s", upstream=("10.0.0.2", 8000))),
                ]))
                await second
            assert whole.calls == [("served", "10.0.0.1:8000"), ("end", "complete")]
            assert cut.calls == [("end", "cancelled")]
            assert streaming.calls == [("served", "10.0.0.2:8000"), ("end", "complete")]
            assert len(server.awaiting) == 0
            counted = {outcome: metrics.access_log_entries.labels(outcome)._value.get()
                       for outcome in ("ended", "alive", "not_awaited")}
            assert counted == {"ended": 3, "alive": 1, "not_awaited": 1}
        finally:
            await server.stop(0)

    asyncio.run(scenario())


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
