"""Server-side TLS whose certificate follows its files, for certificates rotated while serving.

A Kubernetes Secret mounted as a volume is updated in place (the kubelet swaps a symlink), and
cert-manager or ``vramguard certs`` rotate the pair there; the services pick up the new pair
without a restart and without dropping a request.

How: the server is given one *front* context whose SNI callback, run for every handshake (with
``server_name`` None when the client sends no SNI), points the connection at the *current*
context. A reload builds a fresh context from the files and, only if the pair loads, makes it
current. New handshakes get the new certificate; established connections keep the one they
negotiated. Loading into the serving context in place is avoided on purpose: when
``load_cert_chain`` fails half-way (a new certificate with the old key, as seen while a pair is
being replaced), OpenSSL has already dropped the old key and every later handshake fails.

Mutual TLS: with a client CA file, every handshake must present a client certificate that chains
to it and carries the clientAuth usage (OpenSSL checks the purpose), or the handshake fails before
any HTTP is read. The CA file is reloaded with the pair. The requirement itself is set on the
front context, not only on the current one, because OpenSSL copies the verify mode into the
connection when it is created, before the SNI callback switches contexts; the trusted CAs are
looked up in the current context at verification time. Either way a missing piece fails closed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vramguard.io.certs import is_ca_certificate

__all__ = [
    "CERTIFICATE_EXPIRY_METRIC",
    "DEFAULT_RELOAD_INTERVAL",
    "CertificateExpiryCollector",
    "LoadedCertificate",
    "PemFiles",
    "ReloadingTLSContext",
    "TLSLoadError",
    "load_server_tls",
    "new_server_context",
]

logger = logging.getLogger(__name__)

DEFAULT_RELOAD_INTERVAL = 10.0
CERTIFICATE_EXPIRY_METRIC = "vramguard_certificate_expiry_timestamp_seconds"

# Forward-secret AEAD suites only, for TLS 1.2 (TLS 1.3 suites are not set by this string).
# Go's TLS client, used by the kube-apiserver and kube-scheduler, offers all of them.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TLSLoadError(Exception):
    """The certificate and key files could not be loaded as a matching pair."""


@dataclass(frozen=True)
class PemFiles:
    """The content of the TLS files as one load read and validated them (a consistent set)."""

    certificate: bytes
    key: bytes
    client_ca: bytes | None


@dataclass(frozen=True)
class LoadedCertificate:
    """What the server presents now: enough to log, alert on expiry, and compare in tests."""

    serial_number: int
    subject: str
    not_after: dt.datetime
    sha256_fingerprint: str


def new_server_context() -> ssl.SSLContext:
    """Return a server context with the settings every vramguard listener uses: TLS 1.2 or later,
    forward-secret AEAD ciphers, ALPN ``http/1.1`` (aiohttp does not speak HTTP/2)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(_TLS12_CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    context.set_alpn_protocols(["http/1.1"])
    return context


class ReloadingTLSContext:
    """A server TLS context that serves the pair currently in ``cert_file`` / ``key_file``.

    Hand :attr:`context` to the server, run :meth:`watch` alongside it (``vramguard.io.server`` does
    both), and register :meth:`is_loaded` as a readiness check. A pair that fails to load (half
    written, mismatched, unreadable) is logged and the previous pair stays in service; the files
    are looked at again on the next tick.
    """

    def __init__(
        self, cert_file: Path | str, key_file: Path | str, client_ca_file: Path | str | None = None
    ) -> None:
        """Prepare a context for the given PEM files; nothing is loaded until :meth:`reload`.

        With ``client_ca_file`` (PEM, one or more CA certificates) clients must present a
        certificate signed by one of those CAs (mutual TLS).
        """
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.client_ca_file = Path(client_ca_file) if client_ca_file is not None else None
        self._front = new_server_context()
        if self.client_ca_file is not None:
            self._front.verify_mode = ssl.CERT_REQUIRED
        self._front.sni_callback = self._select_current
        self._current: ssl.SSLContext | None = None
        self._loaded_digest: bytes | None = None
        self._pem: PemFiles | None = None
        self._failed_digest: bytes | None = None
        self._certificate: LoadedCertificate | None = None
        self._client_cas: tuple[LoadedCertificate, ...] = ()
        self.last_error: str | None = None

    @property
    def requires_client_certificate(self) -> bool:
        """Whether handshakes without a client certificate from the client CA are refused."""
        return self.client_ca_file is not None

    @property
    def client_cas(self) -> tuple[LoadedCertificate, ...]:
        """The CA certificates client certificates are checked against now (empty without mTLS)."""
        return self._client_cas

    @property
    def context(self) -> ssl.SSLContext:
        """The context to give the server; it stays the same object across reloads."""
        return self._front

    @property
    def certificate(self) -> LoadedCertificate | None:
        """The certificate new handshakes receive, or None before the first successful load."""
        return self._certificate

    @property
    def pem(self) -> PemFiles | None:
        """The files' content as last loaded and validated, or None before the first load: what a
        server that reads certificates from files of its own is given (never a half-rotated pair)."""
        return self._pem

    def is_loaded(self) -> bool:
        """Return True once a certificate is being served (a readiness check)."""
        return self._current is not None

    def reload(self) -> bool:
        """Load the files if their content changed since the last load; return True if it did.

        Never raises for bad files: the failure is logged once per distinct content, kept in
        :attr:`last_error`, and the previous pair keeps serving.
        """
        try:
            pem, before = self._read()
        except OSError as exc:
            self._failed(None, f"cannot read {exc.filename or 'the TLS files'}: {exc.strerror or exc}")
            return False
        cert_pem, ca_pem = pem.certificate, pem.client_ca
        if before == self._loaded_digest:
            return False
        candidate = new_server_context()
        try:
            candidate.load_cert_chain(self.cert_file, self.key_file, password=_refuse_password)
            certificate = _describe(cert_pem)
        except (OSError, ssl.SSLError, TLSLoadError, ValueError) as exc:
            self._failed(before, f"cannot load {self.cert_file} with {self.key_file}: {exc}")
            return False
        client_cas: tuple[LoadedCertificate, ...] = ()
        if ca_pem is not None:
            try:
                client_cas = _trust_client_cas(candidate, ca_pem)
            except (ssl.SSLError, TLSLoadError, ValueError) as exc:
                self._failed(before, f"cannot load the client CA {self.client_ca_file}: {exc}")
                return False
        try:
            _, after = self._read()
        except OSError as exc:
            self._failed(None, f"cannot read {exc.filename or 'the TLS files'}: {exc.strerror or exc}")
            return False
        if after != before:
            # The files changed while they were being read: the pair loaded is consistent (OpenSSL
            # checks the key against the certificate) but may not be the one the digest names.
            logger.info("TLS files changed while loading; trying again on the next check")
            return False
        self._current = candidate
        self._loaded_digest = before
        self._pem = pem
        self._failed_digest = None
        self._certificate = certificate
        self._client_cas = client_cas
        self.last_error = None
        logger.info(
            "serving TLS certificate %s (serial %x, expires %s)",
            certificate.subject,
            certificate.serial_number,
            certificate.not_after.isoformat(),
        )
        for ca in client_cas:
            logger.info("requiring client certificates signed by %s (expires %s)", ca.subject, ca.not_after.isoformat())
        return True

    async def watch(
        self, interval: float = DEFAULT_RELOAD_INTERVAL, on_change: Callable[[], None] | None = None
    ) -> None:
        """Check the files every ``interval`` seconds until cancelled, reloading on change, and
        calling ``on_change`` after each change loaded (a server that reads the files itself).

        Content hashes, not modification times, decide: a Secret volume update swaps a symlink
        and may keep the old timestamps.
        """
        while True:
            await asyncio.sleep(interval)
            try:
                if self.reload() and on_change is not None:
                    on_change()
            except Exception:
                # A bug here must not end the watcher, or rotation would silently stop.
                logger.exception("unexpected error while reloading TLS files")

    def _select_current(self, connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        current = self._current
        if current is not None:
            connection.context = current

    def _read(self) -> tuple[PemFiles, bytes]:
        """Return the files' content and a digest of all of them."""
        cert_pem = self.cert_file.read_bytes()
        key_pem = self.key_file.read_bytes()
        ca_pem = self.client_ca_file.read_bytes() if self.client_ca_file is not None else None
        sha = hashlib.sha256()
        for content in (cert_pem, key_pem, ca_pem or b""):
            # Length-prefixed so that moving bytes from one file to another changes the digest.
            sha.update(len(content).to_bytes(8, "big"))
            sha.update(content)
        return PemFiles(cert_pem, key_pem, ca_pem), sha.digest()

    def _failed(self, digest: bytes | None, message: str) -> None:
        self.last_error = message
        if digest is not None and digest == self._failed_digest:
            logger.debug("%s", message)
            return
        self._failed_digest = digest
        if self._current is None:
            logger.error("%s; TLS is not ready", message)
        else:
            logger.warning("%s; still serving the previous certificate", message)


class CertificateExpiryCollector(Collector):
    """``vramguard_certificate_expiry_timestamp_seconds{role}``: when the loaded certificates expire.

    Read from the :class:`ReloadingTLSContext` at scrape time, so a reload shows on the next
    scrape. Roles: ``serving`` (the certificate presented to clients) and ``client-ca`` (the
    soonest-expiring CA client certificates are checked against, with mutual TLS). Nothing is
    exported before it is known. The certificate a client presents is not among them: the native
    server that checks it shows the application no peer certificate (RSGI has no field for it);
    where ``vramguard keep-certs`` issues kube-scheduler's, it exports that one's expiry.
    """

    def __init__(self, tls: ReloadingTLSContext) -> None:
        """Export the certificates of ``tls``."""
        self._tls = tls

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield one gauge family with a sample per loaded role."""
        family = GaugeMetricFamily(
            CERTIFICATE_EXPIRY_METRIC,
            "Unix time at which a loaded certificate expires (notAfter), by role.",
            labels=["role"],
        )
        serving = self._tls.certificate
        if serving is not None:
            family.add_metric(["serving"], serving.not_after.timestamp())
        if self._tls.client_cas:
            family.add_metric(["client-ca"], min(ca.not_after for ca in self._tls.client_cas).timestamp())
        yield family


def load_server_tls(
    cert_file: Path | str, key_file: Path | str, client_ca_file: Path | str | None = None
) -> ReloadingTLSContext:
    """Return a :class:`ReloadingTLSContext` with the files loaded; raise :class:`TLSLoadError` if not.

    Use at start-up so that a service with unusable TLS files fails fast with a clear message.
    """
    tls = ReloadingTLSContext(cert_file, key_file, client_ca_file)
    if not tls.reload():
        raise TLSLoadError(tls.last_error or "TLS files could not be loaded")
    return tls


def _refuse_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key and block.
    raise TLSLoadError("the private key is encrypted; a serving key must be unencrypted")


def _trust_client_cas(context: ssl.SSLContext, ca_pem: bytes) -> tuple[LoadedCertificate, ...]:
    """Make ``context`` require client certificates from the CAs in ``ca_pem``; describe them.

    Every certificate in the file must be a CA: a leaf put there by mistake would otherwise
    become a trust anchor of its own.
    """
    cas = x509.load_pem_x509_certificates(ca_pem)  # ValueError when there is none
    for ca in cas:
        if not is_ca_certificate(ca):
            raise TLSLoadError(f"{ca.subject.rfc4514_string()} is not a CA certificate (basicConstraints CA:TRUE)")
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=ca_pem.decode("ascii"))
    return tuple(_describe_certificate(ca) for ca in cas)


def _describe(cert_pem: bytes) -> LoadedCertificate:
    return _describe_certificate(x509.load_pem_x509_certificates(cert_pem)[0])


def _describe_certificate(certificate: x509.Certificate) -> LoadedCertificate:
    return LoadedCertificate(
        serial_number=certificate.serial_number,
        subject=certificate.subject.rfc4514_string(),
        not_after=certificate.not_valid_after_utc,
        sha256_fingerprint=certificate.fingerprint(hashes.SHA256()).hex(),
    )
