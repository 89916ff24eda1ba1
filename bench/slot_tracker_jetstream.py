"""Issue 29's replication decision: slot tracker writes replicated as today (`--nats`: a
reliable broadcast over NATS core, `replication.Replica` + `nats_replica.NatsReplication`) against
a prototype that publishes the same ops to a JetStream stream (one ordered log, as the indexer
does) and applies them on the other replica from a pull consumer. Prints numbers; never passes
or fails.

    .venv/bin/python -m bench.slot_tracker_jetstream            # about 1 minute
    .venv/bin/python -m bench.slot_tracker_jetstream --seconds 3 --rounds 1

Both designs are driven in-process, without HTTP (what differs between them is the replication,
not the routes): replica A (CPU 0) runs `LANES` concurrent lifecycles (`/add` of 256 hashes,
`/prefill_complete`, `/free`), each write applied to A's `SlotTracker` and answered once the NATS
server has it (today: a PING after the batch, answered; the prototype: JetStream's PubAck);
replica B (CPU 1, with nats-server) applies what A published. Measured:

* write latency: the write's call -> its answer on A (p50/p99), and throughput (writes/s);
* replication latency of each add: its answer on A -> applied to B's tracker (p50/p99; the two
  processes read the same monotonic clock).

The prototype stays here (not adopted: see docs/replicas.md). It publishes A's outbox as one
message per batch (as today), pipelined: each published with a reply subject of its own, the
answers waiting for its PubAck; B pulls with the indexer's `pull.Puller` (one pull request of up
to 512 messages at a time) and applies each op to its tracker in stream order.
Configurations alternate over `--rounds`; each row is the median of its rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from dynamo_lite.indexer.nats_replica import APPLY_SLICE_SECS, FETCH_BATCH, FETCH_TIMEOUT_SECS
from dynamo_lite.indexer.pull import Puller
from dynamo_lite.slot_tracker.core import SlotTracker
from dynamo_lite.slot_tracker.nats_replica import NatsReplication, NatsSettings
from dynamo_lite.slot_tracker.replication import Add, Batch, Free, Op, PrefillComplete, Replica, Tag

from .seed import hash_lists, shape_for

MODEL = "lifecycle"
TENANT = "default"
LANES = 64
A_CPU, B_CPU = 0, 1


def _pin(cpu: int) -> None:
    try:
        os.sched_setaffinity(0, {cpu})
    except (OSError, AttributeError):
        pass


def _tracker() -> SlotTracker:
    tracker = SlotTracker()
    shape = shape_for(MODEL, 16)
    for worker in range(1, shape.workers + 1):
        tracker.register(worker, MODEL, TENANT, 16, 0, shape.dp_size)
    return tracker


def _percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the writer (replica A) ----------------------------------------------------------------------


async def _drive(write: Callable[[str, str, int, int], Any], seconds: float) -> tuple[list[float], dict[str, float]]:
    """`LANES` lifecycles at a time for `seconds`; returns each write's latency and the time
    each add was called (by request id)."""
    shape = shape_for(MODEL, 16)
    latencies: list[float] = []
    answered: dict[str, float] = {}
    end = time.perf_counter() + seconds

    async def lane(number: int) -> None:
        step = 0
        while time.perf_counter() < end:
            request_id = f"r{number}-{step}"
            slot = (number + step) % shape.ranks
            for kind in ("add", "prefill", "free"):
                started = time.perf_counter()
                answer = write(kind, request_id, slot, number + step)
                if answer is not None:
                    await answer
                done = time.perf_counter()
                latencies.append(done - started)
                if kind == "add":
                    answered[request_id] = started
            step += 1

    await asyncio.gather(*(lane(number) for number in range(LANES)))
    return latencies, answered


def _hashes() -> list[list[int]]:
    return hash_lists(64, seed=2)


def writer_today(url: str, prefix: str, seconds: float, pipe: Connection) -> None:
    _pin(A_CPU)

    async def main() -> None:
        lists = _hashes()
        shape = shape_for(MODEL, 16)
        replica = Replica(_tracker())
        sync = NatsReplication(replica, NatsSettings(url, subject_prefix=prefix, join_timeout_secs=0.3))
        await sync.start()

        def write(kind: str, request_id: str, slot: int, index: int) -> Any:
            if kind == "add":
                replica.add(MODEL, TENANT, request_id, slot % shape.workers + 1, slot // shape.workers,
                            lists[index % len(lists)], 4096)
            elif kind == "prefill":
                replica.prefill_complete(MODEL, TENANT, request_id)
            else:
                replica.free(MODEL, TENANT, request_id)
            answer = sync.confirmed(200, None)
            return None if isinstance(answer, tuple) else answer

        pipe.send("ready")
        pipe.recv()
        latencies, answered = await _drive(write, seconds)
        await sync.stop()
        pipe.send((latencies, answered))

    asyncio.run(main())


class _StreamPublisher:
    """The prototype's publishing side: A's outbox, one JetStream message per batch."""

    def __init__(self, client: Any, subject: str, origin: int) -> None:
        self.client = client
        self.subject = subject
        self.origin = origin
        self.outbox: list[Op] = []
        self.waiting: list[asyncio.Future[None]] = []
        self.acks: dict[str, asyncio.Future[None]] = {}
        self.inbox = client.new_inbox()
        self.wake = asyncio.Event()
        self.number = 0

    async def start(self) -> None:
        await self.client.subscribe(f"{self.inbox}.*", cb=self._on_ack)

    async def _on_ack(self, message: Any) -> None:
        waiter = self.acks.pop(message.subject, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def queue(self, op: Op) -> asyncio.Future[None]:
        self.outbox.append(op)
        self.wake.set()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        return waiter

    async def run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            await self.wake.wait()
            self.wake.clear()
            ops, self.outbox = self.outbox, []
            waiting, self.waiting = self.waiting, []
            if not ops:
                continue
            self.number += 1
            reply = f"{self.inbox}.{self.number}"
            ack = self.acks[reply] = asyncio.get_running_loop().create_future()
            await self.client.publish(self.subject, encoder.encode(Batch(self.origin, 0, time.time(), ops)),
                                      reply=reply)
            ack.add_done_callback(lambda _, waiting=waiting: [w.set_result(None) for w in waiting if not w.done()])


def writer_stream(url: str, stream: str, seconds: float, pipe: Connection) -> None:
    """Applied on A when taken, then published (answered on the PubAck)."""
    _stream_writer(url, stream, seconds, pipe, from_stream=False)


def writer_from_stream(url: str, stream: str, seconds: float, pipe: Connection) -> None:
    """Published, then applied on A from its own consumer, in stream order, as every replica
    does (the indexer's design: answered once A applied it)."""
    _stream_writer(url, stream, seconds, pipe, from_stream=True)


def _stream_writer(url: str, stream: str, seconds: float, pipe: Connection, *, from_stream: bool) -> None:
    _pin(A_CPU)

    async def main() -> None:
        import nats

        lists = _hashes()
        shape = shape_for(MODEL, 16)
        tracker = _tracker()
        client = await nats.connect(url)
        publisher = _StreamPublisher(client, f"{stream}.ops", 1)
        await publisher.start()
        task = asyncio.create_task(publisher.run())
        target = Tag(1, 0)
        waiters: dict[tuple[type, str], asyncio.Future[None]] = {}
        consumer = None
        if from_stream:
            def apply(op: Op) -> None:
                _apply_op(tracker, op)
                waiter = waiters.pop((type(op), op.request_id), None)  # type: ignore[union-attr]
                if waiter is not None:
                    waiter.set_result(None)

            consumer = await _consume(client, stream, "a", apply)

        def write(kind: str, request_id: str, slot: int, index: int) -> Any:
            if kind == "add":
                hashes = lists[index % len(lists)]
                op: Op = Add(MODEL, TENANT, request_id, slot % shape.workers + 1, slot // shape.workers, hashes, 4096)
            elif kind == "prefill":
                op = PrefillComplete(MODEL, TENANT, request_id, target)
            else:
                op = Free(MODEL, TENANT, request_id, target)
            if not from_stream:
                _apply_op(tracker, op)
                return publisher.queue(op)
            publisher.queue(op)
            waiter = waiters[(type(op), request_id)] = asyncio.get_running_loop().create_future()
            return waiter

        pipe.send("ready")
        pipe.recv()
        latencies, answered = await _drive(write, seconds)
        task.cancel()
        if consumer is not None:
            consumer.cancel()
        await client.drain()
        pipe.send((latencies, answered))

    asyncio.run(main())


# --- the follower (replica B) ---------------------------------------------------------------------


def follower_today(url: str, prefix: str, pipe: Connection) -> None:
    _pin(B_CPU)

    async def main() -> None:
        tracker = _tracker()
        applied: dict[str, float] = {}
        add = tracker.add

        def recording_add(model_name: str, tenant_id: str, request_id: str, *args: Any) -> None:
            add(model_name, tenant_id, request_id, *args)
            applied[request_id] = time.perf_counter()

        tracker.add = recording_add  # type: ignore[method-assign]
        sync = NatsReplication(Replica(tracker), NatsSettings(url, subject_prefix=prefix, join_timeout_secs=0.3))
        await sync.start()
        pipe.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        await sync.stop()
        pipe.send(applied)

    asyncio.run(main())


async def _consume(client: Any, stream: str, durable: str, apply: Callable[[Op], None]) -> asyncio.Task[None]:
    """Create `stream` if needed and a consumer `durable` from its next message; pull forever
    with the indexer's `Puller`, handing each op to `apply`."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

    js = client.jetstream()
    try:
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], storage=StorageType.FILE))
    except Exception:  # noqa: BLE001 - the other replica created it first
        pass
    await js.add_consumer(stream, ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.NEW,
                                                 ack_policy=AckPolicy.ALL, max_ack_pending=-1))
    decoder = msgspec.msgpack.Decoder(Batch)

    def apply_message(message: Any) -> None:
        for op in decoder.decode(message.data).ops:
            apply(op)

    puller = Puller(client, stream, durable, apply_message, batch=FETCH_BATCH, expires_secs=FETCH_TIMEOUT_SECS,
                    slice_secs=APPLY_SLICE_SECS)
    await puller.subscribe()

    async def pull_forever() -> None:
        while True:
            await puller.pull()

    return asyncio.create_task(pull_forever())


def _apply_op(tracker: SlotTracker, op: Op) -> None:
    kind = type(op)
    if kind is Add:
        tracker.add(op.model_name, op.tenant_id, op.request_id, op.worker_id, op.dp_rank,  # type: ignore[union-attr]
                    op.sequence_hashes, op.new_isl_tokens)  # type: ignore[union-attr]
    elif kind is PrefillComplete:
        tracker.prefill_complete(op.model_name, op.tenant_id, op.request_id)  # type: ignore[union-attr]
    elif kind is Free:
        tracker.free(op.model_name, op.tenant_id, op.request_id)  # type: ignore[union-attr]


def follower_stream(url: str, stream: str, pipe: Connection) -> None:
    _pin(B_CPU)

    async def main() -> None:
        import nats

        tracker = _tracker()
        applied: dict[str, float] = {}

        def apply(op: Op) -> None:
            _apply_op(tracker, op)
            if type(op) is Add:
                applied[op.request_id] = time.perf_counter()  # type: ignore[union-attr]

        client = await nats.connect(url)
        task = await _consume(client, stream, "b", apply)
        pipe.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        task.cancel()
        await client.drain()
        pipe.send(applied)

    asyncio.run(main())


# --- running it -----------------------------------------------------------------------------------


def run_pair(writer: Callable[..., None], follower: Callable[..., None], url: str, name: str,
             seconds: float) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    to_b, b_end = context.Pipe()
    to_a, a_end = context.Pipe()
    b = context.Process(target=follower, args=(url, name, b_end))
    b.start()
    assert to_b.recv() == "ready"
    a = context.Process(target=writer, args=(url, name, seconds, a_end))
    a.start()
    assert to_a.recv() == "ready"
    to_a.send("go")
    latencies, answered = to_a.recv()
    a.join(30)
    time.sleep(1.0)  # B applies what is still on its way
    to_b.send("stop")
    applied = to_b.recv()
    b.join(30)
    lags = [applied[request_id] - at for request_id, at in answered.items() if request_id in applied]
    return {
        "writes_per_s": len(latencies) / seconds,
        "p50_ms": 1000 * _percentile(latencies, 0.5),
        "p99_ms": 1000 * _percentile(latencies, 0.99),
        "b_p50_ms": 1000 * _percentile(lags, 0.5),
        "b_p99_ms": 1000 * _percentile(lags, 0.99),
        "missing_on_b": len(answered) - len(lags),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slot_tracker_jetstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each design, alternating")
    args = parser.parse_args(argv)
    binary = shutil.which("nats-server")
    if binary is None:
        raise SystemExit("nats-server is not installed")
    import socket

    with tempfile.TemporaryDirectory(prefix="bench_st_js_") as scratch:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = subprocess.Popen(["taskset", "-c", str(B_CPU), binary, "-js", "-sd", scratch, "-a", "127.0.0.1",
                                   "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"nats://127.0.0.1:{port}"
            deadline = time.monotonic() + 10
            while True:
                with socket.socket() as sock:
                    if sock.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit("nats-server did not start")
                time.sleep(0.05)
            designs = {"today: NATS core broadcast (Replica)": (writer_today, follower_today, "bench_today"),
                       "JetStream, applied on A then published": (writer_stream, follower_stream, "BENCH_ST"),
                       "JetStream, A applies from the stream": (writer_from_stream, follower_stream, "BENCH_ST_LOG")}
            runs: dict[str, list[dict[str, float]]] = {label: [] for label in designs}
            for round_number in range(args.rounds):
                for label, (writer, follower, name) in designs.items():
                    result = run_pair(writer, follower, url, f"{name}{round_number}", args.seconds)
                    runs[label].append(result)
                    print(f"{label:<44} {result['writes_per_s']:>8,.0f} writes/s  answer p50 {result['p50_ms']:6.2f} "
                          f"p99 {result['p99_ms']:6.2f} ms  applied on B p50 {result['b_p50_ms']:6.2f} "
                          f"p99 {result['b_p99_ms']:6.2f} ms", flush=True)
        finally:
            server.terminate()
            server.wait(10)
    keys = ("writes_per_s", "p50_ms", "p99_ms", "b_p50_ms", "b_p99_ms")
    medians = {label: {key: statistics.median(run[key] for run in results) for key in keys}
               for label, results in runs.items()}
    print(f"\nslot tracker writes, {LANES} lifecycles at a time (add of 256 hashes, prefill_complete, free), "
          f"two replicas, {args.seconds:g} s runs, median of {args.rounds}")
    print("| design | writes/s | answer p50 ms | answer p99 ms | applied on B p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for label, row in medians.items():
        print(f"| {label} | {row['writes_per_s']:,.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | "
              f"{row['b_p50_ms']:.2f} | {row['b_p99_ms']:.2f} |")
    today, *streams = medians.items()
    for label, row in streams:
        print(f"{label} / today: throughput {row['writes_per_s'] / today[1]['writes_per_s']:.2f}x, "
              f"answer p50 {row['p50_ms'] / today[1]['p50_ms']:.2f}x, p99 {row['p99_ms'] / today[1]['p99_ms']:.2f}x, "
              f"applied on B p50 {row['b_p50_ms'] / today[1]['b_p50_ms']:.2f}x, "
              f"p99 {row['b_p99_ms'] / today[1]['b_p99_ms']:.2f}x")


if __name__ == "__main__":
    main()
