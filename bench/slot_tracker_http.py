"""Slot-tracker scenarios over HTTP: `GET /health`, `GET /loads`, `POST /potential_loads`, the
lifecycle mix, and `/potential_loads` at 10 / 1k / 10k active requests x 16 / 256 ranks.

Ours and the reference get the same registrations and `/add`s (bench/seed.py); the stub gets,
as canned answers, the very bytes ours answered, so its payloads are ours.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import httpx
import orjson

from . import profiling
from .runner import CONNECTIONS, HEAVY_CONNECTIONS, Load, Results, measure_point, progress
from .seed import (
    TrackerShape,
    hash_lists,
    potential_loads_body,
    query_hashes,
    register_tracker,
    reset_tracker,
    seed_tracker,
    shape_for,
    unseed_tracker,
    write_hash_lists,
)
from .servers import ROLES, Server, running_servers
from .stub import CANNED_PATH

MODEL = "bench"
ACTIVE_REQUESTS = 200
LIFECYCLE_MODEL = "bench-lifecycle"
LIFECYCLE_LISTS = 256
# /prefill_complete and /free trail their /add by this many steps (see lua/lifecycle.lua), so
# ~2 x LAG requests stay active, as in a busy fleet. It must be large: under load at c=64 our
# server answered the first request of some fresh connections only after ~1,500 others
# (the /prefill_complete got a 404 with a lag of 512 steps; none in runs with 2048).
LIFECYCLE_LAG = 2048
SCALING_RANKS = (16, 256)
SCALING_ACTIVE = (10, 1_000, 10_000)
# Both trackers free a request 300 s after its /add (the reference's is fixed): the state is
# seeded again before a run could end past this age.
SAFE_STATE_AGE_S = 240.0

MAIN_SCENARIOS = ("health", "loads", "potential_loads", "lifecycle")
SCENARIOS = (*MAIN_SCENARIOS, "scale_potential_loads")
STATEFUL_ROLES = ("ours", "reference")


class SeededTrackers:
    """One tracker with active requests on ours and on the reference, kept younger than the
    request TTL: `prepare` (run before every warm-up) re-seeds a server whose state would
    otherwise age past SAFE_STATE_AGE_S during the next run."""

    def __init__(self, servers: dict[str, Server], shape: TrackerShape, lists: list[list[int]]) -> None:
        self.servers = {role: servers[role] for role in STATEFUL_ROLES if role in servers}
        self.shape = shape
        self.lists = lists
        self.seeded_at: dict[str, float] = {}

    def seed(self) -> None:
        for role, server in self.servers.items():
            started = time.monotonic()
            seed_tracker(server.url, self.shape, self.lists)
            self.seeded_at[role] = time.monotonic()
            progress(f"seeded {role}: {len(self.lists)} active requests on {self.shape.ranks} ranks "
                     f"in {self.seeded_at[role] - started:.1f} s")

    def prepare(self, role: str, seconds: float) -> None:
        seeded = self.seeded_at.get(role)
        if seeded is not None and time.monotonic() - seeded + seconds > SAFE_STATE_AGE_S:
            server = self.servers[role]
            unseed_tracker(server.url, self.shape)
            seed_tracker(server.url, self.shape, self.lists)
            self.seeded_at[role] = time.monotonic()

    def drop(self) -> None:
        for server in self.servers.values():
            unseed_tracker(server.url, self.shape)
        self.seeded_at.clear()


def set_canned(stub: Server, path: str, answer: httpx.Response) -> None:
    body = {"path": path, "status": answer.status_code, "body": answer.text}
    response = httpx.post(stub.url + CANNED_PATH, content=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}, timeout=30)
    response.raise_for_status()


def run(results: Results, selected: Collection[str], ref_python: Path) -> None:
    if not any(name in selected for name in SCENARIOS):
        return
    settings = results.settings
    progress("slot tracker: starting ours, the reference and the stub (server CPU 0)")
    with running_servers("slot_tracker", ref_python) as servers, \
            tempfile.TemporaryDirectory(prefix="bench_tracker_") as scratch:
        work = Path(scratch)
        ours = servers["ours"]

        if "health" in selected:
            measure_point(results, "health", "no state", servers, ROLES, CONNECTIONS, settings.repetitions,
                          lambda role, run_id: Load("get.lua", ["/health"]))

        if "loads" in selected or "potential_loads" in selected:
            shape = shape_for(MODEL, 16)
            lists = hash_lists(ACTIVE_REQUESTS, seed=1)
            body = potential_loads_body(MODEL, query_hashes(lists, seed=1))
            body_file = work / "potential_loads.json"
            body_file.write_bytes(body)
            seeded = SeededTrackers(servers, shape, lists)
            seeded.seed()
            loads_path = f"/loads?model_name={MODEL}"
            with httpx.Client(base_url=ours.url, timeout=30) as client:
                set_canned(servers["stub"], "/loads", client.get(loads_path))
                set_canned(servers["stub"], "/potential_loads", client.post(
                    "/potential_loads", content=body, headers={"Content-Type": "application/json"}))
            label = f"16 ranks, {ACTIVE_REQUESTS} active"
            points = {"loads": Load("get.lua", [loads_path]),
                      "potential_loads": Load("post_static.lua", ["/potential_loads", str(body_file)])}
            for name, load in points.items():
                if name not in selected:
                    continue
                measure_point(results, name, label, servers, ROLES, CONNECTIONS, settings.repetitions,
                              lambda role, run_id, load=load: load, seeded.prepare)
                if settings.profile:
                    seeded.prepare("ours", settings.warmup_s + settings.duration_s)
                    profiling.profile_ours(results, name, ours, load, HEAVY_CONNECTIONS, settings.duration_s)
            seeded.drop()

        if "lifecycle" in selected:
            _lifecycle(results, servers, work)

        if "scale_potential_loads" in selected:
            for ranks in SCALING_RANKS:
                for active in SCALING_ACTIVE:
                    _scaling_point(results, servers, work, ranks, active)


def _lifecycle(results: Results, servers: dict[str, Server], work: Path) -> None:
    settings = results.settings
    shape = shape_for(LIFECYCLE_MODEL, 16)
    lists_file = work / "lifecycle_hashes.jsonl"
    write_hash_lists(lists_file, hash_lists(LIFECYCLE_LISTS, seed=2))
    for role in STATEFUL_ROLES:
        with httpx.Client(base_url=servers[role].url, timeout=30) as client:
            register_tracker(client, shape)
    _can_lifecycle_answers(servers["ours"], servers["stub"], shape)

    def prepare(role: str, seconds: float) -> None:
        # Each wrk run ends with ~2 x LAG requests never freed: start every run from none.
        if role in STATEFUL_ROLES:
            reset_tracker(servers[role].url, shape)

    def load_for(role: str, run_id: str) -> Load:
        return Load("lifecycle.lua", [run_id, shape.model, str(lists_file), str(shape.workers),
                                      str(shape.dp_size), str(LIFECYCLE_LAG)])

    label = "256 hashes, unique ids"
    measure_point(results, "lifecycle", label, servers, ROLES, CONNECTIONS, settings.repetitions, load_for, prepare)
    if settings.profile:
        prepare("ours", 0)
        load = load_for("ours", f"profile-{time.monotonic_ns()}")
        profiling.profile_ours(results, "lifecycle", servers["ours"], load, HEAVY_CONNECTIONS, settings.duration_s)
    for role in STATEFUL_ROLES:
        unseed_tracker(servers[role].url, shape)


def _can_lifecycle_answers(ours: Server, stub: Server, shape: TrackerShape) -> None:
    """The stub answers /add, /prefill_complete and /free with ours' status and bytes."""
    hashes = hash_lists(1, seed=3)[0]
    by_id = {"model_name": shape.model, "request_id": "canned"}
    add = {**by_id, "worker_id": 1, "dp_rank": 0, "sequence_hashes": hashes, "new_isl_tokens": 4096}
    with httpx.Client(base_url=ours.url, timeout=30) as client:
        for path, body in (("/add", add), ("/prefill_complete", by_id), ("/free", by_id)):
            set_canned(stub, path, client.post(path, content=orjson.dumps(body),
                                                headers={"Content-Type": "application/json"}))


def _scaling_point(results: Results, servers: dict[str, Server], work: Path, ranks: int, active: int) -> None:
    """Ours and the reference only: the stub's cost does not depend on server state."""
    shape = shape_for(f"scale-{ranks}-{active}", ranks)
    lists = hash_lists(active, seed=4)
    body_file = work / f"scale_{ranks}_{active}.json"
    body_file.write_bytes(potential_loads_body(shape.model, query_hashes(lists, seed=4)))
    seeded = SeededTrackers(servers, shape, lists)
    seeded.seed()
    load = Load("post_static.lua", ["/potential_loads", str(body_file)])
    settings = results.settings
    measure_point(results, "scale_potential_loads", f"{ranks} ranks, {active:,} active", servers, STATEFUL_ROLES,
                  (HEAVY_CONNECTIONS,), settings.scaling_repetitions, lambda role, run_id: load, seeded.prepare)
    if settings.profile and (ranks, active) == (SCALING_RANKS[-1], SCALING_ACTIVE[-1]):
        # The largest state: where a cost that grows with state would show.
        seeded.prepare("ours", settings.warmup_s + settings.duration_s)
        profiling.profile_ours(results, f"potential_loads_{ranks}_ranks_{active}_active", servers["ours"], load,
                               HEAVY_CONNECTIONS, settings.duration_s)
    seeded.drop()
