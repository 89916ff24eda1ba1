"""Self-signed certificate authorities for the TLS tests, made with the `openssl` command (the
`cryptography` package is not a dependency)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    certfile: Path
    keyfile: Path

    @property
    def cert(self) -> tuple[str, str]:
        return str(self.certfile), str(self.keyfile)


@dataclass(frozen=True)
class Authority:
    """A CA in `directory` that issues server and client certificates."""

    directory: Path
    certfile: Path
    keyfile: Path

    @classmethod
    def create(cls, directory: Path, name: str = "dynamo-lite-test-ca") -> Authority:
        if shutil.which("openssl") is None:
            pytest.skip("the openssl command is needed to make test certificates")
        directory.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
                 cwd=directory)
        return cls(directory, directory / f"{name}.pem", directory / f"{name}.key")

    def issue(self, name: str, *, client: bool = False, server: bool = True) -> Pair:
        """A certificate for `name` (and 127.0.0.1, localhost) signed by this CA, for a server,
        a client (`client=True, server=False`), or both."""
        usage = ",".join([*(["serverAuth"] if server else []), *(["clientAuth"] if client else [])])
        extensions = self.directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=self.directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(self.certfile), "-CAkey", str(self.keyfile),
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", extensions.name,
                 cwd=self.directory)
        return Pair(self.directory / f"{name}.pem", self.directory / f"{name}.key")

    def client_context(self, cert: Pair | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.certfile))
        if cert is not None:
            context.load_cert_chain(*cert.cert)
        return context


def peer_common_name(context: ssl.SSLContext, host: str, port: int) -> str:
    """The CN of the certificate a server presents to a new connection."""
    import socket

    with socket.create_connection((host, port), timeout=10) as raw, context.wrap_socket(raw, server_hostname=host) as tls:
        subject = dict(item[0] for item in tls.getpeercert()["subject"])  # type: ignore[index]
        return str(subject["commonName"])
