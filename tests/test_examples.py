"""Every program in examples/ runs, as a newcomer would run it, against real service processes;
the README's Python example is examples/quickstart.py verbatim.

The examples read the services' addresses from SLOT_TRACKER_URL and INDEXER_URL (defaults:
the services' own ports). Each example leaves the services as it found them, which the next
one relies on: they share one slot tracker and one indexer here. The services require an API
key, which the examples take from DYNAMO_LITE_API_KEY as the clients do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reference_server import running_service

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


API_KEY = "examples-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, str]]:
    with running_service("slot_tracker", "--api-key", API_KEY) as tracker, \
            running_service("indexer", "--api-key", API_KEY) as indexer:
        assert httpx.get(f"{tracker}/workers").status_code == 401
        yield {**os.environ, "SLOT_TRACKER_URL": str(tracker), "INDEXER_URL": str(indexer),
               "DYNAMO_LITE_API_KEY": API_KEY}


def run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, f"{argv} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def assert_left_clean(env: dict[str, str]) -> None:
    assert httpx.get(env["SLOT_TRACKER_URL"] + "/workers", headers=AUTH).json() == []
    assert httpx.get(env["INDEXER_URL"] + "/workers", headers=AUTH).json() == []


def test_the_readme_python_example_is_the_quickstart_verbatim() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = (EXAMPLES / "quickstart.py").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert quickstart in blocks, "README's Python example differs from examples/quickstart.py"


def test_quickstart(services: dict[str, str]) -> None:
    out = run([sys.executable, "examples/quickstart.py"], services)
    assert re.search(r"^worker 1 rank 0: 12\.250 = 1 \* 6\.250 \+ 6 \(cached tokens: 0\)$", out, re.M), out
    assert re.search(r"^chosen: worker [12], rank 0$", out, re.M), out
    assert_left_clean(services)


def test_gateway_keeps_each_conversation_on_its_worker(services: dict[str, str]) -> None:
    out = run([sys.executable, "examples/gateway.py"], services)
    assert "every conversation stayed on one worker, each on its own" in out, out
    assert re.search(r"^a-2: 192 tokens -> worker \d \(cached 128 tokens", out, re.M), out
    assert_left_clean(services)


def test_sidecar_reports_an_engines_cache(services: dict[str, str]) -> None:
    out = run([sys.executable, "examples/sidecar.py", "examples/sidecar_events.jsonl"], services)
    assert "step 2: 2 events, applied 2, rejected 0, gaps 0" in out, out
    assert out.rstrip().endswith("worker 7 holds 2 blocks"), out
    # The example registers its worker and leaves it: a sidecar runs for the engine's lifetime.
    httpx.post(services["INDEXER_URL"] + "/unregister", json={"instance_id": 7, "model_name": "llama-3-8b"},
               headers=AUTH)
    assert_left_clean(services)


@pytest.mark.skipif(shutil.which("curl") is None and os.environ.get("CI") != "true", reason="curl is not installed")
def test_routing_with_curl_only(services: dict[str, str]) -> None:
    out = run(["bash", "examples/route_with_curl.sh"], services)
    assert "worker 7: cached 64 tokens, cost = 1 * (0 + 96 - 64) / 16 + 8 = 10.000" in out, out
    assert "worker 8: cached 0 tokens, cost = 1 * (0 + 96 - 0) / 16 + 6 = 12.000" in out, out
    assert "chosen: worker 7" in out, out
    assert_left_clean(services)
