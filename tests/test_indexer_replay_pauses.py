"""Replays under the faults operators meet: an indexer paused (SIGSTOP, as a debugger, memory
pressure or a VM migration stops it) between asking an engine for missed batches and reading
the answer, an answer that arrives in pieces, an engine silent past the deadline, an answer
that breaks off (asked for again from the first batch still missing), an engine whose buffer no
longer holds the batches; and the listener counters with and without `--nats`.

Real processes on loopback: `python -m dynamo_lite.indexer` (alone, or as replicas on a real
`nats-server -js`), fed by dynamo_lite.kv_publishers' vLLM 0.33 publisher with its replay
socket. `EnginePublisher.hold_replays` lets a test stop the indexer after its request reached
the engine and before the answer reaches the indexer, with no race; `replay_answer_limit` cuts
its answers short and `replay_log` records where each request started.
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

from dynamo_lite.indexer.listeners import REPLAY_ATTEMPTS, REPLAY_BACKOFF_SECS, REPLAY_WAIT_SLICE_SECS, ReplayDeadline
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
def one_indexer(context: zmq.Context, buffer_steps: int = 10_000) -> Iterator[
        tuple[httpx.Client, EnginePublisher, list[tuple[httpx.Client, ServerURL]]]]:
    """One indexer without NATS, subscribed to one vLLM 0.33 engine: its client, the engine and
    the fleet of one."""
    with indexers(1) as fleet, EnginePublisher(WireFormat.VLLM, context=context, buffer_steps=buffer_steps) as engine:
        register(fleet[0][0], engine)
        engine.wait_for_subscribers()
        yield fleet[0][0], engine, fleet


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


@pytest.mark.process
@pytest.mark.nats
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
            wait_seq(client, "m", 7, 4)
            # With replicas, `events` and `rejected_events` count when the stream's copy is applied.
            info = eventually(lambda c=client: listener(c, "m", 7), lambda i: i["events"] == 5, "5 events applied")
            assert {name: info[name] for name in COUNTERS} == {
                "batches": 5, "events": 5, "rejected_events": 0, "gaps": 1, "lost_batches": 0, "replays": 1,
                "replayed_batches": 3, "replay_failures": 0, "restarts": 0}
            assert query(client, "m")["scores"] == {"7": {"0": 5 * BLOCK}}


@pytest.mark.process
def test_a_paused_indexer_counts_as_lost_only_what_the_engine_no_longer_buffers(context: zmq.Context) -> None:
    # Three batches kept: by the time the engine answers, seq 1 has left its buffer.
    with one_indexer(context, buffer_steps=3) as (client, engine, fleet):
        lose_three_batches_and_pause(engine, fleet)
        info = wait_seq(client, "m", 7, 4)
        # seq 2..4 are replayed or live, but their chain hangs from seq 1's block: refused.
        assert (info["replayed_batches"], info["lost_batches"], info["replay_failures"]) == (2, 1, 0)
        assert info["rejected_events"] == 3
        assert query(client, "m")["scores"] == {"7": {"0": BLOCK}}


@pytest.mark.process
def test_a_replay_answer_in_pieces_across_the_deadline_is_read_whole(context: zmq.Context) -> None:
    with one_indexer(context) as (client, engine, _):
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


@pytest.mark.process
def test_an_engine_silent_past_the_deadline_is_asked_again_from_the_first_missing_batch(
    context: zmq.Context
) -> None:
    with one_indexer(context) as (client, engine, _):
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


@pytest.mark.process
def test_an_answer_that_breaks_off_is_asked_for_again_from_the_first_batch_still_missing(
    context: zmq.Context
) -> None:
    with one_indexer(context) as (client, engine, _):
        # Every answer stops after one batch, without its end marker: an engine that stalls.
        engine.replay_answer_limit = 1
        engine.publish([chain(0, 1)])
        engine.drop_next(4)
        for start in (1, 2, 3, 4, 5):
            engine.publish([chain(start, start + 1)])  # seq 5 shows the gap
        info = wait_seq(client, "m", 7, 5)
        # Each request starts after what the one before delivered; 3 requests, then seq 4,
        # the one batch no request delivered, is counted as lost (its child store refused).
        assert [start for _, start in engine.replay_log] == [1, 2, 3]
        assert (info["replays"], info["replayed_batches"], info["lost_batches"], info["replay_failures"],
                info["rejected_events"]) == (REPLAY_ATTEMPTS, 3, 1, 1, 1)
        assert query(client, "m")["scores"] == {"7": {"0": 4 * BLOCK}}
        # Asked again only once the deadline passed, with the backoff between requests.
        asked = [at for at, _ in engine.replay_log]
        assert asked[1] - asked[0] >= REPLAY_TIMEOUT_SECS + REPLAY_BACKOFF_SECS
        assert asked[2] - asked[1] >= REPLAY_TIMEOUT_SECS + 2 * REPLAY_BACKOFF_SECS


def zmq_metrics(client: httpx.Client) -> dict[str, float]:
    """Every `dynamo_lite_indexer_zmq_*` sample but the listener states."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("dynamo_lite_indexer_zmq_") and not name.startswith("dynamo_lite_indexer_zmq_listeners"):
            values[name] = float(value)
    return values


def rejected_metrics(client: httpx.Client) -> dict[str, float]:
    wanted = ('dynamo_lite_indexer_events_total{outcome="rejected"}', "dynamo_lite_indexer_zmq_rejected_events_total")
    values = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


@pytest.mark.process
@pytest.mark.nats
def test_listener_counters_are_the_same_with_and_without_nats(context: zmq.Context, tmp_path: Path) -> None:
    with indexers(1) as alone, indexers(2, tmp_path) as replicas, \
            EnginePublisher(WireFormat.VLLM, context=context) as engine:
        register(alone[0][0], engine)
        register(replicas[1][0], engine)
        engine.wait_for_subscribers(3)
        engine.publish([chain(0, 2)])
        engine.publish([chain(3, 4)])  # its parent (block 2) was never stored: refused
        engine.publish([chain(2, 3), chain(3, 4, medium="TAPE")])  # the second is ignored: unknown medium
        engine.publish_raw(b"\xc1")  # does not decode: dropped whole
        engine.drop_next(1)
        engine.publish([chain(3, 4)])  # lost, and replayed
        engine.publish([chain(4, 5)])
        views: list[dict[str, Any]] = []
        metrics: list[dict[str, float]] = []
        for client, _ in alone + replicas:
            info = eventually(lambda c=client: listener(c, "m", 7),
                              lambda i: i.get("last_seq") == 5 and i.get("rejected_events") == 1
                              and i.get("events") == 4,
                              "the refused store counted in /workers")
            views.append({name: value for name, value in info.items() if name != "last_batch_at"})
            metrics.append(zmq_metrics(client))
            assert rejected_metrics(client) == {'dynamo_lite_indexer_events_total{outcome="rejected"}': 1.0,
                                                "dynamo_lite_indexer_zmq_rejected_events_total": 1.0}
            assert query(client, "m")["scores"] == {"7": {"0": 5 * BLOCK}}
        assert {name: views[0][name] for name in COUNTERS} == {
            "batches": 5, "events": 4, "rejected_events": 1, "gaps": 1, "lost_batches": 0, "replays": 1,
            "replayed_batches": 1, "replay_failures": 0, "restarts": 0}
        assert (views[0]["ignored_events"], views[0]["decode_failures"]) == ({"unknown_medium": 1}, 1)
        assert views[1] == views[0] and views[2] == views[0]
        assert metrics[1] == metrics[0] and metrics[2] == metrics[0]


# --- the deadline's decisions (ReplayDeadline, the pure part of a replay request) -------------


def waited_out(deadline: ReplayDeadline) -> int:
    """Wait slice after slice, nothing arriving, until the deadline gives up; how many slices."""
    slices = 0
    while (wait := deadline.next_wait(answer_waiting=False)) is not None:
        assert 0 < wait <= REPLAY_WAIT_SLICE_SECS
        deadline.waited(wait, wait)
        slices += 1
    return slices


@pytest.mark.unit
def test_an_answer_waiting_is_read_even_past_the_deadline() -> None:
    deadline = ReplayDeadline(REPLAY_TIMEOUT_SECS)
    waited_out(deadline)
    assert deadline.next_wait(answer_waiting=False) is None
    assert deadline.next_wait(answer_waiting=True) == 0.0


@pytest.mark.unit
def test_the_replay_deadline_runs_from_the_last_answer() -> None:
    deadline = ReplayDeadline(REPLAY_TIMEOUT_SECS)
    deadline.waited(REPLAY_WAIT_SLICE_SECS, REPLAY_WAIT_SLICE_SECS)
    deadline.answered()
    assert waited_out(deadline) == round(REPLAY_TIMEOUT_SECS / REPLAY_WAIT_SLICE_SECS)


@pytest.mark.unit
def test_a_process_stopped_in_a_wait_keeps_its_deadline() -> None:
    deadline = ReplayDeadline(REPLAY_TIMEOUT_SECS)
    wait = deadline.next_wait(answer_waiting=False)
    assert wait is not None
    deadline.waited(wait, PAUSE_SECS)  # SIGSTOP for longer than the whole deadline
    assert deadline.quiet_secs == wait
    assert deadline.next_wait(answer_waiting=False) is not None
