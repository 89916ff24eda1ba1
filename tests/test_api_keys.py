"""API keys (`--api-key`, `--api-key-file`, `DYNAMO_LITE_API_KEY`, `--read-api-key`,
`--public-metrics`): the `ApiKeys` core, then both services as real processes, every route
asked without a key, with a wrong one, with the read-only one and with each full one, and the
clients, the simulator's clients and `--peers` recovery presenting their key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.routing import Route
from support.reference_server import ServerURL, free_port, running_server

from bench.security import MemoryTransport
from dynamo_lite.client import AsyncSlotTrackerClient, IndexerClient, ServiceCallError, SlotTrackerClient
from dynamo_lite.indexer.app import create_app as create_indexer
from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker
from dynamo_lite.web.auth import Access, ApiKeys, key_list, read_key_file
from dynamo_lite.web.credentials import ClientCredentials, api_key_from_env
from dynamo_lite.web.http import Answer, Headers, HeadersEndpoint, Service
from dynamo_lite.web.server import ConnectionLimits, HttpServer

OLD_KEY, NEW_KEY, FILE_KEY, READ_KEY = "old-key-1", "new-key-2", "file-key-3", "read-key-4"
APPS = {"slot_tracker": create_slot_tracker, "indexer": create_indexer}
JSON = {"content-type": "application/json"}


# --- the core ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_grant_is_the_highest_level_a_bearer_key_reaches() -> None:
    keys = ApiKeys.from_texts(["w1", "w2"], ["r"])
    assert keys.grant(None) is None
    assert keys.grant(b"Basic dzE=") is None
    assert keys.grant(b"Bearer w2") is Access.WRITE
    assert keys.grant(b"bearer  w1 ") is Access.WRITE  # scheme case-insensitive (RFC 7235), blanks around
    assert keys.grant(b"Bearer r") is Access.READ
    assert keys.grant(b"Bearer w") is Access.OPEN  # a prefix of a key is no key
    assert keys.grant(b"Bearer w1w1") is Access.OPEN


@pytest.mark.unit
def test_check_refuses_and_counts_per_reason() -> None:
    keys = ApiKeys.from_texts(["w"], ["r"])
    assert keys.check(None, Access.OPEN) is None
    assert keys.check(b"Bearer r", Access.READ) is None
    assert keys.check(b"Bearer w", Access.WRITE) is None
    missing = keys.check(None, Access.READ)
    invalid = keys.check(b"Bearer nope", Access.READ)
    read_only = keys.check(b"Bearer r", Access.WRITE)
    assert (missing.status, invalid.status, read_only.status) == (401, 401, 403)  # type: ignore[union-attr]
    assert b"invalid_token" in invalid.challenge and b"insufficient_scope" in read_only.challenge  # type: ignore[union-attr]
    assert keys.refused == {"missing": 1, "invalid": 1, "read_only": 1}


@pytest.mark.unit
@pytest.mark.parametrize("write, read", [([], ["r"]), ([""], []), ([" w"], []), (["w\n"], [])])
def test_unusable_keys_are_refused(write: list[str], read: list[str]) -> None:
    with pytest.raises(ValueError):
        ApiKeys.from_texts(write, read)


@pytest.mark.unit
def test_key_lists_and_files(tmp_path: Path) -> None:
    assert key_list(" a, b ,,") == ["a", "b"]
    path = tmp_path / "keys"
    path.write_text("# rotation: old then new\nold\n\n  new  \n")
    assert read_key_file(str(path)) == ["old", "new"]
    assert api_key_from_env({"DYNAMO_LITE_API_KEY": "first,second"}) == "first"
    assert api_key_from_env({}) is None


@pytest.mark.unit
@pytest.mark.parametrize("service", sorted(APPS))
def test_without_keys_every_route_is_open_and_with_keys_only_the_probes(service: str) -> None:
    app: Service = APPS[service]()
    assert {entry.access for _, entry in app.entries()} == {Access.OPEN}
    app.protect(ApiKeys.from_texts(["w"]))
    open_routes = {path for path, entry in app.entries() if entry.access is Access.OPEN}
    assert open_routes == {"/health", "/ready"}
    assert dict(app.entries())["/dump"].access is Access.WRITE  # the whole state: replicas, not gateways


@pytest.mark.unit
@pytest.mark.parametrize("service", sorted(APPS))
def test_the_openapi_documents_say_what_each_route_asks(service: str) -> None:
    """Open routes declare no security; the others the `bearerKey` scheme and a 401, and the
    routes a read-only key may not call a 403 as well."""
    import yaml

    document = yaml.safe_load((Path(__file__).parents[1] / "openapi" / f"{service}.yaml").read_text())
    assert document["components"]["securitySchemes"]["bearerKey"]["scheme"] == "bearer"
    for method, path, access in routes(service):
        operation = document["paths"][path][method.lower()]
        statuses = set(operation["responses"])
        where = f"{method} {path}"
        if access is Access.OPEN:
            assert operation.get("security") == [] and not statuses & {"401", "403"}, where
            continue
        assert operation.get("security", document["security"]) == [{"bearerKey": []}], where
        assert "401" in statuses, where
        assert ("403" in statuses) == (access is Access.WRITE), where


# --- both services as real processes ----------------------------------------------------------


@contextlib.contextmanager
def keyed_service(service: str, tmp_path: Path, *flags: str) -> Iterator[ServerURL]:
    """The service with two full keys from the environment (a rotation), one from a file, and a
    read-only one."""
    key_file = tmp_path / f"{service}.keys"
    key_file.write_text(f"# mounted from a Secret\n{FILE_KEY}\n")
    port = free_port()
    env = dict(os.environ, DYNAMO_LITE_API_KEY=f"{OLD_KEY},{NEW_KEY}")
    argv = [sys.executable, "-m", f"dynamo_lite.{service}", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--api-key-file", str(key_file), "--read-api-key", READ_KEY, *flags]
    with running_server(argv, port, env=env) as url:
        yield url


def routes(service: str) -> list[tuple[str, str, Access]]:
    app: Service = APPS[service]()
    app.protect(ApiKeys.from_texts(["x"]))
    return [(method, path, entry.access) for path, entry in sorted(app.entries(), key=lambda pair: pair[0])
            for method in sorted(entry.methods - {"HEAD"})]


def call(client: httpx.Client, method: str, path: str, key: str | None) -> httpx.Response:
    headers = dict(JSON)
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return client.request(method, path, headers=headers, content=b"{}" if method == "POST" else None)


def assert_refused(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.request.url, response.text)
    assert response.headers["content-type"] == "application/json"
    assert response.headers["www-authenticate"].startswith('Bearer realm="dynamo_lite"')
    assert list(response.json()) == ["error"]


@pytest.mark.process
@pytest.mark.parametrize("service", sorted(APPS))
def test_every_route_asks_for_the_key_it_needs(service: str, tmp_path: Path) -> None:
    with keyed_service(service, tmp_path) as url, httpx.Client(base_url=url, timeout=10) as client:
        for method, path, access in routes(service):
            if access is Access.OPEN:
                assert call(client, method, path, None).status_code == 200, path
                continue
            assert_refused(call(client, method, path, None), 401)
            assert_refused(call(client, method, path, "wrong"), 401)
            assert_refused(call(client, method, path, OLD_KEY[:-1]), 401)
            read_answer = call(client, method, path, READ_KEY)
            if access is Access.WRITE:
                assert_refused(read_answer, 403)
            else:
                assert read_answer.status_code not in (401, 403), (path, read_answer.text)
            for key in (OLD_KEY, NEW_KEY, FILE_KEY):
                answer = call(client, method, path, key)
                assert answer.status_code not in (401, 403, 500), (path, answer.text)
        metrics = call(client, "GET", "/metrics", READ_KEY).text
        assert 'dynamo_lite_http_auth_refusals_total{reason="missing"}' in metrics
        refused = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("dynamo_lite_http_auth_refusals_total")}
        protected = [route for route in routes(service) if route[2] is not Access.OPEN]
        writes = [route for route in protected if route[2] is Access.WRITE]
        assert refused == {'reason="missing"': len(protected), 'reason="invalid"': 2 * len(protected),
                           'reason="read_only"': len(writes)}
        assert url.alive()


@pytest.mark.process
def test_a_refused_body_is_not_read_into_the_service_and_the_connection_stays_usable(tmp_path: Path) -> None:
    with keyed_service("slot_tracker", tmp_path) as url, httpx.Client(base_url=url, timeout=10) as client:
        body = b'{"model_name": "m", "request_id": "r"}' + b" " * 1_000_000
        refused = client.post("/free", content=body, headers=JSON)
        assert_refused(refused, 401)
        served = client.post("/free", content=body, headers={**JSON, "authorization": f"Bearer {NEW_KEY}"})
        assert served.status_code == 404, served.text  # unknown model: the key let it through


@pytest.mark.process
def test_public_metrics_opens_metrics_only(tmp_path: Path) -> None:
    with keyed_service("indexer", tmp_path, "--public-metrics") as url, httpx.Client(base_url=url) as client:
        assert client.get("/metrics").status_code == 200
        assert_refused(client.get("/workers"), 401)


@pytest.mark.process
@pytest.mark.parametrize("flags, message", [
    (["--api-key-file", "/nonexistent/keys"], "cannot read the key file"),
    (["--read-api-key", "r"], "at least one full API key"),
    (["--api-key", "k", "--read-api-key", "k"], "both a full key and a read-only key"),
])
def test_unusable_key_flags_stop_the_command(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "dynamo_lite.slot_tracker", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                           if k != "DYNAMO_LITE_API_KEY"})
    assert done.returncode == 2 and message in done.stderr, done.stderr


# --- clients ---------------------------------------------------------------------------------


@pytest.mark.process
def test_clients_send_the_key_from_the_environment_or_the_argument(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with keyed_service("slot_tracker", tmp_path) as tracker, keyed_service("indexer", tmp_path) as indexer:
        monkeypatch.setenv("DYNAMO_LITE_API_KEY", f"{NEW_KEY},{OLD_KEY}")
        with SlotTrackerClient(tracker) as client:
            client.register(1, "m", 16)
            assert client.loads("m")
        with IndexerClient(indexer, api_key=READ_KEY) as client:
            assert client.workers() == []
            with pytest.raises(ServiceCallError) as refused:
                client.register(1, "m", 16)
            assert refused.value.status == 403
        with SlotTrackerClient(tracker, api_key="") as client, pytest.raises(ServiceCallError) as missing:
            client.loads()
        assert missing.value.status == 401

        async def lean() -> None:
            async with AsyncSlotTrackerClient(tracker, lean=True, api_key=FILE_KEY) as client:
                await client.free("m", "nobody")
                assert len(await client.potential_loads("m", [1, 2])) == 1

        asyncio.run(lean())


@pytest.mark.process
def test_a_replica_started_with_peers_presents_its_key_to_their_dump(tmp_path: Path) -> None:
    with keyed_service("slot_tracker", tmp_path) as first:
        with SlotTrackerClient(first, api_key=OLD_KEY) as client:
            client.register(7, "m", 16, dp_size=2)
        with keyed_service("slot_tracker", tmp_path, "--peers", first) as second:
            with SlotTrackerClient(second, api_key=FILE_KEY) as client:
                assert [worker.worker_id for worker in client.workers()] == [7]


@pytest.mark.process
def test_an_indexer_started_with_peers_presents_its_key_to_their_dump(tmp_path: Path) -> None:
    """The indexer's recovery: without the key the peer's `/dump` is a 401 and the replica would
    start empty (`--recovery-timeout-secs` bounds the wait)."""
    with keyed_service("indexer", tmp_path) as first:
        with IndexerClient(first, api_key=OLD_KEY) as client:
            client.register(8, "m", 16)
            client.events({"m:default": {"block_size": 16, "events": [{"worker_id": 8, "event": {
                "event_id": 0, "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
                    {"block_hash": 1, "tokens_hash": 2}]}}}}]}})  # a dump carries workers with blocks
        with keyed_service("indexer", tmp_path, "--peers", first, "--recovery-timeout-secs", "2") as second:
            with IndexerClient(second, api_key=FILE_KEY) as client:
                assert [worker.instance_id for worker in client.workers()] == [8]


@pytest.mark.process
def test_the_simulator_clients_present_the_key(tmp_path: Path) -> None:
    from dynamo_lite.simulate.calls import LatencyRecorder, service_clients

    async def both(tracker: str, indexer: str) -> None:
        credentials = ClientCredentials(api_key=NEW_KEY)
        async with service_clients(tracker, indexer, LatencyRecorder(), credentials=credentials) as (slots, index):
            await slots.register(3, "sim", 16)
            await index.register(3, "sim", 16)
            assert await index.workers("sim")

    with keyed_service("slot_tracker", tmp_path) as tracker, keyed_service("indexer", tmp_path) as indexer:
        asyncio.run(both(tracker, indexer))


# --- the native server's keyed connections, in process ----------------------------------------


class _HeaderNames(HeadersEndpoint):
    def respond_with_headers(self, query_string: bytes, body: bytes, headers: Headers) -> Answer:
        return 200, orjson.dumps([name.decode() for name, _ in headers]), b"application/json"


@pytest.mark.unit
def test_an_app_whose_endpoints_read_headers_sees_each_requests_own_headers_with_keys() -> None:
    async def exchange() -> bytes:
        app = Service(routes=[Route("/names", _HeaderNames(), methods=["GET"])])
        app.protect(ApiKeys.from_texts(["w"]))
        server = HttpServer(app, ConnectionLimits())
        connection = server()
        transport = MemoryTransport(keep=True)
        connection.connection_made(transport)  # type: ignore[arg-type]
        connection.data_received(b"GET /names HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer w\r\nX-One: 1\r\n\r\n"
                                 b"GET /names HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer w\r\n\r\n"
                                 b"GET /names HTTP/1.1\r\nHost: a\r\n\r\n")
        server.send_all()
        connection.connection_lost(None)
        return transport.written

    written = asyncio.run(exchange())
    answers = written.split(b"HTTP/1.1 ")[1:]
    assert [answer[:3] for answer in answers] == [b"200", b"200", b"401"]
    assert answers[0].endswith(b'["host","authorization","x-one"]')
    assert answers[1].endswith(b'["host","authorization"]')  # the first request's headers are gone


@pytest.mark.process
def test_key_files_are_read_again_on_change_and_on_sighup(tmp_path: Path) -> None:
    """A rotation without a restart: old and new, then new alone; a file left without any full
    key is refused and the keys in force stay."""
    import signal
    import time

    from dynamo_lite.web.reloading import POLL_SECS

    key_file = tmp_path / "keys"
    key_file.write_text("old\n")
    port = free_port()
    argv = [sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port", str(port),
            "--api-key-file", str(key_file)]

    def status(client: httpx.Client, key: str) -> int:
        return client.get("/workers", headers={"authorization": f"Bearer {key}"}).status_code

    def eventually(client: httpx.Client, key: str, expected: int) -> None:
        deadline = time.monotonic() + 5 * POLL_SECS + 10
        while status(client, key) != expected:
            assert time.monotonic() < deadline, f"key {key!r} still not answered {expected}"
            time.sleep(0.1)

    with running_server(argv, port, env={k: v for k, v in os.environ.items() if k != "DYNAMO_LITE_API_KEY"}) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        assert (status(client, "old"), status(client, "new")) == (200, 401)
        key_file.write_text("old\nnew\n")
        eventually(client, "new", 200)
        assert status(client, "old") == 200
        key_file.write_text("# nothing left\n")  # no full key: refused, the keys stay
        time.sleep(2 * POLL_SECS + 0.5)
        assert (status(client, "old"), status(client, "new")) == (200, 200)
        assert "not reloaded" in url.log_text()
        key_file.write_text("new\n")
        os.kill(url.process.pid, signal.SIGHUP)
        eventually(client, "old", 401)
        assert status(client, "new") == 200
