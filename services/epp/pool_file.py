"""The pool file: which engines the picker routes to, read strictly.

The pool file is JSON or YAML: a list of endpoints, or `{"endpoints": [...]}`. One endpoint is
one data-parallel rank of one engine (`endpoint.PoolEndpoint`):

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

`parse_pool` / `load_pool` validate it whole (unknown keys, a key written twice, duplicate ranks,
an address shared by two workers (the dp ranks of one engine share its address), the ranks of
one worker disagreeing on model, tenant, block size or role, or not forming one range) and raise
`PoolError` naming the file, the line, the entry and the field.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from .endpoint import FieldError, PoolEndpoint, RankKey, show_value

_FIELDS = tuple(f.name for f in fields(PoolEndpoint))
_REQUIRED = ("address", "worker_id", "model", "block_size")


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


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # no PyYAML stubs: SafeLoader is Any
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
            raise PoolError(source, f"unknown top-level key {show_value(unknown[0])}: expected only 'endpoints'")
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
            raise PoolError(source, f"must be an object, got {show_value(entry)}", index=index, line=line_of(index))
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
        except FieldError as exc:
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


__all__ = ["PoolError", "load_pool", "parse_pool"]
