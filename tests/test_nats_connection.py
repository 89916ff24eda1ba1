"""The NATS connection helpers against a real `nats-server`: a flush that times out (the server,
or this process, paused longer than its timeout) must leave the connection reading. With
nats-py's own `Client.flush`, the PONG that arrives after the timeout ends the client's read
loop: the connection still says connected and nothing arrives on it again."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from nats.errors import FlushTimeoutError
from support.nats_support import NatsServer

from dynamo_lite.durability.nats_connection import connect, flush

pytestmark = [pytest.mark.process, pytest.mark.nats]


async def _until_stopped(pid: int) -> None:
    """SIGSTOP takes effect as each of the process's threads next enters the kernel: a thread
    running on the other CPU could still answer a PING sent right after `kill` returns."""
    for _ in range(200):
        if all(_state(task) == "T" for task in Path(f"/proc/{pid}/task").iterdir()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("nats-server did not stop within 2 s")


def _state(task: Path) -> str:
    return (task / "stat").read_text().rpartition(")")[2].split()[0]


def test_a_flush_that_times_out_leaves_the_connection_reading(nats_server: NatsServer) -> None:
    assert nats_server.process is not None
    pid = nats_server.process.pid

    async def scenario() -> list[bytes]:
        listener, _ = await connect(nats_server.url, name="listener")
        talker, _ = await connect(nats_server.url, name="talker")
        arrived: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_message(msg: object) -> None:
            await arrived.put(msg.data)  # type: ignore[attr-defined]

        try:
            await listener.subscribe("flush.test", cb=on_message)
            await flush(listener, 5.0)
            os.kill(pid, signal.SIGSTOP)  # the PONG of the next flush comes late
            try:
                await _until_stopped(pid)
                with pytest.raises(FlushTimeoutError):
                    await flush(listener, 0.3)
            finally:
                os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.3)  # the late PONG reaches the listener
            for n in range(3):
                await talker.publish("flush.test", b"after %d" % n)
            await flush(talker, 5.0)
            received = [await asyncio.wait_for(arrived.get(), 5.0) for _ in range(3)]
            await flush(listener, 5.0)  # and its own flushes still get their PONGs
            return received
        finally:
            await listener.close()
            await talker.close()

    assert asyncio.run(scenario()) == [b"after 0", b"after 1", b"after 2"]
