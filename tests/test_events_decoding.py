"""The events document is declared once (`WireSection` and the structs under it): msgspec decodes
bodies against the declaration, and `explain_events_document` walks a refused document against
the same declaration to name the problem. For any body: msgspec refuses exactly what the walk
explains, and the two readers (bytes and decoded JSON) give the same events or the same error."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.base.errors import InvalidShape, ServiceError
from dynamo_lite.indexer.protocols import decode_events_document, explain_events_document, parse_events_document
from dynamo_lite.web.validation import decode_json

pytestmark = pytest.mark.unit

U64 = 2**64 - 1
I64_MIN = -(2**63)

edge_ints = st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64, U64 + 1, -1, I64_MIN, I64_MIN - 1])
small = st.integers(min_value=0, max_value=2**20)
hashes = st.one_of(st.integers(min_value=0, max_value=U64), st.integers(min_value=I64_MIN, max_value=-1))
out_of_range = st.sampled_from([U64 + 1, I64_MIN - 1, 2**70, -(2**70)])
# A key added to some object of the document, with a value that makes sense for it.
PLAUSIBLE_ADDITIONS = {"dp_rank": 3, "removed": {"block_hashes": []}, "stored": {"blocks": []}, "cleared": None,
                       "error": "boom", "extra": 1}
# What a single fault puts in place of a value. Copied each time: a `[]` or `{}` shared between
# examples would collect what later "add" faults put into it, until one contained itself (a
# self-referential document: a stack overflow in `_places`, seen once).
faults = st.one_of(st.sampled_from([None, True, False, 1.0, "7", [], {}, 1e30, "cleared"]).map(copy.deepcopy),
                   edge_ints)


def _optional(key: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(st.just({}), value.map(lambda v: {key: v}))


blocks = st.lists(
    st.fixed_dictionaries({"block_hash": hashes, "tokens_hash": hashes}, optional={"mm_extra_info": st.none()}),
    max_size=4,
)
stored = st.fixed_dictionaries({"blocks": blocks},
                               optional={"parent_hash": st.one_of(st.none(), hashes, hashes), "start_position": st.none()})
removed = st.fixed_dictionaries({"block_hashes": st.lists(hashes, max_size=4)})
data = st.one_of(
    st.just("cleared"),
    st.just({"cleared": None}),
    stored.map(lambda v: {"stored": v}),
    removed.map(lambda v: {"removed": v}),
)
ranks = st.sampled_from([0, 1, 7])
router_event = st.tuples(
    st.fixed_dictionaries({"worker_id": small, "event": st.tuples(
        st.fixed_dictionaries({"event_id": small, "data": data}), _optional("dp_rank", ranks),
    ).map(lambda t: {**t[0], **t[1]})}),
    _optional("dp_rank", ranks),
    _optional("storage_tier", st.sampled_from(["device", "host_pinned", "disk", "external"])),
).map(lambda t: {**t[0], **t[1], **t[2]})
valid_documents = st.dictionaries(
    st.sampled_from(["m:default", "meta/llama:8b:t", "m:"]),
    st.fixed_dictionaries({"block_size": small, "events": st.lists(router_event, min_size=1, max_size=3)}),
    min_size=1, max_size=2,
)


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `value` (keys and indexes)."""
    places = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            places += _places(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            places += _places(item, (*path, index))
    return places


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


@st.composite
def documents(draw: st.DrawFn) -> Any:
    """A valid document, or one with a single fault: a value replaced, a key dropped, a key
    added, a partition key without a colon."""
    document = draw(valid_documents)
    kind = draw(st.sampled_from(["none", "replace", "replace", "replace", "drop", "add", "add", "key"]))
    if kind == "none":
        return document
    if kind == "key":
        return {key.replace(":", "") or "x": section for key, section in document.items()}
    places = _places(document)
    if kind == "add":
        places = [path for path in places if isinstance(_at(document, path), dict)]
    path = draw(st.sampled_from(places))
    if kind == "add":
        key = draw(st.sampled_from(sorted(PLAUSIBLE_ADDITIONS)))
        _at(document, path)[key] = draw(st.one_of(st.just(PLAUSIBLE_ADDITIONS[key]).map(copy.deepcopy), faults))
        return document
    if not path:
        return draw(faults) if kind == "replace" else document
    parent = _at(document, path[:-1])
    last = path[-1]
    if kind == "replace":
        # An integer is replaced by an integer at the edges of its range as often as by another type.
        is_int = type(parent[last]) is int
        parent[last] = draw(st.one_of(out_of_range, edge_ints, faults) if is_int else faults)
    elif isinstance(parent, dict):
        del parent[last]
    return document


def outcome(parse: Any) -> Any:
    try:
        return ("ok", parse())
    except ServiceError as exc:
        return (type(exc).__name__, exc.message)


@settings(max_examples=1500, deadline=None)
@given(documents())
def test_msgspec_refuses_exactly_what_the_declaration_walk_explains(document: Any) -> None:
    assert_readers_agree(document)


def assert_readers_agree(document: Any) -> None:
    body = json.dumps(document).encode()
    decoded = outcome(lambda: decode_events_document(body))
    assert decoded == outcome(lambda: parse_events_document(decode_json(body)))
    try:
        explain_events_document(decode_json(body))  # as JSON reads it: orjson makes 2**64 a float
        explanation = None
    except InvalidShape as problem:
        explanation = problem.message
    if decoded[0] == "ok":
        assert explanation is None
    else:
        assert decoded == ("InvalidShape", explanation)


@pytest.mark.parametrize("body", [b"", b"{", b"[1]", b'{"m:d": {"block_size": 16, "events": []}} x',
                                  b'{"m:d": {"block_size": 16, "events": [], "block_size": 8}}', b"\xff"])
def test_bodies_that_are_not_documents(body: bytes) -> None:
    assert outcome(lambda: decode_events_document(body)) == outcome(lambda: parse_events_document(decode_json(body)))


def _one_event(**changes: Any) -> dict[str, Any]:
    inner = {"event_id": 1, "data": {"stored": {"parent_hash": 5, "blocks": [{"block_hash": 1, "tokens_hash": -2}]}}}
    event: dict[str, Any] = {"worker_id": 3, "event": inner}
    for key, value in changes.items():
        if key.startswith("inner_"):
            inner[key.removeprefix("inner_")] = value
        elif key.startswith("data_"):
            inner["data"][key.removeprefix("data_")] = value
        elif key == "parent_hash":
            inner["data"]["stored"]["parent_hash"] = value
        else:
            event[key] = value
    return {"m:default": {"block_size": 16, "events": [event]}}


@pytest.mark.parametrize("document", [
    _one_event(),
    _one_event(data_removed={"block_hashes": []}),  # two kinds of data at once
    _one_event(data_cleared=None),
    _one_event(data_extra=1),
    _one_event(inner_data={"removed": {"block_hashes": [-1, 2**64 - 1]}, "cleared": None}),
    _one_event(inner_data={}),
    _one_event(inner_data={"cleared": None}),
    _one_event(inner_data={"cleared": 0}),
    _one_event(parent_hash=2**64), _one_event(parent_hash=-(2**63) - 1), _one_event(parent_hash=-(2**63)),
    _one_event(worker_id=2**64), _one_event(worker_id=2**64 - 1), _one_event(inner_event_id=2**64),
    _one_event(dp_rank=2, inner_dp_rank=3), _one_event(dp_rank=2, inner_dp_rank=2), _one_event(dp_rank=2**32),
    _one_event(storage_tier="gpu"), _one_event(storage_tier="disk"),
])
def test_single_faults(document: dict[str, Any]) -> None:
    assert_readers_agree(document)
