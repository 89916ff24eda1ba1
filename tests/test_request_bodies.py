"""Each request type's two readers (see `dynamo_lite.web.validation.RequestBody`): msgspec's one pass
into the struct (the hot path) and the ordered path derived from the same declaration (the
definition of what a route accepts, and of the first error a body gets). For any body of any
route: the same request, or the same status and error text; and every body the ordered path
accepts takes the fast one."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_lite.base.errors import ServiceError
from dynamo_lite.indexer import app as indexer_app
from dynamo_lite.slot_tracker import app as slot_tracker_app
from dynamo_lite.web.validation import RequestBody, decode_json, decoder, ordered_reader

pytestmark = pytest.mark.unit

REQUEST_TYPES = [
    slot_tracker_app.RegisterRequest, slot_tracker_app.UnregisterRequest, slot_tracker_app.AddRequest,
    slot_tracker_app.RequestIdRequest, slot_tracker_app.OutputBlocksRequest, slot_tracker_app.PotentialLoadsRequest,
    indexer_app.RegisterRequest, indexer_app.UnregisterRequest, indexer_app.QueryByHashRequest,
    indexer_app.QueryRequest, indexer_app.RoutedRequest, indexer_app.PeerRequest,
]

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
edge_ints = st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX, U64_MAX + 1, -1, I64_MIN,
                             I64_MIN - 1])
faults = st.one_of(st.sampled_from([None, True, False, 1.0, "7", [], {}, 1e30, [1.5], [None], ["x"]]).map(copy.deepcopy),
                   edge_ints, st.lists(edge_ints, max_size=3))
strings = st.one_of(st.sampled_from(["m", "default", "g", "tcp://127.0.0.1:5557", "tcp://h:1", "ipc://x", "http://h:1"]), st.text(max_size=4))


def _valid(info: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    """Values of the declared type (drawn near its bounds too)."""
    if isinstance(info, msgspec.inspect.UnionType):
        return st.one_of([_valid(t) for t in info.types])
    if isinstance(info, msgspec.inspect.NoneType):
        return st.none()
    if isinstance(info, msgspec.inspect.StrType):
        return strings
    if isinstance(info, msgspec.inspect.IntType):
        low = info.ge if info.ge is not None else I64_MIN
        high = info.le if info.le is not None else U64_MAX
        return st.one_of(st.integers(low, high), st.sampled_from([low, high]))
    if isinstance(info, msgspec.inspect.ListType):
        return st.lists(_valid(info.item_type), max_size=4)
    return st.none()


@st.composite
def bodies(draw: st.DrawFn, request_type: type[RequestBody]) -> Any:
    """A body near the schema: each declared field present or not, valid or one fault."""
    if draw(st.integers(0, 19)) == 0:
        return draw(faults)
    body: dict[str, Any] = {}
    for field in msgspec.inspect.type_info(request_type).fields:  # type: ignore[attr-defined]
        if draw(st.integers(0, 9)) == 0 and field.required or draw(st.integers(0, 2)) == 0 and not field.required:
            continue
        body[field.name] = draw(faults if draw(st.integers(0, 7)) == 0 else _valid(field.type))
    if draw(st.booleans()):
        body["unknown_field"] = draw(faults)
    return body


def _outcome(read: Any, document: Any) -> Any:
    try:
        return read(document)
    except ServiceError as error:
        return error.status, error.message


@pytest.mark.parametrize("request_type", REQUEST_TYPES, ids=lambda t: f"{t.__module__.split('.')[1]}.{t.__name__}")
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fast_and_ordered_paths_agree(request_type: type[RequestBody], data: st.DataObject) -> None:
    body = json.dumps(data.draw(bodies(request_type))).encode()
    ordered = _outcome(ordered_reader(request_type), decode_json(body))
    assert _outcome(decoder(request_type), body) == ordered
    if isinstance(ordered, RequestBody):
        assert msgspec.json.decode(body, type=request_type) == ordered  # the hot path took it
