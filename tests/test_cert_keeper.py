"""The certificate keeper (vramguard.io.cert_keeper) against an in-memory API server: what it creates,
when it renews, rotation of the CA, caBundle repair, kube-scheduler's restart, racing keepers."""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
from typing import Any

import pytest
from cryptography import x509
from prometheus_client import CollectorRegistry, generate_latest

from vramguard.io import certs
from vramguard.io.cert_keeper import (
    RESTART_ANNOTATION,
    KeeperError,
    KeeperNames,
    KeeperStatus,
    keep_certificates,
    keep_forever,
)
from vramguard.io.kube import ApiError

NS = "vramguard-system"
NAMES = KeeperNames(namespace=NS)
T0 = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
VALIDATING = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/vramguard"
MUTATING = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/vramguard"
SCHEDULER = f"/apis/apps/v1/namespaces/{NS}/deployments/vramguard-scheduler"


class FakeApi:
    """Objects by path, with resourceVersions: a create of an existing object and a replace at a stale
    resourceVersion are 409s, as the API server answers them."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.before_write: Any = None
        """Called before each create or replace (a racing keeper)."""
        self.patches: list[tuple[str, Any]] = []

    def put(self, path: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[path] = obj

    async def get(self, path: str) -> dict[str, Any]:
        if path not in self.objects:
            raise ApiError(404, "NotFound", path)
        return copy.deepcopy(self.objects[path])

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            await hook()
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, "AlreadyExists", full)
        self.put(full, body)
        return await self.get(full)

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            await hook()
        if self.objects[path]["metadata"]["resourceVersion"] != body["metadata"].get("resourceVersion"):
            raise ApiError(409, "Conflict", path)
        self.put(path, body)
        return await self.get(path)

    async def patch(self, path: str, body: Any, patch_type: str = "merge") -> dict[str, Any]:
        self.patches.append((path, body))
        obj = self.objects[path]
        if patch_type == "json":
            for op in body:
                keys = op["path"].lstrip("/").split("/")
                target: Any = obj
                for key in keys[:-1]:
                    target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
                if op["op"] == "test":
                    assert target[keys[-1]] == op["value"]
                else:
                    target[keys[-1]] = op["value"]
        else:
            annotations = body["spec"]["template"]["metadata"]["annotations"]
            template = obj["spec"]["template"].setdefault("metadata", {})
            template.setdefault("annotations", {}).update(annotations)
        self.put(path, obj)
        return await self.get(path)

    def secret(self, name: str) -> dict[str, bytes]:
        data = self.objects[f"/api/v1/namespaces/{NS}/secrets/{name}"]["data"]
        return {key: base64.b64decode(value) for key, value in data.items()}


def installed() -> FakeApi:
    """The webhook configurations and the scheduler's Deployment, as the chart applies them."""
    api = FakeApi()
    for path, count in ((VALIDATING, 2), (MUTATING, 1)):
        api.put(path, {"webhooks": [{"name": f"w{i}.vramguard.io", "clientConfig": {"service": {}}}
                                    for i in range(count)]})
    api.put(SCHEDULER, {"spec": {"template": {"metadata": {"labels": {"app": "s"}}}}})
    return api


def keep(api: FakeApi, now: dt.datetime = T0, **options: Any) -> Any:
    return asyncio.run(keep_certificates(api, NAMES, now=now, **options))  # type: ignore[arg-type]


def leaf(api: FakeApi, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(api.secret(name)["tls.crt"])


def test_a_fresh_install_gets_every_certificate_and_both_ca_bundles() -> None:
    api = installed()
    result = keep(api)
    assert result.issued == ["vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls"]
    bundle = api.secret("vramguard-ca")["ca.crt"]
    ca = x509.load_pem_x509_certificate(api.secret("vramguard-ca")["tls.crt"])
    for name in result.issued:
        secret = api.objects[f"/api/v1/namespaces/{NS}/secrets/{name}"]
        assert secret["type"] == "kubernetes.io/tls"
        assert api.secret(name)["ca.crt"] == bundle
        leaf(api, name).verify_directly_issued_by(ca)
    webhook = leaf(api, "vramguard-webhook-tls")
    sans = webhook.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # The name the API server calls a webhook Service by.
    assert "vramguard-webhook.vramguard-system.svc" in sans.get_values_for_type(x509.DNSName)
    client = leaf(api, "vramguard-scheduler-client-tls")
    assert client.subject.rfc4514_string() == "CN=kube-scheduler"
    wanted = base64.b64encode(bundle).decode()
    for path in (VALIDATING, MUTATING):
        assert {w["clientConfig"]["caBundle"] for w in api.objects[path]["webhooks"]} == {wanted}
    assert sorted(result.patched) == ["mutatingwebhookconfigurations/vramguard",
                                      "validatingwebhookconfigurations/vramguard"]
    # The pods wait for their Secrets: no restart, only the digest recorded.
    assert not result.restarted
    assert RESTART_ANNOTATION in api.objects[SCHEDULER]["spec"]["template"]["metadata"]["annotations"]


def test_a_second_pass_changes_nothing() -> None:
    api = installed()
    keep(api)
    version = api.version
    result = keep(api, T0 + dt.timedelta(days=30))
    assert (result.issued, result.patched, result.restarted, api.version) == ([], [], False, version)


def test_a_certificate_is_renewed_in_the_last_third_of_its_life_and_the_scheduler_restarted() -> None:
    api = installed()
    keep(api)
    first = leaf(api, "vramguard-scheduler-client-tls").serial_number
    assert keep(api, T0 + dt.timedelta(days=240)).issued == []  # 125 of 365 days left: more than a third
    result = keep(api, T0 + dt.timedelta(days=250))
    assert set(result.issued) == {"vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls"}
    assert leaf(api, "vramguard-scheduler-client-tls").serial_number != first
    assert result.restarted  # kube-scheduler reads its client certificate only at start


def test_a_caBundle_applied_again_without_it_is_repaired() -> None:
    api = installed()
    keep(api)
    api.objects[VALIDATING]["webhooks"][1]["clientConfig"].pop("caBundle")
    result = keep(api)
    assert result.patched == ["validatingwebhookconfigurations/vramguard"] and result.issued == []
    [(_, patch)] = [p for p in api.patches if p[0] == VALIDATING][-1:]
    # Only the entry that lacked it, guarded by its name.
    assert [op["op"] for op in patch] == ["test", "add"] and patch[0]["value"] == "w1.vramguard.io"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda data: data.update({"tls.crt": base64.b64encode(b"junk").decode()}),
        lambda data: data.pop("tls.key"),
        lambda data: data.update({"ca.crt": base64.b64encode(b"").decode()}),
    ],
    ids=["unreadable", "no-key", "stale-bundle"],
)
def test_a_damaged_secret_is_issued_again(tamper: Any) -> None:
    api = installed()
    keep(api)
    tamper(api.objects[f"/api/v1/namespaces/{NS}/secrets/vramguard-extender-tls"]["data"])
    assert keep(api).issued == ["vramguard-extender-tls"]


def test_a_certificate_from_another_ca_is_replaced() -> None:
    api = installed()
    keep(api)
    stranger = certs.issue_service_certificate(certs.create_ca("other"), "vramguard-webhook", NS)
    data = api.objects[f"/api/v1/namespaces/{NS}/secrets/vramguard-webhook-tls"]["data"]
    data["tls.crt"] = base64.b64encode(stranger.cert_pem()).decode()
    assert keep(api).issued == ["vramguard-webhook-tls"]


def test_the_ca_is_rotated_in_its_last_year_and_the_old_one_stays_trusted() -> None:
    api = installed()
    keep(api)
    old = api.secret("vramguard-ca")["tls.crt"]
    later = T0 + dt.timedelta(days=3650 - 300)
    result = keep(api, later)
    assert result.ca_rotated and result.restarted
    new = api.secret("vramguard-ca")["tls.crt"]
    bundle = api.secret("vramguard-ca")["ca.crt"]
    assert new != old and bundle == new + old
    # Every leaf is signed by the new CA now, and carries the bundle that trusts both.
    for name in ("vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls"):
        leaf(api, name).verify_directly_issued_by(x509.load_pem_x509_certificate(new))
        assert api.secret(name)["ca.crt"] == bundle
    # A week later the transition is over: the bundle drops the old CA, and the leaves follow.
    assert keep(api, later + dt.timedelta(days=6)).issued == []
    result = keep(api, later + dt.timedelta(days=8))
    assert api.secret("vramguard-ca")["ca.crt"] == new
    assert len(result.issued) == 3 and api.secret("vramguard-webhook-tls")["ca.crt"] == new


def test_secrets_made_by_hand_are_taken_over_without_a_gap_in_trust() -> None:
    """An installation whose Secrets `vramguard certs` made: the first pass issues everything from its
    own CA, and trusts the old CA for the week the pods take to reload what they serve."""
    api = installed()
    manual = certs.create_ca("vramguard CA for vramguard-webhook.vramguard-system", now=T0 - dt.timedelta(days=30))
    for service in ("vramguard-webhook", "vramguard-extender"):
        name = f"{service}-tls"
        leaf_pair = certs.issue_service_certificate(manual, service, NS, now=T0 - dt.timedelta(days=30))
        api.put(f"/api/v1/namespaces/{NS}/secrets/{name}", {"type": "kubernetes.io/tls", "data": {
            "tls.crt": base64.b64encode(leaf_pair.cert_pem()).decode(),
            "tls.key": base64.b64encode(leaf_pair.key_pem()).decode(),
            "ca.crt": base64.b64encode(manual.cert_pem()).decode(),
        }})
    result = keep(api)
    assert set(result.issued) == {"vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls"}
    bundle = api.secret("vramguard-ca")["ca.crt"]
    assert bundle == api.secret("vramguard-ca")["tls.crt"] + manual.cert_pem()
    wanted = base64.b64encode(bundle).decode()
    assert {w["clientConfig"]["caBundle"] for w in api.objects[VALIDATING]["webhooks"]} == {wanted}
    keep(api, T0 + dt.timedelta(days=8))
    assert api.secret("vramguard-ca")["ca.crt"] == api.secret("vramguard-ca")["tls.crt"]


def test_a_secret_of_another_type_is_not_overwritten() -> None:
    api = installed()
    api.put(f"/api/v1/namespaces/{NS}/secrets/vramguard-extender-tls", {"type": "Opaque", "data": {}})
    with pytest.raises(KeeperError, match=r"is of type Opaque, not kubernetes\.io/tls: delete it"):
        keep(api)


def test_a_keeper_that_loses_the_race_uses_the_winners_certificate() -> None:
    api = installed()
    keep(api)
    later = T0 + dt.timedelta(days=250)

    async def other_keeper() -> None:
        await keep_certificates(api, NAMES, now=later)  # type: ignore[arg-type]

    api.before_write = other_keeper
    result = keep(api, later)
    # The first write was beaten; the keeper read the winner's certificates and kept them.
    assert result.issued == []
    ca = x509.load_pem_x509_certificate(api.secret("vramguard-ca")["tls.crt"])
    leaf(api, "vramguard-webhook-tls").verify_directly_issued_by(ca)


def test_nothing_installed_yet_is_no_error() -> None:
    api = FakeApi()  # neither the webhook configurations nor the scheduler exist (yet)
    result = keep(api)
    assert len(result.issued) == 3 and result.patched == [] and not result.restarted


def test_the_status_reports_expiries_and_failures() -> None:
    api = installed()
    registry = CollectorRegistry()
    status = KeeperStatus(registry)
    status.succeeded(keep(api))
    text = generate_latest(registry).decode()
    for name in ("vramguard-ca", "vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls"):
        certificate = x509.load_pem_x509_certificate(api.secret(name)["tls.crt"])
        line = f'vramguard_certificates_expiry_timestamp_seconds{{secret="{name}"}} '
        [value] = [row.removeprefix(line) for row in text.splitlines() if row.startswith(line)]
        assert float(value) == certificate.not_valid_after_utc.timestamp()
    assert status.last_ok
    status.failed()
    assert not status.last_ok
    assert "vramguard_certificates_failed_passes_total 1.0" in generate_latest(registry).decode()


def test_the_loop_survives_a_failing_pass_and_tries_again() -> None:
    api = installed()
    calls = {"n": 0}
    real_get = api.get

    async def flaky(path: str) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ApiError(503, "ServiceUnavailable", "the API server is restarting")
        if calls["n"] == 2:
            raise RuntimeError("a bug")
        return await real_get(path)

    api.get = flaky  # type: ignore[method-assign]
    status = KeeperStatus()

    async def run() -> None:
        task = asyncio.create_task(keep_forever(api, NAMES, every=3600, retry=0.01, status=status))  # type: ignore[arg-type]
        for _ in range(500):
            await asyncio.sleep(0.01)
            if status.last_ok:
                break
        task.cancel()

    asyncio.run(run())
    assert status.failures == 2 and status.last_ok and api.secret("vramguard-webhook-tls")
