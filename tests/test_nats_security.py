"""Replicas on a NATS server that requires TLS (verifying client certificates) and authorization:
slot tracker replicas with user/password in the URL, indexer replicas with a token, both with a
credentials file (`--nats-creds`: a user JWT and NKey seed under an operator the server trusts),
each with `--nats-tls-ca` and a client certificate; a replica without the right credentials does
not start. A real `nats-server`, a CA made for the run (tls_support)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.nats_support import NatsServer
from support.reference_server import free_port, running_service
from support.tls_support import Authority

from dynamo_lite.durability.nats_connection import NatsSecurity

STALL = 30.0


def secured_nats(directory: Path, authority: Authority, authorization: str) -> NatsServer:
    """A `nats-server -js` that speaks TLS only, requires a client certificate of `authority`,
    and `authorization`: nats-server configuration text (an `authorization` block's content,
    or, starting with `operator:`, a JWT trust set-up)."""
    server = NatsServer(directory)
    pair = authority.issue("nats-server")
    server.config.write_text(
        server.config.read_text()
        + f'tls {{ cert_file: "{pair.certfile}", key_file: "{pair.keyfile}", ca_file: "{authority.certfile}", '
        "verify: true, timeout: 5 }\n"
        + (authorization if authorization.startswith("operator:") else f"authorization {{ {authorization} }}\n")
    )
    server.url = f"tls://127.0.0.1:{server.port}"
    return server


@pytest.fixture()
def authority(tmp_path: Path) -> Authority:
    return Authority.create(tmp_path / "ca")


def tls_flags(authority: Authority) -> tuple[str, ...]:
    client = authority.issue("replica-client", client=True, server=False)
    return ("--nats-tls-ca", str(authority.certfile), "--nats-tls-certfile", str(client.certfile),
            "--nats-tls-keyfile", str(client.keyfile))


def _eventually(check, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + STALL
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.process
def test_security_options_for_nats_py(tmp_path: Path) -> None:
    assert NatsSecurity().connect_options() == {}
    authority = Authority.create(tmp_path)
    client = authority.issue("c", client=True, server=False)
    options = NatsSecurity("/creds", str(authority.certfile), str(client.certfile), str(client.keyfile)).connect_options()
    assert options["user_credentials"] == "/creds" and options["tls"].verify_mode.name == "CERT_REQUIRED"


@pytest.mark.process
@pytest.mark.nats
def test_slot_tracker_replicas_on_an_authenticated_tls_only_server(tmp_path: Path, authority: Authority) -> None:
    server = secured_nats(tmp_path / "nats", authority, 'user: replica, password: "s3cret"')
    server.start()
    try:
        url = server.url.replace("tls://", "tls://replica:s3cret@")
        flags = ("--nats", url, "--nats-join-timeout-secs", "0.3", *tls_flags(authority))
        with running_service("slot_tracker", *flags) as first, running_service("slot_tracker", *flags) as second:
            register = {"worker_id": 4, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2}
            assert httpx.post(f"{first}/register", json=register, timeout=STALL).status_code == 201
            _eventually(lambda: httpx.get(f"{second}/workers", timeout=STALL).json() != [],
                        "the second replica never saw the registration")
            metrics = httpx.get(f"{second}/metrics", timeout=STALL).text
            assert "dynamo_lite_nats_connected 1.0" in metrics
        # Wrong password, or no client certificate: the replica cannot start (status 3).
        for argv in (("--nats", server.url.replace("tls://", "tls://replica:wrong@"), *tls_flags(authority)),
                     ("--nats", url, "--nats-tls-ca", str(authority.certfile))):
            done = subprocess.run([sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1",
                                   "--port", str(free_port()), *argv], capture_output=True, text=True, timeout=60)
            assert done.returncode == 3, done.stderr[-2000:]
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.nats
def test_indexer_replicas_on_a_token_and_tls_only_server(tmp_path: Path, authority: Authority) -> None:
    server = secured_nats(tmp_path / "nats", authority, 'token: "t0ken"')
    server.start()
    try:
        url = server.url.replace("tls://", "tls://t0ken@")
        flags = ("--nats", url, *tls_flags(authority))
        with running_service("indexer", *flags, "--reset-state") as first, running_service("indexer", *flags) as second:
            register = {"instance_id": 9, "model_name": "m", "block_size": 16}
            assert httpx.post(f"{first}/register", json=register, timeout=STALL).status_code == 201
            _eventually(lambda: httpx.get(f"{second}/workers", timeout=STALL).json() != [],
                        "the second replica never saw the registration")
    finally:
        server.stop()


@pytest.mark.process
@pytest.mark.nats
def test_replicas_with_a_credentials_file_on_a_jwt_server(tmp_path: Path, authority: Authority) -> None:
    """`--nats-creds` with a real decentralized-JWT set-up (operator, accounts, a user's JWT and
    NKey seed; support.nats_jwt makes them as nsc would) on a TLS-only server: slot tracker
    replicas (NATS core) and indexer replicas (JetStream, which the account's JWT allows)
    replicate; no credentials, or a user signed by a key the operator never trusted, cannot
    start (status 3)."""
    from support.nats_jwt import Identity, Trust, nkeys

    trust = Trust.create()
    server = secured_nats(tmp_path / "nats", authority, trust.server_config())
    server.start()
    try:
        creds = trust.user_creds(tmp_path / "replica.creds")
        flags = ("--nats", server.url, "--nats-creds", str(creds), *tls_flags(authority))
        with running_service("slot_tracker", *flags, "--nats-join-timeout-secs", "0.3") as first, \
                running_service("slot_tracker", *flags, "--nats-join-timeout-secs", "0.3") as second:
            register = {"worker_id": 4, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2}
            assert httpx.post(f"{first}/register", json=register, timeout=STALL).status_code == 201
            _eventually(lambda: httpx.get(f"{second}/workers", timeout=STALL).json() != [],
                        "the second slot tracker replica never saw the registration")
        with running_service("indexer", *flags, "--reset-state") as first, running_service("indexer", *flags) as second:
            register = {"instance_id": 9, "model_name": "m", "block_size": 16}
            assert httpx.post(f"{first}/register", json=register, timeout=STALL).status_code == 201
            _eventually(lambda: httpx.get(f"{second}/workers", timeout=STALL).json() != [],
                        "the second indexer replica never saw the registration")
        stranger = trust.user_creds(tmp_path / "stranger.creds",
                                    signer=Identity.create(nkeys.PREFIX_BYTE_ACCOUNT))
        for argv in (("--nats", server.url, *tls_flags(authority)),
                     ("--nats", server.url, "--nats-creds", str(stranger), *tls_flags(authority))):
            done = subprocess.run([sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1",
                                   "--port", str(free_port()), *argv], capture_output=True, text=True, timeout=60)
            assert done.returncode == 3, done.stderr[-2000:]
    finally:
        server.stop()
