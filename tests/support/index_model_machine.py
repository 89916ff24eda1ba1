"""IndexModel: the prefix tree driven by hypothesis against the model (support.indexer_model);
test_indexer_model runs it, test_indexer_tree_runs runs it with short runs."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynamo_lite.hashing import to_signed_list
from dynamo_lite.indexer.protocols import LOWER_TIERS, Stored
from dynamo_lite.indexer.tree import Chain, PrefixTree, StoreStatus
from support.indexer_model import LOCALS, ModelWorker, external, model_match

WORKERS = [(1, 0), (1, 1), (2, 0), (3, 0)]
TIERS = ("device", *LOWER_TIERS)


class IndexModel(RuleBasedStateMachine):
    chains: bool | None = None  # the tree's default: chains, as unlimited

    @initialize(
        prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=7), min_size=2, max_size=5)
    )
    def setup(self, prompts: list[list[int]]) -> None:
        # Prompts grow from one another so that they share prefixes, as chat turns do.
        self.prompts: list[list[int]] = []
        for content in prompts:
            base = self.prompts[len(content) % len(self.prompts)] if self.prompts else []
            self.prompts.append(base[: len(content) // 2] + [LOCALS[c] for c in content])
        self.tree = PrefixTree(chains=self.chains)
        self.model: dict[tuple[int, int], ModelWorker] = {}

    def _worker(self, key: tuple[int, int]) -> ModelWorker:
        return self.model.setdefault(key, ModelWorker())

    def _apply_store(
        self, key: tuple[int, int], parent: int | None, hashes: list[int], locals_: list[int], tier: str
    ) -> None:
        expected = self._worker(key).store(parent, hashes, locals_, tier)
        assert self.tree.store(key, parent, hashes, locals_, tier) is expected

    def _names(self, key: tuple[int, int], prompt: list[int], end: int) -> list[int]:
        return [external(key, tuple(prompt[: i + 1])) for i in range(end)]

    @rule(
        key=st.sampled_from(WORKERS),
        which=st.integers(0, 10),
        length=st.integers(1, 8),
        rename=st.sampled_from([0, 0, 0, 1]),
    )
    def continue_prompt(self, key: tuple[int, int], which: int, length: int, rename: int) -> None:
        """What an engine does: store the next blocks of a prompt after the prefix it holds.
        `rename` gives the blocks other names than before (held blocks keep their first)."""
        prompt = self.prompts[which % len(self.prompts)]
        start = min(self._worker(key).score(prompt), len(prompt) - 1)
        end = min(len(prompt), start + length)
        names = self._names(key, prompt, end)
        parent = names[start - 1] if start else None
        self._apply_store(key, parent, [name ^ rename for name in names[start:end]], prompt[start:end], "device")

    @rule(
        key=st.sampled_from(WORKERS),
        which=st.integers(0, 10),
        start=st.integers(0, 8),
        length=st.integers(1, 8),
        tier=st.sampled_from(TIERS),
        rename=st.sampled_from([0, 0, 0, 1]),
    )
    def store_slice(
        self, key: tuple[int, int], which: int, start: int, length: int, tier: str, rename: int
    ) -> None:
        """prompt[start:start+length] under the chain before it, held or not (offloads to the
        lower tiers look like this; on the device tier an unheld parent is refused)."""
        prompt = self.prompts[which % len(self.prompts)]
        start = min(start, len(prompt) - 1)
        end = min(len(prompt), start + length)
        names = self._names(key, prompt, end)
        stored = [name ^ rename for name in names[start:end]]
        self._apply_store(key, names[start - 1] if start else None, stored, prompt[start:end], tier)

    @rule(
        key=st.sampled_from(WORKERS),
        pick=st.integers(0, 10_000),
        length=st.integers(1, 3),
        rename=st.sampled_from([0, 1]),
    )
    def extend_below_a_gap(self, key: tuple[int, int], pick: int, length: int, rename: int) -> None:
        """Store under a device block the worker holds below a removed block (any held block
        when there is none), renaming or not blocks it may already hold there."""
        worker = self._worker(key)
        inner = {tuple(prompt[:i]) for prompt in self.prompts for i in range(1, len(prompt))}
        extendable = {name: path for name, path in worker.names.items() if path in inner}
        below_gap = [name for name, path in extendable.items() if not worker.reaches(path)]
        candidates = sorted(below_gap or extendable)
        if not candidates:
            return
        parent = candidates[pick % len(candidates)]
        base = worker.names[parent]
        prompt = next(p for p in self.prompts if len(p) > len(base) and tuple(p[: len(base)]) == base)
        end = min(len(prompt), len(base) + length)
        names = [name ^ rename for name in self._names(key, prompt, end)[len(base) :]]
        self._apply_store(key, parent, names, prompt[len(base) : end], "device")

    @rule(key=st.sampled_from(WORKERS), pick=st.integers(0, 10_000), count=st.integers(1, 4))
    def evict_tail_first(self, key: tuple[int, int], pick: int, count: int) -> None:
        """Evict the last `count` blocks of one of the worker's chains, deepest first."""
        worker = self._worker(key)
        inner = {path[:-1] for path in worker.device}
        leaves = sorted(path for path in worker.device if path not in inner)
        if not leaves:
            return
        leaf = leaves[pick % len(leaves)]
        doomed = [worker.device[leaf[:i]] for i in range(len(leaf), 0, -1) if leaf[:i] in worker.device][:count]
        assert worker.remove(doomed, "device") == 0
        assert self.tree.remove(key, doomed) == 0

    @rule(key=st.sampled_from(WORKERS), pick=st.integers(0, 10_000), tier=st.sampled_from(TIERS))
    def evict_one_anywhere(self, key: tuple[int, int], pick: int, tier: str) -> None:
        """Mid-chain eviction: a held block with held blocks below it, else any held block."""
        worker = self._worker(key)
        if tier == "device":
            inner = {path[:-1] for path in worker.device}
            names = sorted(name for name, path in worker.names.items() if path in inner) or sorted(worker.names)
        else:
            names = sorted(worker.lower_names.get(tier, {}))
        if not names:
            return
        doomed = [names[pick % len(names)]]
        assert worker.remove(doomed, tier) == 0
        assert self.tree.remove(key, doomed, tier) == 0

    @rule(
        key=st.sampled_from(WORKERS),
        pick=st.integers(0, 10_000),
        length=st.integers(1, 3),
        rename=st.sampled_from([0, 1]),
    )
    def evict_mid_chain_then_extend_below(self, key: tuple[int, int], pick: int, length: int, rename: int) -> None:
        """The sequence that exercises blocks held below a gap, which random steps rarely hit."""
        self.evict_one_anywhere(key, pick, "device")
        self.extend_below_a_gap(key, pick // 7, length, rename)

    @rule(key=st.sampled_from(WORKERS), hashes=st.lists(st.integers(0, 2**64 - 1), max_size=3))
    def remove_unknown(self, key: tuple[int, int], hashes: list[int]) -> None:
        expected = self._worker(key).remove(hashes, "device")
        assert self.tree.remove(key, hashes) == expected

    @rule(key=st.sampled_from(WORKERS), which=st.integers(0, 10), tier=st.sampled_from(TIERS))
    def store_bad_chain(self, key: tuple[int, int], which: int, tier: str) -> None:
        """A repeated hash, or the worker's hashes in a scrambled order (a name reused)."""
        prompt = self.prompts[which % len(self.prompts)]
        names = [external(key, tuple(prompt[: i + 1])) for i in range(len(prompt))]
        self._apply_store(key, None, [names[0], names[0]], prompt[:1] * 2, tier)
        self._apply_store(key, None, names[::-1], prompt, tier)

    @rule(key=st.sampled_from(WORKERS))
    def clear(self, key: tuple[int, int]) -> None:
        self.model.pop(key, None)
        self.tree.clear(key)

    @rule(key=st.sampled_from(WORKERS))
    def drop(self, key: tuple[int, int]) -> None:
        self.model.pop(key, None)
        self.tree.drop_worker(key)

    @invariant()
    def answers_match_the_model(self) -> None:
        for prompt in self.prompts:
            for query in (prompt, prompt[:-1] + [LOCALS[0] ^ 1]):
                device, host, disk = model_match(self.model, query)
                result = self.tree.match(query)
                assert result.device == device, (query, self.model)
                assert result.host_pinned == host
                assert result.disk == disk
            assert self.tree.match(to_signed_list(prompt)) == self.tree.match(prompt)

    @invariant()
    def block_counts_match(self) -> None:
        for key in WORKERS:
            worker = self.model.get(key, ModelWorker())
            assert self.tree.block_count(key) == len(worker.device)
            for tier in LOWER_TIERS:
                assert self.tree.block_count(key, tier) == len(worker.lower.get(tier, {}))

    @invariant()
    def tree_is_tidy(self) -> None:
        """Masks are prefix-closed, nothing nobody holds is kept, and dormant entries are real."""
        stack = [self.tree.root]
        while stack:
            node = stack.pop()
            child = node.child
            children = [] if child is None else list(child.values()) if isinstance(child, dict) else [child]
            if isinstance(child, dict):
                assert len(child) > 1
            for c in children:
                assert c.parent is node
                if node is not self.tree.root:
                    assert c.holders & ~node.holders == 0
                assert c.holders or c.child is not None or c in self.tree.dormant
                assert not self.tree.dormant.get(c, 0) & c.holders
                if isinstance(c, Chain):
                    assert len(c.locals) == len(c.exts) >= 1 and c.run is None
            stack.extend(children)

    @invariant()
    def dump_replays_to_the_same_answers(self) -> None:
        copy = PrefixTree()
        for event in self.tree.dump():
            data = event.data
            assert isinstance(data, Stored)
            key = (event.worker_id, event.dp_rank)
            status = copy.store(key, data.parent_hash, data.block_hashes, data.tokens_hashes, event.storage_tier)
            assert status is StoreStatus.STORED
        for prompt in self.prompts:
            assert copy.match(prompt) == self.tree.match(prompt)
