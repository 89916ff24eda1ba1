"""Test support: a fake vLLM-style engine whose KV events go over ZMQ through the project's one
engine publisher (`dynamo_lite.kv_publishers.EnginePublisher`), and the model of what an indexer
fed by a fleet of them must hold.

Dynamo 1.6.1's indexer ingests KV events from engines over ZMQ: `POST /register` names the
engine's PUB endpoint and the indexer connects a SUB socket to it (empty subscription). Ours
ingests the same events over HTTP (`POST /events`, the `/dump` document shape). `FakeEngine`
produces both from one list of events, so a test can feed the reference and ours identically:

* wire: one message per batch, `[topic, seq (8-byte big-endian, from 0), payload]`, the payload
  in `WireFormat.VLLM_LEGACY` (the vLLM Dynamo 1.6.1 was built against: a positional batch
  `[ts, events, data_parallel_rank]` of positional events such as
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, None, medium,
  lora_name]`), or `WireFormat.VLLM` (vLLM 0.33's tagged map events) with `map_events`. vLLM has
  no field for a `cache_salt`: a batch with a salted store goes in `WireFormat.SGLANG`, whose
  BlockStored carries one.
* ours: one RouterEvent per wire event, `tokens_hash` = the local block hash of each
  block's tokens (with the event's lora_name / cache_salt), `block_hash` = the engine's
  external hash, `storage_tier` from the medium (None/"GPU" device, "CPU" host_pinned, "DISK"
  disk), `event_id` = the seq of the batch the event came in (Dynamo's live RouterEvents carry
  the batch's ZMQ sequence number), so a batch of several events shares one id.

A SUB socket that connects after messages were published never sees them, and the reference
connects only after `/register`: `wait_for_subscribers(n)` (the publisher's XPUB socket sees each
subscription) blocks until n subscriptions arrived.

`Workload` (second half of the file) drives several FakeEngines with a seeded, realistic and
clean-domain event stream and keeps the expected outcome: `expected_facts()` (a dump,
normalised as by `dump_facts`), `expected_answer()` (a query response) and `sample_queries()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import zmq

from dynamo_lite.base.integers import U64_MASK
from dynamo_lite.hashing import local_block_hashes, sequence_hashes, to_signed
from dynamo_lite.kv_publishers import Cleared, EnginePublisher, Removed, Stored, WireFormat, encode_batch

MEDIUM_TIER: dict[str | None, str] = {None: "device", "GPU": "device", "CPU": "host_pinned", "DISK": "disk"}


@dataclass(frozen=True)
class BlockStored:
    """Blocks stored as a chain under `parent_block_hash` (None: at the root).

    `block_hashes` are the engine's external hashes (u64); `token_ids` cover every block.
    `signed_on_wire` writes the hashes as i64 on the wire (the reference normalises both)."""

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    signed_on_wire: bool = False

    def wire(self) -> Stored:
        parent = None if self.parent_block_hash is None else _wire_hash(self.parent_block_hash, self.signed_on_wire)
        return Stored([_wire_hash(h, self.signed_on_wire) for h in self.block_hashes], parent, list(self.token_ids),
                      self.block_size, medium=self.medium, lora_name=self.lora_name, cache_salt=self.cache_salt)

    def data(self) -> dict[str, Any]:
        locals_ = local_block_hashes(
            self.token_ids, self.block_size, lora_name=self.lora_name, cache_salt=self.cache_salt
        )
        if len(locals_) != len(self.block_hashes):
            raise ValueError(f"{len(self.block_hashes)} block hashes for {len(locals_)} full blocks of tokens")
        return {
            "stored": {
                "parent_hash": None if self.parent_block_hash is None else self.parent_block_hash & U64_MASK,
                "start_position": None,
                "blocks": [
                    {"block_hash": ext & U64_MASK, "tokens_hash": local, "mm_extra_info": None}
                    for ext, local in zip(self.block_hashes, locals_)
                ],
            }
        }


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: Sequence[int]
    medium: str | None = None
    signed_on_wire: bool = False

    def wire(self) -> Removed:
        return Removed([_wire_hash(h, self.signed_on_wire) for h in self.block_hashes], self.medium)

    def data(self) -> dict[str, Any]:
        return {"removed": {"block_hashes": [h & U64_MASK for h in self.block_hashes]}}


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: None = None

    def wire(self) -> Cleared:
        return Cleared()

    def data(self) -> Any:
        return "cleared"


EngineEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def _wire_hash(value: int, signed: bool) -> int:
    return to_signed(value) if signed else value & U64_MASK


def router_event(event: EngineEvent, worker_id: int, dp_rank: int, event_id: int) -> dict[str, Any]:
    """The dynamo_lite `/events` RouterEvent for one engine event."""
    return {
        "worker_id": worker_id,
        "storage_tier": MEDIUM_TIER[event.medium],
        "residency_domain": "worker",
        "event": {"event_id": event_id, "dp_rank": dp_rank, "data": event.data()},
    }


def events_document(sections: Iterable[tuple[str, str, int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """`{"<model>:<tenant>": {"block_size", "events"}}` from (model, tenant, block_size, events)."""
    document: dict[str, Any] = {}
    for model_name, tenant_id, block_size, events in sections:
        key = f"{model_name}:{tenant_id}"
        section = document.setdefault(key, {"block_size": block_size, "events": []})
        if section["block_size"] != block_size:
            raise ValueError(f"{key}: block sizes {section['block_size']} and {block_size}")
        section["events"].extend(events)
    return document


class FakeEngine:
    """One engine (worker_id, dp_rank): an `EnginePublisher` (no replay) on a free loopback port,
    plus the RouterEvents ours is fed for the same batches."""

    def __init__(
        self,
        worker_id: int,
        dp_rank: int = 0,
        *,
        model_name: str,
        block_size: int,
        tenant_id: str = "default",
        topic: bytes = b"kv-events",
        batch_dp_rank: bool = True,
        map_events: bool = False,
        context: zmq.Context | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.model_name = model_name
        self.block_size = block_size
        self.tenant_id = tenant_id
        self.batch_dp_rank = batch_dp_rank  # vLLM fills data_parallel_rank; False sends nil
        # vLLM 0.33's events (tagged maps) instead of positional ones.
        self.format = WireFormat.VLLM if map_events else WireFormat.VLLM_LEGACY
        self._publisher = EnginePublisher(self.format, dp_rank=dp_rank, topic=topic, replay=False, context=context)
        self.endpoint = self._publisher.endpoint
        self.published: list[dict[str, Any]] = []  # RouterEvents not yet taken by `take_router_events`

    # --- registration --------------------------------------------------------------------------

    def reference_registration(self) -> dict[str, Any]:
        """`POST /register` body for Dynamo's indexer (routing_group is its partition key)."""
        return {
            "instance_id": self.worker_id,
            "endpoint": self.endpoint,
            "model_name": self.model_name,
            "block_size": self.block_size,
            "routing_group": self.tenant_id,
            "dp_rank": self.dp_rank,
        }

    def our_registration(self, *, subscribe: bool) -> dict[str, Any]:
        """`POST /register` body for ours: with `subscribe`, ours listens to this engine's
        socket itself; without, it is fed the same events over `POST /events`."""
        return {
            "instance_id": self.worker_id,
            "endpoint": self.endpoint if subscribe else None,
            "model_name": self.model_name,
            "block_size": self.block_size,
            "tenant_id": self.tenant_id,
            "dp_rank": self.dp_rank,
        }

    def wait_for_subscribers(self, count: int = 1, timeout: float = 10.0) -> None:
        """Block until `count` subscriptions (net of unsubscriptions) have arrived."""
        self._publisher.wait_for_subscribers(count, timeout)

    # --- publishing ----------------------------------------------------------------------------

    def payload(self, events: Sequence[EngineEvent], timestamp: float) -> bytes:
        """The batch's payload frame: in this engine's format, or SGLang's when a store is salted."""
        salted = any(isinstance(event, BlockStored) and event.cache_salt is not None for event in events)
        return encode_batch(WireFormat.SGLANG if salted else self.format, [event.wire() for event in events],
                            dp_rank=self.dp_rank if self.batch_dp_rank else None, ts=timestamp)

    def publish(self, events: Sequence[EngineEvent], *, timestamp: float | None = None) -> list[dict[str, Any]]:
        """Send one batch with `events`; returns (and records) the matching RouterEvents."""
        seq = self._publisher.publish_raw(self.payload(events, time.time() if timestamp is None else timestamp))
        # As in Dynamo's RouterEvent stream, every event of the batch carries its seq as id.
        produced = [router_event(event, self.worker_id, self.dp_rank, seq) for event in events]
        self.published.extend(produced)
        return produced

    def take_router_events(self) -> list[dict[str, Any]]:
        """The RouterEvents published since the last call, for ours' `POST /events`."""
        taken, self.published = self.published, []
        return taken

    def close(self) -> None:
        self._publisher.close()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FakeEngine(worker_id={self.worker_id}, dp_rank={self.dp_rank}, endpoint={self.endpoint!r})"


# ============================================================================================
# A realistic event stream with its expected outcome (the reference notes' clean-domain model)
# ============================================================================================
#
# `Workload` drives a set of FakeEngines like a serving fleet would: shared system prompts plus
# unique suffixes, multi-turn continuations, decode-style extensions, tail-first evictions
# (optionally offloaded to CPU, and from CPU to DISK), occasional AllBlocksCleared. It stays in
# the clean domain: every worker's device coverage is
# prefix-closed and the external hash of a block is a function of its prefix (Dynamo's chained
# sequence hash over the local hashes), identical on every worker.
#
# It also keeps the coverage model of `dynamo_lite.indexer.tree` (coverage = set of stored prefix paths) plus the
# lower-tier transitions, from which `expected_facts` (a dump, normalised) and
# `expected_answer` (a query response) are computed.

DEVICE_TIER = "device"
HOST_TIER = "host_pinned"
DISK_TIER = "disk"
TIER_MEDIUM = {HOST_TIER: "CPU", DISK_TIER: "DISK"}


@dataclass(frozen=True)
class Context:
    """What changes the local hash seed of a block."""

    lora_name: str | None = None
    cache_salt: str | None = None


PLAIN = Context()


@dataclass(frozen=True)
class Block:
    ext: int  # external hash (u64): the chained sequence hash of the prefix
    parent: int | None  # external hash of the previous block, None at the root
    local: int  # local block hash (u64), what queries are keyed on
    tokens: tuple[int, ...]
    context: Context


class Chains:
    """Every block ever produced in one partition. ext = f(prefix), as in the clean domain."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, Block] = {}
        self.by_edge: dict[tuple[int | None, int], int] = {}  # (parent ext, local) -> ext
        self.children: dict[int | None, list[int]] = {}

    def child(self, parent: int | None, tokens: Sequence[int], context: Context) -> Block:
        (local,) = local_block_hashes(tokens, self.block_size, lora_name=context.lora_name, cache_salt=context.cache_salt)
        ext = self.by_edge.get((parent, local))
        if ext is not None:
            return self.blocks[ext]
        ext = local if parent is None else sequence_hashes([parent, local])[1]
        block = Block(ext, parent, local, tuple(tokens), context)
        if ext in self.blocks:
            raise AssertionError(f"external hash collision at {ext}")
        self.blocks[ext] = block
        self.by_edge[(parent, local)] = ext
        self.children.setdefault(parent, []).append(ext)
        return block

    def chain(self, tokens: Sequence[int], context: Context) -> list[Block]:
        """The blocks of every full block of `tokens`."""
        blocks: list[Block] = []
        parent = None
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = self.child(parent, tokens[start : start + size], context)
            blocks.append(block)
            parent = block.ext
        return blocks

    def path(self, ext: int) -> list[Block]:
        out = []
        current: int | None = ext
        while current is not None:
            block = self.blocks[current]
            out.append(block)
            current = block.parent
        out.reverse()
        return out

    def tokens(self, ext: int) -> list[int]:
        return [token for block in self.path(ext) for token in block.tokens]


@dataclass
class WorkerModel:
    """Expected state of one (worker, dp_rank)."""

    device: set[int]
    lower: dict[str, dict[int, int | None]]  # tier -> ext -> stored parent ext

    @classmethod
    def empty(cls) -> WorkerModel:
        return cls(set(), {HOST_TIER: {}, DISK_TIER: {}})

    def leaves(self, chains: Chains) -> list[int]:
        parents = {chains.blocks[ext].parent for ext in self.device}
        return sorted(ext for ext in self.device if ext not in parents)

    def lower_leaves(self, tier: str) -> list[int]:
        held = self.lower[tier]
        parents = set(held.values())
        return sorted(ext for ext in held if ext not in parents)


Fact = tuple[int, int, str, "int | None", int, int]  # (worker, dp_rank, tier, parent, ext, local)


def dump_facts(document: dict[str, Any], keys: Iterable[str] | None = None) -> dict[str, set[Fact]]:
    """A `/dump` document, normalised: per partition key, the set of
    (worker_id, dp_rank, tier, parent ext, ext, local hash) of every block it holds.

    Two dumps with equal facts describe the same index whatever the edge splits and the
    event order (the reference dumps compressed-tree edges, ours chains of nodes)."""
    wanted = None if keys is None else set(keys)
    facts: dict[str, set[Fact]] = {}
    for key, section in document.items():
        if wanted is not None and key not in wanted:
            continue
        out = facts.setdefault(key, set())
        for event in section["events"]:
            inner = event["event"]
            stored = inner["data"]["stored"]
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                out.add(
                    (event["worker_id"], inner.get("dp_rank", 0), event.get("storage_tier", DEVICE_TIER),
                     parent, block["block_hash"], block["tokens_hash"])
                )
                parent = block["block_hash"]
    if wanted is not None:
        for key in wanted:
            facts.setdefault(key, set())
    return facts


@dataclass
class Partition:
    model_name: str
    tenant_id: str
    block_size: int
    chains: Chains
    engines: list[FakeEngine]
    system_prompts: list[tuple[list[int], Context]]
    conversations: list[tuple[list[int], Context]]
    contexts: list[Context]

    @property
    def key(self) -> str:
        return f"{self.model_name}:{self.tenant_id}"


GROW = {"prompt": 50, "decode": 30, "evict": 12, "host_evict": 6, "disk_evict": 2, "clear": 0}
SHRINK = {"prompt": 10, "decode": 10, "evict": 45, "host_evict": 20, "disk_evict": 8, "clear": 2}


class Workload:
    """Seeded engine behaviour over several partitions, with the expected outcome."""

    def __init__(self, rng: Any, engines: Sequence[FakeEngine], *, token_limit: int = 50_000) -> None:
        self.rng = rng
        self.token_limit = token_limit
        self.partitions: dict[str, Partition] = {}
        self.state: dict[tuple[int, int], WorkerModel] = {}
        self.engine_partition: dict[tuple[int, int], Partition] = {}
        for engine in engines:
            key = f"{engine.model_name}:{engine.tenant_id}"
            partition = self.partitions.get(key)
            if partition is None:
                contexts = [PLAIN] * 8 + [
                    Context(lora_name="my-lora"),
                    Context(cache_salt="tenant-a"),
                    Context(lora_name="my-lora", cache_salt="tenant-a"),
                ]
                partition = self.partitions[key] = Partition(
                    engine.model_name, engine.tenant_id, engine.block_size, Chains(engine.block_size),
                    [], [], [], contexts,
                )
                for _ in range(4):
                    # System prompts are not block aligned: their last block mixes in user tokens.
                    length = rng.randint(1, 5) * engine.block_size + rng.randrange(engine.block_size)
                    partition.system_prompts.append((self.tokens(length), rng.choice(contexts)))
            partition.engines.append(engine)
            self.state[(engine.worker_id, engine.dp_rank)] = WorkerModel.empty()
            self.engine_partition[(engine.worker_id, engine.dp_rank)] = partition
        self.engines = list(engines)

    # --- generation ---------------------------------------------------------------------------

    def tokens(self, count: int) -> list[int]:
        rng = self.rng
        # Mostly vocabulary-sized ids, now and then one near the top of the u32 range.
        return [rng.randrange(self.token_limit) if rng.random() < 0.995 else rng.randrange(2**31, 2**32)
                for _ in range(count)]

    def run(self, ops: int, weights: dict[str, int]) -> int:
        """`ops` random operations on random engines. An engine publishes what one scheduler
        step did as one batch: usually one operation, often several (a step that prefills one
        request, decodes others and evicts for them), all under one sequence number.
        Returns the number of engine events published."""
        names = [name for name, weight in weights.items() if weight]
        values = [weights[name] for name in names]
        published = done = 0
        while done < ops:
            engine = self.rng.choice(self.engines)
            steps = min(self.rng.choice((1, 1, 1, 2, 3, 5)), ops - done)
            events: list[EngineEvent] = []
            for op in self.rng.choices(names, values, k=steps):
                events += getattr(self, f"_op_{op}")(engine)
            done += steps
            if events:
                engine.publish(events)
                published += len(events)
        return published

    def clear(self, engine: FakeEngine) -> None:
        """Publish AllBlocksCleared for `engine`."""
        engine.publish(self._op_clear(engine))

    def drop(self, engine: FakeEngine) -> None:
        """Forget `engine` (after it was unregistered everywhere): it publishes no more."""
        key = (engine.worker_id, engine.dp_rank)
        self.engines.remove(engine)
        self.engine_partition[key].engines.remove(engine)
        del self.state[key]
        del self.engine_partition[key]

    def _parts(self, engine: FakeEngine) -> tuple[Partition, WorkerModel]:
        key = (engine.worker_id, engine.dp_rank)
        return self.engine_partition[key], self.state[key]

    def _op_clear(self, engine: FakeEngine) -> list[EngineEvent]:
        self.state[(engine.worker_id, engine.dp_rank)] = WorkerModel.empty()
        return [AllBlocksCleared()]

    def _op_prompt(self, engine: FakeEngine) -> list[EngineEvent]:
        """Prefill of a prompt: the blocks the worker does not hold yet, under its cached prefix."""
        partition, worker = self._parts(engine)
        rng = self.rng
        size = partition.block_size
        roll = rng.random()
        if roll < 0.35 or not partition.conversations:
            system, context = rng.choice(partition.system_prompts)
            tokens = system + self.tokens(rng.randint(1, 4 * size))
            if rng.random() < 0.1:
                # Padding: whole blocks of one token, so equal local hashes follow each other.
                tokens += [rng.choice([0, 7])] * (rng.randint(1, 4) * size) + self.tokens(rng.randrange(2 * size))
        elif roll < 0.8:
            previous, context = rng.choice(partition.conversations)
            tokens = previous + self.tokens(rng.randint(0, 3 * size))
        else:
            tokens, context = rng.choice(partition.conversations)
        partition.conversations.append((tokens, context))
        blocks = partition.chains.chain(tokens, context)
        cached = 0
        while cached < len(blocks) and blocks[cached].ext in worker.device:
            cached += 1
        if cached == len(blocks):
            return []
        if cached and rng.random() < 0.05:
            cached = 0  # re-store the whole chain from the root: held blocks are a no-op
        todo = blocks[cached:]
        parent = blocks[cached - 1].ext if cached else None
        events: list[EngineEvent] = []
        cuts = [0, len(todo)]
        if len(todo) > 1 and rng.random() < 0.3:  # chunked prefill: two stores in one batch
            cuts.insert(1, rng.randint(1, len(todo) - 1))
        for start, end in zip(cuts, cuts[1:]):
            part = todo[start:end]
            events.append(self._stored(part, parent, size, None))
            parent = part[-1].ext
        worker.device.update(block.ext for block in todo)
        return events

    def _stored(self, blocks: Sequence[Block], parent: int | None, size: int, medium: str | None) -> BlockStored:
        context = blocks[0].context
        return BlockStored(
            [block.ext for block in blocks],
            parent,
            [token for block in blocks for token in block.tokens],
            size,
            medium=medium if medium is not None else self.rng.choice([None, None, "GPU"]),
            lora_name=context.lora_name,
            cache_salt=context.cache_salt,
            signed_on_wire=self.rng.random() < 0.3,
        )

    def _op_decode(self, engine: FakeEngine) -> list[EngineEvent]:
        """Decode-style extension: one or two new blocks under one of the worker's tails."""
        partition, worker = self._parts(engine)
        leaves = worker.leaves(partition.chains)
        if not leaves:
            return self._op_prompt(engine)
        tail = self.rng.choice(leaves)
        context = partition.chains.blocks[tail].context
        parent: int | None = tail
        new = []
        for _ in range(self.rng.choice([1, 1, 1, 2])):
            block = partition.chains.child(parent, self.tokens(partition.block_size), context)
            new.append(block)
            parent = block.ext
        partition.conversations.append((partition.chains.tokens(new[-1].ext), context))
        worker.device.update(block.ext for block in new)
        return [self._stored(new, tail, partition.block_size, None)]

    def _op_evict(self, engine: FakeEngine) -> list[EngineEvent]:
        """Tail-first eviction; sometimes the evicted run is offloaded to CPU first."""
        partition, worker = self._parts(engine)
        chains = partition.chains
        rng = self.rng
        leaves = worker.leaves(chains)
        if not leaves:
            return []
        events: list[EngineEvent] = []
        if rng.random() < 0.4:
            # One run up from a leaf, while the parent has no other held child.
            run = [rng.choice(leaves)]
            limit = rng.randint(1, 4)
            while len(run) < limit:
                parent = chains.blocks[run[-1]].parent
                if parent is None:
                    break
                siblings = [ext for ext in worker.device if chains.blocks[ext].parent == parent]
                if siblings != [run[-1]]:
                    break
                run.append(parent)
            run.reverse()
            events.extend(self._copy_down(partition, worker, run, HOST_TIER))
            victims = list(run)
        else:
            victims = []
            remaining = set(worker.device)
            for _ in range(rng.randint(1, 6)):
                parents = {chains.blocks[ext].parent for ext in remaining}
                candidates = sorted(ext for ext in remaining if ext not in parents)
                if not candidates:
                    break
                victim = rng.choice(candidates)
                remaining.discard(victim)
                victims.append(victim)
        rng.shuffle(victims)
        worker.device.difference_update(victims)
        events.append(BlockRemoved(victims, rng.choice([None, "GPU"]), signed_on_wire=rng.random() < 0.3))
        return events

    def _copy_down(self, partition: Partition, worker: WorkerModel, run: Sequence[int], tier: str) -> list[EngineEvent]:
        """Store the chain `run` (root-most first) on a lower tier, skipping blocks already
        there; each segment's parent is the block above it (device or lower tier)."""
        chains = partition.chains
        held = worker.lower[tier]
        events: list[EngineEvent] = []
        segment: list[Block] = []
        for ext in [*run, None]:
            if ext is not None and ext not in held:
                segment.append(chains.blocks[ext])
                continue
            if segment:
                events.append(self._stored(segment, segment[0].parent, partition.block_size, TIER_MEDIUM[tier]))
                for block in segment:
                    held[block.ext] = block.parent
                segment = []
        return events

    def _op_host_evict(self, engine: FakeEngine) -> list[EngineEvent]:
        """CPU tail-first eviction, sometimes demoting the blocks to DISK first."""
        partition, worker = self._parts(engine)
        leaves = worker.lower_leaves(HOST_TIER)
        if not leaves:
            return self._op_evict(engine)
        rng = self.rng
        victims = rng.sample(leaves, min(len(leaves), rng.randint(1, 3)))
        events: list[EngineEvent] = []
        if rng.random() < 0.6:
            for victim in victims:
                events.extend(self._copy_down(partition, worker, [victim], DISK_TIER))
        for victim in victims:
            del worker.lower[HOST_TIER][victim]
        events.append(BlockRemoved(victims, "CPU", signed_on_wire=rng.random() < 0.3))
        return events

    def _op_disk_evict(self, engine: FakeEngine) -> list[EngineEvent]:
        partition, worker = self._parts(engine)
        leaves = worker.lower_leaves(DISK_TIER)
        if not leaves:
            return self._op_host_evict(engine)
        victims = self.rng.sample(leaves, min(len(leaves), self.rng.randint(1, 3)))
        for victim in victims:
            del worker.lower[DISK_TIER][victim]
        return [BlockRemoved(victims, "DISK")]

    # --- expectations -------------------------------------------------------------------------

    def router_events_document(self) -> dict[str, Any]:
        """Everything the engines published since the last call, as ours' `POST /events`."""
        return events_document(
            (engine.model_name, engine.tenant_id, engine.block_size, engine.take_router_events())
            for engine in self.engines
        )

    def expected_facts(self) -> dict[str, set[Fact]]:
        facts: dict[str, set[Fact]] = {key: set() for key in self.partitions}
        for (worker_id, dp_rank), worker in self.state.items():
            partition = self.engine_partition[(worker_id, dp_rank)]
            blocks = partition.chains.blocks
            out = facts[partition.key]
            for ext in worker.device:
                block = blocks[ext]
                out.add((worker_id, dp_rank, DEVICE_TIER, block.parent, ext, block.local))
            for tier, held in worker.lower.items():
                for ext, parent in held.items():
                    out.add((worker_id, dp_rank, tier, parent, ext, blocks[ext].local))
        return facts

    def expected_answer(self, key: str, local_hashes: Sequence[int]) -> dict[str, Any]:
        """The query response the clean-domain model predicts (hashes u64 or i64)."""
        partition = self.partitions[key]
        by_edge = partition.chains.by_edge
        size = partition.block_size
        query = [h & U64_MASK for h in local_hashes]
        scores: dict[str, dict[str, int]] = {}
        instances: dict[str, dict[str, Any]] = {}
        for (worker_id, dp_rank), worker in sorted(self.state.items()):
            if self.engine_partition[(worker_id, dp_rank)] is not partition:
                continue
            depth, parent = 0, None
            while depth < len(query):
                ext = by_edge.get((parent, query[depth]))
                if ext is None or ext not in worker.device:
                    break
                depth, parent = depth + 1, ext
            device = depth
            reached = []
            for tier in (HOST_TIER, DISK_TIER):
                held = worker.lower[tier]
                while depth < len(query):
                    ext = by_edge.get((parent, query[depth]))
                    if ext is None or held.get(ext, -1) != parent:
                        break
                    depth, parent = depth + 1, ext
                reached.append(depth)
            if not reached[-1]:
                continue
            name, rank = str(worker_id), str(dp_rank)
            if device:
                scores.setdefault(name, {})[rank] = device * size
            entry = instances.setdefault(name, {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0})
            entry["dp"][rank] = device * size
            entry["gpu"] = max(entry["gpu"], device * size)
            entry["cpu"] = max(entry["cpu"], reached[0] * size)
            entry["disk"] = max(entry["disk"], reached[1] * size)
            entry["longest_matched"] = max(entry["gpu"], entry["cpu"], entry["disk"])
        return {"scores": scores, "frequencies": [], "instances": instances}

    # --- queries ------------------------------------------------------------------------------

    def sample_queries(self, key: str, count: int) -> list[Query]:
        """Realistic and adversarial queries for one partition: prefixes of stored chains,
        divergent suffixes, unknown roots, empty ones; by hash and by tokens (with trailing
        partial blocks and the chain's lora_name / cache_salt, or deliberately without)."""
        partition = self.partitions[key]
        chains = partition.chains
        rng = self.rng
        size = partition.block_size
        held = sorted(
            {ext for (w, d), worker in self.state.items() if self.engine_partition[(w, d)] is partition
             for ext in [*worker.device, *worker.lower[HOST_TIER], *worker.lower[DISK_TIER]]}
        )
        everything = list(chains.blocks)
        queries = [Query(key, [], None), Query(key, None, []), Query(key, [rng.getrandbits(64)], None),
                   Query(key, None, self.tokens(size - 1) if size > 1 else [])]
        while len(queries) < count:
            roll = rng.random()
            if roll < 0.04:
                queries.append(Query(key, [rng.getrandbits(64) for _ in range(rng.randint(1, 6))], None))
                continue
            if roll < 0.07:
                queries.append(Query(key, None, self.tokens(rng.randint(0, 5 * size))))
                continue
            pool = held if held and rng.random() < 0.75 else everything
            if not pool:
                continue
            ext = rng.choice(pool)
            # Often follow the chain further down, beyond what was picked.
            for _ in range(rng.choice([0, 0, 1, 3, 8])):
                children = chains.children.get(ext, []) if rng.random() < 0.5 else []
                if not children:
                    break
                ext = rng.choice(children)
            path = chains.path(ext)
            length = rng.randint(1, len(path)) if rng.random() < 0.4 else len(path)
            path = path[:length]
            context = path[0].context
            if rng.random() < 0.5:
                hashes = [block.local for block in path]
                if rng.random() < 0.2:  # divergent suffix
                    cut = rng.randrange(len(hashes))
                    hashes = hashes[:cut] + [rng.getrandbits(64)] + hashes[cut + 1 :] * rng.randint(0, 1)
                queries.append(Query(key, hashes, None))
            else:
                tokens = [token for block in path for token in block.tokens]
                if rng.random() < 0.2:  # divergence inside a block
                    spot = rng.randrange(len(tokens))
                    tokens[spot] = (tokens[spot] + 1) % 2**32
                tokens += self.tokens(rng.randrange(size))  # trailing partial block
                lora, salt = context.lora_name, context.cache_salt
                if rng.random() < 0.1:
                    lora, salt = rng.choice([(None, None), ("my-lora", None), (None, "tenant-a"), ("my-lora", "tenant-a")])
                queries.append(Query(key, None, tokens, lora, salt))
        return queries


@dataclass
class Query:
    """One query on one partition: by local hashes (`hashes`) or by `tokens`."""

    key: str
    hashes: list[int] | None
    tokens: list[int] | None
    lora_name: str | None = None
    cache_salt: str | None = None

    @property
    def path(self) -> str:
        return "/query_by_hash" if self.hashes is not None else "/query"

    def body(self, tenant_field: str) -> dict[str, Any]:
        """The request body; `tenant_field` is "routing_group" (reference) or "tenant_id"."""
        model_name, _, tenant_id = self.key.rpartition(":")
        body: dict[str, Any] = {"model_name": model_name, tenant_field: tenant_id}
        if self.hashes is not None:
            body["block_hashes"] = [to_signed(h) for h in self.hashes]
        else:
            body["token_ids"] = self.tokens
            if self.lora_name is not None:
                body["lora_name"] = self.lora_name
            if self.cache_salt is not None:
                body["cache_salt"] = self.cache_salt
        return body

    def local_hashes(self, block_size: int) -> list[int]:
        if self.hashes is not None:
            return self.hashes
        assert self.tokens is not None
        return local_block_hashes(self.tokens, block_size, lora_name=self.lora_name, cache_salt=self.cache_salt)
