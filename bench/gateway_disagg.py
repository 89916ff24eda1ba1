"""Part `disaggregated` of `python -m bench.gateway` (issue 38): the same number of engines,
aggregated and as prefill + decode pools, on long prompts.

One run, two fleets of `engines` (K, default 4) engine stand-ins behind Envoy and the picker
(its default cost), each started fresh (empty caches):

* **aggregated**: K engines, each prefilling and decoding its own requests;
* **disaggregated**: K/2 `prefill` engines and K/2 `decode` engines, each decode engine behind a
  P/D sidecar (`python -m dynamo_lite.pd_sidecar`), which is its endpoint in the pool and in
  Envoy. The picker prefills a prompt on a prefill engine when more than
  `--disagg-min-uncached-tokens` of it are uncached on the chosen decode engine; the decode
  engine then reads its blocks at the stated bandwidth.

The workload is the long-prompt slice of the Mooncake conversation trace: its requests with at
least `min_input_tokens` (real) input tokens, the first `requests` of them, their arrival times
scaled so the slice takes `span_s` seconds. Prompts and the engines' prefill time are scaled as
in the routing part (bench/gateway_trace.py: one 512-token hash id becomes 64 tokens, so a
scaled token stands for 8 real ones); so are the KV bytes per token (8 x the stand-in's 131,072,
Llama 3.1 8B in BF16) and the picker's threshold (Dynamo's 2,048 real tokens: 256). Answers
keep the trace's lengths, capped at `max_tokens_cap` (256): a decode token is a real one.

Per fleet: TTFT p50 / p99, ITL p50 / p99 (the gaps between streamed tokens), output tokens/s,
requests answered and failed, the picker's `dynamo_lite_epp_disagg_decisions_total{reason}` and
the sidecars' prefill fallbacks, and what each engine served (the prefill engines' one-token
prefills included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from dynamo_lite.simulate import standin
from dynamo_lite.simulate.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace
from dynamo_lite.stack import Stack

from . import gateway_trace
from .gateway_load import open_loop
from .gateway_routing import (
    DEFAULT_TRACE,
    PICKER_DEFAULT,
    RoutingSettings,
    Workload,
    engine_blocks,
    engine_flags,
    prompt_of,
    real_run,
)
from .runner import progress

# The stand-in's defaults (docs/engine-stand-in.md): 200 Gb/s, 128 KiB of KV per (real) token.
DEFAULT_BANDWIDTH_GBPS = 200.0
DEFAULT_KV_BYTES_PER_TOKEN = 131072
FLEETS = ("aggregated", "disaggregated")


@dataclass(frozen=True)
class DisaggSettings:
    engines: int = 4  # the same in both fleets; the disaggregated one K/2 prefill + K/2 decode
    trace: str = str(DEFAULT_TRACE)
    min_input_tokens: int = 8192  # real Mooncake tokens: what counts as a long prompt
    requests: int = 600
    span_s: float = 150.0  # the slice's arrivals spread over this many seconds
    tokens_per_hash_id: int = 64
    # Answers at the trace's own lengths (not scaled like the prompts), at most this: a decode
    # then lasts about as long beside a prefill as it would unscaled, which is what a long
    # prefill stalls on an aggregated engine.
    max_tokens_cap: int = 256
    output_scale: float = 1.0
    speedup: float = 2.0
    cache_factor: float = 1.4
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN  # per real token
    disagg_min_uncached_tokens: int = 2048  # real tokens (the picker's default), scaled like the prompts
    idle_timeout: float = 10.0

    @property
    def scale(self) -> float:
        """Real tokens per scaled token."""
        return MOONCAKE_BLOCK_TOKENS / self.tokens_per_hash_id

    def routing(self) -> RoutingSettings:
        return RoutingSettings(engines=self.engines, cache_factor=self.cache_factor, trace=self.trace,
                               tokens_per_hash_id=self.tokens_per_hash_id, max_tokens_cap=self.max_tokens_cap,
                               speedup=self.speedup, simulate=False, idle_timeout=self.idle_timeout)


def long_prompts(records: Sequence[TraceRecord], min_input_tokens: int, limit: int) -> list[TraceRecord]:
    """The first `limit` records with at least `min_input_tokens` input tokens, in trace order."""
    return [record for record in records if record.input_length >= min_input_tokens][:limit]


def workload(settings: DisaggSettings, records: Sequence[TraceRecord]) -> Workload:
    """The slice as open-loop requests, its trace time compressed to about `span_s`."""
    first = gateway_trace.build(records, tokens_per_hash_id=settings.tokens_per_hash_id,
                                max_tokens_cap=settings.max_tokens_cap, compression=1.0,
                                output_scale=settings.output_scale)
    span = first.plan[-1].at - first.plan[0].at if len(first.plan) > 1 else 0.0
    compression = max(span / settings.span_s, 1e-9) if span > 0 else 1.0
    trace = gateway_trace.build(records, tokens_per_hash_id=settings.tokens_per_hash_id,
                                max_tokens_cap=settings.max_tokens_cap, compression=compression,
                                output_scale=settings.output_scale)
    start = trace.plan[0].at
    plan = [replace(item, at=item.at - start) for item in trace.plan]
    wall = plan[-1].at if plan else 0.0
    prompts = [len(prompt_of(item.body)) for item in plan]
    description = (f"the first {len(plan):,} requests of the Mooncake conversation trace with at least "
                   f"{settings.min_input_tokens:,} input tokens ({sum(prompts) / max(1, len(prompts)):,.0f} scaled "
                   f"prompt tokens on average, {settings.scale:g} real tokens each), {len(plan) / max(wall, 1e-9):.1f} "
                   f"req/s over {wall:.0f} s (the trace's {span:.0f} s / {compression:.2f})")
    arrivals = [standin.Arrival(item.at, prompt_of(item.body), orjson.loads(item.body)["max_tokens"]) for item in plan]
    return Workload("mooncake-long", 1.0, description, arrivals, lambda url: open_loop(url, plan), plan,
                    settings.tokens_per_hash_id)


def _roles(fleet: str, engines: int) -> tuple[str, ...]:
    if fleet == "aggregated":
        return ()
    prefill = engines // 2
    return ("prefill",) * prefill + ("decode",) * (engines - prefill)


def _metric_sum(text: str, name: str) -> dict[str, float]:
    """Samples of one metric by their label set (the text inside braces, '' for none)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            labels = key[len(name):].strip("{}")
            found[labels] = found.get(labels, 0.0) + float(value)
    return found


def _measure(stack: Stack) -> dict[str, Any]:
    """The picker's disaggregation decisions and the sidecars' prefill fallbacks."""
    decisions: dict[str, int] = {}
    prefix = 'dynamo_lite_epp_disagg_decisions_total{reason="'
    for key, value in stack.picker_metrics().items():
        if key.startswith(prefix) and value:
            decisions[key[len(prefix):-2]] = int(value)
    fallbacks: dict[str, int] = {}
    sidecar_modes: dict[str, int] = {}
    for engine in stack.engines:
        if not engine.sidecar_port:
            continue
        text = httpx.get(f"http://{engine.endpoint}/metrics", timeout=5.0).text
        for labels, value in _metric_sum(text, "dynamo_lite_pd_sidecar_prefill_fallbacks_total").items():
            reason = labels.partition('reason="')[2].partition('"')[0] or "all"
            fallbacks[reason] = fallbacks.get(reason, 0) + int(value)
        for labels, value in _metric_sum(text, "dynamo_lite_pd_sidecar_requests_total").items():
            mode = labels.partition('mode="')[2].partition('"')[0]
            sidecar_modes[mode] = sidecar_modes.get(mode, 0) + int(value)
    return {"disagg_decisions": decisions, "prefill_fallbacks": {k: v for k, v in fallbacks.items() if v},
            "sidecar_requests": sidecar_modes, "roles": [engine.role for engine in stack.engines]}


def disaggregated(settings: DisaggSettings, run: Callable[[Any], Any],
                  started_stack: Callable[..., Any]) -> dict[str, Any]:
    """Both fleets on the same slice; the document `markdown` renders."""
    trace = Path(settings.trace)
    if not trace.exists():
        raise SystemExit(f"{trace}: no such trace (the Mooncake conversation trace; pass --trace PATH)")
    records = long_prompts(load_trace(trace), settings.min_input_tokens, settings.requests)
    if not records:
        raise SystemExit(f"{trace}: no request with at least {settings.min_input_tokens} input tokens")
    load = workload(settings, records)
    routing = settings.routing()
    num_blocks = engine_blocks(routing, load.arrivals)
    longest = max(len(a.prompt) for a in load.arrivals) + settings.max_tokens_cap
    engines = engine_flags(routing, num_blocks, max_model_len=max(8192, longest + 1))
    bytes_per_token = round(settings.kv_bytes_per_token * settings.scale)
    threshold = math.ceil(settings.disagg_min_uncached_tokens / settings.scale)
    kv_transfer = ["--kv-transfer-bandwidth-gbps", f"{settings.bandwidth_gbps:g}",
                   "--kv-bytes-per-token", str(bytes_per_token)]
    policy = replace(PICKER_DEFAULT, title="picker, defaults",
                     picker_flags=("--disagg-min-uncached-tokens", str(threshold)))
    block_ms = 1000 * 16 * bytes_per_token * 8 / (settings.bandwidth_gbps * 1e9) / settings.speedup
    progress(f"disaggregated: {load.description}; {settings.engines} engines x {num_blocks:,} blocks; KV transfer at "
             f"{settings.bandwidth_gbps:g} Gb/s, {settings.kv_bytes_per_token:,} bytes per real token "
             f"({bytes_per_token:,} per scaled token: {block_ms:.2f} ms per 16-token block at --speedup-ratio "
             f"{settings.speedup:g}); picker --disagg-min-uncached-tokens {threshold} "
             f"({settings.disagg_min_uncached_tokens:,} real tokens)")
    result: dict[str, Any] = {
        "settings": asdict(settings), "description": load.description, "requests": len(load.arrivals),
        "num_blocks": num_blocks, "engine_flags": engines.extra + ["--speedup-ratio", str(engines.speedup),
                                                                   "--num-blocks", str(num_blocks)],
        "kv_transfer_flags": kv_transfer, "kv_bytes_per_scaled_token": bytes_per_token,
        "transfer_ms_per_block": block_ms, "picker_flags": list(policy.picker_flags), "rows": [],
    }
    for fleet in FLEETS:
        fleet_engines = replace(engines, roles=_roles(fleet, settings.engines), kv_transfer=kv_transfer)
        row = real_run(routing, load, policy, fleet_engines, run, started_stack, measure=_measure)
        row["fleet"] = fleet
        result["rows"].append(row)
        progress(f"  {fleet:<14} TTFT p50 {_num(row['ttft_p50_ms'])} p99 {_num(row['ttft_p99_ms'])} ms  ITL p50 "
                 f"{_num(row['itl_p50_ms'], 2)} p99 {_num(row['itl_p99_ms'], 2)} p99.9 {_num(row['itl_p999_ms'])} mean "
                 f"{_num(row['itl_mean_ms'], 2)} ms  "
                 f"{row['output_tokens_per_s']:.0f} tok/s  ok {row['requests'] - row['errors']} failed {row['errors']}"
                 f"  decisions {row['disagg_decisions'] or '-'}  fallbacks {row['prefill_fallbacks'] or '-'}"
                 + (f" {row['error_samples']}" if row["errors"] else ""))
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    settings = result["settings"]
    k = settings["engines"]
    lines = [
        f"**Disaggregated fleets**: {result['description']}; {k} engines of {result['num_blocks']:,} blocks "
        f"(`{' '.join(result['engine_flags'])}`), aggregated and as {k // 2} prefill + {k - k // 2} decode (each "
        f"decode engine behind a P/D sidecar; `{' '.join(result['kv_transfer_flags'])}`: "
        f"{settings['bandwidth_gbps']:g} Gb/s and {settings['kv_bytes_per_token']:,} bytes per real token, "
        f"{result['transfer_ms_per_block']:.2f} ms per block); picker defaults with `{' '.join(result['picker_flags'])}`.",
        "",
        "| fleet | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99.9 ms | ITL mean ms | output tok/s | "
        "requests OK / failed | hit ratio | disaggregated / short / prefill busy | sidecar prefill fallbacks | "
        "engine shares (role) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        decisions = row.get("disagg_decisions") or {}
        roles = row.get("roles") or []
        shares = " ".join(f"{share:.2f}{'' if role == 'aggregated' else ' ' + role[0].upper()}"
                          for share, role in zip(row["engine_shares"], roles))
        title = "aggregated" if row["fleet"] == "aggregated" else f"{k // 2} prefill + {k - k // 2} decode"
        disagg = ("–" if row["fleet"] == "aggregated" else
                  f"{decisions.get('disaggregated', 0)} / {decisions.get('short', 0)} / {decisions.get('prefill_busy', 0)}")
        fallbacks = row.get("prefill_fallbacks") or {}
        lines.append(
            f"| {title} | {_num(row['ttft_p50_ms'])} | {_num(row['ttft_p99_ms'])} | {_num(row['itl_p50_ms'], 2)} | "
            f"{_num(row['itl_p99_ms'], 2)} | {_num(row['itl_p999_ms'], 1)} | {_num(row['itl_mean_ms'], 2)} | "
            f"{row['output_tokens_per_s']:.0f} | {row['requests'] - row['errors']} / "
            f"{row['errors']} | {row['hit_ratio']:.1%} | {disagg} | "
            f"{'–' if row['fleet'] == 'aggregated' else sum(fallbacks.values())} | {shares} |")
    lines.append("")
    return lines


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


__all__ = ["DisaggSettings", "FLEETS", "disaggregated", "long_prompts", "markdown", "workload"]
