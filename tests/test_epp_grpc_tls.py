"""`CertificateFiles`, the picker's gRPC TLS files: read at start (unusable files refuse the
start), read again at a handshake only when one changed, and a broken replacement keeps the last
good ones. The handshakes themselves run against a real Envoy in test_epp_security.py."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
from support.tls_support import Authority

from dynamo_lite.epp.grpc_tls import CertificateFiles

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.create(tmp_path_factory.mktemp("grpc-tls"))


def _touch_later(*paths: Path) -> None:
    for path in paths:
        status = path.stat()
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))


def test_nothing_is_read_again_until_a_file_changes(authority: Authority, tmp_path: Path) -> None:
    pair = authority.issue("grpc-tls-a")
    files = CertificateFiles(str(pair.certfile), str(pair.keyfile), str(authority.certfile))
    assert files.fetch() is None and files.fetch() is None
    renewed = authority.issue("grpc-tls-b")
    pair.keyfile.write_bytes(renewed.keyfile.read_bytes())
    pair.certfile.write_bytes(renewed.certfile.read_bytes())
    _touch_later(pair.certfile, pair.keyfile)
    assert files.fetch() is not None  # the new pair, handed to gRPC once
    assert files.fetch() is None


def test_a_broken_replacement_keeps_the_last_good_files(authority: Authority, caplog: pytest.LogCaptureFixture) -> None:
    pair = authority.issue("grpc-tls-c")
    good_cert = pair.certfile.read_bytes()
    files = CertificateFiles(str(pair.certfile), str(pair.keyfile))
    pair.certfile.write_bytes(b"not a certificate\n")
    _touch_later(pair.certfile)
    assert files.fetch() is None
    assert "gRPC TLS files not reloaded" in caplog.text
    caplog.clear()
    assert files.fetch() is None and caplog.text == ""  # logged once per change, not per handshake
    pair.certfile.write_bytes(good_cert)
    _touch_later(pair.certfile)
    assert files.fetch() is not None


def test_a_key_that_does_not_match_or_a_missing_file_refuses_the_start(authority: Authority, tmp_path: Path) -> None:
    first, second = authority.issue("grpc-tls-d"), authority.issue("grpc-tls-e")
    with pytest.raises(ssl.SSLError):
        CertificateFiles(str(first.certfile), str(second.keyfile))
    with pytest.raises(FileNotFoundError):
        CertificateFiles(str(first.certfile), str(first.keyfile), str(tmp_path / "missing-ca.pem"))
    empty_ca = tmp_path / "empty.pem"
    empty_ca.write_text("")
    with pytest.raises(ssl.SSLError):  # a CA file with no certificate in it
        CertificateFiles(str(first.certfile), str(first.keyfile), str(empty_ca))
