"""Certificates for the webhook and the extender: a private CA and serving certificates it signs,
and the client certificate kube-scheduler presents to the extender (mutual TLS).

The kube-apiserver calls a webhook over HTTPS and checks the serving certificate against the
``caBundle`` of the webhook configuration, by the DNS name of the Service
(``<service>.<namespace>.svc``); the scheduler calls the extender the same way. A private CA per
installation is enough: nothing outside the cluster needs to trust it.

Everything here is built with ``cryptography``; no certificate logic is written by hand.
Keys are ECDSA P-256 by default: small, fast, and accepted by Go's TLS stack.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import tempfile
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT_FILE",
    "CA_VALIDITY_DAYS",
    "CLIENT_VALIDITY_DAYS",
    "DEFAULT_KEY_TYPE",
    "KEY_TYPES",
    "LEAF_VALIDITY_DAYS",
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "CertificateAuthority",
    "CertificateError",
    "IPAddress",
    "KeyType",
    "PrivateKey",
    "ServingCertificate",
    "ServingFiles",
    "ca_from_pem",
    "create_ca",
    "generate_private_key",
    "issue_client_certificate",
    "issue_service_certificate",
    "issue_serving_certificate",
    "load_ca",
    "parse_ip_addresses",
    "service_dns_names",
    "write_atomic",
    "write_ca_key",
    "write_serving_files",
]

# File names of a ``kubernetes.io/tls`` Secret, so a directory written here can be turned into
# one as-is (``kubectl create secret generic NAME --from-file=DIR``).
CA_CERT_FILE = "ca.crt"
TLS_CERT_FILE = "tls.crt"
TLS_KEY_FILE = "tls.key"

CA_VALIDITY_DAYS = 3650
LEAF_VALIDITY_DAYS = 365
# kube-scheduler reads its extender client certificate only at start, so renewing it means a
# restart of the control plane's scheduler: issued for longer than serving certificates.
CLIENT_VALIDITY_DAYS = 1825

# Backdating notBefore keeps a freshly issued certificate valid on a node whose clock runs a
# little behind the machine that issued it.
_CLOCK_SKEW = dt.timedelta(minutes=5)

KeyType = Literal["ecdsa-p256", "ecdsa-p384", "rsa-2048", "rsa-3072", "rsa-4096"]
KEY_TYPES: tuple[KeyType, ...] = typing.get_args(KeyType)
DEFAULT_KEY_TYPE: KeyType = "ecdsa-p256"

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Kubernetes name rules: a Service name is an RFC 1035 label, a namespace an RFC 1123 label.
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class CertificateError(ValueError):
    """Bad input for a certificate, or a CA that cannot sign one; the message says which."""


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA certificate and the private key that signs with it."""

    certificate: x509.Certificate
    private_key: PrivateKey

    def cert_pem(self) -> bytes:
        """Return the CA certificate in PEM, the form ``caBundle`` carries (base64 of this)."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """Return the CA private key as unencrypted PKCS#8 PEM."""
        return _key_pem(self.private_key)


@dataclass(frozen=True)
class ServingCertificate:
    """A serving (leaf) certificate, its private key, and the CA certificate that signed it."""

    certificate: x509.Certificate
    private_key: PrivateKey
    ca_certificate: x509.Certificate

    def cert_pem(self) -> bytes:
        """Return the leaf certificate in PEM (the CA is not appended: clients hold it already)."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """Return the leaf private key as unencrypted PKCS#8 PEM."""
        return _key_pem(self.private_key)

    def ca_pem(self) -> bytes:
        """Return the signing CA certificate in PEM."""
        return self.ca_certificate.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class ServingFiles:
    """Paths written by :func:`write_serving_files`."""

    ca_cert: Path
    tls_cert: Path
    tls_key: Path


def generate_private_key(key_type: KeyType = DEFAULT_KEY_TYPE) -> PrivateKey:
    """Generate a new private key of ``key_type`` (ECDSA P-256 unless told otherwise)."""
    match key_type:
        case "ecdsa-p256":
            return ec.generate_private_key(ec.SECP256R1())
        case "ecdsa-p384":
            return ec.generate_private_key(ec.SECP384R1())
        case "rsa-2048" | "rsa-3072" | "rsa-4096":
            return rsa.generate_private_key(public_exponent=65537, key_size=int(key_type[4:]))
    raise CertificateError(f"unknown key type {key_type!r}; expected one of {', '.join(KEY_TYPES)}")


def create_ca(
    common_name: str = "vramguard CA",
    *,
    days: int = CA_VALIDITY_DAYS,
    key_type: KeyType = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
) -> CertificateAuthority:
    """Create a self-signed CA valid for ``days`` days, allowed to sign leaf certificates only.

    ``now`` fixes the issue time (for tests); it defaults to the current UTC time.
    """
    _check_days(days)
    if not common_name.strip():
        raise CertificateError("the CA common name must not be empty")
    key = generate_private_key(key_type)
    issued = _utc(now)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    public_key = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(issued - _CLOCK_SKEW)
        .not_valid_after(issued + dt.timedelta(days=days))
        # path_length=0: this CA signs serving certificates, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(key, _signature_hash(key))
    )
    return CertificateAuthority(certificate=certificate, private_key=key)


def service_dns_names(service: str, namespace: str, cluster_domain: str = "cluster.local") -> list[str]:
    """Return the DNS names a Service is reached by, shortest first.

    ``<service>``, ``<service>.<namespace>``, ``<service>.<namespace>.svc`` (the one the
    kube-apiserver uses for webhooks) and ``<service>.<namespace>.svc.<cluster_domain>``.
    """
    if not _DNS1035_LABEL.fullmatch(service):
        raise CertificateError(
            f"invalid service name {service!r}: expected a DNS-1035 label "
            "(lower-case letters, digits and '-', starting with a letter, at most 63 characters)"
        )
    if not _DNS1123_LABEL.fullmatch(namespace):
        raise CertificateError(
            f"invalid namespace {namespace!r}: expected a DNS-1123 label "
            "(lower-case letters, digits and '-', at most 63 characters)"
        )
    domain = _normalise_dns_name(cluster_domain, allow_wildcard=False, what="cluster domain")
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.{domain}",
    ]


def parse_ip_addresses(values: Iterable[str | IPAddress]) -> list[IPAddress]:
    """Parse IP addresses for IP SANs; raise :class:`CertificateError` naming the first bad one."""
    addresses: list[IPAddress] = []
    for value in values:
        if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
            addresses.append(value)
            continue
        try:
            addresses.append(ipaddress.ip_address(value.strip()))
        except ValueError:
            raise CertificateError(f"invalid IP address {value!r}") from None
    return addresses


def issue_serving_certificate(
    ca: CertificateAuthority,
    *,
    dns_names: Sequence[str],
    ip_addresses: Iterable[str | IPAddress] = (),
    common_name: str | None = None,
    days: int = LEAF_VALIDITY_DAYS,
    key_type: KeyType = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
) -> ServingCertificate:
    """Issue a TLS server certificate signed by ``ca`` for the given DNS names and IP addresses.

    The certificate carries the serverAuth extended key usage and is not a CA. Its validity must
    end before the CA's does: a leaf outliving its CA would fail verification early, so that is
    refused here rather than discovered later.
    """
    names = _dedupe(_normalise_dns_name(name, allow_wildcard=True, what="DNS name") for name in dns_names)
    addresses = _dedupe(parse_ip_addresses(ip_addresses))
    if not names and not addresses:
        raise CertificateError("a serving certificate needs at least one DNS name or IP address")
    subject_cn = common_name or (names[0] if names else str(addresses[0]))
    return _issue_leaf(
        ca, subject_cn, [ExtendedKeyUsageOID.SERVER_AUTH], names, addresses, (), days, key_type, now
    )


def issue_client_certificate(
    ca: CertificateAuthority,
    common_name: str,
    *,
    organizations: Sequence[str] = (),
    days: int = LEAF_VALIDITY_DAYS,
    key_type: KeyType = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
) -> ServingCertificate:
    """Issue a TLS client certificate (clientAuth) for ``common_name`` in ``organizations``.

    Kubernetes reads the user from the common name and the groups from the organizations.
    """
    if not common_name.strip():
        raise CertificateError("a client certificate needs a common name")
    return _issue_leaf(
        ca, common_name, [ExtendedKeyUsageOID.CLIENT_AUTH], [], [], organizations, days, key_type, now
    )


def _issue_leaf(
    ca: CertificateAuthority,
    common_name: str,
    usages: list[x509.ObjectIdentifier],
    names: Sequence[str],
    addresses: Sequence[IPAddress],
    organizations: Sequence[str],
    days: int,
    key_type: KeyType,
    now: dt.datetime | None,
) -> ServingCertificate:
    _check_days(days)
    issued = _utc(now)
    not_before = issued - _CLOCK_SKEW
    not_after = issued + dt.timedelta(days=days)
    ca_cert = ca.certificate
    if ca_cert.not_valid_after_utc <= issued:
        raise CertificateError(f"the CA expired on {ca_cert.not_valid_after_utc:%Y-%m-%d}; create a new CA")
    if not_after > ca_cert.not_valid_after_utc:
        days_left = (ca_cert.not_valid_after_utc - issued).days
        raise CertificateError(
            f"the CA expires on {ca_cert.not_valid_after_utc:%Y-%m-%d}, before a {days}-day certificate "
            f"would; use at most {days_left} days or a new CA"
        )

    key = generate_private_key(key_type)
    public_key = key.public_key()
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]
    subject += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(max(not_before, ca_cert.not_valid_before_utc))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                # RSA key exchange (TLS 1.2 without ECDHE) encrypts with the key; ECDSA keys never do.
                key_encipherment=isinstance(key, rsa.RSAPrivateKey),
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(_authority_key_identifier(ca_cert), critical=False)
    )
    san: list[x509.GeneralName] = [x509.DNSName(name) for name in names]
    san += [x509.IPAddress(address) for address in addresses]
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    certificate = builder.sign(ca.private_key, _signature_hash(ca.private_key))
    return ServingCertificate(certificate=certificate, private_key=key, ca_certificate=ca_cert)


def issue_service_certificate(
    ca: CertificateAuthority,
    service: str,
    namespace: str,
    *,
    extra_dns_names: Sequence[str] = (),
    ip_addresses: Iterable[str | IPAddress] = (),
    cluster_domain: str = "cluster.local",
    days: int = LEAF_VALIDITY_DAYS,
    key_type: KeyType = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
) -> ServingCertificate:
    """Issue a serving certificate for a Kubernetes Service (see :func:`service_dns_names`).

    ``extra_dns_names`` and ``ip_addresses`` are added as further SANs, e.g. ``127.0.0.1`` for a
    control plane that reaches the service on the loopback address.
    """
    names = [*service_dns_names(service, namespace, cluster_domain), *extra_dns_names]
    return issue_serving_certificate(
        ca,
        dns_names=names,
        ip_addresses=ip_addresses,
        common_name=f"{service}.{namespace}.svc",
        days=days,
        key_type=key_type,
        now=now,
    )


def is_ca_certificate(certificate: x509.Certificate) -> bool:
    """Whether ``certificate`` may sign others (``basicConstraints: CA:TRUE``)."""
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    return constraints.ca


def load_ca(cert_file: Path | str, key_file: Path | str, password: bytes | None = None) -> CertificateAuthority:
    """Load an existing CA from PEM files, to issue a new leaf without changing ``caBundle``.

    Raises :class:`CertificateError` when a file cannot be read, the key does not belong to the
    certificate, or the certificate is not a CA allowed to sign certificates.
    """
    cert_path, key_path = Path(cert_file), Path(key_file)
    return ca_from_pem(
        _read(cert_path, "CA certificate"), _read(key_path, "CA key"), password, where=(str(cert_path), str(key_path))
    )


def ca_from_pem(
    cert_bytes: bytes, key_bytes: bytes, password: bytes | None = None, *, where: tuple[str, str] = ("ca", "key")
) -> CertificateAuthority:
    """A CA from its PEM certificate and key (``where`` names them in errors); see :func:`load_ca`."""
    cert_path, key_path = where
    try:
        certificate = x509.load_pem_x509_certificate(cert_bytes)
    except ValueError:
        raise CertificateError(f"{cert_path}: not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_bytes, password=password)
    except TypeError:
        # cryptography raises TypeError when a password is missing or given for a plain key.
        raise CertificateError(f"{key_path}: the key is encrypted (or a password was given for a plain key)") from None
    except ValueError:
        raise CertificateError(f"{key_path}: not a PEM private key, or a wrong password") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise CertificateError(f"{key_path}: unsupported key type {type(key).__name__}; use ECDSA or RSA")
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(der, spki) != certificate.public_key().public_bytes(der, spki):
        raise CertificateError(f"{key_path} is not the private key of the certificate in {cert_path}")
    if not is_ca_certificate(certificate):
        raise CertificateError(f"{cert_path} is not a CA certificate (basicConstraints CA:TRUE is missing)")
    try:
        usage = certificate.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.key_cert_sign:
        raise CertificateError(f"{cert_path}: the CA's key usage does not allow signing certificates")
    return CertificateAuthority(certificate=certificate, private_key=key)


def write_serving_files(out_dir: Path | str, leaf: ServingCertificate) -> ServingFiles:
    """Write ``ca.crt``, ``tls.crt`` and ``tls.key`` into ``out_dir`` (created if missing).

    Each file is replaced atomically, so a server watching the directory never reads half a file;
    the key is written 0600 from the start, never briefly readable by others. The CA certificate
    goes first and the leaf certificate last, so a reader that sees the new leaf also finds the
    CA that signed it.
    """
    directory = Path(out_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CertificateError(f"cannot create {directory}: {exc.strerror or exc}") from None
    files = ServingFiles(
        ca_cert=directory / CA_CERT_FILE,
        tls_cert=directory / TLS_CERT_FILE,
        tls_key=directory / TLS_KEY_FILE,
    )
    write_atomic(files.ca_cert, leaf.ca_pem(), 0o644)
    write_atomic(files.tls_key, leaf.key_pem(), 0o600)
    write_atomic(files.tls_cert, leaf.cert_pem(), 0o644)
    return files


def write_ca_key(path: Path | str, ca: CertificateAuthority) -> Path:
    """Write the CA private key (0600) to ``path``, for issuing later leaves with :func:`load_ca`."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CertificateError(f"cannot create {target.parent}: {exc.strerror or exc}") from None
    write_atomic(target, ca.key_pem(), 0o600)
    return target


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )


def _signature_hash(key: PrivateKey) -> hashes.SHA256 | hashes.SHA384:
    # Match the hash to the curve strength (RFC 5480); SHA-256 for P-256 and for RSA.
    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.key_size > 256:
        return hashes.SHA384()
    return hashes.SHA256()


def _authority_key_identifier(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    # Reuse the CA's own SubjectKeyIdentifier when it has one, so chain building matches exactly.
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        public_key = ca_cert.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
            raise CertificateError("the CA key must be ECDSA or RSA") from None
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key)
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _normalise_dns_name(name: str, *, allow_wildcard: bool, what: str) -> str:
    candidate = name.strip().rstrip(".").lower()
    labels = candidate.split(".")
    if allow_wildcard and len(labels) > 1 and labels[0] == "*":
        labels = labels[1:]
    if not candidate or len(candidate) > 253 or not all(_DNS1123_LABEL.fullmatch(label) for label in labels):
        raise CertificateError(
            f"invalid {what} {name!r}: expected lower-case letters, digits, '-' and '.' "
            "(labels of at most 63 characters)"
        )
    return candidate


def _check_days(days: int) -> None:
    if days < 1:
        raise CertificateError(f"validity must be at least 1 day, got {days}")


def _utc(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        raise CertificateError("now must be timezone-aware")
    return now.astimezone(dt.UTC)


_T = typing.TypeVar("_T")


def _dedupe(items: Iterable[_T]) -> list[_T]:
    # Order matters for readers (the first SAN is the CN); dict keeps first occurrences in order.
    return list(dict.fromkeys(items))


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CertificateError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` at once (readers see the old file or the new, never a part), mode
    ``mode`` from the start; :class:`CertificateError` when it cannot be written."""
    # mkstemp creates the file 0600 in the target directory (same filesystem, so the rename is
    # atomic); the mode is then set exactly, independent of the umask.
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise CertificateError(f"cannot write {path}: {exc.strerror or exc}") from None
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CertificateError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
