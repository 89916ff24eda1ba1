"""The indexer subscribes to engines itself: every wire layout, DP ranks, tiers, LoRA and cache
salt, lost messages with and without replay, engine restarts, malformed batches, many engines.

One indexer process runs for the module (`python -m dynamo_lite.indexer`), and each test drives
it with publishers that put real engines' bytes on the wire (dynamo_lite.kv_publishers (shared/kv_publishers.py): vLLM
0.33, the vLLM layouts before it, SGLang 0.5), registered with `POST /register {endpoint,
replay_endpoint}` as a user would. Listeners apply batches asynchronously, so checks poll
`/workers` or a query until the expected state shows (`eventually`), within a deadline.
"""

from __future__ import annotations

import itertools
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from support.indexer_zmq import BLOCK, CHAIN, TOKENS, chain, eventually, listener, query, wait_seq
from support.reference_server import ServerURL, free_port, running_server, running_service

from dynamo_lite.indexer.listeners import REPLAY_ATTEMPTS
from dynamo_lite.kv_publishers import Cleared, DpEngine, EnginePublisher, Removed, WireFormat

pytestmark = pytest.mark.process

_ids = itertools.count(100)


@pytest.fixture(scope="module")
def indexer_url() -> Iterator[ServerURL]:
    port = free_port()
    argv = [sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info", "--replay-timeout-secs", "2"]
    with running_server(argv, port) as url:
        yield url


@pytest.fixture(scope="module")
def indexer(indexer_url: ServerURL) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=indexer_url, timeout=10) as client:
        yield client


def register(client: httpx.Client, model: str, worker: int, publisher: EnginePublisher, *, dp_rank: int = 0,
             replay: bool = True, subscribe_wait: bool = True) -> None:
    body = {"instance_id": worker, "model_name": model, "block_size": BLOCK, "dp_rank": dp_rank,
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint if replay else None}
    response = client.post("/register", json=body)
    assert response.status_code == 201, response.text
    if subscribe_wait:
        publisher.wait_for_subscribers()


def model_name() -> str:
    return f"m{next(_ids)}"


# --- layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_every_wire_layout_feeds_the_index(indexer: httpx.Client, context: zmq.Context, fmt: WireFormat) -> None:
    model, worker = model_name(), next(_ids)
    medium = "CPU_PINNED" if fmt is WireFormat.SGLANG else "CPU"
    with EnginePublisher(fmt, context=context, topic=b"kv-events") as engine:
        register(indexer, model, worker, engine)
        # One scheduler step: a chunked prefill in two stores and an offload, under one seq.
        engine.publish([chain(0, 2), chain(2, 4), chain(4, 5, medium=medium)])
        engine.publish([Removed([CHAIN[3]]), chain(3, 4)])  # evicted and stored again, one step
        info = wait_seq(indexer, model, worker, 1)
        answer = query(indexer, model)
    assert answer["scores"] == {str(worker): {"0": 4 * BLOCK}}
    assert answer["instances"][str(worker)]["cpu"] == 5 * BLOCK
    assert (info["batches"], info["events"], info["gaps"], info["decode_failures"]) == (2, 5, 0, 0)


def test_data_parallel_ranks_publish_on_their_own_ports(indexer: httpx.Client, context: zmq.Context) -> None:
    model, worker = model_name(), next(_ids)
    with DpEngine(WireFormat.VLLM, 2, context=context) as engine:
        for rank in (0, 1):
            register(indexer, model, worker, engine[rank], dp_rank=rank)
        engine[0].publish([chain(0, 3)])
        engine[1].publish([chain(0, 1)])
        wait_seq(indexer, model, worker, 0, dp_rank=1)
        wait_seq(indexer, model, worker, 0, dp_rank=0)
        assert query(indexer, model)["scores"] == {str(worker): {"0": 3 * BLOCK, "1": BLOCK}}


def test_a_batch_rank_overrides_the_registered_one(indexer: httpx.Client, context: zmq.Context) -> None:
    # One socket multiplexing ranks (the batch names its rank; Dynamo attributes it there).
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, dp_rank=5, context=context) as engine:
        register(indexer, model, worker, engine, dp_rank=0)
        engine.publish([chain(0, 2)])
        wait_seq(indexer, model, worker, 0)
        assert query(indexer, model)["scores"] == {str(worker): {"5": 2 * BLOCK}}


def test_lora_and_cache_salt_blocks_answer_queries_with_the_same_context(
    indexer: httpx.Client, context: zmq.Context
) -> None:
    model, vllm_worker, sglang_worker = model_name(), next(_ids), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context) as vllm, \
            EnginePublisher(WireFormat.SGLANG, context=context) as sglang:
        register(indexer, model, vllm_worker, vllm)
        register(indexer, model, sglang_worker, sglang)
        vllm.publish([chain(0, 2, lora_name="my-lora")])
        sglang.publish([chain(0, 2, cache_salt="tenant-a")])
        wait_seq(indexer, model, vllm_worker, 0)
        wait_seq(indexer, model, sglang_worker, 0)
    tokens = TOKENS[:2 * BLOCK]

    def scores(**context_fields: str) -> dict[str, Any]:
        response = indexer.post("/query", json={"model_name": model, "token_ids": tokens, **context_fields})
        return response.json()["scores"]

    assert scores(lora_name="my-lora") == {str(vllm_worker): {"0": 2 * BLOCK}}
    assert scores(cache_salt="tenant-a") == {str(sglang_worker): {"0": 2 * BLOCK}}
    assert scores() == {}


@pytest.mark.parametrize(("fmt", "host", "disk"), [(WireFormat.VLLM, "CPU", "STORAGE"),
                                                  (WireFormat.SGLANG, "CPU_PINNED", "DISK")])
def test_host_and_disk_tiers_extend_a_device_match(
    indexer: httpx.Client, context: zmq.Context, fmt: WireFormat, host: str, disk: str
) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(fmt, context=context) as engine:
        register(indexer, model, worker, engine)
        engine.publish([chain(0, 2), chain(2, 3, medium=host), chain(3, 5, medium=disk)])
        wait_seq(indexer, model, worker, 0)
    instance = query(indexer, model)["instances"][str(worker)]
    assert (instance["gpu"], instance["cpu"], instance["disk"]) == (2 * BLOCK, 3 * BLOCK, 5 * BLOCK)


def test_other_kv_cache_groups_are_counted_not_indexed(indexer: httpx.Client, context: zmq.Context) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(indexer, model, worker, engine)
        engine.publish([
            chain(0, 2, group_idx=0, kv_cache_spec_kind="full_attention"),
            chain(0, 2, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128),
            Removed([CHAIN[1]], group_idx=1),
        ])
        info = wait_seq(indexer, model, worker, 0)
    assert info["ignored_events"] == {"other_kv_cache_group": 2}
    assert query(indexer, model)["scores"] == {str(worker): {"0": 2 * BLOCK}}


# --- lost messages, restarts, bad input -----------------------------------------------------


@pytest.mark.parametrize("fmt", [WireFormat.VLLM, WireFormat.VLLM_LEGACY, WireFormat.SGLANG])
def test_a_lost_message_is_replayed_in_order(indexer: httpx.Client, context: zmq.Context, fmt: WireFormat) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(fmt, context=context) as engine:
        register(indexer, model, worker, engine)
        engine.publish([chain(0, 1)])
        engine.drop_next(2)
        engine.publish([chain(1, 2)])  # lost on the way: only the replay buffer has them
        engine.publish([chain(2, 3), Removed([CHAIN[2]]), chain(2, 4)])
        engine.publish([chain(4, 5)])  # seq 3: the gap shows, seq 1 and 2 are asked for
        info = wait_seq(indexer, model, worker, 3)
        assert engine.replay_requests == 1
    assert (info["gaps"], info["replays"], info["replayed_batches"], info["lost_batches"]) == (1, 1, 2, 0)
    assert query(indexer, model)["scores"] == {str(worker): {"0": 5 * BLOCK}}


def test_batches_the_engine_no_longer_buffers_are_counted_as_lost(
    indexer: httpx.Client, context: zmq.Context
) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context, buffer_steps=2) as engine:
        register(indexer, model, worker, engine)
        engine.publish([chain(0, 1)])
        engine.drop_next(4)
        for start in (1, 2, 3, 4):
            engine.publish([chain(start, start + 1)])
        engine.publish([chain(5, 6)])  # seq 5 shows the gap; the buffer then holds seq 4 and 5
        info = wait_seq(indexer, model, worker, 5)
    assert (info["gaps"], info["replayed_batches"], info["lost_batches"]) == (1, 1, 3)
    assert query(indexer, model)["scores"] == {str(worker): {"0": BLOCK}}  # seq 3 had no parent


def test_without_replay_a_gap_is_counted_as_lost(indexer: httpx.Client, context: zmq.Context) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context, replay=False) as engine:
        register(indexer, model, worker, engine, replay=False)
        engine.publish([chain(0, 1)])
        engine.drop_next(3)
        for start in (1, 2, 3):
            engine.publish([chain(start, start + 1)])
        engine.publish([chain(4, 5)])  # its parent never arrived: refused
        info = wait_seq(indexer, model, worker, 4)
    assert (info["gaps"], info["lost_batches"], info["replays"], info["rejected_events"]) == (1, 3, 0, 1)
    assert query(indexer, model)["scores"] == {str(worker): {"0": BLOCK}}
    metrics = indexer.get("/metrics").text
    assert "dynamo_lite_indexer_zmq_lost_batches_total" in metrics


def test_an_engine_that_does_not_answer_a_replay_costs_only_its_batches(
    indexer: httpx.Client, context: zmq.Context
) -> None:
    model, worker, other = model_name(), next(_ids), next(_ids)
    silent = context.socket(zmq.ROUTER)  # takes the request, never answers
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with EnginePublisher(WireFormat.VLLM, context=context, replay=False) as engine, \
                EnginePublisher(WireFormat.VLLM, context=context) as healthy:
            response = indexer.post("/register", json={
                "instance_id": worker, "model_name": model, "block_size": BLOCK, "endpoint": engine.endpoint,
                "replay_endpoint": f"tcp://127.0.0.1:{silent_port}"})
            assert response.status_code == 201
            engine.wait_for_subscribers()
            register(indexer, model, other, healthy)
            engine.publish([chain(0, 1)])
            engine.drop_next(1)
            engine.publish([chain(1, 2)])
            engine.publish([chain(2, 3)])
            healthy.publish([chain(0, 4)])  # served while the other listener waits for its replay
            wait_seq(indexer, model, other, 0)
            info = wait_seq(indexer, model, worker, 2)
    finally:
        silent.close(0)
    # Asked REPLAY_ATTEMPTS times, then the one missing batch is counted as lost.
    assert (info["replays"], info["replay_failures"], info["lost_batches"]) == (REPLAY_ATTEMPTS, 1, 1)


def test_an_engine_restart_drops_its_old_blocks(indexer: httpx.Client, context: zmq.Context) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(indexer, model, worker, engine)
        engine.publish([chain(0, 4)])
        engine.publish([chain(4, 6)])
        wait_seq(indexer, model, worker, 1)
        assert query(indexer, model)["scores"] == {str(worker): {"0": 6 * BLOCK}}
        engine.restart()  # a new process behind the same address: seq 0, an empty cache
        engine.publish([chain(0, 1)])
        engine.publish([chain(1, 2)])
        info = eventually(lambda: listener(indexer, model, worker),
                          lambda i: i.get("restarts") == 1 and i.get("last_seq") == 1, "the restart")
        assert query(indexer, model)["scores"] == {str(worker): {"0": 2 * BLOCK}}
        # Restarted again, and its first batch lost: seq 1 follows seq 1, so it is a restart,
        # and the replay brings seq 0 back.
        engine.restart()
        engine.drop_next(1)
        engine.publish([chain(0, 1)])
        engine.publish([chain(1, 3)])
        info = eventually(lambda: listener(indexer, model, worker),
                          lambda i: i.get("restarts") == 2 and i.get("last_seq") == 1, "the second restart")
    assert info["replayed_batches"] == 1 and info["lost_batches"] == 0
    assert query(indexer, model)["scores"] == {str(worker): {"0": 3 * BLOCK}}


def test_a_subscriber_that_joins_late_replays_what_the_engine_buffers(
    indexer: httpx.Client, context: zmq.Context
) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.SGLANG, context=context) as engine:
        engine.publish([chain(0, 2)])  # nobody listens yet: PUB drops them
        engine.publish([chain(2, 3)])
        register(indexer, model, worker, engine)
        engine.publish([chain(3, 4)])
        info = wait_seq(indexer, model, worker, 2)
    assert (info["first_seq"], info["gaps"], info["replayed_batches"]) == (2, 0, 2)
    assert query(indexer, model)["scores"] == {str(worker): {"0": 4 * BLOCK}}


def test_a_malformed_message_is_dropped_whole_and_counted(indexer: httpx.Client, context: zmq.Context) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(indexer, model, worker, engine)
        engine.publish([chain(0, 1)])
        engine.publish_raw(b"\xc1")  # seq 1: not msgpack
        engine.publish_raw(msgspec_batch([["BlockStored", [1], None, [2**32], BLOCK], ["Unknown"]]))  # seq 2
        engine.publish_raw(b"", frames=[b"kv", b"\x00" * 4, b"x"])  # a 4-byte seq frame: no seq used
        engine.publish([chain(1, 2), Cleared(), chain(0, 3)])  # seq 3
        info = wait_seq(indexer, model, worker, 3)
    assert (info["decode_failures"], info["gaps"], info["lost_batches"], info["batches"]) == (3, 0, 0, 2)
    assert query(indexer, model)["scores"] == {str(worker): {"0": 3 * BLOCK}}


def msgspec_batch(events: list[Any]) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([time.time(), events, 0])


# --- lifecycle ------------------------------------------------------------------------------


def test_unregister_closes_the_subscription_and_drops_the_blocks(
    indexer: httpx.Client, context: zmq.Context
) -> None:
    model, worker = model_name(), next(_ids)
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(indexer, model, worker, engine)
        engine.publish([chain(0, 2)])
        wait_seq(indexer, model, worker, 0)
        assert indexer.post("/unregister", json={"instance_id": worker, "model_name": model}).status_code == 200
        engine.wait_for_unsubscribed()
        engine.publish([chain(0, 4)])
    assert indexer.post("/query_by_hash", json={"model_name": model, "block_hashes": []}).status_code == 404


def test_unreachable_engines_never_block_the_others(
    indexer: httpx.Client, indexer_url: ServerURL, context: zmq.Context
) -> None:
    model, dead, alive = model_name(), next(_ids), next(_ids)
    closed_port = free_port()  # nobody listens there
    response = indexer.post("/register", json={
        "instance_id": dead, "model_name": model, "block_size": BLOCK,
        "endpoint": f"tcp://127.0.0.1:{closed_port}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})
    assert response.status_code == 201
    with EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(indexer, model, alive, engine)
        engine.publish([chain(0, 2)])
        wait_seq(indexer, model, alive, 0)
        refused = eventually(lambda: listener(indexer, model, dead), lambda info: info["error"] is not None,
                             "the refused connection's reason")
        assert refused["status"] == "connecting" and "refused or unreachable" in refused["error"]
        assert listener(indexer, model, alive)["status"] == "active"
        assert listener(indexer, model, alive)["error"] is None
        assert query(indexer, model)["scores"] == {str(alive): {"0": 2 * BLOCK}}
    # The engine went away: its listener says so, and ZMQ keeps trying to reconnect.
    gone = eventually(lambda: listener(indexer, model, alive), lambda info: info["status"] == "connecting",
                      "the listener noticing its engine is gone")
    assert str(engine.endpoint) in gone["error"]
    # ZMQ retried every 100 ms meanwhile; the log says it once.
    refusals = [line for line in indexer_url.log_text().splitlines() if f":{closed_port}: refused" in line]
    assert len(refusals) == 1, refusals


def test_an_endpoint_that_accepts_tcp_but_never_speaks_zmq_is_not_active() -> None:
    """Nor does /metrics count it active (an indexer of its own: the shared one's listeners change
    state meanwhile)."""
    model, worker = model_name(), next(_ids)
    with running_service("indexer", "--log-level", "info") as indexer_url, \
            httpx.Client(base_url=indexer_url, timeout=30) as indexer:
        # The kernel completes TCP connections to a listening socket; nothing ever answers ZMQ.
        with socket.create_server(("127.0.0.1", 0)) as mute:
            endpoint = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
            response = indexer.post("/register", json={"instance_id": worker, "model_name": model,
                                                       "block_size": BLOCK, "endpoint": endpoint})
            assert response.status_code == 201
            info = eventually(lambda: listener(indexer, model, worker), lambda info: info["error"] is not None,
                              "the handshake timing out")  # HANDSHAKE_TIMEOUT_MS
            assert info["status"] == "connecting" and "no ZMQ handshake" in info["error"], info
            assert listener(indexer, model, worker)["status"] == "connecting"
            metrics = indexer.get("/metrics").text
            assert 'dynamo_lite_indexer_zmq_listeners{status="active"} 0.0' in metrics, metrics
            assert 'dynamo_lite_indexer_zmq_listeners{status="connecting"} 1.0' in metrics, metrics
        assert indexer.post("/unregister", json={"instance_id": worker, "model_name": model}).status_code == 200
        assert not [line for line in indexer_url.log_text().splitlines() if f"{endpoint} is active" in line]


def test_sixteen_engines_at_once(indexer: httpx.Client, context: zmq.Context) -> None:
    model = model_name()
    formats = itertools.cycle(list(WireFormat))
    engines = [EnginePublisher(next(formats), context=context) for _ in range(16)]
    workers = [next(_ids) for _ in engines]
    try:
        for worker, engine in zip(workers, engines):
            register(indexer, model, worker, engine)
        for round_ in range(8):  # every engine stores the whole chain, one block a batch
            for engine in engines:
                engine.publish([chain(round_, round_ + 1)])
            assert indexer.get("/health").status_code == 200
        for worker in workers:
            wait_seq(indexer, model, worker, 7)
    finally:
        for engine in engines:
            engine.close()
    assert query(indexer, model)["scores"] == {str(worker): {"0": 8 * BLOCK} for worker in workers}
    metrics = indexer.get("/metrics").text
    assert 'dynamo_lite_indexer_zmq_listeners{status="active"}' in metrics


def test_workers_flag_subscribes_at_start_up(context: zmq.Context) -> None:
    with EnginePublisher(WireFormat.VLLM, context=context) as engine, \
            EnginePublisher(WireFormat.SGLANG, dp_rank=1, context=context) as rank_1:
        port = free_port()
        workers = f"7={engine.endpoint}+{engine.replay_endpoint},7:1={rank_1.endpoint}"
        argv = [sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port", str(port),
                "--workers", workers, "--block-size", str(BLOCK), "--model-name", "startup"]
        with running_server(argv, port) as url, httpx.Client(base_url=url) as client:
            engine.wait_for_subscribers()
            rank_1.wait_for_subscribers()
            engine.publish([chain(0, 3)])
            rank_1.publish([chain(0, 1)])
            wait_seq(client, "startup", 7, 0)
            wait_seq(client, "startup", 7, 0, dp_rank=1)
            assert query(client, "startup")["scores"] == {"7": {"0": 3 * BLOCK, "1": BLOCK}}
            assert listener(client, "startup", 7)["replay_endpoint"] == engine.replay_endpoint
            url.process.send_signal(signal.SIGTERM)  # shutdown closes every subscription, exits 0
            assert url.process.wait(timeout=15) == 0
            engine.wait_for_unsubscribed()
            rank_1.wait_for_unsubscribed()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "7=tcp://127.0.0.1:5557"], "--block-size is required when --workers is given"),
        (["--workers", "x=tcp://h:1", "--block-size", "16"], "must be integers"),
        (["--workers", "7=nonsense", "--block-size", "16"], "invalid ZMQ endpoint `nonsense`: missing scheme"),
        (["--workers", "7=tcp://h:1,7=tcp://h:2", "--block-size", "16"], "is listed twice"),
    ],
)
def test_workers_flag_errors(flags: list[str], message: str) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "dynamo_lite.indexer", *flags], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
