"""Certificates for TLS tests, made in the test (the `cryptography` package): a CA of one's own
and a server certificate it signs for 127.0.0.1.

Import it as ``import tlskit`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Issued:
    ca: Path  # the CA's certificate (what a client trusts)
    cert: Path  # the server's certificate
    key: Path  # the server's private key (mode 0600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.now(UTC)
    return (
        x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=1))
    )  # fmt: skip


def _pem(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass(frozen=True)
class Ca:
    path: Path
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def make_ca(directory: Path, name: str = "sandstream test CA") -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(name, name, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False,
        ), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return Ca(_pem(directory / (name.replace(" ", "-").replace("'", "") + ".pem"), cert), cert, key)


def issue_for_localhost(directory: Path, dns_names: Sequence[str] = ("localhost",)) -> Issued:
    """A CA and a server certificate for 127.0.0.1 and ``dns_names`` signed by it."""
    ca = make_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName(
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), *map(x509.DNSName, dns_names)]
    )
    issuer = ca.cert.subject.rfc4514_string().removeprefix("CN=")
    cert = (
        _builder("127.0.0.1", issuer, key)
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca.key, hashes.SHA256())
    )
    key_path = directory / "server.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Issued(ca.path, _pem(directory / "server.pem", cert), key_path)


def pem_keystore(issued: Issued) -> Path:
    """The server's key followed by its certificate, in one file (mode 0600): a PEM keystore as
    Kafka's ``ssl.keystore.type=PEM`` reads it."""
    path = issued.key.with_name("server-keystore.pem")
    path.touch(mode=0o600)
    path.write_bytes(issued.key.read_bytes() + issued.cert.read_bytes())
    return path
