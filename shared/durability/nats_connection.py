"""One NATS connection per process (`--nats URL` of both services): flags, connecting, metrics.

With `--nats` the services replicate through a NATS server: the indexer through a JetStream
stream and an object store (`dynamo_lite.indexer.replication`), the slot tracker over NATS core
subjects (`dynamo_lite.slot_tracker.replication`). Without it nothing here is imported by the
serving path and the services behave as single processes.

The connection reconnects forever (every `RECONNECT_WAIT_SECS`): a NATS server restart or a
network blip must not stop a replica, only delay its replication. While disconnected, nats-py
keeps what is published in a buffer of `PENDING_BYTES` and sends it after reconnecting;
`/metrics` shows whether the connection is up and how often it dropped.

Authorization: user/password or a token in the URL (`nats://user:password@host:4222`, as
nats-py reads it), a credentials file (`--nats-creds`), and TLS (`tls://` URLs, or any URL with
`--nats-tls-ca` / a client certificate): `NatsSecurity`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.errors import FlushTimeoutError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("dynamo_lite.nats")

CONNECT_TIMEOUT_SECS = 5.0
START_TIMEOUT_SECS = 10.0  # the first connection: a replica that cannot reach NATS fails its start-up
RECONNECT_WAIT_SECS = 0.5
# What a replica may publish while the server is unreachable (nats-py's default is 2 MiB).
PENDING_BYTES = 64 * 1024 * 1024


def add_nats_arguments(parser: argparse.ArgumentParser, *, subject_prefix: str, what: str) -> argparse._ArgumentGroup:
    """`--nats` and `--nats-subject-prefix`; the group, for a service's own NATS flags."""
    group = parser.add_argument_group(
        "replicas (NATS)",
        f"run several replicas that share {what} through a NATS server (2.9 or later, with "
        "JetStream for the indexer); without --nats the process keeps its state to itself",
    )
    group.add_argument("--nats", default=None, metavar="URL",
                       help="NATS server URL, e.g. nats://127.0.0.1:4222 (several: comma-separated)")
    group.add_argument("--nats-subject-prefix", default=subject_prefix,
                       help="prefix of every subject the replicas use; replicas sharing state use the same one, "
                       "and different fleets on one NATS server use different ones")
    group.add_argument("--nats-creds", default=None, metavar="PATH",
                       help="NATS credentials file (user JWT and NKey seed, as nsc writes it); user/password or a "
                       "token go in the URL instead: nats://user:password@host:4222")
    group.add_argument("--nats-tls-ca", default=None, metavar="PATH",
                       help="CA bundle of the NATS server's certificate: TLS to NATS (tls:// URLs use the "
                       "system's CAs without it)")
    group.add_argument("--nats-tls-certfile", default=None, metavar="PATH",
                       help="client certificate (PEM) for a NATS server that verifies clients")
    group.add_argument("--nats-tls-keyfile", default=None, metavar="PATH", help="private key of --nats-tls-certfile")
    return group


@dataclass(frozen=True)
class NatsSecurity:
    """The credentials and TLS settings of the NATS connection (the URL carries user/password
    or a token itself)."""

    creds: str | None = None
    tls_ca: str | None = None
    tls_certfile: str | None = None
    tls_keyfile: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NatsSecurity:
        return cls(args.nats_creds, args.nats_tls_ca, args.nats_tls_certfile, args.nats_tls_keyfile)

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of nats-py's `connect`."""
        options: dict[str, Any] = {}
        if self.creds:
            options["user_credentials"] = self.creds
        if self.tls_ca or self.tls_certfile:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_certfile:
                context.load_cert_chain(self.tls_certfile, self.tls_keyfile)
            options["tls"] = context
        return options


def server_urls(text: str) -> list[str]:
    return [url.strip() for url in text.split(",") if url.strip()]


@dataclass
class ConnectionCounts:
    disconnects: int = 0
    reconnects: int = 0
    errors: int = 0


async def connect(url: str, *, name: str, security: NatsSecurity = NatsSecurity()) -> tuple[Client, ConnectionCounts]:
    """Connect to `url`, retried for `START_TIMEOUT_SECS` (then ConnectionError: the start-up
    fails, and the orchestrator restarts the process), and reconnected forever after that."""
    counts = ConnectionCounts()

    async def disconnected() -> None:
        if client.is_closed or client.is_draining:
            return  # our own shutdown
        counts.disconnects += 1
        logger.warning("disconnected from NATS; reconnecting every %.1fs", RECONNECT_WAIT_SECS)

    async def reconnected() -> None:
        counts.reconnects += 1
        logger.info("reconnected to NATS at %s", client.connected_url.netloc if client.connected_url else url)

    async def error(exc: Exception) -> None:
        counts.errors += 1
        logger.warning("NATS: %s: %s", type(exc).__name__, exc)

    client = Client()
    try:
        await asyncio.wait_for(client.connect(
            server_urls(url),
            name=name,
            # nats-py annotates both as int; it hands them to asyncio as seconds, fractions included.
            connect_timeout=CONNECT_TIMEOUT_SECS,  # type: ignore[arg-type]
            reconnect_time_wait=RECONNECT_WAIT_SECS,  # type: ignore[arg-type]
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            pending_size=PENDING_BYTES,
            # A replica never needs what it published itself back (the indexer's stream
            # deliveries and acknowledgements come from the server, not from this connection).
            no_echo=True,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
            **security.connect_options(),
        ), START_TIMEOUT_SECS)
    except asyncio.TimeoutError:
        with contextlib.suppress(Exception):
            await client.close()
        raise ConnectionError(f"cannot reach the NATS server at {url} within {START_TIMEOUT_SECS:g}s") from None
    logger.info("connected to NATS at %s as %s", client.connected_url.netloc if client.connected_url else url, name)
    return client, counts


# How long a PING of `flush` may wait for its PONG inside nats-py (see `flush`): as long as the
# connection lives. A reconnection drops the PINGs in flight, and this bounds a PING lost then.
PONG_PATIENCE_SECS = 3600


async def flush(client: Client, timeout: float) -> None:
    """`client.flush(timeout)`, without stopping the client's reads when it times out.

    nats-py (2.16) cancels the PING's future when its flush times out but leaves it queued; the
    late PONG then raises InvalidStateError in its read loop, which ends the loop for good: the
    connection still looks up, and nothing arrives on it until a stale-connection check, minutes
    later, reconnects. A process paused longer than a flush's timeout (SIGSTOP, CPU throttling)
    hits this as soon as it resumes: asyncio fires the timeout before it reads the PONG. Here
    nats-py waits for its PONG as long as the connection lives, shielded from our timeout; only
    this call gives up, with nats-py's own FlushTimeoutError."""
    pinging = asyncio.ensure_future(client.flush(timeout=PONG_PATIENCE_SECS))
    pinging.add_done_callback(_retrieve)
    try:
        await asyncio.wait_for(asyncio.shield(pinging), timeout)
    except asyncio.TimeoutError:
        raise FlushTimeoutError from None


def _retrieve(task: asyncio.Future[None]) -> None:
    """Nobody may be waiting for a flush that outlived its caller: read its outcome so asyncio
    does not log it as never retrieved (a closed connection's, or a lost PING's timeout)."""
    if not task.cancelled():
        task.exception()


class NatsCollector(Collector):
    """`dynamo_lite_nats_*`: the connection's state and how often it dropped."""

    def __init__(self, client: Client | None, counts: ConnectionCounts) -> None:
        self.client = client
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        connected = GaugeMetricFamily("dynamo_lite_nats_connected", "1 while connected to the NATS server")
        connected.add_metric([], 1.0 if self.client is not None and self.client.is_connected else 0.0)
        yield connected
        for name, value, text in (
            ("disconnects", self.counts.disconnects, "connections to the NATS server lost"),
            ("reconnects", self.counts.reconnects, "connections to the NATS server restored"),
            ("errors", self.counts.errors, "errors the NATS client reported"),
        ):
            counter = CounterMetricFamily(f"dynamo_lite_nats_{name}", text)
            counter.add_metric([], float(value))
            yield counter
