"""A real `nats-server` (Debian's package) for the replica tests, on loopback and a free port.

`NatsServer` runs one server with JetStream, its store in a directory of the test's, and can
be stopped, killed and started again on the same port and store (a NATS restart mid-run).
Without the binary the tests that need it skip, or fail under `DYNAMO_LITE_REQUIRE_NATS=1`
(`.ci/run` installs the package and sets it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.reference_server import free_port

# /events documents are up to 8 MiB (the indexer's body limit); the default is 1 MiB.
MAX_PAYLOAD = "8MB"


def nats_server_binary() -> str:
    """The path of `nats-server`, else pytest.skip (pytest.fail under DYNAMO_LITE_REQUIRE_NATS=1)."""
    path = shutil.which("nats-server")
    if path is None:
        message = "nats-server is not installed (Debian: apt-get install nats-server)"
        if os.environ.get("DYNAMO_LITE_REQUIRE_NATS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


class NatsServer:
    """One `nats-server -js` on 127.0.0.1; `url` stays the same across restarts."""

    def __init__(self, directory: Path, *, port: int | None = None) -> None:
        self.binary = nats_server_binary()
        self.directory = directory
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "nats-server.log"
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / "nats-server.conf"
        self.config.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f'jetstream {{ store_dir: "{directory / "jetstream"}" }}\n'
        )

    def start(self, timeout: float = 10.0) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen([self.binary, "-c", str(self.config)], stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited at start-up:\n{self.log_text()}")
            with socket.socket() as sock:
                sock.settimeout(0.2)
                if sock.connect_ex(("127.0.0.1", self.port)) == 0 and "Server is ready" in self.log_text():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server did not start within {timeout}s:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self, *, wipe: bool = False) -> None:
        """Stop and start again on the same port; `wipe`: without its JetStream store (streams,
        consumers and object stores gone), as a server on ephemeral storage comes back."""
        self.stop()
        if wipe:
            shutil.rmtree(self.directory / "jetstream", ignore_errors=True)
        self.start()

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""


@contextlib.contextmanager
def running_nats(directory: Path) -> Iterator[NatsServer]:
    server = NatsServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh NATS server with JetStream per test, stopped afterwards."""
    with running_nats(tmp_path / "nats") as server:
        yield server
