"""TLS for the services' HTTP server, with uvicorn's flag names (`--ssl-certfile`,
`--ssl-keyfile`, `--ssl-ca-certs`), and certificates replaced without a restart.

With `--ssl-ca-certs` every client must present a certificate that CA signed (mutual TLS).

Rotation: the listener's context never changes; its `sni_callback`, which OpenSSL calls for
every handshake (with or without a server name), hands the connection the newest context. A new
context is built from the files on SIGHUP and when their modification time or size changes
(`dynamo_lite.web.reloading`); a context that cannot be built (a key that does not match, a file
half written) is logged and the previous one stays in use. Connections already open keep the
certificate they were made with.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .reloading import file_stamp

logger = logging.getLogger("dynamo_lite.tls")


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



class ReloadingContext:
    """The listener's context, whose handshakes use the newest context built from `files`."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = file_stamp(files.paths())
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
        self._stamp = file_stamp(self.files.paths())
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
        if file_stamp(self.files.paths()) != self._stamp:
            self.reload()


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


__all__ = ["ReloadingContext", "TlsCollector", "TlsFiles"]
