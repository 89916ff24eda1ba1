"""Service clients for the simulator, with every HTTP exchange timed per route.

The simulator reports the services' own call latency as the client sees it: the time from
handing the request to the connection pool until the whole response body has arrived, measured
inside the httpx transport, so the simulator's own work and the clients' JSON decoding are not
counted, while loopback, HTTP framing and the service's work are.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.web.credentials import ClientCredentials

DEFAULT_TIMEOUT_SECS = 30.0  # an /events batch after a burst of evictions can be large


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics, as
    numpy's default does; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class RouteLatency:
    service: str
    route: str
    calls: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


class LatencyRecorder:
    """Seconds per (service, route), only while `recording` is on (setup calls are not timed)."""

    def __init__(self) -> None:
        self.recording = False
        self.samples: defaultdict[tuple[str, str], list[float]] = defaultdict(list)

    def record(self, service: str, route: str, seconds: float) -> None:
        if self.recording:
            self.samples[(service, route)].append(seconds)

    def summary(self) -> list[RouteLatency]:
        return [
            RouteLatency(
                service, route, len(values),
                percentile(values, 50) * 1e3, percentile(values, 99) * 1e3,
                sum(values) / len(values) * 1e3, max(values) * 1e3,
            )
            for (service, route), values in sorted(self.samples.items())
        ]


class TimedTransport(httpx.AsyncBaseTransport):
    """An `AsyncHTTPTransport` that reads each body before returning it, and times the exchange."""

    def __init__(self, recorder: LatencyRecorder, service: str, credentials: ClientCredentials) -> None:
        self._inner = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            verify=credentials.ssl_context(),
        )
        self._recorder = recorder
        self._service = service

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        started = time.perf_counter()
        response = await self._inner.handle_async_request(request)
        try:
            await response.aread()
        except BaseException:
            await response.aclose()
            raise
        self._recorder.record(self._service, request.url.path, time.perf_counter() - started)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@contextlib.asynccontextmanager
async def service_clients(
    slot_tracker_url: str,
    indexer_url: str,
    recorder: LatencyRecorder,
    timeout: float = DEFAULT_TIMEOUT_SECS,
    credentials: ClientCredentials | None = None,
) -> AsyncIterator[tuple[AsyncSlotTrackerClient, AsyncIndexerClient]]:
    """Both clients on timed transports, presenting `credentials` (default: the environment's
    key); closed on exit."""
    credentials = credentials if credentials is not None else ClientCredentials.from_env()
    async with httpx.AsyncClient(
        base_url=slot_tracker_url, timeout=timeout, transport=TimedTransport(recorder, "slot_tracker", credentials)
    ) as slot_http, httpx.AsyncClient(
        base_url=indexer_url, timeout=timeout, transport=TimedTransport(recorder, "indexer", credentials)
    ) as indexer_http:
        yield (AsyncSlotTrackerClient(client=slot_http, credentials=credentials),
               AsyncIndexerClient(client=indexer_http, credentials=credentials))
