"""The slot tracker as a process: --help, flags, serving, and a clean exit on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.reference_server import free_port, wait_healthy

COMMAND = [sys.executable, "-m", "dynamo_lite.slot_tracker"]


@pytest.mark.process
def test_help_lists_every_flag() -> None:
    result = subprocess.run([*COMMAND, "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for flag in ("--host", "--port", "--log-level", "--request-ttl-secs", "--access-log"):
        assert flag in result.stdout
    assert "8091" in result.stdout


@pytest.mark.process
@pytest.mark.parametrize("argv", [["--port", "70000"], ["--request-ttl-secs", "0"], ["--log-level", "loud"]])
def test_bad_flags_exit_with_usage(argv: list[str]) -> None:
    result = subprocess.run([*COMMAND, *argv], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "usage:" in result.stderr


@pytest.mark.process
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serves_then_stops_cleanly(stop_signal: signal.Signals) -> None:
    port = free_port()
    process = subprocess.Popen(
        [*COMMAND, "--host", "127.0.0.1", "--port", str(port), "--request-ttl-secs", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, timeout=15)
        body = {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert httpx.post(f"{base_url}/register", json=body).status_code == 201
        add = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0,
               "sequence_hashes": [1, 2], "new_isl_tokens": 5}
        assert httpx.post(f"{base_url}/add", json=add).status_code == 201
        deadline = time.monotonic() + 10
        while httpx.get(f"{base_url}/loads").json()[0]["active_decode_blocks"] and time.monotonic() < deadline:
            time.sleep(0.1)  # the background sweep frees the request once its TTL has passed
        assert httpx.get(f"{base_url}/loads").json()[0]["active_decode_blocks"] == 0
    finally:
        process.send_signal(stop_signal)
        output, _ = process.communicate(timeout=20)
    assert process.returncode == 0, output
    assert "expired 1 stale requests" in output


@pytest.mark.unit
def test_default_connection_cap_keeps_a_tenth_of_the_open_files_for_everything_else() -> None:
    from dynamo_lite.web.cli import default_max_connections

    assert default_max_connections(1024) == 896  # systemd's default soft limit: 128 kept
    assert default_max_connections(20_000) == 18_000
    assert default_max_connections(100) == 64  # never below 64
    assert default_max_connections(-1) == 0  # RLIM_INFINITY: no cap


@pytest.mark.process
@pytest.mark.parametrize("module", ["slot_tracker", "indexer"])
def test_a_port_in_use_ends_with_one_error_line_and_status_3(module: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", f"dynamo_lite.{module}", "--host", "127.0.0.1", "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in result.stderr


@pytest.mark.process
@pytest.mark.parametrize("script", ["dynamo-lite-slot-tracker", "dynamo-lite-indexer", "dynamo-lite-epp",
                                    "dynamo-lite-mock-engine", "dynamo-lite-stack"])
def test_the_console_scripts_help_names_the_script(script: str) -> None:
    """The installed scripts sit next to the interpreter of the venv the project is installed in."""
    path = Path(sys.executable).parent / script
    result = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: {script} ")
