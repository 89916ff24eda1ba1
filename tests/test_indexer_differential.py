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

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import zmq
from support.fake_engine import GROW, SHRINK, FakeEngine, Query, Workload
from support.indexer_differential import (
    Coverage,
    Mismatches,
    Service,
    compare_queries,
    distinct_ports,
    feed_ours,
    make_engines,
    ours_argv,
    post,
    reference_argv,
    register,
    shortened,
    wait_for_facts,
)
from support.reference_server import require_reference_or_skip, running_server

pytestmark = [pytest.mark.process, pytest.mark.reference]

SEEDS = [int(s) for s in os.environ.get("DYNAMO_LITE_INDEXER_DIFF_SEEDS", "1,2,3").split(",") if s.strip()]
QUERIES = int(os.environ.get("DYNAMO_LITE_INDEXER_DIFF_QUERIES", "120"))


# --------------------------------------------------------------------------------------------
# Services
# --------------------------------------------------------------------------------------------


@dataclass
class Services:
    references: list[Service]
    ours: Service

    @property
    def all(self) -> list[Service]:
        return [*self.references, self.ours]


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


def unregister(service: Service, engine: FakeEngine) -> None:
    field_name = "routing_group" if service.reference else "tenant_id"
    post(service, "/unregister", {"instance_id": engine.worker_id, "model_name": engine.model_name,
                                  field_name: engine.tenant_id, "dp_rank": engine.dp_rank})


def compare_with_model(service: Service, queries: list[Query], workload: Workload, mismatches: Mismatches,
                       where: str) -> None:
    for query in queries:
        size = workload.partitions[query.key].block_size
        expected = workload.expected_answer(query.key, query.local_hashes(size))
        response = service.client.post(query.path, json=query.body("tenant_id" if not service.reference else "routing_group"))
        if response.status_code != 200 or response.json() != expected:
            mismatches.add(f"{where}: POST {query.path} {shortened(query.body('tenant_id'))}\n"
                           f"    {service.name}: {response.status_code} {shortened(response.text)}\n"
                           f"    model: {shortened(expected)}")


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


@pytest.mark.parametrize("path", ["/health", "/workers", "/dump"])
def test_a_get_with_a_small_json_body_is_answered_as_without_one(services: Services, path: str) -> None:
    """The reference ignores a body sent with GET; so does ours (it answered 413 before)."""
    for service in services.all:
        plain = service.client.get(path)
        with_body = service.client.request("GET", path, content=b'{"model_name": "m"}',
                                           headers={"content-type": "application/json"})
        assert plain.status_code == 200, (service.name, plain.text)
        assert (with_body.status_code, with_body.content) == (plain.status_code, plain.content), service.name
