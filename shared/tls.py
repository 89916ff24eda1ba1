"""TLS for the services' HTTP server, with uvicorn's flag names (`--ssl-certfile`,
`--ssl-keyfile`, `--ssl-ca-certs`), and certificates replaced without a restart.

With `--ssl-ca-certs` every client must present a certificate that CA signed (mutual TLS).

Rotation: the listener's context never changes; its `sni_callback`, which OpenSSL calls for
every handshake (with or without a server name), hands the connection the newest context. A new
context is built from the files on SIGHUP and when their modification time or size changes
(checked every `POLL_SECS`); a context that cannot be built (a key that does not match, a file
half written) is logged and the previous one stays in use. Connections already open keep the
certificate they were made with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("dynamo_lite.tls")

POLL_SECS: Final = 2.0


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files a server context is built from."""

    certfile: str
    keyfile: str | None = None  # None: the key is in `certfile`
    ca_certs: str | None = None  # clients must present a certificate this bundle signed

    def paths(self) -> tuple[str, ...]:
        return tuple(path for path in (self.certfile, self.keyfile, self.ca_certs) if path)

    def context(self) -> ssl.SSLContext:
        """A server context from the files as they are now; `ssl.SSLError` or `OSError` when
        they cannot be used."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs:
            context.load_verify_locations(cafile=self.ca_certs)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def stamp(self) -> tuple[tuple[int, int], ...]:
        """What changes when a file is replaced: (mtime in ns, size) of each, (0, 0) if missing."""
        stamps = []
        for path in self.paths():
            try:
                status = os.stat(path)
            except OSError:
                stamps.append((0, 0))
            else:
                stamps.append((status.st_mtime_ns, status.st_size))
        return tuple(stamps)


class ReloadingContext:
    """The listener's context, whose handshakes use the newest context built from `files`."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = files.stamp()
        self.current = files.context()  # fails at start-up, before the port opens: a bad flag
        self.listener = files.context()
        self.listener.sni_callback = self._select
        self.reloads = 0
        self.failed_reloads = 0

    def _select(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self.current is not context:
            connection.context = self.current
        return None

    def reload(self) -> bool:
        """Build a context from the files now; keep the previous one if they cannot be used."""
        self._stamp = self.files.stamp()
        try:
            context = self.files.context()
        except (ssl.SSLError, OSError, ValueError) as exc:
            self.failed_reloads += 1
            logger.error("TLS files %s not reloaded, the previous certificate stays in use: %s",
                         ", ".join(self.files.paths()), exc)
            return False
        self.current = context
        self.reloads += 1
        logger.info("TLS certificate reloaded from %s", self.files.certfile)
        return True

    def reload_if_changed(self) -> None:
        if self.files.stamp() != self._stamp:
            self.reload()

    async def watch(self, poll_secs: float = POLL_SECS) -> None:
        """Reload on SIGHUP and when a file changes, until cancelled."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            while True:
                await asyncio.sleep(poll_secs)
                self.reload_if_changed()
        finally:
            loop.remove_signal_handler(signal.SIGHUP)


class TlsCollector(Collector):
    """`/metrics` view of the certificate reloads."""

    def __init__(self, context: ReloadingContext) -> None:
        self.context = context

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("dynamo_lite_tls_reloads", "TLS certificates reloaded (SIGHUP or a file changed)",
                                  self.context.reloads)
        yield CounterMetricFamily("dynamo_lite_tls_failed_reloads",
                                  "TLS reloads refused (the files could not be used): the previous certificate "
                                  "stays in use", self.context.failed_reloads)
        yield GaugeMetricFamily("dynamo_lite_tls_client_certificates_required",
                                "1 with --ssl-ca-certs (mutual TLS)", 1 if self.context.files.ca_certs else 0)


__all__ = ["POLL_SECS", "ReloadingContext", "TlsCollector", "TlsFiles"]
