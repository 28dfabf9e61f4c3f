"""The extender's verbs answer kube-scheduler only: mutual TLS against the process the harness runs.

kube-scheduler presents the client certificate the harness issued for it (``tlsConfig.certFile``),
so every scheduling test in ``e2e/test_extender.py`` goes through the same check. Here, requests
over real HTTPS from clients without that certificate: the TLS handshake refuses them before any
HTTP is read, so not even an error response comes back. Probes and metrics answer on the
plain-HTTP ops port without any certificate.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from cryptography import x509

from e2e.scenario import require_extender
from vramguard.io import certs

pytestmark = pytest.mark.timeout(120)

BIND = b'{"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": "n"}'


def _extender(cluster: Any) -> tuple[str, str]:
    """The verbs URL and the ops URL of the harness's extender."""
    require_extender(cluster)
    ops = (getattr(cluster.state, "vramguard_ops", None) or {}).get("extender")
    if not ops or not hasattr(cluster, "client_ssl_context"):
        pytest.skip("this cluster's extender was not started by the harness")
    return str(cluster.state.vramguard["extender"]), str(ops)


def _post(url: str, path: str, body: bytes, context: ssl.SSLContext, method: str = "POST") -> bytes | str:
    """One request over one TLS connection; the raw response, or the TLS error that ended the exchange."""
    parts = urlsplit(url)
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    try:
        with (
            socket.create_connection((parts.hostname, parts.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=parts.hostname) as tls,
        ):
            tls.sendall(request)
            received = b""
            while chunk := tls.recv(65536):
                received += chunk
            return received
    except (ssl.SSLError, ConnectionError) as exc:
        # TLS 1.3: the client's handshake completes first; the server's alert (certificate
        # required / unknown CA) then ends the connection on the first read.
        return f"{type(exc).__name__}: {exc}"


def _client_with(cluster: Any, tmp_path: Path, presenting: str) -> ssl.SSLContext:
    context: ssl.SSLContext = cluster.ssl_context()
    if presenting == "none":
        return context
    leaf = certs.issue_client_certificate(certs.create_ca("not the extender's client CA"), "kube-scheduler")
    (tmp_path / "c.crt").write_bytes(leaf.cert_pem())
    (tmp_path / "c.key").write_bytes(leaf.key_pem())
    context.load_cert_chain(tmp_path / "c.crt", tmp_path / "c.key")
    return context


@pytest.mark.parametrize(
    "presenting",
    [
        pytest.param("none", id="no-client-certificate"),
        pytest.param("other-ca", id="client-certificate-from-another-ca"),
    ],
)
def test_bind_without_the_schedulers_certificate_gets_no_http_response(
    cluster: Any, tmp_path: Path, presenting: str
) -> None:
    verbs, _ = _extender(cluster)
    outcome = _post(verbs, "/bind", BIND, _client_with(cluster, tmp_path, presenting))
    assert isinstance(outcome, str) or not outcome.startswith(b"HTTP/"), outcome
    # The same request with kube-scheduler's certificate reaches HTTP: the refusal above was TLS.
    answered = _post(verbs, "/bind", b"{}", cluster.client_ssl_context())
    assert isinstance(answered, bytes) and answered.startswith(b"HTTP/1.1 400"), answered


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:  # plain HTTP: no certificate at all
        return int(response.status), response.read().decode()


def test_probes_and_metrics_need_no_client_certificate(cluster: Any) -> None:
    verbs, ops = _extender(cluster)
    assert urlsplit(ops).scheme == "http"
    _post(verbs, "/bind", b"{}", cluster.client_ssl_context())  # a call from "kube-scheduler"
    assert _get(ops + "/readyz")[0] == 200
    assert _get(ops + "/healthz")[0] == 200
    status, metrics = _get(ops + "/metrics")
    assert status == 200
    expiry = dict(re.findall(r'vramguard_certificate_expiry_timestamp_seconds\{role="([a-z-]+)"\} (\S+)', metrics))
    # Not the client's own certificate: the native TLS shows the extender no peer certificate.
    assert set(expiry) == {"serving", "client-ca"}
    client_ca = x509.load_pem_x509_certificate((cluster.pki / "ca.crt").read_bytes())
    assert float(expiry["client-ca"]) == client_ca.not_valid_after_utc.timestamp()
    assert all(float(value) > time.time() for value in expiry.values())
    # The verbs port serves the verbs only, even to kube-scheduler.
    for path in ("/metrics", "/readyz"):
        answered = _post(verbs, path, b"", cluster.client_ssl_context(), method="GET")
        assert isinstance(answered, bytes) and answered.startswith(b"HTTP/1.1 404"), (path, answered)


def test_the_verbs_are_offered_over_http2_to_the_schedulers_certificate(cluster: Any) -> None:
    # kube-scheduler's extender client takes HTTP/2 when offered: one connection for a whole wave.
    verbs, _ = _extender(cluster)
    parts = urlsplit(verbs)
    context = cluster.client_ssl_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    with (
        socket.create_connection((parts.hostname, parts.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=parts.hostname) as tls,
    ):
        assert tls.selected_alpn_protocol() == "h2"
