"""The endpoint pool: which engines the picker routes to, read from a file and kept registered.

The pool file is JSON or YAML: a list of endpoints, or `{"endpoints": [...]}`. One endpoint is
one data-parallel rank of one engine:

    endpoints:
      - address: 10.0.0.7:8000          # what Envoy connects to ("[::1]:8000" for IPv6)
        worker_id: 7                    # the engine's id in the slot tracker and the indexer (u64)
        dp_rank: 0                      # default 0
        model: llama-3.1-8b
        block_size: 16                  # the engine's --block-size / --page-size
        kv_events_endpoint: tcp://10.0.0.7:5557   # optional: the indexer subscribes to it
        replay_endpoint: tcp://10.0.0.7:5600      # optional, only with kv_events_endpoint
        max_num_batched_tokens: 8192    # the engine's per-step token budget (default 8192)
        total_kv_blocks: 30000          # optional: KV blocks per rank (vLLM's num_gpu_blocks); else
                                        # read from the engine's /metrics
        tenant_id: default
        lora_names: [sql-adapter]       # LoRA adapters the engine serves under other names
        role: decode                    # prefill | decode | aggregated (default): disaggregated
                                        # fleets (docs/disaggregation.md)

`parse_pool` / `load_pool` validate it whole (unknown keys, duplicate ranks, an address shared by
two workers (the dp ranks of one engine share its address), the
ranks of one worker disagreeing on model, tenant or block size, or not forming one range) and
raise `PoolError` naming the file, the line, the entry and the field.

`PoolRegistrar` registers endpoints with the slot tracker (one registration per worker: its ranks
as one range) and the indexer (one per rank, with the engine's KV-event endpoints), idempotently:
several pickers may share one pool, and a restarting picker registers again, so a 409 whose
registration is exactly ours counts as success. `PoolWatcher` keeps the pool in step with the
file (polling its mtime, size and inode, or on `reload()`), unregisters what left the file,
registers what came, and retries what a service that was down could not take.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import ipaddress
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import yaml

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient
from dynamo_lite.integers import U32_MAX, U64_MODULUS
from dynamo_lite.registrar import IndexedRank, Registrar, TrackerWorker

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_TENANT = "default"
PREFILL = "prefill"
DECODE = "decode"
AGGREGATED = "aggregated"
ROLES = (PREFILL, DECODE, AGGREGATED)

RankKey = tuple[int, int]
"""(worker_id, dp_rank): one rank of one engine."""


# ------------------------------------------------------------------------------------------------
# Endpoints
# ------------------------------------------------------------------------------------------------


class _FieldError(ValueError):
    """A bad value of one field of one endpoint (turned into a PoolError by parse_pool)."""

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
        raise ValueError(f"must be a string \"host:port\", got {_show(address)}")
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


def _show(value: Any) -> str:
    """A value as the file wrote it, for messages (YAML turns `yes`, `null`, `1e3` into non-strings)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_field(name: str, value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(name, f"must be an integer {what}, got {_show(value)}")
    if not low <= value < high:
        raise _FieldError(name, f"must be an integer {what}, got {value}")
    return value


def _string_field(name: str, value: Any) -> str:
    if not isinstance(value, str):
        hint = " (quote it in YAML)" if isinstance(value, (bool, int, float)) or value is None else ""
        raise _FieldError(name, f"must be a string, got {_show(value)}{hint}")
    if not value:
        raise _FieldError(name, "must not be empty")
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
            raise _FieldError("address", str(exc)) from None
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
                    raise _FieldError(name, str(exc)) from None
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise _FieldError("replay_endpoint", "needs a kv_events_endpoint (replay serves missed KV events)")
        _int_field("max_num_batched_tokens", self.max_num_batched_tokens, 1, U64_MODULUS, "> 0")
        if self.total_kv_blocks is not None:
            _int_field("total_kv_blocks", self.total_kv_blocks, 1, U64_MODULUS, "> 0")
        _string_field("tenant_id", self.tenant_id)
        if ":" in self.tenant_id:
            raise _FieldError("tenant_id", f"must not contain ':' (the indexer refuses it), got {self.tenant_id!r}")
        names = self.lora_names
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise _FieldError("lora_names", f"must be a list of strings, got {_show(names)}")
        seen: set[str] = set()
        for name in names:
            if not isinstance(name, str) or not name:
                raise _FieldError("lora_names", f"must hold non-empty strings, got {_show(name)}")
            if name in seen:
                raise _FieldError("lora_names", f"{name!r} is listed twice")
            if name == self.model:
                raise _FieldError("lora_names", f"{name!r} is the endpoint's own model")
            seen.add(name)
        object.__setattr__(self, "lora_names", tuple(names))
        if self.role not in ROLES:
            raise _FieldError("role", f"must be one of {', '.join(ROLES)}, got {_show(self.role)}")

    @property
    def rank_key(self) -> RankKey:
        """(worker_id, dp_rank)."""
        return (self.worker_id, self.dp_rank)


_FIELDS = tuple(f.name for f in fields(PoolEndpoint))
_REQUIRED = ("address", "worker_id", "model", "block_size")


# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------


class PoolError(ValueError):
    """A pool file that cannot be used: the message names the file, the line (YAML/JSON source
    line of the entry, when known), the entry index and the field."""

    def __init__(self, source: str, message: str, *, index: int | None = None, field: str | None = None,
                 line: int | None = None) -> None:
        where = source if line is None else f"{source}:{line}"
        parts = [where]
        if index is not None:
            parts.append(f"endpoints[{index}]")
        if field is not None:
            parts.append(field)
        super().__init__(": ".join(parts) + ": " + message)
        self.source = source
        self.index = index
        self.field = field
        self.line = line
        self.detail = message


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key written twice in one mapping (JSON and YAML parsers
    otherwise keep the last one silently; a doubled key in a pool file is a mistake)."""


def _construct_strict_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} is written twice (first on line {seen[key].line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        except TypeError:
            pass  # an unhashable key: construct_mapping reports it
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_strict_mapping)


def _load_document(text: str, source: str) -> tuple[Any, list[int | None]]:
    """The document, and the source line (1-based) of each endpoint entry where known.

    YAML first (it reads JSON too, and tells the lines); JSON that YAML refuses (tab-indented
    JSON: YAML allows no tabs there) is read as JSON. Both refuse a key written twice."""
    loader = _StrictLoader(text)
    loader.name = source  # marks in YAML errors name the file
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        yaml_problem = " ".join(str(exc).split())
        try:
            return json.loads(text, object_pairs_hook=_strict_json_object), []
        except ValueError as json_exc:
            if text.lstrip().startswith(("{", "[")):
                raise PoolError(source, f"not valid JSON: {json_exc}") from None
        raise PoolError(source, f"not valid YAML: {yaml_problem}") from None
    finally:
        loader.dispose()
    entries_node = node
    if isinstance(node, yaml.MappingNode):
        entries_node = next(
            (value for key, value in node.value if isinstance(key, yaml.ScalarNode) and key.value == "endpoints"),
            None,
        )
    lines: list[int | None] = []
    if isinstance(entries_node, yaml.SequenceNode):
        lines = [item.start_mark.line + 1 for item in entries_node.value]
    return data, lines


def _strict_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the key {key!r} is written twice in one object")
        result[key] = value
    return result


def parse_pool(text: str, *, source: str) -> list[PoolEndpoint]:
    """The endpoints of a pool file's text (JSON or YAML), in file order; PoolError if any entry
    or the whole is invalid. `source` names the file in messages. An empty list is a valid pool."""
    data, lines = _load_document(text, source)
    if data is None:
        raise PoolError(source, "the file is empty: write [] (or endpoints: []) for a pool without endpoints")
    if isinstance(data, dict):
        unknown = [key for key in data if key != "endpoints"]
        if unknown:
            raise PoolError(source, f"unknown top-level key {_show(unknown[0])}: expected only 'endpoints'")
        if "endpoints" not in data:
            raise PoolError(source, "expected a list of endpoints or an object with 'endpoints'")
        data = data["endpoints"]
        if not isinstance(data, list):
            raise PoolError(source, f"'endpoints' must be a list, got {type(data).__name__}", field="endpoints")
    elif not isinstance(data, list):
        raise PoolError(source, f"expected a list of endpoints or an object with 'endpoints', got {type(data).__name__}")

    def line_of(index: int) -> int | None:
        return lines[index] if index < len(lines) else None

    pool: list[PoolEndpoint] = []
    for index, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise PoolError(source, f"must be an object, got {_show(entry)}", index=index, line=line_of(index))
        for key in entry:
            if key not in _FIELDS:
                close = difflib.get_close_matches(str(key), _FIELDS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(_FIELDS)})"
                raise PoolError(source, f"unknown key{hint}", index=index, field=str(key), line=line_of(index))
        for key in _REQUIRED:
            if key not in entry:
                raise PoolError(source, "missing (required)", index=index, field=key, line=line_of(index))
        values = dict(entry)
        if isinstance(values.get("lora_names"), list):
            values["lora_names"] = tuple(values["lora_names"])
        try:
            pool.append(PoolEndpoint(**values))
        except _FieldError as exc:
            raise PoolError(source, exc.detail, index=index, field=exc.field, line=line_of(index)) from None
    _check_consistency(pool, source, line_of)
    return pool


def _check_consistency(pool: list[PoolEndpoint], source: str, line_of: Callable[[int], int | None]) -> None:
    by_address: dict[str, int] = {}
    by_rank: dict[RankKey, int] = {}
    first_of_worker: dict[int, int] = {}
    for index, ep in enumerate(pool):
        # The ranks of one data-parallel engine share its one HTTP server (vLLM picks the rank
        # from the X-data-parallel-rank header the picker sets); other endpoints may not.
        other = by_address.get(ep.address)
        if other is not None and pool[other].worker_id != ep.worker_id:
            raise PoolError(source, f"{ep.address} is also the address of endpoints[{other}] (another worker; "
                            "only the dp ranks of one worker may share an address)",
                            index=index, field="address", line=line_of(index))
        by_address.setdefault(ep.address, index)
        if ep.rank_key in by_rank:
            raise PoolError(
                source,
                f"worker_id {ep.worker_id} dp_rank {ep.dp_rank} is also endpoints[{by_rank[ep.rank_key]}]",
                index=index, field="dp_rank", line=line_of(index),
            )
        by_rank[ep.rank_key] = index
        first = first_of_worker.setdefault(ep.worker_id, index)
        for name in ("model", "block_size", "tenant_id", "role"):
            mine, theirs = getattr(ep, name), getattr(pool[first], name)
            if mine != theirs:
                raise PoolError(
                    source,
                    f"{mine!r} differs from {theirs!r} of endpoints[{first}], another rank of worker_id "
                    f"{ep.worker_id} (all ranks of one worker serve one model, tenant, block size and role)",
                    index=index, field=name, line=line_of(index),
                )
    ranks: dict[int, list[tuple[int, int]]] = {}
    for index, ep in enumerate(pool):
        ranks.setdefault(ep.worker_id, []).append((ep.dp_rank, index))
    for worker_id, listed in ranks.items():
        listed.sort()
        for (previous, _), (rank, index) in zip(listed, listed[1:]):
            if rank != previous + 1:
                raise PoolError(
                    source,
                    f"worker_id {worker_id} lists dp_ranks {', '.join(str(r) for r, _ in listed)}: the slot "
                    f"tracker registers a worker's ranks as one range, so list every rank from "
                    f"{listed[0][0]} to {listed[-1][0]}",
                    index=index, field="dp_rank", line=line_of(index),
                )


def load_pool(path: str | os.PathLike[str]) -> list[PoolEndpoint]:
    """`parse_pool` of a file; PoolError when it cannot be read either."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PoolError(source, f"cannot read the pool file: {exc}") from None
    return parse_pool(text, source=source)


# ------------------------------------------------------------------------------------------------
# Diff
# ------------------------------------------------------------------------------------------------


@dataclass
class PoolDiff:
    """What changed between two pools, by rank_key: `changed` holds (old, new) pairs of the
    same rank with some other field different."""

    added: list[PoolEndpoint] = field(default_factory=list)
    removed: list[PoolEndpoint] = field(default_factory=list)
    changed: list[tuple[PoolEndpoint, PoolEndpoint]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff(old: Iterable[PoolEndpoint], new: Iterable[PoolEndpoint]) -> PoolDiff:
    """Added, removed and changed endpoints from `old` to `new`, each in its pool's order."""
    before = {ep.rank_key: ep for ep in old}
    after = {ep.rank_key: ep for ep in new}
    return PoolDiff(
        added=[ep for key, ep in after.items() if key not in before],
        removed=[ep for key, ep in before.items() if key not in after],
        changed=[(before[key], ep) for key, ep in after.items() if key in before and before[key] != ep],
    )


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------


class PoolRegistrar(Registrar):
    """The `Registrar` by pool endpoint: give every rank of a worker together, as the slot
    tracker registers a worker's ranks as one range, built from the ranks given. It logs as the
    pool module."""

    def __init__(self, slot_tracker: AsyncSlotTrackerClient, indexer: AsyncIndexerClient) -> None:
        super().__init__(slot_tracker, indexer, logger=log)

    async def register(self, endpoints: Iterable[PoolEndpoint]) -> set[RankKey]:
        """Register `endpoints` with both services; the rank_keys now registered with both."""
        endpoints = list(endpoints)
        return await self.register_all(tracker_workers(endpoints), [indexer_rank(ep) for ep in endpoints])

    async def unregister(self, endpoints: Iterable[PoolEndpoint]) -> set[RankKey]:
        """Unregister `endpoints` from both services (an endpoint already gone is fine); the
        rank_keys now gone from both. The slot tracker knows whole workers only: any rank given
        unregisters its worker there (register the worker's remaining ranks again)."""
        endpoints = list(endpoints)
        return await self.unregister_all(tracker_workers(endpoints), [indexer_rank(ep) for ep in endpoints])

    async def known(self, endpoints: Iterable[PoolEndpoint]) -> bool:
        """True when both services currently list every endpoint, registered exactly as the pool
        says (the picker's `readiness`); False when they do not or cannot be asked."""
        endpoints = list(endpoints)
        return await self.known_all(tracker_workers(endpoints), [indexer_rank(ep) for ep in endpoints])


def tracker_workers(endpoints: Iterable[PoolEndpoint]) -> list[TrackerWorker]:
    """The slot tracker registrations of these endpoints: one per worker_id, its listed ranks as
    one range (from the lowest to the highest; parse_pool guarantees there is no gap)."""
    grouped: dict[int, list[PoolEndpoint]] = {}
    for ep in endpoints:
        grouped.setdefault(ep.worker_id, []).append(ep)
    result = []
    for worker_id, eps in grouped.items():
        low = min(ep.dp_rank for ep in eps)
        high = max(ep.dp_rank for ep in eps)
        first = eps[0]
        result.append(TrackerWorker(worker_id, first.model, first.tenant_id, first.block_size, low, high - low + 1))
    return result


def indexer_rank(ep: PoolEndpoint) -> IndexedRank:
    """The indexer registration of one endpoint."""
    return IndexedRank(ep.worker_id, ep.dp_rank, ep.model, ep.tenant_id, ep.block_size,
                       ep.kv_events_endpoint, ep.replay_endpoint)


# ------------------------------------------------------------------------------------------------
# Watching the file
# ------------------------------------------------------------------------------------------------

OnChange = Callable[[list[PoolEndpoint]], Any]


class Registrations(Protocol):
    """What `PoolWatcher` registers through: `PoolRegistrar` (both services), or the picker's
    own cores (`state.LocalRegistrar`, `--state in-process`)."""

    async def listed(self) -> tuple[set[TrackerWorker] | None, set[IndexedRank] | None]: ...

    async def register_tracker_worker(self, worker: TrackerWorker) -> bool: ...

    async def register_indexer_rank(self, rank: IndexedRank) -> bool: ...

    async def unregister_tracker_worker(self, worker: TrackerWorker) -> bool: ...

    async def unregister_indexer_rank(self, rank: IndexedRank) -> bool: ...


class PoolWatcher:
    """The current pool, kept in step with its file and registered with both services.

    `run()` (a task for the picker's lifetime) registers the pool, then every `interval`
    seconds: re-reads the file if its mtime, size or inode changed (or `reload()` was called:
    the CLI's SIGHUP), retries the registrations and unregistrations that did not go through,
    and every `verify_interval` seconds checks that both services still list what it
    registered (a service that restarted without its state gets it again).

    A valid new file: what left it, and the old form of what changed there, is unregistered;
    the rest registered; then the pool is swapped and the `on_change` callbacks called with it
    (a callback may be a coroutine function; its errors are logged). An invalid file is logged
    and ignored: the pool stays as it was. Nothing is unregistered when the watcher stops:
    several pickers may share the pool.

    `pool`, `by_address` and `ready` are read by the picker; treat `pool` and `by_address` as
    read-only (a change swaps them whole).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        registrar: Registrations,
        *,
        interval: float = 1.0,
        verify_interval: float = 10.0,
        on_change: Iterable[OnChange] = (),
        pool: Sequence[PoolEndpoint] | None = None,
    ) -> None:
        """`pool`: the pool already loaded from `path` (else it is loaded here: PoolError if the
        file is invalid, so a picker does not start on a broken file)."""
        self.path = Path(path)
        self.registrar = registrar
        self.interval = interval
        self.verify_interval = verify_interval
        self.on_change: list[OnChange] = list(on_change)
        """Called with each new pool once it is in force (append to it freely)."""
        self._file_key = self._stat_key()
        self._set_pool(list(pool) if pool is not None else load_pool(self.path))
        self.last_error: str | None = None  # the file's problem, while it has one
        self._tracker_done: set[TrackerWorker] = set()
        self._indexer_done: set[IndexedRank] = set()
        self._tracker_stale: set[TrackerWorker] = set()
        self._indexer_stale: set[IndexedRank] = set()
        self._ready = False
        self._reload = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._last_verify = time.monotonic()

    # --- what the picker reads ------------------------------------------------------------------

    @property
    def pool(self) -> list[PoolEndpoint]:
        return self._pool

    @property
    def by_address(self) -> dict[str, PoolEndpoint]:
        return self._by_address

    @property
    def ready(self) -> bool:
        """Every endpoint registered with both services at the last attempt."""
        return self._ready

    @property
    def registered(self) -> set[RankKey]:
        """The rank_keys of the pool registered with both services at the last attempt."""
        tracker = set().union(*(w.rank_keys for w in self._tracker_done)) if self._tracker_done else set()
        return {r.rank_key for r in self._indexer_done if r.rank_key in tracker}

    def add_on_change(self, callback: OnChange) -> None:
        self.on_change.append(callback)

    # --- driving it -----------------------------------------------------------------------------

    def reload(self) -> None:
        """Re-read the file at the next turn even if it looks unchanged (from a signal handler,
        the loop's thread, or another thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # Safe from a signal handler or another thread alike: the set runs on the loop.
            loop.call_soon_threadsafe(self._reload.set)
        else:
            self._reload.set()

    async def run(self) -> None:
        """Register the pool, then follow the file until cancelled."""
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - one bad turn must not end the watching
                log.exception("pool watcher: the turn failed; trying again in %.1f s", self.interval)
            try:
                await asyncio.wait_for(self._reload.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass

    async def refresh(self, force: bool = False) -> bool:
        """One turn: re-read the file if it changed (or `force`, or `reload()` was called), then
        catch up with registrations. True when a new pool was taken."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            force = force or self._reload.is_set()
            self._reload.clear()
            new_pool = self._read_if_changed(force)
            if new_pool is not None and new_pool == self._pool:
                new_pool = None
            await self._sync(new_pool)
        if new_pool is not None:
            await self._notify(new_pool)
        return new_pool is not None

    # --- internals ------------------------------------------------------------------------------

    def _set_pool(self, pool: list[PoolEndpoint]) -> None:
        self._pool = pool
        self._by_address = {ep.address: ep for ep in pool}

    def _stat_key(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)

    def _read_if_changed(self, force: bool) -> list[PoolEndpoint] | None:
        key = self._stat_key()
        if key is None:
            self._problem(f"{self.path}: cannot read the pool file (missing?)")
            self._file_key = None  # read it again whenever it is back
            return None
        if key == self._file_key and not force:
            return None
        self._file_key = key  # stat before reading: a write during the read shows at the next turn
        try:
            pool = load_pool(self.path)
        except PoolError as exc:
            self._problem(str(exc), again=True)
            return None
        if self.last_error is not None:
            log.info("%s: valid again", self.path)
        self.last_error = None
        return pool

    def _problem(self, message: str, again: bool = False) -> None:
        if again or message != self.last_error:
            log.error("%s; keeping the current pool of %d endpoints", message, len(self._pool))
        self.last_error = message

    async def _sync(self, new_pool: list[PoolEndpoint] | None) -> None:
        registrar = self.registrar
        if new_pool is not None:
            changes = diff(self._pool, new_pool)
            old_workers, old_ranks = set(tracker_workers(self._pool)), {indexer_rank(ep) for ep in self._pool}
            new_workers, new_ranks = set(tracker_workers(new_pool)), {indexer_rank(ep) for ep in new_pool}
            self._tracker_stale |= old_workers - new_workers
            self._indexer_stale |= old_ranks - new_ranks
            log.info(
                "%s: %d endpoints (%d added, %d removed, %d changed)", self.path, len(new_pool),
                len(changes.added), len(changes.removed), len(changes.changed),
            )
            pool = new_pool
        else:
            pool = self._pool
        want_workers = set(tracker_workers(pool))
        want_ranks = {indexer_rank(ep) for ep in pool}
        self._tracker_stale -= want_workers
        self._indexer_stale -= want_ranks
        self._tracker_done &= want_workers
        self._indexer_done &= want_ranks

        now = time.monotonic()
        replacing = bool(
            {w.identity for w in self._tracker_stale} & {w.identity for w in want_workers - self._tracker_done}
            or {r.identity for r in self._indexer_stale} & {r.identity for r in want_ranks - self._indexer_done}
        )
        if replacing or now - self._last_verify >= self.verify_interval:
            # What the services hold: a replacement another picker already made is not undone,
            # and a registration a restarted service lost is made again.
            self._last_verify = now
            tracker_listed, indexer_listed = await registrar.listed()
            if tracker_listed is not None:
                self._tracker_done = (self._tracker_done & tracker_listed) | (want_workers & tracker_listed)
                wanted_ids = {w.identity for w in want_workers & tracker_listed}
                self._tracker_stale = {w for w in self._tracker_stale if w.identity not in wanted_ids}
            if indexer_listed is not None:
                self._indexer_done = (self._indexer_done & indexer_listed) | (want_ranks & indexer_listed)
                wanted_rank_ids = {r.identity for r in want_ranks & indexer_listed}
                self._indexer_stale = {r for r in self._indexer_stale if r.identity not in wanted_rank_ids}

        # Unregister first: a changed worker's old registration is in the way of its new one.
        stale_workers, stale_ranks = list(self._tracker_stale), list(self._indexer_stale)
        if stale_workers or stale_ranks:
            results = await asyncio.gather(
                *(registrar.unregister_tracker_worker(w) for w in stale_workers),
                *(registrar.unregister_indexer_rank(r) for r in stale_ranks),
            )
            self._tracker_stale -= {w for w, ok in zip(stale_workers, results[:len(stale_workers)]) if ok}
            self._indexer_stale -= {r for r, ok in zip(stale_ranks, results[len(stale_workers):]) if ok}
            # Unregistering goes by identity: whatever was registered under it is gone.
            gone_workers = {w.identity for w in stale_workers} - {w.identity for w in self._tracker_stale}
            gone_ranks = {r.identity for r in stale_ranks} - {r.identity for r in self._indexer_stale}
            self._tracker_done = {w for w in self._tracker_done if w.identity not in gone_workers}
            self._indexer_done = {r for r in self._indexer_done if r.identity not in gone_ranks}
        blocked_workers = {w.identity for w in self._tracker_stale}
        blocked_ranks = {r.identity for r in self._indexer_stale}
        todo_workers = [w for w in want_workers - self._tracker_done if w.identity not in blocked_workers]
        todo_ranks = [r for r in want_ranks - self._indexer_done if r.identity not in blocked_ranks]
        if todo_workers or todo_ranks:
            results = await asyncio.gather(
                *(registrar.register_tracker_worker(w) for w in todo_workers),
                *(registrar.register_indexer_rank(r) for r in todo_ranks),
            )
            newly_workers = {w for w, ok in zip(todo_workers, results[:len(todo_workers)]) if ok}
            newly_ranks = {r for r, ok in zip(todo_ranks, results[len(todo_workers):]) if ok}
            for w in sorted(newly_workers, key=lambda w: w.identity):
                log.info("registered %s with the slot tracker", w.describe())
            for r in sorted(newly_ranks, key=lambda r: r.identity):
                log.info("registered %s with the indexer%s", r.describe(),
                         f" (KV events from {r.endpoint})" if r.endpoint else "")
            self._tracker_done |= newly_workers
            self._indexer_done |= newly_ranks

        if new_pool is not None:
            self._set_pool(new_pool)
        self._ready = want_workers <= self._tracker_done and want_ranks <= self._indexer_done

    async def _notify(self, pool: list[PoolEndpoint]) -> None:
        for callback in list(self.on_change):
            try:
                result = callback(pool)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - a callback's bug must not stop the watcher
                log.exception("pool on_change callback %r failed", callback)


__all__ = [
    "IndexedRank",
    "PoolDiff",
    "PoolEndpoint",
    "PoolError",
    "PoolRegistrar",
    "PoolWatcher",
    "Registrations",
    "TrackerWorker",
    "diff",
    "indexer_rank",
    "load_pool",
    "normalize_address",
    "parse_pool",
    "tracker_workers",
]
