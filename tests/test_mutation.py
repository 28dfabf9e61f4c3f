"""The mutating webhook's decisions (vramguard.mutation through AdmissionRules.mutation): routing GPU
pods to the vramguard scheduler, and the memory limits written for nvidia-container-toolkit."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.admission import AdmissionRules, ClusterView, Subject
from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL, VRAM_ANNOTATION
from vramguard.dra.claims import read_claim_template
from vramguard.dra.classes import read_device_class
from vramguard.dra.review import DraContext
from vramguard.inventory import Sharing
from vramguard.ledger import ResourceOffer
from vramguard.mutation import LIMIT_ENV, REQUEST_ENV, ROUTING_LABEL, Mutation
from vramguard.policy import Policy
from vramguard.quantity import GiB, MiB
from vramguard.scale_up import GATE

POLICY_TEXT = """
default_class: shared
enforcement: audit
classes:
  shared:
    sharing: [time-slicing, mps]
    allows_pod_classes: [limited, mps-only]
  limited:
    sharing: [time-slicing]
    enforce_memory_limits: true
  mps-only:
    sharing: [mps]
    enforce_memory_limits: true
schedulers: [vramguard]
"""
RULES = AdmissionRules(Policy.from_yaml(POLICY_TEXT))
VLLM = "vllm/vllm-openai:v0.21.0"
GB80 = 80 * GiB
# vLLM v0.21.0 holds --gpu-memory-utilization x the device's memory, and one CUDA context (512 MiB)
# beside it; its CUDA graphs are inside the share (vllm/v1/worker/gpu_worker.py, v0.20.0 on).
VLLM_090_ON_80GIB_MIB = (int(0.9 * 80 * 1024 * MiB) + 512 * MiB) // MiB


def offer(*sizes: int, sharing: tuple[Sharing, ...] = ("time-slicing",)) -> dict[str, ResourceOffer]:
    return {"nvidia.com/gpu": ResourceOffer(min(sizes), max(sizes), max(sizes), frozenset(sharing))}


def vllm_pod(*, qos: str | None = None, scheduler: str | None = None, **extra: Any) -> dict[str, Any]:
    obj = pod(container("vllm", image=VLLM, args=["--model", "m", "--gpu-memory-utilization", "0.90"], **extra))
    if qos:
        obj["metadata"]["labels"] = {QOS_CLASS_LABEL: qos}
    if scheduler is not None:
        obj["spec"]["schedulerName"] = scheduler
    return obj


def mutate(
    obj: Mapping[str, Any],
    *,
    labels: dict[str, str] | None = None,
    offers: dict[str, ResourceOffer] | None = None,
    rules: AdmissionRules = RULES,
    dra: DraContext | None = None,
) -> Mutation:
    view = ClusterView(labels or {}, offers if offers is not None else offer(GB80), None, dra=dra)
    return rules.mutation("default", obj, view)


def apply_patch(obj: Mapping[str, Any], patch: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """RFC 6902 ``add`` as the API server applies it (the only operation the webhook writes)."""
    out = copy.deepcopy(dict(obj))
    for operation in patch:
        assert operation["op"] == "add", operation
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in operation["path"].lstrip("/").split("/")]
        target: Any = out
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if last == "-":
            target.append(operation["value"])
        else:
            target[last] = operation["value"]
    return out


def placed(obj: dict[str, Any], node: str) -> dict[str, Any]:
    obj["spec"]["nodeName"] = node
    return obj


@pytest.mark.parametrize("scheduler", [None, "", "default-scheduler"])
def test_a_gpu_pod_naming_no_scheduler_is_routed(scheduler: str | None) -> None:
    mutation = mutate(vllm_pod(scheduler=scheduler))
    assert mutation.routed_to == "vramguard"
    assert apply_patch(vllm_pod(scheduler=scheduler), mutation.patch)["spec"]["schedulerName"] == "vramguard"


@pytest.mark.parametrize(
    ("obj", "labels", "policy"),
    [
        pytest.param(vllm_pod(scheduler="volcano"), {}, POLICY_TEXT, id="names-another-scheduler"),
        pytest.param(vllm_pod(), {ROUTING_LABEL: "disabled"}, POLICY_TEXT, id="namespace-opts-out"),
        pytest.param(pod(container("web", gpus=0)), {}, POLICY_TEXT, id="no-gpu"),
        pytest.param(placed(vllm_pod(), "n1"), {}, POLICY_TEXT, id="placed-directly"),
        pytest.param(
            vllm_pod(), {}, POLICY_TEXT.replace("[vramguard]", "[vramguard, default-scheduler]"),
            id="default-scheduler-calls-the-extender",
        ),
        pytest.param(vllm_pod(), {}, POLICY_TEXT + "routing: {enabled: false}\n", id="routing-off"),
    ],
)
def test_pods_that_are_not_routed(obj: dict[str, Any], labels: dict[str, str], policy: str) -> None:
    mutation = mutate(obj, labels=labels, rules=AdmissionRules(Policy.from_yaml(policy)))
    assert mutation.patch == () and mutation.routed_to is None


def test_routing_goes_to_the_scheduler_the_policy_names() -> None:
    rules = AdmissionRules(Policy.from_yaml(POLICY_TEXT.replace("[vramguard]", "[gpu-a, gpu-b]")))
    assert mutate(vllm_pod(), rules=rules).routed_to == "gpu-a"
    rules = AdmissionRules(Policy.from_yaml(POLICY_TEXT + "routing: {scheduler: gpu-b}\n"))
    assert mutate(vllm_pod(), rules=rules).routed_to == "gpu-b"


def claim_pod(template: str) -> dict[str, Any]:
    obj = pod(container("vllm", image=VLLM, args=["--model", "m"], gpus=0))
    obj["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    obj["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return obj


def test_a_pod_whose_claims_may_get_a_gpu_is_routed_and_one_whose_claims_cannot_is_not() -> None:
    def template(name: str, device_class: str) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": device_class}}]}}},
        }

    def device_class(name: str, driver: str) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}]},
        }

    read = [read_device_class(device_class(name, name)) for name in ("gpu.nvidia.com", "nic.example.com")]
    classes = {c.name: c for c in read if c is not None}
    templates = {
        "gpu": read_claim_template(template("gpu", "gpu.nvidia.com")),
        "nic": read_claim_template(template("nic", "nic.example.com")),
    }
    dra = DraContext(classes, (), lambda namespace, name: None, lambda namespace, name: templates.get(name))
    assert mutate(claim_pod("gpu"), dra=dra).routed_to == "vramguard"
    assert mutate(claim_pod("nic"), dra=dra).routed_to is None
    # A template the watches have not shown yet may be a GPU's: routed, so it is guarded.
    assert mutate(claim_pod("unknown"), dra=dra).routed_to == "vramguard"


def env_of(obj: Mapping[str, Any], name: str = "vllm") -> dict[str, str]:
    [found] = [c for c in obj["spec"]["containers"] if c["name"] == name]
    return {e["name"]: e.get("value", "") for e in found.get("env") or ()}


def test_a_class_enforcing_limits_gets_the_reservation_in_mib_as_request_and_limit() -> None:
    obj = vllm_pod(qos="limited")
    mutation = mutate(obj)
    env = env_of(apply_patch(obj, mutation.patch))
    assert env == {REQUEST_ENV: str(VLLM_090_ON_80GIB_MIB), LIMIT_ENV: str(VLLM_090_ON_80GIB_MIB)}
    assert [(i.container, i.name) for i in mutation.injections] == [("vllm", REQUEST_ENV), ("vllm", LIMIT_ENV)]
    # Existing env entries are kept; the values are appended.
    obj = vllm_pod(qos="limited", env=[{"name": "HF_HOME", "value": "/cache"}])
    env = env_of(apply_patch(obj, mutate(obj).patch))
    assert env["HF_HOME"] == "/cache" and env[LIMIT_ENV] == str(VLLM_090_ON_80GIB_MIB)


def test_classes_without_the_option_get_no_limits() -> None:
    assert all("/env" not in op["path"] for op in mutate(vllm_pod()).patch)


def test_an_mps_only_class_also_gets_the_pinned_memory_limit_per_gpu() -> None:
    obj = vllm_pod(qos="mps-only", gpus=2)
    obj["spec"]["containers"][0]["args"] += ["--tensor-parallel-size", "2"]
    env = env_of(apply_patch(obj, mutate(obj, offers=offer(GB80, sharing=("mps",))).patch))
    per_gpu = int(env[LIMIT_ENV])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={per_gpu}M,1={per_gpu}M"


@pytest.mark.parametrize(
    "env",
    [[{"name": LIMIT_ENV, "value": "1000"}], [{"name": REQUEST_ENV, "value": "1000"}]],
    ids=["limit", "request"],
)
def test_never_over_a_value_the_user_set(env: list[dict[str, str]]) -> None:
    obj = vllm_pod(qos="limited", env=env)
    mutation = mutate(obj)
    assert all("/env" not in op["path"] for op in mutation.patch) and mutation.injections == ()
    assert any("set by the pod" in note for note in mutation.notes), mutation.notes


def test_env_from_may_set_them_so_nothing_is_written() -> None:
    obj = vllm_pod(qos="limited", envFrom=[{"configMapRef": {"name": "settings"}}])
    mutation = mutate(obj)
    assert mutation.injections == () and any("envFrom" in note for note in mutation.notes)


def test_a_fraction_on_gpus_of_different_sizes_is_no_single_number() -> None:
    mutation = mutate(vllm_pod(qos="limited"), offers=offer(GB80, 141 * GiB))
    assert mutation.injections == ()
    assert any("depends on the GPU" in note for note in mutation.notes), mutation.notes


def test_a_declaration_in_bytes_is_written_on_any_size() -> None:
    obj = vllm_pod(qos="limited")
    obj["metadata"]["annotations"] = {VRAM_ANNOTATION: "20Gi"}
    obj["spec"]["containers"][0]["args"] = ["--model", "m", "--gpu-memory-utilization", "0.10"]
    mutation = mutate(obj, offers=offer(GB80, 141 * GiB))
    # A declaration is the whole reservation per GPU; vLLM's own 0.10 (with its context) is below it
    # on both sizes, so it is one number.
    assert {i.name: i.value for i in mutation.injections}[LIMIT_ENV] == str(20 * 1024)


def test_no_size_known_means_no_limit() -> None:
    mutation = mutate(vllm_pod(qos="limited"), offers={})
    assert mutation.injections == () and any("no node offers" in note for note in mutation.notes)


def review_mode(obj: Mapping[str, Any], kind: str, labels: dict[str, str]) -> Any:
    return RULES.review(Subject(kind, "CREATE", "default", obj), ClusterView(labels, offer(GB80)))


def deployment(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "default"},
        "spec": {"replicas": 1, "template": {"metadata": {}, "spec": template["spec"]}},
    }


def test_an_unrouted_gpu_pod_is_a_warning_even_in_audit_mode() -> None:
    decision = review_mode(vllm_pod(), "Pod", {})
    assert decision.allowed and decision.mode == "audit"
    assert "not guarded: default-scheduler does not call vramguard (not routed); set schedulerName: vramguard" in (
        decision.warnings
    ), decision.warnings


def test_an_unrouted_gpu_pod_is_refused_where_the_namespace_enforces() -> None:
    decision = review_mode(vllm_pod(), "Pod", {ENFORCE_LABEL: "enforce"})
    assert not decision.allowed and "the mutating webhook did not route it" in (decision.message or "")


def test_a_workload_naming_no_scheduler_is_fine_where_its_pods_are_routed() -> None:
    decision = review_mode(deployment(vllm_pod()), "Deployment", {ENFORCE_LABEL: "enforce"})
    assert decision.allowed, decision.message
    opted_out = review_mode(deployment(vllm_pod()), "Deployment", {ENFORCE_LABEL: "enforce", ROUTING_LABEL: "disabled"})
    assert not opted_out.allowed and "opts out of routing" in (opted_out.message or "")


SCALE_UP = AdmissionRules(Policy.from_yaml(
    POLICY_TEXT + "scale_up: {autoscaler: cluster-autoscaler, classes: [limited]}\n"
))


def test_pods_of_a_gated_class_are_created_with_the_scale_up_gate() -> None:
    gated = apply_patch(vllm_pod(qos="limited"), mutate(vllm_pod(qos="limited"), rules=SCALE_UP).patch)
    assert gated["spec"]["schedulerName"] == "vramguard"
    assert gated["spec"]["schedulingGates"] == [{"name": GATE}]
    assert gated["metadata"]["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}


def test_the_pods_own_scale_down_annotation_wins() -> None:
    obj = vllm_pod(qos="limited")
    obj["metadata"]["annotations"] = {"cluster-autoscaler.kubernetes.io/safe-to-evict": "true", "a": "b"}
    assert apply_patch(obj, mutate(obj, rules=SCALE_UP).patch)["metadata"]["annotations"] == {
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "true", "a": "b"}
    karpenter = AdmissionRules(Policy.from_yaml(POLICY_TEXT + "scale_up: {autoscaler: karpenter}\n"))
    obj["metadata"]["annotations"] = {"a": "b"}
    assert apply_patch(obj, mutate(obj, rules=karpenter).patch)["metadata"]["annotations"] == {
        "a": "b", "karpenter.sh/do-not-disrupt": "true"}
    unprotected = AdmissionRules(Policy.from_yaml(
        POLICY_TEXT + "scale_up: {autoscaler: karpenter, protect_from_scale_down: false}\n"))
    assert apply_patch(obj, mutate(obj, rules=unprotected).patch)["metadata"]["annotations"] == {"a": "b"}


def owned_by(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": kind, "name": "x", "uid": "u",
                                           "controller": True}]
    return obj


def test_a_replicaset_pod_is_gated() -> None:
    obj = owned_by(vllm_pod(qos="limited"), "ReplicaSet")
    assert apply_patch(obj, mutate(obj, rules=SCALE_UP).patch)["spec"]["schedulingGates"] == [{"name": GATE}]


@pytest.mark.parametrize("obj", [
    pytest.param(vllm_pod(), id="class-not-gated"),
    pytest.param(vllm_pod(qos="limited", scheduler="volcano"), id="scheduler-without-the-extender"),
    pytest.param(placed(vllm_pod(qos="limited"), "n1"), id="placed-directly"),
    pytest.param(pod(container("web", gpus=0)), id="no-gpu"),
    pytest.param(owned_by(vllm_pod(qos="limited"), "DaemonSet"), id="daemonset-pod"),
])
def test_pods_that_are_not_gated(obj: dict[str, Any]) -> None:
    mutated = apply_patch(obj, mutate(obj, rules=SCALE_UP).patch)
    assert "schedulingGates" not in mutated["spec"]


def test_nothing_is_gated_without_an_autoscaler() -> None:
    rules = AdmissionRules(Policy.from_yaml(POLICY_TEXT + "scale_up: {classes: [limited]}\n"))
    assert "schedulingGates" not in apply_patch(vllm_pod(qos="limited"), mutate(vllm_pod(qos="limited"),
                                                                                rules=rules).patch)["spec"]
