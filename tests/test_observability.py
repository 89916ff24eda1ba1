"""Metrics, readiness, logs and environment variables of both services."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from support.http_support import post
from support.reference_server import free_port, wait_healthy

from dynamo_lite.hashing import local_block_hashes
from dynamo_lite.indexer.app import create_app as create_indexer_app
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document
from dynamo_lite.slot_tracker.app import SlotTrackerConfig
from dynamo_lite.slot_tracker.app import create_app as create_tracker_app
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.web import cli, http
from dynamo_lite.web.logs import AccessLog, JsonFormatter, access_logger

LOCAL = local_block_hashes(list(range(1, 161)), 16)  # 10 blocks
TEXT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# --- helpers ------------------------------------------------------------------------------------


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, by (sample name, sorted labels). Parsing it is itself a check
    that the exposition is valid text format."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == TEXT_TYPE
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, key
            samples[key] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def requests_total(samples: dict, route: str, status: int) -> float:
    return value(samples, "dynamo_lite_http_requests_total", route=route, status=str(status))


def tracker_gauges(samples: dict) -> dict[str, float]:
    prefix = "dynamo_lite_slot_tracker_"
    return {name[len(prefix):]: v for (name, labels), v in samples.items() if name.startswith(prefix)}


@pytest.fixture
def tracker_client() -> Iterator[TestClient]:
    with TestClient(create_tracker_app()) as client:
        yield client


@pytest.fixture
def indexer_client() -> Iterator[TestClient]:
    with TestClient(create_indexer_app()) as client:
        yield client


def stored(worker: int, event_id: int, externals: list[int], locals_: list[int], parent: int | None = None,
           tier: str = "device") -> dict:
    return {"worker_id": worker, "storage_tier": tier, "event": {"event_id": event_id, "dp_rank": 0, "data": {
        "stored": {"parent_hash": parent, "blocks": [
            {"block_hash": e, "tokens_hash": h} for e, h in zip(externals, locals_)]}}}}


def events(*items: dict) -> dict:
    return {"llama:default": {"block_size": 16, "events": list(items)}}


# --- /metrics: requests -------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("create_app", [create_tracker_app, create_indexer_app])
def test_metric_names_follow_the_conventions(create_app) -> None:
    with TestClient(create_app()) as client:
        client.get("/health")
        response = client.get("/metrics")
    families = list(text_string_to_metric_families(response.text))
    ours = [family for family in families if family.name.startswith("dynamo_lite_")]
    assert len(ours) >= 8
    for family in families:
        assert family.name.startswith(("dynamo_lite_", "process_", "python_")), family.name
        assert family.documentation, family.name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
    latency = {family.name: family for family in families}["dynamo_lite_http_request_duration_seconds"]
    assert latency.type == "histogram"


@pytest.mark.unit
def test_request_counts_and_latencies_move_per_route_and_status(tracker_client: TestClient) -> None:
    before = scrape(tracker_client)
    register = {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert post(tracker_client, "/register", register).status_code == 201
    assert post(tracker_client, "/register", register).status_code == 409
    for _ in range(3):
        assert tracker_client.get("/loads").status_code == 200
    assert tracker_client.head("/loads").status_code == 200
    after = scrape(tracker_client)

    assert requests_total(after, "/register", 201) - requests_total(before, "/register", 201) == 1
    assert requests_total(after, "/register", 409) - requests_total(before, "/register", 409) == 1
    assert requests_total(after, "/loads", 200) - requests_total(before, "/loads", 200) == 4
    assert requests_total(after, "/metrics", 200) == requests_total(before, "/metrics", 200) + 1
    for route, status in [("/register", 201), ("/register", 409), ("/loads", 200)]:
        labels = {"route": route, "status": str(status)}
        count = value(after, "dynamo_lite_http_request_duration_seconds_count", **labels)
        assert count == requests_total(after, route, status)
        assert value(after, "dynamo_lite_http_request_duration_seconds_bucket", le="+Inf", **labels) == count
        assert value(after, "dynamo_lite_http_request_duration_seconds_sum", **labels) > 0
        buckets = sorted(
            (float(dict(key_labels)["le"]), v) for (name, key_labels), v in after.items()
            if name == "dynamo_lite_http_request_duration_seconds_bucket"
            and dict(key_labels)["route"] == route and dict(key_labels)["status"] == str(status)
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts)  # cumulative


@pytest.mark.unit
def test_unknown_paths_and_wrong_methods_are_recorded(indexer_client: TestClient) -> None:
    assert indexer_client.get("/no/such/path").status_code == 404
    assert indexer_client.get("/another?x=1").status_code == 404
    assert indexer_client.get("/events").status_code == 405
    assert indexer_client.post("/events", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    samples = scrape(indexer_client)
    assert requests_total(samples, "unmatched", 404) == 2
    assert requests_total(samples, "/events", 405) == 1
    assert requests_total(samples, "/events", 400) == 1
    # the route label takes only the service's own paths: clients cannot add series
    routes = {dict(labels)["route"] for name, labels in samples if name == "dynamo_lite_http_requests_total"}
    assert routes == {"unmatched", "/events"}


@pytest.mark.unit
def test_a_client_that_leaves_before_its_body_is_recorded_as_499() -> None:
    app = create_tracker_app()

    async def leave() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        raise AssertionError("nothing may be sent to a client that left")

    scope = {"type": "http", "method": "POST", "path": "/add", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"10")]}
    asyncio.run(app(scope, leave, send))
    assert app.request_metrics.routes["/add"][499][-1] >= 0
    assert sum(app.request_metrics.routes["/add"][499][:-1]) == 1


# --- /metrics: service state --------------------------------------------------------------------


@pytest.mark.unit
def test_slot_tracker_gauges_follow_its_state() -> None:
    now = [0.0]
    tracker = SlotTracker(request_ttl_secs=10, clock=lambda: now[0])
    with TestClient(create_tracker_app(SlotTrackerConfig(sweep_interval_secs=3600), tracker)) as client:
        assert tracker_gauges(scrape(client)) == {
            "partitions": 0, "workers": 0, "ranks": 0, "active_requests": 0, "tracked_blocks": 0,
            "active_decode_blocks": 0, "output_blocks": 0, "active_prefill_tokens": 0,
            "expired_requests_total": 0, "request_ttl_seconds": 10,
        }
        for worker, dp_size in [(1, 2), (2, 1)]:
            post(client, "/register", {"worker_id": worker, "model_name": "m", "block_size": 16,
                                       "dp_start": 0, "dp_size": dp_size})
        post(client, "/register", {"worker_id": 3, "model_name": "m", "tenant_id": "t", "block_size": 16,
                                   "dp_start": 0, "dp_size": 1})
        adds = [("a", 1, 0, [1, 2, 3], 40), ("b", 1, 1, [1, 2], 10), ("c", 2, 0, [1, 2, 3, 4], 7)]
        for request_id, worker, rank, hashes, tokens in adds:
            assert post(client, "/add", {"model_name": "m", "request_id": request_id, "worker_id": worker,
                                         "dp_rank": rank, "sequence_hashes": hashes,
                                         "new_isl_tokens": tokens}).status_code == 201
        post(client, "/prefill_complete", {"model_name": "m", "request_id": "a"})
        post(client, "/output_blocks", {"model_name": "m", "request_id": "c", "output_blocks": 2})
        gauges = tracker_gauges(scrape(client))
        loads = client.get("/loads").json()
        assert gauges["partitions"] == 2 and gauges["workers"] == 3 and gauges["ranks"] == 4
        assert gauges["active_requests"] == 3
        assert gauges["tracked_blocks"] == 4  # distinct hashes 1..4 of partition (m, default)
        assert gauges["active_decode_blocks"] == sum(row["active_decode_blocks"] for row in loads) == 11
        assert gauges["output_blocks"] == 2
        assert gauges["active_prefill_tokens"] == sum(row["active_prefill_tokens"] for row in loads) == 17

        post(client, "/free", {"model_name": "m", "request_id": "b"})
        now[0] = 11.0
        assert tracker.expire() == 2
        gauges = tracker_gauges(scrape(client))
        assert gauges["active_requests"] == gauges["tracked_blocks"] == gauges["active_decode_blocks"] == 0
        assert gauges["output_blocks"] == 0
        assert gauges["active_prefill_tokens"] == 0
        assert gauges["expired_requests_total"] == 2
        assert gauges["workers"] == 3


@pytest.mark.unit
def test_indexer_gauges_and_event_counters_follow_its_state(indexer_client: TestClient) -> None:
    client = indexer_client
    post(client, "/register", {"instance_id": 9, "model_name": "llama", "block_size": 16, "dp_rank": 1})
    report = post(client, "/events", events(
        stored(1, 0, [101, 102, 103], LOCAL[:3]),
        stored(1, 1, [104], LOCAL[3:4], parent=103, tier="host_pinned"),
        stored(1, 0, [105], LOCAL[4:5]),  # a re-delivery: skipped
        stored(2, 0, [201, 202], LOCAL[:2]),
        stored(2, 5, [203], LOCAL[2:3], parent=202),  # jumps from 0 to 5: a gap
        stored(2, 6, [204], LOCAL[3:4], parent=999),  # unknown parent: rejected
        stored(2, 7, [205], LOCAL[5:6], parent=203, tier="disk"),
    )).json()
    assert (report["applied"], report["skipped"], report["rejected"], report["gap_count"]) == (5, 1, 1, 1)
    samples = scrape(client)
    assert value(samples, "dynamo_lite_indexer_events_total", outcome="applied") == 5
    assert value(samples, "dynamo_lite_indexer_events_total", outcome="skipped") == 1
    assert value(samples, "dynamo_lite_indexer_events_total", outcome="rejected") == 1
    assert value(samples, "dynamo_lite_indexer_event_gaps_total") == 1
    assert value(samples, "dynamo_lite_indexer_partitions") == 1
    assert value(samples, "dynamo_lite_indexer_workers") == 3
    assert value(samples, "dynamo_lite_indexer_ranks") == 3
    workers = client.get("/workers").json()
    device = sum(rank["blocks"] for worker in workers for rank in worker["ranks"])
    lower = sum(rank["lower_tier_blocks"] for worker in workers for rank in worker["ranks"])
    assert value(samples, "dynamo_lite_indexer_blocks", tier="device") == device == 6
    assert value(samples, "dynamo_lite_indexer_blocks", tier="host_pinned") == 1
    assert value(samples, "dynamo_lite_indexer_blocks", tier="disk") == 1
    assert value(samples, "dynamo_lite_indexer_blocks", tier="external") == 0
    assert lower == 2
    indexer: Indexer = client.app.state.indexer
    assert value(samples, "dynamo_lite_indexer_evicted_blocks_total") == getattr(indexer, "evicted_blocks_total", 0)

    post(client, "/unregister", {"instance_id": 1, "model_name": "llama"})
    samples = scrape(client)
    assert value(samples, "dynamo_lite_indexer_blocks", tier="device") == 3
    assert value(samples, "dynamo_lite_indexer_blocks", tier="host_pinned") == 0
    assert value(samples, "dynamo_lite_indexer_events_total", outcome="applied") == 5  # totals stay


@pytest.mark.unit
def test_evictions_are_counted() -> None:
    indexer = Indexer(max_blocks=2)
    with TestClient(create_indexer_app(indexer=indexer)) as client:
        post(client, "/events", events(stored(1, 0, [1, 2, 3, 4, 5], LOCAL[:5])))
        samples = scrape(client)
    assert value(samples, "dynamo_lite_indexer_blocks", tier="device") <= 2
    assert value(samples, "dynamo_lite_indexer_evicted_blocks_total") == indexer.evicted_blocks_total >= 3


@pytest.mark.unit
def test_recovered_dumps_are_not_counted_as_events() -> None:
    source = Indexer()
    source.apply_events(parse_events_document(events(stored(1, 0, [1, 2], LOCAL[:2]))))
    target = Indexer()
    target.load_dump(source.dump())
    with TestClient(create_indexer_app(indexer=target)) as client:
        samples = scrape(client)
    assert value(samples, "dynamo_lite_indexer_blocks", tier="device") == 2
    assert value(samples, "dynamo_lite_indexer_events_total", outcome="applied") == 0


# --- /ready -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_ready_is_503_until_start_up_has_finished_and_from_shutdown_on() -> None:
    async def scenario() -> list[tuple[str, int]]:
        release = asyncio.Event()

        @contextlib.asynccontextmanager
        async def slow_start_up(app: object) -> AsyncIterator[None]:
            await release.wait()  # e.g. recovery from a peer, loading a snapshot
            yield

        app = http.Service(routes=[http.health_route()], lifespan=slow_start_up)
        lifespan_in: asyncio.Queue = asyncio.Queue()
        lifespan_out: asyncio.Queue = asyncio.Queue()
        lifespan = asyncio.create_task(app({"type": "lifespan", "state": {}}, lifespan_in.get, lifespan_out.put))
        seen = []

        async def probe(path: str) -> None:
            messages = []

            async def receive() -> dict:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: dict) -> None:
                messages.append(message)

            scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": []}
            await app(scope, receive, send)
            seen.append((path, messages[0]["status"]))

        await lifespan_in.put({"type": "lifespan.startup"})
        await asyncio.sleep(0)
        await probe("/ready")
        await probe("/health")
        release.set()
        assert (await lifespan_out.get())["type"] == "lifespan.startup.complete"
        await probe("/ready")
        await lifespan_in.put({"type": "lifespan.shutdown"})
        assert (await lifespan_out.get())["type"] == "lifespan.shutdown.complete"
        await lifespan
        await probe("/ready")
        return seen

    assert asyncio.run(scenario()) == [("/ready", 503), ("/health", 200), ("/ready", 200), ("/ready", 503)]


@pytest.mark.unit
@pytest.mark.parametrize("create_app", [create_tracker_app, create_indexer_app])
def test_ready_answers_json(create_app) -> None:
    app = create_app()
    without_lifespan = TestClient(app)  # the lifespan has not run: not ready
    response = without_lifespan.get("/ready")
    assert response.status_code == 503 and "not ready" in response.json()["error"]
    with TestClient(app) as client:
        response = client.get("/ready")
        assert response.status_code == 200 and response.json() == {"status": "ready"}
        assert client.head("/ready").content == b""


# --- logs ---------------------------------------------------------------------------------------


@pytest.fixture
def access_lines() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    access_logger.addHandler(handler)
    level, propagate = access_logger.level, access_logger.propagate
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = False
    try:
        yield stream
    finally:
        access_logger.removeHandler(handler)
        access_logger.setLevel(level)
        access_logger.propagate = propagate


@pytest.mark.unit
def test_access_log_lines_are_json_with_the_trace_id(access_lines: io.StringIO) -> None:
    app = create_tracker_app()
    app.access_log = AccessLog("X-Request-Id")
    with TestClient(app) as client:
        client.get("/loads", headers={"x-request-id": "abc-123"})
        client.get("/nowhere")
        post(client, "/free", {"model_name": "m", "request_id": "r"})
    lines = [json.loads(line) for line in access_lines.getvalue().splitlines()]
    assert [(line["method"], line["path"], line["status"], line["trace_id"]) for line in lines] == [
        ("GET", "/loads", 200, "abc-123"), ("GET", "/nowhere", 404, None), ("POST", "/free", 404, None)]
    for line in lines:
        assert line["logger"] == "dynamo_lite.access" and line["level"] == "INFO"
        assert line["time"].endswith("Z") and line["duration_ms"] >= 0
        assert line["message"].startswith("testclient:")


@pytest.mark.unit
def test_no_access_log_unless_enabled(access_lines: io.StringIO) -> None:
    with TestClient(create_indexer_app()) as client:
        client.get("/health", headers={"x-trace-id": "t"})
    assert access_lines.getvalue() == ""


@pytest.mark.unit
def test_json_formatter_keeps_exceptions_on_one_line() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text
    entry = json.loads(text)
    assert entry["message"] == "failed here" and "ValueError: boom" in entry["exception"]


# --- environment variables ----------------------------------------------------------------------


def parser():
    parser = cli.service_parser("prog", "a service", 8000)
    parser.add_argument("--request-ttl-secs", type=cli.positive_float, default=300.0, help="ttl")
    return parser


@pytest.mark.unit
def test_every_flag_can_come_from_the_environment() -> None:
    environ = {"DYNAMO_LITE_PORT": "9001", "DYNAMO_LITE_HOST": "127.0.0.1", "DYNAMO_LITE_LOG_FORMAT": "json",
               "DYNAMO_LITE_ACCESS_LOG": "true", "DYNAMO_LITE_TRACE_ID_HEADER": "x-request-id",
               "DYNAMO_LITE_REQUEST_TTL_SECS": "2.5", "DYNAMO_LITE_LOG_LEVEL": "debug"}
    args = cli.parse_args(parser(), [], environ)
    assert (args.port, args.host, args.log_format, args.access_log) == (9001, "127.0.0.1", "json", True)
    assert (args.trace_id_header, args.request_ttl_secs, args.log_level) == ("x-request-id", 2.5, "debug")
    defaults = cli.parse_args(parser(), [], {"DYNAMO_LITE_ACCESS_LOG": "0", "UNRELATED": "x"})
    assert (defaults.port, defaults.access_log, defaults.log_format) == (8000, False, "text")


@pytest.mark.unit
def test_the_command_line_wins_over_the_environment() -> None:
    args = cli.parse_args(parser(), ["--port", "9002", "--log-format", "text"],
                          {"DYNAMO_LITE_PORT": "9001", "DYNAMO_LITE_LOG_FORMAT": "json"})
    assert (args.port, args.log_format) == (9002, "text")
    on_by_environment = {"DYNAMO_LITE_ACCESS_LOG": "1"}
    assert cli.parse_args(parser(), [], on_by_environment).access_log is True
    assert cli.parse_args(parser(), ["--no-access-log"], on_by_environment).access_log is False


@pytest.mark.unit
@pytest.mark.parametrize("name, text, message", [
    ("DYNAMO_LITE_PORT", "70000", "outside 0..65535"),
    ("DYNAMO_LITE_PORT", "eighty", "is not a TCP port"),
    ("DYNAMO_LITE_REQUEST_TTL_SECS", "-1", "not a positive number"),
    ("DYNAMO_LITE_LOG_FORMAT", "xml", "invalid choice"),
    ("DYNAMO_LITE_ACCESS_LOG", "maybe", "expected one of"),
])
def test_a_bad_environment_value_exits_2_naming_the_variable(
    capsys: pytest.CaptureFixture[str], name: str, text: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(parser(), [], {name: text})
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert f"environment variable {name}={text!r}" in stderr and message in stderr


# --- the services as processes ------------------------------------------------------------------

SERVICES = {
    "slot_tracker": ("dynamo_lite.slot_tracker", "DYNAMO_LITE_REQUEST_TTL_SECS", "dynamo_lite_slot_tracker_workers"),
    "indexer": ("dynamo_lite.indexer", "DYNAMO_LITE_RECOVERY_TIMEOUT_SECS", "dynamo_lite_indexer_workers"),
}


@pytest.mark.process
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_help_names_the_environment_variables(service: str) -> None:
    module, own_variable, _ = SERVICES[service]
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for variable in ("DYNAMO_LITE_HOST", "DYNAMO_LITE_PORT", "DYNAMO_LITE_LOG_FORMAT", "DYNAMO_LITE_ACCESS_LOG",
                     "DYNAMO_LITE_TRACE_ID_HEADER", own_variable):
        assert variable in result.stdout


@pytest.mark.process
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_bad_environment_value_stops_the_service(service: str) -> None:
    module, _, _ = SERVICES[service]
    result = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "DYNAMO_LITE_LOG_FORMAT": "yaml"})
    assert result.returncode == 2
    assert "environment variable DYNAMO_LITE_LOG_FORMAT='yaml'" in result.stderr


@pytest.mark.process
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_configured_by_environment_logs_json(service: str) -> None:
    module, _, workers_metric = SERVICES[service]
    port = free_port()
    env = {**os.environ, "DYNAMO_LITE_HOST": "127.0.0.1", "DYNAMO_LITE_PORT": str(port),
           "DYNAMO_LITE_LOG_FORMAT": "json", "DYNAMO_LITE_ACCESS_LOG": "1", "DYNAMO_LITE_TRACE_ID_HEADER": "x-req"}
    process = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, path="/ready", timeout=20)
        metrics = httpx.get(f"{base_url}/metrics", headers={"x-req": "trace-42"})
        assert metrics.status_code == 200
        families = {family.name for family in text_string_to_metric_families(metrics.text)}
        assert {workers_metric, "dynamo_lite_http_request_duration_seconds", "process_resident_memory_bytes"} <= families
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
    assert process.returncode == 0, output
    entries = [json.loads(line) for line in output.splitlines()]  # every line is one JSON object
    assert any(entry["logger"] == f"dynamo_lite.{service}" and "starting" in entry["message"] for entry in entries)
    access = [entry for entry in entries if entry["logger"] == "dynamo_lite.access"]
    assert {"path": "/metrics", "status": 200, "trace_id": "trace-42"}.items() <= access[-1].items()
