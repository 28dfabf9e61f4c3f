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
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes

__all__ = [
    "DEFAULT_RELOAD_INTERVAL",
    "LoadedCertificate",
    "ReloadingTLSContext",
    "TLSLoadError",
    "load_server_tls",
    "new_server_context",
]

logger = logging.getLogger(__name__)

DEFAULT_RELOAD_INTERVAL = 10.0

# Forward-secret AEAD suites only, for TLS 1.2 (TLS 1.3 suites are not set by this string).
# Go's TLS client, used by the kube-apiserver and kube-scheduler, offers all of them.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TLSLoadError(Exception):
    """The certificate and key files could not be loaded as a matching pair."""


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

    Hand :attr:`context` to the server, run :meth:`watch` alongside it (``service.server`` does
    both), and register :meth:`is_loaded` as a readiness check. A pair that fails to load (half
    written, mismatched, unreadable) is logged and the previous pair stays in service; the files
    are looked at again on the next tick.
    """

    def __init__(self, cert_file: Path | str, key_file: Path | str) -> None:
        """Prepare a context for the given PEM files; nothing is loaded until :meth:`reload`."""
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self._front = new_server_context()
        self._front.sni_callback = self._select_current
        self._current: ssl.SSLContext | None = None
        self._loaded_digest: bytes | None = None
        self._failed_digest: bytes | None = None
        self._certificate: LoadedCertificate | None = None
        self.last_error: str | None = None

    @property
    def context(self) -> ssl.SSLContext:
        """The context to give the server; it stays the same object across reloads."""
        return self._front

    @property
    def certificate(self) -> LoadedCertificate | None:
        """The certificate new handshakes receive, or None before the first successful load."""
        return self._certificate

    def is_loaded(self) -> bool:
        """Return True once a certificate is being served (a readiness check)."""
        return self._current is not None

    def reload(self) -> bool:
        """Load the files if their content changed since the last load; return True if it did.

        Never raises for bad files: the failure is logged once per distinct content, kept in
        :attr:`last_error`, and the previous pair keeps serving.
        """
        try:
            cert_pem, before = self._read()
        except OSError as exc:
            self._failed(None, f"cannot read {exc.filename or 'the TLS files'}: {exc.strerror or exc}")
            return False
        if before == self._loaded_digest:
            return False
        candidate = new_server_context()
        try:
            candidate.load_cert_chain(self.cert_file, self.key_file, password=_refuse_password)
            _, after = self._read()
            certificate = _describe(cert_pem)
        except (OSError, ssl.SSLError, TLSLoadError, ValueError) as exc:
            self._failed(before, f"cannot load {self.cert_file} with {self.key_file}: {exc}")
            return False
        if after != before:
            # The files changed while they were being read: the pair loaded is consistent (OpenSSL
            # checks the key against the certificate) but may not be the one the digest names.
            logger.info("TLS files changed while loading; trying again on the next check")
            return False
        self._current = candidate
        self._loaded_digest = before
        self._failed_digest = None
        self._certificate = certificate
        self.last_error = None
        logger.info(
            "serving TLS certificate %s (serial %x, expires %s)",
            certificate.subject,
            certificate.serial_number,
            certificate.not_after.isoformat(),
        )
        return True

    async def watch(self, interval: float = DEFAULT_RELOAD_INTERVAL) -> None:
        """Check the files every ``interval`` seconds until cancelled, reloading on change.

        Content hashes, not modification times, decide: a Secret volume update swaps a symlink
        and may keep the old timestamps.
        """
        while True:
            await asyncio.sleep(interval)
            try:
                self.reload()
            except Exception:
                # A bug here must not end the watcher, or rotation would silently stop.
                logger.exception("unexpected error while reloading TLS files")

    def _select_current(self, connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        current = self._current
        if current is not None:
            connection.context = current

    def _read(self) -> tuple[bytes, bytes]:
        """Return the certificate file's content and a digest of both files."""
        cert_pem = self.cert_file.read_bytes()
        key_pem = self.key_file.read_bytes()
        sha = hashlib.sha256()
        for content in (cert_pem, key_pem):
            # Length-prefixed so that moving bytes from one file to the other changes the digest.
            sha.update(len(content).to_bytes(8, "big"))
            sha.update(content)
        return cert_pem, sha.digest()

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


def load_server_tls(cert_file: Path | str, key_file: Path | str) -> ReloadingTLSContext:
    """Return a :class:`ReloadingTLSContext` with the pair loaded; raise :class:`TLSLoadError` if not.

    Use at start-up so that a service with unusable TLS files fails fast with a clear message.
    """
    tls = ReloadingTLSContext(cert_file, key_file)
    if not tls.reload():
        raise TLSLoadError(tls.last_error or "TLS files could not be loaded")
    return tls


def _refuse_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key and block.
    raise TLSLoadError("the private key is encrypted; a serving key must be unencrypted")


def _describe(cert_pem: bytes) -> LoadedCertificate:
    leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    return LoadedCertificate(
        serial_number=leaf.serial_number,
        subject=leaf.subject.rfc4514_string(),
        not_after=leaf.not_valid_after_utc,
        sha256_fingerprint=leaf.fingerprint(hashes.SHA256()).hex(),
    )
