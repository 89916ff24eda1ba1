"""Peers an indexer can recover its state from, and the recovery itself.

Recovery is one `GET <peer>/dump` from the first peer that answers, merged into the index
before the HTTP port opens. A dump from a Dynamo 1.6.1 indexer has the same shape as ours;
ours also carries the approximations (`/routed`), which keep the TTL they have left.
"""

from __future__ import annotations

from dynamo_lite.base.errors import NotFound
from dynamo_lite.durability.peers import recover as recover_from_peers
from dynamo_lite.web.credentials import ClientCredentials

from .core import Indexer
from .protocols import decode_events_document


class PeerList:
    """Base URLs in registration order, without duplicates or trailing slashes."""

    def __init__(self, urls: list[str] | None = None) -> None:
        self._urls: list[str] = []
        for url in urls or []:
            self.add(url)

    def add(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self._urls:
            self._urls.append(url)

    def remove(self, url: str) -> None:
        try:
            self._urls.remove(url.rstrip("/"))
        except ValueError:
            raise NotFound("peer not found") from None

    def urls(self) -> list[str]:
        return list(self._urls)


async def recover(
    indexer: Indexer, peers: list[str], *, deadline_secs: float, attempt_timeout_secs: float = 5.0,
    credentials: ClientCredentials = ClientCredentials(),
) -> str | None:
    """Merge the first reachable peer's dump into `indexer`; retry the list until
    `deadline_secs` have passed. Returns the peer used, or None when no peer answered in time
    (the indexer then starts empty). A peer whose dump we cannot read is logged and skipped."""

    def load(body: bytes) -> str:
        report = indexer.load_sections(decode_events_document(body))
        return f"{report.applied} events applied, {report.rejected} rejected"

    return await recover_from_peers(peers, load, deadline_secs=deadline_secs, otherwise="an empty index",
                                    attempt_timeout_secs=attempt_timeout_secs, credentials=credentials)
