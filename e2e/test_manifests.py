"""The shipped manifests against the real API server: they apply, and RBAC grants what each part needs.

Each rendering (the kustomize base, the default-scheduler overlay, and the Helm chart in both modes
when ``helm`` is installed) is applied with server-side apply: the Namespace and the RBAC objects
for real (SubjectAccessReviews need them; they are the same objects the harness already created
from ``manifests/``), everything else with ``dryRun=All``, so the API server validates every field
(and compiles every CEL expression) without the objects replacing the harness's own webhook
configuration. Then a SubjectAccessReview per ServiceAccount checks what it may and may not do.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.kube import api_exception, kubernetes_module
from tests.test_manifests import BASE, DEFAULT_SCHEDULER, NAMESPACE, helm_command, render_chart, render_kustomization

FIELD_MANAGER = "vramguard-e2e-manifests"
REAL_KINDS = frozenset({"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
JSON = dict[str, Any]

RENDERINGS: dict[str, Callable[[], list[JSON]]] = {
    "kustomize-base": lambda: render_kustomization(BASE),
    "kustomize-default-scheduler": lambda: render_kustomization(DEFAULT_SCHEDULER),
    "helm-second-scheduler": render_chart,
    "helm-default-scheduler": lambda: render_chart("mode=default-scheduler"),
}

# (verb, resource, subresource, namespace, name, allowed) per ServiceAccount; "" namespace = cluster-wide.
Check = tuple[str, str, str, str, str, bool]
NOBODY: list[Check] = [
    ("get", "secrets", "", NAMESPACE, "", False),
    ("list", "secrets", "", "", "", False),
    ("watch", "secrets", "", "kube-system", "", False),
    ("create", "pods", "", "default", "", False),
    ("delete", "nodes", "", "", "", False),
    ("update", "nodes", "status", "", "", False),
]
EXTENDER: list[Check] = [
    ("create", "pods", "binding", "default", "", True),
    ("create", "pods", "eviction", "default", "", True),
    ("get", "pods", "", "default", "", True),
    ("watch", "pods", "", "", "", True),
    ("list", "nodes", "", "", "", True),
    ("watch", "namespaces", "", "", "", True),
    ("watch", "leases", "", NAMESPACE, "", True),
    ("list", "leases", "", "kube-system", "", False),
]
EXPECTED: dict[str, list[Check]] = {
    "vramguard-extender": [
        *EXTENDER,
        ("patch", "nodes", "", "", "", False),
        ("delete", "pods", "", "default", "", False),
        # The extender only reads pods and creates Bindings and Evictions.
        ("patch", "pods", "", "default", "", False),
    ],
    "vramguard-scheduler": [
        *EXTENDER,
        ("get", "leases", "", NAMESPACE, "vramguard-scheduler", True),
        ("update", "leases", "", NAMESPACE, "vramguard-scheduler", True),
        ("update", "leases", "", "kube-system", "kube-controller-manager", False),
        ("get", "configmaps", "", "kube-system", "extension-apiserver-authentication", True),
        ("patch", "nodes", "", "", "", False),
    ],
    "vramguard-webhook": [
        ("list", "pods", "", "", "", True),
        ("watch", "nodes", "", "", "", True),
        ("get", "namespaces", "", "", "team", True),
        ("create", "pods", "binding", "default", "", False),
        ("patch", "pods", "", "default", "", False),
        ("patch", "nodes", "", "", "", False),
    ],
    "vramguard-certificates": [
        ("create", "secrets", "", NAMESPACE, "", True),
        ("get", "secrets", "", NAMESPACE, "vramguard-ca", True),
        ("update", "secrets", "", NAMESPACE, "vramguard-webhook-tls", True),
        ("get", "secrets", "", NAMESPACE, "some-other-secret", False),
        ("delete", "secrets", "", NAMESPACE, "vramguard-ca", False),
        ("patch", "mutatingwebhookconfigurations", "", "", "vramguard", True),
        ("patch", "validatingwebhookconfigurations", "", "", "vramguard", True),
        ("patch", "validatingwebhookconfigurations", "", "", "another-webhook", False),
        ("patch", "deployments", "", NAMESPACE, "vramguard-scheduler", True),
        ("patch", "deployments", "", NAMESPACE, "vramguard-webhook", False),
        ("list", "pods", "", "", "", False),
    ],
    "vramguard-agent": [
        ("patch", "nodes", "", "", "gpu-1", True),
        ("get", "nodes", "", "", "gpu-1", True),
        ("list", "pods", "", "", "", True),
        ("create", "pods", "binding", "default", "", False),
        ("patch", "pods", "", "default", "", False),
        ("update", "leases", "", NAMESPACE, "vramguard-agent-gpu-1", True),
        ("create", "leases", "", NAMESPACE, "", True),
        ("update", "leases", "", "kube-node-lease", "gpu-1", False),
        ("delete", "leases", "", NAMESPACE, "vramguard-agent-gpu-1", False),
        ("create", "events", "", "default", "", True),
    ],
}


def _resource(dynamic: Any, obj: JSON) -> Any:
    return dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])


def apply(dynamic: Any, obj: JSON) -> None:
    """Server-side apply, for real for the RBAC kinds and the Namespace, else ``dryRun=All``."""
    resource = _resource(dynamic, obj)
    options: dict[str, Any] = {"field_manager": FIELD_MANAGER, "force_conflicts": True}
    if obj["kind"] not in REAL_KINDS:
        options["dry_run"] = "All"
    if obj["kind"] in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        # The harness registered its own "vramguard" (clientConfig.url): apply ours beside it, so
        # the server validates this object and not a merge of the two.
        obj = {**obj, "metadata": {**obj["metadata"], "name": obj["metadata"]["name"] + "-shipped"}}
    resource.server_side_apply(body=obj, namespace=obj["metadata"].get("namespace"), **options)


def may(api_client: Any, account: str, check: Check) -> bool:
    """A SubjectAccessReview for the ServiceAccount ``account`` of the vramguard namespace."""
    verb, resource, subresource, namespace, name, _ = check
    groups = {
        "coordination.k8s.io": ("leases",),
        "apps": ("deployments",),
        "admissionregistration.k8s.io": ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"),
    }
    group = next((g for g, resources in groups.items() if resource in resources), "")
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{NAMESPACE}:{account}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}", "system:authenticated"],
            "resourceAttributes": {
                "verb": verb, "group": group, "resource": resource, "subresource": subresource,
                "namespace": namespace, "name": name,
            },
        },
    }
    api = kubernetes_module().client.AuthorizationV1Api(api_client)
    response = api.create_subject_access_review(body, _preload_content=False)
    return bool(json.loads(response.data)["status"].get("allowed"))


@pytest.fixture(scope="module")
def dynamic(cluster: Any) -> Any:
    """A dynamic client on the session cluster, as the admin."""
    return kubernetes_module().dynamic.DynamicClient(cluster.api_client())


def expected(rendering: str, account: str) -> list[Check]:
    """What ``account`` may do in ``rendering``: where kube-scheduler is the control plane's, the
    certificate keeper restarts no Deployment."""
    checks = EXPECTED[account]
    if account == "vramguard-certificates" and rendering.endswith("default-scheduler"):
        return [(*c[:5], False) if c[1] == "deployments" else c for c in checks]
    return checks


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_manifests_apply_and_rbac_is_least_privilege(rendering: str, cluster: Any, dynamic: Any) -> None:
    if rendering.startswith("helm") and helm_command() is None:
        pytest.skip("helm is not installed")
    objects = RENDERINGS[rendering]()
    order = ["Namespace", "ServiceAccount", "ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding"]
    objects.sort(key=lambda o: order.index(o["kind"]) if o["kind"] in order else len(order))
    for obj in objects:
        apply(dynamic, obj)
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    assert accounts <= set(EXPECTED), f"no expectations for {accounts - set(EXPECTED)}"
    client = cluster.api_client()
    wrong = [
        f"{account} {'may' if not allowed else 'may not'} {verb} {resource}{'/' + sub if sub else ''}"
        f" in {namespace or 'the cluster'}{' ' + name if name else ''}"
        for account in sorted(accounts)
        for verb, resource, sub, namespace, name, allowed in [*expected(rendering, account), *NOBODY]
        if may(client, account, (verb, resource, sub, namespace, name, allowed)) != allowed
    ]
    assert wrong == []


@pytest.fixture
def two_nodes(core_v1: Any, unique: str) -> Iterator[tuple[str, str]]:
    """Two plain nodes, deleted afterwards."""
    names = (f"agent-a-{unique}", f"agent-b-{unique}")
    for name in names:
        gpu_nodes.create_cpu_node(core_v1, name)
    yield names
    gpu_nodes.delete_nodes(core_v1, list(names))


def _as_agent(cluster: Any, node: str) -> Any:
    """CoreV1Api impersonating the agent's ServiceAccount with a token bound to a pod on ``node``."""
    client = cluster.api_client()
    client.set_default_header("Impersonate-User", f"system:serviceaccount:{NAMESPACE}:vramguard-agent")
    client.set_default_header("Impersonate-Group", "system:serviceaccounts")
    key = urllib.parse.quote("authentication.kubernetes.io/node-name", safe="")
    client.set_default_header(f"Impersonate-Extra-{key}", node)
    return kubernetes_module().client.CoreV1Api(client)


def test_agent_may_annotate_only_its_own_node(cluster: Any, dynamic: Any, two_nodes: tuple[str, str]) -> None:
    for obj in render_kustomization(BASE):
        if obj["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding") or (
            obj["kind"] in REAL_KINDS and "agent" in obj["metadata"]["name"]
        ):
            resource = _resource(dynamic, obj)
            resource.server_side_apply(
                body=obj, namespace=obj["metadata"].get("namespace"), field_manager=FIELD_MANAGER, force_conflicts=True
            )
    own, other = two_nodes
    agent = _as_agent(cluster, own)
    denied = api_exception()

    def annotate(node: str, value: str) -> None:
        agent.patch_node(node, {"metadata": {"annotations": {"vramguard.io/gpus": value}}})

    # The policy reaches the API server's admission within seconds: wait until it denies.
    deadline = time.monotonic() + 30
    while True:
        try:
            annotate(other, '{"version": 1}')
        except denied as error:
            assert getattr(error, "status", None) in (403, 422), error
            break
        assert time.monotonic() < deadline, "the agent could annotate another node"
        time.sleep(0.5)
    annotate(own, '{"version": 1, "gpus": []}')
    with pytest.raises(denied):
        agent.patch_node(own, {"metadata": {"labels": {"nvidia.com/gpu.product": "forged"}}})
    with pytest.raises(denied):
        agent.patch_node(own, {"spec": {"unschedulable": True}})
    with pytest.raises(denied):
        agent.patch_node(own, {"metadata": {"annotations": {"other": "x"}}})
