"""No body makes the engine stand-in answer 500 or leave a request behind: arbitrary JSON to every
POST route gets a 200 or vLLM's 4xx error shape (in-process, through the ASGI app)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.kv_publishers import WireFormat
from dynamo_lite.mock_engine.app import create_app
from dynamo_lite.mock_engine.engine import EngineConfig, KvEventsConfig
from dynamo_lite.routing.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/completions/render", "/v1/chat/completions/render",
          "/tokenize"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
fields = {
    "model": st.sampled_from(["mock", "other", 3, None]),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-2, 5000), max_size=20), json_values),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 1]),
                                                          "content": st.one_of(st.text(max_size=30), json_values)}),
                                   max_size=3), json_values),
    "max_tokens": st.one_of(st.integers(-1, 40), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "cache_salt": st.one_of(st.text(max_size=5), json_values),
    "n": st.one_of(st.integers(0, 3), json_values),
}
bodies = st.one_of(json_values, st.fixed_dictionaries({}, optional=fields))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    config = EngineConfig(num_blocks=256, max_model_len=2048, timing=TimingModel().scaled(1000),
                          kv_events=KvEventsConfig(), kv_events_format=WireFormat.VLLM)
    app = create_app(config, Tokenizer.load())
    with TestClient(app) as client:
        client.app_state = app.state  # type: ignore[attr-defined]
        yield client


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_any_json_body_is_answered_without_a_500(client: TestClient, route: str, body: object) -> None:
    answer = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert answer.status_code in (200, 400, 404), (answer.status_code, answer.text)
    if answer.status_code != 200:
        error = answer.json()["error"]
        assert isinstance(error, dict) and error["code"] == answer.status_code and error["message"]
    engine = client.app_state.engine  # type: ignore[attr-defined]
    for rank in engine.ranks:
        assert not rank.scheduler.has_work and rank.cache.used_blocks == 0
