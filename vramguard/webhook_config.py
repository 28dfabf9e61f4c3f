"""The ValidatingWebhookConfiguration of the vramguard webhook, generated from a policy, and
its MutatingWebhookConfiguration (:func:`mutating_webhook_configuration`).

Pure: :func:`webhook_configuration` builds the object, :func:`render` writes it as YAML. The
shipped ``manifests/webhook/validating-webhook.yaml`` is :func:`render` of the default policy (a
test checks it), ``vramguard webhook-config`` prints it for any policy, and the Helm chart derives
its entries from the same file.

**Failure policy.** A webhook that cannot answer (down, slow, a body too large) is passed over by
the API server under ``Ignore``: the object is admitted unchecked. That is wrong where a
namespace enforces the policy, and right where it only warns or audits (an outage must not stop
deployments there). So each kind gets two entries, split on the namespace label
``vramguard.io/enforce``: ``Fail`` for namespaces that enforce, ``Ignore`` for the others. A
namespace without the label follows the policy's default mode, hence the selectors depend on it:

==================  ======================================  ======================================
default mode        ``Fail`` entry selects                  ``Ignore`` entry selects
==================  ======================================  ======================================
warn or audit       ``vramguard.io/enforce In [enforce]``    ``vramguard.io/enforce NotIn [enforce]``
enforce             ``NotIn [warn, audit]``                  ``In [warn, audit]``
==================  ======================================  ======================================

A label with another value follows the default mode in the webhook too, so the split and the
webhook always agree.

**Pod updates.** An update of a bound pod that changes what vramguard reads of it (an image, hence
an engine's version and its rules; an ephemeral container added through ``pods/ephemeralcontainers``,
which ``kubectl debug`` uses) is judged against the devices the pod holds, and gets the same pair
of entries (``pod-changes``): ``Fail`` where the namespace enforces, since the ledger would count the
new claims at once. Their matchCondition (:data:`BOUND_CHANGE_EXPRESSION`) compares ``object`` with
``oldObject``, so no other update ever reaches them. Every other pod UPDATE stays ``Ignore``
everywhere (``pod-updates``): an outage must never block removing a finalizer or garbage
collection, and nothing else that decides a pod's VRAM can change.

**Custom workloads.** Every namespaced kind of the policy's ``workload_kinds`` gets the same pair
of entries, registered for the versions the policy names (a version the cluster does not serve
matches nothing). Its matchCondition follows each pod template path with ``has()`` guards, and
stops at a ``*`` (a list or map of templates): such objects are sent whenever that part exists.

**Serving operators' kinds** (KubeAI ``Model``, KAITO ``Workspace``, ``NIMService``, Dynamo's
``DynamoGraphDeployment``, production-stack's ``VLLMRuntime``: :mod:`vramguard.operators`) share
one pair of entries, ``serving-operators``; their objects hold no pod template a condition could
test, so each is sent, and the webhook reads it as its controller will render the pods.

**matchConditions** send only objects that ask for a GPU resource of the policy (its
``gpu_resources`` and ``gpu_resource_prefixes``) in a container's or init container's limits or
requests, that name DRA claims (``spec.resourceClaims``), or whose containers may reach GPUs without
asking (they set ``NVIDIA_VISIBLE_DEVICES``, or run an image that sets it). Each expression guards every field
with ``has()``, so it never errors, and checks ``object != null`` for operations without an object.

**DRA claims.** ResourceClaims and ResourceClaimTemplates are sent on CREATE (their spec is
immutable) to the same pair of entries: one created after the pods that name it is checked against
them, and refused where the namespace enforces the policy. The claims the scheduler creates on the
DRA extended-resource path and those the resourceclaim controller makes from a template for a pod
(``resource.kubernetes.io/pod-claim-name``) are not sent: the pod, and the template, were checked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

from vramguard.codecs import ENFORCE_LABEL, webhook_name
from vramguard.demand.visible import CUDA_IMAGES, VISIBLE_DEVICES
from vramguard.mutation import DEFAULT_SCHEDULER, ROUTING_DISABLED, ROUTING_LABEL, routing_scheduler
from vramguard.operators import OPERATOR_RESOURCES
from vramguard.policy import Policy
from vramguard.workloads import WorkloadKind

__all__ = [
    "WebhookTarget",
    "enforcement_selectors",
    "mutating_webhook_configuration",
    "render",
    "webhook_configuration",
]

CONFIGURATION_NAME = "vramguard"
MUTATE_PATH = "/mutate"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True, slots=True)
class WebhookTarget:
    """Where the API server finds the webhook, and which namespaces it never sends."""

    namespace: str = "vramguard-system"
    service: str = "vramguard-webhook"
    path: str = "/validate"
    port: int = 443
    timeout_seconds: int = 5
    excluded_namespaces: tuple[str, ...] = ("kube-system", "vramguard-system")


@dataclass(frozen=True, slots=True)
class _Kind:
    """One group of resources the webhook validates, and where their pod spec lies."""

    name: str
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    """(API group, resources) pairs, all version v1."""
    spec_path: str
    """The CEL path of the pod spec in ``object`` (``object.spec`` for a Pod)."""


# Workloads' pod templates are validated too, so a bad Deployment is refused at apply time rather
# than later in its ReplicaSet's events; a CronJob's template lies one level deeper.
_KINDS = (
    _Kind("pods", (("", ("pods",)),), "object.spec"),
    _Kind(
        "workloads",
        (("apps", ("deployments", "statefulsets", "daemonsets", "replicasets")), ("batch", ("jobs",))),
        "object.spec.template.spec",
    ),
    _Kind("cronjobs", (("batch", ("cronjobs",)),), "object.spec.jobTemplate.spec.template.spec"),
)


def _client_config(target: WebhookTarget) -> dict[str, Any]:
    return {
        "service": {"namespace": target.namespace, "name": target.service, "path": target.path, "port": target.port}
    }


def enforcement_selectors(default_mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``vramguard.io/enforce`` match expressions of the ``Fail`` and the ``Ignore`` entries."""
    if default_mode == "enforce":
        others = ["warn", "audit"]
        return (
            {"key": ENFORCE_LABEL, "operator": "NotIn", "values": others},
            {"key": ENFORCE_LABEL, "operator": "In", "values": others},
        )
    return (
        {"key": ENFORCE_LABEL, "operator": "In", "values": ["enforce"]},
        {"key": ENFORCE_LABEL, "operator": "NotIn", "values": ["enforce"]},
    )


def asks_for_gpu_expression(
    spec_path: str, resources: Sequence[str], prefixes: Sequence[str], *, reaches: bool = True
) -> str:
    """A CEL expression true when the pod spec at ``spec_path`` asks for one of the GPU resources,
    names DRA claims, or (``reaches``) has a container that sets ``NVIDIA_VISIBLE_DEVICES`` or runs an
    image that sets it (:data:`CUDA_IMAGE_PATTERN`)
    (:mod:`vramguard.demand.visible`: it may reach GPUs without asking)."""
    is_gpu = _is_gpu(resources, prefixes)
    parts = spec_path.split(".")
    guards = [f"has({'.'.join(parts[: i + 1])})" for i in range(1, len(parts))]
    per_list = []
    for field in ("containers", "initContainers"):
        per_list.append(
            f"(has({spec_path}.{field}) && {spec_path}.{field}.exists(c, has(c.resources) &&\n"
            f"  ((has(c.resources.limits) && c.resources.limits.exists(r, {is_gpu})) ||\n"
            f"   (has(c.resources.requests) && c.resources.requests.exists(r, {is_gpu})))))"
        )
    # A pod whose GPU comes from a DRA claim asks for no resource: its claims send it.
    per_list.append(f"(has({spec_path}.resourceClaims) && size({spec_path}.resourceClaims) > 0)")
    if reaches:
        fields = ("containers", "initContainers", "ephemeralContainers") if spec_path == "object.spec" else (
            "containers", "initContainers")
        per_list.extend(
            f"(has({spec_path}.{field}) && {spec_path}.{field}.exists(c, (has(c.env) &&\n"
            f"  c.env.exists(e, e.name == '{VISIBLE_DEVICES}')) ||\n"
            f"  (has(c.image) && c.image.matches('{CUDA_IMAGE_PATTERN}'))))"
            for field in fields
        )
    return "object != null && " + " && ".join(guards) + " &&\n(" + " ||\n ".join(per_list) + ")"


assert all(re.fullmatch(r"[a-z0-9/_-]+", name) for name in CUDA_IMAGES)  # nothing to escape in the pattern
CUDA_IMAGE_PATTERN = "(^|/)(" + "|".join(sorted(CUDA_IMAGES)) + ")([:@]|$)"
"""An image of :data:`~vramguard.demand.visible.CUDA_IMAGES` (any registry, tag or digest), whose own
``NVIDIA_VISIBLE_DEVICES=all`` shows a container that asks for no GPU every GPU of its node."""


BOUND_CHANGE_EXPRESSION = (
    "oldObject != null && has(oldObject.spec.nodeName) && oldObject.spec.nodeName != '' && (\n"
    "  object.spec.containers.map(c, has(c.image) ? c.image : '') !=\n"
    "    oldObject.spec.containers.map(c, has(c.image) ? c.image : '') ||\n"
    "  (has(object.spec.initContainers) ? object.spec.initContainers.map(c, has(c.image) ? c.image : '') : []) !=\n"
    "    (has(oldObject.spec.initContainers) ? oldObject.spec.initContainers.map(c, has(c.image) ? c.image : '') : [])"
    " ||\n"
    "  (has(object.spec.ephemeralContainers) ? size(object.spec.ephemeralContainers) : 0) !=\n"
    "    (has(oldObject.spec.ephemeralContainers) ? size(oldObject.spec.ephemeralContainers) : 0))"
)
"""A pod already bound whose update changes what vramguard reads of it: an image (hence an engine's
version), or an ephemeral container added (``kubectl debug``, through ``pods/ephemeralcontainers``).
Nothing else that decides a pod's VRAM can change once it exists (its command, environment and
resources are immutable; its ``vramguard.io/`` annotations and labels are frozen once bound by the
ValidatingAdmissionPolicy ``vramguard-bound-pod-annotations``)."""


def workload_gpu_expression(kind: WorkloadKind, resources: Sequence[str], prefixes: Sequence[str]) -> str:
    """A CEL expression true when a custom workload may ask for a GPU in one of its templates.

    Each template path is followed with ``has()`` guards; a path through ``*`` (a list or a map of
    templates) or through a name CEL cannot select stops there: the object is sent whenever that
    part exists, and the webhook itself reads the templates.
    """
    terms: list[str] = []
    for template in kind.templates:
        for alternative in template.path.split("|"):
            terms.append(_template_term(alternative.strip().split("."), template.form, resources, prefixes))
    return "object != null && (" + " ||\n ".join(dict.fromkeys(terms)) + ")"


_CEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _template_term(keys: list[str], form: str, resources: Sequence[str], prefixes: Sequence[str]) -> str:
    reachable: list[str] = []
    for key in keys:
        if key == "*" or not _CEL_NAME.match(key):
            return "has(" + ".".join(["object", *reachable]) + ")" if reachable else "true"
        reachable.append(key)
    base = ".".join(["object", *reachable])
    if form == "container":
        guards = [f"has({'.'.join(['object', *reachable[: i + 1]])})" for i in range(len(reachable))]
        is_gpu = _is_gpu(resources, prefixes)
        return (
            "(" + " && ".join(guards) + f" && has({base}.resources) &&\n"
            f"  ((has({base}.resources.limits) && {base}.resources.limits.exists(r, {is_gpu})) ||\n"
            f"   (has({base}.resources.requests) && {base}.resources.requests.exists(r, {is_gpu}))))"
        )
    spec = base + ".spec" if form == "template" else base
    return "(" + asks_for_gpu_expression(spec, resources, prefixes).removeprefix("object != null && ") + ")"


def _is_gpu(resources: Sequence[str], prefixes: Sequence[str]) -> str:
    tests = [f"r == '{name}'" for name in resources] + [f"r.startsWith('{prefix}')" for prefix in prefixes]
    return " || ".join(tests) or "false"


def webhook_configuration(policy: Policy, target: WebhookTarget | None = None) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration for ``policy`` (see the module docstring)."""
    target = target or WebhookTarget()
    fail_selector, ignore_selector = enforcement_selectors(policy.enforcement)
    excluded = {"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": list(target.excluded_namespaces)}
    webhooks: list[dict[str, Any]] = []
    targets = [
        (
            kind.name,
            [{"apiGroups": [group], "apiVersions": ["v1"], "resources": list(resources)}
             for group, resources in kind.rules],
            asks_for_gpu_expression(kind.spec_path, policy.gpu_resources, policy.gpu_resource_prefixes),
        )
        for kind in _KINDS
    ]
    targets += [
        (
            f"{extra.resource}.{extra.group}",
            [{"apiGroups": [extra.group], "apiVersions": list(extra.versions), "resources": [extra.resource]}],
            workload_gpu_expression(extra, policy.gpu_resources, policy.gpu_resource_prefixes),
        )
        for extra in policy.workload_kinds
        if extra.namespaced
    ]
    # The serving operators' kinds vramguard reads (vramguard.operators) hold no pod template to
    # test: every object of theirs runs GPU pods, and is sent whole. A kind the policy describes
    # itself is sent by its own entry.
    described = {(extra.group, extra.resource) for extra in policy.workload_kinds}
    operator_rules = [
        {"apiGroups": [group], "apiVersions": list(versions), "resources": [resource]}
        for group, _, resource, versions in OPERATOR_RESOURCES
        if (group, resource) not in described
    ]
    if operator_rules:
        targets.append(("serving-operators", operator_rules, "object != null"))
    for target_name, rules, expression in targets:
        condition = {"name": "asks-for-a-gpu", "expression": expression}
        creates = ["CREATE"] if target_name == "pods" else ["CREATE", "UPDATE"]
        entries: list[tuple[str, str, list[dict[str, Any]], dict[str, Any] | None, list[dict[str, str]]]] = [
            (webhook_name(target_name), "Fail", _with(rules, creates), fail_selector, [condition]),
            (webhook_name(f"{target_name}-unenforced"), "Ignore", _with(rules, creates), ignore_selector, [condition]),
        ]
        if target_name == "pods":
            # A bound pod's change that alters what it holds is judged like a creation: Fail where
            # the namespace enforces. Every other update (labels, finalizers, status) is sent only
            # with Ignore, so an outage never blocks garbage collection or a deletion.
            changes = _with([*rules, {"apiGroups": [""], "apiVersions": ["v1"], "resources": [
                "pods/ephemeralcontainers"]}], ["UPDATE"])
            changed = {"name": "bound-pod-changes", "expression": BOUND_CHANGE_EXPRESSION}
            unchanged = {"name": "not-a-bound-pod-change", "expression": f"!({BOUND_CHANGE_EXPRESSION})"}
            entries += [
                (webhook_name("pod-changes"), "Fail", changes, fail_selector, [condition, changed]),
                (webhook_name("pod-changes-unenforced"), "Ignore", changes, ignore_selector, [condition, changed]),
                (webhook_name("pod-updates"), "Ignore", _with(rules, ["UPDATE"]), None, [condition, unchanged]),
            ]
        for name, failure, entry_rules, selector, conditions in entries:
            expressions = [excluded, *([selector] if selector is not None else [])]
            webhooks.append({
                "name": name,
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "timeoutSeconds": target.timeout_seconds,
                "failurePolicy": failure,
                "matchPolicy": "Equivalent",
                "clientConfig": _client_config(target),
                "rules": entry_rules,
                "namespaceSelector": {"matchExpressions": [dict(e) for e in expressions]},
                "matchConditions": [dict(c) for c in conditions],
            })
    webhooks.append(_claims_entry(webhook_name("resourceclaims"), "Fail", fail_selector, target, excluded))
    webhooks.append(
        _claims_entry(webhook_name("resourceclaims-unenforced"), "Ignore", ignore_selector, target, excluded)
    )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {
            "name": CONFIGURATION_NAME,
            "labels": {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "webhook"},
        },
        "webhooks": webhooks,
    }


def _with(rules: Sequence[dict[str, Any]], operations: Sequence[str]) -> list[dict[str, Any]]:
    return [{**rule, "operations": list(operations), "scope": "Namespaced"} for rule in rules]


def mutating_webhook_configuration(policy: Policy, target: WebhookTarget | None = None) -> dict[str, Any]:
    """The MutatingWebhookConfiguration for ``policy``: Pod CREATEs that ask for a GPU (a GPU
    resource of the policy, or any DRA claim) go to ``/mutate`` (:mod:`vramguard.mutation`).

    ``failurePolicy: Ignore`` everywhere: a webhook that cannot answer leaves the pod as it was
    written, never blocks it. The validating webhook then judges an unrouted GPU pod by the
    namespace's mode: refused where it enforces the policy (its entry there is ``Fail``), a
    warning where it warns or audits. ``reinvocationPolicy: Never``: the patch is computed once,
    from the pod as the earlier mutating webhooks left it. A namespace labelled
    ``vramguard.io/routing: disabled`` is never sent."""
    target = replace(target or WebhookTarget(), path=MUTATE_PATH)
    excluded = {"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": list(target.excluded_namespaces)}
    opted_out = {"key": ROUTING_LABEL, "operator": "NotIn", "values": [ROUTING_DISABLED]}
    expression = asks_for_gpu_expression(
        "object.spec", policy.gpu_resources, policy.gpu_resource_prefixes, reaches=False
    )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": CONFIGURATION_NAME,
            "labels": {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "webhook"},
        },
        "webhooks": [{
            "name": webhook_name("pod-routing"),
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "timeoutSeconds": target.timeout_seconds,
            "failurePolicy": "Ignore",
            "reinvocationPolicy": "Never",
            "matchPolicy": "Equivalent",
            "clientConfig": _client_config(target),
            "rules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "operations": ["CREATE"],
                "scope": "Namespaced",
            }],
            "namespaceSelector": {"matchExpressions": [excluded, opted_out]},
            "matchConditions": [{"name": "asks-for-a-gpu", "expression": expression}],
        }],
    }


ROUTING_POLICY_NAME = "vramguard-gpu-pods-routed"


def routing_admission_policy(policy: Policy, target: WebhookTarget | None = None) -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicy (and its binding) that refuses a GPU pod the mutating webhook did
    not route: one still on ``default-scheduler`` where routing applies. ``[]`` where nothing is routed.

    The mutating webhook is ``Ignore``: when it cannot answer (down, a body it cannot read), a pod is
    created as written, and ``default-scheduler``, which does not call the extender, would place it
    past every VRAM budget, in every mode. This policy runs inside the API server, after the
    mutating webhooks, with no outage of its own: such a pod is refused, its controller retries, and
    the pod is routed once the webhook answers. It sees GPU resources only; a pod whose GPU comes
    from a DRA claim is routed by the webhook alone (the policy cannot tell a GPU claim from another),
    and the scheduler's DRA plugin still counts what claims consume.
    """
    routed_to = routing_scheduler(policy)
    if routed_to is None:
        return []
    target = target or WebhookTarget()
    labels = {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "webhook"}
    is_gpu = _is_gpu(policy.gpu_resources, policy.gpu_resource_prefixes)
    # A count of 0 asks for nothing (charts template `nvidia.com/gpu: 0` for CPU variants): not routed.
    terms = [
        f"(has(object.spec.{field}) && object.spec.{field}.exists(c, has(c.resources) &&\n"
        f"  ((has(c.resources.limits) && c.resources.limits.exists(r, ({is_gpu}) &&\n"
        f"     quantity(c.resources.limits[r]).isGreaterThan(quantity('0')))) ||\n"
        f"   (has(c.resources.requests) && c.resources.requests.exists(r, ({is_gpu}) &&\n"
        f"     quantity(c.resources.requests[r]).isGreaterThan(quantity('0')))))))"
        for field in ("containers", "initContainers")
    ]
    gpu = "object != null && has(object.spec) &&\n(" + " ||\n ".join(terms) + ")"
    message = (
        f"'GPU pod ' + (has(object.metadata.name) ? object.metadata.name : '') + ' was not routed to the "
        f"{routed_to} scheduler (the vramguard webhook did not answer): refused rather than placed by "
        f"{DEFAULT_SCHEDULER}, which counts no VRAM; it is routed once the webhook answers (retry)'"
    )
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": ROUTING_POLICY_NAME, "labels": dict(labels)},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"],
                }]},
                "matchConditions": [
                    {"name": "asks-for-a-gpu", "expression": gpu},
                    {"name": "not-placed-directly",
                     "expression": "!has(object.spec.nodeName) || object.spec.nodeName == ''"},
                ],
                "validations": [{
                    "expression": (
                        f"has(object.spec.schedulerName) && object.spec.schedulerName != '{DEFAULT_SCHEDULER}'"
                    ),
                    "messageExpression": message,
                    "reason": "Forbidden",
                }],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": ROUTING_POLICY_NAME, "labels": dict(labels)},
            "spec": {
                "policyName": ROUTING_POLICY_NAME,
                "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchExpressions": [
                    {"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": list(target.excluded_namespaces)},
                    {"key": ROUTING_LABEL, "operator": "NotIn", "values": [ROUTING_DISABLED]},
                ]}},
            },
        },
    ]


CLAIMS_CONDITION = (
    "object != null && !(has(object.metadata.annotations) &&\n"
    "  ('resource.kubernetes.io/extended-resource-claim' in object.metadata.annotations ||\n"
    "   'resource.kubernetes.io/pod-claim-name' in object.metadata.annotations))"
)
"""Claims the scheduler creates (the DRA extended-resource path) or the resourceclaim controller makes
from a template are not sent: their pod and template were checked."""


def _claims_entry(
    name: str, failure: str, selector: dict[str, Any], target: WebhookTarget, excluded: dict[str, Any]
) -> dict[str, Any]:
    """ResourceClaims and ResourceClaimTemplates, on CREATE (their spec is immutable)."""
    return {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "timeoutSeconds": target.timeout_seconds,
        "failurePolicy": failure,
        "matchPolicy": "Equivalent",
        "clientConfig": _client_config(target),
        "rules": [{
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["v1"],
            "resources": ["resourceclaims", "resourceclaimtemplates"],
            "operations": ["CREATE"],
            "scope": "Namespaced",
        }],
        "namespaceSelector": {"matchExpressions": [dict(excluded), dict(selector)]},
        "matchConditions": [{"name": "not-made-for-a-pod", "expression": CLAIMS_CONDITION}],
    }


HEADER = """\
# The vramguard validating admission webhook: refuses (or warns about) pods and workloads whose
# VRAM does not add up, at `kubectl apply` time instead of in a crash loop.
#
# GENERATED by `vramguard webhook-config` from the default policy (vramguard/default_policy.yaml);
# do not edit by hand. With a policy of your own (default enforcement, GPU resources), run
# `vramguard webhook-config --policy FILE > validating-webhook.yaml`.
#
# Each kind has two entries, split on the namespace label vramguard.io/enforce: failurePolicy
# Fail where the namespace enforces the policy (an outage or an unreadable review is a refusal
# there), Ignore where it warns or audits (Ignore admits the object unchecked on ANY error: down,
# timeout, a body too large). An update of a bound pod that changes what it holds (an image, an
# ephemeral container added) gets the same pair (pod-changes); every other pod UPDATE is Ignore
# everywhere (pod-updates), so an outage never blocks finalizer removal or garbage collection.
# Run two replicas with the PodDisruptionBudget.
# matchConditions send only objects that ask for a GPU resource of the policy, use a DRA claim,
# set NVIDIA_VISIBLE_DEVICES in a container, or run a CUDA serving image (which sets it to all).
# ResourceClaims and ResourceClaimTemplates (CREATE) are checked against the pods already naming them,
# with the same Fail / Ignore split; those made for a pod (by the scheduler or from a template) are not sent.
#
# Install: `vramguard certs --service vramguard-webhook --namespace vramguard-system --out DIR
# --patch-webhook vramguard` writes the serving certificate and puts its CA into caBundle (or let
# cert-manager's CA injector do it). The e2e harness points clientConfig at its local webhook and
# keeps everything else, so the file tested is the file shipped.
"""


MUTATING_HEADER = """\
# The vramguard mutating admission webhook: routes GPU pods that name no scheduler (or
# default-scheduler) to the vramguard scheduler, so workloads are guarded without edits, and, for
# classes with enforce_memory_limits, writes each GPU container's reservation as
# NVIDIA_GPU_MEMORY_REQUEST/LIMIT (never over a value the pod sets).
#
# GENERATED by `vramguard webhook-config --mutating` from the default policy; do not edit by hand.
#
# failurePolicy Ignore: when the webhook cannot answer, a pod is created as written. The
# validating webhook then refuses an unrouted GPU pod where the namespace enforces the policy,
# and warns about it elsewhere. A namespace labelled vramguard.io/routing=disabled is never sent.
"""


ROUTING_HEADER = """\
# A ValidatingAdmissionPolicy that refuses a GPU pod the mutating webhook did not route to the
# vramguard scheduler (second-scheduler layout). The mutating webhook is failurePolicy Ignore: when
# it cannot answer, a pod is created as written and default-scheduler, which counts no VRAM, would
# place it. This policy runs inside the API server (no outage of its own): such a pod is refused
# in every mode, its controller retries, and it is routed once the webhook answers. Pods created
# with spec.nodeName, pods naming another scheduler, namespaces labelled vramguard.io/routing=disabled
# and the excluded namespaces are left alone; pods whose GPU comes from a DRA claim are routed by the
# webhook only.
#
# GENERATED by `vramguard webhook-config --routing-policy` from the default policy; do not edit by
# hand. Not part of the default-scheduler layout (nothing is routed there).
"""


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the CEL expressions), so the file stays readable."""

    def ignore_aliases(self, data: Any) -> bool:
        """Never write anchors: every entry reads on its own."""
        return True


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def render(configuration: dict[str, Any] | list[dict[str, Any]], header: str = HEADER) -> str:
    """The configuration as YAML, after ``header`` (a list: one document per object)."""
    objects = configuration if isinstance(configuration, list) else [configuration]
    return header + "---\n".join(
        yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120, default_flow_style=False) for obj in objects
    )
