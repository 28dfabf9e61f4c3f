"""Keeps vramguard's certificates in the cluster, so installing it needs no certificate step.

``vramguard keep-certs`` runs as its own Deployment (``vramguard-certificates``, one replica, with
the only ServiceAccount that may write the Secrets: the services that serve untrusted input never
hold the CA's key) and, on each pass, makes the cluster hold:

- a private CA, in the Secret ``vramguard-ca`` (``tls.crt``, ``tls.key``, and ``ca.crt``: the
  bundle of the CAs trusted). It lives ten years; within its last year a new CA takes over
  signing, and the bundle keeps the old one for a week of transition (so is a CA found in the TLS
  Secrets on the first pass, made by ``vramguard certs`` or an earlier installation): every
  certificate is issued again at once, and the week covers the pods reloading them;
- the webhook's and the extender's serving certificates (``vramguard-webhook-tls``,
  ``vramguard-extender-tls``) for their Services' DNS names, and kube-scheduler's client
  certificate for the extender's mutual TLS (``vramguard-scheduler-client-tls``), each a
  ``kubernetes.io/tls`` Secret with the bundle as ``ca.crt``. A certificate is issued again when it
  is missing, unreadable, not signed by the current CA, for other names, or within the last third
  of its life (four months of a year): long before it expires, with many passes to retry;
- the bundle as the ``caBundle`` of every webhook of the Validating- and
  MutatingWebhookConfiguration ``vramguard`` (a configuration applied again without it is
  repaired on the next pass);
- kube-scheduler restarted (an annotation of the vramguard-scheduler Deployment's pod template)
  when its client certificate or the bundle changed: it reads both only at start. The webhook and
  the extender reload the mounted files when the kubelet updates them, without a restart.

The services' pods mount the Secrets: on a fresh install they wait for the first pass to create
them. Every write is conditional (a create, or a replace at the ``resourceVersion`` read), so two
keepers (a rollout's old and new pod) never undo each other: the loser of a race reads the
winner's certificate and uses it.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry, Counter, Gauge

from vramguard.io import certs
from vramguard.io.kube import ApiError, KubeClient, collection_path, object_path

__all__ = ["KeepResult", "KeeperError", "KeeperNames", "KeeperStatus", "keep_certificates", "keep_forever"]

logger = logging.getLogger(__name__)

CA_RENEW_BEFORE = dt.timedelta(days=365)
RENEW_AT_REMAINING = 1 / 3
"""A leaf is issued again when less than this part of its life is left."""
RESTART_ANNOTATION = "vramguard.io/certificates"
"""On kube-scheduler's pod template: a digest of its client certificate and the bundle."""
CLIENT_NAME = "kube-scheduler"
TRANSITION = dt.timedelta(days=7)
"""How long the CAs trusted before the current one stay in the bundle."""
PREVIOUS_UNTIL_ANNOTATION = "vramguard.io/previous-cas-until"
"""On the CA's Secret: until when the bundle keeps the CAs trusted before the current one."""
ATTEMPTS = 3
"""Passes over a Secret that another keeper changed meanwhile, before giving up until the next run."""
SECRETS = "/api/v1/secrets"
DEPLOYMENTS = "/apis/apps/v1/deployments"
WEBHOOK_KINDS = ("validatingwebhookconfigurations", "mutatingwebhookconfigurations")
LABELS = {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/managed-by": "vramguard-keep-certs"}


@dataclass(frozen=True, slots=True)
class KeeperNames:
    """What the keeper keeps, by name."""

    namespace: str
    ca_secret: str = "vramguard-ca"
    webhook_secret: str = "vramguard-webhook-tls"
    extender_secret: str = "vramguard-extender-tls"
    client_secret: str = "vramguard-scheduler-client-tls"
    webhook_service: str = "vramguard-webhook"
    extender_service: str = "vramguard-extender"
    webhook_configuration: str = "vramguard"
    scheduler_deployment: str | None = "vramguard-scheduler"
    """``None``: kube-scheduler is the control plane's (mode default-scheduler); not restarted here."""
    cluster_domain: str = "cluster.local"


@dataclass(slots=True)
class KeepResult:
    """What one pass did."""

    issued: list[str] = field(default_factory=list)
    """Secrets written with a new certificate."""
    ca_rotated: bool = False
    patched: list[str] = field(default_factory=list)
    """Webhook configurations whose caBundle was set."""
    restarted: bool = False
    expiries: dict[str, float] = field(default_factory=dict)
    """Per Secret, when its certificate (the signing CA's, for the CA's Secret) expires (Unix time)."""


class KeeperError(Exception):
    """A pass could not finish; the message says what failed. The next pass tries again."""


@dataclass(frozen=True, slots=True)
class _Leaf:
    secret: str
    dns_names: tuple[str, ...]
    """Empty for the client certificate."""


async def keep_certificates(client: KubeClient, names: KeeperNames, *, now: dt.datetime | None = None) -> KeepResult:
    """One pass (see the module docstring)."""
    result = KeepResult()
    moment = now or dt.datetime.now(dt.UTC)
    ca, bundle = await _keep_ca(client, names, moment, result)
    before = await _read_secret(client, names.namespace, names.client_secret)
    for leaf in _leaves(names):
        await _keep_leaf(client, names, leaf, ca, bundle, moment, result)
    await _keep_ca_bundles(client, names, bundle, result)
    if names.scheduler_deployment:
        await _restart_scheduler(client, names, bundle, existed=before is not None, result=result)
    return result


class KeeperStatus:
    """What the passes so far say, for the probes and the metrics: ready once a pass succeeded and
    as long as the last one did; the ``vramguard_certificates_*`` series in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.failures = 0
        self.last_ok = False
        self._expiry = Gauge(
            "vramguard_certificates_expiry_timestamp_seconds",
            "When each certificate the keeper keeps expires (Unix time), by Secret; renewed a third of its "
            "life before.",
            labelnames=("secret",), registry=registry,
        )
        self._last_success = Gauge(
            "vramguard_certificates_last_success_timestamp_seconds",
            "When a pass of the certificate keeper last succeeded (Unix time; 0: never).", registry=registry,
        )
        self._failed = Counter(
            "vramguard_certificates_failed_passes", "Passes of the certificate keeper that failed (retried in 30 s).",
            registry=registry,
        )

    def succeeded(self, result: KeepResult) -> None:
        self.last_ok = True
        self._last_success.set_to_current_time()
        for secret, moment in result.expiries.items():
            self._expiry.labels(secret).set(moment)

    def failed(self) -> None:
        self.failures += 1
        self.last_ok = False
        self._failed.inc()


async def keep_forever(
    client: KubeClient, names: KeeperNames, *, every: float, retry: float = 30.0, status: KeeperStatus | None = None
) -> None:
    """Run a pass every ``every`` seconds (``retry`` after a failed one) until cancelled."""
    status = status or KeeperStatus()
    while True:
        wait = every
        try:
            result = await keep_certificates(client, names)
            status.succeeded(result)
            _log(result)
        except (KeeperError, ApiError, certs.CertificateError) as exc:
            status.failed()
            logger.error("keeping certificates failed: %s; trying again in %.0f s", exc, retry)
            wait = min(every, retry)
        except Exception:
            # A bug must not end the loop, or renewal would silently stop.
            status.failed()
            logger.exception("keeping certificates failed; trying again in %.0f s", retry)
            wait = min(every, retry)
        await asyncio.sleep(wait)


def _log(result: KeepResult) -> None:
    if result.ca_rotated:
        logger.info("a new CA signs from now on; the previous one stays in the bundle until it expires")
    for secret in result.issued:
        logger.info("issued a certificate into Secret %s", secret)
    for configuration in result.patched:
        logger.info("set caBundle of %s", configuration)
    if result.restarted:
        logger.info("restarted kube-scheduler: its client certificate or the bundle changed")


# ---------------------------------------------------------------------------------- the CA


async def _keep_ca(
    client: KubeClient, names: KeeperNames, now: dt.datetime, result: KeepResult
) -> tuple[certs.CertificateAuthority, bytes]:
    """The CA that signs, and the bundle of CAs trusted; creates or rotates them as needed.

    The CAs trusted before the current one took over (the previous CA after a rotation; on a first
    pass, the CAs of Secrets made by hand or by an earlier installation) stay in the bundle for
    :data:`TRANSITION`, while the pods reload what they serve and present: then they go."""
    for _ in range(ATTEMPTS):
        secret = await _read_secret(client, names.namespace, names.ca_secret)
        current = _ca_of(secret)
        stored = _data(secret or {}, certs.CA_CERT_FILE)
        until = _annotation_time(secret, PREVIOUS_UNTIL_ANNOTATION)
        if current is not None and current.certificate.not_valid_after_utc - now > CA_RENEW_BEFORE:
            signing = current
            previous = _certificates(stored) if until is not None and now < until else []
            bundle = _bundle([current.certificate, *previous], now)
            if bundle == stored:
                result.expiries[names.ca_secret] = current.certificate.not_valid_after_utc.timestamp()
                return current, bundle
            # A previous CA's transition ended (or it expired): the bundle drops it.
        else:
            signing = certs.create_ca(f"vramguard CA ({names.namespace})", days=certs.CA_VALIDITY_DAYS, now=now)
            previous = [current.certificate] if current is not None else await _adopted_cas(client, names)
            bundle = _bundle([signing.certificate, *previous], now)
            until = now + TRANSITION
        data = {
            certs.TLS_CERT_FILE: signing.cert_pem(),
            certs.TLS_KEY_FILE: signing.key_pem(),
            certs.CA_CERT_FILE: bundle,
        }
        annotations = {PREVIOUS_UNTIL_ANNOTATION: until.isoformat()} if until is not None else {}
        if await _write_secret(client, names.namespace, names.ca_secret, "Opaque", data, secret, annotations):
            result.ca_rotated = current is not None and signing is not current
            result.expiries[names.ca_secret] = signing.certificate.not_valid_after_utc.timestamp()
            return signing, bundle
    raise KeeperError(f"Secret {names.namespace}/{names.ca_secret} kept changing under this keeper")


async def _adopted_cas(client: KubeClient, names: KeeperNames) -> list[x509.Certificate]:
    """The CAs of the TLS Secrets there before the keeper's first CA (``vramguard certs``, an
    earlier installation), trusted through the transition so nothing fails while pods reload."""
    found: list[x509.Certificate] = []
    for leaf in _leaves(names):
        secret = await _read_secret(client, names.namespace, leaf.secret)
        found.extend(_certificates(_data(secret or {}, certs.CA_CERT_FILE)))
    return found


def _annotation_time(secret: Mapping[str, Any] | None, key: str) -> dt.datetime | None:
    value = (((secret or {}).get("metadata") or {}).get("annotations") or {}).get(key)
    try:
        moment = dt.datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return moment if moment is not None and moment.tzinfo is not None else None


def _ca_of(secret: Mapping[str, Any] | None) -> certs.CertificateAuthority | None:
    if secret is None:
        return None
    try:
        return certs.ca_from_pem(_data(secret, certs.TLS_CERT_FILE), _data(secret, certs.TLS_KEY_FILE))
    except certs.CertificateError as exc:
        logger.warning("the CA Secret holds no usable CA (%s): a new CA replaces it", exc)
        return None


def _bundle(certificates: list[x509.Certificate], now: dt.datetime) -> bytes:
    """PEM of the CAs not expired, first seen first, without duplicates."""
    seen: set[bytes] = set()
    pems: list[bytes] = []
    for certificate in certificates:
        der = certificate.public_bytes(serialization.Encoding.DER)
        if der in seen or certificate.not_valid_after_utc <= now or not certs.is_ca_certificate(certificate):
            continue
        seen.add(der)
        pems.append(certificate.public_bytes(serialization.Encoding.PEM))
    return b"".join(pems)


def _certificates(pem: bytes) -> list[x509.Certificate]:
    try:
        return list(x509.load_pem_x509_certificates(pem)) if pem else []
    except ValueError:
        return []


# ---------------------------------------------------------------------------------- leaves


def _leaves(names: KeeperNames) -> tuple[_Leaf, ...]:
    def dns(service: str) -> tuple[str, ...]:
        return tuple(certs.service_dns_names(service, names.namespace, names.cluster_domain))

    return (
        _Leaf(names.webhook_secret, dns(names.webhook_service)),
        _Leaf(names.extender_secret, dns(names.extender_service)),
        _Leaf(names.client_secret, ()),
    )


async def _keep_leaf(
    client: KubeClient,
    names: KeeperNames,
    leaf: _Leaf,
    ca: certs.CertificateAuthority,
    bundle: bytes,
    now: dt.datetime,
    result: KeepResult,
) -> None:
    for _ in range(ATTEMPTS):
        secret = await _read_secret(client, names.namespace, leaf.secret)
        expiry = _current(secret, leaf, ca, bundle, now) if secret is not None else None
        if expiry is not None:
            result.expiries[leaf.secret] = expiry
            return
        days = min(certs.LEAF_VALIDITY_DAYS, (ca.certificate.not_valid_after_utc - now).days - 1)
        if leaf.dns_names:
            issued = certs.issue_serving_certificate(
                ca, dns_names=leaf.dns_names, common_name=leaf.dns_names[2], days=days, now=now
            )
        else:
            issued = certs.issue_client_certificate(ca, CLIENT_NAME, days=days, now=now)
        data = {
            certs.TLS_CERT_FILE: issued.cert_pem(),
            certs.TLS_KEY_FILE: issued.key_pem(),
            certs.CA_CERT_FILE: bundle,
        }
        if await _write_secret(client, names.namespace, leaf.secret, "kubernetes.io/tls", data, secret):
            result.issued.append(leaf.secret)
            result.expiries[leaf.secret] = issued.certificate.not_valid_after_utc.timestamp()
            return
    raise KeeperError(f"Secret {names.namespace}/{leaf.secret} kept changing under this keeper")


def _current(
    secret: Mapping[str, Any], leaf: _Leaf, ca: certs.CertificateAuthority, bundle: bytes, now: dt.datetime
) -> float | None:
    """When the Secret's certificate expires, if it needs no new issue (see the module docstring);
    ``None`` when it does."""
    if _data(secret, certs.CA_CERT_FILE) != bundle or not _data(secret, certs.TLS_KEY_FILE):
        return None
    try:
        certificate = x509.load_pem_x509_certificate(_data(secret, certs.TLS_CERT_FILE))
        certificate.verify_directly_issued_by(ca.certificate)
    except (ValueError, TypeError, InvalidSignature):
        return None
    expiry = certificate.not_valid_after_utc
    if expiry - now < (expiry - certificate.not_valid_before_utc) * RENEW_AT_REMAINING:
        return None
    if leaf.dns_names:
        try:
            sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return None
        matches = set(sans.get_values_for_type(x509.DNSName)) == set(leaf.dns_names)
    else:
        common = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        matches = bool(common) and common[0].value == CLIENT_NAME
    return expiry.timestamp() if matches else None


# ---------------------------------------------------------------------------------- consumers


async def _keep_ca_bundles(client: KubeClient, names: KeeperNames, bundle: bytes, result: KeepResult) -> None:
    """Set ``caBundle`` of every webhook of the two configurations where it differs."""
    wanted = base64.b64encode(bundle).decode()
    for kind in WEBHOOK_KINDS:
        path = f"/apis/admissionregistration.k8s.io/v1/{kind}/{names.webhook_configuration}"
        try:
            configuration = await client.get(path)
        except ApiError as exc:
            if exc.status == 404:
                continue  # not installed (or not yet): the next pass sets it
            raise
        patch: list[dict[str, Any]] = []
        for index, webhook in enumerate(configuration.get("webhooks") or ()):
            if (webhook.get("clientConfig") or {}).get("caBundle") == wanted:
                continue
            # Guarded by the entry's name, so a reordered list fails instead of patching another entry.
            patch.append({"op": "test", "path": f"/webhooks/{index}/name", "value": webhook.get("name")})
            patch.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": wanted})
        if patch:
            await client.patch(path, patch, patch_type="json")
            result.patched.append(f"{kind}/{names.webhook_configuration}")


async def _restart_scheduler(
    client: KubeClient, names: KeeperNames, bundle: bytes, *, existed: bool, result: KeepResult
) -> None:
    """Roll kube-scheduler's pods when what it read at start (client certificate, bundle) changed."""
    assert names.scheduler_deployment is not None
    secret = await _read_secret(client, names.namespace, names.client_secret)
    digest = hashlib.sha256(_data(secret or {}, certs.TLS_CERT_FILE) + bundle).hexdigest()[:16]
    path = object_path(DEPLOYMENTS, names.namespace, names.scheduler_deployment)
    try:
        deployment = await client.get(path)
    except ApiError as exc:
        if exc.status == 404:
            return  # mode default-scheduler, or not installed yet
        raise
    annotations = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    current = (annotations.get("annotations") or {}).get(RESTART_ANNOTATION)
    if current == digest:
        return
    await client.patch(path, {"spec": {"template": {"metadata": {"annotations": {RESTART_ANNOTATION: digest}}}}})
    # The first pass only records the digest: the pods are waiting for the Secret, not running without it.
    result.restarted = existed and current is not None


# ---------------------------------------------------------------------------------- Secrets


async def _read_secret(client: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return dict(await client.get(object_path(SECRETS, namespace, name)))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def _write_secret(
    client: KubeClient,
    namespace: str,
    name: str,
    kind: str,
    data: Mapping[str, bytes],
    previous: Mapping[str, Any] | None,
    annotations: Mapping[str, str] | None = None,
) -> bool:
    """Create the Secret, or replace ``previous`` at its resourceVersion; False when another
    keeper wrote it first (read it again)."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": kind,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(LABELS)},
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }
    try:
        if annotations:
            body["metadata"]["annotations"] = {**body["metadata"].get("annotations", {}), **annotations}
        if previous is None:
            await client.create(collection_path(SECRETS, namespace), body)
        else:
            metadata = previous.get("metadata") or {}
            body["metadata"]["resourceVersion"] = metadata.get("resourceVersion")
            body["metadata"]["labels"] = {**(metadata.get("labels") or {}), **LABELS}
            kept = {k: v for k, v in (metadata.get("annotations") or {}).items() if k != PREVIOUS_UNTIL_ANNOTATION}
            body["metadata"]["annotations"] = {**kept, **(annotations or {})}
            if previous.get("type") not in (None, kind):
                raise KeeperError(
                    f"Secret {namespace}/{name} is of type {previous.get('type')}, not {kind}: delete it to let "
                    "the keeper issue it"
                )
            await client.replace(object_path(SECRETS, namespace, name), body)
    except ApiError as exc:
        if exc.status == 409:
            return False
        raise
    return True


def _data(secret: Mapping[str, Any], key: str) -> bytes:
    value = (secret.get("data") or {}).get(key)
    if not isinstance(value, str):
        return b""
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        return b""
