"""One endpoint of the picker's pool: one data-parallel rank of one engine, validated on creation.

`PoolEndpoint` is the value the pool file's entries become (`pool_file.parse_pool`) and the
picker routes to; its fields are the file's keys (see `pool_file`). The address checks
(`normalize_address`: "host:port", IPv6 in brackets, canonical form) and the ZMQ endpoint checks
(the indexer's rule for `kv_events_endpoint` / `replay_endpoint`) live here, as a bad field
raises `FieldError` naming it.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from dynamo_lite.base.integers import U32_MAX, U64_MODULUS

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_TENANT = "default"
PREFILL = "prefill"
DECODE = "decode"
AGGREGATED = "aggregated"
ROLES = (PREFILL, DECODE, AGGREGATED)

RankKey = tuple[int, int]
"""(worker_id, dp_rank): one rank of one engine."""


class FieldError(ValueError):
    """A bad value of one field of one endpoint (turned into a `PoolError` by `parse_pool`)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.detail = message


_HOST_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_ZMQ_TCP = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]\s]+):(\d{1,5})$")  # as the indexer checks


def normalize_address(address: str) -> str:
    """`address` ("host:port") in canonical form: IP literals as `ipaddress` prints them (IPv6 in
    brackets), host names lower-cased, the port without leading zeros. ValueError otherwise."""
    if not isinstance(address, str):
        raise ValueError(f"must be a string \"host:port\", got {show_value(address)}")
    if address != address.strip() or not address:
        raise ValueError(f"must be \"host:port\" without spaces, got {address!r}")
    if address.startswith("["):
        end = address.find("]")
        if end < 0 or address[end + 1:end + 2] != ":":
            raise ValueError(f"an IPv6 address must be written \"[addr]:port\", got {address!r}")
        host_text, port_text = address[1:end], address[end + 2:]
        try:
            host = f"[{ipaddress.IPv6Address(host_text)}]"
        except ValueError as exc:
            raise ValueError(f"{host_text!r} in {address!r} is not an IPv6 address ({exc})") from None
    else:
        host_text, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"must be \"host:port\", got {address!r} (no port)")
        if ":" in host_text:
            raise ValueError(f"an IPv6 address must be written \"[addr]:port\", got {address!r}")
        host = _normalize_host(host_text, address)
    if not _PORT.match(port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"the port of {address!r} must be a number in 1..65535")
    return f"{host}:{int(port_text)}"


def _normalize_host(host: str, address: str) -> str:
    if not host:
        raise ValueError(f"must be \"host:port\", got {address!r} (no host)")
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"{host!r} in {address!r} is neither an IP address nor a host name")
    if labels[-1].isdigit():
        raise ValueError(f"{host!r} in {address!r} is not a valid IPv4 address")
    return host.lower()


def _check_zmq_endpoint(value: str) -> None:
    """The indexer's rule: tcp://host:port (port 1..65535, not the bind-all `*`), ipc://path or
    inproc://name."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        raise ValueError(f"{value!r} has no scheme: expected tcp://host:port, ipc://path or inproc://name")
    if scheme == "tcp":
        match = _ZMQ_TCP.match(value)
        if match is not None and match.group(1) == "*":
            raise ValueError(
                f"{value!r} is the engine's bind address; give the address the indexer connects to "
                f"(tcp://<engine host>:{match.group(2)})"
            )
        if match is None or not 0 < int(match.group(2)) <= 65535:
            raise ValueError(f"{value!r} is not tcp://host:port with a port in 1..65535")
    elif scheme in ("ipc", "inproc"):
        if not rest:
            raise ValueError(f"{value!r}: empty {scheme} address")
    else:
        raise ValueError(f"{value!r}: the scheme must be tcp, ipc or inproc")


def show_value(value: Any) -> str:
    """A value as the file wrote it, for messages (YAML turns `yes`, `null`, `1e3` into non-strings)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_field(name: str, value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"must be an integer {what}, got {show_value(value)}")
    if not low <= value < high:
        raise FieldError(name, f"must be an integer {what}, got {value}")
    return value


def _string_field(name: str, value: Any) -> str:
    if not isinstance(value, str):
        hint = " (quote it in YAML)" if isinstance(value, (bool, int, float)) or value is None else ""
        raise FieldError(name, f"must be a string, got {show_value(value)}{hint}")
    if not value:
        raise FieldError(name, "must not be empty")
    return value


@dataclass(frozen=True, kw_only=True)
class PoolEndpoint:
    """One data-parallel rank of one engine, as the pool file lists it (validated on creation:
    a bad field raises ValueError naming it; the address is stored in canonical form)."""

    address: str
    worker_id: int
    dp_rank: int = 0
    model: str
    block_size: int
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    total_kv_blocks: int | None = None
    tenant_id: str = DEFAULT_TENANT
    lora_names: tuple[str, ...] = ()
    role: str = AGGREGATED

    def __post_init__(self) -> None:
        try:
            address = normalize_address(self.address)
        except ValueError as exc:
            raise FieldError("address", str(exc)) from None
        object.__setattr__(self, "address", address)
        _int_field("worker_id", self.worker_id, 0, U64_MODULUS, "in 0..2^64-1")
        # The slot tracker wants dp_start + dp_size <= 2^32 - 1.
        _int_field("dp_rank", self.dp_rank, 0, U32_MAX, "in 0..2^32-2")
        _string_field("model", self.model)
        _int_field("block_size", self.block_size, 1, U32_MAX + 1, "> 0")
        for name in ("kv_events_endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                _string_field(name, value)
                try:
                    _check_zmq_endpoint(value)
                except ValueError as exc:
                    raise FieldError(name, str(exc)) from None
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise FieldError("replay_endpoint", "needs a kv_events_endpoint (replay serves missed KV events)")
        _int_field("max_num_batched_tokens", self.max_num_batched_tokens, 1, U64_MODULUS, "> 0")
        if self.total_kv_blocks is not None:
            _int_field("total_kv_blocks", self.total_kv_blocks, 1, U64_MODULUS, "> 0")
        _string_field("tenant_id", self.tenant_id)
        if ":" in self.tenant_id:
            raise FieldError("tenant_id", f"must not contain ':' (the indexer refuses it), got {self.tenant_id!r}")
        names = self.lora_names
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise FieldError("lora_names", f"must be a list of strings, got {show_value(names)}")
        seen: set[str] = set()
        for name in names:
            if not isinstance(name, str) or not name:
                raise FieldError("lora_names", f"must hold non-empty strings, got {show_value(name)}")
            if name in seen:
                raise FieldError("lora_names", f"{name!r} is listed twice")
            if name == self.model:
                raise FieldError("lora_names", f"{name!r} is the endpoint's own model")
            seen.add(name)
        object.__setattr__(self, "lora_names", tuple(names))
        if self.role not in ROLES:
            raise FieldError("role", f"must be one of {', '.join(ROLES)}, got {show_value(self.role)}")

    @property
    def rank_key(self) -> RankKey:
        """(worker_id, dp_rank)."""
        return (self.worker_id, self.dp_rank)



__all__ = [
    "AGGREGATED", "DECODE", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_TENANT", "PREFILL", "ROLES", "FieldError",
    "PoolEndpoint", "RankKey", "normalize_address", "show_value",
]
