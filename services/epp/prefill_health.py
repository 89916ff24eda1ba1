"""Which prefill endpoints are up: the picker names a prefill engine in `x-prefiller-host-port`
only while it answers.

A prefill engine is never one of Envoy's destinations (the decode engine's sidecar calls it), so
no health check of Envoy's watches it. A dead one in the pool would still be named, and every
long prompt would pay a failed connection and a fallback in the sidecar before prefilling on
the decode engine anyway. So the picker asks each prefill endpoint's `GET /health` every
`interval` seconds (vLLM and the stand-in answer it): one that does not answer 200 within
`timeout` is down until it does again, and a request that would have been disaggregated runs
aggregated (reason `no_prefill`) while none is up. Down from the first failed probe, up from
the first good one: a probe costs one small request, and flapping costs at worst a fallback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import httpx

from .endpoint import PREFILL, PoolEndpoint

logger = logging.getLogger("dynamo_lite.epp")

DEFAULT_PROBE_SECS = 1.0
PROBE_TIMEOUT_SECS = 1.0


class PrefillHealth:
    """The prefill endpoints' liveness, by address. Addresses never probed count as up, so a
    picker that just started routes as the pool says until the first round is in."""

    def __init__(self, pool: Callable[[], Sequence[PoolEndpoint]], interval: float = DEFAULT_PROBE_SECS,
                 timeout: float = PROBE_TIMEOUT_SECS, client: httpx.AsyncClient | None = None) -> None:
        self.pool = pool
        self.interval = interval
        self.down: set[str] = set()
        self._client = client or httpx.AsyncClient(timeout=timeout)

    def up(self, address: str) -> bool:
        return address not in self.down

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.probe_once()
                except Exception:  # noqa: BLE001 - a round that fails must not end the probing for good
                    logger.exception("prefill endpoints not probed this round")
                await asyncio.sleep(self.interval)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def probe_once(self) -> None:
        addresses = sorted({endpoint.address for endpoint in self.pool() if endpoint.role == PREFILL})
        answers = await asyncio.gather(*(self._probe(address) for address in addresses))
        for address, (alive, why) in zip(addresses, answers):
            if alive and address in self.down:
                self.down.discard(address)
                logger.info("prefill endpoint %s answers again: disaggregating onto it", address)
            elif not alive and address not in self.down:
                self.down.add(address)
                logger.warning("prefill endpoint %s is down (%s): not disaggregating onto it", address, why)
        self.down.intersection_update(addresses)  # an endpoint that left the pool is forgotten

    async def _probe(self, address: str) -> tuple[bool, str]:
        try:
            answer = await self._client.get(f"http://{address}/health")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return answer.status_code == 200, f"/health answered {answer.status_code}"


__all__ = ["DEFAULT_PROBE_SECS", "PROBE_TIMEOUT_SECS", "PrefillHealth"]
