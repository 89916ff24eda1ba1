"""Recovery from peers: the first reachable peer's `GET /dump` replaces the tracker's state
before the HTTP port opens.

A peer wins over the snapshot: a replica that kept running saw every `/add` and `/free` since the
snapshot was written, and the two cannot be merged (the same requests would be on both sides).
So start-up asks the peers first and loads the snapshot only when no peer's dump was loaded. A
peer's dump is loaded as taken (it was taken a moment ago, and the two hosts' clocks may differ
by more than that).
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamo_lite.durability.peers import recover as recover_from_peers
from dynamo_lite.web.credentials import ClientCredentials

from .core import SlotTracker
from .snapshot import EMPTY, decode, describe_restore


async def recover(
    tracker: SlotTracker, peers: Sequence[str], *, deadline_secs: float, otherwise: str = EMPTY,
    credentials: ClientCredentials = ClientCredentials(),
) -> str | None:
    """Replace the tracker's state with the first reachable peer's dump; returns the peer used,
    or None when no peer's dump was loaded within `deadline_secs` (the log then says the tracker
    starts with `otherwise`)."""

    def load(body: bytes) -> str:
        return describe_restore(tracker.restore(decode(body)))

    return await recover_from_peers(peers, load, deadline_secs=deadline_secs, otherwise=otherwise,
                                    credentials=credentials)
