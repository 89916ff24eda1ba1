"""What the selection service's tests share: engine stand-ins publishing vLLM's KV events, as
a worker record's fields, and waiting for a state."""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from typing import Any

from support.reference_server import free_port, running_server

BLOCK = 16
MODEL = "mock"


def engine(stack: ExitStack) -> dict[str, Any]:
    """An engine stand-in publishing vLLM's KV events; returns its worker record's fields."""
    port, events, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    argv = [sys.executable, "-m", "dynamo_lite.mock_engine", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--speedup-ratio", "50", "--block-size", str(BLOCK),
            "--kv-events-config", json.dumps(config)]
    url = stack.enter_context(running_server(argv, port))
    return {"model_name": MODEL, "endpoint": str(url), "block_size": BLOCK,
            "kv_events_endpoint": f"tcp://127.0.0.1:{events}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "max_num_batched_tokens": 8192, "total_kv_blocks": 1024}


def wait_until(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
