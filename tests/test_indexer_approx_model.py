"""The index with approximations (`/routed`) against a simple model, as a hypothesis state machine.

Model, per rank of one partition:

* exact blocks: `ModelWorker` of tests/test_indexer_model.py (chains stored by events, removed
  by name, cleared), with its lower tiers;
* approximations: an ordered map (rank, prompt prefix) -> expiry, in the order they go when the
  bound is hit: routing a prompt puts each of its prefixes at the end, the longest first (a
  refreshed one moves). An approximation counts while now < expiry; the bound (MAX_APPROXIMATIONS)
  drops the first ones, after the expired ones are gone;
* a rank's device score: the longer of its exact score and its approximate score, the largest k
  such that every prefix query[:j], j <= k, is approximated; its host-pinned and disk blocks
  count from its exact score, and only past the device score;
* a `removed` event of a rank drops the approximations of the prefixes it names; `cleared`, an
  engine restart and unregistering drop all of the rank's;
* `source`: `events` once the rank has had an event or was registered with an endpoint,
  `approximate` once a route recorded blocks for it, `none` before either.

Steps: events storing, removing (tail-first and mid-chain) and clearing exact blocks, routes,
the clock moving (by up to a TTL), sweeps, registrations, unregistrations, engine restarts.
After each step every prompt's answer, every rank's counts and source must be the model's, and a
dump reloaded into a fresh index answers the same.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.fake_clock import Clock
from support.indexer_model import LOCALS, ModelWorker, external, model_match

from dynamo_lite.base.errors import Conflict
from dynamo_lite.hashing import to_signed_list
from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.approx import shadow_of
from dynamo_lite.indexer.core import ApplyReport, Indexer
from dynamo_lite.indexer.protocols import LOWER_TIERS, parse_events_document
from dynamo_lite.indexer.tree import StoreStatus

pytestmark = pytest.mark.unit

MODEL, TENANT, BLOCK = "m", "default", 4
ANCHOR = (99, 0)  # always registered, so the partition never goes away
RANKS = [(1, 0), (1, 1), (2, 0), (3, 0)]  # (3, 0) names its blocks with another seed
TTL = 10.0
MAX_APPROXIMATIONS = 12

Path = tuple[int, ...]


@dataclass
class ModelRank:
    source: str = "none"
    registered: bool = False


class ApproximateIndexModel(RuleBasedStateMachine):
    @initialize(
        prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=2, max_size=4),
        register_first=st.booleans(),
    )
    def setup(self, prompts: list[list[int]], register_first: bool) -> None:
        self.prompts: list[list[int]] = []
        for content in prompts:  # prompts share prefixes, as the turns of a conversation do
            base = self.prompts[len(content) % len(self.prompts)] if self.prompts else []
            self.prompts.append(base[: len(content) // 2] + [LOCALS[c] for c in content])
        self.clock = Clock()
        self.indexer = Indexer(approx_ttl_secs=TTL, approx_max_blocks=MAX_APPROXIMATIONS, clock=self.clock,
                               wall_clock=self.clock.wall)
        self.indexer.register(ANCHOR[0], MODEL, TENANT, BLOCK)
        self.ranks: dict[tuple[int, int], ModelRank] = {ANCHOR: ModelRank("none", True)}
        self.exact: dict[tuple[int, int], ModelWorker] = {}
        self.approximations: OrderedDict[tuple[tuple[int, int], Path], float] = OrderedDict()
        self.event_ids: dict[tuple[int, int], int] = {}
        if register_first:
            self.register(RANKS[0], False)

    # --- the model's own bookkeeping ----------------------------------------------------------

    def _expire(self) -> int:
        """What the index does first on every route, query, sweep and dump."""
        due = [key for key, expires in self.approximations.items() if expires <= self.clock.now]
        for key in due:
            del self.approximations[key]
        return len(due)

    def _forget(self, key: tuple[int, int]) -> None:
        for doomed in [k for k in self.approximations if k[0] == key]:
            del self.approximations[doomed]

    def _event(self, key: tuple[int, int], data: object, tier: str = "device") -> ApplyReport:
        event_id = self.event_ids.get(key, 0)
        self.event_ids[key] = event_id + 1
        event = {"event_id": event_id, "dp_rank": key[1], "data": data}
        document = {f"{MODEL}:{TENANT}": {"block_size": BLOCK, "events": [
            {"worker_id": key[0], "storage_tier": tier, "event": event}]}}
        report = self.indexer.apply_events(parse_events_document(document))
        assert report.skipped == 0
        self.ranks.setdefault(key, ModelRank()).source = "events"
        return report

    def _store(self, key: tuple[int, int], prompt: list[int], start: int, end: int, tier: str) -> None:
        """prompt[start:end] under the chain before it, on `tier`, in the model and the index."""
        names = self._names(key, prompt, end)
        parent = names[start - 1] if start else None
        status = self.exact.setdefault(key, ModelWorker()).store(parent, names[start:end], prompt[start:end], tier)
        report = self._event(key, {"stored": {"parent_hash": parent, "blocks": [
            {"block_hash": name, "tokens_hash": local} for name, local in zip(names[start:end], prompt[start:end])]}},
            tier)
        assert report.rejected == (status is not StoreStatus.STORED)

    def _names(self, key: tuple[int, int], prompt: list[int], end: int) -> list[int]:
        return [external(key, tuple(prompt[: i + 1])) for i in range(end)]

    # --- rules --------------------------------------------------------------------------------

    @rule(key=st.sampled_from(RANKS), which=st.integers(0, 10), length=st.integers(1, 6))
    def store(self, key: tuple[int, int], which: int, length: int) -> None:
        """An engine stores the next blocks of a prompt after the prefix it holds."""
        prompt = self.prompts[which % len(self.prompts)]
        start = min(self.exact.get(key, ModelWorker()).score(prompt), len(prompt) - 1)
        self._store(key, prompt, start, min(len(prompt), start + length), "device")

    @rule(key=st.sampled_from(RANKS), which=st.integers(0, 10), start=st.integers(0, 5),
          length=st.integers(1, 4), tier=st.sampled_from(LOWER_TIERS))
    def offload(self, key: tuple[int, int], which: int, start: int, length: int, tier: str) -> None:
        """Blocks copied to a lower tier, continuing the prefix before them."""
        prompt = self.prompts[which % len(self.prompts)]
        start = min(start, len(prompt) - 1)
        self._store(key, prompt, start, min(len(prompt), start + length), tier)

    @rule(key=st.sampled_from([*RANKS, ANCHOR]), which=st.integers(0, 10), length=st.integers(1, 7),
          signed=st.booleans())
    def route(self, key: tuple[int, int], which: int, length: int, signed: bool) -> None:
        prompt = self.prompts[which % len(self.prompts)][:length]
        self._expire()
        prefixes = [tuple(prompt[: i + 1]) for i in range(len(prompt))]
        new = sum((key, prefix) not in self.approximations for prefix in prefixes)
        expires = self.clock.now + TTL
        for prefix in reversed(prefixes):
            self.approximations[(key, prefix)] = expires
            self.approximations.move_to_end((key, prefix))
        evicted = 0
        while len(self.approximations) > MAX_APPROXIMATIONS:
            self.approximations.popitem(last=False)
            evicted += 1
        report = self.indexer.record_routed(
            MODEL, TENANT, key[0], key[1], to_signed_list(prompt) if signed else prompt
        )
        assert (report.recorded, report.new, report.evicted) == (len(prompt), new, evicted)
        rank = self.ranks.setdefault(key, ModelRank())
        if rank.source == "none":
            rank.source = "approximate"

    @rule(key=st.sampled_from(RANKS), pick=st.integers(0, 10_000), tail_first=st.booleans())
    def remove(self, key: tuple[int, int], pick: int, tail_first: bool) -> None:
        """A `removed` event: the deepest block of a chain, or one with blocks below it."""
        worker = self.exact.get(key)
        if worker is None or not worker.device:
            return
        inner = {path[:-1] for path in worker.device}
        if tail_first:
            candidates = sorted(name for name, path in worker.names.items() if path not in inner)
        else:
            candidates = sorted(name for name, path in worker.names.items() if path in inner) or sorted(worker.names)
        name = candidates[pick % len(candidates)]
        self.approximations.pop((key, worker.names[name]), None)
        worker.remove([name], "device")
        self._event(key, {"removed": {"block_hashes": [name, 4242]}})  # and a name it never had

    @rule(key=st.sampled_from(RANKS))
    def clear(self, key: tuple[int, int]) -> None:
        self.exact.pop(key, None)
        self._forget(key)
        self._event(key, "cleared")

    @rule(key=st.sampled_from(RANKS))
    def restart(self, key: tuple[int, int]) -> None:
        """The rank's engine restarted (a listener saw its sequence numbers start again)."""
        self.indexer.reset_rank(MODEL, TENANT, key[0], key[1])
        if key in self.ranks:
            self.exact.pop(key, None)
            self._forget(key)

    @rule(key=st.sampled_from(RANKS), endpoint=st.booleans())
    def register(self, key: tuple[int, int], endpoint: bool) -> None:
        rank = self.ranks.get(key)
        try:
            self.indexer.register(key[0], MODEL, TENANT, BLOCK, key[1], "tcp://engine:1" if endpoint else None)
        except Conflict:
            assert rank is not None and rank.registered
            return
        rank = self.ranks.setdefault(key, ModelRank())
        rank.registered = True
        if endpoint:
            rank.source = "events"

    @rule(key=st.sampled_from(RANKS))
    def unregister(self, key: tuple[int, int]) -> None:
        if key not in self.ranks:
            return
        self.indexer.unregister(key[0], MODEL, TENANT, key[1])
        del self.ranks[key]
        self.exact.pop(key, None)
        self._forget(key)

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, TTL / 2, TTL]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule()
    def sweep(self) -> None:
        assert self.indexer.expire_approximations() == self._expire()

    @rule()
    def dump_and_reload_answer_the_same(self) -> None:
        self._expire()
        copy = Indexer(approx_ttl_secs=TTL, approx_max_blocks=MAX_APPROXIMATIONS, clock=self.clock,
                       wall_clock=self.clock.wall)
        report = copy.load_dump(self.indexer.dump())
        assert report.rejected == 0
        for prompt in self.prompts:
            assert copy.query(MODEL, TENANT, prompt) == self.indexer.query(MODEL, TENANT, prompt)

    # --- invariants ---------------------------------------------------------------------------

    def _expected(self, query: list[int]) -> dict:
        device, host, disk = model_match(self.exact, query)
        approximate: dict[tuple[int, int], int] = {}
        for key in self.ranks:
            depth = 0
            while depth < len(query) and (key, tuple(query[: depth + 1])) in self.approximations:
                depth += 1
            if depth:
                approximate[key] = depth
        scores: dict[str, dict[str, int]] = {}
        instances: dict[str, dict] = {}
        for key in sorted(device.keys() | host.keys() | disk.keys() | approximate.keys()):
            exact = device.get(key, 0)
            gpu = max(exact, approximate.get(key, 0))
            cpu = max(gpu, exact + host.get(key, 0))
            on_disk = max(cpu, exact + host.get(key, 0) + disk.get(key, 0))
            if gpu:
                scores.setdefault(str(key[0]), {})[str(key[1])] = gpu * BLOCK
            entry = instances.setdefault(str(key[0]), {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
            entry["dp"][str(key[1])] = gpu * BLOCK
            entry["gpu"] = max(entry["gpu"], gpu * BLOCK)
            entry["cpu"] = max(entry["cpu"], cpu * BLOCK)
            entry["disk"] = max(entry["disk"], on_disk * BLOCK)
            entry["longest_matched"] = max(entry["gpu"], entry["cpu"], entry["disk"])
        return {"scores": scores, "frequencies": [], "instances": instances}

    @invariant()
    def answers_match_the_model(self) -> None:
        self._expire()
        for prompt in self.prompts:
            for query in (prompt, prompt[:-1] + [LOCALS[0] ^ 1]):
                assert query_answer(self.indexer.query(MODEL, TENANT, query)) == self._expected(query), query

    @invariant()
    def ranks_match_the_model(self) -> None:
        listed = {
            (worker.instance_id, rank.dp_rank): rank for worker in self.indexer.workers() for rank in worker.ranks
        }
        assert listed.keys() == self.ranks.keys()
        for key, rank in listed.items():
            expected = self.ranks[key]
            assert (rank.source, rank.registered) == (expected.source, expected.registered), key
            assert rank.blocks == len(self.exact.get(key, ModelWorker()).device)
            assert rank.approximate_blocks == sum(1 for k in self.approximations if k[0] == key)

    @invariant()
    def every_approximated_block_has_its_timer(self) -> None:
        partition = self.indexer.partitions[(MODEL, TENANT)]
        approx = partition.approx
        if approx is None:
            assert not self.approximations
            assert all(slot[0] >= 0 for slot in partition.tree.slots)  # no shadow left behind
            return
        assert len(approx.timers) == len(self.approximations)
        assert approx.serials.keys() <= {shadow_of(key) for key in self.ranks}
        for shadow, serial in approx.serials.items():
            for name in partition.tree.held_hashes(shadow):
                assert serial << 64 | name in approx.timers


ApproximateIndexModel.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestApproximateIndexModel = ApproximateIndexModel.TestCase
