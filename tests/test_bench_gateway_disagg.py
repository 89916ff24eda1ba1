"""Issue 38's benchmark part, without starting anything: `python -m bench.gateway --disaggregated`
selects it, the long-prompt slice and its timing, the disaggregated fleet's pool file and
engine flags, and the table (the run itself: `python -m bench.gateway --disaggregated --quick`)."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest

from bench import gateway, gateway_disagg
from bench.gateway_disagg import DisaggSettings
from bench.gateway_stack import EngineSettings, gateway_stack
from dynamo_lite.simulate.trace import TraceRecord

pytestmark = pytest.mark.unit


def test_disaggregated_is_a_part_of_its_own_and_its_flags_reach_the_settings() -> None:
    args = gateway.parse_args(["--disaggregated", "--disagg-engines", "6", "--kv-transfer-bandwidth-gbps", "50"])
    assert args.parts == ["disaggregated"]
    assert gateway.parse_args(["--parts", "disaggregated"]).parts == ["disaggregated"]
    assert "disaggregated" in gateway.parse_args([]).parts  # the full run has it
    settings = gateway.routing_settings(gateway.Settings(), args).disaggregated
    assert (settings.engines, settings.bandwidth_gbps) == (6, 50.0)
    assert gateway.routing_settings(gateway.Settings(), gateway.parse_args([])).disaggregated == DisaggSettings()
    for bad in (["--disagg-engines", "3"], ["--disaggregated", "--parts", "cost"], ["--disagg-seconds", "0"]):
        with pytest.raises(SystemExit):
            gateway.parse_args(bad)


def test_the_slice_is_the_long_prompts_in_trace_order_spread_over_the_stated_span() -> None:
    records = [TraceRecord(1000 * i, 10_000 if i % 2 else 1_000, 400, tuple(range(3 * i, 3 * i + 20)))
               for i in range(40)]
    long = gateway_disagg.long_prompts(records, 8192, 10)
    assert [r.timestamp_ms for r in long] == [1000 * i for i in range(1, 21, 2)]
    load = gateway_disagg.workload(DisaggSettings(span_s=9.0), long)
    assert load.bound_plan[0].at == 0 and load.bound_plan[-1].at == pytest.approx(9.0)
    body = orjson.loads(load.bound_plan[0].body)
    assert len(body["prompt"]) == 10_000 // 8 and body["max_tokens"] == 256  # 400 real tokens, capped
    assert body["stream"] is True


def test_the_disaggregated_fleet_has_sidecars_roles_and_kv_connectors() -> None:
    settings = EngineSettings(num_blocks=500, roles=("prefill", "decode"),
                              kv_transfer=["--kv-transfer-bandwidth-gbps", "200"])
    stack = gateway_stack(engines=2, engine_settings=settings, variants=())
    prefill, decode = stack.engines
    assert prefill.endpoint == prefill.address and decode.endpoint != decode.address
    entries = stack.pool()
    assert [(e["role"], e["address"], e["total_kv_blocks"]) for e in entries] == [
        ("prefill", prefill.address, 500), ("decode", decode.endpoint, 500)]
    assert entries[1]["kv_events_endpoint"] == f"tcp://127.0.0.1:{decode.events_port}"  # the engine's own
    flags = stack.process("engine1").argv
    config = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert "--kv-transfer-bandwidth-gbps" in flags
    assert f"http://{decode.address}" in stack.process("sidecar1").argv
    plain = gateway_stack(engines=2, engine_settings=EngineSettings(), variants=())
    assert "role" not in plain.pool()[0]
    assert "--kv-transfer-config" not in plain.process("engine0").argv
    for made in (stack, plain):
        shutil.rmtree(made.workdir, ignore_errors=True)  # made, never entered: nothing started
    with pytest.raises(ValueError):
        gateway_stack(engines=3, engine_settings=settings, variants=())


def test_the_table_has_a_row_per_fleet_with_the_picker_s_decisions() -> None:
    def row(fleet: str, roles: list[str], decisions: dict[str, int]) -> dict:
        return {"fleet": fleet, "roles": roles, "ttft_p50_ms": 100.0, "ttft_p99_ms": 900.0, "itl_p50_ms": 3.0,
                "itl_p99_ms": 9.0, "itl_p999_ms": 300.0, "itl_mean_ms": 4.0, "output_tokens_per_s": 1000.0,
                "requests": 10, "errors": 1, "hit_ratio": 0.1, "disagg_decisions": decisions,
                "prefill_fallbacks": {}, "engine_shares": [0.5, 0.5]}

    result = {"settings": {"engines": 2, "bandwidth_gbps": 200.0, "kv_bytes_per_token": 131072},
              "description": "a slice", "num_blocks": 100, "engine_flags": ["--speedup-ratio", "2"],
              "kv_transfer_flags": ["--kv-transfer-bandwidth-gbps", "200"], "transfer_ms_per_block": 0.34,
              "picker_flags": ["--disagg-min-uncached-tokens", "256"],
              "rows": [row("aggregated", ["aggregated"] * 2, {}),
                       row("disaggregated", ["prefill", "decode"], {"disaggregated": 7, "short": 2})]}
    lines = gateway_disagg.markdown(result)
    assert "200 Gb/s and 131,072 bytes per real token" in lines[0]
    assert lines[4].startswith("| aggregated | 100.0 | 900.0 | 3.00 | 9.00 | 300.0 | 4.00 | 1000 | 9 / 1 |")
    assert lines[5].startswith("| 1 prefill + 1 decode |") and "| 7 / 2 / 0 | 0 | 0.50 P 0.50 D |" in lines[5]
