"""Part 1 of `python -m bench.gateway`: routing quality on a fleet-sized gateway, real and simulated.

Two workloads, each at its base rate and at 2x and 3x (where balancing load matters most):

* **mooncake**: the first 2,000 requests of the public Mooncake conversation trace
  (`../shared/data/mooncake/conversation_trace.jsonl` beside the checkout, or `--trace`), at the
  trace's arrival times (bench/gateway_trace.py: one 512-token hash id becomes 64 tokens, the
  engines' prefill per token x 8 so a prompt takes as long as the one it stands for);
* **chat**: 32 conversations x 10 turns with a 64-token shared system prompt, each turn's prompt
  the conversation so far, a turn only after the previous answer (bench/gateway_chat.py).

Each on `engines` engine stand-ins (default 8) whose caches are sized from the workload: all of
them together hold `cache_factor` (1.4) x the workload's distinct prompt blocks, so one holds
1.4 / 8 = 0.175 of them. Rows: the picker with its defaults, the picker with `--cost dynamo`,
Envoy's ROUND_ROBIN and LEAST_REQUEST, and the bound (the hit ratio of one endless cache fed every
prompt in order). Columns: prefix hit ratio, TTFT p50 / p99 and ITL p50 at the client, output
tokens/s, errors, and each engine's share of the requests (from its own metrics).

Beside every real row, the same workload, rate and routing in the simulator
(`dynamo_lite.simulate.standin`: the stand-ins' own scheduler and cache, the same scheduling
cycle, simulated time), so the two can be compared; docs/benchmarks.md says where they differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from dynamo_lite.base.timing import TimingModel
from dynamo_lite.routing.scheduling import dynamo_config
from dynamo_lite.simulate import standin
from dynamo_lite.simulate.trace import TraceRecord, load_trace
from dynamo_lite.stack import LEAST_REQUEST, PICKER_FULL, ROUND_ROBIN, Stack

from . import gateway_chat, gateway_trace
from .gateway_chat import ChatShape
from .gateway_load import Outcome, Planned, open_loop, percentile, summarise
from .gateway_stack import BLOCK_SIZE, EngineSettings, envoy_of, picker_cpu_seconds
from .runner import progress

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


@dataclass(frozen=True)
class Policy:
    name: str
    variant: str  # the Envoy configuration
    title: str
    picker_flags: tuple[str, ...] = ()


PICKER_DEFAULT = Policy("picker", PICKER_FULL, "picker, defaults")
PICKER_DYNAMO = Policy("picker_dynamo", PICKER_FULL, "picker, `--cost dynamo`", ("--cost", "dynamo"))
POLICIES = (PICKER_DEFAULT, PICKER_DYNAMO, Policy(ROUND_ROBIN, ROUND_ROBIN, "Envoy ROUND_ROBIN"),
            Policy(LEAST_REQUEST, LEAST_REQUEST, "Envoy LEAST_REQUEST"))
WORKLOADS = ("mooncake", "chat")


@dataclass(frozen=True)
class RoutingSettings:
    engines: int = 8
    cache_factor: float = 1.4  # all caches together hold this x the workload's distinct prompt blocks
    rates: tuple[float, ...] = (1.0, 2.0, 3.0)
    workloads: tuple[str, ...] = WORKLOADS
    policies: tuple[str, ...] = tuple(policy.name for policy in POLICIES)
    trace: str = str(DEFAULT_TRACE)
    mooncake_requests: int = 2000
    tokens_per_hash_id: int = 64  # one Mooncake 512-token block becomes 64 tokens (1/8)
    max_tokens_cap: int = 64
    # Trace time / this is the base rate: with the engines `speedup` x faster than the H100 model,
    # the fleet sees the trace 1.75x denser than real time (RR keeps its prefill ~a quarter busy).
    compression: float = 3.5
    speedup: float = 2.0
    chat: ChatShape = ChatShape(conversations=32, turns=10, system_tokens=64)
    simulate: bool = True
    idle_timeout: float = 10.0


# --- workloads ---------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One workload at one rate: what the load generator sends, and the same as simulator arrivals."""

    name: str
    rate: float
    description: str
    arrivals: list[standin.Arrival]
    send: Callable[[str], Any]  # the load generator's coroutine for an Envoy URL
    bound_plan: list[Planned]
    first_tokens: int  # tokens every prompt shares (the column "hits past them")


def prompt_of(body: bytes) -> list[int]:
    prompt: list[int] = orjson.loads(body)["prompt"]
    return prompt


def mooncake_workload(settings: RoutingSettings, records: Sequence[TraceRecord], rate: float) -> Workload:
    trace = gateway_trace.build(records, tokens_per_hash_id=settings.tokens_per_hash_id,
                                max_tokens_cap=settings.max_tokens_cap, compression=settings.compression * rate)
    arrivals = [standin.Arrival(item.at, prompt_of(item.body), orjson.loads(item.body)["max_tokens"])
                for item in trace.plan]
    span = trace.plan[-1].at if trace.plan else 0.0
    return Workload("mooncake", rate, f"the first {len(trace.plan):,} requests of the Mooncake conversation trace, "
                    f"{len(trace.plan) / max(span, 1e-9):.1f} req/s over {span:.0f} s", arrivals,
                    lambda url: open_loop(url, trace.plan), trace.plan, settings.tokens_per_hash_id)


def chat_workload(settings: RoutingSettings, rate: float) -> Workload:
    shape = replace(settings.chat, rate=settings.chat.rate * rate)
    plan = gateway_chat.build(shape)
    arrivals = [standin.Arrival(turn.planned.at, prompt_of(turn.planned.body), shape.reply_tokens,
                                after=turn.previous, session=f"conversation-{turn.conversation}")
                for turn in plan]
    system = shape.system_tokens // BLOCK_SIZE * BLOCK_SIZE
    return Workload("chat", rate, f"{shape.conversations} conversations x {shape.turns} turns, a {shape.system_tokens}-"
                    f"token system prompt, {shape.user_tokens}-token messages, {shape.reply_tokens}-token replies, "
                    f"{shape.rate:g} turns/s", arrivals, lambda url: gateway_chat.conversation_loop(url, plan),
                    [turn.planned for turn in plan], system)


def distinct_blocks(arrivals: Sequence[standin.Arrival]) -> int:
    """Distinct full prompt blocks of a workload (prefix chains: a block is its whole prefix)."""
    seen: set[int] = set()
    for arrival in arrivals:
        key = 0
        prompt = arrival.prompt
        for block in range(len(prompt) // BLOCK_SIZE):
            key = hash((key, tuple(prompt[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE])))
            seen.add(key)
    return len(seen)


def engine_blocks(settings: RoutingSettings, arrivals: Sequence[standin.Arrival]) -> int:
    """Each engine's cache: together `cache_factor` x the distinct blocks, and at least the
    longest prompt and answer."""
    longest = max(-(-(len(a.prompt) + a.max_tokens) // BLOCK_SIZE) for a in arrivals)
    return max(longest + 1, math.ceil(settings.cache_factor * distinct_blocks(arrivals) / settings.engines))


def engine_timing(settings: RoutingSettings) -> TimingModel:
    """The H100 model with prefill per token x 8 (a scaled token stands for 512 / 64 real ones),
    `speedup` times faster: what the engines run with (`engine_flags`)."""
    base = TimingModel()
    return TimingModel(base.prefill_secs_per_token * 512 / settings.tokens_per_hash_id, base.decode_step_secs,
                       base.decode_secs_per_running).scaled(settings.speedup)


def engine_flags(settings: RoutingSettings, num_blocks: int, max_model_len: int) -> EngineSettings:
    prefill = TimingModel().prefill_secs_per_token * 512 / settings.tokens_per_hash_id
    return EngineSettings(speedup=settings.speedup, num_blocks=num_blocks, extra=[
        "--prefill-secs-per-token", f"{prefill:g}", "--max-model-len", str(max_model_len)])


def oracle_hits(plan: Sequence[Planned], first_tokens: int) -> tuple[float, float]:
    """The hit ratio (and the part past the first `first_tokens`) of one engine with an endless
    cache that sees every request in order: the most any routing can reach."""
    prompts = [prompt_of(item.body) for item in sorted(plan, key=lambda item: item.at)]
    hits = standin.endless_cache_hits(prompts, BLOCK_SIZE)
    total = sum(len(prompt) for prompt in prompts)
    beyond = sum(max(0, hit - first_tokens) for hit in hits)
    return (sum(hits) / total, beyond / total) if total else (0.0, 0.0)


def ideal_ttft_ms(plan: Sequence[Planned], timing: TimingModel) -> tuple[float | None, float | None]:
    """TTFT p50 / p99 if every request found the bound's cached prefix and no queue: its own
    uncached prefill alone (the floor no routing goes below on this fleet)."""
    prompts = [prompt_of(item.body) for item in sorted(plan, key=lambda item: item.at)]
    hits = standin.endless_cache_hits(prompts, BLOCK_SIZE)
    times = [1000 * timing.prefill_seconds(len(prompt) - hit) for prompt, hit in zip(prompts, hits)]
    return percentile(times, 50), percentile(times, 99)


# --- one run per policy -------------------------------------------------------------------------------


def _row(summary_fields: dict[str, Any], outcomes: Sequence[Outcome], wall: float, shares: list[float],
         first_tokens: int) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    gaps = [1000 * gap for o in good for gap in o.token_gaps]
    beyond = sum(max(0, o.cached_tokens - first_tokens) for o in good)
    prompt = summary_fields["prompt_tokens"]
    return {**summary_fields, "hit_ratio": summary_fields["cached_tokens"] / prompt if prompt else 0.0,
            "conversation_hit_ratio": beyond / prompt if prompt else 0.0, "itl_p50_ms": percentile(gaps, 50),
            "itl_p99_ms": percentile(gaps, 99), "itl_p999_ms": percentile(gaps, 99.9),
            "itl_mean_ms": sum(gaps) / len(gaps) if gaps else None,
            "output_tokens_per_s": summary_fields["completion_tokens"] / wall if wall else 0.0, "wall_s": wall,
            "engine_shares": shares}


def engine_counts(stack: Stack) -> list[float]:
    """Requests each engine answered (its vllm:time_to_first_token_seconds count)."""
    counts = []
    for engine in stack.engines:
        text = httpx.get(f"http://{engine.address}/metrics", timeout=5.0).text
        counts.append(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                          if line.startswith("vllm:time_to_first_token_seconds_count")))
    return counts


def real_run(settings: RoutingSettings, workload: Workload, policy: Policy, engines: EngineSettings,
             run: Callable[[Any], Any], started_stack: Callable[..., Any],
             measure: Callable[[Stack], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One fresh stack, the workload through it; `measure` reads more from the stack at the end
    (into the row)."""
    with started_stack(engines=settings.engines, engine_settings=engines, variants=(policy.variant,),
                       picker_flags=policy.picker_flags) as stack:
        cpu_before = picker_cpu_seconds(stack) if stack.has_picker else 0.0
        outcomes, wall = run(workload.send(envoy_of(stack, policy.variant).url))
        picker_cpu = (picker_cpu_seconds(stack) - cpu_before) / len(outcomes) if stack.has_picker else None
        counts = engine_counts(stack)
        left, _ = stack.wait_idle(settings.idle_timeout) if stack.has_picker else (0, 0.0)
        measured = measure(stack) if measure is not None else {}
    total = sum(counts) or 1.0
    row = _row(asdict(summarise(outcomes)), outcomes, wall, [count / total for count in counts], workload.first_tokens)
    row.update(picker_cpu_ms_per_request=None if picker_cpu is None else 1000 * picker_cpu, booked_left=left,
               **measured)
    return row


def sim_run(settings: RoutingSettings, workload: Workload, policy: Policy, num_blocks: int) -> dict[str, Any]:
    shape = standin.FleetShape(settings.engines, num_blocks, BLOCK_SIZE, engine_timing(settings))
    router: standin.Router
    if policy.name == PICKER_DYNAMO.name:
        router = standin.SchedulerRouter(dynamo_config(), name=policy.name)
    elif policy.name == PICKER_DEFAULT.name:
        router = standin.SchedulerRouter(name=policy.name)
    elif policy.name == ROUND_ROBIN:
        router = standin.RoundRobinRouter()
    else:
        router = standin.LeastRequestRouter()
    summary = standin.summarise(standin.simulate(workload.arrivals, shape, router), settings.engines)
    return {"hit_ratio": summary.hit_ratio, "ttft_p50_ms": summary.ttft_p50_ms, "ttft_p99_ms": summary.ttft_p99_ms,
            "itl_p50_ms": summary.itl_p50_ms, "output_tokens_per_s": summary.output_tokens_per_s,
            "engine_shares": list(summary.engine_shares)}


def routing(settings: RoutingSettings, run: Callable[[Any], Any], started_stack: Callable[..., Any]) -> dict[str, Any]:
    """Every workload x rate x policy, real then simulated; the document `markdown` renders."""
    results: dict[str, Any] = {"settings": {**asdict(settings), "chat": asdict(settings.chat)}, "workloads": []}
    records: list[TraceRecord] = []
    if "mooncake" in settings.workloads:
        trace = Path(settings.trace)
        if not trace.exists():
            raise SystemExit(f"{trace}: no such trace (the Mooncake conversation trace; pass --trace PATH)")
        records = load_trace(trace, settings.mooncake_requests)
    for name in settings.workloads:
        for rate in settings.rates:
            workload = mooncake_workload(settings, records, rate) if name == "mooncake" else chat_workload(settings, rate)
            num_blocks = engine_blocks(settings, workload.arrivals)
            longest = max(len(a.prompt) + a.max_tokens for a in workload.arrivals)
            engines = engine_flags(settings, num_blocks, max_model_len=max(8192, longest + 1))
            distinct = distinct_blocks(workload.arrivals)
            bound, bound_beyond = oracle_hits(workload.bound_plan, workload.first_tokens)
            ideal_p50, ideal_p99 = ideal_ttft_ms(workload.bound_plan, engine_timing(settings))
            progress(f"routing: {name} at {rate:g}x: {workload.description}; {settings.engines} engines x "
                     f"{num_blocks:,} blocks ({settings.engines * num_blocks / distinct:.2f}x the {distinct:,} distinct "
                     f"prompt blocks); bound {bound:.2%}")
            part: dict[str, Any] = {
                "workload": name, "rate": rate, "description": workload.description, "requests": len(workload.arrivals),
                "num_blocks": num_blocks, "distinct_blocks": distinct, "engine_flags": engines.extra + [
                    "--speedup-ratio", str(engines.speedup), "--num-blocks", str(num_blocks)],
                "bound_hit_ratio": bound, "bound_conversation_hit_ratio": bound_beyond,
                "ideal_ttft_p50_ms": ideal_p50, "ideal_ttft_p99_ms": ideal_p99, "rows": [],
            }
            for policy in (p for p in POLICIES if p.name in settings.policies):
                row: dict[str, Any] = {"policy": policy.name, "title": policy.title}
                row["real"] = real_run(settings, workload, policy, engines, run, started_stack)
                if settings.simulate:
                    row["sim"] = sim_run(settings, workload, policy, num_blocks)
                part["rows"].append(row)
                real = row["real"]
                sim = row.get("sim") or {}
                progress(f"  {policy.name:<14} hit {real['hit_ratio']:6.2%} (sim {sim.get('hit_ratio', math.nan):6.2%})  "
                         f"TTFT p50 {_ms(real['ttft_p50_ms'])} (sim {_ms(sim.get('ttft_p50_ms'))}) p99 "
                         f"{_ms(real['ttft_p99_ms'])} (sim {_ms(sim.get('ttft_p99_ms'))})  ITL p50 "
                         f"{_ms(real['itl_p50_ms'])}  {real['output_tokens_per_s']:6.0f} tok/s  errors {real['errors']}"
                         + (f" {real['error_samples']}" if real["errors"] else ""))
            part["checks"] = checks(part)
            results["workloads"].append(part)
    return results


# --- the targets ------------------------------------------------------------------------------------


def checks(part: dict[str, Any]) -> dict[str, Any]:
    """Issue 36's targets for the defaults on one workload and rate (None where a row is missing)."""
    rows = {row["policy"]: row["real"] for row in part["rows"]}
    ours, rr, lr = rows.get(PICKER_DEFAULT.name), rows.get(ROUND_ROBIN), rows.get(LEAST_REQUEST)
    if ours is None:
        return {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    result: dict[str, Any] = {"hit_of_bound": ratio(ours["hit_ratio"], part["bound_hit_ratio"])}
    if rr is not None:
        result.update(ttft_p50_of_rr=ratio(ours["ttft_p50_ms"], rr["ttft_p50_ms"]),
                      ttft_p99_of_rr=ratio(ours["ttft_p99_ms"], rr["ttft_p99_ms"]),
                      hit_of_rr=ratio(ours["hit_ratio"], rr["hit_ratio"]),
                      tokens_per_s_of_rr=ratio(ours["output_tokens_per_s"], rr["output_tokens_per_s"]),
                      itl_p50_of_rr=ratio(ours["itl_p50_ms"], rr["itl_p50_ms"]),
                      ideal_ttft_p50_of_rr=ratio(part["ideal_ttft_p50_ms"], rr["ttft_p50_ms"]))
    if lr is not None:
        result["ttft_p50_of_lr"] = ratio(ours["ttft_p50_ms"], lr["ttft_p50_ms"])
    return result


TARGETS = (
    ("hit_of_bound", ">=", 0.85, "hit ratio >= 0.85 x bound"),
    ("ttft_p50_of_rr", "<=", 0.6, "TTFT p50 <= 0.6 x round robin"),
    ("ttft_p50_of_lr", "<=", 0.8, "TTFT p50 <= 0.8 x least request"),
    ("ttft_p99_of_rr", "<=", 0.9, "TTFT p99 <= 0.9 x round robin"),
    ("hit_of_rr", ">=", 1.0, "hit ratio >= round robin"),
    ("tokens_per_s_of_rr", ">=", 0.98, "output tokens/s >= round robin (2 % noise)"),
)


def markdown(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for part in results.get("workloads", []):
        lines += [
            f"**{part['workload']} at {part['rate']:g}x**: {part['description']}; {len(part['rows'][0]['real']['engine_shares']) if part['rows'] else 0} "
            f"engines of {part['num_blocks']:,} blocks (together {len(part['rows'][0]['real']['engine_shares']) * part['num_blocks'] / part['distinct_blocks'] if part['rows'] else 0:.2f}x the "
            f"{part['distinct_blocks']:,} distinct prompt blocks); engines `{' '.join(part['engine_flags'])}`.",
            "",
            "| policy | hit ratio (sim) | TTFT p50 ms (sim) | TTFT p99 ms (sim) | ITL p50 ms (sim) | output tok/s (sim) | "
            "errors | engine shares |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in part["rows"]:
            real, sim = row["real"], row.get("sim") or {}
            lines.append(
                f"| {row['title']} | {real['hit_ratio']:.1%} ({_pct(sim.get('hit_ratio'))}) | {_num(real['ttft_p50_ms'])} "
                f"({_num(sim.get('ttft_p50_ms'))}) | {_num(real['ttft_p99_ms'])} ({_num(sim.get('ttft_p99_ms'))}) | "
                f"{_num(real['itl_p50_ms'], 2)} ({_num(sim.get('itl_p50_ms'), 2)}) | {real['output_tokens_per_s']:.0f} "
                f"({_num(sim.get('output_tokens_per_s'), 0)}) | {real['errors']} | "
                f"{' '.join(f'{share:.2f}' for share in real['engine_shares'])} |")
        lines.append(f"| *bound (one endless cache)* | {part['bound_hit_ratio']:.1%} | {_num(part['ideal_ttft_p50_ms'])} "
                     f"| {_num(part['ideal_ttft_p99_ms'])} | | | | |")
        lines.append("")
    summary = target_table(results)
    if summary:
        lines += summary
    return lines


def target_table(results: dict[str, Any]) -> list[str]:
    parts = [part for part in results.get("workloads", []) if part.get("checks")]
    if not parts:
        return []
    header = "| target | " + " | ".join(f"{part['workload']} {part['rate']:g}x" for part in parts) + " |"
    lines = ["The defaults against the targets (met: ✓):", "", header, "|---|" + "---|" * len(parts)]
    for key, op, limit, title in TARGETS:
        cells = []
        for part in parts:
            value = part["checks"].get(key)
            if value is None:
                cells.append("–")
                continue
            met = value >= limit if op == ">=" else value <= limit
            cells.append(f"{value:.2f}{' ✓' if met else ' ✗'}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    floor = [part["checks"].get("ideal_ttft_p50_of_rr") for part in parts]
    lines.append("| *floor: TTFT p50 with the bound's hits and no queue ÷ round robin's* | "
                 + " | ".join("–" if value is None else f"{value:.2f}" for value in floor) + " |")
    lines.append("")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f} ms"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


__all__ = ["POLICIES", "RoutingSettings", "WORKLOADS", "checks", "markdown", "routing"]
