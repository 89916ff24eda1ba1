"""The engine stand-in in both roles of a disaggregated pair (vLLM's NixlConnector): the
parameters it takes and answers, the scheduler holding a prefill's blocks, and two real
processes where the test plays the P/D proxy."""

from __future__ import annotations

import time

import httpx
import pytest
from support.pd_support import BLOCK, metric, pd_engine, prefill_params, stored_tokens
from support.reference_server import free_port

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.kv_publishers import Stored
from dynamo_lite.mock_engine.cache import PrefixCache
from dynamo_lite.mock_engine.kv_transfer import (
    KvTransferConfig,
    KvTransferConfigError,
    RemoteBlocks,
    TransferModel,
    prefill_answer_params,
    remote_blocks,
    wants_remote_decode,
)
from dynamo_lite.mock_engine.scheduler import EngineRequest, Scheduler

# --- parameters -------------------------------------------------------------------------------


@pytest.mark.unit
def test_kv_transfer_config_takes_vllms_json() -> None:
    config = KvTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert (config.kv_connector, config.kv_role) == ("NixlConnector", "kv_both")
    assert len(config.engine_id) == 36  # vLLM's default engine id: a new uuid4
    assert KvTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}').engine_id != config.engine_id
    given = KvTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "p1", '
                                   '"kv_buffer_device": "cuda", "kv_connector_extra_config": {}}')
    assert (given.kv_role, given.engine_id) == ("kv_producer", "p1")


@pytest.mark.unit
@pytest.mark.parametrize(("text", "message"), [
    ("not json", "not JSON"),
    ("[]", "JSON object"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "colour": 1}', "unknown field(s) colour"),
    ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "NixlConnector only"),
    ('{"kv_connector": "NixlConnector"}', "kv_role None"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}', "recompute"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": 7}', "engine_id"),
])
def test_kv_transfer_config_refusals_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(KvTransferConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KvTransferConfig.parse(text)


REMOTE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
          "remote_engine_id": "p1", "remote_request_id": "cmpl-a-1", "remote_host": "10.0.0.7", "remote_port": 8000,
          "tp_size": 1}


@pytest.mark.unit
def test_a_prefill_answer_has_the_nixl_connectors_params_and_a_decode_request_reads_them() -> None:
    params = prefill_answer_params([4, 5], "p1", "cmpl-a-1", "10.0.0.7", 8000)
    assert params == REMOTE
    remote = remote_blocks(params)
    assert remote == RemoteBlocks([4, 5], "p1", "cmpl-a-1", "10.0.0.7", 8000)
    assert isinstance(remote, RemoteBlocks)
    assert remote.url == "http://10.0.0.7:8000/kv_transfer/read"
    assert RemoteBlocks([1], "p", "r", "::1", 9).url == "http://[::1]:9/kv_transfer/read"


@pytest.mark.unit
def test_which_requests_are_prefills_and_which_read_remote_blocks() -> None:
    assert wants_remote_decode(prefill_params())
    assert not wants_remote_decode(None) and not wants_remote_decode({}) and not wants_remote_decode(REMOTE)
    assert remote_blocks(None) is None and remote_blocks(prefill_params()) is None
    assert remote_blocks({**REMOTE, "remote_block_ids": []}) is None  # a prompt under a block: nothing to move
    assert remote_blocks({**REMOTE, "do_remote_prefill": False}) is None
    assert remote_blocks({**REMOTE, "remote_host": None}) == "missing remote_host"
    missing = dict(REMOTE)
    del missing["remote_request_id"], missing["remote_port"]
    assert remote_blocks(missing) == "missing remote_request_id, remote_port"
    assert "list of integers" in str(remote_blocks({**REMOTE, "remote_block_ids": ["4"]}))
    assert "TCP port" in str(remote_blocks({**REMOTE, "remote_port": 70000}))
    assert "strings" in str(remote_blocks({**REMOTE, "remote_engine_id": 3}))


@pytest.mark.unit
def test_transfer_time_is_blocks_times_block_bytes_over_the_bandwidth() -> None:
    model = TransferModel(kv_bytes_per_token=131_072, bandwidth_gbps=200.0, hold_secs=480.0)
    assert model.bytes_per_block(16) == 2 * 1024 * 1024
    assert model.seconds(100, 16) == pytest.approx(100 * 2 * 1024 * 1024 * 8 / 200e9)
    fast = model.scaled(50)
    assert fast.seconds(100, 16) == pytest.approx(model.seconds(100, 16) / 50)
    assert fast.hold_secs == pytest.approx(480.0 / 50)


# --- the scheduler and the cache ----------------------------------------------------------------


def _scheduler(cache: PrefixCache) -> Scheduler:
    return Scheduler(cache, TimingModel(0.001, 0.01, 0.0), next_token=lambda request, index: 9000 + index)


def _run(sched: Scheduler, request: EngineRequest) -> None:
    now = 0.0
    while request.finished is None:
        step = sched.plan()
        assert step is not None
        now += step.seconds
        sched.finish(step, now)


@pytest.mark.unit
def test_a_prefill_for_a_remote_decode_holds_its_blocks_until_they_are_read() -> None:
    cache = PrefixCache(64, BLOCK, hash_seed="0")
    sched = _scheduler(cache)
    request = EngineRequest("p", list(range(100, 140)), 1, 0.0, transfer_id="p-1")  # 2.5 blocks
    sched.add(request)
    _run(sched, request)
    assert request.held_block_ids is not None and len(request.held_block_ids) == 3
    assert cache.used_blocks == 3 and set(sched.held) == {"p-1"}
    seq = sched.release_held("p-1")
    assert seq is not None and seq.token_ids == list(range(100, 140))
    assert cache.used_blocks == 0 and cache.cached_blocks == 2  # freed, still cached
    assert sched.release_held("p-1") is None
    plain = EngineRequest("q", list(range(200, 240)), 1, 0.0)
    sched.add(plain)
    _run(sched, plain)
    assert plain.held_block_ids is None and cache.used_blocks == 0


@pytest.mark.unit
def test_a_decode_request_with_read_blocks_computes_only_its_last_prompt_token() -> None:
    cache = PrefixCache(64, BLOCK, hash_seed="0")
    sched = _scheduler(cache)
    prompt = list(range(300, 348))  # 3 full blocks
    cache.drain_events()
    request = EngineRequest("d", prompt, 2, 0.0)
    seq = cache.load("d", prompt, len(prompt) - 1)
    assert seq is not None and seq.computed == 47 and seq.cached_tokens == 0
    (stored,) = cache.drain_events()
    assert isinstance(stored, Stored) and stored.token_ids == prompt[:32]  # the blocks it can cache now
    request.seq = seq
    sched.add(request)
    step = sched.plan()
    assert step is not None and step.prefill_tokens == 1
    _run(sched, request)
    assert request.output_token_ids == [9000, 9001]


# --- two engines, the test playing the proxy -----------------------------------------------------

PROMPT = list(range(1000, 1200))  # 12 full blocks of 16 and 8 tokens


def _prefill(url: str, prompt: list[int]) -> dict:
    answer = httpx.post(url + "/v1/completions", timeout=10, headers={"X-Request-Id": "pd-1"},
                        json={"model": "mock", "prompt": prompt, "max_tokens": 1, "stream": False,
                              "kv_transfer_params": prefill_params()})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _decode(url: str, prompt: list[int], params: dict, max_tokens: int = 4) -> list[str]:
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "kv_transfer_params": params}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as answer:
        assert answer.status_code == 200
        return [line for line in answer.iter_lines() if line.startswith("data: {")]


@pytest.mark.process
def test_a_prompt_prefilled_on_one_engine_is_decoded_on_the_other() -> None:
    slow_prefill = ("--prefill-secs-per-token", "0.05")  # 200 tokens: 10 s, 0.2 s at speedup 50
    with pd_engine("prefill-1", *slow_prefill) as (prefill, _), \
            pd_engine("decode-1", *slow_prefill, events=True) as (decode, replay):
        answer = _prefill(prefill, PROMPT)
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert len(params["remote_block_ids"]) == 13 and params["tp_size"] == 1
        assert params["remote_engine_id"] == "prefill-1" and params["remote_request_id"].startswith("cmpl-pd-1-")
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", int(prefill.rsplit(":", 1)[1]))
        assert answer["usage"]["completion_tokens"] == 1
        # The prefill engine holds the blocks for the decode engine.
        assert metric(prefill, "dynamo_lite_mock_engine_held_requests") == 1
        assert metric(prefill, "dynamo_lite_mock_engine_remote_decode_requests_total") == 1
        assert metric(prefill, "vllm:kv_cache_usage_perc") > 0

        assert len(_decode(decode, PROMPT, params)) == 4
        assert metric(decode, "dynamo_lite_mock_engine_remote_prefill_requests_total") == 1
        assert metric(decode, "dynamo_lite_mock_engine_kv_blocks_read_total") == 13
        assert metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 199
        assert metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") == 1
        assert metric(decode, "vllm:nixl_bytes_transferred_sum") == 13 * BLOCK * 131_072
        assert metric(decode, "vllm:nixl_num_failed_transfers_total") == 0
        # Read once: the prefill engine freed them.
        assert metric(prefill, "dynamo_lite_mock_engine_held_requests") == 0
        assert metric(prefill, "dynamo_lite_mock_engine_kv_blocks_sent_total") == 13
        assert metric(prefill, "vllm:kv_cache_usage_perc") == 0
        # The decode engine published the blocks it received, as a real decode engine does.
        assert stored_tokens(replay)[:192] == PROMPT[:192]
        # Its first token came after the transfer and one token's compute, not a prefill.
        prefill_ttft = metric(prefill, "vllm:time_to_first_token_seconds_sum")
        decode_ttft = metric(decode, "vllm:time_to_first_token_seconds_sum")
        assert decode_ttft < prefill_ttft / 3, (decode_ttft, prefill_ttft)


@pytest.mark.process
def test_a_decode_request_that_cannot_read_the_blocks_prefills_locally() -> None:
    with pd_engine("prefill-2") as (prefill, _), pd_engine("decode-2") as (decode, _):
        params = _prefill(prefill, PROMPT)["kv_transfer_params"]
        invalid = {**params, "remote_host": None}
        unreachable = {**params, "remote_port": free_port()}
        unknown = {**params, "remote_request_id": "cmpl-never"}
        for case in (invalid, unreachable, unknown):
            assert len(_decode(decode, PROMPT, case)) == 4
        assert metric(decode, "dynamo_lite_mock_engine_remote_prefill_fallbacks_total") == 3
        assert metric(decode, "vllm:nixl_num_failed_transfers_total") == 2  # the invalid one read nothing
        assert metric(decode, "dynamo_lite_mock_engine_remote_prefill_requests_total") == 0
        assert metric(prefill, "dynamo_lite_mock_engine_held_requests") == 1  # still held: nobody read it
        # Another prompt's blocks are refused: NIXL would copy whatever they hold.
        other = [token + 1 for token in PROMPT]
        assert len(_decode(decode, other, params)) == 4
        assert metric(decode, "vllm:nixl_num_failed_transfers_total") == 3


@pytest.mark.process
def test_blocks_nobody_reads_are_freed_after_the_hold_time() -> None:
    with pd_engine("prefill-3", "--kv-transfer-hold-secs", "10") as (prefill, _):  # 0.2 s at speedup 50
        _prefill(prefill, PROMPT)
        deadline = time.monotonic() + 5
        while metric(prefill, "dynamo_lite_mock_engine_held_requests") != 0:
            assert time.monotonic() < deadline, "the held blocks never expired"
            time.sleep(0.05)
        assert metric(prefill, "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert metric(prefill, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.process
def test_a_client_that_hangs_up_before_a_whole_answer_aborts_it() -> None:
    with pd_engine("engine-4", "--decode-step-secs", "0.5") as (url, _):  # 10 ms a token
        body = {"model": "mock", "prompt": "hang up on me", "max_tokens": 5000}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while metric(url, "vllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the abandoned request still runs"
            time.sleep(0.05)
        assert metric(url, "vllm:kv_cache_usage_perc") == 0
