"""Indexers side by side (ours and the reference): starting them, feeding them the same fake
engines' events, comparing their answers."""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import zmq

from support.fake_engine import FakeEngine, Query, Workload, dump_facts
from support.reference_server import free_port

BARRIER_TIMEOUT = 15.0
MAX_REPORTED = 5


@dataclass
class Service:
    name: str
    url: str
    client: httpx.Client
    reference: bool

    def tenant_field(self, rng: random.Random) -> str:
        # The reference's partition key is routing_group; ours is tenant_id, with routing_group
        # accepted as an alias.
        return "routing_group" if self.reference else rng.choice(["tenant_id", "routing_group"])


def reference_argv(python: Any, port: int, *extra: str) -> list[str]:
    return [str(python), "-m", "dynamo.indexer", "--port", str(port), *extra]


def ours_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *extra]


def distinct_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def post(service: Service, path: str, body: Any, expect: int | None = 200) -> httpx.Response:
    response = service.client.post(path, json=body)
    if expect is not None:
        assert response.status_code == expect, f"{service.name}: POST {path} {body} -> {response.status_code} {response.text}"
    return response


def register(service: Service, engine: FakeEngine, *, subscribe: bool = False) -> None:
    """Register `engine` with `service`: the reference always subscribes to its socket; ours
    does when `subscribe`, and is otherwise fed over POST /events (`feed_ours`)."""
    body = engine.reference_registration() if service.reference else engine.our_registration(subscribe=subscribe)
    post(service, "/register", body, 201)


def feed_ours(service: Service, workload: Workload, subscribed: bool = False) -> dict[str, Any] | None:
    """POST the events published since the last call; every one must be applied. Nothing to
    do (but forget them) when ours subscribed to the engines itself."""
    document = workload.router_events_document()
    if subscribed:
        return None
    report = post(service, "/events", document).json()
    assert report["rejected"] == 0 and report["skipped"] == 0 and report["gap_count"] == 0, report
    return report


def describe_facts_diff(got: dict[str, set], expected: dict[str, set], limit: int = 8) -> str:
    lines = []
    for key in sorted(expected.keys() | got.keys()):
        missing = sorted(expected.get(key, set()) - got.get(key, set()), key=repr)
        extra = sorted(got.get(key, set()) - expected.get(key, set()), key=repr)
        if missing or extra:
            lines.append(f"  {key}: {len(missing)} missing, {len(extra)} unexpected "
                         "(worker, dp_rank, tier, parent, block_hash, tokens_hash)")
            lines += [f"    missing    {fact}" for fact in missing[:limit]]
            lines += [f"    unexpected {fact}" for fact in extra[:limit]]
    return "\n".join(lines)


def wait_for_facts(service: Service, expected: dict[str, set], timeout: float = BARRIER_TIMEOUT) -> None:
    """Poll `/dump` until its normalised content equals `expected` (the reference applies ZMQ
    events asynchronously); fail with the difference after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        document = service.client.get("/dump").json()
        got = dump_facts(document, expected.keys())
        absent = sorted(expected.keys() - document.keys())  # a partition is dumped even when empty
        if got == expected and not absent:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{service.name}: /dump never reached the expected state within {timeout:.0f} s:\n"
                        + (f"  partitions not in the dump: {absent}\n" if absent else "")
                        + describe_facts_diff(got, expected), pytrace=False)
        time.sleep(0.05)


@dataclass
class Mismatches:
    """Differences found while comparing, reported together at the end of a test."""

    items: list[str] = field(default_factory=list)
    count: int = 0

    def add(self, text: str) -> None:
        self.count += 1
        if len(self.items) < MAX_REPORTED:
            self.items.append(text)

    def check(self, what: str) -> None:
        if self.count:
            pytest.fail(f"{self.count} mismatches {what}; the first {len(self.items)}:\n\n" + "\n\n".join(self.items),
                        pytrace=False)


def shortened(value: Any, limit: int = 1500) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Coverage:
    """What the compared answers exercised, so a silently trivial run shows."""

    queries: int = 0
    device_hits: int = 0  # some worker scored
    several_workers: int = 0  # more than one instance scored
    partial: int = 0  # instances scored differently
    host_extends: int = 0  # cpu > gpu for some instance
    disk_extends: int = 0  # disk > cpu for some instance
    lower_only: int = 0  # an instance with gpu 0 but cpu/disk > 0
    two_ranks: int = 0  # an instance with two dp ranks in its answer

    def note(self, answer: dict[str, Any]) -> None:
        self.queries += 1
        scores, instances = answer["scores"], answer["instances"]
        self.device_hits += bool(scores)
        self.several_workers += len(scores) > 1
        self.partial += len({v for ranks in scores.values() for v in ranks.values()}) > 1
        self.host_extends += any(i["cpu"] > i["gpu"] for i in instances.values())
        self.disk_extends += any(i["disk"] > i["cpu"] for i in instances.values())
        self.lower_only += any(i["gpu"] == 0 for i in instances.values())
        self.two_ranks += any(len(i["dp"]) > 1 for i in instances.values())


def compare_queries(
    services: list[Service], queries: list[Query], workload: Workload, mismatches: Mismatches, where: str,
    rng: random.Random, coverage: Coverage | None = None,
) -> int:
    """Send every query to every service; the responses must be equal. Returns the count sent."""
    for query in queries:
        answers = {}
        for service in services:
            body = query.body(service.tenant_field(rng))
            response = service.client.post(query.path, json=body)
            answers[service.name] = (response.status_code, response.json() if response.status_code == 200 else response.text)
        status, first = next(iter(answers.values()))
        if coverage is not None and status == 200:
            coverage.note(first)
        if len({json.dumps(a, sort_keys=True) for a in answers.values()}) > 1:
            size = workload.partitions[query.key].block_size
            model = workload.expected_answer(query.key, query.local_hashes(size))
            lines = [f"{where}: POST {query.path} {shortened(query.body('routing_group'))}"]
            lines.append(f"    local hashes: {query.local_hashes(size)}")
            lines += [f"    {name}: {status} {shortened(answer)}" for name, (status, answer) in answers.items()]
            lines.append(f"    clean-domain model: {shortened(model)}")
            mismatches.add("\n".join(lines))
    return len(queries)


def make_engines(seed: int, context: zmq.Context, *, colon_in_model: bool = True) -> list[FakeEngine]:
    """Partition A (block size 16): workers 1, 2 (vLLM 0.33's map events), 3 (nil batch dp
    rank), 4 with dp ranks 0 and 1, each rank on its own socket. Partition B (block size 4, routing group "tenant-b",
    a model name with a colon unless `colon_in_model` is False): worker 10 (map events) and a
    worker id near the top of the u64 range."""
    base = seed * 1000
    a = dict(model_name=f"llama-{seed}", block_size=16, context=context)
    b = dict(model_name=f"qwen/{seed}{':8b' if colon_in_model else '-8b'}", tenant_id="tenant-b", block_size=4,
             context=context)
    return [
        FakeEngine(base + 1, **a),
        FakeEngine(base + 2, map_events=True, **a),  # vLLM 0.33's layout
        FakeEngine(base + 3, batch_dp_rank=False, **a),
        FakeEngine(base + 4, 0, **a),
        FakeEngine(base + 4, 1, **a),
        FakeEngine(base + 10, map_events=True, **b),
        FakeEngine(2**64 - 1 - seed, **b),
    ]
