"""The picker's Prometheus metrics (`GET /metrics` on `--metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Picks take a few hundred microseconds to a few milliseconds (two service reads).
PICK_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0)


class EppMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        prefix = "dynamo_lite_epp_"
        self.pick_seconds = Histogram(
            prefix + "pick_seconds", "time from the request body's end to the pick (queue wait included)",
            buckets=PICK_BUCKETS, registry=registry)
        self.decisions = Counter(
            prefix + "decisions", "picks by outcome: kv (both services), load_only (indexer away), "
            "overlap_only (slot tracker away), round_robin (both away), and the refusals by status",
            ["outcome"], registry=registry)
        self.fallbacks = Counter(
            prefix + "fallback_endpoints", "fallback endpoints handed to the gateway after the pick", registry=registry)
        self.served_mismatches = Counter(
            prefix + "served_mismatches", "requests the gateway served elsewhere than the pick (a fallback); "
            "the bookkeeping follows where it went", registry=registry)
        self.lifecycle_failures = Counter(
            prefix + "lifecycle_call_failures", "slot tracker / indexer bookkeeping calls that failed after retries",
            ["call"], registry=registry)
        self.degraded = Gauge(
            prefix + "service_unreachable", "1 while the last call to the service failed", ["service"],
            registry=registry)
        self.queue_depth = Gauge(prefix + "queue_depth", "requests waiting for a rank with capacity",
                                 registry=registry)
        self.in_flight = Gauge(prefix + "requests_in_flight", "picked requests whose answer has not ended",
                               registry=registry)
        self.ends = Counter(prefix + "request_ends", "picked requests ended, by how", ["reason"], registry=registry)
        self.awaiting_log = Gauge(
            prefix + "answers_awaiting_access_log", "answers handed back to Envoy after their first chunk whose end "
            "the access log has not reported yet", registry=registry)
        self.access_log_entries = Counter(
            prefix + "access_log_entries", "Envoy access log entries received: ended (an answer handed over), alive "
            "(a periodic entry of one still running), not_awaited (any other request)", ["outcome"],
            registry=registry)
        self.disagg_decisions = Counter(
            prefix + "disagg_decisions", "requests of a model with prefill endpoints, by whether they were prefilled "
            "on one: disaggregated, or aggregated on the decode endpoint because the prompt's uncached tokens were "
            "few (short) or every prefill endpoint was busy (prefill_busy)", ["reason"], registry=registry)
        self.output_estimates = Counter(
            prefix + "output_estimates", "estimates of the output of answers the picker no longer sees (the "
            "access-log configuration), one per answer and estimator pass", registry=registry)


__all__ = ["EppMetrics", "PICK_BUCKETS"]
