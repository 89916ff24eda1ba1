"""`--snapshot`: round trip, atomic replacement, bad files, and the process under SIGKILL/SIGTERM."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.testclient import TestClient
from support.reference_server import free_port, wait_healthy

from dynamo_lite.indexer import snapshot
from dynamo_lite.indexer.app import IndexerConfig, create_app
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document

COMMAND = [sys.executable, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1"]


def stored(worker: int, event_id: int, hashes: list[int], parent: int | None = None, tier: str = "device") -> dict:
    return {"worker_id": worker, "storage_tier": tier, "event": {"event_id": event_id, "dp_rank": 0, "data": {
        "stored": {"parent_hash": parent, "blocks": [{"block_hash": h, "tokens_hash": h ^ 0x5A5A} for h in hashes]}}}}


def sample_indexer() -> Indexer:
    indexer = Indexer()
    indexer.register(9, "idle", "default", 32)  # a partition whose only worker holds nothing
    indexer.apply_events(parse_events_document({
        "llama:default": {"block_size": 16, "events": [
            stored(1, 0, [1, 2, 3]), stored(1, 1, [4], parent=3), stored(2, 0, [1, 2]),
            stored(2, 1, [7, 8], tier="host_pinned"),
        ]},
        "llama:team-b": {"block_size": 16, "events": [stored(3, 0, [2**64 - 1, 5])]},
    }))
    return indexer


@pytest.mark.unit
def test_round_trip_restores_every_partition_and_answer(tmp_path: Path) -> None:
    original = sample_indexer()
    path = tmp_path / "index.json"
    snapshot.write_atomically(path, snapshot.encode(original))
    assert path.read_bytes() == orjson.dumps(original.dump())  # the very /dump document
    assert snapshot.encode(Indexer()) == orjson.dumps(Indexer().dump()) == b"{}"
    restored = Indexer()
    report = snapshot.load(restored, path)
    assert report is not None and report.rejected == 0
    assert restored.dump() == original.dump()
    for tenant, hashes in [("default", [1 ^ 0x5A5A, 2 ^ 0x5A5A, 3 ^ 0x5A5A, 4 ^ 0x5A5A, 0]),
                           ("team-b", [(2**64 - 1) ^ 0x5A5A])]:
        assert restored.query("llama", tenant, hashes) == original.query("llama", tenant, hashes)
    # The /dump format names workers only through their events: one holding nothing comes back
    # as its partition and block size only, and registers again.
    assert [w.instance_id for w in restored.workers()] == [1, 2, 3]
    assert restored.block_size("idle", "default") == 32


@pytest.mark.unit
def test_missing_snapshot_means_empty_index(tmp_path: Path) -> None:
    assert snapshot.load(Indexer(), tmp_path / "absent.json") is None


@pytest.mark.unit
def test_failed_write_keeps_the_previous_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "index.json"
    snapshot.write_atomically(path, b'{"old": 1}')

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        snapshot.write_atomically(path, b'{"new": 2}')
    assert path.read_bytes() == b'{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]  # no temp file left


@pytest.mark.unit
def test_temp_files_of_a_killed_writer_are_removed_at_start_up(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    (tmp_path / ".index.json.abc123.tmp").write_bytes(b'{"half')
    (tmp_path / "other.tmp").write_bytes(b"not ours")
    app = create_app(IndexerConfig(snapshot=str(path)))
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "other.tmp"]


@pytest.mark.unit
@pytest.mark.parametrize("content", [b'{"llama:default": {"block_size": 16, "ev', b'["not", "a", "dump"]', b"\xff\xfe"])
def test_bad_snapshot_stops_start_up(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "index.json"
    path.write_bytes(content)
    with pytest.raises(snapshot.SnapshotError, match="index.json"):
        with TestClient(create_app(IndexerConfig(snapshot=str(path)))):
            pass
    assert path.read_bytes() == content  # left for the operator to inspect


@pytest.mark.unit
def test_bad_snapshot_is_moved_aside_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    path.write_bytes(b"{")
    with TestClient(create_app(IndexerConfig(snapshot=str(path), ignore_bad_snapshot=True))) as client:
        assert client.get("/ready").status_code == 200
        assert client.get("/dump").json() == {}
    assert (tmp_path / "index.json.bad").read_bytes() == b"{"
    assert orjson.loads(path.read_bytes()) == {}  # the final snapshot at shutdown


@pytest.mark.unit
def test_shutdown_writes_the_final_snapshot_in_process(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    with TestClient(create_app(IndexerConfig(snapshot=str(path), snapshot_interval_secs=3600))) as client:
        document = {"m:default": {"block_size": 4, "events": [stored(1, 0, [10, 11])]}}
        assert client.post("/events", json=document).status_code == 200
        expected = client.get("/dump").json()
        assert not path.exists()
    assert orjson.loads(path.read_bytes()) == expected


# --- the process ----------------------------------------------------------------------------


def start(path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [*COMMAND, "--port", str(port), "--snapshot", str(path), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, path="/ready", timeout=20)
    except RuntimeError:
        process.kill()
        raise AssertionError(f"indexer did not become ready: {process.communicate()[0]}") from None
    return process, base_url


def held_blocks(base_url: str) -> set[int]:
    document = httpx.get(f"{base_url}/dump", timeout=10).json()
    return {block["block_hash"] for section in document.values() for event in section["events"]
            for block in event["event"]["data"]["stored"]["blocks"]}


class Publisher(threading.Thread):
    """Posts 64-block stored events until stopped; remembers the blocks acknowledged."""

    def __init__(self, base_url: str, hashes: itertools.count) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.hashes = hashes
        self.acknowledged: set[int] = set()
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        rng = random.Random(0)  # which of the four workers each batch goes to
        with httpx.Client(timeout=5) as client:
            event_id = 0
            while not self.stop.is_set():
                blocks = [next(self.hashes) for _ in range(64)]
                document = {"m:default": {"block_size": 16, "events": [stored(rng.randrange(4), event_id, blocks)]}}
                event_id += 1
                try:
                    response = client.post(f"{self.base_url}/events", json=document)
                except httpx.TransportError:
                    return  # killed
                if response.status_code != 200:
                    self.failures.append(response.text)
                    return
                self.acknowledged.update(blocks)


@pytest.mark.process
def test_sigkill_under_load_always_restarts_from_a_valid_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    hashes = itertools.count(1)
    posted: set[int] = set()  # sent, acknowledged or not: a request in flight may have been applied
    loaded: set[int] = set()
    # Killed this long after the first acknowledged write: spread over the snapshot cycle, and
    # the same on every run.
    for delay in (0.4, 0.53, 0.66, 0.79, 0.9):
        process, base_url = start(path, "--snapshot-interval-secs", "0.05")
        try:
            now = held_blocks(base_url)
            # Each restart has at least what the previous one loaded (snapshots only grow here),
            # and nothing that was never posted.
            assert loaded <= now <= posted
            loaded = now
            publisher = Publisher(base_url, hashes)
            publisher.start()
            deadline = time.monotonic() + 30
            while not publisher.acknowledged and publisher.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert publisher.acknowledged, f"no write acknowledged within 30 s: {publisher.failures}"
            time.sleep(delay)
        finally:
            process.kill()
            process.wait(timeout=10)
        publisher.stop.set()
        publisher.join(timeout=10)
        assert not publisher.failures
        posted = set(range(1, next(hashes)))
    assert loaded


@pytest.mark.process
def test_sigterm_writes_everything_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    process, base_url = start(path, "--snapshot-interval-secs", "3600")
    publisher = Publisher(base_url, itertools.count(1))
    try:
        publisher.start()
        time.sleep(0.5)
        publisher.stop.set()
        publisher.join(timeout=10)
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "wrote the final snapshot" in output
    restored = Indexer()
    snapshot.load(restored, path)
    assert publisher.acknowledged and not publisher.failures
    assert restored.workers()
    document = restored.dump()
    held = {block["block_hash"] for section in document.values() for event in section["events"]
            for block in event["event"]["data"]["stored"]["blocks"]}
    assert held == publisher.acknowledged


@pytest.mark.process
def test_bad_snapshot_makes_the_process_exit_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    path.write_bytes(b'{"m:default": ')
    result = subprocess.run([*COMMAND, "--port", str(free_port()), "--snapshot", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3  # dynamo_lite.web.server.STARTUP_FAILED_EXIT_STATUS
    assert f"snapshot {path} is not valid JSON" in result.stderr
    assert "refusing to start" in result.stderr


@pytest.mark.unit
def test_missing_snapshot_directory_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(snapshot.SnapshotError, match="does not exist"):
        with TestClient(create_app(IndexerConfig(snapshot=str(tmp_path / "absent" / "index.json"), ignore_bad_snapshot=True))):
            pass


@pytest.mark.unit
def test_a_write_in_progress_finishes_before_the_next_one(tmp_path: Path) -> None:
    """Cancelling a periodic save (shutdown) must not let its rename land after the final one."""
    indexer = sample_indexer()
    saver = snapshot.Snapshots(indexer, tmp_path / "index.json", 3600)
    release = threading.Event()
    original_write = saver._write
    order: list[str] = []

    def slow_write(partitions: list) -> int:
        release.wait(10)
        order.append(f"write of {len(partitions)} partitions")
        return original_write(partitions)

    async def scenario() -> None:
        saver._write = slow_write  # type: ignore[method-assign]
        periodic = asyncio.create_task(saver.save())
        await asyncio.sleep(0.01)  # it is now inside the thread
        periodic.cancel()
        saver._write = original_write  # type: ignore[method-assign]
        indexer.register(50, "late", "default", 8)
        final = asyncio.create_task(saver.save())
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(periodic, return_exceptions=True)
        await final

    asyncio.run(scenario())
    assert order == ["write of 3 partitions"]
    assert "late:default" in orjson.loads((tmp_path / "index.json").read_bytes())
