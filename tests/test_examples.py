"""Every program in examples/ runs, as a newcomer would run it, against real service processes;
the Python example of the README and of docs/routing.md is examples/quickstart.py verbatim.

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
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.docs_support import blocks, marked_blocks
from support.reference_server import running_service

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


@pytest.mark.unit
def test_the_python_quickstart_of_the_readme_and_the_docs_is_the_example_verbatim() -> None:
    quickstart = (EXAMPLES / "quickstart.py").read_text(encoding="utf-8")
    pages = {page.name for page, block in blocks("python") if "KvRouter" in block and block == quickstart}
    differing = {page.name for page, block in blocks("python") if "Route one request with KvRouter" in block} - pages
    assert {"README.md", "routing.md"} <= pages and not differing, f"these pages' quickstart differs: {differing}"


@pytest.mark.process
def test_quickstart(services: dict[str, str]) -> None:
    out = run([sys.executable, "examples/quickstart.py"], services)
    # Nothing cached, nothing running: 100 tokens to prefill at the default 32 us per token.
    assert re.search(r"^worker 51 rank 0: 3\.200 ms = prefill_time 3\.200 ms \+ decode_interference 0\.000 ms "
                     r"\+ cache_pressure 0\.000 ms \(cached tokens: 0\)$", out, re.M), out
    assert re.search(r"^chosen: worker 5[12], rank 0$", out, re.M), out
    assert_left_clean(services)


@pytest.mark.process
def test_gateway_keeps_each_conversation_on_its_worker(services: dict[str, str]) -> None:
    out = run([sys.executable, "examples/gateway.py"], services)
    assert "every conversation stayed on one worker, each on its own" in out, out
    assert re.search(r"^a-2: 192 tokens -> worker 6[1-4] \(cached 128 tokens", out, re.M), out
    assert_left_clean(services)


@pytest.mark.process
def test_sidecar_reports_an_engines_cache(services: dict[str, str]) -> None:
    out = run([sys.executable, "examples/sidecar.py", "examples/sidecar_events.jsonl"], services)
    assert "step 2: 2 events, applied 2, rejected 0, gaps 0" in out, out
    assert out.rstrip().endswith("worker 31 holds 2 blocks"), out
    assert_left_clean(services)  # the file is the engine's life: its worker goes at the end


@pytest.mark.process
@pytest.mark.skipif(shutil.which("curl") is None and os.environ.get("CI") != "true", reason="curl is not installed")
def test_routing_with_curl_only(services: dict[str, str]) -> None:
    out = run(["bash", "examples/route_with_curl.sh"], services)
    assert "worker 41: cached 64 tokens, cost = 1 * (0 + 96 - 64) / 16 + 8 = 10.000" in out, out
    assert "worker 42: cached 0 tokens, cost = 1 * (0 + 96 - 0) / 16 + 6 = 12.000" in out, out
    assert "chosen: worker 41" in out, out
    assert_left_clean(services)


EVERY_EXAMPLE = {
    "quickstart.py": [sys.executable, "examples/quickstart.py"],
    "gateway.py": [sys.executable, "examples/gateway.py"],
    "sidecar.py": [sys.executable, "examples/sidecar.py", "examples/sidecar_events.jsonl"],
    "route_with_curl.sh": ["bash", "examples/route_with_curl.sh"],
}


@pytest.mark.process
@pytest.mark.skipif(shutil.which("curl") is None and os.environ.get("CI") != "true", reason="curl is not installed")
@pytest.mark.parametrize("name", list(EVERY_EXAMPLE))
def test_an_example_meeting_its_ids_in_use_says_why_in_one_line_and_leaves_them(services: dict[str, str], name: str) -> None:
    """Someone else holds the example's first worker id under another model: the example ends with
    the service's message on one line, status 1, and unregisters nothing of the other user's."""
    first_worker = {"quickstart.py": 51, "gateway.py": 61, "sidecar.py": 31, "route_with_curl.sh": 41}[name]
    indexer = services["INDEXER_URL"]
    squatter = {"instance_id": first_worker, "model_name": "someone-else", "block_size": 16}
    assert httpx.post(indexer + "/register", json=squatter, headers=AUTH).status_code == 201
    try:
        done = subprocess.run(EVERY_EXAMPLE[name], env=services, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 1, done
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert f"instance {first_worker}" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert [worker["instance_id"] for worker in httpx.get(indexer + "/workers", headers=AUTH).json()] == [first_worker]
    finally:
        httpx.post(indexer + "/unregister", json={"instance_id": first_worker, "model_name": "someone-else"}, headers=AUTH)
    assert_left_clean(services)


@pytest.mark.process
@pytest.mark.parametrize("name", list(EVERY_EXAMPLE))
def test_an_example_without_services_says_so_in_one_line(name: str) -> None:
    if name.endswith(".sh") and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    env = {**os.environ, "SLOT_TRACKER_URL": "http://127.0.0.1:9", "INDEXER_URL": "http://127.0.0.1:9"}
    done = subprocess.run(EVERY_EXAMPLE[name], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.process
@pytest.mark.parametrize("argv", [["examples/gateway.py"], ["examples/sidecar.py"], ["-m", "dynamo_lite.simulate"],
                                  ["-m", "dynamo_lite.stack"]], ids=["gateway.py", "sidecar.py", "simulate", "stack"])
def test_help_explains_every_flag_and_shows_each_default_once(argv: list[str]) -> None:
    out = run([sys.executable, *argv, "--help"], dict(os.environ))
    options = re.split(r"\n  (?=-)", out.split("options:", 1)[1])[1:]
    assert options
    for option in options:
        assert len(option.split()) > 2, f"{option.split()[0]} has no help text"  # more than the flag and its metavar
        assert "(default: None)" not in option and option.count("default") <= 1, option
        assert "(default: False)" not in option, option  # a switch is off unless given


@pytest.mark.process
def test_the_walkthrough_the_examples_and_the_simulator_run_at_once_on_the_same_services(
        services: dict[str, str]) -> None:
    """Each has worker ids and a model of its own, so they do not clash even when they overlap in
    time (a newcomer's simulator in one terminal, the examples in another): while the simulator
    replays the bundled sample (its workers registered), the walkthrough and every example run at
    once; every call succeeds and the services are left as they were."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    ((_, walkthrough), *_) = marked_blocks("routing-walkthrough")
    walkthrough = re.sub(r"^B=\S+", f"B={services['SLOT_TRACKER_URL']}", walkthrough, count=1, flags=re.M)
    walkthrough = re.sub(r"^I=\S+", f"I={services['INDEXER_URL']}", walkthrough, count=1, flags=re.M)
    script = ('set -euo pipefail\ncurl() { command curl -sSf -H "Authorization: Bearer $DYNAMO_LITE_API_KEY" "$@"; }\n'
              + walkthrough)
    programs = {**EVERY_EXAMPLE, "walkthrough": ["bash", "-c", script]}

    def start(argv: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, env=services, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    simulator = start([sys.executable, "-m", "dynamo_lite.simulate", "--policy", "kv", "--quiet"])
    deadline = time.monotonic() + 60
    while not any(worker["model_name"].startswith("sim-")
                  for worker in httpx.get(services["INDEXER_URL"] + "/workers", headers=AUTH).json()):
        assert simulator.poll() is None and time.monotonic() < deadline, simulator.communicate()
        time.sleep(0.05)
    running = {name: start(argv) for name, argv in programs.items()}
    running["simulator"] = simulator
    failed = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=300)
        if process.returncode != 0:
            failed[name] = (process.returncode, err[-2000:], out[-2000:])
    assert not failed, failed
    assert_left_clean(services)
