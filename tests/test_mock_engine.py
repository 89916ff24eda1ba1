"""The engine stand-in as a real process: vLLM's OpenAI API through the `openai` client, and its
KV events through a real indexer subscribed over ZMQ."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.reference_server import ServerURL, free_port, running_service

from dynamo_lite.routing.tokenizer import Tokenizer

pytestmark = pytest.mark.process

BLOCK = 16
CONVERSATION = [
    {"role": "system", "content": "You are a router's test engine. Answer briefly and never mind the filler."},
    {"role": "user", "content": "Which worker holds the longest prefix of this prompt, and how many blocks is that? "
                                "Count the shared system prompt too, because it is the same for every turn."},
]


def kv_events_config(port: int, replay_port: int | None) -> str:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "topic": ""}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return json.dumps(config)


def free_run(count: int) -> int:
    """A port p with p .. p + count - 1 all free now."""
    while True:
        port = free_port()
        if all(_bindable(port + offset) for offset in range(1, count)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def start_engine(*flags: str, events: bool = True, replay: bool = True, dp: int = 1):
    """The stand-in on free ports, fast (speedup 50), with its KV events endpoints."""
    event_port, replay_port = free_port(), free_port()
    if dp > 1:  # rank r binds port + r: both must be free (and below the ephemeral range)
        event_port = free_run(dp)
        replay_port = free_run(dp)
        while abs(replay_port - event_port) < dp:
            replay_port = free_run(dp)
    argv = ["--speedup-ratio", "50", "--block-size", str(BLOCK), *flags]
    if events:
        argv += ["--kv-events-config", kv_events_config(event_port, replay_port if replay else None)]
    else:
        argv += ["--kv-events-config", '{"enable_kv_cache_events": false}']
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    return running_service("mock_engine", *argv), event_port, replay_port


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerURL]:
    context, _, _ = start_engine(events=False)
    with context as url:
        yield url


@pytest.fixture
def client(engine: ServerURL) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine + "/v1", api_key="unused", max_retries=0)


def unique(text: str) -> str:
    return f"{text} [{time.monotonic_ns()}]"


def test_completions_through_the_openai_client(client: openai.OpenAI) -> None:
    prompt = unique("The prefix cache of an engine stand-in holds blocks of sixteen tokens each, " * 4)
    first = client.completions.create(model="mock", prompt=prompt, max_tokens=12)
    assert first.object == "text_completion" and first.id.startswith("cmpl-")
    assert first.choices[0].finish_reason == "length" and first.choices[0].text
    usage = first.usage
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12
    assert usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="mock", prompt=prompt, max_tokens=12)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert second.choices[0].text == first.choices[0].text  # seeded filler: the same answer


def test_completions_take_token_ids_and_default_to_16_tokens(client: openai.OpenAI) -> None:
    answer = client.completions.create(model="mock", prompt=list(range(100, 140)))
    assert answer.usage.prompt_tokens == 40 and answer.usage.completion_tokens == 16


def test_streamed_completion_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="mock", prompt=unique("stream me"), max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 7 and text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_chat_streamed_and_not_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": unique("Tell me about routing.")}]
    whole = client.chat.completions.create(model="mock", messages=messages, max_tokens=9)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 9
    stream = list(client.chat.completions.create(model="mock", messages=messages, max_tokens=9, stream=True,
                                                 stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant" and stream[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert stream[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert stream[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_sse_framing_on_the_wire(engine: ServerURL) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": unique("frames")}], "max_tokens": 3,
            "stream": True}
    with httpx.stream("POST", engine + "/v1/chat/completions", json=body, timeout=10) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/event-stream"
        raw = b"".join(answer.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(event.startswith(b"data: {") for event in events[:-2]) and len(events) == 2 + 1 + 3


def test_errors_are_vllm_shaped(client: openai.OpenAI, engine: ServerURL) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt="x")
    assert "does not exist" in str(missing.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mock", messages=[{"role": "user", "content": 5}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="mock", prompt="x", max_tokens=10_000_000)
    for body in ({"model": "mock", "prompt": ["a", "b"]}, {"model": "mock", "prompt": "x", "max_tokens": 0},
                 {"model": "mock", "prompt": "x", "stream_options": {"include_usage": True}},
                 {"model": "mock"}, [1, 2]):
        answer = httpx.post(engine + "/v1/completions", json=body)
        assert answer.status_code == 400, body
        error = answer.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    answer = httpx.post(engine + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 400


def test_render_tokenize_and_models_agree_with_the_tokenizer(engine: ServerURL) -> None:
    tokenizer = Tokenizer.load()
    rendered = httpx.post(engine + "/v1/chat/completions/render", json={"model": "mock", "messages": CONVERSATION})
    assert rendered.status_code == 200
    assert rendered.json()["prompt_token_ids"] == tokenizer.chat_token_ids(CONVERSATION)
    completion = httpx.post(engine + "/v1/completions/render", json={"model": "mock", "prompt": "hello world"}).json()
    assert completion["prompt_token_ids"] == tokenizer.prompt_token_ids("hello world")
    tokens = httpx.post(engine + "/tokenize", json={"model": "mock", "prompt": "hello world"}).json()
    assert tokens["tokens"] == completion["prompt_token_ids"] and tokens["count"] == len(tokens["tokens"])
    models = httpx.get(engine + "/v1/models").json()
    assert [card["id"] for card in models["data"]] == ["mock"]
    assert httpx.get(engine + "/health").status_code == 200


def test_metrics_have_vllms_names(client: openai.OpenAI, engine: ServerURL) -> None:
    prompt = unique("metrics " * 40)
    client.completions.create(model="mock", prompt=prompt, max_tokens=2)
    client.completions.create(model="mock", prompt=prompt, max_tokens=2)
    text = httpx.get(engine + "/metrics").text
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                 "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{",
                 "vllm:time_to_first_token_seconds_bucket{"):
        assert name in text, name
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total{")]
    assert float(hits[0].rsplit(" ", 1)[1]) > 0


def test_a_client_that_hangs_up_mid_stream_frees_its_request() -> None:
    context, _, _ = start_engine("--decode-step-secs", "0.5", events=False)  # 10 ms a token at speedup 50
    with context as url:
        body = {"model": "mock", "prompt": "hang up on me", "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as answer:
            iterator = answer.iter_lines()
            next(iterator)
            assert _metric(url, "vllm:num_requests_running") == 1
        deadline = time.monotonic() + 5
        while _metric(url, "vllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the aborted request still runs"
            time.sleep(0.05)
        assert _metric(url, "vllm:kv_cache_usage_perc") == 0


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# --- KV events into a real indexer ------------------------------------------------------------


def register(indexer: str, worker_id: int, endpoint: str, replay: str | None = None, dp_rank: int = 0) -> None:
    body = {"instance_id": worker_id, "model_name": "mock", "block_size": BLOCK, "dp_rank": dp_rank,
            "endpoint": endpoint}
    if replay is not None:
        body["replay_endpoint"] = replay
    answer = httpx.post(indexer + "/register", json=body)
    assert answer.status_code == 201, answer.text


def overlap(indexer: str, token_ids: list[int]) -> dict[str, dict[str, int]]:
    answer = httpx.post(indexer + "/query", json={"model_name": "mock", "token_ids": token_ids})
    assert answer.status_code == 200, answer.text
    return answer.json()["scores"]


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def chat_tokens(url: str, messages: list[dict[str, str]]) -> list[int]:
    return httpx.post(url + "/v1/chat/completions/render", json={"model": "mock", "messages": messages}).json()[
        "prompt_token_ids"]


def test_the_indexer_sees_exactly_what_the_engine_caches() -> None:
    context, port, replay_port = start_engine("--num-blocks", "64")
    with context as url, running_service("indexer") as indexer:
        register(indexer, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        time.sleep(0.3)  # the subscription travels to the engine's socket
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        tokens = chat_tokens(url, CONVERSATION)
        answer = client.chat.completions.create(model="mock", messages=CONVERSATION, max_tokens=4)
        assert answer.usage.prompt_tokens == len(tokens)
        full = len(tokens) // BLOCK * BLOCK
        wait_for(lambda: overlap(indexer, tokens).get("1", {}).get("0") == full, "the prompt's blocks in the index")
        again = client.chat.completions.create(model="mock", messages=CONVERSATION, max_tokens=4)
        assert again.usage.prompt_tokens_details.cached_tokens == (len(tokens) - 1) // BLOCK * BLOCK

        # 64 blocks of 16: other prompts push the conversation out of the cache, and the
        # removals reach the index.
        for index in range(6):
            client.completions.create(model="mock", prompt=list(range(600 * index + 1, 600 * index + 200)),
                                      max_tokens=1)
        wait_for(lambda: overlap(indexer, tokens).get("1", {}).get("0", 0) == 0, "the evicted blocks removed")
        third = client.chat.completions.create(model="mock", messages=CONVERSATION, max_tokens=1)
        assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_batches_published_before_the_indexer_subscribed_are_replayed() -> None:
    context, port, replay_port = start_engine()
    with context as url, running_service("indexer") as indexer:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        early = chat_tokens(url, CONVERSATION)
        client.chat.completions.create(model="mock", messages=CONVERSATION, max_tokens=2)  # nobody listens yet
        register(indexer, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        time.sleep(0.3)
        later = list(range(2000, 2100))
        client.completions.create(model="mock", prompt=later, max_tokens=2)  # a batch with seq > 0
        wait_for(lambda: overlap(indexer, later).get("1", {}).get("0") == 96, "the live batch")
        assert overlap(indexer, early)["1"]["0"] == len(early) // BLOCK * BLOCK  # replayed


def test_data_parallel_ranks_publish_on_offset_ports() -> None:
    context, port, replay_port = start_engine(dp=2)
    with context as url, running_service("indexer") as indexer:
        for rank in range(2):
            register(indexer, 3, f"tcp://127.0.0.1:{port + rank}", f"tcp://127.0.0.1:{replay_port + rank}", rank)
        time.sleep(0.3)
        prompt = list(range(500, 600))
        answer = httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 1},
                            headers={"X-data-parallel-rank": "1"})
        assert answer.status_code == 200
        wait_for(lambda: overlap(indexer, prompt).get("3") == {"1": 96}, "rank 1 alone holds the prompt")
        bad = httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": prompt},
                         headers={"X-data-parallel-rank": "2"})
        assert bad.status_code == 400


def test_sglang_layout_reaches_the_indexer() -> None:
    context, port, replay_port = start_engine("--kv-events-format", "sglang")
    with context as url, running_service("indexer") as indexer:
        register(indexer, 5, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        time.sleep(0.3)
        prompt = list(range(700, 760))
        httpx.post(url + "/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 1})
        wait_for(lambda: overlap(indexer, prompt).get("5", {}).get("0") == 48, "SGLang-layout blocks indexed")


def test_ttft_on_the_real_clock_follows_the_cache_and_the_batch() -> None:
    """The timing model on the wall clock, with margins wide enough for a busy machine: 1 ms per
    uncached prompt token makes a 400-token prompt take 0.4 s to its first token, and its repeat
    (all but the last block cached) about 0.016 s."""
    context, _, _ = start_engine("--prefill-secs-per-token", "0.05", "--decode-step-secs", "0.5",
                                 "--decode-secs-per-running", "0.5", events=False)  # / speedup 50
    with context as url:
        body = {"model": "mock", "prompt": list(range(1000, 1400)), "max_tokens": 1, "stream": True}

        def ttft(request: dict) -> float:
            started = time.monotonic()
            with httpx.stream("POST", url + "/v1/completions", json=request, timeout=30) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: {"):
                        return time.monotonic() - started
            raise AssertionError("no token")

        cold, warm = ttft(body), ttft(body)
        assert cold > 0.35 and warm < cold / 3, (cold, warm)
        # Ten long answers running: a decode step takes 10 ms + 10 ms per further running request
        # (100 ms), and the probe's 40 ms prefill shares a step with them.
        streams = [httpx.stream("POST", url + "/v1/completions", timeout=30,
                                json={"model": "mock", "prompt": [7, i], "max_tokens": 500, "stream": True})
                   for i in range(10)]
        answers = [stream.__enter__() for stream in streams]
        try:
            for answer in answers:
                next(answer.iter_lines())
            loaded = ttft({**body, "prompt": list(range(2000, 2040))})
            idle_estimate = 40 * 0.001
            assert loaded > idle_estimate + 0.005, loaded
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
