"""The benchmark suite's pure parts: reading wrk's result line, ranking profile samples, and
the report's targets and rendering (no servers, no wrk)."""

from __future__ import annotations

import pytest

from bench import report
from bench.profiling import top_functions
from bench.runner import Settings
from bench.wrk import WrkError, parse_wrk_output

pytestmark = pytest.mark.unit

WRK_OUTPUT = """Running 10s test @ http://127.0.0.1:8091
  1 threads and 64 connections
BENCH_RESULT {"duration_us":10000000,"requests":50000,"bytes":900000,"connect_errors":0,"read_errors":1,"write_errors":0,"status_errors":2,"timeouts":0,"p50_us":1200,"p90_us":2500,"p99_us":9000,"mean_us":1400.5}
"""


def test_wrk_result_line_is_parsed() -> None:
    result = parse_wrk_output(WRK_OUTPUT)
    assert result.rps == pytest.approx(5000.0)
    assert result.errors == 3
    assert (result.p50_us, result.p99_us) == (1200.0, 9000.0)


def test_missing_result_line_is_an_error() -> None:
    with pytest.raises(WrkError, match="no BENCH_RESULT"):
        parse_wrk_output("Running 10s test\nunable to connect to 127.0.0.1:1\n")


def test_profile_ranks_own_and_inclusive_time_without_the_event_loop() -> None:
    collapsed = "\n".join([
        "_run_code (<frozen runpy>:88);Runner.run (asyncio/runners.py:118);handle (shared/web/http.py:10);"
        "parse (shared/web/validation.py:5) 30",
        "_run_code (<frozen runpy>:88);Runner.run (asyncio/runners.py:118);handle (shared/web/http.py:12) 10",
        "_run_code (<frozen runpy>:88);Runner.run (asyncio/runners.py:118) 60",
    ])
    profile = top_functions(collapsed)
    assert profile["samples"] == 100
    assert profile["top_own"][0] == ("Runner.run (asyncio/runners.py)", 60.0)
    # Lines of one function merge; outer frames stay out of the inclusive ranking.
    assert dict(profile["top_inclusive"]) == {"handle (shared/web/http.py)": 40.0, "parse (shared/web/validation.py)": 30.0}


def _run(scenario: str, role: str, connections: int, rps: float, p50_us: float = 1000.0,
         label: str = "state") -> dict:
    return {"scenario": scenario, "label": label, "role": role, "connections": connections, "rep": 1,
            "rps": rps, "p50_us": p50_us, "p90_us": p50_us, "p99_us": p50_us, "errors": 0}


def _data(**extra: list) -> dict:
    runs = [
        _run("potential_loads", "ours", 64, 3000), _run("potential_loads", "reference", 64, 10000),
        _run("potential_loads", "stub", 64, 3100),
        _run("potential_loads", "ours", 1, 900, p50_us=300), _run("potential_loads", "reference", 1, 3000, p50_us=100),
    ]
    data = {"settings": Settings().__dict__, "meta": {}, "runs": runs, "ingest": [], "memory": [],
            "profiles": [], "notes": []}
    data.update(extra)
    return data


def test_targets_judge_ratios_from_medians() -> None:
    rows = {target: (measured, verdict) for target, measured, verdict in report.targets(_data())}
    assert rows["potential_loads: ≥ 0.8× the reference (c=64)"] == ("0.30×", "**not met**")
    assert rows["potential_loads: p50 at c=1 ≤ 1.0× the reference"][1] == "**not met**"
    assert rows["loads: ≥ 0.7× the reference (c=64)"] == ("—", "not measured")


def _index_row(fill: str, role: str, per_pair: float) -> dict:
    return {"fill": fill, "role": role, "workers": 8, "pairs": 1_000_000, "distinct_blocks": 562_500,
            "rss_before": 0, "rss_after": int(per_pair * 1_000_000), "fill_s": 2.0, "bytes_per_pair": per_pair,
            "bytes_per_block": per_pair * 1_000_000 / 562_500}


def _tracker_row(role: str, requests: int, per_hash: float) -> dict:
    return {"role": role, "requests": requests, "hashes": requests * 256, "rss_before": 0,
            "rss_after": int(per_hash * requests * 256), "bytes_per_request_hash": per_hash,
            "bytes_per_request": per_hash * 256}


def test_memory_and_ingest_targets() -> None:
    data = _data(
        index_memory=[_index_row("8 workers, half shared", "ours", 150.0)],
        tracker_memory=[_tracker_row("ours", 1_000, 40.0)],
        ingest=[{"role": "ours", "detail": "1 event per POST", "rep": rep, "blocks": 64_000, "seconds": 1.0,
                 "blocks_per_s": rate} for rep, rate in ((1, 250_000), (2, 350_000), (3, 310_000))],
    )
    rows = {target: (measured, verdict) for target, measured, verdict in report.targets(data)}
    assert rows["index memory ≤ 1.0× the reference per (block, worker) pair (8 workers, half shared)"] == (
        "—", "not measured")
    assert rows["slot tracker memory ≤ 2.0× the reference per (request, hash) at 1,000 active requests"][1] == (
        "not measured")
    assert rows["/events ≥ 300,000 blocks/s (1 event per POST)"] == ("310,000 blocks/s", "**met**")
    data["index_memory"] += [_index_row("8 workers, half shared", "reference", 75.0),
                             _index_row("1 worker", "ours", 90.0), _index_row("1 worker", "reference", 100.0)]
    data["tracker_memory"] += [_tracker_row("reference", 1_000, 16.0), _tracker_row("ours", 10_000, 30.0),
                               _tracker_row("reference", 10_000, 16.0)]
    data["pauses"] = [{"role": role, "state": state, "pairs": 1_000_000, "seconds": 2.0, "queries": 100,
                       "errors": 0, "max_ms": longest, "p99_ms": 1.0, "p50_ms": 0.1}
                      for role, state, longest in (("ours", "idle", 1.0), ("ours", "ingesting", 7.5),
                                                   ("reference", "ingesting", 80.0))]
    data["ingest"].append({"role": "reference", "detail": "ZMQ, 16 engines", "rep": 1, "blocks": 64_000,
                           "seconds": 1.0, "blocks_per_s": 300_000})
    data["cores"] = [{"name": "query_by_hash, 512 hashes, 16 workers", "us": 31.5}]
    rows = {target: (measured, verdict) for target, measured, verdict in report.targets(data)}
    assert rows["index memory ≤ 1.0× the reference per (block, worker) pair (8 workers, half shared)"] == (
        "2.00× (150 vs 75 B, 1,000,000 pairs)", "**not met**")
    assert rows["index memory ≤ 1.0× the reference per (block, worker) pair (1 worker)"][1] == "**met**"
    # Judged at the most active requests measured.
    assert rows["slot tracker memory ≤ 2.0× the reference per (request, hash) at 10,000 active requests"] == (
        "1.88× (30.0 vs 16.0 B)", "**met**")
    assert rows["longest `/query_by_hash` pause while ingesting ~1.0M pairs ≤ 5 ms (median over repetitions)"] == (
        "7.5 ms; reference 80.0 ms", "**not met**")
    assert rows["/events ingest ≥ 0.8× the reference's ZMQ ingest (1 event per POST)"] == (
        "1.03× (310,000 vs 300,000 blocks/s)", "**met**")
    assert rows["core: query_by_hash, 512 hashes, 16 workers ≤ 30 µs"] == ("31.5 µs", "**not met**")
    assert rows["core: potential_loads, 512 hashes, 16 ranks ≤ 40 µs"] == ("—", "not measured")
    text = report.render(data)
    assert "## Index memory, both sides fed the same paced ZMQ stream" in text
    assert "| 1 worker | ours | 1,000,000 | 562,500 | 0 → 86 MiB | 90 | 160 | 0.90× |" in text
    assert "| ours | 10,000 | 0 → 73 MiB | 30.0 | 7.5 | 1.88× |" in text
    assert "| ingesting | ours | 1 | 100 | 7.50 | — | 1.00 | 0.10 | 2.0 | — | — |" in text
    data["pauses"] += [{**data["pauses"][1], "rep": 2, "max_ms": 3.0}, {**data["pauses"][1], "rep": 3, "max_ms": 4.0}]
    rows = {target: (measured, verdict) for target, measured, verdict in report.targets(data)}
    assert rows["longest `/query_by_hash` pause while ingesting ~1.0M pairs ≤ 5 ms (median over repetitions)"] == (
        "4.0 ms (repetitions: 7.5, 3.0, 4.0); reference 80.0 ms", "**met**")


def test_old_results_without_the_memory_rows_still_render() -> None:
    data = _data()
    for key in ("index_memory", "tracker_memory", "pauses"):
        data.pop(key, None)
    rows = {target: verdict for target, _, verdict in report.targets(data)}
    assert rows["index memory ≤ 1.0× the reference per (block, worker) pair"] == "not measured"
    assert "## Index memory" not in report.render(data)


def test_rewriting_keeps_the_written_explanation(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    report.write(path, _data())
    text = path.read_text()
    assert report.WHY_MARKER in text and "3,000" in text
    path.write_text(text.replace("_To be completed from the profiles above and the analysis in "
                                 "[ANALYSIS.md](ANALYSIS.md)._", "uvicorn costs 70 us per request."))
    report.write(path, _data())
    assert "uvicorn costs 70 us per request." in path.read_text()


def test_rewriting_keeps_the_gateway_section_and_the_hand_written_ones_after_it_at_the_end(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    report.write(path, _data())
    written = path.read_text().replace("_To be completed from the profiles above and the analysis in "
                                       "[ANALYSIS.md](ANALYSIS.md)._", "uvicorn costs 70 us per request.")
    gateway = ("## Gateway: Envoy + endpoint picker\n\n`python -m bench.gateway`: 60 req/s per picker core.\n\n"
               "| policy | hit ratio |\n|---|---|\n| picker | 6.00% |\n\n"
               "## Issue 29: one replication design?\n\nMeasured by hand: keep both.\n")
    path.write_text(written.rstrip("\n") + "\n\n" + gateway)
    for _ in range(2):  # and stays as it is on every later rewrite
        report.write(path, _data())
        text = path.read_text()
        assert text.endswith("\n\n" + gateway)
        assert text.count("## Gateway") == 1 and "uvicorn costs 70 us per request." in text


def test_a_full_run_measures_the_key_check_and_tls_and_reports_both() -> None:
    """Issue 28: `python -m bench` (no --only) runs the security scenario; its key check row is
    judged against the ≤ 1 µs target and the TLS rows get their table."""
    from bench.__main__ import parse_args
    from bench.security import KEY_CHECK_ROW

    assert "security" in parse_args([]).selected
    tls = [{"route": "/potential_loads", "connections": 64, "scheme": scheme, "rps": rps, "p50_us": p50}
           for scheme, rps, p50 in (("http", 20_000.0, 2000.0), ("https", 15_000.0, 2600.0))]
    data = _data(cores=[{"name": KEY_CHECK_ROW, "us": 0.6}], security=tls)
    (row,) = [row for row in report.targets(data) if KEY_CHECK_ROW in row[0]]
    assert "≤ 1" in row[0] and "0.6" in row[1] and "not" not in row[2].lower(), row
    slow = [row for row in report.targets(_data(cores=[{"name": KEY_CHECK_ROW, "us": 1.4}]))
            if KEY_CHECK_ROW in row[0]]
    assert "not" in slow[0][2].lower(), slow
    text = report.render(data)
    assert "## TLS on the heavy routes" in text and "| `/potential_loads` | 64 | 20,000 | 15,000 |" in text


def test_a_script_s_extra_line_is_kept_with_the_result() -> None:
    result = parse_wrk_output(WRK_OUTPUT + 'BENCH_EXTRA {"steps":12,"timed":true}\n')
    assert result.extra == {"steps": 12, "timed": True}
    assert result.as_dict()["extra"] == {"steps": 12, "timed": True}
    assert "extra" not in parse_wrk_output(WRK_OUTPUT).as_dict()


def test_select_route_latencies_are_nearest_rank_percentiles_per_route() -> None:
    from bench.select_service_http import route_latencies

    lines = [f"select_and_reserve {value}" for value in range(100, 0, -1)] + ["free 7.5", "free 2.5", ""]
    summary = route_latencies("\n".join(lines))
    assert summary["select_and_reserve"] == {"count": 100, "p50_us": 50.0, "p90_us": 90.0, "p99_us": 99.0}
    assert summary["free"] == {"count": 2, "p50_us": 2.5, "p90_us": 7.5, "p99_us": 7.5}


def test_select_targets_use_the_mix_at_64_and_the_selection_s_own_p50_at_1() -> None:
    """Issue 37: ours ÷ the reference at c=64 (both costs), and /select_and_reserve's p50 at
    c=1 from the per-route latencies, not the mix's."""
    from bench.__main__ import parse_args

    assert {"select_lifecycle", "select_lifecycle_hashes"} <= parse_args(["--only", "select_service"]).selected

    def timed(role: str, select_us: float) -> dict:
        run = _run("select_lifecycle", role, 1, 5000, p50_us=60, label="16 workers")
        run["extra"] = {"steps": 10, "timed": True,
                        "routes": {"select_and_reserve": {"count": 10, "p50_us": select_us, "p90_us": select_us,
                                                          "p99_us": select_us},
                                   "free": {"count": 10, "p50_us": 50, "p90_us": 50, "p99_us": 50}}}
        return run

    runs = [_run("select_lifecycle", role, 64, rps, label="16 workers")
            for role, rps in (("ours", 9000), ("ours_ttft", 7000), ("reference", 10000), ("stub", 20000))]
    runs += [timed("ours", 280), timed("ours_ttft", 350), timed("reference", 200)]
    data = _data(runs=runs)
    rows = {target.split(": ≥")[0].split(": ≤")[0]: (measured, verdict) for target, measured, verdict in
            report.targets(data) if "select" in target}
    assert rows["selection lifecycle per core (token_ids, ours --cost dynamo)"] == (
        "0.90× (9,000 vs 10,000 req/s)", "**met**")
    assert rows["selection lifecycle per core (token_ids, ours default cost)"][1] == "**not met**"
    assert rows["`/select_and_reserve` p50 at c=1, 4,096 tokens (token_ids), 16 workers, ours --cost dynamo"] == (
        "0.280 ms (reference 0.200 ms)", "**met**")
    assert rows["`/select_and_reserve` p50 at c=1, 4,096 tokens (token_ids), 16 workers, ours default cost"][1] == \
        "**not met**"
    assert not any("hash form" in target for target in rows)  # not measured: no rows
    assert "| token_ids | `select_and_reserve` | 0.280 (0.280) | 0.350 (0.350) | 0.200 (0.200) | — |" in \
        report.render(data)
