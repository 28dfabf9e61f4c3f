"""Plugging the vramguard extender and webhook into a local control plane.

The services run as local processes over HTTPS on 127.0.0.1 with a serving certificate (IP SAN
127.0.0.1) signed by the harness CA, and are wired in from the shipped manifests. The extender
requires client certificates from the harness CA (mutual TLS, as shipped): kube-scheduler
presents one issued for it, through ``tlsConfig.certFile``/``keyFile``. The extender's probes
and metrics answer on a separate plain-HTTP port.

* kube-scheduler reads ``manifests/scheduler/extender-default.yaml`` (or
  ``second-scheduler.yaml``); only ``urlPrefix``, ``tlsConfig``, the kubeconfig path and
  leader election are rewritten for the local run.
* the ValidatingWebhookConfiguration found under ``manifests/`` is registered with its
  ``clientConfig`` pointed at the local webhook (``url`` + ``caBundle``); a built-in one is
  used while the manifests have none.
* RBAC objects found under ``manifests/`` are applied and the services authenticate as the
  ServiceAccounts those manifests name, so the shipped permissions are the tested ones.

Intended command lines (each service answers ``GET /readyz`` with 200 once ready)::

    vramguard extender --listen 127.0.0.1:PORT --tls-cert F --tls-key F --kubeconfig K --policy P \
        --client-ca CA --ops-listen 127.0.0.1:OPS_PORT
    vramguard webhook  --listen 127.0.0.1:PORT --tls-cert F --tls-key F --kubeconfig K --policy P
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from vramguard.webhook_config import ROUTING_POLICY_NAME

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = REPO_ROOT / "manifests"
SCHEDULER_MANIFESTS = MANIFESTS / "scheduler"
DEFAULT_SCHEDULER_CONFIG = SCHEDULER_MANIFESTS / "extender-default.yaml"
SECOND_SCHEDULER_CONFIG = SCHEDULER_MANIFESTS / "second-scheduler.yaml"
SECOND_SCHEDULER_NAME = "vramguard"

ServiceName = Literal["extender", "webhook"]
SERVICES: tuple[ServiceName, ...] = ("extender", "webhook")
DEFAULT_NAMESPACE = "vramguard-system"

_RBAC_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "FlowSchema")


# --------------------------------------------------------------------------- discovery


def vramguard_command() -> list[str] | None:
    """The ``vramguard`` command: next to this Python interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "vramguard"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("vramguard")
    return [found] if found else None


def service_available(service: ServiceName, command: Sequence[str] | None = None) -> bool:
    """True if ``vramguard <service> --help`` succeeds, i.e. the service is implemented."""
    command = command or vramguard_command()
    if not command:
        return False
    try:
        result = subprocess.run([*command, service, "--help"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def service_argv(
    command: Sequence[str],
    service: ServiceName,
    *,
    port: int,
    tls_cert: Path,
    tls_key: Path,
    kubeconfig: Path,
    policy: Path | None,
    client_ca: Path | None = None,
    ops_port: int | None = None,
) -> list[str]:
    """The command line that starts one vramguard service on 127.0.0.1:``port``.

    ``client_ca`` makes it require client certificates from that CA; ``ops_port`` serves its
    probes and metrics on 127.0.0.1:``ops_port``.
    """
    argv = [
        *command,
        service,
        "--listen",
        f"127.0.0.1:{port}",
        "--tls-cert",
        str(tls_cert),
        "--tls-key",
        str(tls_key),
        "--kubeconfig",
        str(kubeconfig),
    ]
    if policy is not None:
        argv += ["--policy", str(policy)]
    if client_ca is not None:
        argv += ["--client-ca", str(client_ca)]
    if ops_port is not None:
        argv += ["--ops-listen", f"127.0.0.1:{ops_port}"]
    return argv


# --------------------------------------------------------------------------- manifests


def iter_manifest_objects(root: Path = MANIFESTS) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Plain YAML objects under ``root`` (Helm templates and unparsable files are skipped)."""
    if not root.is_dir():
        return
    for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        if "templates" in path.parts:
            continue
        text = path.read_text(errors="replace")
        if "{{" in text:
            continue
        try:
            documents = list(yaml.safe_load_all(text))
        except yaml.YAMLError:
            continue
        for document in documents:
            if isinstance(document, dict) and "kind" in document:
                yield path, document


def manifest_objects(kinds: Sequence[str], root: Path = MANIFESTS) -> list[dict[str, Any]]:
    """All objects of the given kinds under ``root``, in file order."""
    return [obj for _, obj in iter_manifest_objects(root) if obj.get("kind") in kinds]


@dataclass(frozen=True)
class ServiceIdentity:
    """The ServiceAccount a service authenticates as (through a static token in the harness)."""

    namespace: str
    name: str

    @property
    def username(self) -> str:
        """The user name the API server sees."""
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups a ServiceAccount token carries."""
        return ("system:serviceaccounts", f"system:serviceaccounts:{self.namespace}")


def service_identity(service: ServiceName, root: Path = MANIFESTS) -> ServiceIdentity:
    """The ServiceAccount the manifests define for ``service`` (by name), else a default."""
    hints = {"extender": ("extender", "scheduler"), "webhook": ("webhook", "admission")}[service]
    accounts = manifest_objects(["ServiceAccount"], root)
    for hint in hints:
        for account in accounts:
            metadata = account.get("metadata") or {}
            if hint in str(metadata.get("name", "")):
                return ServiceIdentity(str(metadata.get("namespace") or DEFAULT_NAMESPACE), str(metadata["name"]))
    return ServiceIdentity(DEFAULT_NAMESPACE, f"vramguard-{service}")


SCALE_UP_COMPONENTS = {
    "cluster-autoscaler": ("overlays/scale-up",),
    "karpenter": ("overlays/scale-up", "overlays/scale-up-karpenter"),
}
"""The optional kustomize components whose rights the extender has with each ``scale_up.autoscaler``."""
_OPTIONAL = frozenset(part for parts in SCALE_UP_COMPONENTS.values() for part in parts)


def rbac_objects(
    identities: Sequence[ServiceIdentity], root: Path = MANIFESTS, *, autoscaler: str = "none"
) -> list[dict[str, Any]]:
    """RBAC objects to create: those in the manifests (the optional scale-up components only for
    ``autoscaler``, as an installation adds them), plus a cluster-admin binding for any identity
    the manifests do not bind at all (so the harness works before RBAC is written)."""
    wanted = {root / part for part in SCALE_UP_COMPONENTS.get(autoscaler, ())}
    skipped = {root / part for part in _OPTIONAL} - wanted
    objects = [
        copy.deepcopy(obj) for path, obj in iter_manifest_objects(root)
        if obj.get("kind") in _RBAC_KINDS and path.parent not in skipped
    ]
    for obj in objects:
        metadata = obj.setdefault("metadata", {})
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            metadata.setdefault("namespace", DEFAULT_NAMESPACE)
    bound = {
        (str(subject.get("namespace") or DEFAULT_NAMESPACE), str(subject.get("name")))
        for obj in objects
        if obj["kind"] in ("ClusterRoleBinding", "RoleBinding")
        for subject in obj.get("subjects") or []
        if subject.get("kind") == "ServiceAccount"
    }
    declared = {obj["metadata"].get("name") for obj in objects if obj["kind"] == "Namespace"}
    for namespace in sorted({identity.namespace for identity in identities} - declared):
        objects.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    for identity in identities:
        if (identity.namespace, identity.name) in bound:
            continue
        objects.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"e2e-{identity.namespace}-{identity.name}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [{"kind": "ServiceAccount", "namespace": identity.namespace, "name": identity.name}],
            }
        )
    # Namespaces first, then accounts and roles, then bindings (a stable sort keeps file order).
    return sorted(objects, key=lambda obj: _RBAC_KINDS.index(obj["kind"]))


# --------------------------------------------------------------------------- scheduler config

QUEUE_FLAGS = ("--pod-max-in-unschedulable-pods-duration",)


def scheduler_queue_args(root: Path = MANIFESTS) -> list[str]:
    """The queue flags the shipped second scheduler runs with (``manifests/base/scheduler.yaml``),
    for a harness scheduler that calls the extender."""
    for obj in manifest_objects(["Deployment"], root / "base"):
        for container in obj["spec"]["template"]["spec"]["containers"]:
            if container.get("name") == "kube-scheduler":
                return [arg for arg in container.get("command", []) if arg.startswith(QUEUE_FLAGS)]
    return []



def load_yaml(path: Path) -> dict[str, Any]:
    """Load a single-document YAML file as a mapping."""
    loaded = yaml.safe_load(path.read_text())
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping")
    return loaded


EXTENDER_VERB_KEYS = ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb")
"""The fields of an ``extenders`` entry that name the verbs kube-scheduler calls."""


def plain_scheduler_config(like: Mapping[str, Any]) -> dict[str, Any]:
    """A KubeSchedulerConfiguration with only the default profile (no extender), with the API rate
    limit (``clientConnection.qps/burst``) of the shipped configuration ``like``, so that the stock
    scheduler it is compared with is not throttled differently."""
    connection = like.get("clientConnection") or {}
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {key: connection[key] for key in ("qps", "burst") if key in connection},
        "profiles": [{"schedulerName": "default-scheduler"}],
    }


def localize_scheduler_config(
    config: Mapping[str, Any],
    *,
    kubeconfig: Path,
    extender_url: str | None,
    ca_b64: str | None,
    client_cert: tuple[Path, Path] | None = None,
    verbs: Collection[str] | None = None,
) -> dict[str, Any]:
    """Adapt a shipped KubeSchedulerConfiguration to the local run.

    Sets the kubeconfig, turns leader election off (one scheduler per profile, and no lease wait)
    and points every extender at ``extender_url`` (keeping the manifest's URL path) with the
    harness CA as ``tlsConfig.caData`` and ``client_cert`` (certificate file, key file) as
    ``tlsConfig.certFile``/``keyFile``, the client certificate the extender requires. Without an
    extender the ``extenders`` list is dropped, so the same profile runs without vramguard.
    ``verbs``: the only verbs the scheduler calls (``filter``, ``prioritize``, ``bind``, ``preempt``),
    the others left out of the configuration (the throughput benchmark's breakdown); ``None``: as shipped.
    """
    local = copy.deepcopy(dict(config))
    local.setdefault("clientConnection", {})["kubeconfig"] = str(kubeconfig)
    local["leaderElection"] = {"leaderElect": False}
    if extender_url is None:
        local.pop("extenders", None)
        return local
    for extender in local.get("extenders") or []:
        path = urlsplit(str(extender.get("urlPrefix", ""))).path.rstrip("/")
        extender["urlPrefix"] = extender_url.rstrip("/") + path
        extender["enableHTTPS"] = True
        extender["tlsConfig"] = {"insecure": False, "caData": ca_b64}
        if client_cert is not None:
            extender["tlsConfig"] |= {"certFile": str(client_cert[0]), "keyFile": str(client_cert[1])}
        for key in EXTENDER_VERB_KEYS:
            if verbs is not None and extender.get(key) not in verbs:
                extender.pop(key, None)
    return local


# --------------------------------------------------------------------------- webhook config


def default_webhook_configuration() -> dict[str, Any]:
    """The ValidatingWebhookConfiguration used while ``manifests/`` ships none."""
    rules = [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]},
        {
            "apiGroups": ["apps"],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["deployments", "statefulsets", "daemonsets", "replicasets"],
        },
        {
            "apiGroups": ["batch"],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["jobs", "cronjobs"],
        },
    ]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "vramguard"},
        "webhooks": [
            {
                "name": "workloads.vramguard.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 5,
                "clientConfig": {
                    "service": {
                        "namespace": DEFAULT_NAMESPACE,
                        "name": "vramguard-webhook",
                        "path": "/validate",
                    }
                },
                "rules": rules,
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
                    ]
                },
            }
        ],
    }


def localize_webhook_configuration(config: Mapping[str, Any], *, webhook_url: str, ca_b64: str) -> dict[str, Any]:
    """Point every webhook's ``clientConfig`` at the local service (keeping its path)."""
    local = copy.deepcopy(dict(config))
    for webhook in local.get("webhooks") or []:
        client = webhook.get("clientConfig") or {}
        service = client.get("service") or {}
        path = str(service.get("path") or urlsplit(str(client.get("url", ""))).path or "/")
        webhook["clientConfig"] = {"url": webhook_url.rstrip("/") + path, "caBundle": ca_b64}
    return local


def admission_policies(root: Path = MANIFESTS, *, routing: bool = False) -> list[dict[str, Any]]:
    """The shipped ValidatingAdmissionPolicies of the webhook (manifests/webhook) and their bindings;
    with ``routing``, the one that refuses GPU pods left unrouted too (the second-scheduler layout's)."""
    kinds = ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    if (root / "webhook").is_dir():  # the manifests' layout
        found = manifest_objects(kinds, root / "webhook") + manifest_objects(kinds, root / "base")
    else:  # a rendered chart: every object in one place
        found = manifest_objects(kinds, root)
    # The agents' node scope is not the webhook's (and no agent of the harness runs under its identity).
    found = [obj for obj in found if "agent" not in obj["metadata"]["name"]]
    return [obj for obj in found if routing or obj["metadata"]["name"] != ROUTING_POLICY_NAME]


def mutating_webhook_configuration(root: Path = MANIFESTS) -> dict[str, Any]:
    """The shipped MutatingWebhookConfiguration (routing GPU pods to the vramguard scheduler)."""
    [found] = manifest_objects(["MutatingWebhookConfiguration"], root)
    return copy.deepcopy(found)


def webhook_configuration(root: Path = MANIFESTS) -> dict[str, Any]:
    """The shipped ValidatingWebhookConfiguration, or the built-in default."""
    found = manifest_objects(["ValidatingWebhookConfiguration"], root)
    return copy.deepcopy(found[0]) if found else default_webhook_configuration()


# --------------------------------------------------------------------------- REST paths


def object_path(obj: Mapping[str, Any]) -> str:
    """The collection path an object is POSTed to (for the kinds the harness creates)."""
    kind = obj["kind"]
    namespace = (obj.get("metadata") or {}).get("namespace") or DEFAULT_NAMESPACE
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    admission = "/apis/admissionregistration.k8s.io/v1"
    paths = {
        "Namespace": "/api/v1/namespaces",
        "ServiceAccount": f"/api/v1/namespaces/{namespace}/serviceaccounts",
        "ClusterRole": f"{rbac}/clusterroles",
        "ClusterRoleBinding": f"{rbac}/clusterrolebindings",
        "Role": f"{rbac}/namespaces/{namespace}/roles",
        "RoleBinding": f"{rbac}/namespaces/{namespace}/rolebindings",
        "ValidatingWebhookConfiguration": f"{admission}/validatingwebhookconfigurations",
        "MutatingWebhookConfiguration": f"{admission}/mutatingwebhookconfigurations",
        "ValidatingAdmissionPolicy": f"{admission}/validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": f"{admission}/validatingadmissionpolicybindings",
        "FlowSchema": "/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas",
    }
    if kind not in paths:
        raise ValueError(f"the harness does not create {kind} objects")
    return paths[kind]
