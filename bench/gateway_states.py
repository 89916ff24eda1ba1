"""`python -m bench.gateway --parts states`: the latency the picker adds through Envoy with its
state in the two services (`--state services`, the default: two HTTP reads per pick, bookings
as HTTP calls) and in its own process (`--state in-process`: the index and the loads read and
booked synchronously, no service running).

Both stacks run at once (fast engines, each picker on the picker's CPU, idle while the other is
measured), and the rounds alternate: Envoy ROUND_ROBIN without ext_proc, then Envoy with each
picker, the same small streamed request at the same open-loop rate; the difference to round
robin at p50 and p99 is what each picker adds. On a machine shared with other work, drift
then falls on all three paths alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import orjson

from .gateway_load import Outcome, Planned, open_loop, summarise
from .gateway_stack import MODEL, PICKER_FULL, ROUND_ROBIN, EngineSettings, GatewayStack
from .runner import progress

STATES = ("services", "in-process")
TITLES = {"services": "`--state services` (slot tracker + indexer over HTTP)",
          "in-process": "`--state in-process` (the picker's own cores)"}
ROUNDS = 5  # short rounds, alternating: drift spreads over every path


def by_state(settings: Any, run: Callable[[Any], Any], started_stack: Callable[..., Any]) -> dict[str, Any]:
    """Per state, the picker's added latency at p50 and p99 (bench.gateway's part 2 (a), both
    stacks measured in turn)."""
    engines = EngineSettings(speedup=settings.fast_speedup, extra=["--decode-step-secs", "0.00001"])
    body = orjson.dumps({"model": MODEL, "prompt": list(range(100, 100 + settings.small_prompt_tokens)),
                         "max_tokens": settings.small_max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}})
    seconds = settings.latency_seconds * settings.latency_rounds / ROUNDS
    count = max(1, round(settings.latency_rate * seconds))
    plan = [Planned(i / settings.latency_rate, "/v1/completions", body) for i in range(count)]
    rounds = ROUNDS if not settings.quick else 1
    progress(f"added latency by state: {rounds} round(s) of {count} small streamed requests per path at "
             f"{settings.latency_rate:.0f} req/s; round robin, then the picker with each state")
    with contextlib.ExitStack() as running:
        stacks: dict[str, GatewayStack] = {
            state: running.enter_context(started_stack(engine_settings=engines, state=state,
                                                       variants=(PICKER_FULL, ROUND_ROBIN)))
            for state in STATES}
        outcomes: dict[str, list[Outcome]] = {ROUND_ROBIN: [], **{state: [] for state in STATES}}
        cpu = dict.fromkeys(STATES, 0.0)
        before = {state: stack.picker_metrics() for state, stack in stacks.items()}
        for _ in range(rounds):
            done, _ = run(open_loop(stacks[STATES[0]].envoys[ROUND_ROBIN].url, plan))
            outcomes[ROUND_ROBIN] += done
            for state, stack in stacks.items():
                started = stack.picker_cpu_seconds()
                done, _ = run(open_loop(stack.envoys[PICKER_FULL].url, plan))
                cpu[state] += stack.picker_cpu_seconds() - started
                outcomes[state] += done
        after = {state: stack.picker_metrics() for state, stack in stacks.items()}
        for stack in stacks.values():
            stack.wait_idle(settings.idle_timeout)
    plain = summarise(outcomes[ROUND_ROBIN])
    results: dict[str, Any] = {"engine_flags": engines.extra + ["--speedup-ratio", str(engines.speedup)],
                               "rate": settings.latency_rate, "rounds": rounds,
                               "requests_per_path": len(outcomes[ROUND_ROBIN]),
                               "prompt_tokens": settings.small_prompt_tokens, "max_tokens": settings.small_max_tokens,
                               "round_robin": asdict(plain)}
    for state in STATES:
        picker = summarise(outcomes[state])
        picks = after[state].get("dynamo_lite_epp_pick_seconds_count", 0) - before[state].get(
            "dynamo_lite_epp_pick_seconds_count", 0)
        pick_secs = after[state].get("dynamo_lite_epp_pick_seconds_sum", 0) - before[state].get(
            "dynamo_lite_epp_pick_seconds_sum", 0)
        row = {"picker": asdict(picker),
               "added_p50_ms": _minus(picker.latency_p50_ms, plain.latency_p50_ms),
               "added_p99_ms": _minus(picker.latency_p99_ms, plain.latency_p99_ms),
               "picker_cpu_ms_per_request": 1000 * cpu[state] / max(1, len(outcomes[state])),
               "pick_mean_ms": 1000 * pick_secs / picks if picks else None}
        results[state] = row
        progress(f"  {state}: picker p50 {_ms(picker.latency_p50_ms)} p99 {_ms(picker.latency_p99_ms)}; added p50 "
                 f"{_ms(row['added_p50_ms'])} p99 {_ms(row['added_p99_ms'])}; pick mean {_ms(row['pick_mean_ms'])}; "
                 f"picker CPU {row['picker_cpu_ms_per_request']:.2f} ms/request; errors {picker.errors}")
    progress(f"  round robin p50 {_ms(plain.latency_p50_ms)} p99 {_ms(plain.latency_p99_ms)}; errors {plain.errors}")
    return results


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def markdown(results: dict[str, Any]) -> list[str]:
    plain = results["round_robin"]
    lines = [
        "",
        f"Added latency by where the picker's state lives: the same streamed request ({results['prompt_tokens']} "
        f"prompt tokens, {results['max_tokens']} answer tokens) at {results['rate']:.0f} req/s open loop, "
        f"{results['requests_per_path']} requests per path in {results['rounds']} alternating rounds, fast engines "
        f"(`{' '.join(results['engine_flags'])}`); round robin without ext_proc: p50 "
        f"{_ms(plain['latency_p50_ms'])}, p99 {_ms(plain['latency_p99_ms'])}.",
        "",
        "| picker state | added p50 | added p99 | picker p50 | picker p99 | picker CPU per request | "
        "pick (body end → pick) mean | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for state in STATES:
        row = results[state]
        picker = row["picker"]
        lines.append(
            f"| {TITLES[state]} | **{_ms(row['added_p50_ms'])}** | **{_ms(row['added_p99_ms'])}** | "
            f"{_ms(picker['latency_p50_ms'])} | {_ms(picker['latency_p99_ms'])} | "
            f"{row['picker_cpu_ms_per_request']:.2f} ms | {_ms(row['pick_mean_ms'])} | {picker['errors']} |")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


__all__ = ["STATES", "by_state", "markdown"]
