"""TLS (`--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs`) on both services as real processes,
with a CA made for the run: curl and the clients, mutual TLS refusing a client without a
certificate, certificates replaced without a restart (on change and on SIGHUP), a bad
replacement refused while the old certificate keeps serving, and the server's limits (head
timeout, connection cap) under TLS. The hostile-input suite runs on TLS too
(test_hostile_input.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.reference_server import ServerURL, free_port, running_server
from support.tls_support import Authority, Pair, peer_common_name

from dynamo_lite.client import IndexerClient, ServiceCallError, SlotTrackerClient
from dynamo_lite.web.reloading import POLL_SECS

pytestmark = pytest.mark.process

STALL = 30.0


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.create(tmp_path_factory.mktemp("tls"))


@contextlib.contextmanager
def tls_service(service: str, server: Pair, authority: Authority, *flags: str,
                client: Pair | None = None) -> Iterator[ServerURL]:
    port = free_port()
    argv = [sys.executable, "-m", f"dynamo_lite.{service}", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info", "--ssl-certfile", str(server.certfile), "--ssl-keyfile", str(server.keyfile),
            *flags]
    with running_server(argv, port, scheme="https", verify=authority.client_context(client)) as url:
        yield url


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("service", ["slot_tracker", "indexer"])
def test_curl_and_the_clients_talk_tls_and_plain_http_is_refused(service: str, authority: Authority) -> None:
    with tls_service(service, authority.issue(f"{service}-server"), authority, "--api-key", "k") as url:
        curl = subprocess.run(["curl", "-sS", "--cacert", str(authority.certfile), "-H", "Authorization: Bearer k",
                               f"{url}/workers"], capture_output=True, text=True, timeout=STALL)
        assert curl.returncode == 0 and curl.stdout == "[]", curl.stderr
        untrusted = subprocess.run(["curl", "-sS", f"{url}/health"], capture_output=True, text=True, timeout=STALL)
        assert untrusted.returncode != 0  # a CA the system does not know
        client_type = SlotTrackerClient if service == "slot_tracker" else IndexerClient
        with client_type(url, api_key="k", verify=authority.client_context()) as client:
            assert client.workers() == []
        with client_type(url, api_key="k", verify=str(authority.certfile)) as client:  # a CA bundle path
            assert client.workers() == []
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
        assert url.alive()


def test_mutual_tls_refuses_a_client_without_a_certificate(authority: Authority) -> None:
    client_pair = authority.issue("gateway", client=True, server=False)
    with tls_service("slot_tracker", authority.issue("mtls-server"), authority,
                     "--ssl-ca-certs", str(authority.certfile), client=client_pair) as url:
        with pytest.raises((httpx.HTTPError, ssl.SSLError, OSError)):
            httpx.get(f"{url}/health", verify=authority.client_context(), timeout=5)
        stranger = Authority.create(authority.directory / "stranger")
        with pytest.raises((httpx.HTTPError, ssl.SSLError, OSError)):
            httpx.get(f"{url}/health", verify=stranger.client_context(stranger.issue("x", client=True, server=False)), timeout=5)
        with SlotTrackerClient(url, verify=str(authority.certfile), cert=client_pair.cert) as client:
            client.register(1, "m", 16)
            assert len(client.loads("m")) == 1
        if shutil.which("curl"):
            curl = subprocess.run(["curl", "-sS", "--cacert", str(authority.certfile), "--cert",
                                   str(client_pair.certfile), "--key", str(client_pair.keyfile), f"{url}/loads"],
                                  capture_output=True, text=True, timeout=STALL)
            assert curl.returncode == 0 and '"worker_id":1' in curl.stdout, curl.stderr
        assert url.alive()


def _replace(target: Pair, source: Pair) -> None:
    """Swap the files in, as a Secret update does (new files renamed into place)."""
    for src, dst in ((source.keyfile, target.keyfile), (source.certfile, target.certfile)):
        staged = dst.with_suffix(".new")
        shutil.copyfile(src, staged)
        os.replace(staged, dst)


def _wait_for_common_name(context: ssl.SSLContext, port: int, name: str) -> None:
    deadline = time.monotonic() + 5 * POLL_SECS + 10
    while peer_common_name(context, "127.0.0.1", port) != name:
        assert time.monotonic() < deadline, f"the server still presents another certificate than {name}"
        time.sleep(0.2)


def test_certificates_are_replaced_without_a_restart(authority: Authority, tmp_path: Path) -> None:
    first = authority.issue("rotation-first")
    live = Pair(tmp_path / "tls.crt", tmp_path / "tls.key")
    _replace(live, first)
    context = authority.client_context()
    with tls_service("indexer", live, authority, "--api-key", "k") as url:
        port = _port(url)
        with httpx.Client(base_url=url, verify=context, headers={"authorization": "Bearer k"}) as kept:
            assert kept.get("/workers").status_code == 200
            assert peer_common_name(context, "127.0.0.1", port) == "rotation-first"
            _replace(live, authority.issue("rotation-second"))  # the files change: picked up by the poll
            _wait_for_common_name(context, port, "rotation-second")
            assert kept.get("/workers").status_code == 200  # a connection made before still works
        # A key that does not match its certificate is refused; the last good one stays.
        broken = authority.issue("rotation-broken")
        shutil.copyfile(authority.issue("rotation-other").keyfile, broken.keyfile)
        _replace(live, broken)
        time.sleep(2 * POLL_SECS + 0.5)
        assert peer_common_name(context, "127.0.0.1", port) == "rotation-second"
        # SIGHUP reloads at once, whatever the files' times say.
        _replace(live, authority.issue("rotation-third"))
        os.kill(url.process.pid, signal.SIGHUP)
        _wait_for_common_name(context, port, "rotation-third")
        metrics = httpx.get(f"{url}/metrics", verify=context, headers={"authorization": "Bearer k"}).text
        reloads = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                   if line.startswith("dynamo_lite_tls_")}
        assert reloads["dynamo_lite_tls_reloads_total"] >= 2
        assert reloads["dynamo_lite_tls_failed_reloads_total"] >= 1
        assert "not reloaded" in url.log_text()
        assert url.alive()


def test_limits_hold_under_tls(authority: Authority) -> None:
    """A head not finished in --header-timeout-secs gets its 408; a connection that never starts
    its handshake is closed in that time too; past --max-connections a new one gets a 503."""
    context = authority.client_context()
    with tls_service("slot_tracker", authority.issue("limits-server"), authority,
                     "--header-timeout-secs", "1", "--max-connections", "3") as url:
        port = _port(url)
        with socket.create_connection(("127.0.0.1", port), timeout=STALL) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
            answer = tls.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
        with socket.create_connection(("127.0.0.1", port), timeout=STALL) as silent:
            started = time.monotonic()
            assert silent.recv(4096) == b""  # closed without a handshake
            assert time.monotonic() - started < STALL
        held = [context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=STALL),
                                    server_hostname="127.0.0.1") for _ in range(3)]
        try:
            for sock in held:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
            with socket.create_connection(("127.0.0.1", port), timeout=STALL) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as extra:
                assert extra.recv(4096).startswith(b"HTTP/1.1 503 ")
        finally:
            for sock in held:
                sock.close()
        assert url.alive()


def test_a_replica_recovers_from_a_mutual_tls_peer_with_its_key(authority: Authority) -> None:
    """`--peers` with `--ssl-ca-certs`: the replica presents its own certificate (made for both
    uses) and its first full key to the peer's `/dump`."""
    replica = authority.issue("replica", client=True)
    gateway = authority.issue("replica-gateway", client=True, server=False)
    verify = str(authority.certfile)
    flags = ("--ssl-ca-certs", verify, "--api-key", "k")
    with tls_service("slot_tracker", replica, authority, *flags, client=gateway) as first:
        with SlotTrackerClient(first, api_key="k", verify=verify, cert=gateway.cert) as tracker:
            tracker.register(5, "m", 16, dp_size=3)
        with tls_service("slot_tracker", replica, authority, *flags, "--peers", first, client=gateway) as second:
            with SlotTrackerClient(second, api_key="k", verify=verify, cert=gateway.cert) as tracker:
                assert [worker.worker_id for worker in tracker.workers()] == [5]
            with SlotTrackerClient(second, api_key="wrong", verify=verify, cert=gateway.cert) as tracker, \
                    pytest.raises(ServiceCallError) as refused:
                tracker.workers()
            assert refused.value.status == 401
