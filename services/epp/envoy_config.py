"""Envoy configurations for the picker, from the shipped `deploy/envoy/envoy-fallbacks.yaml`.

`python -m dynamo_lite.stack` and the tests start Envoy from that very file with their own ports,
picker address and engine list, so what ships is what runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from importlib import resources
from typing import Any

import yaml

SHIPPED = "envoy.yaml"  # package data: a symlink to deploy/envoy/envoy-fallbacks.yaml


def shipped_config() -> dict[str, Any]:
    """The shipped Envoy configuration (with fallbacks), as a dict."""
    text = (resources.files("dynamo_lite.epp") / SHIPPED).read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def http_filter(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in _hcm(config)["http_filters"] if f["name"] == name)


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    return _hcm(config)["http_filters"]  # type: ignore[no-any-return]


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


def configure(
    base: dict[str, Any],
    *,
    listen_host: str = "0.0.0.0",
    listen_port: int,
    admin_port: int,
    picker_host: str = "127.0.0.1",
    picker_port: int = 9002,
    failure_mode_allow: bool | None = None,
    engines: Sequence[str] | None = None,
    health_check_interval: str | None = None,
) -> dict[str, Any]:
    """A copy of `base` with these ports, picker address, fail mode and engines ("ip:port")."""
    config = copy.deepcopy(base)
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    config["static_resources"]["listeners"][0]["address"]["socket_address"] = {
        "address": listen_host, "port_value": listen_port}
    if failure_mode_allow is not None:
        http_filter(config, "envoy.filters.http.ext_proc")["typed_config"]["failure_mode_allow"] = failure_mode_allow
    picker = cluster(config, "ext_proc")
    endpoint = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = {"address": picker_host, "port_value": picker_port}
    if health_check_interval is not None:
        for check in picker.get("health_checks", []):
            check["interval"] = check["no_traffic_interval"] = health_check_interval
    if engines is not None:
        cluster(config, "engines")["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}}}
            for host, _, port in (engine.rpartition(":") for engine in engines)
        ]
    return config


__all__ = ["cluster", "configure", "http_filter", "http_filters", "shipped_config"]
