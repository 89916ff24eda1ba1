"""The routing defaults on workloads the gateway benchmark does not have, in the simulator.

    python -m bench.routing_shapes             # every shape (about 1 minute), tables on stdout
    python -m bench.routing_shapes --json out.json

`python -m bench.gateway` measures two workloads end to end; a default tuned to those two could
lose elsewhere. This runs the same scheduling cycle (`dynamo_lite.simulate.standin`: the engine
stand-ins' own scheduler and cache in simulated time, which agrees with the real runs within a
few per cent on hit ratio, bench/RESULTS.md) on other shapes of reuse and load, and on fleets
whose engines differ: the defaults, Dynamo's cost, round robin and least request, and the bound.

No default was tuned on these: they were written to try to make the defaults lose.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.routing.scheduling import dynamo_config
from dynamo_lite.simulate import standin
from dynamo_lite.simulate.standin import Arrival, FleetShape

BLOCK = 16
FAST = TimingModel(2.56e-4, 6.8e-3, 0.06e-3).scaled(2.0)  # the gateway benchmark's engines
SLOW = TimingModel(2.56e-4, 6.8e-3, 0.06e-3)  # half as fast
TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mooncake"


def tokens(label: str, count: int) -> list[int]:
    digest = hashlib.shake_128(label.encode()).digest(2 * count)
    return [int.from_bytes(digest[i:i + 2], "little") % 4000 for i in range(0, 2 * count, 2)]


def chat(conversations: int, turns: int, system_tokens: int, rate: float, *, systems: int = 1, user: int = 96,
         reply: int = 64, min_gap: int = 12, seed: int = 0) -> list[Arrival]:
    """Conversations that come back (bench/gateway_chat.py's shape): each turn's prompt is the
    conversation so far; `systems` different system prompts."""
    rng = random.Random(seed)
    done, last, order = [0] * conversations, [-min_gap] * conversations, []
    for slot in range(conversations * turns):
        left = [c for c in range(conversations) if done[c] < turns]
        eligible = [c for c in left if slot - last[c] >= min_gap] or left
        fewest = min(done[c] for c in eligible)
        chosen = rng.choice([c for c in eligible if done[c] == fewest])
        order.append(chosen)
        done[chosen] += 1
        last[chosen] = slot
    arrivals: list[Arrival] = []
    latest: dict[int, int] = {}
    turn_of = [0] * conversations
    for slot, c in enumerate(order):
        turn_of[c] += 1
        prompt = tokens(f"system:{c % systems}", system_tokens)
        for turn in range(1, turn_of[c]):
            prompt += tokens(f"user:{c}:{turn}", user) + tokens(f"reply:{c}:{turn}", reply)
        prompt += tokens(f"user:{c}:{turn_of[c]}", user)
        arrivals.append(Arrival(slot / rate, prompt, reply, after=latest.get(c), session=f"c{c}"))
        latest[c] = len(arrivals) - 1
    return arrivals


def poisson(count: int, rate: float, make: Callable[[int, random.Random], tuple[list[int], int]],
            seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for index in range(count):
        at += rng.expovariate(rate)
        prompt, max_tokens = make(index, rng)
        arrivals.append(Arrival(at, prompt, max_tokens))
    return arrivals


def prefix_groups(groups: int, users: int, prefix: int, question: int, rate: float, seed: int) -> list[Arrival]:
    """llm-d's shared-prefix benchmark, scaled down: groups of users sharing a long prefix."""
    def make(index: int, rng: random.Random) -> tuple[list[int], int]:
        group, user = rng.randrange(groups), rng.randrange(users)
        return tokens(f"group:{group}", prefix) + tokens(f"question:{group}:{user}:{index}", question), 48
    return poisson(groups * users * 3, rate, make, seed)


def mooncake(name: str, requests: int, compression: float) -> list[Arrival]:
    """A Mooncake trace scaled as bench.gateway scales it (64 tokens per 512-token hash id)."""
    from dynamo_lite.simulate.trace import load_trace

    from .gateway_trace import build

    trace = build(load_trace(TRACES / name, requests), tokens_per_hash_id=64, max_tokens_cap=64,
                  compression=compression)
    return [Arrival(item.at, json.loads(item.body)["prompt"], json.loads(item.body)["max_tokens"]) for item in trace.plan]


@dataclass(frozen=True)
class Shape:
    name: str
    what: str
    arrivals: Callable[[], list[Arrival]]
    fleet: FleetShape


def shapes() -> list[Shape]:
    eight = lambda blocks: FleetShape(8, blocks, BLOCK, FAST)  # noqa: E731
    mixed_speed = (FAST,) * 4 + (SLOW,) * 4
    return [
        Shape("chat", "the benchmark's chat: 32 conversations x 10 turns, 64-token system prompt, 9 turns/s",
              lambda: chat(32, 10, 64, 9.0), eight(560)),
        Shape("chat_long_system", "64 conversations x 6 turns sharing a 1,000-token system prompt, 12 turns/s",
              lambda: chat(64, 6, 1000, 12.0), eight(1024)),
        Shape("chat_4_systems", "48 conversations x 8 turns, 4 system prompts of 512 tokens, 200-token answers",
              lambda: chat(48, 8, 512, 10.0, systems=4, reply=200), eight(1024)),
        Shape("prefix_groups", "40 groups x 5 users sharing 1,024-token prefixes, 160-token questions, 8 req/s",
              lambda: prefix_groups(40, 5, 1024, 160, 8.0, 1), eight(1024)),
        Shape("prefix_groups_hot", "8 groups x 20 users sharing 3,000-token prefixes, 12 req/s",
              lambda: prefix_groups(8, 20, 3000, 160, 12.0, 1), eight(1024)),
        Shape("one_hot_prefix", "one 2,000-token prefix for every request, 60 req/s: more than one engine's prefill",
              lambda: poisson(600, 60.0, lambda i, rng: (tokens("hot", 2000) + tokens(f"hq:{i}", 200), 32), 5),
              eight(1024)),
        Shape("no_reuse", "prompts sharing nothing (exponential lengths, mean 800 tokens), 10 req/s",
              lambda: poisson(600, 10.0, lambda i, rng: (tokens(f"nr:{i}", max(16, int(rng.expovariate(1 / 800)))),
                                                         64), 2), eight(4096)),
        Shape("no_reuse_heavy", "the same at 40 req/s: pure load balancing under load",
              lambda: poisson(600, 40.0, lambda i, rng: (tokens(f"nr:{i}", max(16, int(rng.expovariate(1 / 800)))),
                                                         64), 2), eight(4096)),
        Shape("long_answers", "20 groups, 600-token prompts, answers of 600 tokens on average, 8 req/s",
              lambda: poisson(400, 8.0, lambda i, rng: (tokens(f"lo:{rng.randrange(20)}", 300) + tokens(f"lo:{i}", 600),
                                                        max(1, int(rng.expovariate(1 / 600)))), 4), eight(2048)),
        Shape("mooncake_synthetic", "the Mooncake synthetic trace's first 1,500 requests (compression 2)",
              lambda: mooncake("synthetic_trace.jsonl", 1500, 2.0), eight(24_000)),
        Shape("chat_mixed_fleet", "the chat at 2x on 4 engines of 512 blocks and 4 twice as slow of 1,024",
              lambda: chat(32, 10, 64, 18.0), FleetShape(8, (512,) * 4 + (1024,) * 4, BLOCK, mixed_speed)),
        Shape("mooncake_mixed_fleet", "the Mooncake conversation trace at 2x on 4 fast engines and 4 half as fast",
              lambda: mooncake("conversation_trace.jsonl", 2000, 7.0), FleetShape(8, 24_000, BLOCK, mixed_speed)),
    ]


ROUTERS: dict[str, Callable[[], standin.Router]] = {
    "defaults": lambda: standin.SchedulerRouter(),
    "dynamo": lambda: standin.SchedulerRouter(dynamo_config(), name="dynamo"),
    "round_robin": standin.RoundRobinRouter,
    "least_request": standin.LeastRequestRouter,
}


def run(shape: Shape) -> dict[str, object]:
    arrivals = shape.arrivals()
    hits = standin.endless_cache_hits([a.prompt for a in arrivals], BLOCK)
    bound = sum(hits) / sum(len(a.prompt) for a in arrivals)
    rows = {name: asdict(standin.summarise(standin.simulate(arrivals, shape.fleet, make()), shape.fleet.engines))
            for name, make in ROUTERS.items()}
    return {"shape": shape.name, "what": shape.what, "requests": len(arrivals), "bound": bound, "rows": rows}


def ratio(a: float, b: float) -> str:
    return "-" if not b else f"{a / b:.2f}"


def markdown(results: list[dict[str, object]]) -> str:
    lines = ["| shape | bound | hit ratio: defaults / dynamo / RR / LR | defaults ÷ RR: hit, TTFT p50, p99, tok/s "
             "| defaults ÷ LR: TTFT p50 | defaults ÷ dynamo: TTFT p50, p99 |", "|---|---|---|---|---|---|"]
    for result in results:
        rows = result["rows"]
        assert isinstance(rows, dict)
        ours, dyn, rr, lr = rows["defaults"], rows["dynamo"], rows["round_robin"], rows["least_request"]
        lines.append(
            f"| {result['shape']} | {result['bound']:.1%} | {ours['hit_ratio']:.1%} / {dyn['hit_ratio']:.1%} / "
            f"{rr['hit_ratio']:.1%} / {lr['hit_ratio']:.1%} | {ratio(ours['hit_ratio'], rr['hit_ratio'])}, "
            f"{ratio(ours['ttft_p50_ms'], rr['ttft_p50_ms'])}, {ratio(ours['ttft_p99_ms'], rr['ttft_p99_ms'])}, "
            f"{ratio(ours['output_tokens_per_s'], rr['output_tokens_per_s'])} | "
            f"{ratio(ours['ttft_p50_ms'], lr['ttft_p50_ms'])} | {ratio(ours['ttft_p50_ms'], dyn['ttft_p50_ms'])}, "
            f"{ratio(ours['ttft_p99_ms'], dyn['ttft_p99_ms'])} |")
    lines += ["", "Shapes:", ""] + [f"- `{result['shape']}`: {result['what']}" for result in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--shapes", nargs="+", default=None, help="only these shapes (default: all)")
    args = parser.parse_args(argv)
    results = []
    for shape in shapes():
        if args.shapes and shape.name not in args.shapes:
            continue
        started = time.monotonic()
        results.append(run(shape))
        print(f"{shape.name}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
