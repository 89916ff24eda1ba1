"""The prefix tree against a deliberately simple model of what it must answer.

Model, per worker slot (the coverage model of `dynamo_lite.indexer.tree`, extended to lower tiers):

* device coverage: the set of prefix chains (tuples of local hashes) it stored and did not
  remove, each under the external hash it was first stored with; a store is rejected whole
  when its parent is not one of the worker's device hashes, when a hash repeats, or when a
  hash already names a different chain of the worker; remove deletes exactly the named chains;
* device score of a query = the largest k such that every prefix query[:j], j <= k, is covered;
* per lower tier: transitions (parent hash | None, local) -> hash; a query continues a worker
  from its device stop (parent = its hash for query[:k]) or, with no device hit, from the root,
  through host_pinned, then disk, then external.

Prompts share prefixes and repeat content; external hashes are chained like a real engine's,
with one worker using another hash seed (inconsistent names, docs/differences.md).
Removals are tail-first, mid-chain and random (unknown hashes too).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from support.index_model_machine import IndexModel

pytestmark = pytest.mark.unit

IndexModel.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexModel = IndexModel.TestCase


class PlainIndexModel(IndexModel):
    """The same model against a tree with a node per block (what a limited tree keeps)."""

    chains = False


PlainIndexModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPlainIndexModel = PlainIndexModel.TestCase
