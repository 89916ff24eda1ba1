"""A model of the indexer's answers: per worker, the blocks it holds by content path, and what a query should match."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dynamo_lite.hashing import sequence_hashes
from dynamo_lite.indexer.protocols import LOWER_TIERS
from dynamo_lite.indexer.tree import StoreStatus

ODD_SEED_WORKER = (3, 0)  # names the same content differently from everyone else
_rng = random.Random(1234)


# Content ids 0..5 -> local hashes; half of them above 2**63 to exercise signed forms.
LOCALS = [_rng.getrandbits(63) | (i % 2) << 63 for i in range(6)]
Path = tuple[int, ...]


def external(worker: tuple[int, int], path: Path) -> int:
    seed = 4242 if worker == ODD_SEED_WORKER else 1337
    return sequence_hashes(path, seed)[-1]


@dataclass
class ModelWorker:
    device: dict[Path, int] = field(default_factory=dict)  # chain -> its external hash
    names: dict[int, Path] = field(default_factory=dict)  # external hash -> chain
    lower: dict[str, dict[tuple[int | None, int], int]] = field(default_factory=dict)
    lower_names: dict[str, dict[int, tuple[int | None, int]]] = field(default_factory=dict)

    def store(self, parent: int | None, hashes: list[int], locals_: list[int], tier: str) -> StoreStatus:
        if len(set(hashes)) != len(hashes) or parent in hashes:
            return StoreStatus.SELF_REFERENCE
        if tier == "device":
            return self._store_device(parent, hashes, locals_)
        transitions = self.lower.setdefault(tier, {})
        names = self.lower_names.setdefault(tier, {})
        keys = list(zip([parent, *hashes[:-1]], locals_))
        if any(names.get(h, key) != key for h, key in zip(hashes, keys)):
            return StoreStatus.HASH_CONFLICT
        for h, key in zip(hashes, keys):
            if h not in names and key not in transitions:
                transitions[key] = h
                names[h] = key
        return StoreStatus.STORED

    def _store_device(self, parent: int | None, hashes: list[int], locals_: list[int]) -> StoreStatus:
        if parent is None:
            base: Path = ()
        elif parent in self.names:
            base = self.names[parent]
        else:
            return StoreStatus.UNKNOWN_PARENT
        paths = [base + tuple(locals_[: i + 1]) for i in range(len(locals_))]
        if any(self.names.get(h, path) != path for h, path in zip(hashes, paths)):
            return StoreStatus.HASH_CONFLICT
        for h, path in zip(hashes, paths):
            if path not in self.device:
                self.device[path] = h
                self.names[h] = path
        return StoreStatus.STORED

    def remove(self, hashes: list[int], tier: str) -> int:
        unknown = 0
        for h in hashes:
            if tier == "device":
                path = self.names.pop(h, None)
                if path is None:
                    unknown += 1
                else:
                    del self.device[path]
            else:
                key = self.lower_names.get(tier, {}).pop(h, None)
                if key is None:
                    unknown += 1
                else:
                    del self.lower[tier][key]
        return unknown

    def reaches(self, path: Path) -> bool:
        """Whether every prefix of `path` is covered, i.e. it counts for queries."""
        return all(path[:i] in self.device for i in range(1, len(path) + 1))

    def score(self, query: list[int]) -> int:
        k = 0
        while k < len(query) and tuple(query[: k + 1]) in self.device:
            k += 1
        return k


def model_match(workers: dict[tuple[int, int], ModelWorker], query: list[int]) -> tuple[dict, dict, dict]:
    device = {key: w.score(query) for key, w in workers.items()}
    state = {key: (k, w.device[tuple(query[:k])]) for key, w in workers.items() if (k := device[key])}
    gained: dict[str, dict] = {tier: {} for tier in LOWER_TIERS}
    for tier in LOWER_TIERS:
        for key, w in workers.items():
            transitions = w.lower.get(tier, {})
            if key not in state and query and (None, query[0]) in transitions:
                state[key] = (0, None)
            if key not in state:
                continue
            start, parent = state[key]
            position = start
            while position < len(query) and (parent, query[position]) in transitions:
                parent = transitions[(parent, query[position])]
                position += 1
            if position > start:
                gained[tier][key] = position - start
                state[key] = (position, parent)
    disk = {}
    for key in workers:
        total = gained["disk"].get(key, 0) + gained["external"].get(key, 0)
        if total:
            disk[key] = total
    return {k: v for k, v in device.items() if v}, gained["host_pinned"], disk
