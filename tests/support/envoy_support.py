"""Test support: a real Envoy (the library's `dynamo_lite.stack.Envoy`) as the tests run it, and
the test-only HTTP filters they put around the picker's.

    with envoy_process(picker_port=9002, failure_mode_allow=False) as envoy:
        httpx.post(f"{envoy.url}/v1/completions", ...)

The shipped file (deploy/envoy/envoy.yaml unless `config_file` or `base` says otherwise) with only
its ports, the picker's address, `failure_mode_allow`, the health-check pace and the filters
given changed, so the tests run the file that ships.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from dynamo_lite.stack import Envoy, EnvoySettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
# The variant with fallbacks: the engines listed in a cluster behind Envoy's override-host balancer.
FALLBACKS_CONFIG = ROOT / "deploy" / "envoy" / "envoy-fallbacks.yaml"


def envoy_settings(*, config_file: Path = DEPLOY_CONFIG, base: dict[str, Any] | None = None,
                   failure_mode_allow: bool = False, health_check_interval: str = "1s", **changes: Any) -> EnvoySettings:
    """The tests' Envoy: fail-closed, the picker checked every second, one worker, logging at
    $ENVOY_LOG_LEVEL (info); `changes` are further `EnvoySettings` fields."""
    return EnvoySettings(base=base if base is not None else yaml.safe_load(config_file.read_text()),
                         failure_mode_allow=failure_mode_allow, health_check_interval=health_check_interval,
                         log_level=os.environ.get("ENVOY_LOG_LEVEL", "info"), **changes)


def envoy_process(*, picker_port: int, engines: list[str] | None = None, **settings: Any) -> Envoy:
    """One Envoy on free loopback ports (a context manager; or `launch` / `wait_ready` / `stop`)."""
    return Envoy(envoy_settings(**settings), picker_port=picker_port, engines=engines)


def lua_filter(name: str, code: str) -> dict[str, Any]:
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code},
        },
    }


# A test stand-in for the gateway's subset hint: from request header x-test-subset (a list in the
# metadata) or x-test-subset-string (one comma-separated string), put before ext_proc.
SUBSET_LUA = """
function envoy_on_request(handle)
  local headers = handle:headers()
  local v = headers:get("x-test-subset")
  if v ~= nil then
    local list = {}
    for item in string.gmatch(v, "[^,]+") do table.insert(list, item) end
    handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", list)
    headers:remove("x-test-subset")
  end
  local s = headers:get("x-test-subset-string")
  if s ~= nil then
    handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", s)
    headers:remove("x-test-subset-string")
  end
end
"""
