"""TLS for the EPP's ext_proc listener, as the Gateway API reference EPP serves it.

The reference EPP (``--secure-serving``, on by default) reads ``tls.crt`` and ``tls.key``
from ``--cert-path``, the layout of a mounted ``kubernetes.io/tls`` Secret, and makes a
self-signed certificate when none is given. kvmesh does the same (``EppConfig.cert_path``);
a self-signed certificate encrypts but no gateway can verify it, so start-up says so.

:func:`make_certificate` (``cryptography``) also issues the test CA and the certificates
that the local Envoy of :mod:`kvmesh.harness.envoy` verifies.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
from collections.abc import Sequence
from pathlib import Path

from kvmesh.errors import ConfigError

log = logging.getLogger(__name__)

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
SELF_SIGNED_NAMES = ("kvmesh-epp", "localhost", "127.0.0.1")


def make_certificate(
    names: Sequence[str],
    issuer: tuple[bytes, bytes] | None = None,
    *,
    ca: bool = False,
    days: int = 365,
) -> tuple[bytes, bytes]:
    """A PEM ``(certificate, private key)`` for ``names`` (DNS names or IP addresses, the
    first also the common name), signed by ``issuer`` (a PEM ``(cert, key)``; None: by
    itself). ``ca``: a CA certificate that may sign others. EC P-256 keys."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    if issuer is None:
        issuer_name, signer = subject, key
    else:
        issuer_cert = x509.load_pem_x509_certificate(issuer[0])
        issuer_name = issuer_cert.subject
        loaded = serialization.load_pem_private_key(issuer[1], password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ConfigError("the issuer's key must be an EC key (make it with make_certificate)")
        signer = loaded
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
    cert = builder.sign(signer, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_pair(directory: str | Path, cert: bytes, key: bytes) -> Path:
    """Write ``tls.crt`` and ``tls.key`` (mode 600) into ``directory``; return it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / CERT_FILE).write_bytes(cert)
    key_path = d / KEY_FILE
    key_path.touch(mode=0o600)
    key_path.write_bytes(key)
    return d


def server_pair(cert_path: str | None) -> tuple[bytes, bytes]:
    """The ``(certificate chain, key)`` the ext_proc listener serves (see the module docstring)."""
    if cert_path is None:
        log.warning(
            "kvmesh epp: no cert_path: ext_proc is served over TLS with a self-signed certificate "
            "that the gateway cannot verify; mount a kubernetes.io/tls Secret and set cert_path"
        )
        return make_certificate(SELF_SIGNED_NAMES)
    d = Path(cert_path)
    try:
        cert, key = (d / CERT_FILE).read_bytes(), (d / KEY_FILE).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cert_path {cert_path!r}: cannot read {CERT_FILE}/{KEY_FILE}: {exc}") from None
    if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
        raise ConfigError(
            f"cert_path {cert_path!r}: {CERT_FILE} and {KEY_FILE} must be PEM (a kubernetes.io/tls Secret)"
        )
    return cert, key
