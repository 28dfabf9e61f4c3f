"""Certificates for a local control plane, on top of :mod:`vramguard.io.certs`.

One CA signs the kube-apiserver's serving certificate and the vramguard services' (IP SAN
127.0.0.1); a second one, as kubeadm sets it up, signs the aggregation layer's front-proxy client
certificate. Service-account token signing needs a bare key pair.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from vramguard.io import certs

LEAF_DAYS = 30


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
    """A CA that issues the control plane's serving and client certificates."""

    authority: certs.CertificateAuthority

    @classmethod
    def create(cls, common_name: str) -> CertificateAuthority:
        """Generate a new CA key and self-signed certificate."""
        return cls(certs.create_ca(common_name))

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        """Load a CA written by :meth:`write`."""
        return cls(certs.load_ca(cert_path, key_path))

    @property
    def cert(self) -> x509.Certificate:
        """The CA certificate."""
        return self.authority.certificate

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate in PEM form (what goes into caBundle / caData)."""
        return self.authority.cert_pem()

    @property
    def cert_b64(self) -> str:
        """The PEM CA certificate, base64-encoded, as kubeconfigs and caBundle fields want it."""
        return base64.b64encode(self.cert_pem).decode("ascii")

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write the CA certificate and key."""
        KeyPair(self.cert_pem, self.authority.key_pem()).write(cert_path, key_path)

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
        """Issue a serving certificate (``server``) or a client certificate (``client``)."""
        if server == client:
            raise ValueError("issue either a serving or a client certificate")
        if server:
            leaf = certs.issue_serving_certificate(
                self.authority, dns_names=dns_names, ip_addresses=ip_addresses, common_name=common_name, days=LEAF_DAYS
            )
        else:
            leaf = certs.issue_client_certificate(
                self.authority, common_name, organizations=organizations, days=LEAF_DAYS
            )
        return KeyPair(leaf.cert_pem(), leaf.key_pem())

    def issue_localhost_server(self, common_name: str, *extra_dns: str) -> KeyPair:
        """A serving certificate for ``https://127.0.0.1:<port>`` (IP SAN) and ``localhost``."""
        return self.issue(common_name, ip_addresses=["127.0.0.1"], dns_names=["localhost", *extra_dns])


def service_account_keys(private_path: Path, public_path: Path) -> None:
    """Write a key pair for --service-account-signing-key-file / --service-account-key-file."""
    key = certs.generate_private_key()
    private_path.touch(mode=0o600)
    private_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
