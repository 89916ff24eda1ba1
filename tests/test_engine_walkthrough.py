"""The docs' engine stand-in walkthrough prints exactly what it says, against a real engine
and indexer (its ports pointed at free ones)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
from support.docs_support import marked_blocks
from support.reference_server import free_port, running_service

pytestmark = [pytest.mark.process, pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")]


def walkthrough() -> str:
    ((_, block),) = marked_blocks("engine-walkthrough")
    return block


def test_the_readme_walkthrough_answers_as_written() -> None:
    events, replay = free_port(), free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
    with running_service("mock_engine", "--kv-events-config", config) as engine, running_service(
            "indexer", "--model-name", "mock", "--block-size", "16",
            "--workers", f"1=tcp://127.0.0.1:{events}+tcp://127.0.0.1:{replay}") as indexer:
        time.sleep(0.3)  # the indexer's subscription reaches the engine
        script = walkthrough()
        script = re.sub(r"^E=.*$", f"E={engine}", script, count=1, flags=re.M)
        script = re.sub(r"^I=.*$", f"I={indexer}", script, count=1, flags=re.M)
        expected = [line[2:] for line in script.splitlines() if line.startswith("# ")]
        result = subprocess.run(["bash", "-c", "set -e\n" + script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == expected
