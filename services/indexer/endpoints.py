"""`--allowed-endpoints`: which engine endpoints `POST /register` may make the indexer connect to.

Without the flag any endpoint is taken, as in Dynamo. With it, an endpoint must match one rule:

* `10.0.0.0/8`, `fd00::/8`, `10.1.2.3`: a network or an address; matches `tcp://` endpoints
  whose host is an IP address in it.
* `*.engines.svc.cluster.local`, `vllm-*`: a host name pattern (`*` and `?` as in shell
  globs, case-insensitive); matches `tcp://` endpoints whose host is a name. Names are matched
  as written, not resolved: allow names only in zones whose records you control.
* either of the above followed by `:PORT` or `:LOW-HIGH`: the port must match too.
* `ipc:///run/vllm/*`: a whole-endpoint pattern, for `ipc://` and `inproc://` endpoints.

`EndpointRules` is the core: parsed once, one synchronous `check` per registration.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from dataclasses import dataclass
from typing import Final, Union

from dynamo_lite.base.errors import InvalidArgument

from .listeners import _TCP as TCP_ENDPOINT  # the form `validate_endpoint` accepts

_PORTS: Final = re.compile(r"^(.*):(\d{1,5})(?:-(\d{1,5}))?$")

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


@dataclass(frozen=True)
class EndpointRule:
    text: str  # as given, for the error message
    network: Network | None = None
    host_pattern: str | None = None
    endpoint_pattern: str | None = None
    ports: tuple[int, int] = (1, 65535)

    @classmethod
    def parse(cls, text: str) -> EndpointRule:
        """ValueError for a rule that is none of the forms in the module docstring."""
        rule = text.strip()
        if "://" in rule:
            return cls(rule, endpoint_pattern=rule)
        host, ports = rule, (1, 65535)
        if host.count(":") <= 1 or host.startswith("["):  # host:port, [v6]:port; a bare IPv6 has no port
            match = _PORTS.match(host)
            if match is not None:
                low = int(match.group(2))
                high = int(match.group(3)) if match.group(3) else low
                if not 1 <= low <= high <= 65535:
                    raise ValueError(f"allowed endpoint rule {text!r}: ports must be within 1..65535, low to high")
                host, ports = match.group(1), (low, high)
        host = host.strip("[]")
        if not host:
            raise ValueError(f"allowed endpoint rule {text!r}: no host")
        try:
            return cls(rule, network=ipaddress.ip_network(host, strict=False), ports=ports)
        except ValueError:
            pass
        if "/" in host or not re.fullmatch(r"[A-Za-z0-9.*?_-]+", host):
            raise ValueError(f"allowed endpoint rule {text!r}: expected a CIDR, an address, a host name pattern "
                             "(with an optional :port or :low-high) or a scheme://pattern")
        return cls(rule, host_pattern=host.lower(), ports=ports)

    def matches(self, endpoint: str, host: str | None, port: int) -> bool:
        if self.endpoint_pattern is not None:
            return fnmatch.fnmatchcase(endpoint, self.endpoint_pattern)
        if host is None or not self.ports[0] <= port <= self.ports[1]:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return self.host_pattern is not None and fnmatch.fnmatchcase(host.lower(), self.host_pattern)
        return self.network is not None and address in self.network


@dataclass(frozen=True)
class EndpointRules:
    rules: tuple[EndpointRule, ...]

    @classmethod
    def parse(cls, text: str) -> EndpointRules:
        """`--allowed-endpoints`: comma-separated rules; ValueError naming a bad one."""
        rules = tuple(EndpointRule.parse(part) for part in text.split(",") if part.strip())
        if not rules:
            raise ValueError("--allowed-endpoints lists no rule")
        return cls(rules)

    def check(self, endpoint: str, what: str = "endpoint") -> None:
        """InvalidArgument (400) naming the rules when `endpoint` matches none of them."""
        match = TCP_ENDPOINT.match(endpoint)
        host, port = (match.group(1).strip("[]"), int(match.group(2))) if match else (None, 0)
        if not any(rule.matches(endpoint, host, port) for rule in self.rules):
            allowed = ", ".join(rule.text for rule in self.rules)
            raise InvalidArgument(f"{what} `{endpoint}` is outside --allowed-endpoints ({allowed})")


__all__ = ["EndpointRule", "EndpointRules"]
