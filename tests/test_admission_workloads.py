"""The admission rules on custom workloads: every pod template is checked, with its pods at full scale."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.admission import AdmissionRules, ClusterView, NamespaceUsage, ResourceOffer, Subject, quantity_text
from vramguard.policy import ENFORCE_LABEL, Policy, default_policy
from vramguard.quantity import GiB

CORPUS = Path(__file__).parent / "data" / "workloads"
GB80 = 80 * GiB
OFFERS = {"nvidia.com/gpu": ResourceOffer(GB80, GB80, GB80, frozenset({"time-slicing", "none"}))}


def rules(quota: str | None = None) -> AdmissionRules:
    text = Path("vramguard/default_policy.yaml").read_text()
    data = yaml.safe_load(text)
    data["enforcement"] = "enforce"
    data["schedulers"] = ["vramguard", "default-scheduler"]
    if quota is not None:
        data["quotas"] = {"serving": quota}
    return AdmissionRules(Policy.from_yaml(yaml.safe_dump(data)))


def corpus(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = list(yaml.safe_load_all((CORPUS / name).read_text()))[-1]
    return loaded


def review(obj: dict[str, Any], *, operation: str = "CREATE", old: dict[str, Any] | None = None,
           quota: str | None = None, used: int = 0) -> Any:
    subject = Subject(obj["kind"], operation, "serving", obj, old)  # type: ignore[arg-type]
    usage = NamespaceUsage(used, 1 if used else 0) if quota is not None else None
    return rules(quota).review(subject, ClusterView({ENFORCE_LABEL: "enforce"}, OFFERS, None, usage))


OWN_SCHEDULER = {
    "kai-gpu-fraction-non-default-container.yaml": "kai-scheduler",
    "volcano-vgpu-multi-container.yaml": "volcano",
}
"""Manifests for another GPU-sharing system's scheduler: vramguard never places them, so an enforcing
namespace refuses them as it refuses any GPU pod that bypasses it."""


@pytest.mark.parametrize("name", sorted(p.name for p in CORPUS.glob("*.yaml")))
def test_every_corpus_manifest_is_admitted(name: str) -> None:
    decision = review(corpus(name))
    if name in OWN_SCHEDULER:
        assert not decision.allowed
        assert f"spec.schedulerName {OWN_SCHEDULER[name]} does not call vramguard" in str(decision.message)
        return
    assert decision.allowed, decision.message


def bad_lws() -> dict[str, Any]:
    obj = corpus("lws-vllm-nnodes.yaml")
    obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["args"][-1] = (
        "--gpu-memory-utilization=1.5"
    )
    return obj


def test_an_invalid_leaderworkerset_is_refused_naming_its_template() -> None:
    decision = review(bad_lws())
    assert not decision.allowed
    assert decision.message is not None
    assert "LeaderWorkerSet leader: container vllm: --gpu-memory-utilization=1.5 is outside (0, 1]" in decision.message


def test_a_leaderworkerset_whose_group_does_not_add_up_is_refused() -> None:
    obj = corpus("lws-vllm-nnodes.yaml")
    obj["spec"]["leaderWorkerTemplate"]["size"] = 4
    decision = review(obj)
    assert not decision.allowed
    assert "over a group of 4 pods = 4 per pod" in str(decision.message)


def test_an_invalid_inferenceservice_is_refused() -> None:
    obj = corpus("kserve-isvc-huggingface.yaml")
    obj["spec"]["predictor"]["model"]["args"].append("--tensor-parallel-size=2")
    decision = review(obj)
    assert not decision.allowed
    assert "InferenceService predictor: container kserve-container: vLLM: --tensor-parallel-size=2 = 2 GPUs" in str(
        decision.message
    )


def test_quota_counts_every_template_at_full_scale() -> None:
    # 2 leaders + 2 workers of 8 GPUs, each the whole 80Gi (vllm-openai:latest names no version, so vLLM
    # is read as its newest, whose default takes the whole device): 4 x 8 x 80Gi.
    decision = review(corpus("lws-vllm-ray.yaml"), quota="1000Gi")
    assert not decision.allowed
    assert "LeaderWorkerSet leader: namespace serving would hold" in str(decision.message)
    assert review(corpus("lws-vllm-ray.yaml"), quota="100000Gi").allowed


def test_an_update_is_not_refused_for_what_the_old_object_had() -> None:
    old = bad_lws()
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"team": "x"}
    decision = review(new, operation="UPDATE", old=old)
    assert decision.allowed
    assert any("is outside (0, 1]" in w for w in decision.warnings)


def test_a_kind_nothing_reads_is_left_alone() -> None:
    obj = {"apiVersion": "serving.example.com/v1", "kind": "ModelServer", "metadata": {"name": "n"},
           "spec": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}
    decision = review(obj)
    assert decision.allowed and not decision.wants_gpu


def test_a_serving_operators_object_is_reviewed_as_the_pods_it_makes() -> None:
    # A KubeAI Model whose vLLM flag vLLM itself refuses: refused at apply time in an enforcing
    # namespace, naming the kind and the template, as for any workload.
    model = {"apiVersion": "kubeai.org/v1", "kind": "Model", "metadata": {"name": "m", "namespace": "ns"},
             "spec": {"url": "hf://org/m", "engine": "VLLM", "resourceProfile": "nvidia-gpu-l4:1",
                      "args": ["--gpu-memory-utilization=1.5"], "maxReplicas": 2}}
    decision = review(model)
    assert not decision.allowed and decision.wants_gpu and decision.pods == 2
    assert "Model model: container server: --gpu-memory-utilization=1.5 is outside (0, 1]" in str(decision.message)
    model["spec"]["args"] = ["--gpu-memory-utilization=0.5"]
    assert review(model).allowed


def test_default_policy_is_readable() -> None:
    assert {k.kind for k in default_policy().workload_kinds} >= {
        "LeaderWorkerSet", "RayCluster", "RayService", "RayJob", "InferenceService", "ServingRuntime",
        "ClusterServingRuntime", "JobSet", "PyTorchJob", "MPIJob",
    }


def test_the_demand_cache_tells_groups_of_different_sizes_apart() -> None:
    same_rules = rules()

    def verdict(obj: dict[str, Any]) -> bool:
        subject = Subject(obj["kind"], "CREATE", "serving", obj)
        return same_rules.review(subject, ClusterView({ENFORCE_LABEL: "enforce"}, OFFERS, None, None)).allowed

    bad = corpus("lws-vllm-nnodes.yaml")
    bad["spec"]["leaderWorkerTemplate"]["size"] = 4
    assert not verdict(bad)
    assert verdict(corpus("lws-vllm-nnodes.yaml"))


FULL_SCALE = quantity_text(2 * 8 * GB80 + 2 * 8 * GB80)
"""lws-vllm-ray.yaml at full scale: leaders 2 x 8 GPUs of vLLM's default on an unknown version (the whole
80Gi device), workers (no engine of their own: a whole device each, as their pods will be counted)
2 x 8 x 80Gi."""


def test_quota_counts_the_templates_together() -> None:
    # Each template fits on its own (1280Gi each); together they do not.
    decision = review(corpus("lws-vllm-ray.yaml"), quota="2000Gi")
    assert not decision.allowed
    assert decision.message is not None
    assert "LeaderWorkerSet leader:" not in decision.message
    assert f"namespace serving would hold {FULL_SCALE} of its 2000Gi VRAM quota (LeaderWorkerSet at full scale" in (
        decision.message
    )


@pytest.mark.parametrize("mode", ["warn", "audit"])
def test_whole_quota_in_modes_that_admit(mode: str) -> None:
    obj = corpus("lws-vllm-ray.yaml")
    subject = Subject(obj["kind"], "CREATE", "serving", obj)
    view = ClusterView({ENFORCE_LABEL: mode}, OFFERS, None, NamespaceUsage(0, 0))
    decision = rules("2000Gi").review(subject, view)
    assert decision.allowed
    if mode == "warn":
        assert decision.warnings[0].startswith(f"would deny: namespace serving would hold {FULL_SCALE} ")
    else:
        assert f"namespace serving would hold {FULL_SCALE} " in decision.audit_annotations["would-deny"]


def test_a_workload_template_is_reviewed_with_what_its_workload_gives_it() -> None:
    # An Argo script template: the engine is in the script's source, which Argo runs as a file
    # (executeScript, workflow/controller/operator.go v4.1.2). The review reads it, as explain's table
    # does: a 0.4 vLLM, not "no known engine" (a whole GPU).
    workflow = {
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "w"},
        "spec": {"entrypoint": "serve", "templates": [{"name": "serve", "script": {
            "image": "vllm/vllm-openai:v0.11.0", "command": ["bash"],
            "source": "vllm serve m --gpu-memory-utilization 0.4\n",
            "resources": {"limits": {"nvidia.com/gpu": 1}}}}]},
    }
    decision = review(workflow, quota="40Gi")
    assert decision.allowed, decision.message
    assert not any("no known engine" in w for w in decision.warnings), decision.warnings
    # 0.4 of an 80 GiB GPU and its allowances fit a 40 GiB quota; a whole GPU would not.
    assert not review(workflow, quota="30Gi").allowed
