"""The endpoint picker's pool: the file format, diffs, and registration with the real services.

Parsing and diffs are checked on text; registration runs against `python -m dynamo_lite.slot_tracker`
and `python -m dynamo_lite.indexer` started as processes (shared by the tests of this module, each
test with its own model names and worker ids), with a real ZMQ publisher standing in for an
engine's KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.reference_server import free_port, running_server, running_service

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.epp.endpoint import PoolEndpoint
from dynamo_lite.epp.pool_file import PoolError, load_pool, parse_pool
from dynamo_lite.epp.registration import PoolRegistrar
from dynamo_lite.epp.watcher import PoolWatcher, diff
from dynamo_lite.kv_publishers import EnginePublisher, WireFormat

# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------

YAML_POOL = """\
# two ranks of one engine, and a second engine
endpoints:
  - address: 10.0.0.7:8000
    worker_id: 7
    model: llama
    block_size: 16
    kv_events_endpoint: tcp://10.0.0.7:5557
    replay_endpoint: tcp://10.0.0.7:5600
    lora_names: [sql, chat]
  - address: 10.0.0.7:8001
    worker_id: 7
    dp_rank: 1
    model: llama
    block_size: 16
    max_num_batched_tokens: 2048
  - address: "[fe80::0001]:8000"
    worker_id: 18446744073709551615
    model: qwen
    block_size: 32
    tenant_id: team-a
"""


def entry(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"address": "10.0.0.1:8000", "worker_id": 1, "model": "m", "block_size": 16}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


@pytest.mark.unit
def test_parse_yaml() -> None:
    pool = parse_pool(YAML_POOL, source="pool.yaml")
    assert [ep.rank_key for ep in pool] == [(7, 0), (7, 1), (2**64 - 1, 0)]
    first, second, third = pool
    assert first == PoolEndpoint(
        address="10.0.0.7:8000", worker_id=7, model="llama", block_size=16,
        kv_events_endpoint="tcp://10.0.0.7:5557", replay_endpoint="tcp://10.0.0.7:5600", lora_names=("sql", "chat"),
    )
    assert (first.dp_rank, first.max_num_batched_tokens, first.tenant_id) == (0, 8192, "default")
    assert second.max_num_batched_tokens == 2048 and second.lora_names == () and second.kv_events_endpoint is None
    assert third.address == "[fe80::1]:8000"  # canonical form
    assert third.tenant_id == "team-a"


@pytest.mark.unit
def test_roles() -> None:
    pool = parse_pool("- {address: 10.0.0.1:80, worker_id: 1, model: m, block_size: 16, role: prefill}\n"
                      "- {address: 10.0.0.2:80, worker_id: 2, model: m, block_size: 16, role: decode}\n"
                      "- {address: 10.0.0.3:80, worker_id: 3, model: m, block_size: 16, role: aggregated}\n"
                      "- {address: 10.0.0.4:80, worker_id: 4, model: m, block_size: 16}\n", source="pool.yaml")
    assert [ep.role for ep in pool] == ["prefill", "decode", "aggregated", "aggregated"]
    as_decode = PoolEndpoint(address="10.0.0.4:80", worker_id=4, model="m", block_size=16, role="decode")
    assert diff(pool, [*pool[:3], as_decode]).changed == [(pool[3], as_decode)]


@pytest.mark.unit
def test_the_dp_ranks_of_one_engine_share_its_address() -> None:
    pool = parse_pool(pool_text(entry(), entry(dp_rank=1)), source="pool.json")
    assert [(ep.address, ep.rank_key) for ep in pool] == [("10.0.0.1:8000", (1, 0)), ("10.0.0.1:8000", (1, 1))]


@pytest.mark.unit
def test_parse_json_list_and_object_forms() -> None:
    entries = [entry(), entry(address="host-b.example:9000", worker_id=2, dp_rank=3)]
    as_list = parse_pool(json.dumps(entries), source="pool.json")
    as_object = parse_pool(json.dumps({"endpoints": entries}, indent="\t"), source="pool.json")  # tabs: not YAML
    assert as_list == as_object
    assert [ep.address for ep in as_list] == ["10.0.0.1:8000", "host-b.example:9000"]
    assert as_list[1].rank_key == (2, 3)


@pytest.mark.unit
@pytest.mark.parametrize("text", ["[]", "endpoints: []", '{"endpoints": []}', "# nobody yet\n[]\n"])
def test_an_empty_pool_is_valid(text: str) -> None:
    assert parse_pool(text, source="pool.yaml") == []


@pytest.mark.unit
@pytest.mark.parametrize("address, canonical", [
    ("10.0.0.1:8000", "10.0.0.1:8000"),
    ("[::1]:8000", "[::1]:8000"),
    ("[2001:DB8:0:0::1]:443", "[2001:db8::1]:443"),
    ("Engine-0.Pool.svc.cluster.local:8000", "engine-0.pool.svc.cluster.local:8000"),
    ("localhost:08000", "localhost:8000"),
    ("localhost:65535", "localhost:65535"),
])
def test_addresses(address: str, canonical: str) -> None:
    assert PoolEndpoint(address=address, worker_id=1, model="m", block_size=1).address == canonical


def pool_text(*entries: dict[str, Any]) -> str:
    return json.dumps(list(entries))


# (text, the message's expected text). Every entry error names the file, the entry and the field.
ERRORS = [
    pytest.param(pool_text(entry(modle="x")), "pool.json:1: endpoints[0]: modle: unknown key (did you mean 'model'?)",
                 id="unknown-key"),
    pytest.param(pool_text(entry(), entry(address="10.0.0.2:1", worker_id=2, block_size=...)),
                 "pool.json:1: endpoints[1]: block_size: missing (required)", id="missing"),
    pytest.param(pool_text(entry(address="10.0.0.1")), "endpoints[0]: address: must be \"host:port\", got '10.0.0.1' (no port)",
                 id="no-port"),
    pytest.param(pool_text(entry(address="10.0.0.1:0")), "endpoints[0]: address: the port of '10.0.0.1:0' must be a number in 1..65535",
                 id="port-0"),
    pytest.param(pool_text(entry(address="10.0.0.1:65536")), "endpoints[0]: address: the port", id="port-big"),
    pytest.param(pool_text(entry(address="::1:8000")), "endpoints[0]: address: an IPv6 address must be written \"[addr]:port\"",
                 id="ipv6-unbracketed"),
    pytest.param(pool_text(entry(address="[::g]:8000")), "endpoints[0]: address: '::g' in '[::g]:8000' is not an IPv6 address",
                 id="ipv6-bad"),
    pytest.param(pool_text(entry(address="10.0.0.300:80")), "endpoints[0]: address: '10.0.0.300' in '10.0.0.300:80' is not a valid IPv4 address",
                 id="ipv4-bad"),
    pytest.param(pool_text(entry(address="bad_host:80")), "endpoints[0]: address: 'bad_host' in 'bad_host:80' is neither an IP address nor a host name",
                 id="hostname-bad"),
    pytest.param(pool_text(entry(address=8000)), "endpoints[0]: address: must be a string \"host:port\", got 8000",
                 id="address-not-str"),
    pytest.param(pool_text(entry(worker_id=-1)), "endpoints[0]: worker_id: must be an integer in 0..2^64-1, got -1",
                 id="worker-negative"),
    pytest.param(pool_text(entry(worker_id=2**64)), "endpoints[0]: worker_id: must be an integer in 0..2^64-1", id="worker-big"),
    pytest.param(pool_text(entry(worker_id=True)), "endpoints[0]: worker_id: must be an integer in 0..2^64-1, got true",
                 id="worker-bool"),
    pytest.param(pool_text(entry(worker_id="7")), "endpoints[0]: worker_id: must be an integer in 0..2^64-1, got '7'",
                 id="worker-str"),
    pytest.param(pool_text(entry(dp_rank=-1)), "endpoints[0]: dp_rank: must be an integer in 0..2^32-2, got -1", id="rank"),
    pytest.param(pool_text(entry(block_size=0)), "endpoints[0]: block_size: must be an integer > 0, got 0", id="block-0"),
    pytest.param(pool_text(entry(block_size=16.0)), "endpoints[0]: block_size: must be an integer > 0, got 16.0", id="block-float"),
    pytest.param(pool_text(entry(max_num_batched_tokens=0)), "endpoints[0]: max_num_batched_tokens: must be an integer > 0, got 0",
                 id="budget-0"),
    pytest.param(pool_text(entry(model="")), "endpoints[0]: model: must not be empty", id="model-empty"),
    pytest.param("- {address: '10.0.0.1:80', worker_id: 1, model: yes, block_size: 16}",
                 "pool.json:1: endpoints[0]: model: must be a string, got true (quote it in YAML)", id="model-yaml-bool"),
    pytest.param(pool_text(entry(tenant_id="a:b")), "endpoints[0]: tenant_id: must not contain ':'", id="tenant-colon"),
    pytest.param(pool_text(entry(replay_endpoint="tcp://10.0.0.1:5600")),
                 "endpoints[0]: replay_endpoint: needs a kv_events_endpoint", id="replay-alone"),
    pytest.param(pool_text(entry(kv_events_endpoint="tcp://*:5557")),
                 "endpoints[0]: kv_events_endpoint: 'tcp://*:5557' is the engine's bind address", id="kv-bind-all"),
    pytest.param(pool_text(entry(kv_events_endpoint="10.0.0.1:5557")),
                 "endpoints[0]: kv_events_endpoint: '10.0.0.1:5557' has no scheme", id="kv-no-scheme"),
    pytest.param(pool_text(entry(kv_events_endpoint="udp://10.0.0.1:5557")),
                 "endpoints[0]: kv_events_endpoint: 'udp://10.0.0.1:5557': the scheme must be tcp, ipc or inproc", id="kv-scheme"),
    pytest.param(pool_text(entry(kv_events_endpoint="tcp://e:5557", replay_endpoint="tcp://e:0")),
                 "endpoints[0]: replay_endpoint: 'tcp://e:0' is not tcp://host:port", id="replay-port"),
    pytest.param(pool_text(entry(lora_names="sql")), "endpoints[0]: lora_names: must be a list of strings, got 'sql'", id="lora-str"),
    pytest.param(pool_text(entry(lora_names=["a", "a"])), "endpoints[0]: lora_names: 'a' is listed twice", id="lora-twice"),
    pytest.param(pool_text(entry(lora_names=["m"])), "endpoints[0]: lora_names: 'm' is the endpoint's own model", id="lora-model"),
    pytest.param(pool_text(entry(), entry(worker_id=2, address="10.0.0.1:08000")),
                 "pool.json:1: endpoints[1]: address: 10.0.0.1:8000 is also the address of endpoints[0]", id="dup-address"),
    pytest.param(pool_text(entry(), entry(address="[::1]:1", worker_id=2), entry(address="[0::1]:1", worker_id=3)),
                 "endpoints[2]: address: [::1]:1 is also the address of endpoints[1]", id="dup-address-ipv6"),
    pytest.param(pool_text(entry(), entry(address="10.0.0.2:8000")),
                 "endpoints[1]: dp_rank: worker_id 1 dp_rank 0 is also endpoints[0]", id="dup-rank"),
    pytest.param(pool_text(entry(), entry(address="10.0.0.2:8000", dp_rank=1, model="other")),
                 "endpoints[1]: model: 'other' differs from 'm' of endpoints[0], another rank of worker_id 1", id="rank-model"),
    pytest.param(pool_text(entry(), entry(address="10.0.0.2:8000", dp_rank=1, block_size=32)),
                 "endpoints[1]: block_size: 32 differs from 16 of endpoints[0], another rank of worker_id 1", id="rank-block"),
    pytest.param(pool_text(entry(), entry(address="10.0.0.2:8000", dp_rank=1, tenant_id="t")),
                 "endpoints[1]: tenant_id: 't' differs from 'default' of endpoints[0]", id="rank-tenant"),
    pytest.param(pool_text(entry(), entry(address="10.0.0.2:8000", dp_rank=2)),
                 "endpoints[1]: dp_rank: worker_id 1 lists dp_ranks 0, 2: the slot tracker registers a worker's ranks "
                 "as one range, so list every rank from 0 to 2", id="rank-gap"),
    pytest.param(pool_text(entry(role="prefiller")),
                 "endpoints[0]: role: must be one of prefill, decode, aggregated, got 'prefiller'", id="role-unknown"),
    pytest.param(pool_text(entry(role=None)), "endpoints[0]: role: must be one of prefill, decode, aggregated, got null",
                 id="role-null"),
    pytest.param(pool_text(entry(role="decode"), entry(address="10.0.0.2:8000", dp_rank=1, role="prefill")),
                 "endpoints[1]: role: 'prefill' differs from 'decode' of endpoints[0], another rank of worker_id 1",
                 id="rank-role"),
    pytest.param(pool_text(entry(), 5), "endpoints[1]: must be an object, got 5", id="not-object"),
    pytest.param("", "pool.json: the file is empty: write [] (or endpoints: []) for a pool without endpoints", id="empty-file"),
    pytest.param('{"endpoints": [], "extra": 1}', "pool.json: unknown top-level key 'extra': expected only 'endpoints'",
                 id="top-unknown"),
    pytest.param('{"endpoint": []}', "pool.json: unknown top-level key 'endpoint'", id="top-typo"),
    pytest.param('{"endpoints": {"a": 1}}', "pool.json: endpoints: 'endpoints' must be a list, got dict", id="top-not-list"),
    pytest.param('"hello"', "pool.json: expected a list of endpoints or an object with 'endpoints', got str", id="scalar"),
    pytest.param("- address: 10.0.0.1:80\n  address: 10.0.0.2:80\n",
                 "the key 'address' is written twice (first on line 1)", id="yaml-dup-key"),
    pytest.param('{\n\t"endpoints": [{"block_size": 1, "block_size": 2}]}',
                 "pool.json: not valid JSON: the key 'block_size' is written twice in one object", id="json-dup-key"),
    pytest.param("endpoints: [\n  {address: x\n", "pool.json: not valid YAML:", id="yaml-syntax"),
    pytest.param('{\n\t"endpoints": [}', "pool.json: not valid JSON: Expecting value: line 2 column 16", id="json-syntax"),
]


@pytest.mark.unit
@pytest.mark.parametrize("text, message", ERRORS)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(PoolError) as caught:
        parse_pool(text, source="pool.json")
    assert message in str(caught.value)
    assert str(caught.value).startswith("pool.json")


@pytest.mark.unit
def test_errors_carry_their_place() -> None:
    text = "endpoints:\n  - address: 10.0.0.1:80\n    worker_id: 1\n    model: m\n    block_size: 16\n" \
           "  - address: 10.0.0.2:80\n    worker_id: 2\n    model: m\n    block_size: -4\n"
    with pytest.raises(PoolError) as caught:
        parse_pool(text, source="/etc/epp/pool.yaml")
    error = caught.value
    assert (error.source, error.line, error.index, error.field) == ("/etc/epp/pool.yaml", 6, 1, "block_size")
    assert str(error) == "/etc/epp/pool.yaml:6: endpoints[1]: block_size: must be an integer > 0, got -4"
    assert isinstance(error, ValueError)


@pytest.mark.unit
def test_endpoint_validates_itself() -> None:
    with pytest.raises(ValueError, match="block_size: must be an integer > 0"):
        PoolEndpoint(address="10.0.0.1:80", worker_id=1, model="m", block_size=0)
    ep = PoolEndpoint(address="10.0.0.1:80", worker_id=1, dp_rank=2, model="m", block_size=1, lora_names=["a"])  # type: ignore[arg-type]
    assert ep.lora_names == ("a",) and ep.rank_key == (1, 2)
    assert hash(ep) == hash(PoolEndpoint(address="10.0.0.1:80", worker_id=1, dp_rank=2, model="m", block_size=1,
                                         lora_names=("a",)))


@pytest.mark.unit
def test_load_pool(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(YAML_POOL)
    assert load_pool(path) == parse_pool(YAML_POOL, source="x")
    with pytest.raises(PoolError, match=r"^.*missing\.yaml: cannot read the pool file: "):
        load_pool(tmp_path / "missing.yaml")
    path.write_bytes(b"\xff\xfe[")
    with pytest.raises(PoolError, match="pool.yaml: cannot read the pool file"):
        load_pool(path)


@pytest.mark.unit
def test_diff() -> None:
    a = PoolEndpoint(address="10.0.0.1:80", worker_id=1, model="m", block_size=16)
    b = PoolEndpoint(address="10.0.0.2:80", worker_id=2, model="m", block_size=16)
    b2 = PoolEndpoint(address="10.0.0.2:80", worker_id=2, model="m", block_size=16, max_num_batched_tokens=1)
    c = PoolEndpoint(address="10.0.0.3:80", worker_id=3, model="m", block_size=16)
    d = diff([a, b], [b2, c])
    assert (d.added, d.removed, d.changed) == ([c], [a], [(b, b2)])
    assert d
    assert not diff([a, b], [b, a])
    assert diff([], [a]).added == [a]


# ------------------------------------------------------------------------------------------------
# Registration with the real services
# ------------------------------------------------------------------------------------------------

DEADLINE = 15.0


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[str, str]]:
    with running_service("slot_tracker") as tracker, running_service("indexer") as indexer:
        yield tracker, indexer


def endpoint(worker_id: int, model: str, *, dp_rank: int = 0, block_size: int = 16, **extra: Any) -> PoolEndpoint:
    return PoolEndpoint(address=f"10.1.{worker_id % 250}.{dp_rank + 1}:8000", worker_id=worker_id, dp_rank=dp_rank,
                        model=model, block_size=block_size, **extra)


@contextlib.asynccontextmanager
async def registrar_for(tracker_url: str, indexer_url: str):  # type: ignore[no-untyped-def]
    async with AsyncSlotTrackerClient(tracker_url, timeout=2.0) as tracker, \
            AsyncIndexerClient(indexer_url, timeout=2.0) as indexer:
        yield PoolRegistrar(tracker, indexer)


async def eventually(probe: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """`probe()` (awaited if it returns an awaitable) once it is truthy; a test failure after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s", pytrace=False)
        await asyncio.sleep(0.05)


async def tracker_workers(url: str, model: str) -> list[tuple[int, int, int, int]]:
    async with AsyncSlotTrackerClient(url) as tracker:
        return [(w.worker_id, w.block_size, w.dp_start, w.dp_size) for w in await tracker.workers(model)]


async def indexer_ranks(url: str, model: str) -> dict[tuple[int, int], dict[str, Any]]:
    async with AsyncIndexerClient(url) as indexer:
        return {
            (info.instance_id, rank.dp_rank): rank
            for info in await indexer.workers(model) for rank in info.ranks if rank.registered
        }


@pytest.mark.process
def test_registering_twice_is_idempotent(services: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    tracker_url, indexer_url = services
    model = "idempotent"
    pool = [endpoint(101, model), endpoint(101, model, dp_rank=1), endpoint(102, model)]

    async def body() -> None:
        # Two pickers sharing one pool, each registering all of it (the second, again, after a restart).
        async with registrar_for(tracker_url, indexer_url) as first, registrar_for(tracker_url, indexer_url) as second:
            assert not await first.known(pool)
            everything = {(101, 0), (101, 1), (102, 0)}
            assert await first.register(pool) == everything
            assert await second.register(pool) == everything
            assert await second.register(reversed(pool)) == everything
            assert await first.known(pool) and await second.known(pool)
            assert not await first.known([*pool, endpoint(103, model)])

        assert await tracker_workers(tracker_url, model) == [(101, 16, 0, 2), (102, 16, 0, 1)]
        assert set(await indexer_ranks(indexer_url, model)) == {(101, 0), (101, 1), (102, 0)}

    with caplog.at_level(logging.WARNING, logger="dynamo_lite.epp.pool"):
        asyncio.run(body())
    assert not caplog.records  # success, both times: no conflict logged


@pytest.mark.process
def test_a_real_conflict_is_not_registered(services: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    tracker_url, indexer_url = services
    model = "conflict"

    async def body() -> None:
        async with registrar_for(tracker_url, indexer_url) as registrar:
            assert await registrar.register([endpoint(111, model)]) == {(111, 0)}
            other = [endpoint(111, model, block_size=32)]  # another picker's pool disagrees
            assert await registrar.register(other) == set()
            assert await registrar.register(other) == set()
            assert not await registrar.known(other)
            assert await registrar.known([endpoint(111, model)])
            # Unregistering: gone from both; again: already gone, fine.
            assert await registrar.unregister([endpoint(111, model)]) == {(111, 0)}
            assert await registrar.unregister([endpoint(111, model)]) == {(111, 0)}
            assert not await registrar.known([endpoint(111, model)])
            assert await registrar.register(other) == {(111, 0)}

    with caplog.at_level(logging.ERROR, logger="dynamo_lite.epp.pool"):
        asyncio.run(body())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # One error per service while the conflict lasts, not one per attempt.
    assert len(errors) == 2, errors
    assert any("slot tracker: cannot register worker 111 (dp_rank 0) of model=conflict" in e
               and "it has block_size 16" in e for e in errors), errors
    assert any("indexer: cannot register worker 111 dp_rank 0 of model=conflict" in e for e in errors), errors


@pytest.mark.process
def test_the_indexer_subscribes_to_the_engine(services: tuple[str, str]) -> None:
    tracker_url, indexer_url = services
    model = "kv-events"
    with EnginePublisher(WireFormat.VLLM) as engine:
        assert engine.replay_endpoint is not None
        ep = endpoint(121, model, kv_events_endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint)

        async def body() -> None:
            async with registrar_for(tracker_url, indexer_url) as first, registrar_for(tracker_url, indexer_url) as second:
                assert await first.register([ep]) == {(121, 0)}
                assert await second.register([ep]) == {(121, 0)}  # same endpoints: the same registration
                assert await first.known([ep])

        asyncio.run(body())
        engine.wait_for_subscribers(timeout=DEADLINE)  # the indexer's listener connected
        rank = asyncio.run(indexer_ranks(indexer_url, model))[(121, 0)]
        assert (rank.endpoint, rank.replay_endpoint, rank.source) == (engine.endpoint, engine.replay_endpoint, "events")
        assert rank.listener is not None


def write_pool(path: Path, endpoints: list[PoolEndpoint]) -> None:
    """Replace the file as an editor or a ConfigMap update does: a new file renamed over it."""
    entries = [
        {"address": ep.address, "worker_id": ep.worker_id, "dp_rank": ep.dp_rank, "model": ep.model,
         "block_size": ep.block_size, **({"kv_events_endpoint": ep.kv_events_endpoint} if ep.kv_events_endpoint else {})}
        for ep in endpoints
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoints": entries}, indent=2))
    os.replace(tmp, path)


@pytest.mark.process
def test_the_watcher_follows_the_file(services: tuple[str, str], tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    tracker_url, indexer_url = services
    model = "watched"
    path = tmp_path / "pool.json"
    a, b, c = endpoint(131, model), endpoint(132, model), endpoint(133, model)
    a1 = endpoint(131, model, dp_rank=1)
    write_pool(path, [a, b])
    changes: list[list[PoolEndpoint]] = []

    async def async_callback(pool: list[PoolEndpoint]) -> None:
        changes.append(pool)

    def broken_callback(pool: list[PoolEndpoint]) -> None:
        raise RuntimeError("a callback's bug")

    async def body() -> None:
        async with registrar_for(tracker_url, indexer_url) as registrar:
            watcher = PoolWatcher(path, registrar, interval=0.05, on_change=[broken_callback])
            watcher.on_change.append(async_callback)
            assert watcher.pool == [a, b] and not watcher.ready
            task = asyncio.create_task(watcher.run())
            try:
                await eventually(lambda: watcher.ready, "the first pool registered")
                assert watcher.registered == {(131, 0), (132, 0)}
                assert await registrar.known([a, b])

                # b leaves, c comes, a gets a second rank.
                write_pool(path, [a, a1, c])
                await eventually(lambda: len(changes) == 1, "the new pool taken")
                assert changes[0] == [a, a1, c] and watcher.pool == [a, a1, c]
                assert watcher.by_address == {ep.address: ep for ep in [a, a1, c]}
                assert watcher.ready and watcher.registered == {(131, 0), (131, 1), (133, 0)}
                assert await tracker_workers(tracker_url, model) == [(131, 16, 0, 2), (133, 16, 0, 1)]
                assert set(await indexer_ranks(indexer_url, model)) == {(131, 0), (131, 1), (133, 0)}

                # A broken file: logged, and the pool stays.
                path.write_text('{"endpoints": [{"address": "10.9.9.9:80", "worker_id": 1, "modle": "x"}]}')
                await eventually(lambda: watcher.last_error is not None, "the broken file seen")
                assert "modle: unknown key (did you mean 'model'?)" in watcher.last_error
                await asyncio.sleep(0.2)
                assert watcher.pool == [a, a1, c] and watcher.ready and len(changes) == 1

                # The file gone (a bad deploy): logged, and the pool stays.
                path.unlink()
                await eventually(lambda: "cannot read the pool file" in (watcher.last_error or ""), "the file gone")
                assert watcher.pool == [a, a1, c] and len(changes) == 1

                # Fixed again, in place, with the same size and mtime: only reload() sees it.
                write_pool(path, [a, a1])
                stat = path.stat()
                await eventually(lambda: len(changes) == 2, "the fixed file taken")
                assert watcher.last_error is None and watcher.pool == [a, a1]
                same_size = path.read_text().replace('"10.1.131.1:8000"', '"10.1.131.9:8000"')
                with open(path, "r+") as handle:
                    handle.write(same_size)
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
                await asyncio.sleep(0.2)
                assert len(changes) == 2
                watcher.reload()
                await eventually(lambda: len(changes) == 3, "the reloaded file taken")
                assert watcher.pool[0].address == "10.1.131.9:8000"
                # An address change is no registration change: nothing was unregistered for it.
                assert await tracker_workers(tracker_url, model) == [(131, 16, 0, 2)]
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # Stopping the watcher unregisters nothing: other pickers share the pool.
            assert await registrar.known(watcher.pool)

    with caplog.at_level(logging.INFO, logger="dynamo_lite.epp.pool"):
        asyncio.run(body())
    messages = [r.getMessage() for r in caplog.records]
    assert any("unregistered worker 132 (dp_rank 0) of model=watched tenant_id=default from the slot tracker" in m
               for m in messages), messages
    assert any("modle: unknown key" in m and "keeping the current pool of 3 endpoints" in m for m in messages), messages
    assert any("callback" in m and "failed" in m for m in messages), messages


@pytest.mark.process
def test_a_service_down_at_start_is_registered_when_it_comes_up(
    services: tuple[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, indexer_url = services
    model = "late"
    port = free_port()
    tracker_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]
    path = tmp_path / "pool.yaml"
    pool = [endpoint(141, model), endpoint(142, model)]
    write_pool(path, pool)

    async def body() -> None:
        with contextlib.ExitStack() as stack:
            async with registrar_for(tracker_url, indexer_url) as registrar:
                watcher = PoolWatcher(path, registrar, interval=0.05, verify_interval=0.2)
                task = asyncio.create_task(watcher.run())
                try:
                    # The indexer takes the pool; the slot tracker is not there.
                    await eventually(lambda: indexer_ranks(indexer_url, model), "registered with the indexer")
                    await asyncio.sleep(0.3)  # several retries
                    assert not watcher.ready and watcher.registered == set()
                    assert not await registrar.known(pool)

                    await asyncio.to_thread(stack.enter_context, running_server(argv, port))
                    await eventually(lambda: watcher.ready, "registered once the tracker is up")
                    assert await tracker_workers(tracker_url, model) == [(141, 16, 0, 1), (142, 16, 0, 1)]
                    assert watcher.registered == {(141, 0), (142, 0)}

                    # The tracker restarts without its state: the watcher notices and registers again.
                    await asyncio.to_thread(stack.close)
                    await asyncio.to_thread(stack.enter_context, running_server(argv, port))
                    await eventually(lambda: tracker_workers(tracker_url, model), "registered again after a restart")
                    assert await tracker_workers(tracker_url, model) == [(141, 16, 0, 1), (142, 16, 0, 1)]
                    await eventually(lambda: watcher.ready, "ready again")
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await asyncio.to_thread(stack.close)

    with caplog.at_level(logging.INFO, logger="dynamo_lite.epp.pool"):
        asyncio.run(body())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # One warning per failure streak (two streaks: before the start, and during the restart at most).
    assert 1 <= len(warnings) <= 2, warnings
    assert all(w.startswith("slot tracker unavailable") for w in warnings), warnings
    assert any(r.getMessage() == "slot tracker reachable again" for r in caplog.records)


@pytest.mark.unit
def test_unreachable_services_raise_nothing(caplog: pytest.LogCaptureFixture) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    pool = [endpoint(151, "nowhere")]

    async def body() -> None:
        async with registrar_for(nowhere, nowhere) as registrar:
            assert await registrar.register(pool) == set()
            assert await registrar.register(pool) == set()
            assert await registrar.unregister(pool) == set()
            assert not await registrar.known(pool)
            assert not await registrar.known([])
            assert set(registrar.failing) == {"slot tracker", "indexer"}

    with caplog.at_level(logging.WARNING, logger="dynamo_lite.epp.pool"):
        asyncio.run(body())
    warnings = sorted(r.getMessage().split(" unavailable")[0] for r in caplog.records)
    assert warnings == ["indexer", "slot tracker"]  # once per service and failure streak
