"""Prefill/decode disaggregation on loopback: engine stand-ins with vLLM's NixlConnector
(`--kv-transfer-config`), their `/metrics` and the KV events a decode engine published (read
back from its replay socket, so no subscription can miss them)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import zmq

from dynamo_lite.kv_publishers import END_SEQ
from support.reference_server import ServerURL, free_port, running_service

BLOCK = 16
SPEEDUP = "50"


def kv_transfer_config(engine_id: str, role: str = "kv_both") -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id})


@contextlib.contextmanager
def pd_engine(engine_id: str, *flags: str, events: bool = False) -> Iterator[tuple[ServerURL, str | None]]:
    """A stand-in with the NixlConnector, fast (speedup 50); with `events`, its KV events
    publisher and replay socket on free loopback ports. Yields its URL and replay endpoint."""
    argv = ["--speedup-ratio", SPEEDUP, "--block-size", str(BLOCK), "--kv-transfer-config",
            kv_transfer_config(engine_id), *flags]
    replay = None
    if events:
        replay = f"tcp://127.0.0.1:{free_port()}"
        argv += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                                   "replay_endpoint": replay})]
    else:
        argv += ["--kv-events-config", '{"enable_kv_cache_events": false}']
    with running_service("mock_engine", *argv) as url:
        yield url, replay


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples (those with `labels`) in `url`'s /metrics; 0 when absent."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric_name, _, label_text = sample.partition("{")
        if metric_name != name:
            continue
        if all(f'{key}="{wanted}"' in label_text for key, wanted in labels.items()):
            total += float(value)
    return total


def published_batches(replay_endpoint: str, timeout_ms: int = 3000) -> list[list[dict[str, Any]]]:
    """Every batch of KV events the engine published so far (its replay answer from seq 0),
    each a list of vLLM's events as decoded maps."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    batches = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(timeout_ms), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                return batches
            _, events, _ = msgspec.msgpack.decode(frames[-1])
            batches.append(events)
    finally:
        dealer.close()


def stored_tokens(replay_endpoint: str) -> list[int]:
    """The token ids of every block the engine announced as stored, in publishing order."""
    tokens: list[int] = []
    for batch in published_batches(replay_endpoint):
        for event in batch:
            if event["type"] == "BlockStored":
                tokens.extend(event["token_ids"])
    return tokens


def prefill_params() -> dict[str, Any]:
    """What a P/D proxy sends a prefill engine (llm-d's routing sidecar's NIXL v2 protocol)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
