"""``vramguard certs``: files written, clean errors, and caBundle patching through the real client."""

from __future__ import annotations

import asyncio
import base64
import json
import stat
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography import x509

from vramguard.cli import build_parser, main
from vramguard.cli import certs as certs_cli
from vramguard.io import certs

WEBHOOK_CONFIG = "vramguard"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["certs", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _base_args(out: Path) -> list[str]:
    return ["--service", "vramguard-webhook", "--namespace", "gpu-system", "--out", str(out)]


def test_writes_the_secret_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = _run(capsys, *_base_args(out), "--ip", "127.0.0.1", "--dns", "hook.example.test")
    assert (code, stderr) == (0, "")
    assert sorted(path.name for path in out.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate((out / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    leaf.verify_directly_issued_by(ca)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "vramguard-webhook.gpu-system.svc" in san.get_values_for_type(x509.DNSName)
    assert "hook.example.test" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert "vramguard-webhook.gpu-system.svc" in stdout
    assert "--ca-key-out" in stdout  # says the new CA's key was discarded and how to keep it


def test_days_and_key_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = _run(capsys, *_base_args(tmp_path), "--days", "7", "--key-type", "rsa-2048")
    assert code == 0
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == 7  # 7 days + backdating
    assert leaf.public_key().key_size == 2048  # type: ignore[union-attr]


def test_reusing_the_ca_keeps_ca_crt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    code, _, _ = _run(capsys, *_base_args(first), "--ca-key-out", str(tmp_path / "keep" / "ca.key"))
    assert code == 0
    assert stat.S_IMODE((tmp_path / "keep" / "ca.key").stat().st_mode) == 0o600
    assert not (first / "ca.key").exists()  # the signing key never lands in the Secret directory

    args = [*_base_args(second), "--ca-cert", str(first / "ca.crt"), "--ca-key", str(tmp_path / "keep" / "ca.key")]
    code, _, stderr = _run(capsys, *args)
    assert (code, stderr) == (0, "")
    assert (second / "ca.crt").read_bytes() == (first / "ca.crt").read_bytes()
    new_leaf = x509.load_pem_x509_certificate((second / "tls.crt").read_bytes())
    new_leaf.verify_directly_issued_by(x509.load_pem_x509_certificate((first / "ca.crt").read_bytes()))
    assert new_leaf != x509.load_pem_x509_certificate((first / "tls.crt").read_bytes())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        pytest.param(["--service", "Bad_Name"], "invalid service name", id="bad-service"),
        pytest.param(["--namespace", "a.b"], "invalid namespace", id="bad-namespace"),
        pytest.param(["--ip", "1.2.3"], "invalid IP address '1.2.3'", id="bad-ip"),
        pytest.param(["--dns", "a b"], "invalid DNS name", id="bad-dns"),
        pytest.param(["--days", "0"], "at least 1 day", id="zero-days"),
        pytest.param(["--days", "4000"], "use at most", id="outlives-ca"),
        pytest.param(["--ca-cert", "ca.crt"], "--ca-cert and --ca-key go together", id="ca-cert-alone"),
        pytest.param(["--ca-cert", "nope.crt", "--ca-key", "nope.key"], "cannot read CA certificate", id="no-ca"),
        pytest.param(["--kubeconfig", "kc"], "only used with --patch-webhook", id="kubeconfig-alone"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    # Later occurrences of --service / --namespace win (argparse), so the table can override them.
    code, _, stderr = _run(capsys, *_base_args(tmp_path / "out"), *extra)
    assert code == 2
    assert stderr.startswith("vramguard certs: error: ")
    assert message in stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert not (tmp_path / "out" / "tls.key").exists()


def test_unwritable_output_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, stderr = _run(capsys, *_base_args(blocker / "out"))
    assert code == 2
    assert stderr.startswith("vramguard certs: error: cannot create")


def test_a_reused_ca_that_is_not_a_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, *_base_args(tmp_path / "a"))[0] == 0
    code, _, stderr = _run(
        capsys,
        *_base_args(tmp_path / "b"),
        "--ca-cert",
        str(tmp_path / "a" / "tls.crt"),
        "--ca-key",
        str(tmp_path / "a" / "tls.key"),
    )
    assert code == 2
    assert "is not a CA certificate" in stderr


def test_parser_choices_follow_the_library() -> None:
    # The CLI lists key types itself so that `vramguard --help` does not import cryptography.
    parser = build_parser()
    args = parser.parse_args(["certs", "--service", "s", "--namespace", "n", "--out", "o"])
    assert args.key_type == certs.DEFAULT_KEY_TYPE
    assert args.days is None  # the default depends on the kind: serving or --client
    assert args.ca_days == certs.CA_VALIDITY_DAYS
    for key_type in certs.KEY_TYPES:
        parser.parse_args(["certs", "--service", "s", "--namespace", "n", "--out", "o", "--key-type", key_type])


class _FakeWebhook:
    def __init__(self, name: str) -> None:
        self.name = name


class _FakeConfiguration:
    def __init__(self, names: list[str]) -> None:
        self.webhooks = [_FakeWebhook(name) for name in names]


class _FakeAdmissionApi:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.patches: list[tuple[str, Any, dict[str, Any]]] = []

    def read_validating_webhook_configuration(self, name: str, **_: Any) -> _FakeConfiguration:
        return _FakeConfiguration(self.names)

    def patch_validating_webhook_configuration(self, name: str, body: Any, **kwargs: Any) -> None:
        self.patches.append((name, body, kwargs))

    def read_mutating_webhook_configuration(self, name: str, **_: Any) -> _FakeConfiguration:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        raise ApiException(status=404, reason="Not Found")

    def patch_mutating_webhook_configuration(self, name: str, body: Any, **kwargs: Any) -> None:
        self.patches.append((name, body, kwargs))


def test_patch_sets_every_webhook_and_guards_the_order() -> None:
    api = _FakeAdmissionApi(["pods.vramguard.io", "templates.vramguard.io"])
    count = certs_cli.patch_webhook_ca_bundle(api, WEBHOOK_CONFIG, b"PEM")
    assert count == 2
    [(name, body, kwargs)] = api.patches
    assert name == WEBHOOK_CONFIG
    assert kwargs["_content_type"] == "application/json-patch+json"
    bundle = base64.b64encode(b"PEM").decode()
    assert body == [
        {"op": "test", "path": "/webhooks/0/name", "value": "pods.vramguard.io"},
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": bundle},
        {"op": "test", "path": "/webhooks/1/name", "value": "templates.vramguard.io"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": bundle},
    ]


def test_patch_refuses_a_configuration_without_webhooks() -> None:
    with pytest.raises(certs_cli.WebhookPatchError, match="has no webhooks"):
        certs_cli.patch_webhook_ca_bundle(_FakeAdmissionApi([]), WEBHOOK_CONFIG, b"PEM")


# A fake API server, so the real kubernetes client (serialisation, content type, kubeconfig) is
# exercised end to end without a cluster.


def _webhook_object(names: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK_CONFIG, "resourceVersion": "1"},
        "webhooks": [
            {
                "name": name,
                "clientConfig": {"service": {"name": "vramguard-webhook", "namespace": "gpu-system"}},
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "rules": [],
            }
            for name in names
        ],
    }


class _FakeApiServer:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.patches: list[tuple[str, Any]] = []
        self.app = web.Application()
        path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"
        self.app.router.add_get(path, self.read)
        self.app.router.add_patch(path, self.patch)

    async def read(self, request: web.Request) -> web.Response:
        if request.match_info["name"] != WEBHOOK_CONFIG:
            return web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404},
                status=404,
            )
        return web.json_response(_webhook_object(self.names))

    async def patch(self, request: web.Request) -> web.Response:
        self.patches.append((request.content_type, json.loads(await request.read())))
        return web.json_response(_webhook_object(self.names))


def _kubeconfig(path: Path, port: int) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
                "current-context": "fake",
            }
        )
    )
    return path


async def test_patch_webhook_through_the_kubernetes_client(tmp_path: Path) -> None:
    fake = _FakeApiServer(["pods.vramguard.io", "templates.vramguard.io"])
    async with TestServer(fake.app, host="127.0.0.1") as server:
        kubeconfig = _kubeconfig(tmp_path / "kubeconfig", server.port or 0)
        argv = ["certs", *_base_args(tmp_path / "out"), "--patch-webhook", WEBHOOK_CONFIG]
        # The kubernetes client is synchronous; run it off the loop that serves the fake.
        code = await asyncio.to_thread(main, [*argv, "--kubeconfig", str(kubeconfig)])
    assert code == 0
    [(content_type, patch)] = fake.patches
    assert content_type == "application/json-patch+json"
    bundles = [op["value"] for op in patch if op["op"] == "add"]
    assert len(bundles) == 2
    assert {base64.b64decode(bundle) for bundle in bundles} == {(tmp_path / "out" / "ca.crt").read_bytes()}


async def test_patch_webhook_not_found_is_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = _FakeApiServer(["pods.vramguard.io"])
    async with TestServer(fake.app, host="127.0.0.1") as server:
        kubeconfig = _kubeconfig(tmp_path / "kubeconfig", server.port or 0)
        argv = ["certs", *_base_args(tmp_path / "out"), "--patch-webhook", "absent", "--kubeconfig", str(kubeconfig)]
        code = await asyncio.to_thread(main, argv)
    stderr = capsys.readouterr().err
    assert code == 1
    assert stderr == "vramguard certs: error: cannot read ValidatingWebhookConfiguration absent: HTTP 404 Not Found\n"
    assert fake.patches == []


def test_bad_kubeconfig_fails_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "kubeconfig").write_text("not: [a kubeconfig")
    code, _, stderr = _run(
        capsys,
        *_base_args(tmp_path / "out"),
        "--patch-webhook",
        WEBHOOK_CONFIG,
        "--kubeconfig",
        str(tmp_path / "kubeconfig"),
    )
    assert code == 1
    assert stderr.startswith("vramguard certs: error: cannot load Kubernetes configuration")
    assert stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


# --- the client certificate kube-scheduler presents to the extender --------------------------


def test_client_certificate_signed_by_the_extenders_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extender, scheduler, ca_key = tmp_path / "extender", tmp_path / "scheduler", tmp_path / "ca.key"
    assert _run(capsys, *_base_args(extender), "--ca-key-out", str(ca_key))[0] == 0
    code, stdout, stderr = _run(
        capsys, "--client", "kube-scheduler", "--out", str(scheduler),
        "--ca-cert", str(extender / "ca.crt"), "--ca-key", str(ca_key),
    )
    assert (code, stderr) == (0, "")
    assert (scheduler / "ca.crt").read_bytes() == (extender / "ca.crt").read_bytes()
    assert stat.S_IMODE((scheduler / "tls.key").stat().st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate((scheduler / "tls.crt").read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate((extender / "ca.crt").read_bytes()))
    assert leaf.subject.rfc4514_string() == "CN=kube-scheduler"
    usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    # Long-lived: kube-scheduler reads it only at start, so each renewal is a scheduler restart.
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == certs.CLIENT_VALIDITY_DAYS
    assert "restart" in stdout


def test_serving_certificates_keep_their_default_validity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, *_base_args(tmp_path))[0] == 0
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == certs.LEAF_VALIDITY_DAYS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--client", "kube-scheduler", "--service", "s"], "--service", id="client-with-service"),
        pytest.param(["--client", "kube-scheduler", "--ip", "127.0.0.1"], "--ip", id="client-with-ip"),
        pytest.param(["--client", "kube-scheduler", "--patch-webhook", "v"], "--patch-webhook", id="client-patch"),
        pytest.param(["--client", "  "], "needs a name", id="blank-client-name"),
        pytest.param([], "--service and --namespace are required", id="neither-service-nor-client"),
        pytest.param(["--client", "kube-scheduler", "--days", "0"], "at least 1 day", id="client-zero-days"),
    ],
)
def test_client_certificate_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, stderr = _run(capsys, *argv, "--out", str(tmp_path / "out"))
    assert code == 2
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


class _FakeMutatingApi(_FakeAdmissionApi):
    def read_mutating_webhook_configuration(self, name: str, **_: Any) -> _FakeConfiguration:
        return _FakeConfiguration(self.names)


def test_patch_sets_the_mutating_configuration_of_the_same_name_where_there_is_one() -> None:
    present = _FakeMutatingApi(["pod-routing.vramguard.io"])
    assert certs_cli.patch_webhook_ca_bundle(present, WEBHOOK_CONFIG, b"PEM", kind="mutating", required=False) == 1
    [(_, body, _)] = present.patches
    assert body[1]["path"] == "/webhooks/0/clientConfig/caBundle"
    missing = _FakeAdmissionApi([])
    assert certs_cli.patch_webhook_ca_bundle(missing, WEBHOOK_CONFIG, b"PEM", kind="mutating", required=False) == 0
    with pytest.raises(certs_cli.WebhookPatchError, match="cannot read MutatingWebhookConfiguration"):
        certs_cli.patch_webhook_ca_bundle(missing, WEBHOOK_CONFIG, b"PEM", kind="mutating")
