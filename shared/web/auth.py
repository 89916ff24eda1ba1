"""API keys: who may call which route (`--api-key`, `--read-api-key`).

Each route has an `Access` level: `OPEN` routes (`/health`, `/ready`, and `/metrics` with
`--public-metrics`) answer anyone; `READ` routes (the queries a gateway that only reads needs)
take a read-only key or a full key; `WRITE` routes (everything that changes state, and `/dump`,
which hands out the whole state) take a full key. A request proves its key with
`Authorization: Bearer KEY`.

`ApiKeys` is the core: plain data and one synchronous check, no I/O. The servers ask it only
when keys are configured; without keys no request runs any of this.

Keys are compared with `hmac.compare_digest` against every configured key, without stopping at
the first match, so the time a check takes says nothing about how much of a key was right, nor
which key matched.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from hmac import compare_digest
from pathlib import Path
from typing import Final

import orjson
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class Access(enum.IntEnum):
    """What a route asks of a request's key; a key's grant is the highest level it reaches."""

    OPEN = 0
    READ = 1
    WRITE = 2


BEARER: Final = b"bearer "
# RFC 6750 section 3: the challenge a refusal carries, with the reason when a key was sent.
CHALLENGE: Final = b'Bearer realm="dynamo_lite"'
INVALID_CHALLENGE: Final = b'Bearer realm="dynamo_lite", error="invalid_token"'
SCOPE_CHALLENGE: Final = b'Bearer realm="dynamo_lite", error="insufficient_scope"'

MISSING: Final = "missing"
INVALID: Final = "invalid"
READ_ONLY: Final = "read_only"


@dataclass(frozen=True)
class Refusal:
    """The answer to a request whose key does not reach its route's level."""

    status: int
    body: bytes
    challenge: bytes  # the `WWW-Authenticate` value
    reason: str  # MISSING, INVALID or READ_ONLY: the label of the refusal counter

    @property
    def header_pair(self) -> tuple[bytes, bytes]:
        return b"www-authenticate", self.challenge

    @property
    def header(self) -> bytes:
        """The raw header line, CRLF included, as the native server writes extra headers."""
        return b"www-authenticate: %s\r\n" % self.challenge


def _refusal(status: int, message: str, header: bytes, reason: str) -> Refusal:
    return Refusal(status, orjson.dumps({"error": message}), header, reason)


REFUSALS: Final = {
    MISSING: _refusal(401, "this route needs an API key: send `Authorization: Bearer <key>`", CHALLENGE, MISSING),
    INVALID: _refusal(401, "the API key is not valid", INVALID_CHALLENGE, INVALID),
    READ_ONLY: _refusal(403, "this API key may only read: this route needs a full API key", SCOPE_CHALLENGE,
                        READ_ONLY),
}


@dataclass
class ApiKeys:
    """The configured keys and what they were refused; `check` is the whole decision."""

    write_keys: tuple[bytes, ...]
    read_keys: tuple[bytes, ...] = ()
    public_metrics: bool = False
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))

    def __post_init__(self) -> None:
        self.replace(self.write_keys, self.read_keys)

    def replace(self, write_keys: tuple[bytes, ...], read_keys: tuple[bytes, ...]) -> None:
        """Take these keys instead (a rotation); ValueError, and nothing changed, for keys
        that cannot be used."""
        if not write_keys:
            raise ValueError("at least one full API key is needed (a read-only key alone would leave writes open)")
        for key in (*write_keys, *read_keys):
            if not key or key != key.strip() or b"\r" in key or b"\n" in key:
                raise ValueError("an API key must be non-empty, without spaces around it or line breaks")
        if set(write_keys) & set(read_keys):
            raise ValueError("a key cannot be both a full key and a read-only key")
        self.write_keys, self.read_keys = write_keys, read_keys
        self._keys = tuple((key, Access.WRITE) for key in self.write_keys) + tuple(
            (key, Access.READ) for key in self.read_keys
        )
        # The exact header a client sends (`Bearer KEY`): compared whole first, which spares
        # the parsing of `grant` on every request of a well-behaved client.
        self._headers = tuple((b"Bearer " + key, int(level)) for key, level in self._keys)

    @classmethod
    def from_texts(cls, write_keys: Iterable[str], read_keys: Iterable[str] = (), *,
                   public_metrics: bool = False) -> ApiKeys:
        return cls(tuple(key.encode() for key in write_keys), tuple(key.encode() for key in read_keys),
                   public_metrics)

    def grant(self, authorization: bytes | None) -> Access | None:
        """The level the `Authorization` header's key reaches; None when there is no bearer
        key, `Access.OPEN` when it matches no configured key."""
        if authorization is None or authorization[:7].lower() != BEARER:
            return None
        presented = authorization[7:].strip()
        granted = Access.OPEN
        for key, level in self._keys:  # every key, always: no early exit to time
            if compare_digest(presented, key) and level > granted:
                granted = level
        return granted

    def check(self, authorization: bytes | None, access: Access) -> Refusal | None:
        """None when a request with this `Authorization` header may call a route of `access`;
        else the refusal to answer, counted."""
        if access is Access.OPEN:
            return None
        if authorization is not None:
            matched = 0
            for header, level in self._headers:  # every key, always: no early exit to time
                if compare_digest(authorization, header) and level > matched:
                    matched = level
            if matched >= access:
                return None
        granted = self.grant(authorization)
        if granted is None:
            reason = MISSING
        elif granted is Access.OPEN:
            reason = INVALID
        elif granted < access:
            reason = READ_ONLY
        else:
            return None
        self.refused[reason] += 1
        return REFUSALS[reason]


class ApiKeysCollector(Collector):
    """`/metrics` view of the refusals: `dynamo_lite_http_auth_refusals_total{reason}`."""

    def __init__(self, api_keys: ApiKeys) -> None:
        self.api_keys = api_keys

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "dynamo_lite_http_auth_refusals",
            "requests refused for their API key: missing or invalid (401), read-only on a write route (403)",
            labels=["reason"],
        )
        for reason, count in self.api_keys.refused.items():
            family.add_metric([reason], count)
        yield family


def read_key_file(path: str) -> list[str]:
    """The keys of `--api-key-file`: one per line; blank lines and `#` comments are skipped, so
    a Kubernetes Secret mounted as a file can hold the old and the new key during a rotation."""
    keys = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def key_list(text: str) -> list[str]:
    """`--api-key` / `DYNAMO_LITE_API_KEY`: one key, or several separated by commas (a
    rotation: old and new both valid until every client has the new one)."""
    return [key.strip() for key in text.split(",") if key.strip()]


__all__ = ["Access", "ApiKeys", "ApiKeysCollector", "Refusal", "key_list", "read_key_file"]
