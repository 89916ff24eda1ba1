"""TLS of the picker's gRPC port: the server certificate, and optionally Envoy's client certificate.

ext_proc carries no credentials of its own, so the way to let only the gateway call the picker is
mutual TLS: with `--client-ca`, a caller must present a certificate that CA signed (Envoy's
`ext_proc` cluster sets one in its `UpstreamTlsContext`), and any other caller fails the
handshake before it can open a stream.

The files are read again when they change, as the services' certificates are: gRPC asks
`CertificateFiles.fetch` at every handshake, which compares the files' modification times (a
`stat` each, no read) and hands gRPC the new certificate and CA only when one moved. A file that
cannot be read or parsed keeps the last good configuration and is logged once per change.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass

import grpc

log = logging.getLogger("dynamo_lite.epp")


@dataclass(frozen=True)
class _Loaded:
    stamps: tuple[tuple[int, int], ...]  # (mtime_ns, size) per file, in (cert, key, ca) order
    configuration: grpc.ServerCertificateConfiguration


class CertificateFiles:
    """The server certificate and key, and the client CA when callers must present a certificate."""

    def __init__(self, certfile: str, keyfile: str, client_ca: str | None = None) -> None:
        self.paths = tuple(path for path in (certfile, keyfile, client_ca) if path is not None)
        self.client_ca = client_ca
        self._loaded = self._load()  # raises: a start with unusable files is refused
        self._refused: tuple[tuple[int, int], ...] | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._loaded.configuration, self.fetch, require_client_authentication=self.client_ca is not None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake callback (on one of its threads): a new configuration, or None to
        keep the current one. Never raises: a broken file must not take the port down. Two
        handshakes at once may both load a changed file; each assignment is whole, so the worst
        is one extra read."""
        try:
            stamps = self._stamps()
        except OSError:
            return None  # a file is being replaced: the next handshake looks again
        if stamps == self._loaded.stamps or stamps == self._refused:
            return None
        try:
            self._loaded = self._load()
        except (OSError, ValueError, ssl.SSLError) as error:
            self._refused = stamps
            log.warning("gRPC TLS files not reloaded, the previous ones stay in force: %s", error)
            return None
        log.info("gRPC TLS files reloaded: %s", ", ".join(self.paths))
        return self._loaded.configuration

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        return tuple((status.st_mtime_ns, status.st_size) for status in map(os.stat, self.paths))

    def _load(self) -> _Loaded:
        stamps = self._stamps()
        certfile, keyfile = self.paths[0], self.paths[1]
        # The ssl module checks that the pair is PEM and matches, which gRPC would only find out
        # at the next handshake, refusing it.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
        with open(certfile, "rb") as f:
            cert = f.read()
        with open(keyfile, "rb") as f:
            key = f.read()
        root = None
        if self.client_ca is not None:
            ssl.create_default_context(cafile=self.client_ca)  # refuses a file with no certificate
            with open(self.client_ca, "rb") as f:
                root = f.read()
        configuration = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=root)
        return _Loaded(stamps, configuration)
