"""Prometheus metrics of one app: per-route request counts and latencies, plus core gauges.

Every LLM request passes through a route, so the per-request part must be cheap:
prometheus-client's labelled `Histogram.labels(...).observe()` plus a `Counter` cost a quarter
of a `/potential_loads` call (bench/ANALYSIS.md, "Figures behind the code"). Instead each
route keeps a dict status -> plain list of bucket counts (the last two items are the +Inf
bucket and the sum of seconds): recording is one dict lookup, one `bisect` and two list
updates. `RequestMetrics.collect` turns those lists into metric families when Prometheus
scrapes, and the services' collectors read their core's state then too, so gauges cost
nothing between scrapes.

Each app owns a `CollectorRegistry` (no global registry): several apps in one process, as in
the tests, never share or collide.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX: Final = "dynamo_lite_"

# Upper bounds in seconds: the routes answer in tens of microseconds to milliseconds.
LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)

UNMATCHED_ROUTE: Final = "unmatched"  # the route label of paths that are no route (404s)
DISCONNECTED: Final = 499  # the status recorded when the client left before its body arrived


class RouteSeries(dict):
    """status -> [count per bucket..., count above the last bucket, sum of seconds]."""

    __slots__ = ("buckets",)

    def __init__(self, buckets: tuple[float, ...]) -> None:
        super().__init__()
        self.buckets = buckets

    def __missing__(self, status: int) -> list[float]:
        series: list[float] = [0] * (len(self.buckets) + 2)
        series[-1] = 0.0
        self[status] = series
        return series

    def record(self, status: int, seconds: float) -> None:
        series = self[status]
        series[bisect_left(self.buckets, seconds)] += 1
        series[-1] += seconds


class RequestMetrics:
    """Request counts and latency histograms per (route, status)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.routes: dict[str, RouteSeries] = {}

    def route(self, path: str) -> RouteSeries:
        """The series of one route, to keep beside its endpoint and `record` into."""
        series = self.routes.get(path)
        if series is None:
            series = self.routes[path] = RouteSeries(self.buckets)
        return series

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            PREFIX + "http_requests", "HTTP requests answered, by route and status", labels=["route", "status"]
        )
        latency = HistogramMetricFamily(
            PREFIX + "http_request_duration_seconds",
            "time from the request reaching the app to its answer being sent, by route and status",
            labels=["route", "status"],
        )
        bounds = [repr(bound) for bound in self.buckets] + ["+Inf"]
        for path, by_status in sorted(self.routes.items()):
            for status, series in sorted(by_status.items()):
                labels = [path, str(status)]
                cumulative: list[tuple[str, float]] = []
                running = 0
                for bound, count in zip(bounds, series):
                    running += int(count)
                    cumulative.append((bound, running))
                requests.add_metric(labels, running)
                latency.add_metric(labels, cumulative, series[-1])
        yield requests
        yield latency


class FunctionCollector(Collector):
    """A collector whose metrics come from a function called at every scrape."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


def new_registry(requests: RequestMetrics) -> CollectorRegistry:
    """A registry with the request metrics and the standard process, platform and GC ones."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FunctionCollector(requests.collect))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


__all__ = [
    "DISCONNECTED",
    "LATENCY_BUCKETS",
    "PREFIX",
    "UNMATCHED_ROUTE",
    "FunctionCollector",
    "RequestMetrics",
    "RouteSeries",
    "new_registry",
]
