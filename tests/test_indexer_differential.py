"""Differential tests: our indexer against Dynamo 1.6.1's (`python -m dynamo.indexer`).

Three services run as subprocesses on loopback: the reference with `--threads 1`, the reference
with its default `--threads 4`, and ours. Fake vLLM-style engines (tests/support/fake_engine.py) publish
one seeded, realistic event stream over ZMQ, to which both references subscribe after their
`POST /register`; ours is registered the same way and gets the very same events as RouterEvents
over `POST /events`.

The stream stays in the clean domain, where our answers must equal the
reference's exactly: shared system prompts plus unique suffixes and multi-turn continuations,
external hashes chained from the prefix (the same on every worker), decode-style extensions,
tail-first evictions (any order inside one event), CPU offload of evicted runs whose parent is a
device block of the same worker and CPU -> DISK demotion, occasional AllBlocksCleared,
LoRA (positional form) and cache-salt (map form) chains, hashes sometimes sent as i64.

The reference applies ZMQ events asynchronously and has no barrier: after each round the test
polls each reference's `/dump` until its normalised content (the set of (worker, dp_rank, tier,
parent, block hash, tokens hash)) equals what the workload's model expects, and checks ours'
dump the same way. Then many `/query_by_hash` and `/query` requests go to all three services and
the whole responses (`scores`, `frequencies`, `instances`; JSON objects, so key order is
ignored) must be equal; the model's prediction is shown next to any difference.

Knobs: DYNAMO_LITE_INDEXER_DIFF_SEEDS (comma list, default 1,2,3), DYNAMO_LITE_INDEXER_DIFF_QUERIES
(queries per partition per round, default 120). The reference venv is created on first use (see
reference_server.py); without it these tests skip loudly, or fail when
DYNAMO_LITE_REQUIRE_REFERENCE=1.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import zmq
from support.fake_engine import GROW, SHRINK, FakeEngine, Query, Workload, dump_facts
from support.reference_server import free_port, require_reference_or_skip, running_server

pytestmark = pytest.mark.reference

SEEDS = [int(s) for s in os.environ.get("DYNAMO_LITE_INDEXER_DIFF_SEEDS", "1,2,3").split(",") if s.strip()]
QUERIES = int(os.environ.get("DYNAMO_LITE_INDEXER_DIFF_QUERIES", "120"))
BARRIER_TIMEOUT = 15.0
MAX_REPORTED = 5


# --------------------------------------------------------------------------------------------
# Services
# --------------------------------------------------------------------------------------------


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


@dataclass
class Services:
    references: list[Service]
    ours: Service

    @property
    def all(self) -> list[Service]:
        return [*self.references, self.ours]


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


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    python = require_reference_or_skip()
    p1, p4, po = distinct_ports(3)
    with running_server(reference_argv(python, p1, "--threads", "1"), p1) as ref1, \
            running_server(reference_argv(python, p4, "--threads", "4"), p4) as ref4, \
            running_server(ours_argv(po), po) as ours, \
            httpx.Client(base_url=ref1, timeout=30) as c1, \
            httpx.Client(base_url=ref4, timeout=30) as c4, \
            httpx.Client(base_url=ours, timeout=30) as co:
        yield Services(
            [Service("reference --threads 1", ref1, c1, True), Service("reference --threads 4", ref4, c4, True)],
            Service("ours", ours, co, False),
        )


# --------------------------------------------------------------------------------------------
# Helpers shared with test_indexer_recovery.py
# --------------------------------------------------------------------------------------------


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


def unregister(service: Service, engine: FakeEngine) -> None:
    field_name = "routing_group" if service.reference else "tenant_id"
    post(service, "/unregister", {"instance_id": engine.worker_id, "model_name": engine.model_name,
                                  field_name: engine.tenant_id, "dp_rank": engine.dp_rank})


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


def _short(value: Any, limit: int = 1500) -> str:
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
            lines = [f"{where}: POST {query.path} {_short(query.body('routing_group'))}"]
            lines.append(f"    local hashes: {query.local_hashes(size)}")
            lines += [f"    {name}: {status} {_short(answer)}" for name, (status, answer) in answers.items()]
            lines.append(f"    clean-domain model: {_short(model)}")
            mismatches.add("\n".join(lines))
    return len(queries)


def compare_with_model(service: Service, queries: list[Query], workload: Workload, mismatches: Mismatches,
                       where: str) -> None:
    for query in queries:
        size = workload.partitions[query.key].block_size
        expected = workload.expected_answer(query.key, query.local_hashes(size))
        response = service.client.post(query.path, json=query.body("tenant_id" if not service.reference else "routing_group"))
        if response.status_code != 200 or response.json() != expected:
            mismatches.add(f"{where}: POST {query.path} {_short(query.body('tenant_id'))}\n"
                           f"    {service.name}: {response.status_code} {_short(response.text)}\n"
                           f"    model: {_short(expected)}")


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


# --------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------

# (label, weights, operations, engines to clear afterwards)
PLAN = [
    ("store", GROW, 150, 0),
    ("evict", SHRINK, 80, 0),
    ("store", GROW, 150, 0),
    ("evict+clear", SHRINK, 100, 1),
    ("store", GROW, 120, 0),
    ("evict", SHRINK, 100, 0),
]


FEEDS = ["events", "zmq"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("feed", FEEDS)
def test_random_event_stream_answers_like_the_reference(services: Services, feed: str, seed: int) -> None:
    """`feed` "events": ours gets every batch as RouterEvents over POST /events (a batch's
    events share its seq as event_id); "zmq": ours subscribes to the same engine sockets as
    the references, and all three decode the same bytes."""
    rng = random.Random(seed)
    subscribe = feed == "zmq"
    context = zmq.Context()
    engines = make_engines(seed, context)
    registered: list[tuple[Service, FakeEngine]] = []
    mismatches, model_mismatches = Mismatches(), Mismatches()
    sent = 0
    coverage = Coverage()
    try:
        workload = Workload(rng, engines)
        for engine in engines:
            for service in services.all:
                register(service, engine, subscribe=subscribe)
                registered.append((service, engine))
        for engine in engines:
            engine.wait_for_subscribers(len(services.references) + subscribe)
        for number, (label, weights, ops, clears) in enumerate(PLAN):
            workload.run(ops, weights)
            for engine in rng.sample(workload.engines, clears):
                workload.clear(engine)
            feed_ours(services.ours, workload, subscribe)
            expected = workload.expected_facts()
            for service in services.all:
                wait_for_facts(service, expected)
            where = f"{feed} seed {seed} round {number} ({label})"
            for key in workload.partitions:
                queries = workload.sample_queries(key, QUERIES)
                sent += compare_queries(services.all, queries, workload, mismatches, where, rng, coverage)
                compare_with_model(services.ours, queries[: QUERIES // 4], workload, model_mismatches, where)

        # Unregistering one rank drops its blocks everywhere.
        victim = next(e for e in workload.engines if e.dp_rank == 1)
        for service in services.all:
            unregister(service, victim)
            registered.remove((service, victim))
        workload.drop(victim)
        expected = workload.expected_facts()
        for service in services.all:
            wait_for_facts(service, expected)
        for key in workload.partitions:
            queries = workload.sample_queries(key, QUERIES // 2)
            sent += compare_queries(services.all, queries, workload, mismatches,
                                    f"seed {seed} after unregistering {victim.worker_id}/1", rng, coverage)
        # A partition all of whose workers cleared stays: dumped with no events, answering 200.
        emptied = workload.engines[-1]
        key = f"{emptied.model_name}:{emptied.tenant_id}"
        for engine in list(workload.partitions[key].engines):
            workload.clear(engine)
        feed_ours(services.ours, workload, subscribe)
        expected = workload.expected_facts()
        assert not expected[key]
        for service in services.all:
            wait_for_facts(service, expected)
        sent += compare_queries(services.all, workload.sample_queries(key, QUERIES // 4), workload, mismatches,
                                f"seed {seed} after clearing every worker of {key}", rng)
        print(f"{feed} seed {seed}: {sent} queries compared across {len(services.all)} services, "
              f"{sum(len(c.blocks) for c in (p.chains for p in workload.partitions.values()))} distinct blocks; "
              f"{coverage}")
    finally:
        for service, engine in registered:
            unregister(service, engine)
        for engine in engines:
            engine.close()
        context.term()
    mismatches.check("between the reference and ours")
    model_mismatches.check("between ours and the clean-domain model")
