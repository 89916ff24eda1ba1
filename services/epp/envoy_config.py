"""Envoy configurations for the picker, from the shipped `deploy/envoy/envoy-fallbacks.yaml`.

`python -m dynamo_lite.stack` and the tests start Envoy from that very file with their own ports,
picker address and engine list, so what ships is what runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from .protocol import ANSWER_ENDS_BY_ACCESS_LOG, ANSWER_ENDS_METADATA, ENGINE_HEADER

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
    return _hcm(config)["http_filters"]


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


@dataclass(frozen=True)
class PickerTls:
    """How Envoy's `ext_proc` cluster reaches a picker started with `--cert` (and `--client-ca`):
    it checks the picker's certificate against `ca` for the name `server_name`, and presents
    `cert`/`key` when the picker asks for a client certificate. Paths as Envoy will see them."""

    ca: str
    server_name: str
    cert: str | None = None
    key: str | None = None

    def transport_socket(self) -> dict[str, Any]:
        context: dict[str, Any] = {
            "alpn_protocols": ["h2"],  # gRPC is HTTP/2; gRPC servers refuse an ALPN list without it
            "validation_context": {"trusted_ca": {"filename": self.ca},
                                   "match_typed_subject_alt_names": [
                                       {"san_type": "DNS", "matcher": {"exact": self.server_name}}]},
        }
        if self.cert is not None and self.key is not None:
            context["tls_certificates"] = [{"certificate_chain": {"filename": self.cert},
                                            "private_key": {"filename": self.key}}]
        return {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": self.server_name, "common_tls_context": context}}


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
    picker_tls: PickerTls | None = None,
) -> dict[str, Any]:
    """A copy of `base` with these ports, picker address, fail mode and engines ("ip:port"), and
    TLS to the picker when `picker_tls` is given."""
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
    if picker_tls is not None:
        picker["transport_socket"] = picker_tls.transport_socket()
    if engines is not None:
        cluster(config, "engines")["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}}}
            for host, _, port in (engine.rpartition(":") for engine in engines)
        ]
    return config


EXT_PROC = "envoy.filters.http.ext_proc"


def observer_filter(deferred_close_timeout: str | None = None) -> dict[str, Any]:
    """A second ext_proc filter in observability mode that gets the response side (headers, the
    body STREAMED, trailers) and is never waited for: put it after the picker's filter, whose
    response side `split_response_side` turns off. Its stream finds the request's booking by
    `x-request-id`. `deferred_close_timeout`: how long Envoy keeps the stream once the request is
    done (None: Envoy's default, 5 s; shorter notices a client hang-up sooner, but a picker that
    lags that far behind loses the request's end)."""
    typed_config: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}},
        "observability_mode": True,  # Envoy sends and never waits for an answer
        "processing_mode": {
            "request_header_mode": "SEND",  # carries x-request-id: the stream finds its pick
            "request_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "STREAMED",
            "response_trailer_mode": "SEND",
        },
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb"]}},
    }
    if deferred_close_timeout is not None:
        typed_config["deferred_close_timeout"] = deferred_close_timeout
    return {"name": EXT_PROC + ".observer", "typed_config": typed_config}


# The picker's own filter with the response side off (the observer filter takes it).
REQUEST_SIDE_ONLY: dict[str, Any] = {
    "processing_mode": {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
}


def split_response_side(config: dict[str, Any], deferred_close_timeout: str | None = None) -> dict[str, Any]:
    """A copy of `config` whose picker filter keeps the request side only, with
    `observer_filter(...)` right after it for the response side (docs/gateway.md)."""
    config = copy.deepcopy(config)
    filters = http_filters(config)
    at = next(i for i, f in enumerate(filters) if f["name"] == EXT_PROC)
    filters[at]["typed_config"].update(copy.deepcopy(REQUEST_SIDE_ONLY))
    filters.insert(at + 1, observer_filter(deferred_close_timeout))
    return config


ACCESS_LOGGER = "envoy.access_loggers.http_grpc"
ACCESS_LOG_NAME = "dynamo-lite-epp"
# The access-log configuration's response side: the body STREAMED, each chunk held for the
# picker's answer, until the picker has seen the first one and closes its stream; no headers
# (the served engine comes with the first chunk's metadata, the status in the access log), no
# trailers.
FIRST_CHUNK_ONLY: dict[str, Any] = {
    "response_header_mode": "SKIP",
    "response_body_mode": "STREAMED",
    "response_trailer_mode": "SKIP",
}
# The picker sees no response headers there: Envoy names the engine that answered itself.
ENGINE_RESPONSE_HEADER: dict[str, Any] = {
    "header": {"key": ENGINE_HEADER, "value": "%UPSTREAM_HOST%"},
    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
}


def access_log_ends(config: dict[str, Any], *, flush_interval: str = "0.05s",
                    periodic_interval: str = "10s") -> dict[str, Any]:
    """A copy of `config` where the picker sees each answer's first body chunk only (the first
    token) and learns its end from Envoy's gRPC access log (docs/gateway.md): the picker's
    ext_proc filter sends the response body STREAMED and tells the picker, in its stream's gRPC
    metadata, that the access log reports the end; an `envoy.access_loggers.http_grpc` logger on
    the connection manager streams one entry per request to the picker's cluster; the route's
    virtual hosts add x-dynamo-lite-engine to answers themselves.

    `flush_interval`: how long Envoy batches entries, so how late a booking may be freed
    (0.05 s: a few entries per message at a few hundred requests/s). `periodic_interval`: an
    entry for every stream still running this often (the connection manager's
    access_log_flush_interval, for all its loggers), by which the picker tells a long answer
    from one whose end was lost (--access-log-silence-secs, 30 s, must stay above it)."""
    config = copy.deepcopy(config)
    ext_proc = http_filter(config, EXT_PROC)["typed_config"]
    ext_proc["processing_mode"].update(FIRST_CHUNK_ONLY)
    picker = ext_proc["grpc_service"]
    picker["initial_metadata"] = [{"key": ANSWER_ENDS_METADATA, "value": ANSWER_ENDS_BY_ACCESS_LOG}]
    hcm = _hcm(config)
    hcm.setdefault("access_log", []).append({
        "name": ACCESS_LOGGER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": ACCESS_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": copy.deepcopy(picker["envoy_grpc"])},
                "buffer_flush_interval": flush_interval,
            },
        },
    })
    hcm.setdefault("access_log_options", {})["access_log_flush_interval"] = periodic_interval
    for host in hcm["route_config"]["virtual_hosts"]:
        host.setdefault("response_headers_to_add", []).append(copy.deepcopy(ENGINE_RESPONSE_HEADER))
    return config


__all__ = ["ACCESS_LOGGER", "ACCESS_LOG_NAME", "ENGINE_RESPONSE_HEADER", "EXT_PROC", "FIRST_CHUNK_ONLY",
           "REQUEST_SIDE_ONLY",
           "access_log_ends", "PickerTls", "cluster", "configure", "http_filter", "http_filters",
           "observer_filter", "shipped_config", "split_response_side"]
