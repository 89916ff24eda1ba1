"""Differential tests: our slot tracker against Dynamo 1.6.1's (`python -m dynamo.slot_tracker`).

Both services run as subprocesses on loopback and receive the same randomized request lifecycle
(generated from a seeded `random.Random`, so a failure is reproducible from its seed and step).
Every answer is compared exactly after normalising the reference's vocabulary to ours:

* the reference's partition key is `routing_group`; ours is `tenant_id` (with `routing_group` as an
  input alias). The reference is sent `routing_group`; ours is sent, at random, `tenant_id`,
  `routing_group`, or nothing when the tenant is "default". Response keys `routing_group` become
  `tenant_id`, and `routing_group=` in error messages becomes `tenant_id=`; the reference's Rust
  debug texts for an unknown rank and a duplicate request id are translated into ours' wording
  (`_REWORDED`);
* `/potential_loads` order is unspecified: compared as a multiset.

Hashes are realistic chained block hashes (`h_i = H(h_{i-1}, block_i)`, emitted as signed i64),
built from a pool of shared "system prompt" prefixes, multi-turn continuations and unique suffixes:
`/potential_loads` is specified to agree with the reference only for such inputs.

Knobs: DYNAMO_LITE_DIFF_SEEDS (comma list, default 1..8), DYNAMO_LITE_DIFF_STEPS (per seed, default
1000). The reference venv is created on first use (see reference_server.py); without it these tests
skip loudly, or fail when DYNAMO_LITE_REQUIRE_REFERENCE=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import struct
import sys
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from support.reference_server import free_port, require_reference_or_skip, running_server

pytestmark = [pytest.mark.process, pytest.mark.reference]

SEEDS = [int(s) for s in os.environ.get("DYNAMO_LITE_DIFF_SEEDS", "1,2,3,4,5,6,7,8").split(",") if s.strip()]
STEPS = int(os.environ.get("DYNAMO_LITE_DIFF_STEPS", "1000"))

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
BODY_LIMIT = 2 * 1024 * 1024

MODELS = ["llama-3-8b", "Qwen2-7B", "m-é"]
TENANTS = ["default", "t1", "tenant-é", ""]
WORKER_IDS = [0, 1, 2, 3, 7, 42, 2**63 + 1, U64_MAX]
BLOCK_SIZES = [16, 32, 64]


# --------------------------------------------------------------------------------------------
# Services and the comparison
# --------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One logical request, as sent to each side (the bodies differ only in the tenant field)."""

    method: str
    path: str
    ref_body: Any = None
    ours_body: Any = None
    ref_params: dict[str, str] | None = None
    ours_params: dict[str, str] | None = None
    unordered: bool = False

    def describe(self) -> str:
        if self.method == "GET":
            return f"GET {self.path} reference params={self.ref_params} ours params={self.ours_params}"
        return (
            f"POST {self.path}\n    reference body: {_dump(self.ref_body)}\n    ours body:      {_dump(self.ours_body)}"
        )


@dataclass
class Answer:
    status: int | None  # None: the connection failed
    body: Any
    text: str

    def short(self, limit: int = 1500) -> str:
        text = self.text if len(self.text) <= limit else self.text[:limit] + f"... ({len(self.text)} chars)"
        return f"{self.status} {text}"


def _dump(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= 600 else text[:600] + f"... ({len(text)} chars)"


# Messages ours words for people where the reference prints Rust debug text (same statuses).
_REWORDED = [
    (re.compile(r"^Worker WorkerWithDpRank \{ worker_id: (\d+), dp_rank: (\d+) \} not found$"),
     lambda m: f"worker {m[1]} dp_rank {m[2]} is not registered for this model and tenant"),
    (re.compile(r"^Request (.*) already exists \(assigned to worker WorkerWithDpRank "
                r"\{ worker_id: (\d+), dp_rank: (\d+) \}\)$"),
     lambda m: f"request {m[1]} already exists (assigned to worker {m[2]} dp_rank {m[3]})"),
    (re.compile(r"^Request (.*) not found$"), lambda m: f"request {m[1]} not found"),
]


def _reword(message: str) -> str:
    for pattern, words in _REWORDED:
        match = pattern.match(message)
        if match:
            return words(match)
    return message


def _rename(value: Any) -> Any:
    if isinstance(value, dict):
        out = {("tenant_id" if k == "routing_group" else k): _rename(v) for k, v in value.items()}
        if isinstance(out.get("error"), str):
            out["error"] = _reword(out["error"].replace("routing_group=", "tenant_id="))
        return out
    if isinstance(value, list):
        return [_rename(v) for v in value]
    return value


def _ordered(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _canonical_multiset(items: Any) -> Any:
    if not isinstance(items, list):
        return items
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))


class Pair:
    """Both services plus a short history, for failure reports."""

    def __init__(self, ref_url: Any, ours_url: Any, ref: httpx.Client, ours: httpx.Client,
                 ours_is_reference: bool = False) -> None:
        self.ref_url, self.ours_url = ref_url, ours_url
        self.ref, self.ours = ref, ours
        # Self-check mode (DYNAMO_LITE_DIFF_SELF=1): "ours" is a second reference instance, which
        # validates the harness and the generator; it only understands `routing_group`.
        self.ours_is_reference = ours_is_reference
        self.ours_tenant_key = "routing_group" if ours_is_reference else "tenant_id"
        self.ours_body_keys = ["routing_group"] if ours_is_reference else ["tenant_id", "routing_group"]
        self.history: deque[str] = deque(maxlen=25)
        self.context = ""

    @staticmethod
    def _send(client: httpx.Client, method: str, path: str, body: Any, params: Any) -> Answer:
        try:
            if method == "GET":
                response = client.get(path, params=params)
            else:
                response = client.post(path, json=body)
        except httpx.HTTPError as exc:
            return Answer(None, None, f"<transport error {type(exc).__name__}: {exc}>")
        try:
            parsed = response.json() if response.content else None
        except ValueError:
            parsed = ("<not JSON>", response.text)
        return Answer(response.status_code, parsed, response.text)

    def exchange(self, call: Call) -> tuple[int | None, Any]:
        """Send `call` to both sides; fail on any difference; return (status, normalised body)."""
        ref = self._send(self.ref, call.method, call.path, call.ref_body, call.ref_params)
        ours = self._send(self.ours, call.method, call.path, call.ours_body, call.ours_params)
        ref_norm = _rename(ref.body)
        ours_norm = _rename(ours.body) if self.ours_is_reference else ours.body
        if call.unordered and ref.status == 200:
            ref_norm, ours_norm = _canonical_multiset(ref_norm), _canonical_multiset(ours_norm)
        # Exact: values, and also the order of object keys (the reference's order is fixed).
        if ref.status != ours.status or _ordered(ref_norm) != _ordered(ours_norm):
            self.fail(call, ref, ours)
        self.history.append(f"{call.describe()}\n    -> {ref.short(300)}")
        return ref.status, ref_norm

    def fail(self, call: Call, ref: Answer, ours: Answer, what: str = "MISMATCH") -> None:
        history = "\n".join(f"  [{i - len(self.history)}] {h}" for i, h in enumerate(self.history))
        alive = f"reference alive={self.ref_url.alive()}, ours alive={self.ours_url.alive()}"
        pytest.fail(
            f"{what} {self.context}\n"
            f"request: {call.describe()}\n"
            f"reference: {ref.short()}\n"
            f"ours:      {ours.short()}\n"
            f"({alive})\n"
            f"previous requests (oldest first, reference answers):\n{history}",
            pytrace=False,
        )

    def reset(self) -> None:
        """Unregister everything on both sides (each from its own /workers listing)."""
        for client, key in ((self.ref, "routing_group"), (self.ours, self.ours_tenant_key)):
            for worker in client.get("/workers").json():
                client.post(
                    "/unregister",
                    json={"worker_id": worker["worker_id"], "model_name": worker["model_name"], key: worker[key]},
                )
            assert client.get("/workers").json() == [], "cannot reset a service"


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    ref_python = require_reference_or_skip()
    ref_port, ours_port = free_port(), free_port()
    while ours_port == ref_port:
        ours_port = free_port()
    ref_argv = [str(ref_python), "-m", "dynamo.slot_tracker", "--port", str(ref_port)]
    self_check = os.environ.get("DYNAMO_LITE_DIFF_SELF") == "1"
    if self_check:
        ours_argv = [str(ref_python), "-m", "dynamo.slot_tracker", "--port", str(ours_port)]
    else:
        ours_argv = [sys.executable, "-m", "dynamo_lite.slot_tracker", "--host", "127.0.0.1",
                     "--port", str(ours_port), "--log-level", "warning"]
    with running_server(ref_argv, ref_port) as ref_url, running_server(ours_argv, ours_port) as ours_url:
        with httpx.Client(base_url=ref_url, timeout=30) as ref, httpx.Client(base_url=ours_url, timeout=30) as ours:
            yield Pair(ref_url, ours_url, ref, ours, ours_is_reference=self_check)


# --------------------------------------------------------------------------------------------
# Realistic chained hashes
# --------------------------------------------------------------------------------------------

_ROOT = 0x5EED_0F_B10C5


def _chain_step(previous: int, block: int) -> int:
    digest = hashlib.blake2b(struct.pack("<QQ", previous, block), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=False)


def chained_hashes(blocks: list[int]) -> list[int]:
    """h_i = H(h_{i-1}, block_i) as signed i64: equal hashes imply equal prefixes."""
    out = []
    h = _ROOT
    for block in blocks:
        h = _chain_step(h, block)
        out.append(h - 2**64 if h > I64_MAX else h)
    return out


# --------------------------------------------------------------------------------------------
# The randomized lifecycle
# --------------------------------------------------------------------------------------------


@dataclass
class Request:
    worker_id: int
    dp_rank: int
    blocks: list[int]


@dataclass
class Tracker:
    block_size: int
    workers: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker_id -> (dp_start, dp_size)
    requests: dict[str, Request] = field(default_factory=dict)

    def ranks(self) -> list[tuple[int, int]]:
        return [(w, start + i) for w, (start, size) in self.workers.items() for i in range(size)]


class Lifecycle:
    """Generates calls from a seeded RNG and mirrors the (reference-confirmed) state."""

    def __init__(self, seed: int, pair: Pair) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.pair = pair
        rng = self.rng
        self.models = rng.sample(MODELS, 2)
        self.tenants = ["default", *rng.sample(TENANTS[1:], 2)] if seed % 2 else rng.sample(TENANTS, 2)
        self.keys = [(m, t) for m in self.models for t in self.tenants]
        self.trackers: dict[tuple[str, str], Tracker] = {}
        self.next_block = 1
        self.next_request = 0
        self.system_prompts = [self.fresh_blocks(rng.choice([0, 2, 4, 8, 12, 20])) for _ in range(5)]
        self.prompts: list[list[int]] = []  # earlier prompts, for multi-turn continuations
        self.freed_ids: list[tuple[tuple[str, str], str]] = []
        self.coverage: Counter[tuple[str, int | None]] = Counter()

    # ---- generators of values

    def fresh_blocks(self, n: int) -> list[int]:
        start = self.next_block
        self.next_block += n
        # block "content" ids: unique per seed; mixed with the seed so seeds differ.
        return [(self.seed << 40) + b for b in range(start, start + n)]

    def prompt(self) -> list[int]:
        rng = self.rng
        mode = rng.random()
        if mode < 0.05:
            blocks: list[int] = []
        elif mode < 0.40 or not self.prompts:
            blocks = rng.choice(self.system_prompts) + self.fresh_blocks(rng.randint(0, 8))
        elif mode < 0.75:  # next turn of an earlier conversation
            base = rng.choice(self.prompts)
            blocks = base + self.fresh_blocks(rng.randint(1, 6))
        elif mode < 0.90:  # same prompt again (cache hit)
            blocks = list(rng.choice(self.prompts))
        elif mode < 0.97:  # shares part of an earlier prompt, then diverges
            base = rng.choice(self.prompts)
            blocks = base[: rng.randint(0, len(base))] + self.fresh_blocks(rng.randint(1, 6))
        else:  # long prompt
            blocks = rng.choice(self.system_prompts) + self.fresh_blocks(rng.randint(100, 400))
        if blocks:
            self.prompts.append(blocks)
            if len(self.prompts) > 200:
                self.prompts.pop(rng.randrange(len(self.prompts)))
        return blocks

    def query_blocks(self, tracker: Tracker | None) -> list[int]:
        """Hashes for /potential_loads: mostly sharing prefixes with active requests."""
        rng = self.rng
        active = list(tracker.requests.values()) if tracker else []
        mode = rng.random()
        if active and mode < 0.65:
            base = rng.choice(active).blocks
            cut = rng.choice([len(base), rng.randint(0, len(base))])
            extra = rng.choice([0, 0, rng.randint(1, 8)])
            return base[:cut] + self.fresh_blocks(extra)
        if mode < 0.75:
            return []
        if mode < 0.9:
            return rng.choice(self.system_prompts) + self.fresh_blocks(rng.randint(0, 5))
        return self.prompt()

    def isl(self) -> int | None:
        """new_isl_tokens: None means "omit the field"."""
        r = self.rng.random()
        if r < 0.15:
            return None
        if r < 0.35:
            return 0
        if r < 0.97:
            return self.rng.randint(1, 5000)
        return self.rng.choice([2**32, 2**40 + 3])  # large but far from wrapping u64

    def request_id(self) -> str:
        self.next_request += 1
        r = self.rng.random()
        if r < 0.03:
            return f"réq-{self.next_request}-😀"
        if r < 0.05:
            return f"req {self.next_request} with spaces/and?query=chars"
        return f"req-{self.seed}-{self.next_request}"

    def ghost_key(self) -> tuple[str, str]:
        return self.rng.choice([("no-such-model", self.rng.choice(self.tenants)), (self.models[0], "ghost-tenant")])

    # ---- bodies

    def bodies(self, key: tuple[str, str], before: dict[str, Any], after: dict[str, Any]) -> tuple[dict, dict]:
        """(reference body, our body) for a tracker key: `before` fields, model/tenant, `after` fields."""
        model, tenant = key
        rng = self.rng
        ref: dict[str, Any] = dict(before)
        ours: dict[str, Any] = dict(before)
        ref["model_name"] = ours["model_name"] = model
        if tenant != "default" or rng.random() < 0.5:
            ref["routing_group"] = tenant
        keys: list[str | None] = list(self.pair.ours_body_keys)
        choice = rng.choice(keys + [None] if tenant == "default" else keys)
        if choice is not None:
            ours[choice] = tenant
        ref.update(after)
        ours.update(after)
        return ref, ours

    def post(self, path: str, key: tuple[str, str], before: dict[str, Any], after: dict[str, Any],
             unordered: bool = False) -> tuple[int | None, Any]:
        ref, ours = self.bodies(key, before, after)
        status, body = self.pair.exchange(Call("POST", path, ref, ours, unordered=unordered))
        self.coverage[(path, status)] += 1
        return status, body

    def get(self, path: str, model: str | None, tenant: str | None) -> tuple[int | None, Any]:
        ref_params: dict[str, str] = {}
        ours_params: dict[str, str] = {}
        if model is not None:
            ref_params["model_name"] = ours_params["model_name"] = model
        if tenant is not None:
            ref_params["routing_group"] = tenant
            ours_params[self.pair.ours_tenant_key] = tenant
        status, body = self.pair.exchange(Call("GET", path, ref_params=ref_params, ours_params=ours_params))
        self.coverage[(path, status)] += 1
        return status, body

    # ---- operations

    def op_register(self) -> None:
        rng = self.rng
        key = rng.choice(self.keys)
        tracker = self.trackers.get(key)
        r = rng.random()
        worker_id = rng.choice(WORKER_IDS)
        block_size = tracker.block_size if tracker else rng.choice(BLOCK_SIZES)
        dp_start = rng.choice([0, 0, 0, 1, 3, 8, 1000, U32_MAX - 10])
        dp_size = rng.choice([1, 1, 2, 2, 3, 4])
        if tracker and r < 0.12 and tracker.workers:  # duplicate (maybe with another range)
            worker_id = rng.choice(list(tracker.workers))
        elif tracker and r < 0.22:  # block-size mismatch
            block_size = rng.choice([b for b in BLOCK_SIZES if b != tracker.block_size] + [1, 4096])
        elif r < 0.38:  # field validation errors, alone or combined (order of checks matters)
            bad = rng.choice(["block0", "dp0", "both0", "big", "bigger", "overflow", "overflow-big",
                              "overflow-edge", "big-and-overflow"])
            if bad in ("block0", "both0"):
                block_size = 0
            if bad in ("dp0", "both0"):
                dp_size = 0
            if bad == "big":
                dp_size = 4097
            if bad == "bigger":
                dp_size = U32_MAX
            if bad == "overflow":
                dp_start, dp_size = U32_MAX, 1
            if bad == "overflow-big":
                dp_start, dp_size = U32_MAX - 1000, 4096
            if bad == "overflow-edge":
                dp_start, dp_size = U32_MAX - 3, 4
            if bad == "big-and-overflow":
                dp_start, dp_size = U32_MAX, 5000
        status, _ = self.post("/register", key, {"worker_id": worker_id},
                              {"block_size": block_size, "dp_start": dp_start, "dp_size": dp_size})
        if status == 201:
            self.trackers.setdefault(key, Tracker(block_size)).workers[worker_id] = (dp_start, dp_size)

    def op_unregister(self) -> None:
        rng = self.rng
        live = [k for k in self.keys if k in self.trackers]
        r = rng.random()
        if live and r < 0.8:
            key = rng.choice(live)
            tracker = self.trackers[key]
            worker_id = rng.choice(list(tracker.workers)) if r < 0.7 else rng.choice(WORKER_IDS)
        else:
            key = rng.choice([self.ghost_key(), rng.choice(self.keys)])
            worker_id = rng.choice(WORKER_IDS)
        status, _ = self.post("/unregister", key, {"worker_id": worker_id}, {})
        if status == 200:
            tracker = self.trackers[key]
            del tracker.workers[worker_id]
            for rid in [rid for rid, req in tracker.requests.items() if req.worker_id == worker_id]:
                del tracker.requests[rid]
                self.freed_ids.append((key, rid))
            if not tracker.workers:
                del self.trackers[key]

    def op_add(self) -> None:
        rng = self.rng
        live = [k for k in self.keys if k in self.trackers]
        r = rng.random()
        if not live or r < 0.05:
            key = self.ghost_key() if live and rng.random() < 0.7 else rng.choice(self.keys)
            worker_id, dp_rank = rng.choice(WORKER_IDS), 0
            tracker = None
        else:
            key = rng.choice(live)
            tracker = self.trackers[key]
            worker_id, dp_rank = rng.choice(tracker.ranks())
        request_id = self.request_id()
        if tracker is not None:
            if r < 0.13:  # unknown rank: just outside a range, or an unregistered worker
                start, size = tracker.workers[worker_id]
                dp_rank = rng.choice([start + size, max(0, start - 1), U32_MAX])
                if rng.random() < 0.4:
                    worker_id = rng.choice(WORKER_IDS)
            elif r < 0.23 and tracker.requests:  # duplicate id, on any rank
                request_id = rng.choice(list(tracker.requests))
            elif r < 0.30 and self.freed_ids:  # reuse an id that was freed (or never existed here)
                request_id = rng.choice(self.freed_ids)[1]
            elif r < 0.32 and "" not in tracker.requests:
                request_id = ""
        blocks = self.prompt()
        after: dict[str, Any] = {"request_id": request_id, "worker_id": worker_id, "dp_rank": dp_rank,
                                 "sequence_hashes": chained_hashes(blocks)}
        isl = self.isl()
        if isl is not None:
            after["new_isl_tokens"] = isl
        status, _ = self.post("/add", key, {}, after)
        if status == 201:
            self.trackers[key].requests[request_id] = Request(worker_id, dp_rank, blocks)

    def _pick_request(self) -> tuple[tuple[str, str], str]:
        rng = self.rng
        live = [k for k in self.keys if k in self.trackers and self.trackers[k].requests]
        r = rng.random()
        if live and r < 0.75:
            key = rng.choice(live)
            return key, rng.choice(list(self.trackers[key].requests))
        if r < 0.85 and self.freed_ids:
            return rng.choice(self.freed_ids)
        if r < 0.93:
            key = rng.choice([k for k in self.keys if k in self.trackers] or self.keys)
            # an id active in another tracker, or never seen
            others = [rid for k, t in self.trackers.items() if k != key for rid in t.requests]
            return key, rng.choice(others) if others and rng.random() < 0.5 else f"never-{rng.randint(0, 99)}"
        return self.ghost_key(), f"req-{self.seed}-{rng.randint(0, self.next_request)}"

    def op_prefill_complete(self) -> None:
        key, request_id = self._pick_request()
        self.post("/prefill_complete", key, {}, {"request_id": request_id})

    def op_free(self) -> None:
        key, request_id = self._pick_request()
        status, _ = self.post("/free", key, {}, {"request_id": request_id})
        tracker = self.trackers.get(key)
        if status == 200 and tracker is not None and request_id in tracker.requests:
            del tracker.requests[request_id]
            self.freed_ids.append((key, request_id))

    def op_potential_loads(self) -> None:
        rng = self.rng
        live = [k for k in self.keys if k in self.trackers]
        key = rng.choice(live) if live and rng.random() < 0.93 else rng.choice([self.ghost_key(), *self.keys])
        after: dict[str, Any] = {"sequence_hashes": chained_hashes(self.query_blocks(self.trackers.get(key)))}
        isl = self.isl()
        if isl is not None:
            after["new_isl_tokens"] = isl
        self.post("/potential_loads", key, {}, after, unordered=True)

    def _filters(self) -> tuple[str | None, str | None]:
        rng = self.rng
        model = rng.choice([None, None, *self.models, "no-such-model", ""])
        tenant = rng.choice([None, None, *self.tenants, "ghost-tenant", ""])
        return model, tenant

    def op_loads(self) -> None:
        self.get("/loads", *self._filters())

    def op_workers(self) -> None:
        self.get("/workers", *self._filters())

    # ---- the run

    def step(self) -> None:
        active = sum(len(t.requests) for t in self.trackers.values())
        ops = [
            (self.op_register, 10 if len(self.trackers) < 3 else 5),
            (self.op_unregister, 2.5),
            (self.op_add, 30),
            (self.op_prefill_complete, 9),
            (self.op_free, 14 + (25 if active > 80 else 0)),
            (self.op_potential_loads, 16),
            (self.op_loads, 5),
            (self.op_workers, 2.5),
        ]
        op = self.rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
        op()

    def drain_and_check(self) -> None:
        """Free every active request and check that all loads are back to zero on both sides."""
        for key, tracker in list(self.trackers.items()):
            for request_id in list(tracker.requests):
                status, _ = self.post("/free", key, {}, {"request_id": request_id})
                assert status == 200
                del tracker.requests[request_id]
        _, loads = self.get("/loads", None, None)
        busy = [e for e in loads if e["active_prefill_tokens"] or e["active_decode_blocks"]]
        assert not busy, f"seed {self.seed}: loads not zero after freeing everything: {busy}"
        ours_loads = self.pair.ours.get("/loads").json()
        assert all(e["active_prefill_tokens"] == 0 and e["active_decode_blocks"] == 0 for e in ours_loads)
        for key in list(self.trackers):  # potential loads of an idle tracker: blocks = |Q|, no requests
            self.op_potential_loads_for(key)
        for key, tracker in list(self.trackers.items()):
            for worker_id in list(tracker.workers):
                status, _ = self.post("/unregister", key, {"worker_id": worker_id}, {})
                assert status == 200
            del self.trackers[key]
        assert self.get("/workers", None, None)[1] == []
        assert self.get("/loads", None, None)[1] == []

    def op_potential_loads_for(self, key: tuple[str, str]) -> None:
        hashes = chained_hashes(self.prompt())
        status, body = self.post("/potential_loads", key, {}, {"sequence_hashes": hashes, "new_isl_tokens": 5},
                                 unordered=True)
        assert status == 200
        assert all(e["potential_decode_blocks"] == len(hashes) and e["active_requests"] == 0 for e in body)


# Statuses every seed must produce at least once, so a degenerate generator is noticed.
REQUIRED_COVERAGE = [
    ("/register", 201), ("/register", 400), ("/register", 409),
    ("/unregister", 200), ("/unregister", 404),
    ("/add", 201), ("/add", 404), ("/add", 409),
    ("/prefill_complete", 200), ("/prefill_complete", 404),
    ("/free", 200), ("/free", 404),
    ("/potential_loads", 200), ("/potential_loads", 404),
    ("/loads", 200), ("/workers", 200),
]


@pytest.mark.parametrize("seed", SEEDS)
def test_randomized_lifecycle(pair: Pair, seed: int) -> None:
    pair.reset()
    pair.history.clear()
    lifecycle = Lifecycle(seed, pair)
    for index in range(STEPS):
        pair.context = f"(seed={seed}, step={index}; rerun: DYNAMO_LITE_DIFF_SEEDS={seed})"
        lifecycle.step()
        if index % 50 == 49:  # full snapshots now and then, whatever the generator chose
            lifecycle.get("/loads", None, None)
            lifecycle.get("/workers", None, None)
    pair.context = f"(seed={seed}, final drain)"
    lifecycle.drain_and_check()
    print(f"seed {seed}: {sum(lifecycle.coverage.values())} calls per side; "
          + ", ".join(f"{p} {s}: {n}" for (p, s), n in sorted(lifecycle.coverage.items(), key=str)))
    missing = [c for c in REQUIRED_COVERAGE if not lifecycle.coverage[c]]
    assert not missing, f"seed {seed}: the generator never produced {missing}; coverage {dict(lifecycle.coverage)}"


# --------------------------------------------------------------------------------------------
# Scripted scenarios (documented examples and edges)
# --------------------------------------------------------------------------------------------


def _both(pair: Pair, path: str, body: dict[str, Any], *, tenant: str | None = None, unordered: bool = False) -> Any:
    ref, ours = dict(body), dict(body)
    if tenant is not None:
        ref["routing_group"] = tenant
        ours[pair.ours_tenant_key] = tenant
    return pair.exchange(Call("POST", path, ref, ours, unordered=unordered))


def _get(pair: Pair, path: str, params: dict[str, str] | None = None) -> Any:
    params = params or {}
    ref = {("routing_group" if k == "tenant_id" else k): v for k, v in params.items()}
    ours = {(pair.ours_tenant_key if k == "tenant_id" else k): v for k, v in params.items()}
    return pair.exchange(Call("GET", path, ref_params=ref, ours_params=ours))


def test_documented_example_and_tracker_lifetime(pair: Pair) -> None:
    """The worked example of Dynamo 1.6.1's observed behaviour, then tracker deletion and re-creation."""
    pair.reset()
    pair.context = "(scripted: documented example)"
    reg = {"model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2}
    assert _both(pair, "/register", {"worker_id": 1, **reg})[0] == 201
    assert _both(pair, "/register", {"worker_id": 2, **reg})[0] == 201
    a, b, c = chained_hashes([1, 2, 3]), chained_hashes([1, 2, 4]), chained_hashes([1, 2, 3])
    for rid, worker, rank, hashes, isl in (("a", 1, 0, a, 100), ("b", 1, 0, b, 50), ("c", 1, 1, c, 0), ("d", 2, 0, [], 7)):
        body = {"model_name": "m", "request_id": rid, "worker_id": worker, "dp_rank": rank,
                "sequence_hashes": hashes, "new_isl_tokens": isl}
        assert _both(pair, "/add", body)[0] == 201
    status, loads = _get(pair, "/loads")
    assert [(e["active_prefill_tokens"], e["active_decode_blocks"]) for e in loads] == [(150, 4), (0, 3), (7, 0), (0, 0)]
    _both(pair, "/potential_loads", {"model_name": "m", "sequence_hashes": chained_hashes([1, 2, 3, 9])}, unordered=True)
    _both(pair, "/add", {"model_name": "m", "request_id": "a", "worker_id": 2, "dp_rank": 1, "sequence_hashes": []})
    _both(pair, "/add", {"model_name": "m", "request_id": "a", "worker_id": 9, "dp_rank": 0, "sequence_hashes": []})
    _both(pair, "/prefill_complete", {"model_name": "m", "request_id": "a"})
    _both(pair, "/prefill_complete", {"model_name": "m", "request_id": "a"})
    _get(pair, "/loads", {"model_name": "m", "tenant_id": "default"})
    # unregistering worker 1 forgets a, b, c; the tracker lives on with worker 2
    assert _both(pair, "/unregister", {"worker_id": 1, "model_name": "m"})[0] == 200
    _both(pair, "/prefill_complete", {"model_name": "m", "request_id": "a"})
    _both(pair, "/free", {"model_name": "m", "request_id": "b"})
    _both(pair, "/add", {"model_name": "m", "request_id": "a", "worker_id": 2, "dp_rank": 1, "sequence_hashes": a})
    _both(pair, "/potential_loads", {"model_name": "m", "sequence_hashes": a, "new_isl_tokens": 3}, unordered=True)
    # last worker gone: the tracker and its block size are forgotten
    assert _both(pair, "/unregister", {"worker_id": 2, "model_name": "m"})[0] == 200
    _both(pair, "/free", {"model_name": "m", "request_id": "a"})
    _both(pair, "/potential_loads", {"model_name": "m", "sequence_hashes": []})
    assert _both(pair, "/register", {"worker_id": 2, **reg, "block_size": 32})[0] == 201
    _both(pair, "/unregister", {"worker_id": 2, "model_name": "m"}, tenant="default")
    _both(pair, "/unregister", {"worker_id": 2, "model_name": "m"}, tenant="default")
    _get(pair, "/workers")


def test_register_range_edges(pair: Pair) -> None:
    """The largest legal range (4096 ranks ending at u32::MAX - 1) and its neighbours."""
    pair.reset()
    pair.context = "(scripted: range edges)"
    base = {"model_name": "edge", "block_size": 1}
    assert _both(pair, "/register", {"worker_id": U64_MAX, **base, "dp_start": U32_MAX - 4096, "dp_size": 4096})[0] == 201
    assert _both(pair, "/register", {"worker_id": 5, **base, "dp_start": U32_MAX - 4095, "dp_size": 4096})[0] == 400
    assert _both(pair, "/register", {"worker_id": 5, **base, "dp_start": 0, "dp_size": 4096})[0] == 201
    _both(pair, "/add", {"model_name": "edge", "request_id": "x", "worker_id": U64_MAX, "dp_rank": U32_MAX - 1,
                         "sequence_hashes": [I64_MIN, -1, 0, I64_MAX], "new_isl_tokens": U64_MAX // 2})
    _both(pair, "/add", {"model_name": "edge", "request_id": "y", "worker_id": U64_MAX, "dp_rank": U32_MAX,
                         "sequence_hashes": []})
    _both(pair, "/potential_loads", {"model_name": "edge", "sequence_hashes": [I64_MIN, -1]}, unordered=True)
    _get(pair, "/loads", {"model_name": "edge"})
    _get(pair, "/workers")
    pair.reset()


# --------------------------------------------------------------------------------------------
# Malformed bodies: statuses must agree (messages are not compared)
# --------------------------------------------------------------------------------------------

_ADD = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1]}
_REG = {"worker_id": 1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _padded(value: Any, size: int) -> bytes:
    raw = _json(value)
    return raw + b" " * (size - len(raw))


_JSON = {"content-type": "application/json"}
MALFORMED: list[tuple[str, str, bytes, dict[str, str], int]] = [
    # (name, path, body, headers, status the reference gives)
    ("text/plain", "/add", _json(_ADD), {"content-type": "text/plain"}, 415),
    ("no content type", "/register", _json(_REG), {}, 415),
    ("form content type", "/free", b"model_name=m&request_id=r", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("over 2 MiB", "/potential_loads", _padded({"model_name": "nope", "sequence_hashes": []}, BODY_LIMIT + 1), _JSON, 413),
    ("exactly 2 MiB", "/potential_loads", _padded({"model_name": "nope", "sequence_hashes": []}, BODY_LIMIT), _JSON, 404),
    ("empty body", "/add", b"", _JSON, 400),
    ("truncated object", "/register", b"{", _JSON, 400),
    ("trailing comma", "/free", b'{"model_name":"m","request_id":"r",}', _JSON, 400),
    ("garbage", "/prefill_complete", b"hello", _JSON, 400),
    ("missing request_id", "/add", _json({k: v for k, v in _ADD.items() if k != "request_id"}), _JSON, 422),
    ("missing sequence_hashes", "/potential_loads", _json({"model_name": "m"}), _JSON, 422),
    ("missing block_size", "/register", _json({k: v for k, v in _REG.items() if k != "block_size"}), _JSON, 422),
    ("worker_id string", "/register", _json({**_REG, "worker_id": "1"}), _JSON, 422),
    ("worker_id negative", "/unregister", _json({"worker_id": -1, "model_name": "m"}), _JSON, 422),
    ("dp_rank above u32", "/add", _json({**_ADD, "dp_rank": 2**32}), _JSON, 422),
    ("float hash", "/add", _json({**_ADD, "sequence_hashes": [1.0]}), _JSON, 422),
    ("null new_isl_tokens", "/add", _json({**_ADD, "new_isl_tokens": None}), _JSON, 422),
    ("null sequence_hashes", "/potential_loads", _json({"model_name": "m", "sequence_hashes": None}), _JSON, 422),
    ("null model_name", "/free", _json({"model_name": None, "request_id": "r"}), _JSON, 422),
    ("hash 2^63", "/add", _json({**_ADD, "sequence_hashes": [2**63]}), _JSON, 422),
    ("hash -2^63-1", "/potential_loads", _json({"model_name": "m", "sequence_hashes": [-(2**63) - 1]}), _JSON, 422),
    ("hashes object", "/potential_loads", _json({"model_name": "m", "sequence_hashes": {}}), _JSON, 422),
    ("top-level null", "/free", b"null", _JSON, 422),
    ("top-level string", "/register", b'"x"', _JSON, 422),
]


@pytest.mark.parametrize("name,path,body,headers,expected", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_status(pair: Pair, name: str, path: str, body: bytes, headers: dict[str, str], expected: int) -> None:
    answers = []
    for client in (pair.ref, pair.ours):
        try:
            answers.append(client.post(path, content=body, headers=headers).status_code)
        except httpx.HTTPError as exc:
            answers.append(f"<{type(exc).__name__}: {exc}>")
    assert answers[0] == expected, f"{name}: the reference answered {answers[0]}, the test expected {expected}"
    assert answers[1] == answers[0], f"{name}: POST {path}: reference {answers[0]}, ours {answers[1]}"


@pytest.mark.parametrize("path", ["/loads", "/workers", "/health"])
def test_a_get_with_a_small_json_body_is_answered_as_without_one(pair: Pair, path: str) -> None:
    """The reference ignores a body sent with GET; ours answered 413 before."""
    answers = [client.request("GET", path, content=b'{"model_name": "m"}', headers=_JSON) for client in (pair.ref, pair.ours)]
    assert answers[0].status_code == 200, answers[0].text
    assert (answers[1].status_code, answers[1].text) == (answers[0].status_code, answers[0].text)


def test_an_unknown_query_parameter_reference_ignores_it_ours_is_400(pair: Pair) -> None:
    """A documented difference: `?model=` (a typo of model_name) filters nothing in the reference."""
    ref = pair.ref.get("/loads", params={"model": "m"})
    ours = pair.ours.get("/loads", params={"model": "m"})
    assert ref.status_code == 200
    expected = 200 if pair.ours_is_reference else 400
    assert ours.status_code == expected and ("unknown query parameter `model`" in ours.text or expected == 200)


@pytest.mark.parametrize("tenant_value", [None, 5, ["x"]], ids=["null", "number", "array"])
def test_malformed_tenant_field(pair: Pair, tenant_value: Any) -> None:
    """A tenant field of the wrong type is a 422 on both sides (ours named tenant_id)."""
    ref = pair.ref.post("/free", json={"model_name": "m", "routing_group": tenant_value, "request_id": "r"})
    ours = pair.ours.post("/free", json={"model_name": "m", pair.ours_tenant_key: tenant_value, "request_id": "r"})
    assert ref.status_code == 422
    assert ours.status_code == ref.status_code, ours.text


# Body-parsing quirks of the reference's serde/axum stack. Where ours
# answers differently on purpose, docs/differences.md says so and the case pins
# both answers: (path, body, reference status, our status).
QUIRKS = [
    pytest.param("/register", b'{"worker_id":1,"worker_id":2,"model_name":"q-dup","block_size":16,"dp_start":0,"dp_size":1}',
                 422, 201, id="duplicate key: reference 422, ours takes the last value"),
    pytest.param("/free", b'{"model_name":"nope","request_id":"r","model_name":"x"}',
                 422, 404, id="duplicate key before tracker lookup: reference 422, ours last value"),
    pytest.param("/register", b'{"worker_id":-0,"model_name":"q-negzero","block_size":16,"dp_start":0,"dp_size":1}',
                 422, 201, id="integer -0: reference float 422, ours 0"),
    pytest.param("/potential_loads", b'{"model_name":"nope","sequence_hashes":[-0]}',
                 422, 404, id="hash -0: reference float 422, ours 0"),
    pytest.param("/register", b'{"worker_id":1,"model_name":"q-trail","block_size":16,"dp_start":0,"dp_size":1} x',
                 201, 400, id="content after the JSON value: reference ignores it, ours 400"),
    pytest.param("/register", b'[1,"q-arr","default",16,0,1]',
                 201, 422, id="positional array body: reference accepts, ours 422"),
    pytest.param("/register", b'{"worker_id":1,"model_name":"q-exp","block_size":1e1,"dp_start":0,"dp_size":1}',
                 422, 422, id="exponent number is a float -> 422"),
    pytest.param("/register", b' \n{"worker_id":1,"model_name":"q-ws","block_size":16,"dp_start":0,"dp_size":1}\n ',
                 201, 201, id="surrounding whitespace -> 201"),
    pytest.param("/register", b'{"worker_id":1,"model_name":"q-ct","block_size":16,"dp_start":0,"dp_size":1,"extra":{"a":[[1]]}}',
                 201, 201, id="unknown fields ignored -> 201"),
]


@pytest.mark.parametrize("path,body,reference_status,our_status", QUIRKS)
def test_parsing_quirk_status(pair: Pair, path: str, body: bytes, reference_status: int, our_status: int) -> None:
    pair.reset()
    try:
        ref = pair.ref.post(path, content=body, headers=_JSON)
        ours = pair.ours.post(path, content=body, headers=_JSON)
        assert ref.status_code == reference_status, f"the reference answered {ref.status_code} {ref.text}"
        assert ours.status_code == our_status, (
            f"POST {path} {body!r}: reference {ref.status_code} {ref.text}; ours {ours.status_code} {ours.text}"
        )
    finally:
        pair.reset()
