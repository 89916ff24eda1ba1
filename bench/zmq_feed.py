"""Feeding the reference indexer: one ZMQ XPUB socket per worker, as vLLM engines do.

The reference connects a SUB socket to the endpoint given in `POST /register`; XPUB with
`XPUB_VERBOSE` lets us see that subscription arrive before publishing (a SUB that connects
late never sees earlier messages). Frames are `[topic, seq (u64 big-endian), payload]`, as in
tests/support/fake_engine.py.
"""

from __future__ import annotations

import struct
import time

import zmq

TOPIC = b"kv-events"


class Publisher:
    def __init__(self, context: zmq.Context, worker_id: int) -> None:
        self.worker_id = worker_id
        self._socket = context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        # Never drop: the whole fill may be queued before the reference drains it.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._seq = 0

    def wait_subscribed(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._socket.poll(200, zmq.POLLIN) and self._socket.recv()[:1] == b"\x01":
                return
        raise TimeoutError(f"nobody subscribed to {self.endpoint} within {timeout:.0f} s")

    def send(self, payload: bytes) -> None:
        self._socket.send_multipart([TOPIC, struct.pack(">Q", self._seq), payload])
        self._seq += 1

    def close(self) -> None:
        self._socket.close(0)
