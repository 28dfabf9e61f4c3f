"""The certificate keeper (`vramguard keep-certs`) against the real API server: a pass creates the CA
and the three TLS Secrets, sets the webhook configurations' caBundle and records kube-scheduler's
digest; the certificates it issues complete a mutual-TLS handshake by the names the API server and
kube-scheduler use; a second pass changes nothing."""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ADMISSION = "/apis/admissionregistration.k8s.io/v1"


def configuration(kind: str, name: str) -> dict[str, Any]:
    """A webhook configuration whose one entry is never called (it matches no operation's object)."""
    webhook = {
        "name": "never.keeper.test", "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "failurePolicy": "Ignore",
        "clientConfig": {"service": {"namespace": "default", "name": "nothing", "path": "/"}},
        "rules": [{"apiGroups": ["keeper.test"], "apiVersions": ["v1"], "resources": ["nothings"],
                   "operations": ["CREATE"]}],
    }
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": name},
            "webhooks": [webhook]}


@pytest.fixture
def installed(cluster: Any, unique: str) -> Iterator[tuple[str, str]]:
    """A namespace with a scheduler Deployment, and webhook configurations of the test's own name."""
    if not hasattr(cluster, "request"):
        pytest.skip("needs the local cluster")
    namespace, name = f"keeper-{unique}", f"keeper-{unique}"
    cluster.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    cluster.request("POST", f"{ADMISSION}/validatingwebhookconfigurations",
                    configuration("ValidatingWebhookConfiguration", name))
    cluster.request("POST", f"{ADMISSION}/mutatingwebhookconfigurations",
                    configuration("MutatingWebhookConfiguration", name))
    labels = {"app": "scheduler"}
    cluster.request("POST", f"/apis/apps/v1/namespaces/{namespace}/deployments", {
        "metadata": {"name": "vramguard-scheduler"},
        "spec": {"replicas": 0, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "s", "image": "registry.k8s.io/kube-scheduler:v1.36.3"}]}}},
    })
    yield namespace, name
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        cluster.request("DELETE", f"{ADMISSION}/{kind}/{name}")
    cluster.request("DELETE", f"/api/v1/namespaces/{namespace}")


def keep(cluster: Any, namespace: str, name: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "vramguard", "keep-certs", "--once", "--namespace", namespace,
         "--webhook-configuration", name, "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def secret(cluster: Any, namespace: str, name: str) -> dict[str, bytes]:
    obj = cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    return {key: base64.b64decode(value) for key, value in obj["data"].items()}


def handshake(server: dict[str, bytes], client: dict[str, bytes], server_name: str) -> str:
    """A mutual-TLS handshake on loopback between the two Secrets' certificates, as the extender
    (requiring a client certificate signed by its ca.crt) and kube-scheduler (checking the server's
    name against the bundle) make it; returns the client certificate's subject the server saw."""
    with tempfile.TemporaryDirectory() as scratch:
        files = {}
        for role, data in (("server", server), ("client", client)):
            for key in ("tls.crt", "tls.key", "ca.crt"):
                path = Path(scratch) / f"{role}-{key}"
                path.write_bytes(data[key])
                files[f"{role}-{key}"] = str(path)
        serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        serving.load_cert_chain(files["server-tls.crt"], files["server-tls.key"])
        serving.load_verify_locations(files["server-ca.crt"])
        serving.verify_mode = ssl.CERT_REQUIRED
        calling = ssl.create_default_context(cafile=files["client-ca.crt"])
        calling.load_cert_chain(files["client-tls.crt"], files["client-tls.key"])
        listener = socket.create_server(("127.0.0.1", 0))
        seen: list[str] = []

        def serve() -> None:
            connection, _ = listener.accept()
            with serving.wrap_socket(connection, server_side=True) as tls:
                peer: Any = tls.getpeercert()
                seen.append(next(value for rdn in peer["subject"] for key, value in rdn if key == "commonName"))
                tls.sendall(b"ok")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection(listener.getsockname()) as raw, \
                calling.wrap_socket(raw, server_hostname=server_name) as tls:
            assert tls.recv(2) == b"ok"
        thread.join(timeout=10)
        listener.close()
        return seen[0]


def test_one_pass_provisions_everything_and_the_certificates_work(cluster: Any, installed: tuple[str, str]) -> None:
    namespace, name = installed
    out = keep(cluster, namespace, name)
    assert "vramguard-webhook-tls" in out and "vramguard-scheduler-client-tls" in out, out
    bundle = secret(cluster, namespace, "vramguard-ca")["ca.crt"]
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        obj = cluster.request("GET", f"{ADMISSION}/{kind}/{name}")
        assert base64.b64decode(obj["webhooks"][0]["clientConfig"]["caBundle"]) == bundle
    deployment = cluster.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/vramguard-scheduler")
    assert "vramguard.io/certificates" in deployment["spec"]["template"]["metadata"]["annotations"]
    extender = secret(cluster, namespace, "vramguard-extender-tls")
    scheduler = secret(cluster, namespace, "vramguard-scheduler-client-tls")
    # kube-scheduler's tlsConfig.serverName is the extender Service's name in the namespace.
    assert handshake(extender, scheduler, f"vramguard-extender.{namespace}.svc") == "kube-scheduler"
    # The API server calls the webhook by <service>.<namespace>.svc and checks it against caBundle.
    webhook = secret(cluster, namespace, "vramguard-webhook-tls")
    assert handshake(webhook, {**scheduler, "ca.crt": bundle}, f"vramguard-webhook.{namespace}.svc")
    # A second pass finds everything current.
    versions = {
        key: cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{key}")["metadata"]["resourceVersion"]
        for key in ("vramguard-ca", "vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls")
    }
    assert "certificates issued: none; caBundle set in: none" in keep(cluster, namespace, name)
    for key, version in versions.items():
        assert cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{key}")["metadata"][
            "resourceVersion"] == version
