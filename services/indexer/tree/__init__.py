"""One partition's KV index: which (worker, dp_rank) holds which block chains, per tier.

`PrefixTree` (`prefix_tree`) is what the indexer core uses; each concern has a module of its
own, and its notes:

* `nodes`: the device tier, a prefix tree keyed by local block hash (`Node`, `Chain`);
* `chains`: runs of blocks in packed arrays, how they are extended and cut;
* `slots`: a worker slot (`WorkerSlot`), its bit in every mask;
* `names`: how each slot finds its blocks by its own external hashes (the sharded name maps);
* `store`, `remove`: storing and removing device blocks (blocks below a removed one stay,
  dormant, as the coverage model says);
* `runs`, `matching`: the query's walk, and the runs it leaves for the next one;
* `lower`: the host_pinned, disk and external tiers;
* `eviction`: the bounded size (`max_blocks`) of the device tier;
* `dump`: the stored events that rebuild a tree.
"""

from dynamo_lite.indexer.tree.matching import MatchResult
from dynamo_lite.indexer.tree.nodes import Chain, Node
from dynamo_lite.indexer.tree.prefix_tree import PrefixTree
from dynamo_lite.indexer.tree.runs import Run
from dynamo_lite.indexer.tree.slots import WorkerKey
from dynamo_lite.indexer.tree.store import StoreStatus

__all__ = ["Chain", "MatchResult", "Node", "PrefixTree", "Run", "StoreStatus", "WorkerKey"]
