"""The gateway benchmark: Envoy + the endpoint picker, end to end, every part a real process.

    python -m bench.gateway                    # the full run (about 45 minutes), into bench/out/gateway
    python -m bench.gateway --quick            # a smoke run of every path (a few minutes), into a temp dir
    python -m bench.gateway --parts routing --workloads chat --rates 1 3
    python -m bench.gateway --parts cost       # one part (routing, disaggregated, cost, states, profile), into a temp dir
    python -m bench.gateway --disaggregated    # aggregated vs prefill/decode fleets (about 5 minutes), into a temp dir

Three questions, one run:

1. **Routing quality** on a fleet-sized gateway (bench/gateway_routing.py): the Mooncake
   conversation trace's first 2,000 requests and a multi-turn chat, each at its base rate and at
   2x and 3x, on 8 engine stand-ins whose caches together hold 1.4x the workload's distinct
   prompt blocks; routed by the picker (its defaults, and `--cost dynamo`) and by Envoy's own
   ROUND_ROBIN and LEAST_REQUEST; beside each, the simulator's numbers for the same run and the
   bound (one endless cache). Fresh processes (empty caches) for each policy.
2. **Disaggregated fleets** (bench/gateway_disagg.py, issue 38): the Mooncake trace's long
   prompts on K engine stand-ins (default 4) aggregated, then on K/2 prefill + K/2 decode ones
   (the decode ones behind P/D sidecars, the KV transfer timed from a stated bandwidth): TTFT,
   ITL, output tokens/s and the picker's disaggregation decisions of each.
3. **The picker's own cost.** (a) the latency it adds: one small streamed request at a fixed
   open-loop rate through Envoy with the picker and through Envoy ROUND_ROBIN without ext_proc,
   on engines made nearly free; (b) its CPU seconds per request (/proc/<pid>/stat); (c) its CPU
   per 256-token answer streamed one token per chunk, as vLLM streams by default (engines at
   8x the default timing, about 0.9 ms per token, so each token reaches Envoy as its own
   chunk: the full-duplex row's ext_proc messages per request show it), in these Envoy
   configurations: (i) full duplex both ways (as shipped), (ii) response headers only, (iii)
   the response body in a second, observability-mode ext_proc filter (with the tests' 0.5 s
   deferred close, and with Envoy's default 5 s), (iv) the first response chunk only, the
   answer's end from Envoy's gRPC access log (deploy/envoy/envoy-access-log.yaml); (ii) and
   (iv), whose cost does not depend on the chunks, again on the fast engines at a higher rate;
   with the bookkeeping each leaves on the slot tracker, under that load and below capacity,
   and a cProfile of the picker summed by what the code does, in (i) and in (iv).

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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import uvloop

from dynamo_lite.stack import (
    PICKER_ACCESS_LOG,
    PICKER_FULL,
    PICKER_HEADERS_ONLY,
    PICKER_OBSERVER,
    PICKER_OBSERVER_5S,
    ROUND_ROBIN,
    Envoy,
    Stack,
    StackError,
    envoy_binary,
)

from . import gateway_disagg, gateway_profile, gateway_routing, gateway_states
from .gateway_chat import ChatShape
from .gateway_disagg import DisaggSettings
from .gateway_load import Outcome, Planned, closed_loop, open_loop, summarise
from .gateway_routing import RoutingSettings
from .gateway_stack import MODEL, EngineSettings, envoy_of, gateway_stack, picker_cpu_seconds, process_cpu_seconds
from .runner import progress
from .servers import CLIENT_CPU, SERVER_CPU

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "out" / "gateway"
ENGINES = 4  # part 2: the picker's cost does not depend on the fleet's size
# The picker's ext_proc configurations compared in part 2 (c), in the table's order.
# The configurations whose picker CPU per answer does not depend on how many chunks it comes in:
# measured again on the fast engines, at the higher rate those allow.
FAST_ROWS = (PICKER_HEADERS_ONLY, PICKER_ACCESS_LOG)
PICKER_CONFIGS = {
    PICKER_FULL: "(i) full duplex both ways (as shipped)",
    PICKER_HEADERS_ONLY: "(ii) response headers only (body NONE, trailers SKIP)",
    PICKER_OBSERVER: "(iii) request side + observability-mode filter for the response (deferred close 0.5 s)",
    PICKER_OBSERVER_5S: "(iii) the same, Envoy's default deferred close (5 s)",
    PICKER_ACCESS_LOG: "(iv) the first response chunk only, the end from Envoy's access log (envoy-access-log.yaml)",
}


@dataclass(frozen=True)
class Settings:
    routing: RoutingSettings = RoutingSettings()
    disaggregated: DisaggSettings = DisaggSettings()
    # Part 2 (a): the added latency, engines made nearly free.
    fast_speedup: float = 1000.0
    # Part 2 (c): answers streamed one token per chunk. At 1000x the engines emit tokens faster
    # than Envoy reads them (16.5 ext_proc messages for a 128-token answer); at 8x (6.8 ms / 8 =
    # 0.85 ms per token) nearly every token is a read, and so an ext_proc message, of its own.
    paced_speedup: float = 8.0
    latency_rate: float = 100.0  # requests/s, open loop
    latency_seconds: float = 5.0  # per round and path
    latency_rounds: int = 2  # picker and round robin alternate: drift spreads over both
    small_prompt_tokens: int = 32
    small_max_tokens: int = 8
    throughput_concurrency: int = 32
    throughput_seconds: float = 8.0
    throughput_warmup: float = 1.0
    answer_tokens: int = 256
    idle_seconds: float = 3.0  # the picker's CPU with no request: what per-request figures carry
    bookkeeping_rate: float = 30.0  # below every configuration's capacity: exactness, not overload
    bookkeeping_seconds: float = 3.0
    profile_seconds: float = 5.0
    idle_timeout: float = 10.0  # how long to wait for the slot tracker to reach zero
    quick: bool = False

    @classmethod
    def quick_run(cls) -> Settings:
        """Every path once, shortly: 200 trace requests and 12 chats of 3 turns at the base rate,
        2-3 s windows."""
        routing = RoutingSettings(rates=(1.0,), mooncake_requests=200,
                                  chat=ChatShape(conversations=12, turns=3, system_tokens=64, min_gap=6))
        return cls(routing=routing, disaggregated=DisaggSettings(requests=60, span_s=20.0), latency_seconds=2.0, latency_rounds=1, throughput_seconds=3.0,
                   bookkeeping_seconds=2.0, profile_seconds=3.0, quick=True)


# --- part 2: the picker's cost ------------------------------------------------------------------


def _completion(prompt: list[int], max_tokens: int) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}})


def added_latency(settings: Settings, stack: Stack) -> dict[str, Any]:
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
            before = picker_cpu_seconds(stack)
            done, _ = run(open_loop(envoy_of(stack, variant).url, plan))
            if variant == PICKER_FULL:
                picker_cpu += picker_cpu_seconds(stack) - before
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


def throughput(settings: Settings, stack: Stack, variant: str) -> dict[str, Any]:
    """(c): closed loop of 256-token answers streamed one token per chunk; what the picker costs,
    and what the bookkeeping looks like at the end of the window and after it."""
    envoy = envoy_of(stack, variant)
    picked = variant in PICKER_CONFIGS  # round robin: the picker sits idle, its figures mean nothing
    body = _completion(list(range(200, 200 + settings.small_prompt_tokens)), settings.answer_tokens)
    marks: dict[str, Any] = {}

    # The callbacks run on the load generator's loop: the HTTP reads (counters) first when the
    # window opens and last when it closes, the CPU clocks right at its edges.
    def opened() -> None:
        marks.update(envoy_stats=_ext_proc_stats(envoy), calls=_service_calls(stack))
        marks.update(picker=picker_cpu_seconds(stack), envoy=process_cpu_seconds(envoy.pid), clock=time.monotonic())

    def closed() -> None:
        marks.update(picker_end=picker_cpu_seconds(stack), envoy_end=process_cpu_seconds(envoy.pid),
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


def bookkeeping(settings: Settings, stack: Stack, variant: str) -> dict[str, Any]:
    """Below capacity: does every booking end with its answer ("complete"), and at once?"""
    body = _completion(list(range(300, 300 + settings.small_prompt_tokens)), settings.answer_tokens)
    count = max(1, round(settings.bookkeeping_rate * settings.bookkeeping_seconds))
    plan = [Planned(i / settings.bookkeeping_rate, "/v1/completions", body) for i in range(count)]
    before = stack.picker_metrics()
    outcomes, _ = run(open_loop(envoy_of(stack, variant).url, plan))
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


def _fast_engines(settings: Settings) -> EngineSettings:
    return EngineSettings(speedup=settings.fast_speedup, extra=["--decode-step-secs", "0.00001"])


def _paced_engines(settings: Settings) -> EngineSettings:
    return EngineSettings(speedup=settings.paced_speedup)


def idle_cpu(settings: Settings, stack: Stack) -> float:
    """The picker's CPU seconds per second with no request in flight (health checks, the pool
    watcher, the engines' /metrics): part of every per-request figure, more so at low rates."""
    before = picker_cpu_seconds(stack)
    time.sleep(settings.idle_seconds)
    per_second = (picker_cpu_seconds(stack) - before) / settings.idle_seconds
    progress(f"  picker CPU while idle: {1000 * per_second:.1f} ms per second")
    return per_second


def picker_cost(settings: Settings) -> dict[str, Any]:
    fast = _fast_engines(settings)
    with started_stack(engine_settings=fast, variants=(PICKER_FULL, ROUND_ROBIN, *FAST_ROWS)) as stack:
        latency = added_latency(settings, stack)
        progress(f"picker CPU per answer at a higher rate: the same closed loop on the fast engines (an answer in "
                 f"a few chunks), where the picker's cost does not depend on the chunks: {', '.join(FAST_ROWS)}")
        fast_rows = [throughput(settings, stack, variant) for variant in FAST_ROWS]
    paced = _paced_engines(settings)
    with started_stack(engine_settings=paced, variants=(*PICKER_CONFIGS, ROUND_ROBIN)) as stack:
        idle = idle_cpu(settings, stack)
        progress(f"picker CPU per answer: closed loop, {settings.throughput_concurrency} concurrent "
                 f"{settings.answer_tokens}-token answers one token per chunk, {settings.throughput_seconds:.0f} s per "
                 f"configuration (round robin without the picker first: the rest of the stack's own ceiling)")
        rows = [throughput(settings, stack, variant) for variant in (ROUND_ROBIN, *PICKER_CONFIGS)]
        progress(f"bookkeeping below capacity: {settings.bookkeeping_rate:.0f} req/s open loop, "
                 f"{settings.answer_tokens}-token answers")
        books = [bookkeeping(settings, stack, variant) for variant in PICKER_CONFIGS]
    return {"engine_flags": fast.extra + ["--speedup-ratio", str(fast.speedup)],
            "paced_engine_flags": paced.extra + ["--speedup-ratio", str(paced.speedup)],
            "picker_idle_cpu_per_second": idle, "latency": latency, "throughput": rows, "bookkeeping": books,
            "throughput_fast_engines": fast_rows}


def picker_profile(settings: Settings, workdir: Path, variant: str = PICKER_FULL) -> dict[str, Any]:
    """Where the picker's time goes under part 2 (c)'s closed loop, in one Envoy configuration."""
    engines = _paced_engines(settings)
    path = workdir / f"picker-{variant}.prof"
    body = _completion(list(range(400, 400 + settings.small_prompt_tokens)), settings.answer_tokens)
    progress(f"profile: the picker under cProfile, {variant}, closed loop for {settings.profile_seconds:.0f} s")
    with started_stack(engine_settings=engines, variants=(variant,), profile_path=path) as stack:
        outcomes, seconds = run(closed_loop(envoy_of(stack, variant).url, settings.throughput_concurrency,
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
                  profile_path: Path | None = None, attempts: int = 3, engines: int = ENGINES,
                  state: str = "services") -> Iterator[Stack]:
    """A stack up and ready; a start-up that fails (a port taken between its choice and its bind
    by another process on this shared machine) is tried again with other ports."""
    for attempt in range(1, attempts + 1):
        stack = gateway_stack(engines=engines, engine_settings=engine_settings, variants=variants,
                              picker_flags=picker_flags, state=state, profile_path=profile_path)
        try:
            stack.__enter__()
        except StackError as exc:
            if attempt == attempts:
                raise
            progress(f"stack start-up failed ({str(exc).splitlines()[0][:160]}); trying again")
            continue
        try:
            yield stack
        finally:
            stack.__exit__(None, None, None)
        return


def _ext_proc_stats(envoy: Envoy) -> dict[str, int]:
    prefix = "http.inference.ext_proc."
    return {name[len(prefix):]: value for name, value in envoy.stats("^" + prefix).items()}


def _service_calls(stack: Stack) -> float:
    """Requests the slot tracker and the indexer have served (the picker is their only client
    during a run, apart from the indexer's KV events, which come over ZMQ)."""
    if not stack.has_picker:
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
        version = subprocess.run([envoy_binary() or "envoy", "--version"], capture_output=True, text=True, timeout=20).stdout
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
        lines += gateway_routing.markdown(routing)
    if results.get("disaggregated"):
        lines += gateway_disagg.markdown(results["disaggregated"])
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
            f"Picker CPU per answer: closed loop, {results['settings']['throughput_concurrency']} concurrent "
            f"{results['settings']['answer_tokens']}-token answers streamed one token per chunk (engines "
            f"`{' '.join(cost['paced_engine_flags'])}`); picker alone on CPU {SERVER_CPU}, everything else on CPU "
            f"{CLIENT_CPU}; the picker idle costs {1000 * cost['picker_idle_cpu_per_second']:.1f} ms of CPU per "
            "second, included below.",
            "",
            "| Envoy configuration | req/s | picker CPU per request | picker CPU use | req/s per picker core "
            "(1 ÷ CPU per request) | ext_proc messages to / from the picker per request | slot tracker + indexer "
            "calls per request | slot tracker active at the window's end (in flight) | ends by reason | errors |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        header = lines[-2:]
        lines += [_throughput_row(row) for row in cost["throughput"]]
        if cost.get("throughput_fast_engines"):
            lines += ["", "The same on the fast engines (an answer in a few chunks, so a higher rate), for the "
                      "configurations whose picker CPU does not depend on the chunks:", "", *header]
            lines += [_throughput_row(row) for row in cost["throughput_fast_engines"]]
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
    if results.get("states"):
        lines += gateway_states.markdown(results["states"])
    for key, what in (("profile", "full duplex"), ("profile_access_log", "the access-log configuration")):
        profile = results.get(key)
        if profile and "shares" in profile:
            lines += ["", f"Where the picker's time goes (cProfile, {what}, closed loop; "
                          f"{profile['requests_per_s_under_profiler']:.0f} req/s under the profiler; the picker's "
                          "waiting left out):", "",
                      "| share of the picker's Python time | what |", "|---|---|"]
            lines += [f"| {share:.0%} | {name} |" for name, share in profile["shares"].items()]
    return "\n".join(lines) + "\n"


def _throughput_row(row: dict[str, Any]) -> str:
    title = PICKER_CONFIGS.get(row["variant"], "Envoy ROUND_ROBIN, no picker (the rest of the stack)")
    return (f"| {title} | {row['requests_per_s']:.0f} | {_num(row['picker_cpu_ms_per_request'], '.2f', ' ms')} | "
            f"{_num(row['picker_cpu_utilisation'], '.0%')} | {_num(row['requests_per_s_per_picker_core'], '.0f')} | "
            f"{row['ext_proc_messages_to_picker_per_request']:.1f} / "
            f"{row['ext_proc_messages_from_picker_per_request']:.1f} | {_num(row['service_calls_per_request'], '.1f')} | "
            f"{_num(row['slot_tracker_active_at_window_end'], 'd')} ({row['in_flight_at_window_end']}) | "
            f"{_format_ends(row['ends'])} | {row['errors']} |")


def _format_ends(ends: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(ends.items())) or "-"


# --- the command ---------------------------------------------------------------------------------


# The run's parts, in order: routing quality, aggregated against disaggregated fleets, then the
# picker's cost, its added latency with the state in the services and in its own process, and its
# profile.
PARTS = ("routing", "disaggregated", "cost", "states", "profile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run of every path: 200 trace requests, 12 chats of 3 turns, base rate only, "
                             "short windows")
    parser.add_argument("--engines", type=int, default=None, help="engine stand-ins in the routing part (default 8)")
    parser.add_argument("--workloads", nargs="+", choices=gateway_routing.WORKLOADS, default=None,
                        help="the routing part's workloads (default: both)")
    parser.add_argument("--rates", nargs="+", type=float, default=None, metavar="X",
                        help="the routing part's rates, as multiples of each workload's base rate (default 1 2 3)")
    parser.add_argument("--policies", nargs="+", choices=[p.name for p in gateway_routing.POLICIES], default=None,
                        help="the routing part's policies (default: all four)")
    parser.add_argument("--trace", default=None,
                        help="the Mooncake conversation trace (default: ../shared/data/mooncake/conversation_trace.jsonl "
                             "beside the checkout)")
    parser.add_argument("--requests", type=int, default=None,
                        help="Mooncake requests replayed per policy (default 2,000; 200 with --quick)")
    parser.add_argument("--no-sim", action="store_true", help="do not run the simulator beside the real runs")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where gateway.json and gateway.md go (default {DEFAULT_OUT.relative_to(BENCH_DIR.parent)}; "
                             "with --quick or --parts a temporary directory, as python -m bench does, so a smoke "
                             "or partial run never replaces a full run's numbers)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=None, metavar="PART",
                        help=f"what to run, of {', '.join(PARTS)} (default: all)")
    disagg = parser.add_argument_group("the disaggregated part (issue 38)")
    disagg.add_argument("--disaggregated", action="store_true",
                        help="run the disaggregated part only (the same as --parts disaggregated): K aggregated "
                             "engines, then K/2 prefill + K/2 decode, on the trace's long prompts")
    disagg.add_argument("--disagg-engines", type=int, default=None, metavar="K",
                        help="engines in each fleet of the disaggregated part (default 4; even)")
    disagg.add_argument("--disagg-requests", type=int, default=None, metavar="N",
                        help="long-prompt requests replayed per fleet (default 600; 60 with --quick)")
    disagg.add_argument("--disagg-seconds", type=float, default=None, metavar="S",
                        help="the long-prompt slice's arrivals spread over S seconds (default 150; 20 with --quick)")
    disagg.add_argument("--disagg-min-input-tokens", type=int, default=None, metavar="T",
                        help="a long prompt: at least T input tokens in the trace (default 8192)")
    disagg.add_argument("--kv-transfer-bandwidth-gbps", type=float, default=None, metavar="GBPS",
                        help="the stand-ins' KV transfer bandwidth (default 200, the stand-in's)")
    args = parser.parse_args(argv)
    if args.disaggregated:
        if args.parts is not None and args.parts != ["disaggregated"]:
            parser.error("--disaggregated is --parts disaggregated: give one or the other")
        args.parts = ["disaggregated"]
    elif args.parts is None:
        args.parts = list(PARTS)
    if args.disagg_engines is not None and (args.disagg_engines < 2 or args.disagg_engines % 2):
        parser.error("--disagg-engines must be even and at least 2")
    for flag in ("disagg_requests", "disagg_min_input_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("disagg_seconds", "kv_transfer_bandwidth_gbps"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.engines is not None and args.engines < 2:
        parser.error("--engines must be at least 2")
    if args.rates is not None and any(not rate > 0 for rate in args.rates):
        parser.error("--rates must be positive")
    return args


def routing_settings(settings: Settings, args: argparse.Namespace) -> Settings:
    changes: dict[str, Any] = {}
    for flag, field_name in (("engines", "engines"), ("trace", "trace"), ("requests", "mooncake_requests")):
        if getattr(args, flag) is not None:
            changes[field_name] = getattr(args, flag)
    for flag in ("workloads", "rates", "policies"):
        if getattr(args, flag) is not None:
            changes[flag] = tuple(getattr(args, flag))
    if args.no_sim:
        changes["simulate"] = False
    disagg: dict[str, Any] = {}
    for flag, field_name in (("disagg_engines", "engines"), ("disagg_requests", "requests"),
                             ("disagg_seconds", "span_s"), ("disagg_min_input_tokens", "min_input_tokens"),
                             ("kv_transfer_bandwidth_gbps", "bandwidth_gbps"), ("trace", "trace")):
        if getattr(args, flag, None) is not None:
            disagg[field_name] = getattr(args, flag)
    if disagg:
        settings = replace(settings, disaggregated=replace(settings.disaggregated, **disagg))
    return replace(settings, routing=replace(settings.routing, **changes)) if changes else settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = routing_settings(Settings.quick_run() if args.quick else Settings(), args)
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
        if "routing" in args.parts:
            results["routing"] = gateway_routing.routing(settings.routing, run, started_stack)
        if "disaggregated" in args.parts:
            results["disaggregated"] = gateway_disagg.disaggregated(settings.disaggregated, run, started_stack)
        if "cost" in args.parts:
            results["picker_cost"] = picker_cost(settings)
        if "states" in args.parts:
            results["states"] = gateway_states.by_state(settings, run, started_stack)
        if "profile" in args.parts:
            with tempfile.TemporaryDirectory(prefix="bench-gateway-profile-") as workdir:
                results["profile"] = picker_profile(settings, Path(workdir))
                results["profile_access_log"] = picker_profile(settings, Path(workdir), PICKER_ACCESS_LOG)
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
