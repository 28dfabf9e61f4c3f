"""Certificates for a local control plane: a CA, serving certificates and service-account keys.

Everything is generated with ``cryptography`` (ECDSA P-256: fast to generate and accepted by
kube-apiserver, Go's TLS stack and aiohttp alike).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=30)
_CLOCK_SKEW = datetime.timedelta(minutes=5)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write the certificate (0644) and the key (0600)."""
        cert_path.write_bytes(self.cert_pem)
        key_path.touch(mode=0o600)
        key_path.write_bytes(self.key_pem)


@dataclass(frozen=True)
class CertificateAuthority:
    """A self-signed CA that issues serving and client certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, common_name: str) -> CertificateAuthority:
        """Generate a new CA key and self-signed certificate."""
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        """Load a CA written by :meth:`write`."""
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{key_path}: expected an EC private key")
        return cls(key, x509.load_pem_x509_certificate(cert_path.read_bytes()))

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate in PEM form (what goes into caBundle / caData)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def cert_b64(self) -> str:
        """The PEM CA certificate, base64-encoded, as kubeconfigs and caBundle fields want it."""
        return base64.b64encode(self.cert_pem).decode("ascii")

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write the CA certificate and key."""
        KeyPair(self.cert_pem, _key_pem(self.key)).write(cert_path, key_path)

    def issue(
        self,
        common_name: str,
        *,
        ip_addresses: Sequence[str] = (),
        dns_names: Sequence[str] = (),
        organizations: Sequence[str] = (),
        server: bool = True,
        client: bool = False,
    ) -> KeyPair:
        """Issue a leaf certificate with the given SANs and extended key usages."""
        key = _new_key()
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attributes += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        alt_names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
        alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def issue_localhost_server(self, common_name: str, *extra_dns: str) -> KeyPair:
        """A serving certificate for ``https://127.0.0.1:<port>`` (IP SAN) and ``localhost``."""
        return self.issue(
            common_name,
            ip_addresses=["127.0.0.1"],
            dns_names=["localhost", *extra_dns],
        )


def service_account_keys(private_path: Path, public_path: Path) -> None:
    """Write a key pair for --service-account-signing-key-file / --service-account-key-file."""
    key = _new_key()
    private_path.touch(mode=0o600)
    private_path.write_bytes(_key_pem(key))
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
