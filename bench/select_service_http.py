"""The selection service over HTTP: `/select_and_reserve` and the reservation lifecycle
(`prefill_complete`, `output_block` with `{}`, `DELETE`) per core, ours and Dynamo 1.6.1's
`dynamo.select_service` in the same run, and each route's latency at one connection.

* Servers: ours with `--cost dynamo` ("ours": Dynamo's cost, like for like), ours with its
  default cost ("ours_ttft": what users run), the reference and the stub, each alone on the
  server CPU. The reference runs with `DYN_LOG=warn`: at its default level it logs a line per
  selection, which ours (at `--log-level warning`, as in every bench) does not.
* State: 16 workers (block size 16), each a vLLM engine publisher (`EnginePublisher`,
  `WireFormat.VLLM`) that every stateful server subscribes to itself; before measuring, the
  engines publish the Mooncake fill of bench/select_data.py (~512k pairs) and a sentinel block
  each, and the suite waits until every server's `/overlap_scores` sees all 16 sentinels.
* Load (lua/select_lifecycle.lua): 256 distinct 4,096-token prompts in turn, each selection
  under a fresh id; `prefill_complete` and `output_block` trail their selection by LAG steps and
  `DELETE` by 2 x LAG, so ~2 x LAG reservations (128 a worker) stay booked, as in a busy fleet.
  After every wrk run (warm-ups too) the suite deletes what it left booked and checks with
  `GET /loads` that no reservation is left, so every run starts from the same state.
* Two prompt forms, one scenario each: `token_ids` (the service hashes 256 blocks per request;
  what a gateway that holds the tokens sends) and the hash form (`block_hashes`,
  `sequence_hashes`, `isl_tokens`: the caller hashed them).

The stub answers the four routes with ours' bytes (its body decoded), so ours ÷ stub is what
the selection itself costs on our serving path.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import httpx
import zmq

from dynamo_lite.kv_publishers import EnginePublisher, WireFormat

from . import profiling
from .index_data import BLOCK_SIZE, WORKERS, load_trace, sentinel_event
from .indexer_http import _expect
from .runner import CONNECTIONS, HEAVY_CONNECTIONS, Load, Results, measure_point, progress
from .select_data import FILL_PAIRS, HASH_FORM, TOKEN_FORM, PromptForm, index_fill, stored, trace_prompts
from .servers import Server, running_servers
from .slot_tracker_http import set_canned
from .wrk import WrkResult

MODEL = "bench"
SCENARIOS = {"select_lifecycle": TOKEN_FORM, "select_lifecycle_hashes": HASH_FORM}
ROLES = ("ours", "ours_ttft", "reference", "stub")
STATEFUL_ROLES = ("ours", "ours_ttft", "reference")
FLAGS = {"ours": ["--cost", "dynamo"]}
ENV = {"reference": {"DYN_LOG": "warn"}}
# Steps between a selection and its prefill_complete / output_block (its DELETE: twice this):
# far above the connection count (see lua/lifecycle.lua), and 2 x LAG = 2,048 reservations
# booked, 128 per worker.
LAG = 1024
SYNC_TIMEOUT_S = 300.0
# Delete passes over a run's leftover reservations, and the wait between them.
LEFTOVER_ATTEMPTS = 4
LEFTOVER_RETRY_S = 0.25
JSON = {"Content-Type": "application/json"}


def run(results: Results, selected: Collection[str], ref_python: Path) -> None:
    forms = {name: form for name, form in SCENARIOS.items() if name in selected}
    if not forms:
        return
    progress("selection service: starting ours (--cost dynamo and the default cost), the reference and the stub")
    context = zmq.Context()
    engines = [EnginePublisher(WireFormat.VLLM, context=context, replay=False) for _ in range(WORKERS)]
    try:
        with running_servers("select_service", ref_python, ROLES, flags=FLAGS, env=ENV) as servers, \
                tempfile.TemporaryDirectory(prefix="bench_select_") as scratch:
            prompts = _fill(results, servers, engines)
            for scenario, form in forms.items():
                Lifecycle(results, servers, scenario, form, Path(scratch)).measure(prompts)
    finally:
        for engine in engines:
            engine.close()
        context.term()


class Lifecycle:
    """One scenario's wrk runs: their load, and what the suite does after each."""

    def __init__(self, results: Results, servers: dict[str, Server], scenario: str, form: PromptForm,
                 scratch: Path) -> None:
        self.results = results
        self.servers = servers
        self.scenario = scenario
        self.form = form
        self.scratch = scratch
        self.bodies = scratch / f"{scenario}.jsonl"

    def measure(self, prompts: list[list[int]]) -> None:
        settings = self.results.settings
        self.bodies.write_bytes(b"\n".join(self.form.lines(MODEL, prompts)) + b"\n")
        _can_answers(self.servers, self.form, prompts[0])
        label = f"16 workers, 4,096-token prompts as {self.form.name}"
        measure_point(self.results, self.scenario, label, self.servers, ROLES, CONNECTIONS, settings.repetitions,
                      self.load_for, finished=self.finished)
        if settings.profile:
            for role in ("ours", "ours_ttft"):
                run_id = f"profile-{role}-{time.monotonic_ns()}"
                result = profiling.profile_ours(self.results, f"{self.scenario}_{role}", self.servers[role],
                                                self.load_for(role, run_id), HEAVY_CONNECTIONS, settings.duration_s)
                if result is not None:
                    self.finished(role, run_id, result)

    def latency_file(self, run_id: str) -> Path:
        return self.scratch / f"{run_id}.latency"

    def load_for(self, role: str, run_id: str) -> Load:
        return Load("select_lifecycle.lua", [run_id, str(self.bodies), str(LAG), str(self.latency_file(run_id))])

    def finished(self, role: str, run_id: str, result: WrkResult) -> None:
        """Per-route latencies into the run's `extra` (one connection), then the run's
        reservations freed."""
        latencies = self.latency_file(run_id)
        if result.extra.get("timed"):
            result.extra["routes"] = route_latencies(latencies.read_text())
        latencies.unlink(missing_ok=True)
        if role in STATEFUL_ROLES:
            _free_leftovers(self.results, self.scenario, self.servers[role], run_id, result)


def _fill(results: Results, servers: dict[str, Server], engines: list[EnginePublisher]) -> list[list[int]]:
    """Register the 16 workers on every stateful server, publish the fill from their engines,
    wait until every server applied it; the prompts to select for."""
    started = time.monotonic()
    for role in STATEFUL_ROLES:
        with httpx.Client(base_url=servers[role].url, timeout=30) as client:
            for worker, engine in enumerate(engines, start=1):
                answer = _expect(client.post("/workers", json={
                    "worker_id": worker, "model_name": MODEL, "endpoint": f"http://worker-{worker}:8000",
                    "block_size": BLOCK_SIZE, "kv_events_endpoint": engine.endpoint}), 201)
                if answer.json().get("lifecycle") != "schedulable":
                    raise RuntimeError(f"{role}: worker {worker} is not schedulable: {answer.text[:300]}")
    for engine in engines:
        engine.wait_for_subscribers(len(STATEFUL_ROLES))
    trace = load_trace()
    fill = index_fill(trace, WORKERS)
    events = list(fill.events(FILL_PAIRS))
    for event in events:
        engines[event.worker - 1].publish([stored(event)])
    sentinels = [sentinel_event(worker, 1) for worker in range(1, WORKERS + 1)]
    for event in sentinels:
        engines[event.worker - 1].publish([stored(event)])
    for role in STATEFUL_ROLES:
        _wait_for_blocks(servers[role], sentinels[0].tokens, WORKERS)
    prompts = trace_prompts(trace, fill.requests_used)
    progress(f"selection service: {fill.pairs:,} (block, worker) pairs from {fill.requests_used:,} trace requests "
             f"published by {WORKERS} engines and applied by {', '.join(STATEFUL_ROLES)} in "
             f"{time.monotonic() - started:.1f} s")
    results.meta["select_service"] = {"pairs": fill.pairs, "trace_requests": fill.requests_used,
                                      "prompts": len(prompts), "cached": _cached_prefixes(results, servers, prompts)}
    return prompts


def _wait_for_blocks(server: Server, tokens: list[int], workers: int) -> None:
    """Until `server`'s /overlap_scores shows a device block of `tokens` on `workers` workers:
    each engine published them last, and ZMQ keeps each publisher's order."""
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    body = {"model_name": MODEL, "token_ids": tokens}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while True:
            rows = _expect(client.post("/overlap_scores", json=body), 200).json()["workers"]
            if sum(1 for row in rows if row["device_blocks"]) >= workers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.role} did not apply the engines' events within {SYNC_TIMEOUT_S:.0f} s")
            time.sleep(0.05)


def _cached_prefixes(results: Results, servers: dict[str, Server], prompts: list[list[int]]) -> dict[str, int]:
    """How many prompts have how many tokens cached on their best worker (ours' /overlap_scores,
    checked equal to the reference's: the same index on both)."""
    counts: dict[str, int] = {}
    differ = 0
    with httpx.Client(base_url=servers["ours"].url, timeout=30) as ours, \
            httpx.Client(base_url=servers["reference"].url, timeout=30) as reference:
        for tokens in prompts:
            body = {"model_name": MODEL, "token_ids": tokens}
            rows = {role: sorted((row["worker_id"], row["device_blocks"])
                                 for row in _expect(client.post("/overlap_scores", json=body), 200).json()["workers"])
                    for role, client in (("ours", ours), ("reference", reference))}
            differ += rows["ours"] != rows["reference"]
            best = max(blocks for _, blocks in rows["ours"]) * BLOCK_SIZE
            counts[str(best)] = counts.get(str(best), 0) + 1
    if differ:
        results.note(f"select_service: /overlap_scores differ between ours and the reference for {differ} of "
                     f"{len(prompts)} prompts")
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def _can_answers(servers: dict[str, Server], form: PromptForm, tokens: list[int]) -> None:
    """The stub answers the four routes with ours' status and bytes for the same requests."""
    selection_id = f"canned-{time.monotonic_ns()}"
    calls = [("POST", "/select_and_reserve", "/select_and_reserve", form.body(MODEL, tokens, selection_id)),
             ("POST", f"/reservations/{selection_id}/prefill_complete",
              "/reservations/{selection_id}/prefill_complete", b""),
             ("POST", f"/reservations/{selection_id}/output_block", "/reservations/{selection_id}/output_block", b"{}"),
             ("DELETE", f"/reservations/{selection_id}", "/reservations/{selection_id}", None)]
    with httpx.Client(base_url=servers["ours"].url, timeout=30) as client:
        for method, path, route, body in calls:
            answer = client.request(method, path, content=body, headers=JSON if body else None)
            set_canned(servers["stub"], route, _expect(answer, 200))


def route_latencies(text: str) -> dict[str, dict[str, float]]:
    """Per route, the count and p50 / p90 / p99 (nearest rank, microseconds) of a latency file
    (lines `<route> <microseconds>`, as lua/select_lifecycle.lua writes them)."""
    by_route: dict[str, list[float]] = {}
    for line in text.splitlines():
        route, _, value = line.partition(" ")
        if value:
            by_route.setdefault(route, []).append(float(value))
    summary = {}
    for route, values in by_route.items():
        values.sort()
        summary[route] = {"count": len(values), **{f"p{p}_us": values[max(0, math.ceil(len(values) * p / 100) - 1)]
                                                   for p in (50, 90, 99)}}
    return summary


def _free_leftovers(results: Results, scenario: str, server: Server, run_id: str, result: WrkResult) -> None:
    """Delete the reservations a wrk run left booked (its last 2 x LAG selections, whose DELETE
    it never sent), then check that none is left. A selection wrk sent just before it closed its
    connections may be booked after its DELETE (a loaded server, the reference's worker threads,
    answer it late): the deletes are sent again while some are left, a few times."""
    steps = int(result.extra.get("steps", -1))
    if steps < 0:
        raise RuntimeError(f"{scenario}: the wrk run {run_id} did not report its steps")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for attempt in range(LEFTOVER_ATTEMPTS):
            if attempt:
                time.sleep(LEFTOVER_RETRY_S)
            for step in range(max(0, steps - 2 * LAG - 1), steps + 1):
                client.delete(f"/reservations/{run_id}-{step}")
            loads = _expect(client.get("/loads", params={"model_name": MODEL}), 200).json()
            left = _active_requests(loads)
            if not left:
                break
    if left:
        results.note(f"{scenario} {server.role}: {left} reservations still booked after run {run_id} was cleared")


def _active_requests(loads: Any) -> int:
    """Active requests over every rank of a `/loads` answer (a list of partitions)."""
    return sum(row["active_requests"] for partition in loads for row in partition["loads"])

