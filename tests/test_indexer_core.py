"""Unit tests of the indexer core (protocols, tree, state), without HTTP."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from support.indexer_events import L, apply, cleared, doc, removed, scores, stored

from dynamo_lite.base.errors import Conflict, InvalidArgument, InvalidShape, NotFound
from dynamo_lite.hashing import local_block_hashes, to_signed, to_signed_list
from dynamo_lite.indexer import answers
from dynamo_lite.indexer.answers import query_answer
from dynamo_lite.indexer.core import MAX_LISTED, Gap, Indexer, Rejection
from dynamo_lite.indexer.protocols import (
    CLEARED,
    PartitionEvents,
    Removed,
    RouterEvent,
    Stored,
    event_to_json,
    events_document,
    parse_events_document,
    split_partition_key,
)
from dynamo_lite.indexer.tree import Node, PrefixTree, StoreStatus

pytestmark = pytest.mark.unit

# --- document helpers ------------------------------------------------------------------------


def worker_7_holds_four_blocks_worker_8_their_first_two() -> Indexer:
    indexer = Indexer()
    apply(
        indexer,
        doc(
            stored(7, 0, None, [161, 162, 163, 164], L),
            stored(8, 0, None, [161, 162], L[:2]),
        ),
    )
    return indexer


# --- protocols -------------------------------------------------------------------------------


def test_parse_every_event_form() -> None:
    document = doc(
        stored(7, 0, None, [-5, 6], [1, -2], storage_tier="device", residency_domain="worker"),
        removed(7, 1, [-5]),
        cleared(7, 2, dp_rank=3),
        {"worker_id": 9, "dp_rank": 2, "event": {"event_id": 0, "data": {"cleared": None}}},
        stored(9, 1, 2**64 - 1, [1], [2], storage_tier="host_pinned", dp_rank=2),
        key="meta/llama:8b:tenant-a",
    )
    document["meta/llama:8b:tenant-a"]["events"][0]["event"]["data"]["stored"]["start_position"] = 3
    document["meta/llama:8b:tenant-a"]["events"][0]["event"]["data"]["stored"]["blocks"][0]["mm_extra_info"] = None
    (section,) = parse_events_document(document)
    assert (section.model_name, section.tenant_id, section.block_size) == ("meta/llama:8b", "tenant-a", 16)
    assert section.events == [
        RouterEvent(7, 0, 0, "device", Stored(None, [2**64 - 5, 6], [1, 2**64 - 2])),
        RouterEvent(7, 0, 1, "device", Removed([2**64 - 5])),
        RouterEvent(7, 3, 2, "device", CLEARED),
        RouterEvent(9, 2, 0, "device", CLEARED),
        RouterEvent(9, 2, 1, "host_pinned", Stored(2**64 - 1, [1], [2])),
    ]


def test_partition_keys_split_at_the_last_colon() -> None:
    assert split_partition_key("meta/llama:8b:default") == ("meta/llama:8b", "default")
    assert split_partition_key("m:") == ("m", "")
    with pytest.raises(ValueError):
        split_partition_key("no-colon")


_GOOD = stored(7, 0, None, [1], [2])
_DELETE = object()
_STORED = ["event", "data", "stored"]
_BLOCK = [*_STORED, "blocks", 0]
_HASH = "expected an integer in the u64 or i64 range"


def _with(path: list[Any], value: Any) -> dict:
    """A copy of _GOOD with the field at `path` replaced (or deleted)."""
    event = copy.deepcopy(_GOOD)
    target = event
    for step in path[:-1]:
        target = target[step]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return event


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (_with([*_BLOCK, "block_hash"], "x"), f".event.data.stored.blocks[0].block_hash: {_HASH}, got string"),
        (_with([*_BLOCK, "tokens_hash"], 2**64), f".event.data.stored.blocks[0].tokens_hash: {_HASH}, got integer"),
        (_with([*_BLOCK, "tokens_hash"], _DELETE), ".event.data.stored.blocks[0].tokens_hash: missing field"),
        (_with([*_BLOCK, "block_hash"], True), f".event.data.stored.blocks[0].block_hash: {_HASH}, got boolean"),
        (_with(_BLOCK, 5), ".event.data.stored.blocks[0]: expected an object"),
        (_with([*_STORED, "parent_hash"], -(2**63) - 1), ".event.data.stored.parent_hash: expected null or an integer"),
        (_with([*_STORED, "blocks"], None), ".event.data.stored.blocks: expected an array of blocks, got null"),
        (_with(["event", "data"], {"stored": {"blocks": []}, "removed": {"block_hashes": []}}), ".event.data: expected"),
        (_with(["event", "data"], "flushed"), ".event.data: expected"),
        (_with(["event", "event_id"], -1), ".event.event_id: expected an integer in the u64 range, got integer -1"),
        (_with(["event", "event_id"], _DELETE), ".event.event_id: missing field"),
        (_with(["event", "dp_rank"], 2**32), ".event.dp_rank: expected an integer in the u32 range"),
        (_with(["dp_rank"], 1), ".dp_rank: 1 differs from event.dp_rank 0"),
        (_with(["worker_id"], 2**64), ".worker_id: expected an integer in the u64 range"),
        (_with(["worker_id"], 1.0), ".worker_id: expected an integer in the u64 range, got floating point number"),
        (_with(["storage_tier"], "GPU"), '.storage_tier: expected one of "device", "host_pinned", "disk", "external"'),
        (_with(["event"], []), ".event: expected an object, got array"),
        ([], ": expected a RouterEvent object, got array"),
        (removed(7, 0, [1, "2"]), f".event.data.removed.block_hashes[1]: {_HASH}"),
    ],
)
def test_shape_errors_name_partition_event_and_field(event: Any, message: str) -> None:
    document = doc(_GOOD, _GOOD, _GOOD, event, key="m:default")
    with pytest.raises(InvalidShape) as error:
        parse_events_document(document)
    assert error.value.message.startswith('"m:default".events[3]')
    assert message in error.value.message


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "expected a JSON object"),
        ({"nocolon": {"block_size": 4, "events": []}}, '"nocolon": a partition key is written'),
        ({"m:x": []}, '"m:x": expected an object with block_size and events'),
        ({"m:x": {"events": []}}, '"m:x".block_size: missing field'),
        ({"m:x": {"block_size": 2**32, "events": []}}, '"m:x".block_size: expected an integer in the u32 range'),
        ({"m:x": {"block_size": 4}}, '"m:x".events: missing field'),
        ({"m:x": {"error": "boom"}}, "the dump of this partition failed"),
    ],
)
def test_document_level_errors(document: Any, message: str) -> None:
    with pytest.raises(InvalidShape, match=message):
        parse_events_document(document)


def test_serializer_writes_the_dump_shape_and_round_trips() -> None:
    events = [
        RouterEvent(7, 1, 4, "disk", Stored(777, [15], [2**64 - 1])),
        RouterEvent(7, 1, 5, "device", Removed([1, 2])),
        RouterEvent(7, 1, 6, "device", CLEARED),
    ]
    assert event_to_json(events[0]) == {
        "worker_id": 7,
        "storage_tier": "disk",
        "residency_domain": "worker",
        "event": {
            "event_id": 4,
            "dp_rank": 1,
            "data": {
                "stored": {
                    "parent_hash": 777,
                    "start_position": None,
                    "blocks": [{"block_hash": 15, "tokens_hash": 2**64 - 1, "mm_extra_info": None}],
                }
            },
        },
    }
    document = events_document([PartitionEvents("a:b", "c", 8, events)])
    assert list(document) == ["a:b:c"]
    assert parse_events_document(document) == [PartitionEvents("a:b", "c", 8, events)]


# --- the worked example: worker 7 holds four blocks, worker 8 their first two ------------


def test_worker_7_holds_four_blocks_worker_8_their_first_two_scores_before_and_after_the_removal() -> None:
    indexer = worker_7_holds_four_blocks_worker_8_their_first_two()
    assert scores(indexer, L) == {"7": {"0": 64}, "8": {"0": 32}}
    assert scores(indexer, to_signed_list(L)) == {"7": {"0": 64}, "8": {"0": 32}}
    assert query_answer(indexer.query_tokens("llama", "default", list(range(1, 65)) + [5, 5, 5]))["scores"] == {
        "7": {"0": 64},
        "8": {"0": 32},
    }
    apply(indexer, doc(removed(7, 1, [164])))
    assert scores(indexer, L) == {"7": {"0": 48}, "8": {"0": 32}}


def test_worker_7_holds_four_blocks_worker_8_their_first_two_exact_dump() -> None:
    indexer = worker_7_holds_four_blocks_worker_8_their_first_two()
    apply(indexer, doc(removed(7, 1, [164])))

    def block(ext: int, local: int) -> dict:
        return {"block_hash": ext, "mm_extra_info": None, "tokens_hash": local}

    assert indexer.dump() == {
        "llama:default": {
            "block_size": 16,
            "events": [
                {
                    "event": {
                        "data": {
                            "stored": {
                                "blocks": [
                                    block(161, 16863443419780771464),
                                    block(162, 2287610619914608821),
                                    block(163, 12129935312930971799),
                                ],
                                "parent_hash": None,
                                "start_position": None,
                            }
                        },
                        "dp_rank": 0,
                        "event_id": 0,
                    },
                    "residency_domain": "worker",
                    "storage_tier": "device",
                    "worker_id": 7,
                },
                {
                    "event": {
                        "data": {
                            "stored": {
                                "blocks": [block(161, 16863443419780771464), block(162, 2287610619914608821)],
                                "parent_hash": None,
                                "start_position": None,
                            }
                        },
                        "dp_rank": 0,
                        "event_id": 1,
                    },
                    "residency_domain": "worker",
                    "storage_tier": "device",
                    "worker_id": 8,
                },
            ],
        }
    }


def test_lower_tier_hits_without_device_hits() -> None:
    """As Dynamo 1.6.1 answers: a worker with host/disk copies only shows in `instances` with gpu 0."""
    tokens = list(range(1, 17))
    h = local_block_hashes(tokens, 4)
    indexer = Indexer()
    apply(
        indexer,
        doc(
            stored(1101, 0, None, [11, 12], h[:2], storage_tier="host_pinned"),
            stored(1101, 1, 12, [13], h[2:3], storage_tier="disk"),
            block_size=4,
        ),
    )
    assert query_answer(indexer.query_tokens("llama", "default", tokens)) == {
        "scores": {},
        "frequencies": [],
        "instances": {"1101": {"longest_matched": 12, "gpu": 0, "dp": {"0": 0}, "cpu": 8, "disk": 12}},
    }


def test_lower_tiers_continue_the_device_match_in_order() -> None:
    h = local_block_hashes(list(range(1, 33)), 4)  # 8 blocks
    indexer = Indexer()
    apply(
        indexer,
        doc(
            stored(7, 0, None, [1, 2], h[:2]),
            stored(7, 1, 2, [3], h[2:3], storage_tier="host_pinned"),
            stored(7, 2, 3, [4], h[3:4], storage_tier="disk"),
            stored(7, 3, 4, [5], h[4:5], storage_tier="external"),
            # a host copy that does not continue the device match is not counted
            stored(7, 4, 99, [6], h[5:6], storage_tier="host_pinned"),
            stored(8, 0, None, [1, 2], h[:2], dp_rank=1),
            stored(8, 1, 2, [3, 4, 5], h[2:5], storage_tier="disk", dp_rank=1),
            stored(8, 0, None, [1], h[:1], dp_rank=0),
            block_size=4,
        ),
    )
    assert query_answer(indexer.query("llama", "default", h)) == {
        "scores": {"7": {"0": 8}, "8": {"0": 4, "1": 8}},
        "frequencies": [],
        "instances": {
            "7": {"longest_matched": 20, "gpu": 8, "dp": {"0": 8}, "cpu": 12, "disk": 20},
            "8": {"longest_matched": 20, "gpu": 8, "dp": {"0": 4, "1": 8}, "cpu": 8, "disk": 20},
        },
    }


def test_query_miss_and_a_query_not_starting_at_a_root_block() -> None:
    indexer = worker_7_holds_four_blocks_worker_8_their_first_two()
    empty = {"scores": {}, "frequencies": [], "instances": {}}
    assert query_answer(indexer.query("llama", "default", L[1:])) == empty
    assert query_answer(indexer.query("llama", "default", [])) == empty
    assert scores(indexer, [L[0], 12345, L[2]]) == {"7": {"0": 16}, "8": {"0": 16}}


def test_the_result_counts_blocks_and_the_label_cache_stays_bounded() -> None:
    indexer = worker_7_holds_four_blocks_worker_8_their_first_two()
    result = indexer.query("llama", "default", L)
    assert (result.block_size, result.device, result.host_pinned, result.disk) == (16, {(7, 0): 4, (8, 0): 2}, {}, {})
    labels: answers.Labels = {}
    for _ in range(2):  # each key in turn finds the cache full and starts it again
        assert query_answer(result, labels, max_labels=1)["scores"] == {"7": {"0": 64}, "8": {"0": 32}}
        assert len(labels) == 1


# --- tree semantics --------------------------------------------------------------------------


def test_store_under_an_unknown_parent_is_rejected_whole() -> None:
    tree = PrefixTree()
    a, b = (7, 0), (8, 0)
    assert tree.store(a, None, [11, 12], L[:2]) is StoreStatus.STORED
    assert tree.store(b, 12, [13], L[2:3]) is StoreStatus.UNKNOWN_PARENT  # only another worker holds 12
    assert tree.store(a, 12, [13], L[2:3], "host_pinned") is StoreStatus.STORED
    assert tree.store(a, 13, [14], L[3:4]) is StoreStatus.UNKNOWN_PARENT  # 13 is a host block of a
    assert tree.match(L).device == {a: 2}
    assert tree.block_count(b) == 0


def test_restore_is_a_no_op_and_bad_chains_are_refused() -> None:
    tree = PrefixTree()
    w = (1, 0)
    assert tree.store(w, None, [11, 12], L[:2]) is StoreStatus.STORED
    assert tree.store(w, None, [11, 12, 13], L[:3]) is StoreStatus.STORED  # overlapping re-store
    assert tree.store(w, None, [91], L[:1]) is StoreStatus.STORED  # same block, new name: first name kept
    assert tree.block_count(w) == 3 and tree.match(L).device == {w: 3}
    assert tree.remove(w, [91]) == 1
    assert tree.store(w, 13, [14, 14], L[3:] + L[3:]) is StoreStatus.SELF_REFERENCE
    assert tree.store(w, 13, [13], L[3:4]) is StoreStatus.SELF_REFERENCE
    assert tree.store(w, None, [11, 12, 13], [L[0], L[2], L[1]]) is StoreStatus.HASH_CONFLICT
    assert tree.store(w, 13, [14, 11], L[3:4] + [5]) is StoreStatus.HASH_CONFLICT
    assert tree.match(L).device == {w: 3} and tree.block_count(w) == 3


def test_remove_touches_only_that_worker_and_counts_unknown_hashes() -> None:
    tree = PrefixTree()
    a, b = (7, 0), (8, 0)
    tree.store(a, None, [11, 12, 13], L[:3])
    tree.store(b, None, [11, 12, 13], L[:3])
    assert tree.remove(b, [13, 12, 999]) == 1
    assert tree.remove(b, [13]) == 1
    assert tree.match(L).device == {a: 3, b: 1}
    assert tree.remove((5, 5), [11]) == 1  # unknown worker


def test_clear_empties_every_tier_of_one_worker() -> None:
    tree = PrefixTree()
    a, b = (7, 0), (7, 1)
    tree.store(a, None, [11, 12], L[:2])
    tree.store(a, 12, [13], L[2:3], "host_pinned")
    tree.store(b, None, [11], L[:1])
    tree.clear(a)
    assert tree.match(L).device == {b: 1}
    assert tree.block_count(a) == 0 and tree.block_count(a, "host_pinned") == 0
    assert not tree.lower["host_pinned"]
    tree.clear(b)
    assert tree.root.child is None


def test_mid_chain_removal_follows_the_simple_model() -> None:
    """Blocks below a removed block stop counting; re-storing the block revives them, as the
    coverage model says (the engine never reported them gone). No edge-split dependence (docs/differences.md, mid-chain removal)."""
    tree = PrefixTree()
    w, other = (1, 0), (2, 0)
    tree.store(w, None, [11, 12, 13, 14], L)
    tree.store(other, None, [11, 12], L[:2])
    assert tree.remove(w, [12]) == 0
    assert tree.match(L).device == {w: 1, other: 2}
    assert tree.block_count(w) == 3  # 13 and 14 are still held, below a gap
    assert tree.store(w, 14, [15], [777]) is StoreStatus.STORED  # extending a held chain is fine
    assert tree.match(L + [777]).device == {w: 1, other: 2}
    assert tree.store(w, 11, [12], L[1:2]) is StoreStatus.STORED
    assert tree.match(L + [777]).device == {w: 5, other: 2}
    assert not tree.dormant


def test_a_block_held_below_a_gap_keeps_its_first_name() -> None:
    tree = PrefixTree()
    w = (1, 0)
    tree.store(w, None, [1, 2, 3, 4], [11, 12, 13, 14])
    tree.remove(w, [2])
    assert tree.store(w, 3, [40], [14]) is StoreStatus.STORED  # 14 is held (as 4), below the gap
    assert tree.block_count(w) == 3
    assert tree.remove(w, [40]) == 1
    assert tree.store(w, 1, [2], [12]) is StoreStatus.STORED
    assert tree.match([11, 12, 13, 14]).device == {w: 4}


def test_lower_tier_names_are_exact_per_worker() -> None:
    tree = PrefixTree()
    a, b = (1, 0), (2, 0)
    tree.store(a, None, [1], L[:1], "host_pinned")
    tree.store(b, None, [2], L[:1], "host_pinned")  # the same transition under another name
    assert tree.store(b, None, [1], L[:1], "host_pinned") is StoreStatus.STORED  # held already: no-op
    assert tree.block_count(b, "host_pinned") == 1
    tree.store(a, 1, [3], L[1:2], "host_pinned")
    tree.store(b, 2, [4], L[1:2], "host_pinned")
    assert tree.match(L[:2]).host_pinned == {a: 2, b: 2}
    assert tree.remove(b, [1, 2], "host_pinned") == 1
    assert tree.match(L[:2]).host_pinned == {a: 2}
    assert tree.store(b, None, [2], L[:1], "host_pinned") is StoreStatus.STORED
    assert tree.match(L[:2]).host_pinned == {a: 2, b: 2}
    dumped = [_summary(event) for event in tree.dump()]
    assert dumped == [(1, None, [1]), (1, 1, [3]), (2, 2, [4]), (2, None, [2])]
    tree.clear(a)
    tree.clear(b)
    assert not tree.lower["host_pinned"]


def test_q3_scenario_credits_the_right_worker() -> None:
    """Mid-chain removal (docs/differences.md): W1 removes block 2 of [A0..A3] while W2 holds [A0, A1, X]."""
    tree = PrefixTree()
    w1, w2 = (1, 0), (2, 0)
    tree.store(w1, None, [10, 11, 12, 13], L)
    tree.store(w2, None, [10, 11, 99], L[:2] + [424242])
    tree.remove(w1, [12])
    assert tree.match(L).device == {w1: 2, w2: 2}


def test_inconsistent_external_hashes_stay_exact_per_worker() -> None:
    """Known content under other names (docs/differences.md): B stores A's content under other names; B keeps its own names."""
    tree = PrefixTree()
    a, b = (1, 0), (2, 0)
    tree.store(a, None, [11, 12], L[:2])
    tree.store(b, None, [31, 32], L[:2])
    assert tree.store(b, 32, [33], L[2:3]) is StoreStatus.STORED
    assert tree.store(b, 12, [34], L[2:3]) is StoreStatus.UNKNOWN_PARENT
    assert tree.match(L).device == {a: 2, b: 3}
    dumped = [_summary(event) for event in tree.dump()]
    assert dumped == [(1, None, [11, 12]), (2, None, [31, 32, 33])]
    assert tree.remove(b, [12, 11]) == 2
    assert tree.remove(b, [33, 32]) == 0
    assert tree.match(L).device == {a: 2, b: 1}


def test_nodes_are_pruned_and_masks_stay_prefix_closed() -> None:
    tree = PrefixTree()
    workers = [(w, 0) for w in range(3)]
    for w in workers:
        base = w[0] * 10
        tree.store(w, None, [base + 1, base + 2, base + 3], L[:3])
        tree.store(w, None, [base + 4], [L[0] + 1])
    tree.remove(workers[0], [2])  # mid-chain
    tree.remove(workers[1], [13, 12, 11])  # tail first
    for node in _nodes(tree):
        assert node.holders & ~node.parent.holders == 0 or node.parent is tree.root
    for w in workers:
        tree.drop_worker(w)
    assert tree.root.child is None and not tree.dormant and not tree.slots


def test_bits_are_reused_after_a_worker_is_dropped() -> None:
    tree = PrefixTree()
    tree.store((1, 0), None, [1], L[:1])
    tree.drop_worker((1, 0))
    tree.store((2, 0), None, [2], L[:1])
    assert tree.slots[(2, 0)].bit == 1
    assert tree.match(L).device == {(2, 0): 1}


def test_branching_children_collapse_back_to_a_single_child() -> None:
    tree = PrefixTree()
    tree.store((1, 0), None, [1, 2], L[:2])
    tree.store((2, 0), None, [1, 3], [L[0], 5])
    assert isinstance(tree.root.child.child, dict)
    tree.drop_worker((2, 0))
    assert not isinstance(tree.root.child.child, dict)


def test_dump_replays_into_an_identical_index() -> None:
    tree = PrefixTree()
    tree.store((1, 0), None, [11, 12, 13], L[:3])
    tree.store((2, 1), None, [11, 12], L[:2])
    tree.store((2, 1), 12, [21], [55])
    tree.store((3, 0), None, [31], [L[0]])  # another name for L[0]
    tree.store((1, 0), 13, [14], L[3:4], "host_pinned")
    tree.store((2, 1), 777, [15], [66], "disk")
    copy_ = PrefixTree()
    events = tree.dump()
    assert [e.event_id for e in events] == [0, 1, 2, 3, 4, 0, 0]  # the branch splits chains
    for event in events:
        assert _replay(copy_, event) is StoreStatus.STORED
    for query in (L, L[:2] + [55], [66], L[:3] + [L[3]]):
        assert copy_.match(query) == tree.match(query)
    assert [event_to_json(e) for e in copy_.dump()] == [event_to_json(e) for e in events]


def _summary(event: RouterEvent) -> tuple[int, int | None, list[int]]:
    assert isinstance(event.data, Stored)
    return event.worker_id, event.data.parent_hash, event.data.block_hashes


def _replay(tree: PrefixTree, event: RouterEvent) -> StoreStatus:
    data = event.data
    assert isinstance(data, Stored)
    key = (event.worker_id, event.dp_rank)
    return tree.store(key, data.parent_hash, data.block_hashes, data.tokens_hashes, event.storage_tier)


def _nodes(tree: PrefixTree) -> list[Node]:
    found: list[Node] = []
    stack = [tree.root]
    while stack:
        child = stack.pop().child
        if child is None:
            continue
        children = [child] if isinstance(child, Node) else list(child.values())
        found.extend(children)
        stack.extend(children)
    return found


# --- state: workers --------------------------------------------------------------------------


def test_register_conflicts_use_dynamo_messages() -> None:
    indexer = Indexer()
    indexer.register(301, "m5", "default", 4, dp_rank=0, endpoint="tcp://h:1")
    indexer.register(301, "m5", "default", 4, dp_rank=1)
    with pytest.raises(Conflict, match="^instance 301 dp_rank 1 already registered$"):
        indexer.register(301, "m5", "default", 4, dp_rank=1)
    mismatch = r"^block_size mismatch for model=m5 tenant_id=default: existing=4, requested=8$"
    with pytest.raises(Conflict, match=mismatch):
        indexer.register(302, "m5", "default", 8)
    with pytest.raises(Conflict, match="^instance 301 is already registered for model=m5 tenant_id=default$"):
        indexer.register(301, "m6", "default", 4)
    with pytest.raises(InvalidArgument, match="block_size must be greater than 0"):
        indexer.register(303, "m7", "default", 0)
    with pytest.raises(InvalidArgument, match="must not contain `:`"):
        indexer.register(303, "m7", "a:b", 4)
    assert list(indexer.partitions) == [("m5", "default")]


def test_unregister_messages_and_partition_lifetime() -> None:
    indexer = Indexer()
    indexer.register(701, "m9", "default", 4)
    indexer.register(701, "m9", "default", 4, dp_rank=1)
    indexer.register(702, "m9", "default", 4)
    with pytest.raises(NotFound, match="^instance 401 not found$"):
        indexer.unregister(401, "m9", "default")
    with pytest.raises(NotFound, match="^instance 702 is registered for model=m9 tenant_id=default$"):
        indexer.unregister(702, "m8", "default")
    with pytest.raises(NotFound, match="^instance 701 dp_rank 5 not found$"):
        indexer.unregister(701, "m9", "default", dp_rank=5)
    indexer.unregister(701, "m9", "default", dp_rank=1)
    assert [r.dp_rank for w in indexer.workers() for r in w.ranks if w.instance_id == 701] == [0]
    indexer.unregister(701, "m9", "default")
    indexer.register(701, "other", "default", 16)  # free to join another partition now
    indexer.unregister(702, "m9", "default")
    with pytest.raises(NotFound, match="^no indexer for model=m9 tenant_id=default$"):
        indexer.query("m9", "default", [1])
    with pytest.raises(NotFound):
        indexer.block_size("m9", "default")


def test_workers_lists_sources_blocks_and_watermarks() -> None:
    indexer = Indexer()
    indexer.register(5, "b", "t", 16, dp_rank=1, endpoint="tcp://x:1")
    indexer.register(3, "a", "t", 16)
    apply(
        indexer,
        doc(
            stored(5, 4, None, [1, 2], L[:2], dp_rank=0),
            stored(5, 0, None, [1], L[:1], dp_rank=1),
            stored(5, 1, 1, [3], L[1:2], dp_rank=1, storage_tier="disk"),
            key="b:t",
        ),
    )
    indexer.register(5, "b", "t", 16, dp_rank=0, endpoint="tcp://x:0")  # events-sourced rank adopts it
    info = indexer.workers()
    assert [(w.model_name, w.instance_id) for w in info] == [("a", 3), ("b", 5)]
    ranks = [
        (rank.dp_rank, rank.source, rank.registered, rank.endpoint, rank.blocks, rank.lower_tier_blocks,
         rank.last_event_id)
        for rank in info[1].ranks
    ]
    assert ranks == [(0, "events", True, "tcp://x:0", 2, 0, 4), (1, "events", True, "tcp://x:1", 1, 1, 1)]
    assert [(rank.source, rank.registered) for rank in info[0].ranks] == [("none", True)]  # nothing feeds it yet
    assert [w.instance_id for w in indexer.workers(model_name="b")] == [5]
    assert indexer.workers(tenant_id="zzz") == []


# --- state: events ---------------------------------------------------------------------------


def test_watermarks_skip_redeliveries_and_report_gaps() -> None:
    indexer = Indexer()
    report = apply(
        indexer,
        doc(
            stored(1, 0, None, [11], L[:1]),
            stored(1, 0, None, [11], L[:1]),  # same batch (id 0): applied, a no-op store
            stored(1, 3, 11, [12], L[1:2]),  # gap: 1 and 2 missing
            removed(1, 2, [12]),  # late: skipped
            stored(2, 5, None, [21], L[:1]),  # first event of a worker is not 0
            cleared(1, 4, dp_rank=1),  # another rank, its own watermark
        ),
    )
    assert (report.applied, report.skipped, report.rejected, report.gap_count) == (5, 1, 0, 3)
    assert report.gaps == [Gap(1, 0, 1, 3), Gap(2, 0, 0, 5), Gap(1, 1, 0, 4)]
    assert scores(indexer, L) == {"1": {"0": 32}, "2": {"0": 16}}
    again = apply(indexer, doc(stored(1, 3, 11, [12], L[1:2]), stored(1, 4, 12, [13], L[2:3])))
    assert (again.applied, again.skipped, again.gap_count) == (1, 1, 0)


def test_every_event_of_a_multi_event_batch_is_applied() -> None:
    """Dynamo gives every event of one engine batch the batch's sequence number as event_id."""
    indexer = Indexer()
    report = apply(indexer, doc(stored(1, 0, None, [11], L[:1]), stored(1, 0, 11, [12], L[1:2])))
    assert (report.applied, report.skipped, report.gap_count) == (2, 0, 0)
    assert scores(indexer, L) == {"1": {"0": 32}}
    batch = doc(stored(1, 1, 12, [13], L[2:3]), removed(1, 1, [13]), stored(1, 1, 12, [13], L[2:3]))
    assert apply(indexer, batch).applied == 3
    assert scores(indexer, L) == {"1": {"0": 48}}
    # The same batch delivered again, whole: skipped whole, nothing applied twice.
    redelivered = apply(indexer, batch)
    assert (redelivered.applied, redelivered.skipped) == (0, 3)
    assert scores(indexer, L) == {"1": {"0": 48}}


def test_a_batch_is_consecutive_events_of_one_rank() -> None:
    indexer = Indexer()
    apply(indexer, doc(stored(1, 5, None, [11], L[:1])))
    report = apply(
        indexer,
        doc(
            stored(1, 6, 11, [12], L[1:2]),
            stored(2, 0, None, [11], L[:1]),  # another worker between them: still one batch of 1
            stored(1, 6, 12, [13], L[2:3]),
            removed(1, 5, [13]),  # an old batch: skipped, and it ends batch 6 for worker 1
            removed(1, 6, [13]),  # id 6 again after that: a re-delivery, not batch 6 going on
        ),
    )
    assert (report.applied, report.skipped, report.gap_count) == (3, 2, 0)
    assert scores(indexer, L) == {"1": {"0": 48}, "2": {"0": 16}}


def test_rejections_are_counted_with_reasons() -> None:
    indexer = Indexer()
    orphans = [stored(1, i, 999, [i + 100], [i]) for i in range(1, MAX_LISTED + 6)]
    events = [stored(1, 0, None, [11], L[:1]), *orphans]
    events.append(removed(1, MAX_LISTED + 6, [11, 12345]))
    report = apply(indexer, doc(*events))
    assert report.rejected == MAX_LISTED + 5 and len(report.rejections) == MAX_LISTED
    assert report.rejections[0] == Rejection(
        "llama:default", 1, "parent_hash 999 is not a device block of worker 1 dp_rank 0"
    )
    assert (report.applied, report.unknown_removals) == (2, 1)
    assert report.applied + report.skipped + report.rejected == len(events)


def test_a_bad_event_anywhere_applies_nothing() -> None:
    indexer = Indexer()
    indexer.register(9, "other", "default", 16)
    good = doc(stored(1, 0, None, [11], L[:1]))
    bad_shape = {**good, "m2:default": {"block_size": 16, "events": [stored(2, 0, None, ["x"], [1])]}}
    with pytest.raises(InvalidShape):
        apply(indexer, bad_shape)
    size_conflict = {**good, "other:default": {"block_size": 8, "events": [stored(3, 0, None, [1], [1])]}}
    with pytest.raises(Conflict, match="mismatch for model=other tenant_id=default: existing=16, requested=8"):
        apply(indexer, size_conflict)
    owner_conflict = {**good, "m3:default": {"block_size": 16, "events": [stored(9, 0, None, [1], [1])]}}
    with pytest.raises(Conflict, match="^instance 9 is already registered for model=other tenant_id=default$"):
        apply(indexer, owner_conflict)
    split_instance = {**good, "m4:default": {"block_size": 16, "events": [stored(1, 0, None, [1], [1])]}}
    with pytest.raises(Conflict, match="^instance 1 is already registered for model=llama tenant_id=default$"):
        apply(indexer, split_instance)
    zero = {**good, "m5:default": {"block_size": 0, "events": [stored(5, 0, None, [1], [1])]}}
    with pytest.raises(InvalidArgument):
        apply(indexer, zero)
    assert list(indexer.partitions) == [("other", "default")]
    assert [w.instance_id for w in indexer.workers()] == [9]


def test_empty_sections_create_nothing_but_still_check_block_size() -> None:
    indexer = Indexer()
    assert apply(indexer, doc(key="new:default")).applied == 0
    assert not indexer.partitions
    indexer.register(1, "llama", "default", 16)
    with pytest.raises(Conflict):
        apply(indexer, doc(block_size=4))


def test_cleared_event_and_dp_ranks() -> None:
    indexer = Indexer()
    apply(
        indexer,
        doc(
            stored(4, 0, None, [1, 2], L[:2], dp_rank=0),
            stored(4, 0, None, [1, 2, 3], L[:3], dp_rank=1),
            stored(4, 1, 2, [9], L[2:3], dp_rank=0, storage_tier="host_pinned"),
        ),
    )
    assert query_answer(indexer.query("llama", "default", L))["instances"] == {
        "4": {"longest_matched": 48, "gpu": 48, "dp": {"0": 32, "1": 48}, "cpu": 48, "disk": 48}
    }
    apply(indexer, doc(cleared(4, 1, dp_rank=1), cleared(4, 2, dp_rank=0)))
    assert query_answer(indexer.query("llama", "default", L)) == {"scores": {}, "frequencies": [], "instances": {}}
    assert [r.blocks + r.lower_tier_blocks for r in indexer.workers()[0].ranks] == [0, 0]


def test_dump_and_load_dump_restore_partitions_and_workers() -> None:
    source = worker_7_holds_four_blocks_worker_8_their_first_two()
    apply(source, doc(stored(7, 1, 164, [165], [4242], storage_tier="host_pinned")))
    apply(source, doc(stored(2, 0, None, [1], [L[0]]), key="meta/llama:8b:default", block_size=4))
    dump = source.dump()
    assert list(dump) == ["llama:default", "meta/llama:8b:default"]
    copy_ = Indexer()
    report = copy_.load_dump(dump)
    assert (report.applied, report.rejected, report.gap_count) == (4, 0, 0)
    assert copy_.dump() == dump
    assert copy_.query("llama", "default", L + [4242]) == source.query("llama", "default", L + [4242])
    restored = [(w.model_name, w.instance_id, w.ranks[0].source, w.ranks[0].last_event_id) for w in copy_.workers()]
    assert restored == [
        ("llama", 7, "events", None),
        ("llama", 8, "events", None),
        ("meta/llama:8b", 2, "events", None),
    ]
    # after a load, the next live event of a worker starts its watermark afresh
    assert apply(copy_, doc(removed(7, 41, [164]))).gap_count == 1


def test_query_tokens_hashes_with_lora_and_cache_salt() -> None:
    indexer = Indexer()
    tokens = list(range(32))
    salted = local_block_hashes(tokens, 16, lora_name="my-lora", cache_salt="tenant-a")
    apply(indexer, doc(stored(1, 0, None, [1, 2], salted)))
    assert query_answer(indexer.query_tokens("llama", "default", tokens))["scores"] == {}
    answer = query_answer(indexer.query_tokens("llama", "default", tokens, lora_name="my-lora", cache_salt="tenant-a"))
    assert answer["scores"] == {"1": {"0": 32}}
    with pytest.raises(InvalidShape, match=r"token_ids\[1\]"):
        indexer.query_tokens("llama", "default", [1, -1])
    assert indexer.block_size("llama", "default") == 16


def test_signed_and_unsigned_hashes_name_the_same_blocks() -> None:
    indexer = Indexer()
    apply(indexer, doc(stored(1, 0, None, [to_signed(2**64 - 5), 6], to_signed_list(L[:2]))))
    apply(indexer, doc(removed(1, 1, [6])))
    assert scores(indexer, L) == {"1": {"0": 16}}
    apply(indexer, doc(removed(1, 2, [2**64 - 5])))
    assert scores(indexer, L) == {}
