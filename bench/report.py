"""bench/RESULTS.md from a run's results (results.json): method, targets, tables, profiles.

    python -m bench.report [results.json] [RESULTS.md]   # re-render without measuring

Throughput is the median over repetitions of each wrk run's requests per second, shown with
the min-max; latency is the median of the runs' p50. Ratios divide medians of the same run.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Issue 26's targets (issue 13's where it set none): per core, ours ÷ Dynamo 1.6.1 at c=64 in
# the same run, p50 at c=1 likewise.
REFERENCE_TARGETS = {"potential_loads": 0.8, "query_by_hash": 0.6, "loads": 0.7, "lifecycle": 0.7, "health": 0.9}
P50_TARGETS = {"health": 1.3, "loads": 1.3, "potential_loads": 1.0, "lifecycle": 1.3, "query_by_hash": 1.3}
FLAT_TARGET = 0.9  # /potential_loads req/s at the most active requests ÷ at the fewest
QUERY_FLAT_TARGET = 0.95  # /query_by_hash req/s at the most indexed pairs ÷ at the fewest
INDEX_MEMORY_TARGET = 1.0  # ours ÷ the reference, bytes per (block, worker) pair, each fill
TRACKER_MEMORY_TARGET = 2.0  # ours ÷ the reference, bytes per (request, hash) at the most requests
PAUSE_TARGET_MS = 5.0  # longest /query_by_hash latency while engines publish ~1M pairs
INGEST_TARGET = 300_000
# Ours' /events ingest ÷ the reference's ZMQ ingest, same run: one event per POST pays a request
# per event, which the engines' ZMQ batches do not.
EVENTS_VS_ZMQ_TARGETS = {"1 event per POST": 0.8}
EVENTS_VS_ZMQ_TARGET = 1.0  # any other /events shape (16 events per POST)
ZMQ_INGEST_TARGET = 1.0  # ours' ZMQ ingest ÷ the reference's, same run
# The pure cores (bench/cores.py), microseconds per call.
CORE_TARGETS_US = {
    "potential_loads, 512 hashes, 16 ranks": 40.0,
    "potential_loads, 512 hashes, 256 ranks": 100.0,
    "add + prefill_complete + free, 256 hashes": 30.0,
    "query_by_hash, 512 hashes, 16 workers": 30.0,
    # Issue 36: the scheduling cycle with what the picker computes around it, one core.
    "hashes + scheduling cycle, 4,096-token prompt, 8 ranks": 100.0,
    # Issue 28: what a configured API key may add to a request (bench/security.py).
    "API key check per request (keyed − open, native server, GET /loads)": 1.0,
}
INGEST_LATENCY_TARGET = 1.3  # /query_by_hash p50 while engines publish ÷ idle p50
# Issue 37: the selection service's lifecycle mix per core, ours ÷ Dynamo's at c=64 in the same
# run, and /select_and_reserve's own p50 at c=1 (4,096-token prompt, 16 workers).
SELECT_REFERENCE_TARGET = 0.8
SELECT_P50_TARGET_MS = 0.3
SELECT_ROUTE = "select_and_reserve"
# Scenario -> how its prompts travel; the first is the issue's, judged even when not measured.
SELECT_SCENARIOS = {"select_lifecycle": "token_ids", "select_lifecycle_hashes": "hash form"}
SELECT_OURS = {"ours": "--cost dynamo", "ours_ttft": "default cost"}
SELECT_ROLES = (*SELECT_OURS, "reference", "stub")
ZMQ_DETAIL_PREFIX = "ZMQ"

TITLES = {
    "health": "slot tracker `GET /health`",
    "loads": "slot tracker `GET /loads`",
    "potential_loads": "slot tracker `POST /potential_loads` (512-hash query)",
    "lifecycle": "slot tracker lifecycle mix `/add` → `/prefill_complete` → `/free`",
    "query_by_hash": "indexer `POST /query_by_hash` (512 hashes, 16 workers)",
}
# The section python -m bench.gateway's results go in, by hand; kept as it is on every rewrite.
GATEWAY_HEADING = "## Gateway: Envoy + endpoint picker\n"
WHY_MARKER = "<!-- WHY-TARGETS-NOT-MET: written by hand from the run above; python -m bench keeps this section -->"


class Table:
    def __init__(self, runs: list[dict[str, Any]]) -> None:
        self.runs = runs

    def select(self, scenario: str, role: str, connections: int, label: str | None = None) -> list[dict[str, Any]]:
        return [run for run in self.runs if run["scenario"] == scenario and run["role"] == role
                and run["connections"] == connections and (label is None or run["label"] == label)]

    def rps(self, scenario: str, role: str, connections: int, label: str | None = None) -> list[float]:
        return [run["rps"] for run in self.select(scenario, role, connections, label)]

    def median_rps(self, scenario: str, role: str, connections: int, label: str | None = None) -> float | None:
        values = self.rps(scenario, role, connections, label)
        return statistics.median(values) if values else None

    def median_p50_ms(self, scenario: str, role: str, connections: int, label: str | None = None) -> float | None:
        values = [run["p50_us"] / 1000 for run in self.select(scenario, role, connections, label)]
        return statistics.median(values) if values else None

    def labels(self, scenario: str) -> list[str]:
        seen: dict[str, None] = {}
        for run in self.runs:
            if run["scenario"] == scenario:
                seen.setdefault(run["label"], None)
        return list(seen)


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _fmt_rate(values: list[float]) -> str:
    if not values:
        return "—"
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:,.0f}"
    return f"{median:,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def _fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value >= target if higher_is_better else value <= target
    return "**met**" if met else "**not met**"


def targets(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    table = Table(data["runs"])
    rows: list[tuple[str, str, str]] = []
    ingest = _ingest_medians(data)
    for scenario, target in REFERENCE_TARGETS.items():
        ratio = _ratio(table.median_rps(scenario, "ours", 64), table.median_rps(scenario, "reference", 64))
        rows.append((f"{scenario}: ≥ {target}× the reference (c=64)", _fmt_ratio(ratio), _verdict(ratio, target)))
    for scenario in ("health", "loads", "potential_loads", "lifecycle", "query_by_hash"):
        ratio = _ratio(table.median_p50_ms(scenario, "ours", 1), table.median_p50_ms(scenario, "reference", 1))
        measured = "—" if ratio is None else (f"{ratio:.2f}× ({_fmt_ms(table.median_p50_ms(scenario, 'ours', 1))} "
                                              f"vs {_fmt_ms(table.median_p50_ms(scenario, 'reference', 1))} ms)")
        rows.append((f"{scenario}: p50 at c=1 ≤ {P50_TARGETS[scenario]}× the reference", measured,
                     _verdict(ratio, P50_TARGETS[scenario], higher_is_better=False)))
    for ranks in ("16", "256"):
        points = [label for label in table.labels("scale_potential_loads") if label.startswith(f"{ranks} ranks")]
        if len(points) >= 2:
            flat = _ratio(table.median_rps("scale_potential_loads", "ours", 64, points[-1]),
                          table.median_rps("scale_potential_loads", "ours", 64, points[0]))
            rows.append((f"/potential_loads flat in active requests, {ranks} ranks: "
                         f"req/s at {points[-1].split(', ')[1]} ÷ at {points[0].split(', ')[1]} ≥ {FLAT_TARGET}",
                         _fmt_ratio(flat), _verdict(flat, FLAT_TARGET)))
    small, large = _query_scaling(table)
    if small and large:
        flat = _ratio(large[1], small[1])
        rows.append((f"/query_by_hash flat in indexed blocks: req/s at {large[0]} ÷ at {small[0]} ≥ {QUERY_FLAT_TARGET}",
                     _fmt_ratio(flat), _verdict(flat, QUERY_FLAT_TARGET)))
    rows.extend(_memory_targets(data))
    reference_zmq = next((rate for (role, detail), rate in sorted(ingest.items())
                          if role == "reference" and detail.startswith(ZMQ_DETAIL_PREFIX)), None)
    for (role, detail), rate in sorted(ingest.items()):
        if role == "ours" and not detail.startswith(ZMQ_DETAIL_PREFIX):
            rows.append((f"/events ≥ {INGEST_TARGET:,} blocks/s ({detail})", f"{rate:,.0f} blocks/s",
                         _verdict(rate, INGEST_TARGET)))
            ratio = _ratio(rate, reference_zmq)
            wanted = EVENTS_VS_ZMQ_TARGETS.get(detail.split(",")[0], EVENTS_VS_ZMQ_TARGET)
            rows.append((f"/events ingest ≥ {wanted}× the reference's ZMQ ingest ({detail})",
                         "—" if ratio is None else f"{_fmt_ratio(ratio)} ({rate:,.0f} vs {reference_zmq:,.0f} blocks/s)",
                         _verdict(ratio, wanted)))
        elif role == "ours":
            ratio = _ratio(rate, ingest.get(("reference", detail)))
            rows.append((f"engine ingest over ZMQ ≥ {ZMQ_INGEST_TARGET}× the reference ({detail})",
                         f"{_fmt_ratio(ratio)} ({rate:,.0f} vs {ingest.get(('reference', detail), 0):,.0f} blocks/s)",
                         _verdict(ratio, ZMQ_INGEST_TARGET)))
    cores = {row["name"]: row["us"] for row in data.get("cores", [])}
    for name, limit_us in CORE_TARGETS_US.items():
        value = cores.get(name)
        rows.append((f"core: {name} ≤ {limit_us:g} µs", "—" if value is None else f"{value:.1f} µs",
                     _verdict(value, limit_us, higher_is_better=False)))
    rows.extend(_select_targets(table))
    if data.get("pauses"):
        rows.append(_pause_target(data["pauses"]))
    idle, busy = _ingest_latency(table, "ours")
    if idle and busy:
        ratio = _ratio(busy[1], idle[1])
        rows.append((f"`/query_by_hash` p50 at c=1 while engines publish ≤ {INGEST_LATENCY_TARGET}× idle ({busy[0]})",
                     f"{_fmt_ratio(ratio)} ({_fmt_ms(busy[1])} vs {_fmt_ms(idle[1])} ms)",
                     _verdict(ratio, INGEST_LATENCY_TARGET, higher_is_better=False)))
    return rows


def select_p50_ms(table: Table, scenario: str, role: str, route: str = SELECT_ROUTE) -> float | None:
    """The median over repetitions of one route's p50 at c=1 (timed by the Lua script per
    route, in the run's `extra`), in ms."""
    values = [run["extra"]["routes"][route]["p50_us"] / 1000 for run in table.select(scenario, role, 1)
              if route in run.get("extra", {}).get("routes", {})]
    return statistics.median(values) if values else None


def _select_targets(table: Table) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for index, (scenario, form) in enumerate(SELECT_SCENARIOS.items()):
        if index and not table.select(scenario, "ours", 64):
            continue
        reference = table.median_rps(scenario, "reference", 64)
        for role, cost in SELECT_OURS.items():
            ours = table.median_rps(scenario, role, 64)
            ratio = _ratio(ours, reference)
            measured = "—" if ratio is None else f"{_fmt_ratio(ratio)} ({ours:,.0f} vs {reference:,.0f} req/s)"
            rows.append((f"selection lifecycle per core ({form}, ours {cost}): ≥ {SELECT_REFERENCE_TARGET}× the "
                         "reference (c=64)", measured, _verdict(ratio, SELECT_REFERENCE_TARGET)))
        for role, cost in SELECT_OURS.items():
            p50 = select_p50_ms(table, scenario, role)
            reference_p50 = select_p50_ms(table, scenario, "reference")
            measured = "—" if p50 is None else (f"{p50:.3f} ms" + (f" (reference {reference_p50:.3f} ms)"
                                                                  if reference_p50 is not None else ""))
            rows.append((f"`/select_and_reserve` p50 at c=1, 4,096 tokens ({form}), 16 workers, ours {cost}: "
                         f"≤ {SELECT_P50_TARGET_MS} ms", measured,
                         _verdict(p50, SELECT_P50_TARGET_MS, higher_is_better=False)))
    return rows


def _memory_targets(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    index = {(row["fill"], row["role"]): row for row in data.get("index_memory", [])}
    for fill in dict.fromkeys(fill for fill, _ in index):
        ours, reference = index.get((fill, "ours")), index.get((fill, "reference"))
        ratio = _ratio(ours and ours["bytes_per_pair"], reference and reference["bytes_per_pair"])
        rows.append((f"index memory ≤ {INDEX_MEMORY_TARGET}× the reference per (block, worker) pair ({fill})",
                     "—" if ratio is None else (f"{_fmt_ratio(ratio)} ({ours['bytes_per_pair']:,.0f} vs "
                                                f"{reference['bytes_per_pair']:,.0f} B, {ours['pairs']:,} pairs)"),
                     _verdict(ratio, INDEX_MEMORY_TARGET, higher_is_better=False)))
    if not index:
        rows.append((f"index memory ≤ {INDEX_MEMORY_TARGET}× the reference per (block, worker) pair", "—",
                     _verdict(None, INDEX_MEMORY_TARGET)))
    tracker = data.get("tracker_memory", [])
    most = max((row["requests"] for row in tracker), default=None)
    at_most = {row["role"]: row for row in tracker if row["requests"] == most}
    ours, reference = at_most.get("ours"), at_most.get("reference")
    ratio = _ratio(ours and ours["bytes_per_request_hash"], reference and reference["bytes_per_request_hash"])
    rows.append((f"slot tracker memory ≤ {TRACKER_MEMORY_TARGET}× the reference per (request, hash)"
                 + (f" at {most:,} active requests" if most else ""),
                 "—" if ratio is None else (f"{_fmt_ratio(ratio)} ({ours['bytes_per_request_hash']:,.1f} vs "
                                            f"{reference['bytes_per_request_hash']:,.1f} B)"),
                 _verdict(ratio, TRACKER_MEMORY_TARGET, higher_is_better=False)))
    return rows


def _longest_pauses(pauses: list[dict[str, Any]], role: str, state: str) -> list[float]:
    return [row["max_ms"] for row in pauses if row["role"] == role and row["state"] == state and "max_ms" in row]


def _pause_target(pauses: list[dict[str, Any]]) -> tuple[str, str, str]:
    """The median over repetitions of the longest query latency while ingesting."""
    ours, reference = (_longest_pauses(pauses, role, "ingesting") for role in ("ours", "reference"))
    longest = statistics.median(ours) if ours else None
    measured = "—"
    if longest is not None:
        measured = f"{longest:.1f} ms" + (f" (repetitions: {', '.join(f'{v:.1f}' for v in ours)})"
                                          if len(ours) > 1 else "")
        if reference:
            measured += f"; reference {statistics.median(reference):.1f} ms"
    return (f"longest `/query_by_hash` pause while ingesting ~{pauses[0]['pairs'] / 1e6:.1f}M pairs "
            f"≤ {PAUSE_TARGET_MS:g} ms (median over repetitions)", measured,
            _verdict(longest, PAUSE_TARGET_MS, higher_is_better=False))


def _ingest_latency(table: Table, role: str) -> tuple[tuple[str, float] | None, tuple[str, float] | None]:
    """(label, median p50 ms) of `query_while_ingesting` idle, and while ingesting."""
    points = [(label, table.median_p50_ms("query_while_ingesting", role, 1, label))
              for label in table.labels("query_while_ingesting")]
    points = [(label, p50) for label, p50 in points if p50 is not None]
    idle = next((point for point in points if point[0] == "idle"), None)
    busy = next((point for point in points if point[0] != "idle"), None)
    return idle, busy


def _query_scaling(table: Table) -> tuple[tuple[str, float] | None, tuple[str, float] | None]:
    """(label, ours' median req/s at c=64) at the smallest and largest index measured."""
    points = [(label, table.median_rps("scale_query_by_hash", "ours", 64, label))
              for label in table.labels("scale_query_by_hash")]
    points += [(label, table.median_rps("query_by_hash", "ours", 64, label)) for label in table.labels("query_by_hash")]
    points = [(label, rps) for label, rps in points if rps is not None]
    if len(points) < 2:
        return None, None
    return points[0], points[-1]


def _ingest_medians(data: dict[str, Any]) -> dict[tuple[str, str], float]:
    grouped: dict[tuple[str, str], list[float]] = {}
    for row in data["ingest"]:
        grouped.setdefault((row["role"], row["detail"]), []).append(row["blocks_per_s"])
    return {key: statistics.median(values) for key, values in grouped.items()}


def render(data: dict[str, Any]) -> str:
    settings, meta = data["settings"], data["meta"]
    table = Table(data["runs"])
    out: list[str] = []
    add = out.append
    add("# Benchmark results\n")
    quick = " — **quick smoke run, not a measurement**" if settings["quick"] else ""
    add(f"Generated by `{meta.get('command', 'python -m bench')}` on {meta.get('started', '?')} UTC "
        f"(wall time {meta.get('wall_s', 0) / 60:.1f} min){quick}.")
    add(f"Machine: {meta.get('cpu', '?')}, {meta.get('cpus', '?')} CPUs, Linux {meta.get('kernel', '?')}, "
        f"Python {meta.get('python', '?')}, {meta.get('wrk', 'wrk')}; reference: {meta.get('reference', '?')}.\n")
    add("Method: each server runs alone on CPU 0 (`taskset -c 0`), wrk (one thread, Lua scripts in "
        "`bench/lua/`) on CPU 1. Every point is a warm-up of "
        f"{settings['warmup_s']:g} s, then a measured run of {settings['duration_s']:g} s; each repetition "
        "runs ours, the reference (Dynamo 1.6.1, `ai-dynamo-runtime==1.6.1` in its own venv) and the stub "
        "(`bench/stub.py`: our own server decoding each body and answering ours' bytes, canned, with no logic) "
        "one after the other. "
        f"{settings['repetitions']} repetitions for the main scenarios, {settings['scaling_repetitions']} for "
        "the scaling points, which run at c=64 only and without the stub (its cost does not depend on state). "
        "Numbers: median requests/s (min–max over repetitions), median p50 latency in ms; ratios are of "
        "medians from this run. The reference indexer is filled over ZMQ with the same blocks ours gets "
        "through `/events`; a sentinel block per worker confirms it applied them.\n")

    add("## Targets\n")
    add("| target | measured | verdict |")
    add("|---|---|---|")
    for target, measured, verdict in targets(data):
        add(f"| {target} | {measured} | {verdict} |")
    add("")

    add("## Routes (state: 16 ranks, 200 active requests of 256 hashes, half sharing a 128-hash prefix; "
        "indexer: 16 workers, tree from the Mooncake conversation trace)\n")
    add("| scenario | state | c | ours req/s | reference req/s | stub req/s | ours ÷ reference | ours ÷ stub "
        "| p50 ms ours / reference / stub |")
    add("|---|---|---|---|---|---|---|---|---|")
    for scenario, title in TITLES.items():
        for label in table.labels(scenario):
            for conns in (1, 64):
                if not table.select(scenario, "ours", conns, label):
                    continue
                med = {role: table.median_rps(scenario, role, conns, label) for role in ("ours", "reference", "stub")}
                p50 = " / ".join(_fmt_ms(table.median_p50_ms(scenario, role, conns, label))
                                 for role in ("ours", "reference", "stub"))
                add(f"| {title} | {label} | {conns} | {_fmt_rate(table.rps(scenario, 'ours', conns, label))} "
                    f"| {_fmt_rate(table.rps(scenario, 'reference', conns, label))} "
                    f"| {_fmt_rate(table.rps(scenario, 'stub', conns, label))} "
                    f"| {_fmt_ratio(_ratio(med['ours'], med['reference']))} "
                    f"| {_fmt_ratio(_ratio(med['ours'], med['stub']))} | {p50} |")
    add("")
    add("The lifecycle mix counts HTTP requests (one lifecycle = 3 requests); each `/prefill_complete` trails "
        "its `/add` by 2,048 lifecycles and each `/free` by 4,096, so up to ~4,096 requests are active. "
        "`/health` has no state.\n")

    _select_section(add, data, table)
    _scaling_section(add, table)
    _ingest_section(add, data)
    _ingest_latency_section(add, table)
    _memory_section(add, data)
    _cores_section(add, data)
    _tls_section(add, data)
    _profiles_section(add, data)

    add("## Why targets are not met\n")
    add(WHY_MARKER)
    add("")
    add("_To be completed from the profiles above and the analysis in [ANALYSIS.md](ANALYSIS.md)._\n")

    if data["notes"]:
        add("## Notes from the run\n")
        out.extend(f"- {note}" for note in data["notes"])
        add("")
    add("Raw numbers of every wrk run: [`results.json`](results.json). Reproduce: "
        "`python -m bench` (about 30 min; `python -m bench --help`).")
    return "\n".join(out) + "\n"


def _select_section(add: Callable[[str], None], data: dict[str, Any], table: Table) -> None:
    scenarios = {scenario: form for scenario, form in SELECT_SCENARIOS.items() if table.labels(scenario)}
    if not scenarios:
        return
    add("## Selection service: `/select_and_reserve` and the reservation lifecycle (16 workers, 4,096-token "
        "prompts)\n")
    add("| prompts as | c | ours --cost dynamo req/s | ours default cost req/s | reference req/s | stub req/s "
        "| ours ÷ reference (dynamo / default) | ours ÷ stub (dynamo) |")
    add("|---|---|---|---|---|---|---|---|")
    for scenario, form in scenarios.items():
        for conns in (1, 64):
            if not table.select(scenario, "ours", conns):
                continue
            med = {role: table.median_rps(scenario, role, conns) for role in SELECT_ROLES}
            rates = " | ".join(_fmt_rate(table.rps(scenario, role, conns)) for role in SELECT_ROLES)
            add(f"| {form} | {conns} | {rates} | {_fmt_ratio(_ratio(med['ours'], med['reference']))} / "
                f"{_fmt_ratio(_ratio(med['ours_ttft'], med['reference']))} "
                f"| {_fmt_ratio(_ratio(med['ours'], med['stub']))} |")
    add("")
    add("Requests per second of the whole mix: per selection, `POST /select_and_reserve`, "
        "`POST /reservations/{id}/prefill_complete` (no body), `POST /reservations/{id}/output_block` (`{}`) and "
        "`DELETE /reservations/{id}`, 4 requests (bench/lua/select_lifecycle.lua).\n")
    add("Each route's latency at one connection, p50 (p90) in ms, median over repetitions:\n")
    add("| prompts as | route | ours --cost dynamo | ours default cost | reference | stub |")
    add("|---|---|---|---|---|---|")
    for scenario, form in scenarios.items():
        for route in (SELECT_ROUTE, "prefill_complete", "output_block", "free"):
            cells = []
            for role in SELECT_ROLES:
                p50 = select_p50_ms(table, scenario, role, route)
                runs = [run["extra"]["routes"][route]["p90_us"] / 1000 for run in table.select(scenario, role, 1)
                        if route in run.get("extra", {}).get("routes", {})]
                cells.append("—" if p50 is None else f"{p50:.3f} ({statistics.median(runs):.3f})")
            add(f"| {form} | `{route}` | {' | '.join(cells)} |")
    add("")
    state = data["meta"].get("select_service", {})
    cached = ", ".join(f"{tokens} tokens: {count}" for tokens, count in state.get("cached", {}).items())
    add(f"State: 16 workers registered with `POST /workers`, each a vLLM engine publisher (`EnginePublisher`, "
        f"`WireFormat.VLLM`) every server subscribed to; the engines published {state.get('pairs', 0):,} (block, "
        f"worker) pairs, the prompts of the Mooncake conversation trace's first {state.get('trace_requests', 0):,} "
        f"requests (round-robin), before the first run. The {state.get('prompts', 0)} prompts are the first 4,096 "
        f"tokens of the requests that follow; the best worker caches, of a prompt (prompts): {cached or '—'}. "
        "Ours --cost dynamo and the reference pick alike (tests/test_select_service_differential.py). Each "
        "selection's prefill_complete and output_block trail it by 1,024 selections, its DELETE by 2,048, so "
        "~2,048 reservations stay booked; the suite deletes what a run leaves booked after it. The reference "
        "runs with `DYN_LOG=warn` (at its default level it logs a line per selection). The stub decodes each "
        "body and answers ours' bytes.\n")


def _scaling_section(add: Callable[[str], None], table: Table) -> None:
    if not (table.labels("scale_potential_loads") or table.labels("scale_query_by_hash")):
        return
    add("## Scaling (c=64, ours and the reference)\n")
    add("| route | state | ours req/s | reference req/s | ours ÷ reference | ours p50 ms |")
    add("|---|---|---|---|---|---|")
    rows = [("`/potential_loads` (512-hash query)", "scale_potential_loads", label)
            for label in table.labels("scale_potential_loads")]
    rows += [("`/query_by_hash` (512 hashes)", "scale_query_by_hash", label)
             for label in table.labels("scale_query_by_hash")]
    if table.labels("scale_query_by_hash"):
        rows += [("`/query_by_hash` (512 hashes), from the main scenario", "query_by_hash", label)
                 for label in table.labels("query_by_hash")]
    for title, scenario, label in rows:
        ours, reference = (table.median_rps(scenario, role, 64, label) for role in ("ours", "reference"))
        add(f"| {title} | {label} | {_fmt_rate(table.rps(scenario, 'ours', 64, label))} "
            f"| {_fmt_rate(table.rps(scenario, 'reference', 64, label))} | {_fmt_ratio(_ratio(ours, reference))} "
            f"| {_fmt_ms(table.median_p50_ms(scenario, 'ours', 64, label))} |")
    add("")


def _ingest_section(add: Callable[[str], None], data: dict[str, Any]) -> None:
    if not data["ingest"]:
        return
    add("## Ingest: `/events` and engines over ZMQ (fresh 64-block stored events from 16 workers)\n")
    add("| server | how | blocks/s, median (min–max) | blocks per repetition |")
    add("|---|---|---|---|")
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in data["ingest"]:
        grouped.setdefault((row["role"], row["detail"]), []).append(row)
    for (role, detail), rows in grouped.items():
        add(f"| {role} | {detail} | {_fmt_rate([row['blocks_per_s'] for row in rows])} | {rows[0]['blocks']:,} |")
    add("")
    add("Ours and the stub: documents built before the clock starts, posted over 4 keep-alive connections "
        "(each owning 4 workers, so each worker's events stay in order) by a minimal client (`bench/http_post.py`); "
        "time until the last answer. The reference: the same events as vLLM msgpack batches over ZMQ, one "
        "publisher per worker; time from the first message until a sentinel published last is applied "
        "(polled every 5 ms). Rows marked ZMQ: both indexers subscribe to the same kind of publishers "
        "(`bench/zmq_ingest.py`), ours and the reference in turn, each hashing every block's tokens "
        "itself. Workers are unregistered after each run.\n")


def _ingest_latency_section(add: Callable[[str], None], table: Table) -> None:
    labels = table.labels("query_while_ingesting")
    if not labels:
        return
    add("## `/query_by_hash` while engines publish (c=1, 256 hashes)\n")
    add("| state | server | req/s | p50 ms (median) | p99 ms, per repetition |")
    add("|---|---|---|---|---|")
    for label in labels:
        for role in ("ours", "reference"):
            runs = table.select("query_while_ingesting", role, 1, label)
            if runs:
                p99 = ", ".join(f"{run['p99_us'] / 1000:.2f}" for run in runs)
                add(f"| {label} | {role} | {_fmt_rate([run['rps'] for run in runs])} "
                    f"| {_fmt_ms(table.median_p50_ms('query_while_ingesting', role, 1, label))} | {p99} |")
    add("")
    add("16 engines (one vLLM publisher socket each) publish 64-block stored batches paced evenly at the "
        "stated rate from CPU 1 while wrk sends one query at a time; the server (CPU 0) subscribes to all "
        "16. The index holds the 16 workers' first prompts plus everything published so far.\n")


def _against_reference(rows: list[dict[str, Any]], point: str,
                       value: str) -> list[tuple[dict[str, Any], float | None]]:
    """Each row with ours' `value` ÷ the reference's at the same `point` (None on other rows)."""
    reference = {row[point]: row[value] for row in rows if row["role"] == "reference"}
    return [(row, _ratio(row[value], reference.get(row[point])) if row["role"] == "ours" else None) for row in rows]


def _memory_section(add: Callable[[str], None], data: dict[str, Any]) -> None:
    index, tracker = data.get("index_memory", []), data.get("tracker_memory", [])
    if index:
        add("## Index memory, both sides fed the same paced ZMQ stream\n")
        add("| fill | server | pairs | distinct blocks | RSS before → after | bytes per pair | bytes per distinct "
            "block | ours ÷ reference |")
        add("|---|---|---|---|---|---|---|---|")
        for row, ratio in _against_reference(index, "fill", "bytes_per_pair"):
            add(f"| {row['fill']} | {row['role']} | {row['pairs']:,} | {row['distinct_blocks']:,} "
                f"| {row['rss_before'] / 2**20:,.0f} → {row['rss_after'] / 2**20:,.0f} MiB "
                f"| {row['bytes_per_pair']:,.0f} | {row['bytes_per_block']:,.0f} | {_fmt_ratio(ratio)} |")
        add("")
        add("Each row is a fresh server process on CPU 0, subscribed to one ZMQ publisher per worker "
            "(`bench/memory.py`, `ReferenceFeed`, the same for both sides). RSS (the process and its children) "
            "after start-up and one sentinel sync, then after the fill, published in 16 parts with a sentinel "
            "sync after each so no burst waits in a queue. Events are 64-block `BlockStored` chains, 4 per "
            "prompt. With 8 workers, half of each worker's blocks are chains all 8 store (the same tokens, "
            "hence the same hashes) and half its own.\n")
    if tracker:
        add("## Slot tracker memory (16 workers, active requests of 256 hashes)\n")
        add("| server | active requests | RSS before → after | bytes per (request, hash) | KiB per request "
            "| ours ÷ reference |")
        add("|---|---|---|---|---|---|")
        for row, ratio in _against_reference(tracker, "requests", "bytes_per_request_hash"):
            add(f"| {row['role']} | {row['requests']:,} | {row['rss_before'] / 2**20:,.0f} → "
                f"{row['rss_after'] / 2**20:,.0f} MiB | {row['bytes_per_request_hash']:,.1f} "
                f"| {row['bytes_per_request'] / 1024:,.1f} | {_fmt_ratio(ratio)} |")
        add("")
        add("A fresh tracker per server, 16 workers registered and one request added and freed, then the same "
            "`/add` bodies to both over one keep-alive connection: half of the requests start with one of 20 "
            "shared 128-hash prefixes and end with 128 own hashes, half have 256 own hashes.\n")
    pauses = data.get("pauses", [])
    if pauses:
        add("## `/query_by_hash` pauses while ingesting (256 hashes, one query at a time)\n")
        add("| state | server | rep | queries | longest ms | p99.9 ms | p99 ms | p50 ms | seconds "
            "| ingest blocks/s | longest ms after publishing |")
        add("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in sorted(pauses, key=lambda row: (row["state"] != "idle", row["role"], row.get("rep", 1))):
            rate = f"{row['blocks_per_s']:,.0f}" if "blocks_per_s" in row else "—"
            after = _fmt_ms(row.get("max_after_publish_ms"))
            if "publish_s" in row:
                after += f" (published in {row['publish_s']:.2f} s)"
            add(f"| {row['state']} | {row['role']} | {row.get('rep', 1)} | {row['queries']:,} "
                f"| {_fmt_ms(row.get('max_ms'))} | {_fmt_ms(row.get('p999_ms'))} | {_fmt_ms(row.get('p99_ms'))} "
                f"| {_fmt_ms(row.get('p50_ms'))} | {row['seconds']:.1f} | {rate} | {after} |")
        add("")
        add(f"A fresh indexer per server, subscribed to 16 engines' publishers; a client process on CPU 1 sends "
            f"queries one at a time over a keep-alive connection (`bench/http_post.py`), idle for a while, then "
            f"while the engines publish ~{pauses[0]['pairs'] / 1e6:.1f}M pairs at full speed, until a sentinel "
            f"published last is applied (polled every 50 ms). The publishers queue the whole fill from CPU 1 first, "
            f"sharing it with the client; the last column is the longest latency after that.\n")


def _cores_section(add: Callable[[str], None], data: dict[str, Any]) -> None:
    if not data.get("cores"):
        return
    add("## Pure cores (no HTTP, `python -m bench.cores`, server CPU)\n")
    add("| hot path | µs per call |")
    add("|---|---|")
    for row in data["cores"]:
        add(f"| {row['name']} | {row['us']:.1f} |")
    add("")
    add("Each figure is the worst over 10 / 1k / 10k active requests of the best of five timings; the "
        "query is the slower of its i64 and u64 variants. The API key rows (`--only security`) time the "
        "native server's own path in process, a `GET /loads` answered without sockets, with and without "
        "keys (bench/security.py).\n")


def _tls_section(add: Callable[[str], None], data: dict[str, Any]) -> None:
    rows = data.get("security") or []
    if not rows:
        return
    add("## TLS on the heavy routes (ours, http vs https, `bench/security.py`)\n")
    add("| route | connections | http req/s | https req/s | https ÷ http | http p50 ms | https p50 ms |")
    add("|---|---|---|---|---|---|---|")
    by_key = {(row["route"], row["connections"], row["scheme"]): row for row in rows}
    for route, connections in sorted({(row["route"], row["connections"]) for row in rows}):
        plain, tls = by_key.get((route, connections, "http")), by_key.get((route, connections, "https"))
        if plain is None or tls is None:
            continue
        add(f"| `{route}` | {connections} | {plain['rps']:,.0f} | {tls['rps']:,.0f} | "
            f"{_fmt_ratio(_ratio(tls['rps'], plain['rps']))} | {plain['p50_us'] / 1000:.3f} | {tls['p50_us'] / 1000:.3f} |")
    add("")
    add("One run per point, keep-alive connections (the handshake is not counted); the key check's own "
        "cost is in the cores table above.\n")


def _profiles_section(add: Callable[[str], None], data: dict[str, Any]) -> None:
    if not data["profiles"]:
        return
    add("## Profiles of our server (py-spy, c=64)\n")
    add("Recorded during one extra wrk run per scenario (not a measured one; py-spy shares the client CPU). "
        "Shares are of samples in which the server was running Python code.\n")
    for profile in data["profiles"]:
        rps = profile.get("rps_while_profiled")
        add(f"### {profile['scenario']} — {profile['samples']:,} samples"
            f"{f', {rps:,.0f} req/s while profiled' if rps else ''}\n")
        add(f"Flamegraph: [`{profile['flamegraph']}`]({profile['flamegraph']}), collapsed stacks: "
            f"[`{profile['collapsed']}`]({profile['collapsed']}).\n")
        add("| own time | function | | including callees | function |")
        add("|---|---|---|---|---|")
        for own, inclusive in zip(profile["top_own"], profile["top_inclusive"]):
            add(f"| {own[1]:.1f} % | `{own[0]}` | | {inclusive[1]:.1f} % | `{inclusive[0]}` |")
        add("")


def write(path: Path, data: dict[str, Any]) -> None:
    """Render to `path`, keeping the text a person wrote under "Why targets are not met", and the
    gateway section (written from `python -m bench.gateway`, which `python -m bench` does not
    run) with every hand-written section after it, verbatim at the end."""
    text = render(data)
    if path.exists():
        old = path.read_text()
        kept = _why_section(old)
        if kept and "_To be completed" not in kept:
            text = text.replace(_why_section(text), kept)
        gateway = _gateway_section(old)
        if gateway:
            text = text.rstrip("\n") + "\n\n" + gateway.rstrip("\n") + "\n"
    path.write_text(text)


def _gateway_section(text: str) -> str:
    """From the gateway heading to the end: the rendered report never writes past it."""
    start = text.find(GATEWAY_HEADING)
    if start < 0 or (start > 0 and text[start - 1] != "\n"):
        return ""
    return text[start:]


def _why_section(text: str) -> str:
    """From the marker to the next second-level heading (or the end)."""
    start = text.find(WHY_MARKER)
    if start < 0:
        return ""
    end = text.find("\n## ", start)
    return text[start:] if end < 0 else text[start:end]


def main(argv: list[str] | None = None) -> None:
    import json

    args = sys.argv[1:] if argv is None else argv
    source = Path(args[0]) if args else Path(__file__).with_name("results.json")
    target = Path(args[1]) if len(args) > 1 else source.with_name("RESULTS.md")
    write(target, json.loads(source.read_text()))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
