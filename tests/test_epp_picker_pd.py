"""The picker's per-request hints and prefill/decode disaggregation, in process (`LocalState`:
the picker's own slot tracker and indexer, every booking call made at once), no Envoy.

- `nvext.agent_hints.osl` reaches the scheduling request and the slot tracker's `/add`;
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dynamo_lite.epp.metrics import EppMetrics
from dynamo_lite.epp.picker import KvPicker, PickerSettings, expected_output_tokens
from dynamo_lite.epp.pool import PoolEndpoint, indexer_rank, tracker_workers
from dynamo_lite.epp.prompt import PromptReader
from dynamo_lite.epp.protocol import Pick, PickError, RequestInfo
from dynamo_lite.epp.state import LocalState
from dynamo_lite.tokenizer import Tokenizer

MODEL = "mock"
BLOCK = 16


def endpoint(worker_id: int, **fields: Any) -> PoolEndpoint:
    return PoolEndpoint(address=f"127.0.0.1:{18000 + worker_id}", worker_id=worker_id, model=MODEL,
                        block_size=BLOCK, **fields)


async def picker_on(pool: list[PoolEndpoint], **settings: Any) -> tuple[KvPicker, LocalState]:
    state = LocalState()
    for worker in tracker_workers(pool):
        assert await state.registrar.register_tracker_worker(worker)
    for ep in pool:
        assert await state.registrar.register_indexer_rank(indexer_rank(ep))
    picker = KvPicker(pool=pool, prompts=PromptReader(tokenizer=Tokenizer.load()),
                      metrics=EppMetrics(CollectorRegistry()), settings=PickerSettings(seed=0, **settings),
                      state=state)
    return picker, state


def request(request_id: str, prompt: list[int], **body: Any) -> RequestInfo:
    data = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    return RequestInfo(request_id, "POST", "/v1/completions", {}, json.dumps(data).encode(), None)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def idle(state: LocalState) -> bool:
    """No booking left, no load on any rank."""
    return not list(state.tracker.active_requests()) and all(
        (load.active_prefill_tokens, load.active_decode_blocks) == (0, 0) for load in state.tracker.loads())


def first_token_and_end(pick: Pick) -> None:
    pick.tracker.response_headers(200, {"content-type": "text/event-stream"})
    pick.tracker.response_chunk(b'data: {"choices":[{"text":"x"}]}\n\n')
    pick.tracker.end("complete")


# --- nvext.agent_hints.osl -------------------------------------------------------------------------


def test_osl_is_read_from_nvext_agent_hints() -> None:
    assert expected_output_tokens({"model": "m"}) is None
    assert expected_output_tokens({"nvext": {"agent_hints": {"osl": 300}}}) == 300
    assert expected_output_tokens({"nvext": {"agent_hints": {"osl": None}}}) is None
    assert expected_output_tokens({"nvext": {"agent_hints": {}}}) is None
    assert expected_output_tokens({"nvext": "x"}) is None
    for bad in (-1, 1.5, "300", True, 1 << 32, [3]):
        with pytest.raises(PickError) as refused:
            expected_output_tokens({"nvext": {"agent_hints": {"osl": bad}}})
        assert refused.value.status == 400 and "osl" in refused.value.message


def test_osl_goes_to_the_scheduler_and_the_slot_tracker_add() -> None:
    async def scenario() -> None:
        picker, state = await picker_on([endpoint(1)])
        scheduled: list[int | None] = []
        schedule = picker.scheduler.schedule

        def spy(req: Any, *args: Any, **kwargs: Any) -> Any:
            scheduled.append(req.expected_output_tokens)
            return schedule(req, *args, **kwargs)

        picker.scheduler.schedule = spy  # type: ignore[method-assign]
        pick = await picker.pick(request("r-osl", list(range(64)), nvext={"agent_hints": {"osl": 256}}))
        booked = state.tracker.request(MODEL, "default", "r-osl")
        assert booked is not None and booked.expected_output_tokens == 256
        first_token_and_end(pick)
        plain = await picker.pick(request("r-plain", list(range(64))))
        booked = state.tracker.request(MODEL, "default", "r-plain")
        assert booked is not None and booked.expected_output_tokens is None
        first_token_and_end(plain)
        assert scheduled == [256, None]
        with pytest.raises(PickError) as refused:
            await picker.pick(request("r-bad", list(range(64)), nvext={"agent_hints": {"osl": "long"}}))
        assert refused.value.status == 400
        assert idle(state)
        await picker.settle()
        await picker.aclose()
        await state.aclose()

    run(scenario)
