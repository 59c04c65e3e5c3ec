"""Self-signed keys and certificates for the tests that need an X.509 identity: the SAML
service provider and identity providers, and the TLS of the LDAP server the tests start."""

from __future__ import annotations

import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID


def key_and_cert(common_name: str, *, ip_address: str | None = None) -> tuple[str, str]:
    """A new RSA key (PKCS#8 PEM) and a certificate for it (PEM) valid from yesterday for 30
    days; `ip_address`, when given, is the certificate's subject alternative name."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
    )
    if ip_address is not None:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip_address))])
        builder = builder.add_extension(san, critical=False)
    cert = builder.sign(key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return key_pem, cert.public_bytes(serialization.Encoding.PEM).decode()
