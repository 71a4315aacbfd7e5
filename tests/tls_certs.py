"""Certificates a test makes (``cryptography``): a CA, a server certificate for 127.0.0.1 and
localhost, and a client certificate for mutual TLS, all signed by that CA, written as PEM."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["TlsFiles", "make_tls_files"]


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path  # the server's
    key: Path
    client_cert: Path
    client_key: Path
    other_key: Path  # a key that matches no certificate here


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _signed(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    elif server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
        builder = builder.add_extension(usage, critical=False)
    else:
        usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
        builder = builder.add_extension(usage, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls_files(folder: Path) -> TlsFiles:
    keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(4)]
    ca_key, server_key, client_key, other_key = keys
    ca = _signed("shardserve test CA", ca_key, "shardserve test CA", ca_key, ca=True)
    server = _signed("localhost", server_key, "shardserve test CA", ca_key, server=True)
    client = _signed("a client", client_key, "shardserve test CA", ca_key)
    files = TlsFiles(
        ca=folder / "ca.pem",
        cert=folder / "server.pem",
        key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        other_key=folder / "other.key",
    )
    pem = serialization.Encoding.PEM
    files.ca.write_bytes(ca.public_bytes(pem))
    files.cert.write_bytes(server.public_bytes(pem))
    files.key.write_bytes(_key_pem(server_key))
    files.client_cert.write_bytes(client.public_bytes(pem))
    files.client_key.write_bytes(_key_pem(client_key))
    files.other_key.write_bytes(_key_pem(other_key))
    return files
