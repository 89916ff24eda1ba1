"""The httpx clients against the in-process apps."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from dynamo_lite.client import (
    AsyncIndexerClient,
    AsyncSlotTrackerClient,
    CallTimeout,
    ConnectError,
    IndexerClient,
    PotentialLoad,
    RankLoad,
    ServiceCallError,
    ServiceStatusError,
    SlotTrackerClient,
    TransportError,
    WorkerInfo,
)
from dynamo_lite.slot_tracker.app import create_app as create_slot_tracker

ROOT = Path(__file__).resolve().parent.parent


def in_process(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service")


@pytest.mark.unit
def test_async_slot_tracker_client_round_trip() -> None:
    async def scenario() -> None:
        async with AsyncSlotTrackerClient(client=in_process(create_slot_tracker())) as client:
            await client.health()
            await client.register(7, "m", 16, dp_size=2, tenant_id="t")
            assert await client.workers() == [WorkerInfo(7, "m", "t", 16, 0, 2)]
            await client.add("m", "r1", 7, 1, [1, 2, 3], 48, tenant_id="t")
            assert await client.loads(tenant_id="t") == [
                RankLoad("m", "t", 7, 0, 0, 0), RankLoad("m", "t", 7, 1, 48, 3)]
            projected = await client.potential_loads("m", [1, 2, 9], 10, tenant_id="t")
            assert sorted(projected, key=lambda p: p.dp_rank) == [
                PotentialLoad(7, 0, 10, 3, 0), PotentialLoad(7, 1, 58, 4, 1)]
            await client.prefill_complete("m", "r1", tenant_id="t")
            await client.output_blocks("m", "r1", 2, tenant_id="t")
            assert (await client.loads(tenant_id="t"))[1] == RankLoad("m", "t", 7, 1, 0, 5)
            with pytest.raises(ServiceCallError) as shrunk:
                await client.output_blocks("m", "r1", 1, tenant_id="t")
            assert shrunk.value.status == 409 and shrunk.value.path == "/output_blocks"
            await client.free("m", "r1", tenant_id="t")
            with pytest.raises(ServiceCallError) as failure:
                await client.add("m", "r2", 7, 5, [], tenant_id="t")
            assert failure.value.status == 404
            assert "worker 7 dp_rank 5 is not registered" in failure.value.message
            await client.unregister(7, "m", tenant_id="t")
            assert await client.loads() == []

    asyncio.run(scenario())


@pytest.mark.unit
def test_transport_failures_are_service_call_errors() -> None:
    with SlotTrackerClient("http://127.0.0.1:9", timeout=0.5) as client, pytest.raises(ServiceCallError) as failure:
        client.loads()
    assert failure.value.status == 0
    assert isinstance(failure.value, ConnectError) and failure.value.path == "/loads"


@pytest.mark.unit
def test_async_indexer_client_round_trip() -> None:
    from dynamo_lite.client import AsyncIndexerClient, OverlapScores
    from dynamo_lite.hashing import local_block_hashes, to_signed
    from dynamo_lite.indexer.app import create_app as create_indexer

    tokens = list(range(1, 65))
    local = local_block_hashes(tokens, 16)

    async def scenario() -> None:
        async with AsyncIndexerClient(client=in_process(create_indexer())) as client:
            await client.health()
            await client.register(7, "llama", 16, endpoint="ipc:///nonexistent/engine",
                                  replay_endpoint="ipc:///nonexistent/replay")
            report = await client.events({"llama:default": {"block_size": 16, "events": [
                {"worker_id": 7, "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
                    "parent_hash": None, "blocks": [{"block_hash": 100 + i, "tokens_hash": h}
                                                    for i, h in enumerate(local)]}}}}]}})
            assert report.applied == 1 and report.rejected == 0
            by_hash = await client.query_by_hash("llama", [to_signed(h) for h in local])
            assert isinstance(by_hash, OverlapScores) and by_hash.scores == {(7, 0): 64}
            assert by_hash.instances[7]["gpu"] == 64
            assert (await client.query("llama", tokens)).scores == {(7, 0): 64}
            assert (await client.query("llama", tokens, lora_name="my-lora")).scores == {}
            (worker,) = await client.workers(model_name="llama")
            assert worker.instance_id == 7
            assert worker.ranks[0].listener is not None
            assert worker.ranks[0].listener["replay_endpoint"] == "ipc:///nonexistent/replay"
            assert list(await client.dump()) == ["llama:default"]
            await client.register_peer("http://peer:8090")
            assert await client.peers() == ["http://peer:8090"]
            await client.deregister_peer("http://peer:8090")
            await client.unregister(7, "llama", dp_rank=0)
            with pytest.raises(ServiceCallError) as failure:
                await client.query_by_hash("llama", [])
            assert failure.value.status == 404

    asyncio.run(scenario())


@pytest.mark.unit
def test_errors_split_as_httpx_does_under_service_call_error() -> None:
    assert issubclass(ServiceStatusError, ServiceCallError) and issubclass(TransportError, ServiceCallError)
    assert issubclass(ConnectError, TransportError) and issubclass(CallTimeout, TransportError)
    assert not issubclass(ServiceStatusError, TransportError)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/loads":
            raise httpx.ReadTimeout("slow", request=request)
        if request.url.path == "/workers":
            raise httpx.RemoteProtocolError("cut", request=request)
        return httpx.Response(503, json={"error": "not ready"})

    mock = httpx.Client(base_url="http://service", transport=httpx.MockTransport(answer))
    with SlotTrackerClient(client=mock) as client:
        with pytest.raises(CallTimeout) as slow:
            client.loads()
        assert slow.value.status == 0 and "ReadTimeout: slow" in slow.value.message
        with pytest.raises(TransportError) as cut:
            client.workers()
        assert type(cut.value) is TransportError and cut.value.method == "GET"
        with pytest.raises(ServiceStatusError) as refused:
            client.free("m", "r")
        assert (refused.value.status, refused.value.message, refused.value.path) == (503, "not ready", "/free")
        assert str(refused.value) == "POST /free -> 503: not ready"
    mock.close()


@pytest.mark.process
def test_sync_clients_are_generated_from_the_async_source() -> None:
    result = subprocess.run([sys.executable, "scripts/generate_sync_client.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.unit
@pytest.mark.parametrize("sync, async_", [(SlotTrackerClient, AsyncSlotTrackerClient),
                                          (IndexerClient, AsyncIndexerClient)])
def test_sync_clients_have_every_async_method_as_a_typed_function(sync: type, async_: type) -> None:
    routes = [name for name, value in inspect.getmembers(async_, inspect.iscoroutinefunction)
              if not name.startswith("_")]
    assert "health" in routes and "aclose" in routes
    for name in routes:
        method = getattr(sync, "close" if name == "aclose" else name)  # on the class: no forwarding
        assert inspect.isfunction(method) and not inspect.iscoroutinefunction(method), name
        expected = inspect.signature(getattr(async_, name))
        # The same parameters with the same annotations; httpx.AsyncClient -> httpx.Client aside.
        assert inspect.signature(method) == expected, name
        assert (method.__doc__ or "").strip(), name
    sync_init, async_init = inspect.signature(sync).parameters, inspect.signature(async_).parameters
    assert set(async_init) - set(sync_init) == {"lean"} and sync_init["client"].annotation == "httpx.Client | None"


@pytest.mark.unit
def test_sync_slot_tracker_client_round_trip() -> None:
    with TestClient(create_slot_tracker(), base_url="http://service") as http, \
            SlotTrackerClient(client=http) as client:
        client.health()
        client.register(7, "m", 16, dp_size=2)
        client.add("m", "r1", 7, 1, [1, 2, 3], 48)
        assert client.loads() == [RankLoad("m", "default", 7, 0, 0, 0), RankLoad("m", "default", 7, 1, 48, 3)]
        assert client.workers() == [WorkerInfo(7, "m", "default", 16, 0, 2)]
        with pytest.raises(ServiceStatusError) as missing:
            client.potential_loads("other", [1])
        assert missing.value.status == 404
        client.free("m", "r1")
        client.unregister(7, "m")
        assert client.loads() == []
