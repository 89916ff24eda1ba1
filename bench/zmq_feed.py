"""Feeding the reference indexer: one ZMQ publisher per worker, as vLLM engines do.

The project's engine publisher (`dynamo_lite.kv_publishers.EnginePublisher`, vLLM's legacy
layout, as tests/support/fake_engine.py uses it) with what a fill needs: no replay, a send queue
that never drops (the whole fill may be queued before the reference drains it), and payloads
encoded beforehand. The reference connects a SUB socket to the endpoint given in
`POST /register`; `wait_subscribed` sees that subscription arrive before anything is published
(a SUB that connects late never sees earlier messages).
"""

from __future__ import annotations

import zmq

from dynamo_lite.kv_publishers import EnginePublisher, WireFormat

TOPIC = b"kv-events"


class Publisher(EnginePublisher):
    def __init__(self, context: zmq.Context, worker_id: int) -> None:
        super().__init__(WireFormat.VLLM_LEGACY, topic=TOPIC, replay=False, context=context, send_hwm=0)
        self.worker_id = worker_id

    def wait_subscribed(self, timeout: float = 15.0) -> None:
        self.wait_for_subscribers(1, timeout)

    def send(self, payload: bytes) -> None:
        """`payload` as the next batch, `[TOPIC, seq, payload]`."""
        self.publish_raw(payload)
