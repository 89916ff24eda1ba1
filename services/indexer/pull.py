"""Pulling a JetStream consumer's messages, one pull request at a time.

Done here rather than with nats-py's `fetch`, which starts a task and a timer for every
message it hands over (70 us of a replica's CPU per message, measured): one pull request at a
time for up to `batch` messages, which arrive at a callback that applies them as they come.
The server ends a request with a status message (408 when it expired with nothing more to
give, 409 when the consumer went away); a request that gets no answer at all (lost in a
reconnection) is abandoned after its expiry plus a margin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg

logger = logging.getLogger("dynamo_lite.indexer.nats_replica")

ANSWER_MARGIN_SECS = 2.0  # a pull request unanswered this long after its expiry is abandoned


@dataclass(frozen=True)
class Pulled:
    """How one pull request ended."""

    count: int  # messages it brought
    status: str | None  # the status that ended it; None: it filled up, or went unanswered
    answered: bool  # False: no answer (a disconnection), or it could not be sent


class Puller:
    """Pulls from the durable consumer `consumer` of `stream`, handing each message to
    `apply` in order, and acknowledges (with every one before it) the last of each request."""

    def __init__(self, client: Client, stream: str, consumer: str, apply: Callable[[Msg], None], *,
                 batch: int, expires_secs: float, slice_secs: float) -> None:
        self.client = client
        self.subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.stream = stream
        self.apply = apply
        self.batch = batch
        self.expires_secs = expires_secs
        self.slice_secs = slice_secs  # applying hands the event loop back to requests this often
        self._request = orjson.dumps({"batch": batch, "expires": int(expires_secs * 1e9)})
        self._inbox: str | None = None  # where pulled messages arrive (`_on_message`)
        self._done = asyncio.Event()
        self._count = 0
        self._status: str | None = None
        self._last: Msg | None = None
        self._slice_started = 0.0

    async def subscribe(self) -> None:
        """Listen on this puller's inbox (once: it outlives consumers created again)."""
        if self._inbox is None:
            self._inbox = self.client.new_inbox()
            await self.client.subscribe(self._inbox, cb=self._on_message)

    async def pull(self) -> Pulled:
        """One pull request, until it ends; then the acknowledgement."""
        assert self._inbox is not None
        self._done.clear()
        self._count = 0
        self._status = None
        answered = True
        try:
            await self.client.publish(self.subject, self._request, reply=self._inbox)
            await asyncio.wait_for(self._done.wait(), self.expires_secs + ANSWER_MARGIN_SECS)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - no answer (a disconnection), or cannot publish
            logger.debug("pull request unanswered: %s: %s", type(exc).__name__, exc)
            answered = False
        last, self._last = self._last, None
        if last is not None:
            try:
                await last.ack()
            except Exception as exc:  # noqa: BLE001 - an ack lost in a disconnection only means redelivery
                logger.debug("ack failed: %s", exc)
        return Pulled(self._count, self._status, answered)

    async def _on_message(self, message: Msg) -> None:
        headers = message.headers
        if headers is not None and (status := headers.get("Status")) is not None:
            if status != "100":  # not an idle heartbeat: the request is over
                self._status = status
                if status == "409":
                    logger.warning("pull from stream %s refused: %s", self.stream, headers.get("Description"))
                self._done.set()
            return
        self.apply(message)
        self._last = message
        self._count += 1
        if self._count >= self.batch:
            self._done.set()
        loop = asyncio.get_running_loop()
        if loop.time() - self._slice_started > self.slice_secs:
            await asyncio.sleep(0)  # requests get their turn between slices of applying
            self._slice_started = loop.time()
