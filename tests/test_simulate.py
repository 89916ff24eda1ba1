"""The fleet simulator: pure fleet and trace expansion, then one small replay against both
services running as subprocesses."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import os
import random
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from support.reference_server import free_port, running_server, running_service

from dynamo_lite.client import SlotTrackerClient
from dynamo_lite.hashing import local_block_hashes, sequence_hashes
from dynamo_lite.indexer.core import Indexer
from dynamo_lite.indexer.protocols import parse_events_document
from dynamo_lite.simulate.__main__ import build_parser, main
from dynamo_lite.simulate.bound import fleet_lru_bound
from dynamo_lite.simulate.calls import percentile
from dynamo_lite.simulate.fleet import FleetConfig, RankCache, events_document
from dynamo_lite.simulate.metrics import RankLoad, TimeWeighted
from dynamo_lite.simulate.policies import RandomPolicy, RoundRobinPolicy
from dynamo_lite.simulate.progress import Progress
from dynamo_lite.simulate.trace import (
    BlockExpander,
    SimRequest,
    TraceError,
    TraceRecord,
    expand_trace,
    load_trace,
    parse_lines,
)

# --- fleet ------------------------------------------------------------------------------------


def path(*names: int) -> tuple[list[int], list[int]]:
    """(local, sequence) hashes of a prompt whose blocks have these local hashes."""
    local = list(names)
    return local, sequence_hashes(local)


def data(event: dict[str, Any] | None) -> dict[str, Any]:
    assert event is not None
    result: dict[str, Any] = event["event"]["data"]
    return result


@pytest.mark.unit
def test_first_admission_misses_and_publishes_one_chained_stored_event() -> None:
    rank = RankCache(3, 1, capacity=8)
    local, seq = path(11, 12, 13)
    admission = rank.admit(local, seq)
    assert (admission.cached_blocks, admission.evicted, admission.removed) == (0, (), None)
    stored = rank.stored_event(admission)
    assert stored == {
        "worker_id": 3,
        "storage_tier": "device",
        "event": {"event_id": 0, "dp_rank": 1, "data": {"stored": {
            "parent_hash": None,
            "blocks": [{"block_hash": s, "tokens_hash": t} for s, t in zip(seq, local, strict=True)],
        }}},
    }
    assert rank.used == rank.pinned == 3


@pytest.mark.unit
def test_a_shared_prefix_hits_and_the_new_tail_is_stored_under_it() -> None:
    rank = RankCache(1, 0, capacity=8)
    first = path(1, 2, 3)
    rank.stored_event(rank.admit(*first))
    rank.release(first[1])
    second = path(1, 2, 9, 10)
    admission = rank.admit(*second)
    assert admission.cached_blocks == 2
    stored = data(rank.stored_event(admission))["stored"]
    assert stored["parent_hash"] == second[1][1]
    assert [b["block_hash"] for b in stored["blocks"]] == second[1][2:]
    assert (rank.hit_blocks, rank.prompt_blocks) == (2, 7)


@pytest.mark.unit
def test_eviction_is_least_recent_leaf_first_and_emits_matching_removed_event() -> None:
    rank = RankCache(1, 0, capacity=4)
    a = path(1, 2, 3)  # a1 a2 a3
    b = path(1, 7)  # shares a1
    for prompt in (a, b):
        rank.stored_event(rank.admit(*prompt))
        rank.release(prompt[1])
    # LRU, oldest first: a3 a2 (released first), then b's path: b2, then the shared a1.
    assert rank.lru_order() == [a[1][2], a[1][1], b[1][1], a[1][0]]
    c = path(20, 21, 22)
    admission = rank.admit(*c)
    assert admission.evicted == (a[1][2], a[1][1], b[1][1])
    assert data(admission.removed) == {"removed": {"block_hashes": list(admission.evicted)}}
    assert admission.removed is not None and admission.removed["event"]["event_id"] == 2  # +1 per event
    assert rank.cached_hashes() == {a[1][0], *c[1]}


@pytest.mark.unit
def test_pinned_blocks_are_never_evicted_and_a_request_waits_until_they_are_released() -> None:
    rank = RankCache(1, 0, capacity=4)
    running = path(1, 2, 3)
    rank.admit(*running)
    waiting = path(5, 6)
    assert not rank.fits(waiting[1])
    with pytest.raises(MemoryError):
        rank.admit(*waiting)
    rank.release(running[1])
    assert rank.fits(waiting[1])
    admission = rank.admit(*waiting)
    assert admission.evicted == (running[1][2],)  # only as much as needed, the leaf


@pytest.mark.unit
def test_a_cached_prefix_about_to_be_reused_does_not_count_as_evictable_room() -> None:
    rank = RankCache(1, 0, capacity=4)
    old = path(1, 2, 3)
    rank.admit(*old)
    rank.release(old[1])
    # 1 free slot + 3 unpinned blocks, but 2 of those are the new request's own prefix.
    grow = path(1, 2, 8, 9, 10)
    assert not rank.fits(grow[1])
    assert rank.fits(path(1, 2, 8, 9)[1])


@pytest.mark.unit
def test_release_of_a_block_that_is_not_pinned_is_an_error() -> None:
    rank = RankCache(1, 0, capacity=4)
    prompt = path(1, 2)
    rank.admit(*prompt)
    rank.release(prompt[1])
    with pytest.raises(ValueError):
        rank.release(prompt[1])


@pytest.mark.unit
def test_random_workload_stays_prefix_closed_and_its_events_rebuild_the_cache_in_the_indexer() -> None:
    """Random prompts from a small prefix tree, random overlapping lifetimes. After every step:
    within capacity, prefix-closed, pinned blocks present; the published events, applied to the
    real indexer core, are accepted cleanly and the index holds exactly the cached blocks."""
    rng = random.Random(7)
    capacity = 40
    ranks = [RankCache(1, 0, capacity), RankCache(2, 0, capacity)]
    indexer = Indexer()
    running: list[tuple[RankCache, list[int]]] = []
    for _ in range(600):
        depth = rng.randint(1, 12)
        local = [rng.randint(0, 2) * 100 + position for position in range(depth)]  # 3 branches per level
        seq = sequence_hashes(local)
        rank = rng.choice(ranks)
        events = []
        if rank.fits(seq) and rng.random() < 0.7:
            admission = rank.admit(local, seq)
            for seq_hash in admission.evicted:
                assert not any(p == seq_hash for p in map(rank.parent_of, rank.cached_hashes()))
            events += [e for e in (admission.removed, rank.stored_event(admission)) if e is not None]
            running.append((rank, seq))
        elif running:
            done_rank, done_seq = running.pop(rng.randrange(len(running)))
            done_rank.release(done_seq)
        if events:
            report = indexer.apply_events(parse_events_document(events_document("m", "default", 16, events)))
            assert (report.rejected, report.skipped, report.gap_count, report.unknown_removals) == (0, 0, 0, 0)
        for cache in ranks:
            cached = cache.cached_hashes()
            assert cache.used <= capacity
            assert all(cache.parent_of(h) is None or cache.parent_of(h) in cached for h in cached)
        for owner, seq_hashes in running:
            assert all(h in owner for h in seq_hashes)
    counts = {(w.instance_id, r.dp_rank): r.blocks for w in indexer.workers() for r in w.ranks}
    assert counts == {(1, 0): ranks[0].used, (2, 0): ranks[1].used}


@pytest.mark.unit
def test_fleet_config_validates_and_times_prefill_and_decode() -> None:
    config = FleetConfig(workers=2, dp_size=2, prefill_tps=1000, decode_tps=50)
    assert config.rank_keys() == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert config.prefill_seconds(500) == 0.5 and config.decode_seconds(100) == 2.0
    with pytest.raises(ValueError):
        FleetConfig(kv_blocks=0)
    with pytest.raises(ValueError):
        FleetConfig(decode_tps=math.inf)


# --- trace ------------------------------------------------------------------------------------


def record(hash_ids: list[int], input_length: int | None = None, timestamp: int = 0) -> TraceRecord:
    length = input_length if input_length is not None else 512 * len(hash_ids)
    return TraceRecord(timestamp, length, 10, tuple(hash_ids))


@pytest.mark.unit
def test_shared_hash_id_prefixes_give_shared_blocks_and_nothing_more() -> None:
    expander = BlockExpander(64)
    a_local, a_seq = expander.expand(record([0, 1, 2]))
    b_local, b_seq = expander.expand(record([0, 1, 5]))
    c_local, c_seq = expander.expand(record([9, 1, 2]))
    assert len(a_seq) == 24
    assert a_seq[:16] == b_seq[:16] and a_seq[16] != b_seq[16]
    # Same content later in the prompt: same local hashes, different chained hashes.
    assert c_local[8:] == a_local[8:] and not set(c_seq) & set(a_seq)


@pytest.mark.unit
def test_expansion_is_dynamo_hashing_of_synthetic_tokens() -> None:
    expander = BlockExpander(16)
    local, seq = expander.expand(record([3, 8], input_length=700))
    tokens = [*range(3 * 512, 4 * 512), *range(8 * 512, 9 * 512)][:700]
    assert list(local) == local_block_hashes(tokens, 16)
    assert len(local) == 700 // 16  # the partial tail block is not hashed
    assert list(seq) == sequence_hashes(local)


@pytest.mark.unit
def test_memoised_chains_match_a_full_recomputation() -> None:
    expander = BlockExpander(128)
    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randint(0, 4) for _ in range(rng.randint(1, 6))]
        local, seq = expander.expand(record(ids, input_length=512 * len(ids) - rng.randint(0, 511)))
        assert list(seq) == sequence_hashes(local)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 10, "output_length": 1, "hash_ids": [1]}', "missing field 'timestamp'"),
        ('{"timestamp": 1.5, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "must be an integer"),
        ('{"timestamp": true, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "must be an integer"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length must be >= 1"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}', "output_length must be >= 0"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "1"}', "hash_ids must be an array"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', "hash_ids[0] must be"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [8388608]}', "hash_ids[0] must be"),
        ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}', "expected ceil(513/512) = 2"),
    ],
)
def test_bad_lines_are_rejected_with_their_location(line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(TraceError) as error:
        parse_lines([good, "", line], "t.jsonl")
    assert str(error.value).startswith("t.jsonl:3: ")
    assert message in str(error.value)


@pytest.mark.unit
def test_load_trace_limit_skips_blank_lines_and_refuses_an_empty_file(tmp_path: Path) -> None:
    lines = [json.dumps({"timestamp": t, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})
             for t in (0, 5, 9)]
    trace = tmp_path / "t.jsonl"
    trace.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    assert [r.timestamp_ms for r in load_trace(trace, limit=2)] == [0, 5]
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")


@pytest.mark.unit
def test_expand_trace_orders_by_arrival_stably_and_scales_time() -> None:
    records = [record([1], timestamp=2000), record([2], timestamp=1000), record([3], timestamp=1000)]
    requests = expand_trace(records, 64, time_scale=0.5)
    assert [(r.index, r.arrival) for r in requests] == [(1, 0.5), (2, 0.5), (0, 1.0)]
    with pytest.raises(ValueError):
        expand_trace(records, 48)


# --- the fleet-wide LRU bound ------------------------------------------------------------------


def sim_request(index: int, arrival: float, *local: int, block_size: int = 64) -> SimRequest:
    local_hashes, seq = path(*local)
    return SimRequest(index, arrival, len(local) * block_size, 10, tuple(local_hashes), tuple(seq))


@pytest.mark.unit
def test_the_bound_is_one_fleet_sized_lru_fed_in_arrival_order() -> None:
    config = FleetConfig(workers=2, kv_blocks=2, block_size=64)  # one LRU of 4 blocks
    requests = [
        sim_request(0, 0.0, 1, 2),
        sim_request(1, 1.0, 1, 2, 3),  # hits 1, 2
        sim_request(2, 2.0, 7, 8, 9),  # evicts 3 (the leaf), then 2: the least recent leaves
        sim_request(3, 3.0, 1, 2),  # only 1 is left
        sim_request(4, 0.5, 1),  # arrives second: hits 1
    ]
    bound = fleet_lru_bound(requests, config)
    assert bound.capacity_blocks == 4
    assert bound.prompt_tokens == 64 * (2 + 3 + 3 + 2 + 1)
    assert bound.cached_tokens == 64 * (0 + 1 + 2 + 0 + 1)
    assert bound.hit_ratio == pytest.approx(4 / 11)
    # Unbounded, every repeated prefix hits.
    assert fleet_lru_bound(requests, FleetConfig(workers=1, kv_blocks=100)).cached_tokens == 64 * (1 + 2 + 0 + 2)


# --- small pure helpers -----------------------------------------------------------------------


@pytest.mark.unit
def test_time_weighted_load_and_distinct_blocks() -> None:
    load = RankLoad(0.0)
    load.add(0.0, [1, 2, 3])
    load.add(2.0, [1, 2, 9])
    load.remove(3.0, [1, 2, 3], 0)
    assert (load.requests.value, load.blocks.value, load.blocks.peak) == (1, 3, 4)
    assert load.requests.average(0.0, 4.0) == pytest.approx((1 * 2 + 2 * 1 + 1 * 1) / 4)
    # Output blocks add to the decode blocks and leave with their request.
    load.grow_output(4.0, 2)
    assert load.blocks.value == 5
    load.remove(6.0, [1, 2, 9], 2)
    assert (load.requests.value, load.blocks.value) == (0, 0)
    assert load.blocks.average(0.0, 6.0) == pytest.approx((3 * 2 + 4 * 1 + 3 * 1 + 5 * 2) / 6)
    series = TimeWeighted(0.0)
    assert series.average(0.0, 0.0) == 0.0


@pytest.mark.unit
def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))


@pytest.mark.unit
def test_round_robin_and_seeded_random_policies() -> None:
    ranks = [(2, 0), (1, 0), (1, 1)]
    request = expand_trace([record([1])], 64)[0]

    async def picks(policy: RoundRobinPolicy | RandomPolicy, count: int) -> list[tuple[int, int]]:
        return [(await policy.place(request, [])).rank for _ in range(count)]

    assert asyncio.run(picks(RoundRobinPolicy(ranks), 4)) == [(1, 0), (1, 1), (2, 0), (1, 0)]
    first = asyncio.run(picks(RandomPolicy(ranks, 5), 20))
    assert first == asyncio.run(picks(RandomPolicy(ranks, 5), 20)) and len(set(first)) == 3


@pytest.mark.unit
def test_progress_draws_only_when_enabled() -> None:
    stream = io.StringIO()
    progress = Progress("kv", stream=stream, enabled=True, interval=0)
    progress(5, 10)
    progress(10, 10)
    progress.close()
    assert "5/10 (50%)" in stream.getvalue() and stream.getvalue().endswith("\n")
    quiet = io.StringIO()
    Progress("kv", stream=quiet)(1, 2)  # StringIO is not a terminal
    assert quiet.getvalue() == ""


@pytest.mark.unit
def test_unreachable_services_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(conversation_trace(conversations=1, turns=1)[0] + "\n")
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["--trace", str(trace), "--slot-tracker", dead, "--indexer", dead, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "python -m dynamo_lite.stack --services-only" in err and "SLOT_TRACKER_URL" in err, err
    assert err.count("\n") == 1, err


@pytest.mark.unit
def test_a_prompt_larger_than_a_rank_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(conversation_trace(conversations=1, turns=1)[0] + "\n")
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["--trace", str(trace), "--kv-blocks", "2", "--slot-tracker", dead, "--indexer", dead]) == 2
    assert "raise --kv-blocks" in capsys.readouterr().err


# --- end to end -------------------------------------------------------------------------------


def conversation_trace(conversations: int = 40, turns: int = 5, seed: int = 1) -> list[str]:
    """Multi-turn chats: a shared 2-id system prompt, then each turn re-sends the conversation's
    history plus 1-2 new hash ids; turns 5-20 s apart."""
    rng = random.Random(seed)
    next_id = 2
    lines = []
    for _ in range(conversations):
        history = [0, 1]
        clock = rng.uniform(0, 60_000)
        for _ in range(turns):
            for _ in range(rng.randint(1, 2)):
                history.append(next_id)
                next_id += 1
            input_length = 512 * len(history) - rng.randint(0, 300)
            lines.append(json.dumps({
                "timestamp": int(clock), "input_length": input_length,
                "output_length": rng.randint(20, 200), "hash_ids": list(history),
            }))
            clock += rng.uniform(5_000, 20_000)
    return lines


@pytest.mark.process
def test_replay_against_both_services(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "chats.jsonl"
    trace.write_text("\n".join(conversation_trace()) + "\n")
    slot_port, indexer_port = free_port(), free_port()
    python = sys.executable
    with running_server([python, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1", "--port", str(slot_port),
                         "--log-level", "warning"], slot_port) as slot_url, \
            running_server([python, "-m", "dynamo_lite.indexer", "--host", "127.0.0.1", "--port", str(indexer_port),
                            "--log-level", "warning"], indexer_port) as indexer_url:
        common = ["--trace", str(trace), "--workers", "4", "--kv-blocks", "256", "--block-size", "64",
                  "--prefill-tps", "4000", "--decode-tps", "40", "--slot-tracker", slot_url,
                  "--indexer", indexer_url, "--seed", "3", "--quiet"]
        assert main([*common, "--policy", "all", "--json"]) == 0
        document = orjson.loads(capsys.readouterr().out)
        assert main([*common, "--policy", "kv", "--json"]) == 0
        again = orjson.loads(capsys.readouterr().out)
        assert main([*common, "--policy", "round_robin", "--limit", "20"]) == 0
        table = capsys.readouterr().out

        # A model name in use is refused, and the other user's worker stays registered.
        with SlotTrackerClient(slot_url) as slot_tracker:
            slot_tracker.register(1, "taken", 64)
            assert main([*common, "--policy", "random", "--model-name", "taken"]) == 1
            assert "409" in capsys.readouterr().err
            assert [w.worker_id for w in slot_tracker.workers("taken")] == [1]

    results = {r["policy"]: r for r in document["results"]}
    assert list(results) == ["kv", "kv_approx", "round_robin", "random", "least_loaded"]
    assert document["fleet"]["workers"] == 4 and "load" in document["definitions"]
    bound = document["bound"]
    assert bound["capacity_blocks"] == 4 * 256 and 0 < bound["hit_ratio"] <= 1
    # Every output block the trace's requests fill before their last token, reported once.
    output_blocks = sum(-(-r["output_length"] // 64) - 1 for r in map(json.loads, trace.read_text().splitlines()))
    for result in results.values():
        assert result["requests"] == 200
        assert 0 <= result["hit_ratio"] <= 1
        assert result["hit_ratio_of_bound"] == pytest.approx(result["hit_ratio"] / bound["hit_ratio"])
        assert result["ttft_seconds"]["p99"] >= result["ttft_seconds"]["mean"] > 0
        assert result["load"]["active_requests"]["max"] >= result["load"]["active_requests"]["mean"] > 0
        assert sum(result["load"]["routed_per_rank"].values()) == 200
        assert result["checks"]["slot_tracker_idle_at_end"]
        calls = {(c["service"], c["route"]): c["calls"] for c in result["calls"]}
        assert calls[("slot_tracker", "/output_blocks")] == output_blocks > 0
        assert {("slot_tracker", "/add"), ("slot_tracker", "/prefill_complete"), ("slot_tracker", "/free")} <= set(calls)
        ingest = result["indexer_ingest"]
        if result["policy"] == "kv_approx":  # its engines publish nothing: the router records
            assert ingest["documents"] == 0 and ("indexer", "/events") not in calls
            assert calls[("indexer", "/routed")] == 200
            assert "indexer_matches_fleet" not in result["checks"]
            continue
        assert ingest["applied"] > 0 and ("indexer", "/events") in calls
        assert (ingest["rejected"], ingest["skipped"], ingest["gap_count"], ingest["unknown_removals"]) == (0, 0, 0, 0)
        assert result["checks"]["indexer_matches_fleet"]
        assert ("indexer", "/routed") not in calls
    assert ("indexer", "/query_by_hash") in {(c["service"], c["route"]) for c in results["kv"]["calls"]}
    for routed in ("kv", "kv_approx"):
        assert results[routed]["hit_ratio"] >= results["round_robin"]["hit_ratio"]
        assert results[routed]["hit_ratio"] >= results["random"]["hit_ratio"]
        assert results[routed]["expected_cached_tokens"] > 0

    # Same seed, fresh services state: the same simulated outcome.
    rerun = again["results"][0]
    for key in ("hit_ratio", "ttft_seconds", "load", "evicted_blocks"):
        assert rerun[key] == results["kv"][key]
    assert "hit ratio" in table and "round_robin" in table and "slot_tracker /add" in table


# --- the bundled sample trace -----------------------------------------------------------------


@pytest.mark.unit
def test_the_default_trace_is_the_bundled_sample_and_loads() -> None:
    data_dir = resources.files("dynamo_lite.simulate") / "data"
    default = build_parser().parse_args([]).trace
    assert Path(default) == Path(str(data_dir / "conversation_sample.jsonl"))
    records = load_trace(default)
    assert len(records) == 300
    stamps = [r.timestamp_ms for r in records]
    assert stamps[0] == 0 and stamps == sorted(stamps) and stamps[-1] > 0
    assert all(r.hash_ids for r in records)
    # The README beside it names where it comes from and the file's exact digest.
    readme = (data_dir / "README.md").read_text()
    digest = hashlib.sha256((data_dir / "conversation_sample.jsonl").read_bytes()).hexdigest()
    assert digest in readme and "kvcache-ai/Mooncake" in readme and "Apache License 2.0" in readme


@pytest.mark.process
def test_simulate_without_trace_replays_the_bundled_sample(tmp_path: Path) -> None:
    python = sys.executable
    with running_service("slot_tracker") as slot_url, running_service("indexer") as indexer_url:
        # The services' addresses from the environment, as the examples take them; instance 1
        # already belongs to another model, so the default worker ids (1..8) clash.
        env = {**os.environ, "SLOT_TRACKER_URL": str(slot_url), "INDEXER_URL": str(indexer_url)}
        other = {"instance_id": 1, "model_name": "someone-else", "block_size": 16}
        assert httpx.post(f"{indexer_url}/register", json=other).status_code == 201
        clash = subprocess.run([python, "-m", "dynamo_lite.simulate", "--limit", "5", "--policy", "kv", "--quiet"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert clash.returncode == 1, clash
        assert clash.stderr.count("\n") == 1 and "instance 1" in clash.stderr and "Traceback" not in clash.stderr
        # Another working directory: the sample is found through the package, not the cwd.
        done = subprocess.run(
            [python, "-m", "dynamo_lite.simulate", "--limit", "40", "--worker-id-base", "101", "--quiet"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        assert [worker["instance_id"] for worker in httpx.get(f"{indexer_url}/workers").json()] == [1]
    assert done.returncode == 0, done.stderr
    assert "; 40 requests," in done.stdout and "hit ratio" in done.stdout
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) +(\d\.\d+) ", done.stdout, re.MULTILINE)}
    assert set(rows) == {"kv", "kv_approx", "round_robin", "random", "least_loaded"}
    assert all(0 <= ratio <= 1 for ratio in rows.values())
