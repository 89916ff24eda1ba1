"""`python -m bench.gateway --parts states`: the latency the picker adds through Envoy with its
state in the two services (`--state services`, the default: two HTTP reads per pick, bookings
as HTTP calls) and in its own process (`--state in-process`: the index and the loads read and
booked synchronously, no service running).

Both stacks run at once (fast engines, each picker on the picker's CPU, idle while the other is
measured), and the rounds alternate: Envoy ROUND_ROBIN without ext_proc, then Envoy with each
picker in two configurations, full duplex both ways as shipped (deploy/envoy/envoy-fallbacks.yaml:
Envoy waits for the picker's reply to every response chunk) and the observability split
(deploy/envoy/envoy-observer.yaml, Envoy's default deferred close: the response side is
observed, not waited for); the same small streamed request at the same open-loop rate; the
difference to round robin at p50 and p99 is what each picker adds. On a machine shared with
other work, drift then falls on every path alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import orjson

from dynamo_lite.stack import PICKER_FULL, PICKER_OBSERVER_5S, ROUND_ROBIN, Stack

from .gateway_load import Outcome, Planned, open_loop, summarise
from .gateway_stack import MODEL, EngineSettings, envoy_of, picker_cpu_seconds
from .runner import progress

STATES = ("services", "in-process")
TITLES = {"services": "`--state services` (slot tracker + indexer over HTTP)",
          "in-process": "`--state in-process` (the picker's own cores)"}
CONFIGS = {PICKER_FULL: "full duplex (as shipped)", PICKER_OBSERVER_5S: "observability split (envoy-observer.yaml)"}
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
        stacks: dict[str, Stack] = {
            state: running.enter_context(started_stack(engine_settings=engines, state=state,
                                                       variants=(*CONFIGS, ROUND_ROBIN)))
            for state in STATES}
        paths = [(state, config) for config in CONFIGS for state in STATES]
        outcomes: dict[Any, list[Outcome]] = {ROUND_ROBIN: [], **{path: [] for path in paths}}
        cpu = dict.fromkeys(paths, 0.0)
        picks = dict.fromkeys(paths, (0.0, 0.0))
        for _ in range(rounds):
            done, _ = run(open_loop(envoy_of(stacks[STATES[0]], ROUND_ROBIN).url, plan))
            outcomes[ROUND_ROBIN] += done
            for path in paths:
                stack = stacks[path[0]]
                before, started = stack.picker_metrics(), picker_cpu_seconds(stack)
                done, _ = run(open_loop(envoy_of(stack, path[1]).url, plan))
                cpu[path] += picker_cpu_seconds(stack) - started
                after = stack.picker_metrics()
                picks[path] = tuple(was + after.get(name, 0) - before.get(name, 0) for was, name in zip(
                    picks[path], ("dynamo_lite_epp_pick_seconds_count", "dynamo_lite_epp_pick_seconds_sum")))
                outcomes[path] += done
        left = {state: stack.wait_idle(settings.idle_timeout)[0] for state, stack in stacks.items()}
    plain = summarise(outcomes[ROUND_ROBIN])
    results: dict[str, Any] = {"engine_flags": engines.extra + ["--speedup-ratio", str(engines.speedup)],
                               "rate": settings.latency_rate, "rounds": rounds,
                               "requests_per_path": len(outcomes[ROUND_ROBIN]),
                               "prompt_tokens": settings.small_prompt_tokens, "max_tokens": settings.small_max_tokens,
                               "round_robin": asdict(plain), "booked_after": left}
    rows = []
    for state, config in paths:
        picker = summarise(outcomes[(state, config)])
        count, seconds = picks[(state, config)]
        row = {"state": state, "variant": config, "picker": asdict(picker),
               "added_p50_ms": _minus(picker.latency_p50_ms, plain.latency_p50_ms),
               "added_p99_ms": _minus(picker.latency_p99_ms, plain.latency_p99_ms),
               "picker_cpu_ms_per_request": 1000 * cpu[(state, config)] / max(1, len(outcomes[(state, config)])),
               "pick_mean_ms": 1000 * seconds / count if count else None}
        rows.append(row)
        progress(f"  {state}, {config}: picker p50 {_ms(picker.latency_p50_ms)} p99 {_ms(picker.latency_p99_ms)}; added p50 "
                 f"{_ms(row['added_p50_ms'])} p99 {_ms(row['added_p99_ms'])}; pick mean {_ms(row['pick_mean_ms'])}; "
                 f"picker CPU {row['picker_cpu_ms_per_request']:.2f} ms/request; errors {picker.errors}")
    progress(f"  round robin p50 {_ms(plain.latency_p50_ms)} p99 {_ms(plain.latency_p99_ms)}; errors {plain.errors}; "
             f"still booked at the end: {left}")
    results["rows"] = rows
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
        "| picker state | Envoy configuration | added p50 | added p99 | picker p50 | picker p99 | "
        "picker CPU per request | pick (body end → pick) mean | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        picker = row["picker"]
        lines.append(
            f"| {TITLES[row['state']]} | {CONFIGS[row['variant']]} | **{_ms(row['added_p50_ms'])}** | **{_ms(row['added_p99_ms'])}** | "
            f"{_ms(picker['latency_p50_ms'])} | {_ms(picker['latency_p99_ms'])} | "
            f"{row['picker_cpu_ms_per_request']:.2f} ms | {_ms(row['pick_mean_ms'])} | {picker['errors']} |")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


__all__ = ["STATES", "by_state", "markdown"]
