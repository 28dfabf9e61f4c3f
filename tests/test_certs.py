"""Certificates from vramguard.io.certs: names, usages, chain, validity, files, and loading a CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from vramguard.io import certs

SERVICE, NAMESPACE = "vramguard-webhook", "gpu-system"
NOW = dt.datetime(2026, 1, 15, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def ca() -> certs.CertificateAuthority:
    return certs.create_ca("test CA", now=NOW)


@pytest.fixture(scope="module")
def leaf(ca: certs.CertificateAuthority) -> certs.ServingCertificate:
    return certs.issue_service_certificate(
        ca,
        SERVICE,
        NAMESPACE,
        extra_dns_names=["webhook.example.test", "*.gpu.example.test"],
        ip_addresses=["127.0.0.1", "::1"],
        now=NOW,
    )


def _pem_files(tmp_path: Path, leaf: certs.ServingCertificate) -> certs.ServingFiles:
    return certs.write_serving_files(tmp_path / "tls", leaf)


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str) -> None:
    """Run a TLS handshake in memory; raise what the client raises (e.g. a verification error)."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client_side = client.wrap_bio(client_in, client_out, server_hostname=server_hostname)
    server_side = server.wrap_bio(server_in, server_out, server_side=True)
    client_done = server_done = False
    for _ in range(10):
        if not client_done:
            try:
                client_side.do_handshake()
                client_done = True
            except ssl.SSLWantReadError:
                pass
        server_in.write(client_out.read())
        if not server_done:
            try:
                server_side.do_handshake()
                server_done = True
            except ssl.SSLWantReadError:
                pass
        client_in.write(server_out.read())
        if client_done and server_done:
            return
    raise AssertionError("handshake did not finish")


def _python_contexts(files: certs.ServingFiles) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files.tls_cert, files.tls_key)
    client = ssl.create_default_context(cafile=str(files.ca_cert))
    return server, client


SERVED_NAMES = [
    pytest.param(SERVICE, id="service"),
    pytest.param(f"{SERVICE}.{NAMESPACE}", id="service.namespace"),
    pytest.param(f"{SERVICE}.{NAMESPACE}.svc", id="service.namespace.svc"),
    pytest.param(f"{SERVICE}.{NAMESPACE}.svc.cluster.local", id="fully-qualified"),
    pytest.param("webhook.example.test", id="extra-dns"),
    pytest.param("any.gpu.example.test", id="extra-wildcard"),
    pytest.param("127.0.0.1", id="ipv4"),
    pytest.param("::1", id="ipv6"),
]
NOT_SERVED_NAMES = [
    pytest.param(f"other.{NAMESPACE}.svc", id="other-service"),
    pytest.param(f"{SERVICE}.other.svc", id="other-namespace"),
    pytest.param("a.b.gpu.example.test", id="wildcard-one-label-only"),
    pytest.param("127.0.0.2", id="other-ip"),
]


@pytest.mark.parametrize("hostname", SERVED_NAMES)
def test_python_ssl_verifies_served_names_against_the_ca(tmp_path: Path, hostname: str) -> None:
    # The files are valid now, not at NOW: issue with the real clock for a live handshake.
    fresh = certs.issue_service_certificate(
        certs.create_ca(),
        SERVICE,
        NAMESPACE,
        extra_dns_names=["webhook.example.test", "*.gpu.example.test"],
        ip_addresses=["127.0.0.1", "::1"],
    )
    server, client = _python_contexts(_pem_files(tmp_path, fresh))
    _handshake(server, client, hostname)


@pytest.mark.parametrize("hostname", NOT_SERVED_NAMES)
def test_python_ssl_rejects_other_names(tmp_path: Path, hostname: str) -> None:
    fresh = certs.issue_service_certificate(
        certs.create_ca(),
        SERVICE,
        NAMESPACE,
        extra_dns_names=["*.gpu.example.test"],
        ip_addresses=["127.0.0.1"],
    )
    server, client = _python_contexts(_pem_files(tmp_path, fresh))
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client, hostname)


def test_python_ssl_rejects_a_certificate_from_another_ca(tmp_path: Path) -> None:
    fresh = certs.issue_service_certificate(certs.create_ca(), SERVICE, NAMESPACE)
    files = _pem_files(tmp_path, fresh)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files.tls_cert, files.tls_key)
    stranger = tmp_path / "other-ca.crt"
    stranger.write_bytes(certs.create_ca().cert_pem())
    client = ssl.create_default_context(cafile=str(stranger))
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client, f"{SERVICE}.{NAMESPACE}.svc")


def _subject(name: str) -> x509.DNSName | x509.IPAddress:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


@pytest.mark.parametrize("hostname", SERVED_NAMES)
def test_webpki_verifier_accepts_the_chain(
    ca: certs.CertificateAuthority, leaf: certs.ServingCertificate, hostname: str
) -> None:
    # cryptography's verifier applies the CA/Browser Forum profile, stricter than OpenSSL's
    # defaults and close to what Go's crypto/x509 demands of the chain.
    verifier = (
        PolicyBuilder()
        .store(Store([ca.certificate]))
        .time(NOW + dt.timedelta(days=1))
        .build_server_verifier(_subject(hostname))
    )
    chain = verifier.verify(leaf.certificate, [])
    assert chain[-1] == ca.certificate


@pytest.mark.parametrize("hostname", NOT_SERVED_NAMES)
def test_webpki_verifier_rejects_other_names(
    ca: certs.CertificateAuthority, leaf: certs.ServingCertificate, hostname: str
) -> None:
    verifier = (
        PolicyBuilder()
        .store(Store([ca.certificate]))
        .time(NOW + dt.timedelta(days=1))
        .build_server_verifier(_subject(hostname))
    )
    with pytest.raises(VerificationError):
        verifier.verify(leaf.certificate, [])


def test_ca_is_a_self_signed_signing_only_ca(ca: certs.CertificateAuthority) -> None:
    cert = ca.certificate
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert cert.issuer == cert.subject
    cert.verify_directly_issued_by(cert)
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=certs.CA_VALIDITY_DAYS)
    assert isinstance(ca.private_key, ec.EllipticCurvePrivateKey)
    assert ca.private_key.curve.name == "secp256r1"


def test_leaf_is_a_server_certificate_signed_by_the_ca(
    ca: certs.CertificateAuthority, leaf: certs.ServingCertificate
) -> None:
    cert = leaf.certificate
    leaf.certificate.verify_directly_issued_by(ca.certificate)
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert constraints.critical and not constraints.value.ca
    assert usage.digital_signature and not usage.key_encipherment and not usage.key_cert_sign
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=certs.LEAF_VALIDITY_DAYS)
    assert cert.not_valid_before_utc < NOW
    ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert leaf.ca_pem() == ca.cert_pem()


def test_leaf_names_are_the_service_names_then_extras(leaf: certs.ServingCertificate) -> None:
    san = leaf.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [
        SERVICE,
        f"{SERVICE}.{NAMESPACE}",
        f"{SERVICE}.{NAMESPACE}.svc",
        f"{SERVICE}.{NAMESPACE}.svc.cluster.local",
        "webhook.example.test",
        "*.gpu.example.test",
    ]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    cn = leaf.certificate.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
    assert cn == f"{SERVICE}.{NAMESPACE}.svc"


def test_duplicate_and_upper_case_names_are_folded(ca: certs.CertificateAuthority) -> None:
    leaf = certs.issue_service_certificate(
        ca,
        SERVICE,
        NAMESPACE,
        extra_dns_names=[f"{SERVICE}.{NAMESPACE}.SVC", "Extra.Example.Test."],
        ip_addresses=["127.0.0.1", "127.0.0.1"],
        now=NOW,
    )
    san = leaf.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName)[-1] == "extra.example.test"
    assert len(san.get_values_for_type(x509.DNSName)) == 5
    assert len(san.get_values_for_type(x509.IPAddress)) == 1


def test_cluster_domain_is_configurable(ca: certs.CertificateAuthority) -> None:
    assert certs.service_dns_names("svc", "ns", "corp.internal")[-1] == "svc.ns.svc.corp.internal"


@pytest.mark.parametrize(
    ("key_type", "expected_key", "size", "signature_hash"),
    [
        pytest.param("ecdsa-p256", ec.EllipticCurvePrivateKey, 256, hashes.SHA256, id="ecdsa-p256"),
        pytest.param("ecdsa-p384", ec.EllipticCurvePrivateKey, 384, hashes.SHA384, id="ecdsa-p384"),
        pytest.param("rsa-2048", rsa.RSAPrivateKey, 2048, hashes.SHA256, id="rsa-2048"),
    ],
)
def test_key_types(
    key_type: certs.KeyType, expected_key: type, size: int, signature_hash: type[hashes.HashAlgorithm]
) -> None:
    ca = certs.create_ca(key_type=key_type, now=NOW)
    leaf = certs.issue_service_certificate(ca, "svc", "ns", key_type=key_type, now=NOW)
    assert isinstance(leaf.private_key, expected_key)
    assert leaf.private_key.key_size == size
    assert isinstance(leaf.certificate.signature_hash_algorithm, signature_hash)
    usage = leaf.certificate.extensions.get_extension_for_class(x509.KeyUsage).value
    # RSA key exchange needs keyEncipherment; an ECDSA key cannot encipher at all.
    assert usage.key_encipherment is (expected_key is rsa.RSAPrivateKey)


def test_validity_is_configurable(ca: certs.CertificateAuthority) -> None:
    leaf = certs.issue_service_certificate(ca, "svc", "ns", days=30, now=NOW)
    assert leaf.certificate.not_valid_after_utc - NOW == dt.timedelta(days=30)


@pytest.mark.parametrize(
    ("service", "namespace", "extra", "ips", "days", "message"),
    [
        pytest.param("Bad_Name", "ns", [], [], 365, "invalid service name", id="service-not-dns-label"),
        pytest.param("9svc", "ns", [], [], 365, "invalid service name", id="service-starts-with-digit"),
        pytest.param("svc", "ns.sub", [], [], 365, "invalid namespace", id="namespace-with-dot"),
        pytest.param("svc", "x" * 64, [], [], 365, "invalid namespace", id="namespace-too-long"),
        pytest.param("svc", "ns", ["bad name"], [], 365, "invalid DNS name", id="dns-with-space"),
        pytest.param("svc", "ns", ["a.*.test"], [], 365, "invalid DNS name", id="wildcard-not-leftmost"),
        pytest.param("svc", "ns", ["ünï.test"], [], 365, "invalid DNS name", id="dns-not-ascii"),
        pytest.param("svc", "ns", [], ["300.1.1.1"], 365, "invalid IP address", id="ip-out-of-range"),
        pytest.param("svc", "ns", [], ["localhost"], 365, "invalid IP address", id="ip-is-a-name"),
        pytest.param("svc", "ns", [], [], 0, "at least 1 day", id="zero-days"),
        pytest.param("svc", "ns", [], [], 4000, "use at most", id="leaf-outlives-ca"),
    ],
)
def test_bad_input_is_a_certificate_error(
    ca: certs.CertificateAuthority,
    service: str,
    namespace: str,
    extra: list[str],
    ips: list[str],
    days: int,
    message: str,
) -> None:
    with pytest.raises(certs.CertificateError, match=message):
        certs.issue_service_certificate(
            ca, service, namespace, extra_dns_names=extra, ip_addresses=ips, days=days, now=NOW
        )


def test_an_expired_ca_cannot_sign() -> None:
    old = certs.create_ca(days=1, now=NOW - dt.timedelta(days=10))
    with pytest.raises(certs.CertificateError, match="expired"):
        certs.issue_service_certificate(old, "svc", "ns", now=NOW)


def test_a_leaf_needs_a_name(ca: certs.CertificateAuthority) -> None:
    with pytest.raises(certs.CertificateError, match="at least one"):
        certs.issue_serving_certificate(ca, dns_names=[], now=NOW)


def test_ip_only_leaf(ca: certs.CertificateAuthority) -> None:
    leaf = certs.issue_serving_certificate(ca, dns_names=[], ip_addresses=["10.0.0.1"], now=NOW)
    cn = leaf.certificate.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
    assert cn == "10.0.0.1"


def test_files_have_secret_key_names_and_safe_modes(tmp_path: Path, leaf: certs.ServingCertificate) -> None:
    files = _pem_files(tmp_path, leaf)
    assert {path.name for path in (tmp_path / "tls").iterdir()} == {"ca.crt", "tls.crt", "tls.key"}
    assert stat.S_IMODE(files.tls_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.tls_cert.stat().st_mode) == 0o644
    assert stat.S_IMODE(files.ca_cert.stat().st_mode) == 0o644
    assert x509.load_pem_x509_certificate(files.tls_cert.read_bytes()) == leaf.certificate
    key = serialization.load_pem_private_key(files.tls_key.read_bytes(), password=None)
    assert key.public_key() == leaf.private_key.public_key()


def test_files_are_replaced_in_place(tmp_path: Path, ca: certs.CertificateAuthority) -> None:
    first = certs.issue_service_certificate(ca, "svc", "ns", now=NOW)
    second = certs.issue_service_certificate(ca, "svc", "ns", now=NOW)
    _pem_files(tmp_path, first)
    files = _pem_files(tmp_path, second)
    assert x509.load_pem_x509_certificate(files.tls_cert.read_bytes()) == second.certificate
    # No temporary files are left behind next to the real ones.
    assert sorted(path.name for path in (tmp_path / "tls").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]


def test_load_ca_round_trip_issues_leaves_the_old_bundle_verifies(tmp_path: Path) -> None:
    original = certs.create_ca()
    certs.write_ca_key(tmp_path / "ca.key", original)
    (tmp_path / "ca.crt").write_bytes(original.cert_pem())
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600

    loaded = certs.load_ca(tmp_path / "ca.crt", tmp_path / "ca.key")
    leaf = certs.issue_service_certificate(loaded, SERVICE, NAMESPACE)
    server, client = _python_contexts(_pem_files(tmp_path, leaf))
    _handshake(server, client, f"{SERVICE}.{NAMESPACE}.svc")
    assert loaded.cert_pem() == original.cert_pem()


def test_load_ca_with_an_encrypted_key(tmp_path: Path) -> None:
    ca = certs.create_ca()
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem())
    (tmp_path / "ca.key").write_bytes(
        ca.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    assert certs.load_ca(tmp_path / "ca.crt", tmp_path / "ca.key", password=b"secret").cert_pem() == ca.cert_pem()
    with pytest.raises(certs.CertificateError, match="encrypted"):
        certs.load_ca(tmp_path / "ca.crt", tmp_path / "ca.key")


def _write_ca_inputs(tmp_path: Path, case: str) -> tuple[Path, Path]:
    ca = certs.create_ca()
    other = certs.create_ca()
    leaf = certs.issue_service_certificate(ca, "svc", "ns")
    cert_file, key_file = tmp_path / "ca.crt", tmp_path / "ca.key"
    cert_pem, key_pem = ca.cert_pem(), ca.key_pem()
    if case == "missing-cert":
        cert_file = tmp_path / "absent.crt"
    elif case == "not-pem":
        cert_pem = b"not a certificate"
    elif case == "key-not-pem":
        key_pem = b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    elif case == "key-of-another-ca":
        key_pem = other.key_pem()
    elif case == "leaf-not-ca":
        cert_pem, key_pem = leaf.cert_pem(), leaf.key_pem()
    if cert_file.name != "absent.crt":
        cert_file.write_bytes(cert_pem)
    key_file.write_bytes(key_pem)
    return cert_file, key_file


@pytest.mark.parametrize(
    ("case", "message"),
    [
        pytest.param("missing-cert", "cannot read CA certificate", id="missing-cert"),
        pytest.param("not-pem", "not a PEM certificate", id="not-pem"),
        pytest.param("key-not-pem", "not a PEM private key", id="key-not-pem"),
        pytest.param("key-of-another-ca", "is not the private key", id="key-of-another-ca"),
        pytest.param("leaf-not-ca", "is not a CA certificate", id="leaf-not-ca"),
    ],
)
def test_load_ca_errors(tmp_path: Path, case: str, message: str) -> None:
    cert_file, key_file = _write_ca_inputs(tmp_path, case)
    with pytest.raises(certs.CertificateError, match=message):
        certs.load_ca(cert_file, key_file)


def test_naive_time_is_refused() -> None:
    with pytest.raises(certs.CertificateError, match="timezone"):
        certs.create_ca(now=dt.datetime(2026, 1, 1))  # a naive datetime, on purpose


def test_client_certificate_names_user_and_groups(ca: certs.CertificateAuthority) -> None:
    leaf = certs.issue_client_certificate(ca, "front-proxy-client", organizations=["system:masters"], now=NOW)
    subject = leaf.certificate.subject
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "front-proxy-client"
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    usages = leaf.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(x509.ExtensionNotFound):
        leaf.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
