"""The admission rules (vramguard.admission): every rule, every enforcement mode, updates, quotas, messages."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.admission import (
    AUDIT_CLASS_KEY,
    AUDIT_WOULD_DENY_KEY,
    MAX_WARNINGS,
    WARNING_LIMIT,
    AdmissionRules,
    ClusterView,
    Code,
    Decision,
    NamespaceUsage,
    ResourceOffer,
    Subject,
    claims_bytes,
    fit_warning,
    offers_from_inventories,
    quantity_text,
    quota_claims,
    workload_pods,
)
from vramguard.cluster import ClusterState
from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL
from vramguard.demand import derive_pod_demand
from vramguard.demand.model import Vram
from vramguard.inventory import read_inventory
from vramguard.ledger import Ledger
from vramguard.placement import pod_claims
from vramguard.policy import ClassChoice, DirectPlacement, Policy, Routing, default_policy
from vramguard.quantity import GiB, MiB, format_bytes

POLICY = Policy.from_yaml(
    """
default_class: best-effort
enforcement: enforce
classes:
  guaranteed:
    sharing: [none, mig]
    allow_implicit_defaults: false
    unknown_vram: reject
  small:
    sharing: [none, time-slicing]
    max_vram_per_gpu: 40Gi
  burstable:
    sharing: [mps]
    require_mps_limit: true
  best-effort:
    sharing: [time-slicing]
    allows_pod_classes: [guaranteed, small, burstable, capped]
  capped:
    sharing: [time-slicing, none]
    max_vram_per_gpu: "0.5"
quotas:
  team-a: 160Gi
# The pods of these tests name no scheduler (the API server would default it to default-scheduler).
schedulers: [vramguard, default-scheduler]
"""
)
RULES = AdmissionRules(POLICY)
VLLM = "vllm/vllm-openai:v0.21.0"
GB80 = 80 * GiB
CUDA_CONTEXT = 512 * MiB
"""What vLLM v0.21.0 holds beside its share on each GPU with no parallel peers (its CUDA graphs are
inside the share from v0.20.0)."""


def offer(*sizes: int, sharing: tuple[str, ...] = ("time-slicing",), replicas: int = 1) -> ResourceOffer:
    """An offer of devices of the given sizes (bytes)."""
    del replicas
    return ResourceOffer(min(sizes), max(sizes), max(sizes), frozenset(sharing))


TIME_SLICED = {"nvidia.com/gpu": offer(GB80)}


def vllm(
    name: str = "vllm", *flags: str, gpus: int = 1, resource: str = "nvidia.com/gpu", **extra: Any
) -> dict[str, Any]:
    """A vLLM container started by the image's entrypoint with ``flags``."""
    return container(name, image=VLLM, args=["--model", "m", *flags], gpus=gpus, resource=resource, **extra)


def labelled(obj: dict[str, Any], qos: str) -> dict[str, Any]:
    obj["metadata"].setdefault("labels", {})[QOS_CLASS_LABEL] = qos
    return obj


def review(
    obj: Mapping[str, Any],
    *,
    mode: str | None = "enforce",
    kind: str = "Pod",
    operation: str = "CREATE",
    namespace: str = "default",
    offers: Mapping[str, ResourceOffer] | None = None,
    usage: NamespaceUsage | None = None,
    old: Mapping[str, Any] | None = None,
    rules: AdmissionRules = RULES,
    namespace_labels: dict[str, str] | None = None,
) -> Decision:
    labels = dict(namespace_labels or {})
    if mode is not None:
        labels[ENFORCE_LABEL] = mode
    subject = Subject(kind, operation, namespace, obj, old)  # type: ignore[arg-type]
    return rules.review(subject, ClusterView(labels, offers if offers is not None else TIME_SLICED, None, usage))


def deployment(template: dict[str, Any], replicas: int = 1, **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "team-a", **metadata},
        "spec": {"replicas": replicas, "selector": {}, "template": {"metadata": template["metadata"],
                                                                     "spec": template["spec"]}},
    }


# --------------------------------------------------------------------------- one rule each

DENIED = [
    pytest.param(
        pod(vllm("vllm", "--gpu-memory-utilization", "1.5")),
        "container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]",
        id="fraction-out-of-range",
    ),
    pytest.param(
        pod(vllm("vllm", "--gpu-memory-utilization", "0.3", "-tp", "2")),
        "container vllm: vLLM: -tp 2 = 2 GPUs, but the container requests "
        "1 nvidia.com/gpu; make them equal",
        id="tensor-parallel-against-gpus",
    ),
    pytest.param(
        pod(vllm("vllm", "--gpu-memory-utilization", "0.5", env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16G"})),
        # The MPS limit bounds the CUDA context too: CUDA counts it against the client's limit.
        f"container vllm: vllm claims 0.5 of the GPU + 512.0 MiB = {format_bytes(GB80 // 2 + CUDA_CONTEXT)} on a "
        "80.0 GiB GPU, more than its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (16.0 GiB)",
        id="claim-above-mps-limit-on-the-gpu-size",
    ),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3")), "gold"),
        "label vramguard.io/qos-class=gold names no class; "
        "use one of guaranteed, small, burstable, best-effort, capped",
        id="unknown-class-label",
    ),
    pytest.param(
        labelled(pod(container("train", gpus=1)), "guaranteed"),
        "container train: VRAM unknown and class guaranteed rejects that; declare it, "
        "e.g. annotation vramguard.io/vram.train: 16Gi",
        id="unknown-vram-rejected",
    ),
    pytest.param(
        labelled(pod(vllm("vllm")), "guaranteed"),
        "container vllm relies on vLLM's default --gpu-memory-utilization (0.92 of the GPU); set it explicitly "
        "(class guaranteed)",
        id="implicit-vllm-default",
    ),
    pytest.param(
        labelled(pod(container("jax", env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})), "guaranteed"),
        "container jax relies on JAX's default pre-allocation (0.75 of the GPU); set XLA_PYTHON_CLIENT_MEM_FRACTION "
        "(class guaranteed)",
        id="implicit-jax-default",
    ),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.9")), "small"),
        f"container vllm: reserves {format_bytes(int(Fraction(9, 10) * GB80) + CUDA_CONTEXT)} per GPU "
        "(0.9 x 80.0 GiB + 512.0 MiB), above class small's max_vram_per_gpu 40Gi",
        id="max-vram-bytes-limit",
    ),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.6")), "capped"),
        "container vllm: reserves 0.6 of the GPU + 512.0 MiB per GPU, above class capped's max_vram_per_gpu 0.5",
        id="max-vram-fraction-limit",
    ),
    pytest.param(
        labelled(pod(container("train")), "capped"),
        "container train: VRAM unknown, so it holds a whole GPU, above class capped's "
        "max_vram_per_gpu 0.5; declare vramguard.io/vram.train",
        id="max-vram-unknown-is-a-whole-gpu",
    ),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3", "-tp", "2", gpus=2)), "burstable"),
        "container vllm: class burstable requires env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, e.g. 0=16G,1=16G",
        id="burstable-needs-mps-limit",
    ),
    pytest.param(
        pod(vllm("vllm", "--gpu-memory-utilization", "0.3", resource="nvidia.com/mig-3g.40gb")),
        "container vllm: class best-effort does not allow MIG (nvidia.com/mig-3g.40gb); "
        "set label vramguard.io/qos-class to guaranteed",
        id="mig-only-for-classes-allowing-it",
    ),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3", resource="nvidia.com/gpu.shared")), "guaranteed"),
        "container vllm: class guaranteed does not allow shared GPUs (nvidia.com/gpu.shared); "
        "set label vramguard.io/qos-class to small or burstable or best-effort or capped",
        id="shared-resource-for-an-exclusive-class",
    ),
    pytest.param(
        pod(vllm("vllm", "--gpu-memory-utilization", "0.3")),
        "container vllm: nodes offer nvidia.com/gpu only as exclusive GPUs, which class best-effort does not "
        "allow (it allows time-slicing)",
        id="sharing-the-nodes-offer",
    ),
]


EVERY_SHARING = {
    "nvidia.com/gpu": offer(GB80, sharing=("time-slicing", "mps", "none")),
    "nvidia.com/mig-3g.40gb": offer(40 * 10**9, sharing=("mig",)),
    "nvidia.com/gpu.shared": offer(GB80),
}


@pytest.mark.parametrize(("obj", "message"), DENIED)
def test_each_rule_denies_with_an_actionable_message(request: pytest.FixtureRequest, obj: dict[str, Any],
                                                     message: str) -> None:
    offers = dict(EVERY_SHARING)
    if request.node.callspec.id == "sharing-the-nodes-offer":
        offers["nvidia.com/gpu"] = offer(GB80, sharing=("none",))
    decision = review(obj, offers=offers)
    assert not decision.allowed
    assert decision.violations == (message,)
    assert decision.message == message


def test_issue_examples_read_as_written() -> None:
    decision = review(labelled(pod(vllm("vllm")), "guaranteed"), mode="warn")
    assert decision.allowed
    assert decision.warnings[0] == (
        "would deny: container vllm relies on vLLM's default --gpu-memory-utilization (0.92 of the GPU); "
        "set it explicitly (class guaranteed)"
    )


ALLOWED = [
    pytest.param(pod(container("web", gpus=None)), id="no-gpu"),
    pytest.param(pod(container("web", gpus="0")), id="zero-gpus"),
    pytest.param(pod(vllm("vllm", "--gpu-memory-utilization", "0.3")), id="explicit-fraction"),
    pytest.param(labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3")), "guaranteed"), id="guaranteed-ok"),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3",
                          env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=30G"})), "burstable"),
        id="burstable-with-limit",
    ),
    pytest.param(
        labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3", resource="nvidia.com/mig-3g.40gb")),
                 "guaranteed"),
        id="mig-in-guaranteed",
    ),
    pytest.param(pod(container("train"), annotations={"vramguard.io/vram": "12Gi"}), id="declared-bytes"),
]


@pytest.mark.parametrize("obj", ALLOWED)
def test_pods_that_follow_the_rules_are_allowed_without_violations(obj: dict[str, Any]) -> None:
    offers = {
        "nvidia.com/gpu": offer(GB80, sharing=("none", "time-slicing", "mps")),
        "nvidia.com/mig-3g.40gb": offer(40 * 10**9, sharing=("mig",)),
    }
    decision = review(obj, offers=offers)
    assert decision.allowed
    assert decision.violations == ()
    assert decision.message is None


def test_no_gpu_pod_gets_no_warning_at_all() -> None:
    decision = review(pod(container("web", gpus=None)), offers={})
    assert (decision.allowed, decision.wants_gpu, decision.warnings) == (True, False, ())


NOTES = [
    pytest.param(pod(vllm("vllm")), "container vllm relies on vLLM's default --gpu-memory-utilization", id="default"),
    pytest.param(pod(container("train")), "container train: no known engine and no vramguard.io/vram annotation",
                 id="unknown-vram-counted-whole"),
    pytest.param(pod(vllm("vllm", "--gpu-memory-utilization", "0.3", resource="nvidia.com/gpu.shared")),
                 "container vllm: no node offers nvidia.com/gpu.shared yet", id="resource-nobody-offers"),
]


@pytest.mark.parametrize(("obj", "start"), NOTES)
def test_non_blocking_findings_are_warnings_in_every_mode(obj: dict[str, Any], start: str) -> None:
    for mode in ("enforce", "warn", "audit"):
        decision = review(obj, mode=mode)
        assert decision.allowed, mode
        assert any(w.startswith(start) for w in decision.warnings), (mode, decision.warnings)


def test_size_dependent_problems_deny_only_when_true_on_every_gpu() -> None:
    # 0.5 of a 24 GiB GPU is 12 GiB and the CUDA context 0.5 GiB (fits the 16 GiB MPS limit), of an
    # 80 GiB GPU 40 GiB and the context (does not).
    obj = pod(vllm("vllm", "--gpu-memory-utilization", "0.5", env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16G"}))
    mixed = {"nvidia.com/gpu": offer(24 * GiB, GB80)}
    decision = review(obj, offers=mixed)
    assert decision.allowed
    assert any(f"{format_bytes(GB80 // 2 + CUDA_CONTEXT)} on a 80.0 GiB GPU" in w for w in decision.warnings)
    assert not review(obj, offers={"nvidia.com/gpu": offer(GB80)}).allowed


def test_max_vram_on_mixed_gpu_sizes_warns_only() -> None:
    obj = labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.4")), "small")
    offers = {"nvidia.com/gpu": offer(GB80, 141 * GiB, sharing=("none",))}
    decision = review(obj, offers=offers)
    assert decision.allowed
    held = format_bytes(int(Fraction(4, 10) * 141 * GiB) + CUDA_CONTEXT)
    assert (
        f"container vllm: reserves {held} per GPU (0.4 x 141.0 GiB + 512.0 MiB), above class small's "
        "max_vram_per_gpu 40Gi"
    ) in decision.notes


def test_max_vram_needs_a_size_to_compare_a_fraction_with_bytes() -> None:
    obj = labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.4")), "small")
    decision = review(obj, offers={})
    assert decision.allowed
    assert any("cannot check max_vram_per_gpu 40Gi" in n for n in decision.notes)


def test_namespace_class_label_naming_no_class_is_a_note() -> None:
    obj = pod(vllm("vllm", "--gpu-memory-utilization", "0.3"))
    decision = review(obj, namespace_labels={QOS_CLASS_LABEL: "platinum"})
    assert decision.allowed
    assert decision.qos_class == "best-effort"
    assert any("namespace label vramguard.io/qos-class=platinum names no class" in n for n in decision.notes)


def test_namespace_label_chooses_the_class() -> None:
    obj = pod(vllm("vllm"))
    decision = review(obj, namespace_labels={QOS_CLASS_LABEL: "guaranteed"})
    assert decision.qos_class == "guaranteed"
    assert not decision.allowed


def test_a_disallowed_default_is_not_repeated_as_a_warning() -> None:
    decision = review(labelled(pod(vllm("vllm")), "guaranteed"), mode="warn")
    assert sum("relies on vLLM's default" in w for w in decision.warnings) == 1


# --------------------------------------------------------------------------- enforcement modes


BAD = pod(vllm("vllm", "--gpu-memory-utilization", "1.5"))
BAD_MESSAGE = "container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]"


def test_enforce_denies() -> None:
    decision = review(BAD, mode="enforce")
    assert (decision.allowed, decision.mode, decision.message) == (False, "enforce", BAD_MESSAGE)
    assert decision.audit_annotations == {}


def test_warn_admits_with_the_violation_as_a_warning() -> None:
    decision = review(BAD, mode="warn")
    assert (decision.allowed, decision.mode, decision.message) == (True, "warn", None)
    assert f"would deny: {BAD_MESSAGE}" in decision.warnings
    assert decision.audit_annotations == {}


def test_audit_admits_and_records_audit_annotations() -> None:
    decision = review(BAD, mode="audit")
    assert (decision.allowed, decision.mode) == (True, "audit")
    assert json.loads(decision.audit_annotations[AUDIT_WOULD_DENY_KEY]) == [BAD_MESSAGE]
    assert decision.audit_annotations[AUDIT_CLASS_KEY] == "best-effort"
    # Said as well as recorded: what would be refused is never less visible than a note.
    assert decision.warnings[0] == f"audit: would deny: {BAD_MESSAGE}"


def test_audit_annotation_keys_are_names_the_api_server_accepts() -> None:
    # The API server stores "<webhook name>/<key>" and requires a qualified name: no "/" in the key.
    for key in (AUDIT_WOULD_DENY_KEY, AUDIT_CLASS_KEY):
        assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", key) and len(key) <= 63


def test_mode_defaults_to_the_policy_and_invalid_labels_are_reported() -> None:
    audit_policy = AdmissionRules(default_policy())
    assert review(BAD, mode=None, rules=audit_policy).mode == "audit"
    assert review(BAD, mode=None).mode == "enforce"
    decision = review(BAD, mode="strict")
    assert decision.mode == "enforce"
    assert any("vramguard.io/enforce=strict is not enforce, warn or audit" in n for n in decision.notes)


def test_several_violations_are_listed_in_the_denial() -> None:
    obj = labelled(pod(vllm("a", "--gpu-memory-utilization", "1.5"), vllm("b")), "guaranteed")
    decision = review(obj)
    assert decision.message is not None
    assert decision.message.startswith(f"{len(decision.violations)} problems:\n- ")
    assert all(f"- {v}" in decision.message for v in decision.violations)


def test_warnings_stay_under_the_limit_and_are_capped_in_number() -> None:
    many = pod(*(vllm(f"container-with-a-long-name-{i:02d}", "--gpu-memory-utilization", "1.5") for i in range(30)))
    decision = review(many, mode="warn")
    assert all(len(w) <= WARNING_LIMIT for w in decision.warnings)
    assert len(decision.warnings) == MAX_WARNINGS
    assert decision.warnings[-1].startswith("and ")


def test_audit_value_is_bounded() -> None:
    many = pod(*(vllm(f"c{i}-" + "x" * 40, "--gpu-memory-utilization", "1.5") for i in range(200)))
    value = review(many, mode="audit").audit_annotations[AUDIT_WOULD_DENY_KEY]
    assert len(value) < 9000
    assert json.loads(value)[-1].startswith("and ")


# --------------------------------------------------------------------------- updates


def test_update_is_not_refused_for_a_problem_it_did_not_introduce() -> None:
    old = BAD
    new = json.loads(json.dumps(BAD))
    new["metadata"]["labels"] = {"app": "renamed"}
    decision = review(new, operation="UPDATE", old=old)
    assert decision.allowed
    assert BAD_MESSAGE in decision.warnings


def test_update_that_introduces_a_problem_is_refused() -> None:
    old = pod(vllm("vllm", "--gpu-memory-utilization", "0.3"))
    decision = review(BAD, operation="UPDATE", old=old)
    assert not decision.allowed


def test_object_being_deleted_is_admitted() -> None:
    obj = json.loads(json.dumps(BAD))
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert review(obj, operation="UPDATE", old=BAD).allowed


# --------------------------------------------------------------------------- workloads


@pytest.mark.parametrize(
    ("kind", "obj", "pods"),
    [
        pytest.param("Deployment", {"spec": {"replicas": 3}}, 3, id="deployment"),
        pytest.param("StatefulSet", {"spec": {}}, 1, id="statefulset-default"),
        pytest.param("ReplicaSet", {"spec": {"replicas": 0}}, 0, id="replicaset-zero"),
        pytest.param("Job", {"spec": {"parallelism": 4, "completions": 2}}, 2, id="job-completions"),
        pytest.param("Job", {"spec": {"parallelism": 4}}, 4, id="job-parallelism"),
        pytest.param("CronJob", {"spec": {"jobTemplate": {"spec": {"parallelism": 2}}}}, 2, id="cronjob"),
        pytest.param("Deployment", {"spec": {"replicas": "3"}}, 1, id="junk-replicas"),
        pytest.param("DaemonSet", {"spec": {}}, 1, id="daemonset-without-node-count"),
    ],
)
def test_pods_a_workload_runs(kind: str, obj: dict[str, Any], pods: int) -> None:
    assert workload_pods(kind, obj) == pods


def test_invalid_template_of_every_workload_kind_is_denied() -> None:
    template = pod(vllm("vllm", "--gpu-memory-utilization", "1.5"))
    spec = {"metadata": {}, "spec": template["spec"]}
    objects = {
        "Deployment": {"spec": {"template": spec}},
        "StatefulSet": {"spec": {"template": spec}},
        "DaemonSet": {"spec": {"template": spec}},
        "ReplicaSet": {"spec": {"template": spec}},
        "Job": {"spec": {"template": spec}},
        "CronJob": {"spec": {"jobTemplate": {"spec": {"template": spec}}}},
    }
    for kind, obj in objects.items():
        decision = review({"kind": kind, "metadata": {"name": "w"}, **obj}, kind=kind)
        assert decision.message == BAD_MESSAGE, kind


def test_workload_template_class_label_is_read() -> None:
    template = labelled(pod(vllm("vllm")), "guaranteed")
    decision = review(deployment(template), kind="Deployment")
    assert decision.qos_class == "guaranteed"
    assert not decision.allowed


def test_daemonset_counts_the_nodes_it_would_run_on() -> None:
    template = pod(container("agent"), annotations={"vramguard.io/vram": "40Gi"})
    template["spec"]["nodeSelector"] = {"pool": "a"}
    daemonset = {"kind": "DaemonSet", "metadata": {"name": "ds"},
                 "spec": {"template": {"metadata": template["metadata"], "spec": template["spec"]}}}
    offers = {"nvidia.com/gpu": ResourceOffer(GB80, GB80, GB80, frozenset({"time-slicing"}),
                                              ({"pool": "a"}, {"pool": "a"}, {"pool": "b"}, {"pool": "a"}))}
    decision = review(daemonset, kind="DaemonSet", namespace="team-a", offers=offers, usage=NamespaceUsage())
    assert (decision.pods, decision.allowed) == (3, True)  # 120Gi fits 160Gi
    decision = review(daemonset, kind="DaemonSet", namespace="team-a", offers=offers,
                      usage=NamespaceUsage(41 * GiB, 1))
    assert decision.message == (
        "namespace team-a would hold 161Gi of its 160Gi VRAM quota (3 pod(s) x 40Gi, 1 other pod(s) 41Gi)"
    )


# --------------------------------------------------------------------------- quota

DECLARED_40 = {"vramguard.io/vram": "40Gi"}


def test_quota_message_from_the_issue() -> None:
    obj = pod(container("train"), annotations=DECLARED_40)
    decision = review(obj, namespace="team-a", usage=NamespaceUsage(136 * GiB, 4))
    assert decision.message == (
        "namespace team-a would hold 176Gi of its 160Gi VRAM quota (this pod 40Gi, 4 other pod(s) 136Gi)"
    )


def test_quota_fits_exactly() -> None:
    obj = pod(container("train"), annotations=DECLARED_40)
    assert review(obj, namespace="team-a", usage=NamespaceUsage(120 * GiB, 3)).allowed


def test_quota_counts_fractions_on_the_largest_gpu() -> None:
    obj = pod(vllm("vllm", "--gpu-memory-utilization", "0.5"))
    offers = {"nvidia.com/gpu": offer(24 * GiB, GB80)}
    decision = review(obj, namespace="team-a", offers=offers, usage=NamespaceUsage(121 * GiB, 3))
    # 0.5 of the 80 GiB GPU (not of the 24 GiB one) and the CUDA context beside it.
    this_pod = GB80 // 2 + CUDA_CONTEXT
    assert decision.message is not None
    assert f"would hold {quantity_text(121 * GiB + this_pod)} of its 160Gi" in decision.message
    assert f"(this pod {quantity_text(this_pod)}," in decision.message


def test_quota_counts_unknown_vram_as_the_whole_gpu() -> None:
    obj = pod(container("train", gpus=2))
    decision = review(obj, namespace="team-a", usage=NamespaceUsage(1 * GiB, 1))
    assert decision.message is not None and "(this pod 160Gi," in decision.message


def test_quota_cannot_size_a_fraction_without_gpus() -> None:
    obj = pod(vllm("vllm", "--gpu-memory-utilization", "0.5"))
    decision = review(obj, namespace="team-a", offers={}, usage=NamespaceUsage(159 * GiB, 3))
    assert decision.allowed
    assert any("this pod's share of it is not counted" in n for n in decision.notes)


def test_namespace_without_quota_is_not_checked() -> None:
    obj = pod(container("train"), annotations=DECLARED_40)
    assert review(obj, namespace="team-b", usage=NamespaceUsage(10_000 * GiB, 99)).allowed


def test_workload_create_counts_its_replicas_on_top_of_the_namespace() -> None:
    template = pod(container("train"), annotations=DECLARED_40)
    decision = review(deployment(template, replicas=3), kind="Deployment", namespace="team-a",
                      usage=NamespaceUsage(56 * GiB, 2))
    assert decision.message == (
        "namespace team-a would hold 176Gi of its 160Gi VRAM quota (3 pod(s) x 40Gi, 2 other pod(s) 56Gi)"
    )


def test_workload_update_is_checked_alone() -> None:
    template = pod(container("train"), annotations=DECLARED_40)
    old = deployment(template, replicas=3)
    # Its own 3 pods are in the namespace's usage already: scaling to 4 (160Gi) fits.
    assert review(deployment(template, replicas=4), kind="Deployment", operation="UPDATE", namespace="team-a",
                  usage=NamespaceUsage(150 * GiB, 3), old=old).allowed
    decision = review(deployment(template, replicas=5), kind="Deployment", operation="UPDATE",
                      namespace="team-a", usage=NamespaceUsage(150 * GiB, 3), old=old)
    assert decision.message == (
        "Deployment needs 200Gi of VRAM (5 pod(s) x 40Gi), more than namespace team-a's 160Gi VRAM quota"
    )


def test_workload_made_by_a_controller_is_not_quota_checked_again() -> None:
    template = pod(container("train"), annotations=DECLARED_40)
    owned = deployment(template, replicas=5,
                       ownerReferences=[{"kind": "Deployment", "name": "d", "uid": "u", "controller": True}])
    owned["kind"] = "ReplicaSet"
    assert review(owned, kind="ReplicaSet", namespace="team-a", usage=NamespaceUsage(150 * GiB, 3)).allowed


def test_claims_bytes() -> None:
    demand = derive_pod_demand(pod(vllm("a", "--gpu-memory-utilization", "0.25", "-tp", "2", gpus=2),
                                   container("b", resource="nvidia.com/gpu.shared"),
                                   annotations={"vramguard.io/vram.b": "10Gi"}))
    claims = quota_claims(demand)
    # Per GPU of a: 0.25 of it, the CUDA context and the communication buffers (tensor parallel 2);
    # b's declaration is a total.
    per_gpu = GB80 // 4 + CUDA_CONTEXT + GiB
    assert claims_bytes(claims, {"nvidia.com/gpu": offer(GB80)}) == (2 * per_gpu + 10 * GiB, ())
    assert claims_bytes(claims, {}) == (10 * GiB, ("nvidia.com/gpu",))


def test_offers_from_node_inventories() -> None:
    def node(name: str, memory_mib: int, sharing: str, replicas: int) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": {
                "nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": str(memory_mib),
                "nvidia.com/gpu.replicas": str(replicas), "nvidia.com/gpu.sharing-strategy": sharing,
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            "status": {"allocatable": {"nvidia.com/gpu": str(2 * replicas)}},
        }

    inventories = [read_inventory(node("a", 81559, "time-slicing", 4)), read_inventory(node("b", 143771, "mps", 2))]
    offers = offers_from_inventories(inventories, {"a": {"pool": "x"}})
    gpu = offers["nvidia.com/gpu"]
    assert (gpu.smallest_bytes, gpu.largest_bytes) == (81559 * MiB, 143771 * MiB)
    assert gpu.largest_whole_bytes == 81559 * MiB  # one MPS replica of the H200 holds half of it
    assert gpu.sharing == frozenset({"time-slicing", "mps"})
    assert gpu.node_labels == ({"pool": "x"}, {})


# --------------------------------------------------------------------------- text helpers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("short and sweet", "short and sweet", id="short"),
        pytest.param("  spaced \n out  ", "spaced out", id="whitespace"),
        pytest.param("x" * 80 + " keep this (drop this detail please)" + " tail", "x" * 80 + " keep this tail",
                     id="drops-parentheses-first"),
        pytest.param(" ".join(["word"] * 40), " ".join(["word"] * 23) + "...", id="cuts-at-a-word"),
        pytest.param("y" * 200, "y" * 117 + "...", id="cuts-a-long-word"),
    ],
)
def test_fit_warning(text: str, expected: str) -> None:
    fitted = fit_warning(text, limit=120)
    assert fitted == expected
    assert len(fitted) <= 120
    assert len(fit_warning(text * 3)) <= WARNING_LIMIT


@pytest.mark.parametrize(
    ("count", "text"),
    [(176 * GiB, "176Gi"), (0, "0Gi"), (int(70.5 * GiB), "70.5Gi"), (512 * MiB, "512Mi"), (GiB + 1, "1Gi")],
)
def test_quantity_text(count: int, text: str) -> None:
    assert quantity_text(count) == text


# --------------------------------------------------------------------------- absurd requests


@pytest.mark.parametrize("count", ["100000000000000000000", "1e21", "1025"])
def test_more_gpus_than_any_node_offers_costs_nothing_and_is_refused(count: str) -> None:
    obj = pod(vllm("vllm", "--gpu-memory-utilization", "0.3", env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16G"},
                   gpus=count))  # type: ignore[arg-type]
    decision = review(obj, namespace="team-a", usage=NamespaceUsage())
    assert not decision.allowed
    assert f"container vllm: nvidia.com/gpu: {count} devices is more than any node offers (at most 1024)" in (
        decision.violations
    )
    assert len(decision.claims) <= 1024


@pytest.mark.parametrize(
    ("containers", "gpus"),
    [pytest.param(5, 1024, id="each-container-at-the-cap"), pytest.param(2, 513, id="just-over-the-cap-in-all")],
)
def test_a_pod_asking_for_more_devices_than_any_node_has_gets_no_claims(containers: int, gpus: int) -> None:
    """One cap for a container and for the pod in all: no node hands out more devices."""
    asking = (container(f"c{i}", gpus=str(gpus)) for i in range(containers))
    obj = pod(*asking, annotations={"vramguard.io/vram": "1Gi"})
    decision = review(obj)
    asked = containers * gpus
    assert f"the pod asks for {asked} GPU devices in all; no node offers more than 1024" in decision.violations
    assert decision.claims == ()


# --------------------------------------------------------------------------- tenants stay in their lane


def test_pod_label_outside_its_namespace_class_is_a_violation_and_ignored() -> None:
    policy = Policy.from_yaml("""
default_class: open
enforcement: enforce
schedulers: [default-scheduler]
classes:
  open: {sharing: [time-slicing], allows_pod_classes: [team]}
  team: {sharing: [time-slicing], max_vram_per_gpu: 40Gi}
""")
    obj = labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3")), "open")
    decision = review(obj, rules=AdmissionRules(policy), namespace_labels={QOS_CLASS_LABEL: "team"})
    assert decision.qos_class == "team"  # the namespace's class still applies
    assert decision.violations == (
        "label vramguard.io/qos-class=open is not allowed in namespace class team; use one of team "
        "(a namespace admin sets the namespace's class)",
    )
    # The unlabelled namespace's (default) class lists team: the label is honoured there.
    obj = labelled(pod(vllm("vllm", "--gpu-memory-utilization", "0.3")), "team")
    allowed = review(obj, rules=AdmissionRules(policy))
    assert (allowed.allowed, allowed.qos_class, allowed.violations) == (True, "team", ())


# --------------------------------------------------------------------------- schedulers

WIRED = AdmissionRules(POLICY.model_copy(update={"schedulers": ("vramguard",)}))
NOT_WIRED = (
    "spec.schedulerName default-scheduler does not call vramguard, so nothing would check this pod's GPU "
    "memory; set spec.schedulerName: vramguard (policy schedulers: vramguard); the mutating webhook did not "
    "route it (is it running?)"
)
NOT_ROUTED = AdmissionRules(POLICY.model_copy(update={
    "schedulers": ("vramguard",), "routing": Routing(enabled=False)
}))
GOOD = vllm("vllm", "--gpu-memory-utilization", "0.3")
SCHEDULERS = {
    "default-scheduler-implied": (pod(GOOD), "Pod", (NOT_WIRED,)),
    "default-scheduler-named": (pod(GOOD, schedulerName="default-scheduler"), "Pod", (NOT_WIRED,)),
    "wired-scheduler": (pod(GOOD, schedulerName="vramguard"), "Pod", ()),
    "direct-placement-is-checked-otherwise": (pod(GOOD, nodeName="n1", schedulerName="x"), "Pod", ()),
    # Its pods are routed as they are created.
    "workload-template": (deployment(pod(GOOD)), "Deployment", ()),
    "workload-naming-another-scheduler": (
        deployment(pod(GOOD, schedulerName="x")),
        "Deployment",
        ("spec.schedulerName x does not call vramguard, so nothing would check this pod's GPU memory; set "
         "spec.schedulerName: vramguard (policy schedulers: vramguard)",),
    ),
}


def test_without_routing_a_workload_must_name_the_scheduler() -> None:
    decision = review(deployment(pod(GOOD)), kind="Deployment", rules=NOT_ROUTED)
    assert decision.violations == (NOT_WIRED.split("; the mutating", maxsplit=1)[0],)


@pytest.mark.parametrize(("obj", "kind", "violations"), SCHEDULERS.values(), ids=SCHEDULERS.keys())
def test_gpu_pods_must_name_a_scheduler_wired_to_vramguard(obj: dict[str, Any], kind: str,
                                                           violations: tuple[str, ...]) -> None:
    decision = review(obj, kind=kind, rules=WIRED, offers={"nvidia.com/gpu": offer(GB80, sharing=("time-slicing",))})
    assert decision.violations == violations
    assert decision.allowed is not violations


def test_scheduler_violation_only_warns_in_a_warn_namespace() -> None:
    decision = review(pod(GOOD), rules=WIRED, mode="warn")
    assert decision.allowed
    assert decision.warnings[0] == (
        "would deny: spec.schedulerName default-scheduler does not call vramguard, so nothing would check this "
        "pod's GPU memory; set spec.schedulerName: vramguard (policy schedulers: vramguard); the mutating webhook "
        "did not route it (is it running?)"
    )
    assert len(decision.warnings[0]) <= WARNING_LIMIT == 256  # whole, within what the API server keeps


# --------------------------------------------------------------------------- direct placement


def ledger_with(*bound: dict[str, Any], gpus: int = 1) -> Ledger:
    """The cluster model's ledger with one time-sliced node ``n1`` of 80 GiB GPUs and ``bound`` pods."""
    state = ClusterState(POLICY)
    state.nodes.replace([{
        "metadata": {"name": "n1", "labels": {
            "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.replicas": "4",
            "nvidia.com/gpu.sharing-strategy": "time-slicing", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus * 4)}},
    }])
    state.pods.replace(list(bound))
    return state.ledger


def direct(utilization: str, uid: str, **spec: Any) -> dict[str, Any]:
    obj = pod(vllm("vllm", "--gpu-memory-utilization", utilization), nodeName="n1", **spec)
    obj["metadata"]["uid"] = uid
    return obj


# n1's GPU is time-sliced (shared): its budget keeps 3% free. The bound pod holds 0.8 of it, the new one
# needs 0.5; each with its CUDA context.
N1_BUDGET = GB80 * 97 // 100
DIRECT_DENIAL = (
    "spec.nodeName n1 places the pod past the scheduler and it does not fit there: GPU 0 (NVIDIA A100 SXM4 "
    f"80GB): {format_bytes(N1_BUDGET - int(Fraction(8, 10) * GB80) - CUDA_CONTEXT)} of {format_bytes(N1_BUDGET)} "
    f"VRAM budget free, pod needs {format_bytes(GB80 // 2 + CUDA_CONTEXT)} per GPU"
)
DIRECT = {
    "fits": ("CREATE", "bob", (), (), ()),
    "over-budget": ("CREATE", "bob", (), (direct("0.8", "b0"),), (DIRECT_DENIAL,)),
    "allow-listed-user": ("CREATE", "kubelet", (), (direct("0.8", "b0"),), ()),
    "allow-listed-group": ("CREATE", "bob", ("system:nodes",), (direct("0.8", "b0"),), ()),
    "update-not-rechecked": ("UPDATE", "bob", (), (direct("0.8", "b0"),), ()),
}
PLACING = AdmissionRules(POLICY.model_copy(update={"direct_placement": DirectPlacement(
    allowed_users=("kubelet",), allowed_groups=("system:nodes",))}))


@pytest.mark.parametrize(("operation", "user", "groups", "bound", "violations"), DIRECT.values(), ids=DIRECT.keys())
def test_direct_placement_must_fit_the_node_ledger(operation: str, user: str, groups: tuple[str, ...],
                                                   bound: tuple[dict[str, Any], ...],
                                                   violations: tuple[str, ...]) -> None:
    obj = direct("0.5", "new")
    subject = Subject("Pod", operation, "default", obj, obj if operation == "UPDATE" else None,  # type: ignore[arg-type]
                      user, groups)
    view = ClusterView({ENFORCE_LABEL: "enforce"}, TIME_SLICED, TIME_SLICED, None, ledger_with(*bound))
    decision = PLACING.review(subject, view)
    assert decision.violations == violations


def test_direct_placement_on_a_node_being_re_read_is_refused() -> None:
    obj = direct("0.1", "new")
    subject = Subject("Pod", "CREATE", "default", obj, None, "bob")
    view = ClusterView({ENFORCE_LABEL: "enforce"}, TIME_SLICED, TIME_SLICED, None, ledger_with(),
                       "node n1: vramguard is re-reading its pods after an oversized watch event")
    assert PLACING.review(subject, view).violations == (
        "spec.nodeName n1 places the pod past the scheduler: node n1: vramguard is re-reading its pods after an "
        "oversized watch event",
    )


def test_direct_placement_of_unknown_vram_counts_a_whole_gpu_even_where_the_class_rejects_it() -> None:
    # guaranteed rejects unknown VRAM: the pod is refused for that, and its fit is judged as a whole GPU.
    obj = labelled(pod(container("app", gpus=1), nodeName="n1"), "guaranteed")
    subject = Subject("Pod", "CREATE", "default", obj, None, "bob")
    exclusive = {"nvidia.com/gpu": offer(GB80, sharing=("none",))}
    view = ClusterView({ENFORCE_LABEL: "enforce"}, exclusive, exclusive, None, ledger_with(direct("0.2", "b0")))
    violations = RULES.review(subject, view).violations
    assert any(v.startswith("container app: VRAM unknown and class guaranteed rejects that") for v in violations)
    assert any(v.startswith("spec.nodeName n1 places the pod past the scheduler") for v in violations)


# --------------------------------------------------------------------------- a bound pod that changes


def bound_update(old_image: str, new_image: str, mode: str = "enforce", *bound: dict[str, Any],
                 ephemeral: list[dict[str, Any]] | None = None) -> Decision:
    """The update of pod ``b1`` (vLLM, default utilization) bound to n1 beside ``bound``, its image changed."""
    before = pod(container("vllm", image=old_image, args=["--model", "m"]), nodeName="n1")
    before["metadata"]["uid"] = "b1"
    after = json.loads(json.dumps(before))
    after["spec"]["containers"][0]["image"] = new_image
    if ephemeral is not None:
        after["spec"]["ephemeralContainers"] = ephemeral
    subject = Subject("Pod", "UPDATE", "default", after, before, "bob")
    view = ClusterView({ENFORCE_LABEL: mode}, TIME_SLICED, TIME_SLICED, None, ledger_with(before, *bound))
    return RULES.review(subject, view)


def test_a_bound_pods_new_image_must_still_fit_its_gpu() -> None:
    # vLLM's default utilization is 0.9 before v0.20.0 and 0.92 from it (config/cache.py); an image whose
    # tag names no version holds the whole device (the extensible KV cache of v0.34.0 sizes itself to
    # what is free). Beside a pod holding 0.02 of the GPU, 0.9 fits, the whole device does not.
    neighbour = direct("0.02", "b0")
    decision = bound_update("vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.11.1", "enforce", neighbour)
    assert decision.allowed and not decision.violations  # the same rules: nothing to check
    decision = bound_update("vllm/vllm-openai:v0.11.0", "registry.example/tenant/vllm:mine", "enforce", neighbour)
    assert not decision.allowed
    [violation] = decision.problems
    assert violation.code is Code.BOUND_CHANGE
    assert violation.message.startswith("pod is bound to n1 and this change alters what it holds there, which no "
                                        "longer fits: GPU 0 (NVIDIA A100 SXM4 80GB)")
    # warn and audit admit it, saying what enforce would refuse.
    decision = bound_update("vllm/vllm-openai:v0.11.0", "registry.example/tenant/vllm:mine", "warn", neighbour)
    assert decision.allowed and any(w.startswith("would deny: bound to n1") for w in decision.warnings)
    # Alone on the GPU it fits, whatever the image.
    assert bound_update("vllm/vllm-openai:v0.11.0", "registry.example/tenant/vllm:mine").allowed


def test_an_ephemeral_container_naming_gpus_is_refused_on_a_bound_pod() -> None:
    debug = [{"name": "debugger", "image": "vllm/vllm-openai:v0.11.0", "targetContainerName": "vllm",
              "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]
    decision = bound_update("vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.11.0", ephemeral=debug)
    assert not decision.allowed
    [violation] = decision.problems
    assert violation.code is Code.VISIBLE_DEVICES
    assert violation.message.startswith("ephemeral container debugger sets NVIDIA_VISIBLE_DEVICES=all")
    quiet = [{"name": "debugger", "image": "busybox", "targetContainerName": "vllm"}]
    assert bound_update("vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.11.0", ephemeral=quiet).allowed


VISIBLE = {
    "no-gpu-request-all": (container("app", env={"NVIDIA_VISIBLE_DEVICES": "all"}, gpus=None), True),
    "one-gpu-naming-every-gpu": (vllm("app", "--gpu-memory-utilization", "0.2",
                                      env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]), True),
    "from-a-configmap": (container("app", gpus=None, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {
        "configMapKeyRef": {"name": "c", "key": "k"}}}]), True),
    "void-gives-none": (container("app", env={"NVIDIA_VISIBLE_DEVICES": "void"}, gpus=None), False),
    "none-gives-none": (container("app", env={"NVIDIA_VISIBLE_DEVICES": "none"}, gpus=None), False),
    "empty-gives-none": (container("app", env={"NVIDIA_VISIBLE_DEVICES": ""}, gpus=None), False),
}


@pytest.mark.parametrize(("spec", "refused"), VISIBLE.values(), ids=VISIBLE.keys())
def test_containers_naming_their_own_gpus_break_their_class(spec: dict[str, Any], refused: bool) -> None:
    decision = review(pod(spec))
    assert decision.allowed is not refused
    assert [f.code for f in decision.problems] == ([Code.VISIBLE_DEVICES] if refused else [])


IMAGE = "docker.io/vllm/vllm-openai:v0.11.0"
INHERITED = {
    # The image sets NVIDIA_VISIBLE_DEVICES=all (built on nvidia/cuda): without a GPU request the
    # container sees every GPU of its node.
    "engine-image-no-gpu": (container("c", image=IMAGE, args=["m", "--gpu-memory-utilization", "0.9"], gpus=None),
                            True),
    "engine-image-with-a-gpu": (container("c", image=IMAGE, gpus=1), False),
    "engine-image-variable-cleared": (container("c", image=IMAGE, env={"NVIDIA_VISIBLE_DEVICES": "void"},
                                                gpus=None), False),
    "other-image-no-gpu": (container("c", image="busybox:1.36", gpus=None), False),
}


@pytest.mark.parametrize(("spec", "noted"), INHERITED.values(), ids=INHERITED.keys())
def test_a_cuda_image_asking_for_no_gpu_is_noted_not_refused(spec: dict[str, Any], noted: bool) -> None:
    decision = review(pod(spec))
    assert decision.allowed and not decision.problems
    remarks = [f for f in decision.remarks if f.code is Code.VISIBLE_DEVICES]
    assert bool(remarks) is noted
    if noted:
        assert "asks for no GPU, and its image sets NVIDIA_VISIBLE_DEVICES=all" in remarks[0].message


def test_a_class_may_allow_naming_gpus_and_updates_are_not_refused_for_it() -> None:
    allowing = AdmissionRules(POLICY.model_copy(update={"classes": {
        **POLICY.classes, "best-effort": POLICY.classes["best-effort"].model_copy(update={
            "allow_visible_devices": True})}}))
    obj = pod(container("exporter", env={"NVIDIA_VISIBLE_DEVICES": "all"}, gpus=None))
    decision = review(obj, rules=allowing)
    assert decision.allowed and [f.code for f in decision.remarks] == [Code.VISIBLE_DEVICES]
    # An update that keeps the setting is not refused for it (nor is a workload's).
    decision = review(obj, operation="UPDATE", old=obj)
    assert decision.allowed and [f.code for f in decision.remarks] == [Code.VISIBLE_DEVICES]
    decision = review(deployment(obj), kind="Deployment")
    assert not decision.allowed and [f.code for f in decision.problems] == [Code.VISIBLE_DEVICES]


# --------------------------------------------------------------------------- engines named only by env vars


DISTRUSTING = AdmissionRules(Policy.from_yaml("""
default_class: strict
enforcement: enforce
schedulers: [default-scheduler]
classes:
  strict: {sharing: [time-slicing], unknown_vram: reject, trust_env_only_engines: false,
           allows_pod_classes: [capped, trusting]}
  capped: {sharing: [time-slicing], max_vram_per_gpu: 40Gi, trust_env_only_engines: false}
  trusting: {sharing: [time-slicing], max_vram_per_gpu: 40Gi}
"""))
JAX_1PCT = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.01"}
ENV_ONLY = {
    "rejecting-class": ("strict", container("jax", env=JAX_1PCT), None,
                        "container jax: VRAM unknown and class strict rejects that"),
    "whole-gpu-class": ("capped", container("jax", env=JAX_1PCT), None,
                        "container jax: VRAM unknown, so it holds a whole GPU of 80.0 GiB, above class capped's "
                        "max_vram_per_gpu 40Gi"),
    "trusting-class": ("trusting", container("jax", env=JAX_1PCT), None, None),
    "declared": ("strict", container("jax", env=JAX_1PCT), "10Gi", None),
    "engine-on-the-command-line": ("strict", vllm("vllm", "--gpu-memory-utilization", "0.3"), None, None),
}


@pytest.mark.parametrize(("qos", "spec", "declared", "violation"), ENV_ONLY.values(), ids=ENV_ONLY.keys())
def test_engine_named_only_by_env_vars_counts_as_unknown_where_the_class_says(
    qos: str, spec: dict[str, Any], declared: str | None, violation: str | None
) -> None:
    annotations = {"vramguard.io/vram": declared} if declared else None
    decision = review(labelled(pod(spec, annotations=annotations), qos), rules=DISTRUSTING)
    if violation is None:
        assert decision.violations == ()
    else:
        assert any(v.startswith(violation) for v in decision.violations), decision.violations


def test_extender_claims_agree_with_admission_on_env_only_engines() -> None:
    demand = derive_pod_demand(pod(container("jax", env=JAX_1PCT)))
    classes = DISTRUSTING.policy.classes
    trusted = pod_claims(demand, ClassChoice("trusting", classes["trusting"], "pod"))
    distrusted = pod_claims(demand, ClassChoice("capped", classes["capped"], "pod"))
    (held,) = trusted.claims[0].vram
    assert held is not None and held.plain() == Vram(fraction=Fraction(1, 100))
    assert held.allowance_bytes == CUDA_CONTEXT
    assert distrusted.claims[0].vram == (None,)  # a whole GPU
    rejected = pod_claims(demand, ClassChoice("strict", classes["strict"], "pod"))
    assert rejected.refusal is not None and "VRAM unknown" in rejected.refusal
