"""No request makes the picker fail with anything but a `PickError` (which Envoy turns into a
JSON 4xx/5xx), and nothing it books is left behind: arbitrary bodies, paths and headers against
`KvPicker` with a real slot tracker and indexer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from support.reference_server import running_service

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.epp.metrics import EppMetrics
from dynamo_lite.epp.picker import KvPicker, PickerSettings
from dynamo_lite.epp.pool_file import parse_pool
from dynamo_lite.epp.prompt import PromptReader
from dynamo_lite.epp.protocol import PickError, RequestInfo
from dynamo_lite.routing.tokenizer import Tokenizer

pytestmark = pytest.mark.process

POOL = parse_pool(json.dumps([
    {"address": "127.0.0.1:18001", "worker_id": 1, "model": "mock", "block_size": 16, "lora_names": ["adapter"]},
    {"address": "127.0.0.1:18002", "worker_id": 2, "model": "mock", "block_size": 16},
]), source="pool.json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**33) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=40),
    json_values.map(lambda value: json.dumps(value).encode()),
    st.fixed_dictionaries({}, optional={
        "model": st.sampled_from(["mock", "adapter", "other", 3]),
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-1, 2**33), max_size=10), json_values),
        "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", 1]),
                                                              "content": json_values}), max_size=2), json_values),
        "nvext": json_values, "stream": json_values, "cache_salt": json_values,
        "chat_template_kwargs": json_values, "tools": json_values,
    }).map(lambda value: json.dumps(value).encode()),
)


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[str, str]]:
    with running_service("slot_tracker") as slot_tracker, running_service("indexer") as indexer:
        httpx.post(slot_tracker + "/register", json={"worker_id": 1, "model_name": "mock", "block_size": 16,
                                                     "dp_start": 0, "dp_size": 1})
        yield slot_tracker, indexer


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/x?y"]),
       priority=st.one_of(st.none(), st.text(max_size=6)), subset=st.one_of(st.none(), st.lists(
           st.sampled_from(["127.0.0.1:18001", "127.0.0.1:18002", "10.0.0.9:1"]), max_size=2).map(tuple)))
def test_any_request_is_a_pick_or_a_pick_error(services: tuple[str, str], body: bytes, path: str,
                                               priority: str | None, subset: tuple[str, ...] | None) -> None:
    slot_tracker_url, indexer_url = services

    async def scenario() -> None:
        slot_tracker = AsyncSlotTrackerClient(slot_tracker_url, lean=True)
        indexer = AsyncIndexerClient(indexer_url, lean=True)
        picker = KvPicker(pool=POOL, slot_tracker=slot_tracker, indexer=indexer,
                          prompts=PromptReader(tokenizer=Tokenizer.load()),
                          metrics=EppMetrics(CollectorRegistry()), settings=PickerSettings(seed=0))
        headers = {} if priority is None else {"x-request-priority": priority}
        request = RequestInfo("r-1", "POST", path, headers, body, subset)
        try:
            pick = await picker.pick(request)
        except PickError as error:
            assert 400 <= error.status < 600 and error.message
        else:
            assert pick.endpoints and set(pick.endpoints) <= {e.address for e in POOL}
            pick.tracker.response_headers(200, {"content-type": "text/event-stream"})
            pick.tracker.response_chunk(b'data: {"choices":[{"text":"x"}]}\n\n')
            pick.tracker.end("complete")
        await picker.settle()
        await picker.aclose()
        await slot_tracker.aclose()
        await indexer.aclose()

    asyncio.run(scenario())
    dump = httpx.get(slot_tracker_url + "/dump").json()
    assert [r for p in dump["partitions"] for r in p["requests"]] == []
