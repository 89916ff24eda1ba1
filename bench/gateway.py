"""The gateway benchmark: Envoy + the endpoint picker, end to end, every part a real process.

    python -m bench.gateway                    # the full run (about 6 minutes), into bench/out/gateway
    python -m bench.gateway --quick            # a smoke run of every path (about 2-3 minutes), into a temp dir
    python -m bench.gateway --requests 100 --out /tmp/gw
    python -m bench.gateway --parts chat       # one part (trace, chat, cost, profile), into a temp dir

Two questions, one run:

1. **Routing quality**, on two workloads, each streamed `/v1/completions` through Envoy to 4
   engine stand-ins, routed by the picker (its defaults, and leaning on the cache; on the chat
   also leaning with its costs sampled), and by Envoy's own ROUND_ROBIN and LEAST_REQUEST
   (deploy/envoy/envoy-fallbacks.yaml without the ext_proc filter). Fresh processes (empty caches) for each policy. Per policy: the prefix hit
   ratio (cached ÷ prompt tokens, from each answer's usage), TTFT p50/p99 at the client,
   requests/s and errors; and the hit ratio a perfect router could reach on the same prompts.
   - The Mooncake conversation sample (shared/simulate/data/), at the trace's arrival times: real
     arrivals, but little reuse (a perfect router reaches 1.39x round robin's hit ratio).
   - Multi-turn chat (bench/gateway_chat.py): conversations whose every turn sends the whole
     conversation so far, a turn only after the previous answer, with caches too small for one
     engine to hold every conversation: where keeping a conversation on one engine pays.
2. **The picker's own cost.** (a) the latency it adds: one small streamed request at a fixed
   open-loop rate through Envoy with the picker and through Envoy ROUND_ROBIN without ext_proc;
   (b) its CPU seconds per request (/proc/<pid>/stat); (c) the requests/s one picker process
   sustains with 128-token streamed answers and fast engines, in these Envoy configurations:
   (i) full duplex both ways (as shipped), (ii) response headers only, (iii) the response body
   in a second, observability-mode ext_proc filter (with the tests' 0.5 s deferred close, and
   with Envoy's default 5 s); with the bookkeeping each leaves on the slot tracker, under that
   load and below capacity, and a cProfile of the picker summed by what the code does.

The picker runs alone on CPU 0; Envoy, the engines, the slot tracker, the indexer and this load
generator share CPU 1 (bench/servers.py's SERVER_CPU / CLIENT_CPU). A benchmark prints numbers:
nothing here fails a test run, and no target is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import uvloop

from . import gateway_chat, gateway_profile, gateway_trace
from .gateway_chat import ChatShape
from .gateway_load import Outcome, Planned, Summary, closed_loop, open_loop, summarise
from .gateway_stack import (
    BLOCK_SIZE,
    LEAST_REQUEST,
    MODEL,
    PICKER_FULL,
    PICKER_HEADERS_ONLY,
    PICKER_OBSERVER,
    PICKER_OBSERVER_5S,
    ROUND_ROBIN,
    EngineSettings,
    Envoy,
    GatewayStack,
    envoy_binary,
    process_cpu_seconds,
)
from .runner import progress
from .servers import CLIENT_CPU, SERVER_CPU

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "out" / "gateway"
ENGINES = 4
# The picker's ext_proc configurations compared in part 2 (c), in the table's order.
PICKER_CONFIGS = {
    PICKER_FULL: "(i) full duplex both ways (as shipped)",
    PICKER_HEADERS_ONLY: "(ii) response headers only (body NONE, trailers SKIP)",
    PICKER_OBSERVER: "(iii) request side + observability-mode filter for the response (deferred close 0.5 s)",
    PICKER_OBSERVER_5S: "(iii) the same, Envoy's default deferred close (5 s)",
}


@dataclass(frozen=True)
class Policy:
    name: str
    variant: str  # the Envoy configuration
    title: str
    picker_flags: tuple[str, ...] = ()


# Part 1's policies. The picker as it starts by default (Dynamo's KV router cost, overlap weight
# 1), and leaning on the cache (weight 4): the gap between the first and the ideal hit ratio is
# the cost trading cache hits for balance, which the second shows.
PICKER_DEFAULT = Policy("picker", PICKER_FULL, "picker (KV + load, defaults)")
PICKER_CACHE_LEANING = Policy("picker_overlap_4", PICKER_FULL, "picker, `--overlap-score-weight 4`",
                              ("--overlap-score-weight", "4"))
# Leaning on the cache herds requests that share a hot prefix (the chat's system prompt) onto
# the engine that cached it first, past what its cache holds; sampling the costs (Dynamo's
# router temperature) spreads them. One value tried (0.2), not tuned; the chat workload only.
PICKER_CACHE_SAMPLED = Policy("picker_overlap_4_t02", PICKER_FULL,
                              "picker, `--overlap-score-weight 4 --router-temperature 0.2`",
                              ("--overlap-score-weight", "4", "--router-temperature", "0.2"))
POLICIES = (PICKER_DEFAULT, PICKER_CACHE_LEANING, PICKER_CACHE_SAMPLED,
            Policy(ROUND_ROBIN, ROUND_ROBIN, "Envoy ROUND_ROBIN"),
            Policy(LEAST_REQUEST, LEAST_REQUEST, "Envoy LEAST_REQUEST"))
# The Mooncake workload's policies (as in its first run).
TRACE_POLICIES = (PICKER_DEFAULT.name, PICKER_CACHE_LEANING.name, ROUND_ROBIN, LEAST_REQUEST)


@dataclass(frozen=True)
class Settings:
    # Part 1: the trace.
    requests: int = 300  # the whole bundled sample
    tokens_per_hash_id: int = 64  # one Mooncake 512-token block becomes 64 tokens (1/8)
    max_tokens_cap: int = 64
    # Trace time ÷ this: the sample's 105 s in 30 s, about 10 requests/s.
    compression: float = 3.5
    # The engines' prefill per token is the H100 model's x 8 (512 / tokens_per_hash_id): a scaled
    # prompt then takes as long to prefill as the Mooncake prompt it stands for, and cache hits
    # save what they would save. Then everything runs this many times faster than modelled: at
    # ~10 requests/s round robin keeps the engines' prefill about half busy.
    trace_speedup: float = 2.0
    # 8192 blocks of 16 tokens per engine: the four caches together hold a little less than the
    # sample's prompts, so what stays cached, and where, depends on the routing.
    trace_num_blocks: int = 8192
    policies: tuple[str, ...] = TRACE_POLICIES
    # Part 1, second workload: multi-turn chat, the engines timed as for the trace. 512 blocks per
    # engine: one engine holds about a third of the 1,476 blocks the 24 conversations end with
    # (their last prompts and answers, bench/gateway_chat.py's footprint). In an LRU model of the
    # caches (no timing), keeping each conversation on one engine fits (76.6% hits, the ideal's
    # 77.2%, even with 8 conversations on one engine), and round robin, which scatters every
    # conversation over every engine, evicts (43.9% hits; 49.5% with endless caches). With 768
    # blocks round robin hardly evicted (48.8% measured).
    chat: ChatShape = ChatShape()
    chat_num_blocks: int = 512
    chat_policies: tuple[str, ...] = tuple(policy.name for policy in POLICIES)  # all five
    # Part 2: the picker's cost, engines made nearly free.
    fast_speedup: float = 1000.0
    latency_rate: float = 100.0  # requests/s, open loop
    latency_seconds: float = 5.0  # per round and path
    latency_rounds: int = 2  # picker and round robin alternate: drift spreads over both
    small_prompt_tokens: int = 32
    small_max_tokens: int = 8
    throughput_concurrency: int = 64
    throughput_seconds: float = 8.0
    throughput_warmup: float = 1.0
    answer_tokens: int = 128
    bookkeeping_rate: float = 30.0  # below every configuration's capacity: exactness, not overload
    bookkeeping_seconds: float = 3.0
    profile_seconds: float = 5.0
    idle_timeout: float = 10.0  # how long to wait for the slot tracker to reach zero
    quick: bool = False

    @classmethod
    def quick_run(cls) -> Settings:
        """Every path once, shortly: 100 trace requests (no conversation reuse yet: the sample's
        first later turn is request 134), 12 chats of 3 turns, one picker setting, 2-3 s windows."""
        return cls(requests=100, policies=(PICKER_DEFAULT.name, ROUND_ROBIN, LEAST_REQUEST),
                   chat=ChatShape(conversations=12, turns=3, min_gap=6), chat_num_blocks=384,
                   chat_policies=(PICKER_DEFAULT.name, ROUND_ROBIN), latency_seconds=2.0,
                   latency_rounds=1, throughput_seconds=3.0, bookkeeping_seconds=2.0, profile_seconds=3.0, quick=True)


# --- part 1: routing quality ---------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyResult:
    policy: Policy
    summary: Summary
    requests_per_s: float
    wall_s: float
    conversation_hit_ratio: float  # cached tokens past each prompt's first hash id ÷ prompt tokens
    picker_cpu_s_per_request: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.name, "title": self.policy.title,
                "picker_flags": list(self.policy.picker_flags), **asdict(self.summary),
                "hit_ratio": self.summary.hit_ratio, "conversation_hit_ratio": self.conversation_hit_ratio,
                "requests_per_s": self.requests_per_s, "wall_s": self.wall_s,
                "picker_cpu_s_per_request": self.picker_cpu_s_per_request}


def oracle_hits(plan: Sequence[Planned], first_tokens: int) -> tuple[float, float]:
    """The hit ratio (and the part past the first `first_tokens`) of one engine with an endless
    cache that sees every request in order: the most any routing can reach. Counted as the engine
    counts: full blocks only, and the last prompt token is always computed."""
    seen: set[int] = set()
    cached = beyond = total = 0
    for item in plan:
        prompt: list[int] = orjson.loads(item.body)["prompt"]
        total += len(prompt)
        key = 0
        hit_blocks = 0
        reusable = (len(prompt) - 1) // BLOCK_SIZE
        still_hitting = True
        for block in range(len(prompt) // BLOCK_SIZE):
            key = hash((key, tuple(prompt[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE])))
            if still_hitting and key in seen and block < reusable:
                hit_blocks += 1
            else:
                still_hitting = False
            seen.add(key)
        cached += hit_blocks * BLOCK_SIZE
        beyond += max(0, hit_blocks * BLOCK_SIZE - first_tokens)
    return (cached / total, beyond / total) if total else (0.0, 0.0)


def _trace_engines(settings: Settings, num_blocks: int, max_model_len: int) -> EngineSettings:
    """The engines of part 1: prefill per token the H100 model's x 8 (a scaled token stands for
    512 / tokens_per_hash_id real ones), everything `trace_speedup` times faster."""
    prefill = 32e-6 * 512 / settings.tokens_per_hash_id  # the H100 model's 32 µs per token, x 8
    return EngineSettings(speedup=settings.trace_speedup, num_blocks=num_blocks, extra=[
        "--prefill-secs-per-token", f"{prefill:g}", "--max-model-len", str(max_model_len)])


def _compare_policies(policies: Sequence[str], engines: EngineSettings, send: Callable[[str], Any],
                      first_tokens: int) -> list[PolicyResult]:
    """Each policy on fresh processes (empty caches): `send(url)` is the load, run on uvloop."""
    results: list[PolicyResult] = []
    for policy in (policy for policy in POLICIES if policy.name in policies):
        with started_stack(engine_settings=engines, variants=(policy.variant,),
                           picker_flags=policy.picker_flags) as stack:
            cpu_before = stack.picker_cpu_seconds() if stack.picker_pid else 0.0
            outcomes, wall = run(send(stack.envoys[policy.variant].url))
            picker_cpu = (stack.picker_cpu_seconds() - cpu_before) / len(outcomes) if stack.picker_pid else None
            summary = summarise(outcomes)
            beyond = sum(max(0, o.cached_tokens - first_tokens) for o in outcomes if o.ok)
            result = PolicyResult(policy, summary, len(outcomes) / wall, wall,
                                  beyond / summary.prompt_tokens if summary.prompt_tokens else 0.0, picker_cpu)
            results.append(result)
            progress(f"  {policy.name:<20} hit ratio {summary.hit_ratio:6.2%}  TTFT p50 "
                     f"{_ms(summary.ttft_p50_ms)} p99 {_ms(summary.ttft_p99_ms)}  {result.requests_per_s:5.1f} req/s  "
                     f"late max {summary.late_max_ms:.0f} ms  errors {summary.errors}"
                     + (f" {summary.error_samples}" if summary.errors else ""))
    return results


def _engine_flags(engines: EngineSettings) -> list[str]:
    return engines.extra + ["--speedup-ratio", str(engines.speedup), "--num-blocks", str(engines.num_blocks),
                            "--block-size", str(BLOCK_SIZE)]


def routing_quality(settings: Settings) -> dict[str, Any]:
    records = gateway_trace.load_sample(settings.requests)
    trace = gateway_trace.build(records, tokens_per_hash_id=settings.tokens_per_hash_id,
                                max_tokens_cap=settings.max_tokens_cap, compression=settings.compression)
    # The sample's longest prompt, scaled, is ~15k tokens.
    engines = _trace_engines(settings, settings.trace_num_blocks, max_model_len=16384)
    duration = trace.plan[-1].at if trace.plan else 0.0
    progress(f"routing quality: {len(trace.plan)} Mooncake requests, {trace.prompt_tokens:,} prompt tokens, "
             f"over {duration:.0f} s ({len(trace.plan) / max(duration, 1e-9):.1f} req/s), per policy")
    results = _compare_policies(settings.policies, engines, lambda url: open_loop(url, trace.plan),
                                settings.tokens_per_hash_id)
    ideal, ideal_beyond = oracle_hits(trace.plan, settings.tokens_per_hash_id)
    return {
        "requests": len(trace.plan), "prompt_tokens": trace.prompt_tokens, "max_tokens": trace.max_tokens,
        "offered_requests_per_s": len(trace.plan) / max(duration, 1e-9), "trace_span_s": trace.span_s,
        "engine_flags": _engine_flags(engines),
        "oracle_hit_ratio": ideal, "oracle_conversation_hit_ratio": ideal_beyond,
        "policies": [result.as_dict() for result in results],
    }


def chat_quality(settings: Settings) -> dict[str, Any]:
    """Part 1, second workload: multi-turn chat (bench/gateway_chat.py), each turn's prompt the
    conversation so far; caches too small for one engine to hold every conversation."""
    shape = settings.chat
    plan = gateway_chat.build(shape)
    planned = [turn.planned for turn in plan]
    prompt_tokens = sum(len(orjson.loads(item.body)["prompt"]) for item in planned)
    engines = _trace_engines(settings, settings.chat_num_blocks, max_model_len=8192)
    system_blocks_tokens = shape.system_tokens // BLOCK_SIZE * BLOCK_SIZE  # what every engine soon caches
    footprint = gateway_chat.footprint_blocks(shape, BLOCK_SIZE)
    progress(f"multi-turn chat: {shape.conversations} conversations x {shape.turns} turns, {prompt_tokens:,} prompt "
             f"tokens, {shape.rate:g} turns/s; {ENGINES} engines of {settings.chat_num_blocks} blocks, the "
             f"conversations' last prompts fill {footprint} blocks; per policy")
    results = _compare_policies(settings.chat_policies, engines,
                                lambda url: gateway_chat.conversation_loop(url, plan), system_blocks_tokens)
    ideal, ideal_beyond = oracle_hits(planned, system_blocks_tokens)
    return {
        **asdict(shape), "requests": len(plan), "prompt_tokens": prompt_tokens,
        "offered_requests_per_s": shape.rate, "footprint_blocks": footprint,
        "system_prompt_cached_tokens": system_blocks_tokens, "engine_flags": _engine_flags(engines),
        "oracle_hit_ratio": ideal, "oracle_conversation_hit_ratio": ideal_beyond,
        "policies": [result.as_dict() for result in results],
    }


# --- part 2: the picker's cost ------------------------------------------------------------------


def _completion(prompt: list[int], max_tokens: int) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}})


def added_latency(settings: Settings, stack: GatewayStack) -> dict[str, Any]:
    """(a) + (b): the same small streamed request, open loop, through both paths in turn."""
    body = _completion(list(range(100, 100 + settings.small_prompt_tokens)), settings.small_max_tokens)
    count = max(1, round(settings.latency_rate * settings.latency_seconds))
    plan = [Planned(i / settings.latency_rate, "/v1/completions", body) for i in range(count)]
    progress(f"added latency: {count} small streamed requests per round at {settings.latency_rate:.0f} req/s, "
             f"{settings.latency_rounds} round(s), picker and round robin alternating")
    outcomes: dict[str, list[Outcome]] = {PICKER_FULL: [], ROUND_ROBIN: []}
    picker_cpu = 0.0
    picks_before = stack.picker_metrics()
    for _ in range(settings.latency_rounds):
        for variant in outcomes:
            before = stack.picker_cpu_seconds()
            done, _ = run(open_loop(stack.envoys[variant].url, plan))
            if variant == PICKER_FULL:
                picker_cpu += stack.picker_cpu_seconds() - before
            outcomes[variant] += done
    picks_after = stack.picker_metrics()
    stack.wait_idle(settings.idle_timeout)
    picker, plain = summarise(outcomes[PICKER_FULL]), summarise(outcomes[ROUND_ROBIN])
    pick_count = _delta(picks_before, picks_after, "dynamo_lite_epp_pick_seconds_count")
    pick_sum = _delta(picks_before, picks_after, "dynamo_lite_epp_pick_seconds_sum")
    added_p50 = _difference(picker.latency_p50_ms, plain.latency_p50_ms)
    added_p99 = _difference(picker.latency_p99_ms, plain.latency_p99_ms)
    cpu_ms = 1000 * picker_cpu / max(1, len(outcomes[PICKER_FULL]))
    result = {
        "rate": settings.latency_rate, "requests_per_path": len(outcomes[PICKER_FULL]),
        "prompt_tokens": settings.small_prompt_tokens, "max_tokens": settings.small_max_tokens,
        "picker": asdict(picker), "round_robin": asdict(plain),
        "added_p50_ms": added_p50, "added_p99_ms": added_p99, "picker_cpu_ms_per_request": cpu_ms,
        "pick_mean_ms": 1000 * pick_sum / pick_count if pick_count else None,
    }
    progress(f"  picker p50 {_ms(picker.latency_p50_ms)} p99 {_ms(picker.latency_p99_ms)}; round robin p50 "
             f"{_ms(plain.latency_p50_ms)} p99 {_ms(plain.latency_p99_ms)}; added p50 {_ms(added_p50)} "
             f"p99 {_ms(added_p99)}; picker CPU {cpu_ms:.2f} ms/request; "
             f"errors {picker.errors} + {plain.errors}")
    return result


def throughput(settings: Settings, stack: GatewayStack, variant: str) -> dict[str, Any]:
    """(c): closed loop of 128-token streamed answers; what the picker sustains and what it costs,
    and what the bookkeeping looks like at the end of the window and after it."""
    envoy = stack.envoys[variant]
    picked = variant in PICKER_CONFIGS  # round robin: the picker sits idle, its figures mean nothing
    body = _completion(list(range(200, 200 + settings.small_prompt_tokens)), settings.answer_tokens)
    marks: dict[str, Any] = {}

    # The callbacks run on the load generator's loop: the HTTP reads (counters) first when the
    # window opens and last when it closes, the CPU clocks right at its edges.
    def opened() -> None:
        marks.update(envoy_stats=_ext_proc_stats(envoy), calls=_service_calls(stack))
        marks.update(picker=_picker_cpu(stack), envoy=process_cpu_seconds(_pid(envoy)), clock=time.monotonic())

    def closed() -> None:
        marks.update(picker_end=_picker_cpu(stack), envoy_end=process_cpu_seconds(_pid(envoy)),
                     clock_end=time.monotonic())
        marks.update(envoy_stats_end=_ext_proc_stats(envoy), calls_end=_service_calls(stack),
                     active=stack.active_requests() if picked else None)

    metrics_before = stack.picker_metrics()
    outcomes, seconds = run(closed_loop(envoy.url, settings.throughput_concurrency, settings.throughput_seconds,
                                        lambda _: ("/v1/completions", body), on_start=opened, on_end=closed,
                                        warmup=settings.throughput_warmup))
    left, waited = stack.wait_idle(settings.idle_timeout)
    metrics_after = stack.picker_metrics()
    summary = summarise(outcomes)
    requests = max(1, len(outcomes))
    picker_cpu = marks["picker_end"] - marks["picker"]
    clock = marks["clock_end"] - marks["clock"]  # the CPU clocks' own window
    sent = marks["envoy_stats_end"].get("stream_msgs_sent", 0) - marks["envoy_stats"].get("stream_msgs_sent", 0)
    received = (marks["envoy_stats_end"].get("stream_msgs_received", 0)
                - marks["envoy_stats"].get("stream_msgs_received", 0))
    result = {
        "variant": variant, "requests": len(outcomes), "seconds": seconds,
        "requests_per_s": len(outcomes) / seconds, "errors": summary.errors, "error_samples": summary.error_samples,
        "latency_p50_ms": summary.latency_p50_ms, "completion_tokens_per_request": summary.completion_tokens / requests,
        "picker_cpu_ms_per_request": 1000 * picker_cpu / requests if picked else None,
        "picker_cpu_utilisation": picker_cpu / clock if picked else None,
        "requests_per_s_per_picker_core": requests / picker_cpu if picked and picker_cpu > 0 else None,
        "envoy_cpu_utilisation": (marks["envoy_end"] - marks["envoy"]) / clock,
        "ext_proc_messages_to_picker_per_request": sent / requests,
        "ext_proc_messages_from_picker_per_request": received / requests,
        "service_calls_per_request": (marks["calls_end"] - marks["calls"]) / requests if picked else None,
        "slot_tracker_active_at_window_end": marks["active"],
        "in_flight_at_window_end": settings.throughput_concurrency,
        "slot_tracker_active_after": left, "seconds_to_zero_active": waited,
        "ends": _ends(metrics_before, metrics_after),
    }
    progress(f"  {variant:<20} {result['requests_per_s']:6.0f} req/s  picker CPU "
             f"{_num(result['picker_cpu_ms_per_request'], '.2f', ' ms')}/request, utilisation "
             f"{_num(result['picker_cpu_utilisation'], '.0%')}  slot tracker active at the end "
             f"{_num(marks['active'], 'd')} (in flight {settings.throughput_concurrency}); zero after {waited:.1f} s; "
             f"ends {result['ends']}; errors {summary.errors}")
    return result


def bookkeeping(settings: Settings, stack: GatewayStack, variant: str) -> dict[str, Any]:
    """Below capacity: does every booking end with its answer ("complete"), and at once?"""
    body = _completion(list(range(300, 300 + settings.small_prompt_tokens)), settings.answer_tokens)
    count = max(1, round(settings.bookkeeping_rate * settings.bookkeeping_seconds))
    plan = [Planned(i / settings.bookkeeping_rate, "/v1/completions", body) for i in range(count)]
    before = stack.picker_metrics()
    outcomes, _ = run(open_loop(stack.envoys[variant].url, plan))
    # Every answer has ended: with exact bookkeeping the slot tracker is at zero a moment later.
    active_at_last_answer = stack.active_requests()
    left, waited = stack.wait_idle(settings.idle_timeout)
    ends = _ends(before, stack.picker_metrics())
    result = {"variant": variant, "rate": settings.bookkeeping_rate, "requests": count,
              "errors": summarise(outcomes).errors, "active_at_last_answer": active_at_last_answer,
              "slot_tracker_active_after": left, "seconds_to_zero_active": waited, "ends": ends}
    progress(f"  {variant:<20} {count} requests at {settings.bookkeeping_rate:.0f} req/s: active when the last "
             f"answer ended {active_at_last_answer}, zero after {waited:.1f} s, ends {ends}")
    return result


def picker_cost(settings: Settings) -> dict[str, Any]:
    engines = EngineSettings(speedup=settings.fast_speedup, extra=["--decode-step-secs", "0.00001"])
    variants = (*PICKER_CONFIGS, ROUND_ROBIN)
    with started_stack(engine_settings=engines, variants=variants) as stack:
        latency = added_latency(settings, stack)
        progress(f"picker throughput: closed loop, {settings.throughput_concurrency} concurrent "
                 f"{settings.answer_tokens}-token streamed answers, {settings.throughput_seconds:.0f} s per "
                 f"configuration (round robin without the picker first: the rest of the stack's own ceiling)")
        rows = [throughput(settings, stack, variant) for variant in (ROUND_ROBIN, *PICKER_CONFIGS)]
        progress(f"bookkeeping below capacity: {settings.bookkeeping_rate:.0f} req/s open loop, "
                 f"{settings.answer_tokens}-token answers")
        books = [bookkeeping(settings, stack, variant) for variant in PICKER_CONFIGS]
    return {"engine_flags": engines.extra + ["--speedup-ratio", str(engines.speedup)], "latency": latency,
            "throughput": rows, "bookkeeping": books}


class _ProfiledStack(GatewayStack):
    """The stack with the picker run under cProfile (written when the picker exits)."""

    def __init__(self, profile_path: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.profile_path = profile_path

    def _picker_argv(self, pool: Path) -> list[str]:
        argv = super()._picker_argv(pool)
        at = argv.index("dynamo_lite.epp")
        return [*argv[:at], "cProfile", "-o", str(self.profile_path), "-m", *argv[at:]]


def picker_profile(settings: Settings, workdir: Path) -> dict[str, Any]:
    """Where the picker's time goes under the full-duplex closed loop of part 2 (c)."""
    engines = EngineSettings(speedup=settings.fast_speedup, extra=["--decode-step-secs", "0.00001"])
    path = workdir / "picker.prof"
    body = _completion(list(range(400, 400 + settings.small_prompt_tokens)), settings.answer_tokens)
    progress(f"profile: the picker under cProfile, full duplex, closed loop for {settings.profile_seconds:.0f} s")
    with started_stack(engine_settings=engines, variants=(PICKER_FULL,), profile_path=path) as stack:
        outcomes, seconds = run(closed_loop(stack.envoys[PICKER_FULL].url, settings.throughput_concurrency,
                                            settings.profile_seconds, lambda _: ("/v1/completions", body),
                                            warmup=settings.throughput_warmup))
        stack.wait_idle(settings.idle_timeout)
    # The stack has stopped the picker (SIGINT, a clean exit): cProfile has written its file.
    if not path.exists():
        return {"error": "the profiled picker wrote no profile"}
    summary = gateway_profile.summarise(path)
    summary["requests_per_s_under_profiler"] = len(outcomes) / seconds
    for name, share in summary["shares"].items():
        progress(f"  {share:6.1%}  {name}")
    return summary


# --- running -------------------------------------------------------------------------------------


def run(coroutine: Any) -> Any:
    """One load-generator coroutine on uvloop (the client's own overhead kept low)."""
    return uvloop.run(coroutine)


@contextlib.contextmanager
def started_stack(*, engine_settings: EngineSettings, variants: tuple[str, ...], picker_flags: tuple[str, ...] = (),
                  profile_path: Path | None = None, attempts: int = 3) -> Iterator[GatewayStack]:
    """A stack up and ready; a start-up that fails (a port taken between its choice and its bind
    by another process on this shared machine) is tried again with other ports."""
    for attempt in range(1, attempts + 1):
        kwargs: dict[str, Any] = {"engines": ENGINES, "engine_settings": engine_settings, "variants": variants,
                                  "picker_flags": picker_flags}
        stack = _ProfiledStack(profile_path, **kwargs) if profile_path is not None else GatewayStack(**kwargs)
        try:
            stack.__enter__()
        except RuntimeError as exc:
            if attempt == attempts:
                raise
            progress(f"stack start-up failed ({str(exc).splitlines()[0][:160]}); trying again")
            continue
        try:
            yield stack
        finally:
            stack.__exit__(None, None, None)
        return


def _pid(envoy: Envoy) -> int:
    assert envoy.process is not None
    return envoy.process.pid  # taskset execs envoy: the same pid


def _picker_cpu(stack: GatewayStack) -> float:
    return stack.picker_cpu_seconds() if stack.picker_pid else 0.0


def _ext_proc_stats(envoy: Envoy) -> dict[str, int]:
    prefix = "http.inference.ext_proc."
    return {name[len(prefix):]: value for name, value in envoy.stats(prefix).items()}


def _service_calls(stack: GatewayStack) -> float:
    """Requests the slot tracker and the indexer have served (the picker is their only client
    during a run, apart from the indexer's KV events, which come over ZMQ)."""
    if not stack.picker_pid:
        return 0.0
    import httpx

    total = 0.0
    for base in (stack.slot_tracker, stack.indexer):
        for line in httpx.get(base + "/metrics", timeout=5.0).text.splitlines():
            if line.startswith("dynamo_lite_http_requests_total{") and 'route="/metrics"' not in line:
                total += float(line.rpartition(" ")[2])
    return total


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _ends(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The picker's request ends by reason, between two reads of its metrics."""
    prefix = 'dynamo_lite_epp_request_ends_total{reason="'
    ends = {key[len(prefix):-2]: int(_delta(before, after, key)) for key in after if key.startswith(prefix)}
    return {reason: count for reason, count in ends.items() if count}


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _num(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        version = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=20).stdout
        envoy = version.strip().split("version: ", 1)[-1].split("/")[1]
    except (OSError, IndexError, RuntimeError, subprocess.TimeoutExpired):
        envoy = "unknown"
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "envoy": envoy, "load_average_at_start": os.getloadavg()}


# --- the report ----------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    """The tables of one run (what bench/RESULTS.md's gateway section shows)."""
    lines: list[str] = []
    routing = results.get("routing")
    if routing:
        lines += [
            f"Routing quality: {routing['requests']} requests of the Mooncake conversation sample, "
            f"{routing['offered_requests_per_s']:.1f} req/s offered, 4 engines "
            f"(`{' '.join(routing['engine_flags'])}`).",
            "",
        ]
        lines += _policy_table(routing, "hits past the first hash id")
    chat = results.get("chat")
    if chat:
        lines += [""] if lines else []
        lines += [
            f"Multi-turn chat: {chat['conversations']} conversations x {chat['turns']} turns "
            f"({chat['requests']} requests, {chat['prompt_tokens']:,} prompt tokens), each prompt the conversation "
            f"so far: a {chat['system_tokens']}-token system prompt, {chat['user_tokens']}-token user messages, "
            f"{chat['reply_tokens']}-token replies; {chat['rate']:g} turns/s, a turn only after its previous "
            f"answer; 4 engines (`{' '.join(chat['engine_flags'])}`), the conversations' last prompts and "
            f"answers fill {chat['footprint_blocks']} blocks.",
            "",
        ]
        lines += _policy_table(chat, "hits past the system prompt", late=True)
    cost = results.get("picker_cost")
    if cost:
        latency = cost["latency"]
        lines += [
            "",
            f"Added latency: the same streamed request ({latency['prompt_tokens']} prompt tokens, "
            f"{latency['max_tokens']} answer tokens) at {latency['rate']:.0f} req/s open loop, "
            f"{latency['requests_per_path']} requests per path, fast engines (`{' '.join(cost['engine_flags'])}`).",
            "",
            "| path | full request p50 | p99 | errors | picker CPU per request | pick (body end → pick) mean |",
            "|---|---|---|---|---|---|",
            f"| Envoy + picker (full duplex) | {_ms(latency['picker']['latency_p50_ms'])} | "
            f"{_ms(latency['picker']['latency_p99_ms'])} | {latency['picker']['errors']} | "
            f"{latency['picker_cpu_ms_per_request']:.2f} ms | {_ms(latency['pick_mean_ms'])} |",
            f"| Envoy ROUND_ROBIN, no ext_proc | {_ms(latency['round_robin']['latency_p50_ms'])} | "
            f"{_ms(latency['round_robin']['latency_p99_ms'])} | {latency['round_robin']['errors']} | | |",
            f"| **added by the picker** | **{_ms(latency['added_p50_ms'])}** | **{_ms(latency['added_p99_ms'])}** | "
            "| | |",
            "",
            f"Picker throughput: closed loop, {results['settings']['throughput_concurrency']} concurrent "
            f"{results['settings']['answer_tokens']}-token streamed answers; picker alone on CPU {SERVER_CPU}, "
            f"everything else on CPU {CLIENT_CPU}.",
            "",
            "| Envoy configuration | req/s | picker CPU per request | picker CPU use | req/s per picker core "
            "(1 ÷ CPU per request) | ext_proc messages to / from the picker per request | slot tracker + indexer "
            "calls per request | slot tracker active at the window's end (in flight) | ends by reason | errors |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in cost["throughput"]:
            title = PICKER_CONFIGS.get(row["variant"], "Envoy ROUND_ROBIN, no picker (the rest of the stack)")
            lines.append(
                f"| {title} | {row['requests_per_s']:.0f} | {_num(row['picker_cpu_ms_per_request'], '.2f', ' ms')} | "
                f"{_num(row['picker_cpu_utilisation'], '.0%')} | {_num(row['requests_per_s_per_picker_core'], '.0f')} | "
                f"{row['ext_proc_messages_to_picker_per_request']:.1f} / "
                f"{row['ext_proc_messages_from_picker_per_request']:.1f} | {_num(row['service_calls_per_request'], '.1f')} | "
                f"{_num(row['slot_tracker_active_at_window_end'], 'd')} ({row['in_flight_at_window_end']}) | "
                f"{_format_ends(row['ends'])} | {row['errors']} |")
        lines += [
            "",
            f"Bookkeeping below capacity ({results['settings']['bookkeeping_rate']:.0f} req/s open loop, "
            f"{results['settings']['answer_tokens']}-token answers):",
            "",
            "| Envoy configuration | slot tracker active when the last answer ended | seconds until zero | "
            "ends by reason |",
            "|---|---|---|---|",
        ]
        for row in cost["bookkeeping"]:
            lines.append(f"| {PICKER_CONFIGS[row['variant']]} | {row['active_at_last_answer']} | "
                         f"{row['seconds_to_zero_active']:.1f} | {_format_ends(row['ends'])} |")
    profile = results.get("profile")
    if profile and "shares" in profile:
        lines += ["", f"Where the picker's time goes (cProfile, full duplex, closed loop; "
                      f"{profile['requests_per_s_under_profiler']:.0f} req/s under the profiler; the picker's "
                      "waiting left out):", "",
                  "| share of the picker's Python time | what |", "|---|---|"]
        lines += [f"| {share:.0%} | {name} |" for name, share in profile["shares"].items()]
    return "\n".join(lines) + "\n"


def _policy_table(part: dict[str, Any], beyond: str, late: bool = False) -> list[str]:
    """Part 1's table for one workload, and the picker against round robin."""
    lines = [
        f"| policy | prefix hit ratio | {beyond} | TTFT p50 | TTFT p99 | req/s | errors |"
        + (" latest turn (after its slot) |" if late else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if late else ""),
    ]
    for row in part["policies"]:
        lines.append(f"| {row['title']} | {row['hit_ratio']:.2%} | {row['conversation_hit_ratio']:.2%} | "
                     f"{_ms(row['ttft_p50_ms'])} | {_ms(row['ttft_p99_ms'])} | {row['requests_per_s']:.1f} | "
                     f"{row['errors']} |" + (f" {row['late_max_ms']:.0f} ms |" if late else ""))
    lines.append(f"| *ideal (one endless cache)* | {part['oracle_hit_ratio']:.2%} | "
                 f"{part['oracle_conversation_hit_ratio']:.2%} | | | | |" + (" |" if late else ""))
    by_policy = {row["policy"]: row for row in part["policies"]}
    plain = by_policy.get(ROUND_ROBIN)
    if plain and plain["hit_ratio"]:
        lines += ["", f"- Ideal ÷ round robin: hit ratio {part['oracle_hit_ratio'] / plain['hit_ratio']:.2f}x."]
        for policy in (PICKER_DEFAULT, PICKER_CACHE_LEANING, PICKER_CACHE_SAMPLED):
            picker = by_policy.get(policy.name)
            if picker:
                lines.append(f"- {policy.title} ÷ round robin: hit ratio {picker['hit_ratio'] / plain['hit_ratio']:.2f}x, "
                             f"TTFT p50 {_ratio(picker['ttft_p50_ms'], plain['ttft_p50_ms'])}, p99 "
                             f"{_ratio(picker['ttft_p99_ms'], plain['ttft_p99_ms'])}; the picker used "
                             f"{1000 * picker['picker_cpu_s_per_request']:.1f} ms of CPU per request.")
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _format_ends(ends: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(ends.items())) or "-"


# --- the command ---------------------------------------------------------------------------------


# The run's parts, in order: part 1's two workloads, then the picker's cost and its profile.
PARTS = ("trace", "chat", "cost", "profile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run of every path: 100 trace requests, 12 chats of 3 turns, short windows "
                             "(about 2-3 minutes)")
    parser.add_argument("--requests", type=int, default=None,
                        help="Mooncake requests replayed per policy (default 300, the whole sample; 100 with --quick)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where gateway.json and gateway.md go (default {DEFAULT_OUT.relative_to(BENCH_DIR.parent)}; "
                             "with --quick or --parts a temporary directory, as python -m bench does, so a smoke "
                             "or partial run never replaces a full run's numbers)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART",
                        help=f"what to run, of {', '.join(PARTS)} (default: all)")
    args = parser.parse_args(argv)
    if args.requests is not None and not 1 <= args.requests <= 300:
        parser.error("--requests must be in 1..300 (the bundled sample has 300)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings.quick_run() if args.quick else Settings()
    if args.requests is not None:
        settings = replace(settings, requests=args.requests)
    if (os.cpu_count() or 1) < 2:
        print(f"needs 2 CPUs (the picker on CPU {SERVER_CPU}, the rest on CPU {CLIENT_CPU})", file=sys.stderr)
        return 2
    # This process (the load generator) and every child but the picker on the client CPU.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {CLIENT_CPU})
    if args.out is None:
        partial = settings.quick or set(args.parts) != set(PARTS)  # never replaces a full run's numbers
        args.out = Path(tempfile.gettempdir()) / "dynamo_lite_bench_gateway" if partial else DEFAULT_OUT
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "settings": asdict(settings),
        "meta": {**machine(), "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                 "command": "python -m bench.gateway" + ("" if argv is not None else "".join(
                     f" {arg}" for arg in sys.argv[1:])),
                 "pinning": f"picker: taskset -c {SERVER_CPU}; Envoy (--concurrency 1), engines, slot tracker, "
                            f"indexer: taskset -c {CLIENT_CPU}; load generator: sched_setaffinity {{{CLIENT_CPU}}}"},
    }
    progress(f"gateway benchmark{' (quick)' if settings.quick else ''}; output in {args.out}")
    try:
        if "trace" in args.parts:
            results["routing"] = routing_quality(settings)
        if "chat" in args.parts:
            results["chat"] = chat_quality(settings)
        if "cost" in args.parts:
            results["picker_cost"] = picker_cost(settings)
        if "profile" in args.parts:
            with tempfile.TemporaryDirectory(prefix="bench-gateway-profile-") as workdir:
                results["profile"] = picker_profile(settings, Path(workdir))
    finally:
        results["meta"]["wall_s"] = time.monotonic() - started
        (args.out / "gateway.json").write_text(json.dumps(results, indent=1) + "\n")
        table = markdown(results)
        (args.out / "gateway.md").write_text(table)
        progress(f"wrote {args.out / 'gateway.json'} and gateway.md in {results['meta']['wall_s'] / 60:.1f} min")
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
