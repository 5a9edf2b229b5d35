"""kvmesh.epp.tls: the ext_proc certificate as the reference EPP takes it, and its failures."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from kvmesh.epp.config import EppConfig
from kvmesh.epp.server import EppServer
from kvmesh.epp.tls import make_certificate, server_pair, write_pair
from kvmesh.errors import ConfigError


def test_issued_certificate_names_and_chain(tmp_path: Path) -> None:
    ca = make_certificate(["test CA"], ca=True)
    cert, key = make_certificate(["kvmesh-epp", "10.0.0.7"], issuer=ca)
    leaf = x509.load_pem_x509_certificate(cert)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["kvmesh-epp"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca[0]))
    d = write_pair(tmp_path / "tls", cert, key)
    assert server_pair(str(d)) == (cert, key)
    assert (d / "tls.key").stat().st_mode & 0o077 == 0  # the key is the owner's only


def test_missing_or_bad_certificates_stop_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        server_pair(str(tmp_path / "nowhere"))
    d = write_pair(tmp_path / "empty", b"", b"")
    with pytest.raises(ConfigError, match="PEM"):
        server_pair(str(d))
    with pytest.raises(ConfigError, match="PEM"):  # when the server is made, not later on its loop
        EppServer(EppConfig(cert_path=str(d)))
    EppServer(EppConfig(secure_serving=False, cert_path=str(d)))  # plaintext reads no certificate
