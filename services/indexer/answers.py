"""The query routes' answers: an `Indexer` query's `QueryResult` in Dynamo 1.6.1's JSON shape.

The core counts blocks per (instance_id, dp_rank) and tier; this is where they become tokens
and string keys, once per query, so it is on `/query_by_hash`'s hot path.
"""

from __future__ import annotations

from typing import Any, Final

from .core import QueryResult
from .tree import WorkerKey

# (instance_id, dp_rank) -> its JSON keys, str(instance_id) and str(dp_rank). A label depends
# on the key alone, so one cache serves every answer and is never stale; it only has to stay
# small: past MAX_LABELS (more ranks than an indexer serves, so only after much churn) it
# starts again. `query_answer` takes both as parameters, so a test can pass its own.
Labels = dict[WorkerKey, tuple[str, str]]
_LABELS: Final[Labels] = {}
MAX_LABELS: Final = 1 << 14


def query_answer(result: QueryResult, labels: Labels = _LABELS, max_labels: int = MAX_LABELS) -> dict[str, Any]:
    """The `/query_by_hash` and `/query` answer, all values in tokens:

        {"scores": {instance: {dp_rank: device tokens}},      # zero scores left out
         "frequencies": [],
         "instances": {instance: {"longest_matched", "gpu", "dp": {dp_rank: tokens},
                                  "cpu", "disk"}}}

    `cpu` adds the host-pinned blocks that continue a rank's device match, `disk` adds to that
    the disk and external ones; the instance values are maxima over its ranks. Instances and
    ranks come in (instance_id, dp_rank) order.
    """
    if result.host_pinned or result.disk:
        return tiered_answer(result)
    # Device only, the common case: ranks hold the same tokens on every tier, and labels of
    # ranks are cached as strings.
    block_size = result.block_size
    device = result.device
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for key in sorted(device):
        tokens = device[key] * block_size
        label = labels.get(key)
        if label is None:
            if len(labels) >= max_labels:
                labels.clear()
            label = labels[key] = (str(key[0]), str(key[1]))
        name, rank = label
        per_rank = scores.get(name)
        if per_rank is None:
            scores[name] = {rank: tokens}
            instances[name] = {
                "longest_matched": tokens,
                "gpu": tokens,
                "dp": {rank: tokens},
                "cpu": tokens,
                "disk": tokens,
            }
            continue
        per_rank[rank] = tokens
        entry = instances[name]
        entry["dp"][rank] = tokens
        if tokens > entry["gpu"]:
            entry["longest_matched"] = entry["gpu"] = entry["cpu"] = entry["disk"] = tokens
    return {"scores": scores, "frequencies": [], "instances": instances}


def tiered_answer(result: QueryResult) -> dict[str, Any]:
    """`query_answer` for any result, lower tiers included: what `query_answer` answers
    through its faster device-only path when no rank matched on host or disk."""
    device, host, disk, block_size = result.device, result.host_pinned, result.disk, result.block_size
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for (instance_id, dp_rank), blocks in sorted(device.items()):
        scores.setdefault(str(instance_id), {})[str(dp_rank)] = blocks * block_size
    for key in sorted(device.keys() | host.keys() | disk.keys()):
        gpu = device.get(key, 0) * block_size
        cpu = gpu + host.get(key, 0) * block_size
        on_disk = cpu + disk.get(key, 0) * block_size
        entry = instances.get(str(key[0]))
        if entry is None:
            entry = instances[str(key[0])] = {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
        entry["dp"][str(key[1])] = gpu
        entry["gpu"] = max(entry["gpu"], gpu)
        entry["cpu"] = max(entry["cpu"], cpu)
        entry["disk"] = max(entry["disk"], on_disk)
        entry["longest_matched"] = max(entry["gpu"], entry["cpu"], entry["disk"])
    return {"scores": scores, "frequencies": [], "instances": instances}
