"""Peers an indexer can recover its state from, and the recovery itself.

Recovery is one `GET <peer>/dump` from the first peer that answers, merged into the index
before the HTTP port opens. A dump from a Dynamo 1.6.1 indexer has the same shape as ours.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import orjson

from dynamo_lite.errors import NotFound, ServiceError

from .state import ApplyReport, Indexer

logger = logging.getLogger("dynamo_lite.indexer.peers")


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
    indexer: Indexer, peers: list[str], *, deadline_secs: float, attempt_timeout_secs: float = 5.0
) -> tuple[str, ApplyReport] | None:
    """Load the first reachable peer's dump; retry the list until `deadline_secs` have passed.

    Returns the peer used and what was applied, or None when no peer answered in time (the
    indexer then starts empty). A peer whose dump we cannot read is logged and skipped.
    """
    if not peers:
        return None
    stop_at = time.monotonic() + deadline_secs
    async with httpx.AsyncClient(timeout=attempt_timeout_secs) as client:
        while True:
            for url in peers:
                try:
                    response = await client.get(f"{url}/dump")
                    response.raise_for_status()
                    document = orjson.loads(response.content)
                except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
                    logger.warning("peer %s: no dump (%s: %s)", url, type(exc).__name__, exc)
                    continue
                try:
                    report = indexer.load_dump(document)
                except ServiceError as exc:
                    logger.error("peer %s: dump refused: %s", url, exc.message)
                    continue
                logger.info(
                    "recovered from peer %s: %d events applied, %d rejected", url, report.applied, report.rejected
                )
                return url, report
            if time.monotonic() >= stop_at:
                logger.warning("no peer answered within %.1fs; starting with an empty index", deadline_secs)
                return None
            await asyncio.sleep(0.5)
