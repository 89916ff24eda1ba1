"""Where ours and Dynamo 1.6.1's indexer, both subscribed to the same engines, answer alike
and where ours is deliberately different (docs/differences.md, "The indexer").

The random-stream comparison lives in test_indexer_differential.py (feed "zmq"); this file
pins the engine behaviours that stream does not produce: an engine restart, vLLM's map-shaped
batches, multimodal extra keys, vLLM 0.33's STORAGE medium and SGLang's layout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from support.reference_server import free_port, require_reference_or_skip, running_server

from dynamo_lite.hashing import local_block_hashes, local_block_hashes_with_media, sequence_hashes, to_signed
from dynamo_lite.kv_publishers import EnginePublisher, Stored, WireFormat

pytestmark = [pytest.mark.process, pytest.mark.reference]

BLOCK = 16
TOKENS = list(range(1, 65))
LOCAL = local_block_hashes(TOKENS, BLOCK)
CHAIN = sequence_hashes(LOCAL)
# The reference has no barrier: give it time to apply what was published (what it ignores
# cannot be told from what it has not applied yet), then poll until the answers are as expected.
SETTLE_S = 0.5
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, httpx.Client]]:
    python = require_reference_or_skip()
    ref_port, our_port = free_port(), free_port()
    with running_server([str(python), "-m", "dynamo.indexer", "--port", str(ref_port), "--threads", "1"],
                        ref_port) as ref, \
            running_server([sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port",
                            str(our_port), "--log-level", "warning"], our_port) as ours, \
            httpx.Client(base_url=ref, timeout=10) as ref_client, httpx.Client(base_url=ours, timeout=10) as ours_client:
        yield {"reference": ref_client, "ours": ours_client}


_ids = iter(range(500, 10_000))


def subscribe_both(pair: dict[str, httpx.Client], model: str, engine: EnginePublisher) -> int:
    worker = next(_ids)
    for client in pair.values():
        body = {"instance_id": worker, "model_name": model, "block_size": BLOCK, "endpoint": engine.endpoint}
        assert client.post("/register", json=body).status_code == 201
    engine.wait_for_subscribers(2)
    return worker


def answers(pair: dict[str, httpx.Client], model: str, hashes: list[int], expected: dict[str, Any]) -> dict[str, Any]:
    """Each service's scores for `hashes`, once they equal `expected` or the deadline passed."""
    time.sleep(SETTLE_S)
    body = {"model_name": model, "block_hashes": [to_signed(h) for h in hashes]}
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = {name: client.post("/query_by_hash", json=body).json()["scores"] for name, client in pair.items()}
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.parametrize("fmt", [WireFormat.VLLM, WireFormat.VLLM_LEGACY, WireFormat.SGLANG])
def test_the_layouts_dynamo_decodes_answer_alike(pair: dict[str, httpx.Client], context: zmq.Context,
                                                  fmt: WireFormat) -> None:
    model = f"alike-{fmt.value}"
    with EnginePublisher(fmt, context=context) as engine:
        worker = subscribe_both(pair, model, engine)
        disk = "STORAGE" if fmt is not WireFormat.SGLANG else "DISK"
        engine.publish([Stored(CHAIN[:2], None, TOKENS[:32], BLOCK), Stored(CHAIN[2:3], CHAIN[1], TOKENS[32:48],
                                                                         BLOCK, medium=disk)])
        expected = {str(worker): {"0": 2 * BLOCK}}
        got = answers(pair, model, LOCAL, {"reference": expected, "ours": expected})
    assert got["ours"] == got["reference"] == expected
    for name, client in pair.items():
        body = {"model_name": model, "block_hashes": [to_signed(h) for h in LOCAL]}
        assert client.post("/query_by_hash", json=body).json()["instances"][str(worker)]["disk"] == 3 * BLOCK, name


def test_a_map_batch_is_lost_on_dynamo_and_applied_by_ours(pair: dict[str, httpx.Client],
                                                            context: zmq.Context) -> None:
    with EnginePublisher(WireFormat.VLLM_MAP_BATCH, context=context) as engine:
        worker = subscribe_both(pair, "map-batch", engine)
        engine.publish([Stored(CHAIN[:2], None, TOKENS[:32], BLOCK)])
        expected = {"reference": {}, "ours": {str(worker): {"0": 2 * BLOCK}}}
        got = answers(pair, "map-batch", LOCAL, expected)
    assert got == expected


def test_a_restarted_engine_keeps_stale_blocks_on_dynamo_not_on_ours(pair: dict[str, httpx.Client],
                                                                      context: zmq.Context) -> None:
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        worker = subscribe_both(pair, "restart", engine)
        engine.publish([Stored(CHAIN[:3], None, TOKENS[:48], BLOCK)])
        engine.publish([Stored(CHAIN[3:4], CHAIN[2], TOKENS[48:64], BLOCK)])
        before = {str(worker): {"0": 4 * BLOCK}}
        assert answers(pair, "restart", LOCAL, {"reference": before, "ours": before}) == {"reference": before,
                                                                                         "ours": before}
        engine.restart()  # the new engine holds only what it stores now
        engine.publish([Stored(CHAIN[:1], None, TOKENS[:16], BLOCK)])
        expected = {"reference": before, "ours": {str(worker): {"0": BLOCK}}}
        got = answers(pair, "restart", LOCAL, expected)
    assert got == expected


def test_multimodal_extra_keys_enter_ours_hash_and_not_dynamo_1_6_1s(pair: dict[str, httpx.Client],
                                                                     context: zmq.Context) -> None:
    image = "ab" * 32  # vLLM's identifier of one image: 64 hex digits
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        worker = subscribe_both(pair, "multimodal", engine)
        engine.publish([Stored(CHAIN[:2], None, TOKENS[:32], BLOCK, extra_keys=[[image], None])])
        with_image = local_block_hashes_with_media(TOKENS[:32], BLOCK, [[int(image[:16], 16)], None])
        held = {str(worker): {"0": 2 * BLOCK}}
        text_only = answers(pair, "multimodal", LOCAL[:2], {"reference": held, "ours": {}})
        imaged = answers(pair, "multimodal", with_image, {"reference": {}, "ours": held})
    # Dynamo 1.6.1 hashes the placeholder tokens alone: any image in that place would match.
    assert text_only == {"reference": held, "ours": {}}
    assert imaged == {"reference": {}, "ours": held}
