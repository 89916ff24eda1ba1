"""Recovery from peers at start-up (both services' `--peers`): one `GET <peer>/dump` from the
first peer that answers, handed to the service's loader before the HTTP port opens."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import httpx

from dynamo_lite.base.errors import ServiceError
from dynamo_lite.web.credentials import ClientCredentials

logger = logging.getLogger("dynamo_lite.peers")


async def recover(
    peers: Sequence[str],
    load: Callable[[bytes], str],
    *,
    deadline_secs: float,
    otherwise: str,
    attempt_timeout_secs: float = 5.0,
    credentials: ClientCredentials = ClientCredentials(),
) -> str | None:
    """Hand the first reachable peer's `/dump` body to `load`; retry the list until
    `deadline_secs` have passed.

    `load` applies the dump and returns what it held, for the log; it raises ServiceError or
    ValueError for a dump it refuses, and that peer is skipped. Returns the peer used, or None
    when no peer's dump was loaded in time (the service then starts with `otherwise`, which the
    log names). `credentials`: the key and TLS settings the peers want (`/dump` needs a full key).
    """
    if not peers:
        return None
    stop_at = time.monotonic() + deadline_secs
    async with httpx.AsyncClient(timeout=attempt_timeout_secs, **credentials.httpx_options()) as client:
        while True:
            for url in peers:
                try:
                    response = await client.get(f"{url.rstrip('/')}/dump")
                    response.raise_for_status()
                except httpx.HTTPError as exc:
                    logger.warning("peer %s: no dump (%s: %s)", url, type(exc).__name__, exc)
                    continue
                try:
                    loaded = load(response.content)
                except (ServiceError, ValueError) as exc:
                    logger.error("peer %s: dump refused: %s", url, getattr(exc, "message", exc))
                    continue
                logger.info("recovered from peer %s: %s", url, loaded)
                return url
            if time.monotonic() >= stop_at:
                logger.warning("no peer answered within %.1fs; starting with %s", deadline_secs, otherwise)
                return None
            await asyncio.sleep(0.5)
