"""The P/D sidecar as a real process between a client and two engine stand-ins on loopback (a
prefill engine and the decode engine beside it), as llm-d's routing sidecar sits in a pod."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from support.pd_support import metric, pd_engine, stored_tokens
from support.reference_server import ServerURL, free_port, running_service

from dynamo_lite.pd_sidecar.app import forwarded, prefill_body, prefiller

# --- the pure parts -------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_prefill_request_is_one_unstreamed_token_with_the_connectors_params() -> None:
    request = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
               "max_tokens": 300, "max_completion_tokens": 300, "temperature": 0.5}
    body = prefill_body(request)
    assert body == {"model": "m", "messages": [], "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                    "temperature": 0.5,
                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                           "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                           "remote_port": None}}
    assert request["stream"] is True and "kv_transfer_params" not in request  # the original is untouched
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"})


@pytest.mark.unit
def test_the_prefiller_header_names_the_first_host_port() -> None:
    assert prefiller([]) is None
    assert prefiller([(b"x-prefiller-host-port", b"10.0.0.1:8000")]) == "10.0.0.1:8000"
    assert prefiller([(b"x-prefiller-host-port", b" 10.0.0.1:8000, 10.0.0.2:8000")]) == "10.0.0.1:8000"
    assert prefiller([(b"x-prefiller-host-port", b""), (b"x-prefiller-host-port", b"h:1")]) == "h:1"


@pytest.mark.unit
def test_forwarded_headers_drop_hop_by_hop_ones_and_carry_the_request_id() -> None:
    headers = [(b"host", b"sidecar"), (b"content-type", b"application/json"), (b"connection", b"keep-alive"),
               (b"content-length", b"12"), (b"authorization", b"Bearer k"), (b"x-request-id", b"old"),
               (b"x-prefiller-host-port", b"p:1")]
    assert forwarded(headers, b"new") == [(b"content-type", b"application/json"), (b"authorization", b"Bearer k"),
                                          (b"accept-encoding", b"identity"), (b"x-request-id", b"new")]
    assert (b"x-request-id", b"old") in forwarded(headers)


# --- processes ------------------------------------------------------------------------------------

DECODE_FLAGS = ("--decode-step-secs", "0.5")  # 10 ms a token at speedup 50: a stream to hang up on
SLOW_PREFILL = ("--prefill-secs-per-token", "1")  # 200 tokens: 4 s at speedup 50


@contextlib.contextmanager
def sidecar(decode: str, *flags: str) -> Iterator[ServerURL]:
    with running_service("pd_sidecar", "--decode-url", decode, *flags) as url:
        yield url


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ServerURL, ServerURL, str, ServerURL]]:
    """A prefill engine, a decode engine (KV events with replay) and the sidecar before it."""
    with pd_engine("prefill-a") as (prefill, _), pd_engine("decode-a", *DECODE_FLAGS, events=True) as (decode, replay):
        assert replay is not None
        with sidecar(decode) as proxy:
            yield prefill, decode, replay, proxy


def host_port(url: str) -> str:
    return url.removeprefix("http://")


def completion(proxy: str, prompt: list[int], headers: dict[str, str], **fields) -> httpx.Response:
    body = {"model": "mock", "prompt": prompt, "max_tokens": 4, **fields}
    return httpx.post(proxy + "/v1/completions", json=body, headers=headers, timeout=20)


@pytest.mark.process
def test_with_the_header_the_prompt_is_prefilled_there_and_decoded_here(pair) -> None:
    prefill, decode, replay, proxy = pair
    prompt = list(range(3000, 3200))  # 12 full blocks and 8 tokens
    header = {"x-prefiller-host-port": host_port(prefill), "x-request-id": "pd-test-1"}
    body = {"model": "mock", "prompt": prompt, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proxy + "/v1/completions", json=body, headers=header, timeout=20) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(chunks) == 6  # the stream as the decode engine wrote it
    assert chunks[0]["id"] == "cmpl-pd-test-1"
    assert chunks[-1]["usage"]["prompt_tokens"] == 200 and chunks[-1]["usage"]["completion_tokens"] == 5
    # Prefilled on the prefill engine, read and decoded by the decode engine.
    assert metric(prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == 1
    assert metric(prefill, "dynamo_lite_mock_engine_kv_blocks_sent_total") == 13
    assert metric(prefill, "dynamo_lite_mock_engine_held_requests") == 0
    assert metric(decode, "dynamo_lite_mock_engine_remote_prefill_requests_total") == 1
    assert metric(decode, "dynamo_lite_mock_engine_kv_blocks_read_total") == 13
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 199
    assert metric(proxy, "dynamo_lite_pd_sidecar_prefills_total") == 1
    assert metric(proxy, "dynamo_lite_pd_sidecar_requests_total", mode="disaggregated") == 1
    assert metric(proxy, "dynamo_lite_pd_sidecar_prefill_seconds_count") == 1
    # The decode engine published the blocks it read, as a real one does.
    stored = stored_tokens(replay)
    assert prompt[:192] == stored[stored.index(prompt[0]):][:192]

    # A chat request, not streamed: the answer is the decode engine's, kv_transfer_params null.
    chat = httpx.post(proxy + "/v1/chat/completions", headers={"x-prefiller-host-port": host_port(prefill)},
                      json={"model": "mock", "max_completion_tokens": 3,
                            "messages": [{"role": "user", "content": "disaggregate me " * 40}]}, timeout=20)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3 and chat.json()["kv_transfer_params"] is None
    assert metric(prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == 2
    assert metric(decode, "dynamo_lite_mock_engine_remote_prefill_requests_total") == 2


@pytest.mark.process
def test_without_the_header_requests_are_proxied_as_they_came(pair) -> None:
    prefill, decode, _, proxy = pair
    before = metric(prefill, "vllm:prefix_cache_queries_total")
    answer = completion(proxy, list(range(3300, 3400)), {})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert answer.json()["kv_transfer_params"] is None
    assert metric(prefill, "vllm:prefix_cache_queries_total") == before  # the prefill engine saw nothing
    assert metric(proxy, "dynamo_lite_pd_sidecar_requests_total", mode="proxied") >= 1
    # Errors and the other routes come back as the decode engine answered them.
    bad = completion(proxy, [1, 2, 3], {"x-prefiller-host-port": host_port(prefill)}, max_tokens=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    models = httpx.get(proxy + "/v1/models", timeout=5)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "mock"
    assert httpx.get(proxy + "/health", timeout=5).status_code == 200


@pytest.mark.process
def test_an_unreachable_prefill_engine_falls_back_to_a_local_prefill(pair) -> None:
    _, decode, _, proxy = pair
    queries = metric(decode, "vllm:prefix_cache_queries_total")
    answer = completion(proxy, list(range(3500, 3600)), {"x-prefiller-host-port": f"127.0.0.1:{free_port()}"})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert metric(proxy, "dynamo_lite_pd_sidecar_prefill_fallbacks_total", reason="error") == 1
    # The decode engine got the request as it came (no remote parameters) and prefilled it.
    assert metric(decode, "vllm:prefix_cache_queries_total") == queries + 100
    assert metric(decode, "dynamo_lite_mock_engine_remote_prefill_fallbacks_total") == 0


@pytest.mark.process
def test_a_streaming_client_that_hangs_up_cancels_the_decode_request(pair) -> None:
    prefill, decode, _, proxy = pair
    body = {"model": "mock", "prompt": list(range(3700, 3800)), "max_tokens": 5000, "stream": True}
    cancelled = metric(proxy, "dynamo_lite_pd_sidecar_cancelled_total")
    with httpx.stream("POST", proxy + "/v1/completions", json=body, timeout=20,
                      headers={"x-prefiller-host-port": host_port(prefill)}) as answer:
        lines = answer.iter_lines()
        assert next(lines).startswith("data: {")
        assert metric(decode, "vllm:num_requests_running") == 1
    wait_for(lambda: metric(decode, "vllm:num_requests_running") == 0, "the decode engine aborts the request")
    assert metric(decode, "vllm:kv_cache_usage_perc") == 0
    wait_for(lambda: metric(proxy, "dynamo_lite_pd_sidecar_cancelled_total") == cancelled + 1, "the sidecar counts it")


def wait_for(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.process
def test_a_slow_prefill_times_out_and_a_client_gone_cancels_the_prefill() -> None:
    with pd_engine("prefill-slow", *SLOW_PREFILL) as (prefill, _), pd_engine("decode-b") as (decode, _), \
            sidecar(decode, "--prefill-timeout-secs", "0.3") as hasty, sidecar(decode) as patient:
        header = {"x-prefiller-host-port": host_port(prefill)}
        prompt = list(range(100, 300))
        started = time.monotonic()
        answer = completion(hasty, prompt, header)
        assert answer.status_code == 200 and time.monotonic() - started < 3
        assert metric(hasty, "dynamo_lite_pd_sidecar_prefill_fallbacks_total", reason="timeout") == 1
        # The prefill given up was cancelled on the prefill engine too (it would run 4 s).
        wait_for(lambda: metric(prefill, "vllm:num_requests_running") == 0, "the prefill engine aborts the prefill",
                 timeout=1.5)
        assert metric(prefill, "dynamo_lite_mock_engine_held_requests") == 0

        # A client that leaves during the prefill: the prefill is cancelled, the decode never sent.
        queries = metric(decode, "vllm:prefix_cache_queries_total")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(patient + "/v1/completions", headers=header, timeout=0.5,
                       json={"model": "mock", "prompt": [token + 1 for token in prompt], "max_tokens": 4})
        wait_for(lambda: metric(patient, "dynamo_lite_pd_sidecar_cancelled_total") == 1, "the sidecar cancels")
        wait_for(lambda: metric(prefill, "vllm:num_requests_running") == 0, "the prefill engine aborts the prefill",
                 timeout=1.5)
        assert metric(decode, "vllm:prefix_cache_queries_total") == queries


@pytest.mark.process
def test_a_prefill_engine_killed_mid_request_falls_back() -> None:
    with pd_engine("decode-c") as (decode, _), sidecar(decode) as proxy:
        with pd_engine("prefill-doomed", *SLOW_PREFILL) as (prefill, _):
            header = {"x-prefiller-host-port": host_port(prefill)}
            killer = threading.Timer(0.3, prefill.process.kill)
            killer.start()
            answer = completion(proxy, list(range(500, 700)), header)
            killer.join()
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert metric(proxy, "dynamo_lite_pd_sidecar_prefill_fallbacks_total", reason="error") == 1
        assert metric(decode, "vllm:prefix_cache_queries_total") == 200
