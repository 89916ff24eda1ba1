"""Replays under the faults operators meet: an indexer paused (SIGSTOP, as a debugger, memory
pressure or a VM migration stops it) between asking an engine for missed batches and reading
the answer, an answer that arrives in pieces, an engine silent past the deadline, an engine
whose buffer no longer holds the batches; and the listener counters with and without `--nats`.

Real processes on loopback: `python -m dynamo_lite.indexer` (alone, or as replicas on a real
`nats-server -js`), fed by dynamo_lite.kv_publishers' vLLM 0.33 publisher with its replay
socket. `EnginePublisher.hold_replays` lets a test stop the indexer after its request reached
the engine and before the answer reaches the indexer, with no race.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from support.indexer_zmq import BLOCK, chain, eventually, listener, query, wait_seq
from support.nats_support import NatsServer
from support.reference_server import ServerURL, free_port, running_server

from dynamo_lite.kv_publishers import EnginePublisher, WireFormat

REPLAY_TIMEOUT_SECS = 2.0
PAUSE_SECS = 2 * REPLAY_TIMEOUT_SECS + 1  # well past the replay deadline
COUNTERS = ("batches", "events", "rejected_events", "gaps", "lost_batches", "replays", "replayed_batches",
            "replay_failures", "restarts")


def indexer_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info", "--replay-timeout-secs", str(REPLAY_TIMEOUT_SECS), *extra]


@contextmanager
def indexers(count: int, tmp_path: Path | None = None) -> Iterator[list[tuple[httpx.Client, ServerURL]]]:
    """`count` indexers: one without NATS when `tmp_path` is None, else replicas of one NATS."""
    with ExitStack() as stack:
        extra: list[str] = []
        if tmp_path is not None:
            nats = NatsServer(tmp_path / "nats")
            nats.start()
            stack.callback(nats.stop)
            extra = ["--nats", nats.url]
        started = []
        for _ in range(count):
            port = free_port()
            url = stack.enter_context(running_server(indexer_argv(port, *extra), port, "/ready", timeout=60))
            started.append((stack.enter_context(httpx.Client(base_url=url, timeout=10)), url))
        yield started


def register(client: httpx.Client, engine: EnginePublisher, model: str = "m", worker: int = 7) -> None:
    response = client.post("/register", json={
        "instance_id": worker, "model_name": model, "block_size": BLOCK, "endpoint": engine.endpoint,
        "replay_endpoint": engine.replay_endpoint})
    assert response.status_code == 201, response.text


@contextmanager
def stopped(processes: list[ServerURL]) -> Iterator[None]:
    for url in processes:
        url.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for url in processes:
            url.process.send_signal(signal.SIGCONT)


def lose_three_batches_and_pause(engine: EnginePublisher, fleet: list[tuple[httpx.Client, ServerURL]],
                                 paused: int | None = None) -> None:
    """The issue's scenario: seq 1..3 dropped on the way, seq 4 shows the gap, every indexer asks
    for a replay; the engine answers while the first `paused` of them (all by default) are
    stopped, for longer than the deadline."""
    engine.publish([chain(0, 1)])
    for client, _ in fleet:
        wait_seq(client, "m", 7, 0)
    engine.hold_replays()
    engine.drop_next(3)
    for start in (1, 2, 3):
        engine.publish([chain(start, start + 1)])
    engine.publish([chain(4, 5)])
    eventually(lambda: engine.replay_requests, lambda asked: asked == len(fleet), "every indexer asking for a replay")
    with stopped([url for _, url in fleet[:paused]]):
        engine.release_replays()  # answered at once, read only after the pause
        time.sleep(PAUSE_SECS)


@pytest.mark.parametrize(("replicas", "paused"), [(0, 1), (2, 2), (2, 1)],
                         ids=["single indexer", "replicas paused together", "one replica of two paused"])
def test_a_pause_longer_than_the_replay_timeout_loses_nothing(
    context: zmq.Context, tmp_path: Path, replicas: int, paused: int
) -> None:
    with indexers(replicas or 1, tmp_path if replicas else None) as fleet, \
            EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(fleet[0][0], engine)
        engine.wait_for_subscribers(len(fleet))
        lose_three_batches_and_pause(engine, fleet, paused)
        for client, _ in fleet:
            info = wait_seq(client, "m", 7, 4)
            assert {name: info[name] for name in ("gaps", "replays", "replayed_batches", "lost_batches",
                                                  "replay_failures", "rejected_events")} == {
                "gaps": 1, "replays": 1, "replayed_batches": 3, "lost_batches": 0, "replay_failures": 0,
                "rejected_events": 0}
            assert query(client, "m")["scores"] == {"7": {"0": 5 * BLOCK}}


def test_a_paused_indexer_counts_as_lost_only_what_the_engine_no_longer_buffers(context: zmq.Context) -> None:
    # Three batches kept: by the time the engine answers, seq 1 has left its buffer.
    with indexers(1) as fleet, EnginePublisher(WireFormat.VLLM, context=context, buffer_steps=3) as engine:
        client = fleet[0][0]
        register(client, engine)
        engine.wait_for_subscribers()
        lose_three_batches_and_pause(engine, fleet)
        info = wait_seq(client, "m", 7, 4)
        # seq 2..4 are replayed or live, but their chain hangs from seq 1's block: refused.
        assert (info["replayed_batches"], info["lost_batches"], info["replay_failures"]) == (2, 1, 0)
        assert info["rejected_events"] == 3
        assert query(client, "m")["scores"] == {"7": {"0": BLOCK}}


def test_a_replay_answer_in_pieces_across_the_deadline_is_read_whole(context: zmq.Context) -> None:
    with indexers(1) as fleet, EnginePublisher(WireFormat.VLLM, context=context) as engine:
        client = fleet[0][0]
        register(client, engine)
        engine.wait_for_subscribers()
        # Six messages (four lost batches, the live one, the end marker), 0.8 s apart: the whole
        # answer takes twice the deadline, no wait between two pieces comes near it.
        engine.replay_pause_secs = 0.4 * REPLAY_TIMEOUT_SECS
        engine.publish([chain(0, 1)])
        engine.drop_next(4)
        for start in (1, 2, 3, 4, 5):
            engine.publish([chain(start, start + 1)])
        info = wait_seq(client, "m", 7, 5)
        assert (info["replays"], info["replayed_batches"], info["lost_batches"], info["replay_failures"]) == (
            1, 4, 0, 0)
        assert query(client, "m")["scores"] == {"7": {"0": 6 * BLOCK}}


def test_an_engine_silent_past_the_deadline_is_asked_again_from_the_first_missing_batch(
    context: zmq.Context
) -> None:
    with indexers(1) as fleet, EnginePublisher(WireFormat.VLLM, context=context) as engine:
        client = fleet[0][0]
        register(client, engine)
        engine.wait_for_subscribers()
        engine.publish([chain(0, 1)])
        wait_seq(client, "m", 7, 0)
        engine.hold_replays()  # busy: the first request waits past the deadline
        engine.drop_next(2)
        for start in (1, 2, 3):
            engine.publish([chain(start, start + 1)])
        eventually(lambda: engine.replay_requests, lambda asked: asked == 2, "the listener asking again")
        engine.release_replays()  # the first answer goes to a socket the listener has closed
        info = wait_seq(client, "m", 7, 3)
        assert (info["replays"], info["replayed_batches"], info["lost_batches"], info["replay_failures"]) == (
            2, 2, 0, 0)
        assert query(client, "m")["scores"] == {"7": {"0": 4 * BLOCK}}


def rejected_metrics(client: httpx.Client) -> dict[str, float]:
    wanted = ('dynamo_lite_indexer_events_total{outcome="rejected"}', "dynamo_lite_indexer_zmq_rejected_events_total")
    values = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


def test_listener_counters_are_the_same_with_and_without_nats(context: zmq.Context, tmp_path: Path) -> None:
    with indexers(1) as alone, indexers(2, tmp_path) as replicas, \
            EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(alone[0][0], engine)
        register(replicas[1][0], engine)
        engine.wait_for_subscribers(3)
        engine.publish([chain(0, 2)])
        engine.publish([chain(3, 4)])  # its parent (block 2) was never stored: refused
        engine.publish([chain(2, 3)])
        views: list[dict[str, Any]] = []
        for client, _ in alone + replicas:
            info = eventually(lambda c=client: listener(c, "m", 7),
                              lambda i: i.get("last_seq") == 2 and i.get("rejected_events") == 1,
                              "the refused store counted in /workers")
            views.append({name: info[name] for name in COUNTERS})
            assert rejected_metrics(client) == {'dynamo_lite_indexer_events_total{outcome="rejected"}': 1.0,
                                                "dynamo_lite_indexer_zmq_rejected_events_total": 1.0}
            assert query(client, "m")["scores"] == {"7": {"0": 3 * BLOCK}}
        assert views[1] == views[0] and views[2] == views[0]
