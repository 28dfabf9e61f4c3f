"""``vramguard plan``: the seed's scenario and friends, from a manifest file to placements."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.cli import main
from vramguard.cli.plan import ADMISSION_REFUSAL
from vramguard.quantity import MiB, format_bytes

VLLM = "vllm/vllm-openai:v0.21.0"
"""A vLLM whose --gpu-memory-utilization is its own share (from v0.9.1), with its CUDA graphs inside it
(from v0.20.0): each pod holds its share and its CUDA context (512 MiB)."""
CORPUS = Path(__file__).resolve().parent / "data" / "workloads"
H100_BYTES = 81559 * MiB
H100_BUDGET = H100_BYTES * 97 // 100
"""The H100 node's GPU is time-sliced (shared): the shipped policy keeps 3% of it free."""

H100_NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "h100-1", "labels": {
        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
        "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
    }},
    "status": {"allocatable": {"cpu": "32", "nvidia.com/gpu": "4"}},
}


def vllm_deployment(
    name: str, utilization: str, replicas: int, namespace: str = "team-a", image: str = VLLM
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas, "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{
            "name": "vllm",
            "image": image,
            "args": ["--model", "m", "--gpu-memory-utilization", utilization],
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        }]}}},
    }


def write(tmp_path: Path, *objects: dict[str, Any]) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    return str(path)


@pytest.mark.parametrize(("utilization", "placed", "code"), [("0.20", 4, 0), ("0.30", 3, 1)], ids=["0.20", "0.30"])
def test_seed_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str], utilization: str, placed: int,
                       code: int) -> None:
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", utilization, 4))
    assert main(["plan", path, "-o", "json"]) == code
    plan = json.loads(capsys.readouterr().out)
    assert [p["node"] for p in plan["placed"]] == ["h100-1"] * placed
    assert plan["placed"][0]["containers"] == {"vllm": ["0"]}
    if plan["pending"]:
        (pending,) = plan["pending"]
        assert pending["pod"] == "team-a/vllm-3"
        need = int(Fraction(utilization) * H100_BYTES) + 512 * MiB
        assert pending["reasons"]["h100-1"] == {
            "unresolvable": False,
            "rule": "vram-budget",
            "message": f"GPU 0 (NVIDIA H100 80GB HBM3): {format_bytes(H100_BUDGET - 3 * need)} of "
            f"{format_bytes(H100_BUDGET)} VRAM budget free, pod needs {format_bytes(need)} per GPU",
        }
    (gpu,) = plan["gpus"]
    assert gpu["reserved"] <= gpu["budget"]
    assert plan["notes"] == []


def test_text_output_and_class_from_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = {"vramguard.io/qos-class": "guaranteed"}
    namespace = {"kind": "Namespace", "metadata": {"name": "secure", "labels": labels}}
    path = write(tmp_path, H100_NODE, namespace, vllm_deployment("svc", "0.2", 1, namespace="secure"))
    assert main(["plan", path]) == 1
    out = capsys.readouterr().out
    assert "pending  secure/svc-0 (guaranteed)" in out
    assert ("h100-1 (never, class-guarantee): class guaranteed does not allow time-slicing GPUs "
            "(node offers time-slicing)") in out
    assert "NODE    GPU" in out


def test_bound_pods_count_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bound: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {"name": "old", "namespace": "team-b", "uid": "u-old",
                     "annotations": {"vramguard.io/vram": "62Gi"}},  # 62Gi + 0.2 of the GPU > its budget
        "spec": {"nodeName": "h100-1", "containers": [
            {"name": "app", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": 1}}}
        ]},
    }
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", "0.2", 1), bound)
    assert main(["plan", path, "-o", "json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert [(p["pod"], p["bound"]) for p in plan["placed"]] == [("team-b/old", True)]
    assert plan["pending"][0]["pod"] == "team-a/vllm-0"


def test_vllm_before_0_9_1_takes_a_gpu_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """V1, the default engine from v0.8.0, capped the whole GPU's use with --gpu-memory-utilization until
    v0.9.1, everyone's included: a ceiling, which counts over half the budget, so two never share a GPU
    (the second would find no memory of its own); its CUDA graphs, captured after the KV cache was
    allocated, come on top (v0.9.0 v1/worker/gpu_worker.py determine_available_memory,
    v1/executor/abstract.py initialize_from_config)."""
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", "0.20", 4, image="vllm/vllm-openai:v0.9.0"))
    assert main(["plan", path, "-o", "json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert [p["node"] for p in plan["placed"]] == ["h100-1"]
    (gpu,) = plan["gpus"]
    assert gpu["reserved"] == H100_BUDGET // 2 + 1 + 1024 * MiB


def test_vllm_old_engine_is_per_instance_with_graphs_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old engine (the default before v0.8.0: envs.py VLLM_USE_V1 defaults to "0" in v0.7.3) sizes its
    KV cache to total x utilization less what its own process added after its CUDA context existed (v0.7.3
    worker/worker.py determine_num_available_blocks, memory_for_current_instance), and captures CUDA
    graphs after allocating it (initialize_cache: _init_cache_engine, then _warm_up_model's
    capture_model): each pod holds its share, its context and its graphs, and pods share a GPU."""
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", "0.24", 4, image="vllm/vllm-openai:v0.7.3"))
    assert main(["plan", path, "-o", "json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    per_pod = int(Fraction(24, 100) * H100_BYTES) + 512 * MiB + 1024 * MiB
    assert len(plan["placed"]) == H100_BUDGET // per_pod == 3
    (gpu,) = plan["gpus"]
    assert gpu["reserved"] == 3 * per_pod
    # VLLM_USE_V1=1 picks V1 (v0.6.5 to v0.9.0: device-wide, a ceiling) in the same image.
    v1 = vllm_deployment("vllm", "0.24", 4, image="vllm/vllm-openai:v0.7.3")
    v1["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "VLLM_USE_V1", "value": "1"}]
    assert main(["plan", write(tmp_path, H100_NODE, v1), "-o", "json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["placed"]) == 1


def test_policy_file_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Four pods of 0.24 and a CUDA context each fit a GPU that keeps no margin, not the shipped 3%.
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", "0.24", 4))
    assert main(["plan", path, "-o", "json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["placed"]) == 3
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "default_class: loose\nclasses: {loose: {sharing: [time-slicing]}}\nbudget: {margins: {time-slicing: 0}}"
    )
    assert main(["plan", path, "--policy", str(policy), "-o", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["placed"]) == 4


@pytest.mark.parametrize(
    ("content", "policy", "message"),
    [("kind: [", None, "not valid YAML"), ("kind: Node", "classes: {}", "invalid policy")],
    ids=["bad-manifest", "bad-policy"],
)
def test_unreadable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, policy: str | None,
                          message: str) -> None:
    path = tmp_path / "in.yaml"
    path.write_text(content)
    args = ["plan", str(path)]
    if policy is not None:
        (tmp_path / "policy.yaml").write_text(policy)
        args += ["--policy", str(tmp_path / "policy.yaml")]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def gpu_node(name: str, labels: dict[str, str], allocatable: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"cpu": "96", **allocatable}}}


A100_8X = gpu_node("a100-8x", {
    "nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920",
    "nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none",
}, {"nvidia.com/gpu": "8"})
A100_WHOLE = gpu_node("a100-1x", {
    "nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920",
    "nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none",
}, {"nvidia.com/gpu": "1"})
A100_MIG = gpu_node("a100-mig", {
    "nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920",
    "nvidia.com/gpu.replicas": "0", "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/mig-1g.10gb.count": "7", "nvidia.com/mig-1g.10gb.memory": "9728",
}, {"nvidia.com/mig-1g.10gb": "7"})


def pod(name: str, resource: str, count: int, args: list[str], namespace: str = "ml") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "main", "image": VLLM, "args": args,
                                     "resources": {"limits": {resource: count}}}]}}


WORKLOADS = [
    pod("train", "nvidia.com/gpu", 8, ["--model", "m", "-tp", "8"]),
    pod("vllm-whole", "nvidia.com/gpu", 1, ["--model", "m", "--gpu-memory-utilization", "0.85"]),
    pod("vllm-mig", "nvidia.com/mig-1g.10gb", 1, ["--model", "m", "--gpu-memory-utilization", "0.85"]),
]


def test_shipped_policy_places_whole_gpu_and_mig_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Installing vramguard must not stop a workload that ran before: nothing that fits is refused."""
    path = write(tmp_path, A100_8X, A100_WHOLE, A100_MIG, *WORKLOADS)
    assert main(["plan", path, "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {p["pod"]: p["node"] for p in plan["placed"]} == {
        "ml/train": "a100-8x", "ml/vllm-whole": "a100-1x", "ml/vllm-mig": "a100-mig"}
    assert all(p["findings"] == [] for p in plan["placed"])


@pytest.mark.parametrize(("mode", "code"), [("audit", 0), ("warn", 0), ("enforce", 1)])
def test_class_rules_follow_the_namespace_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str,
                                               code: int) -> None:
    labels = {"vramguard.io/qos-class": "shared", "vramguard.io/enforce": mode}
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml", "labels": labels}}
    path = write(tmp_path, A100_8X, A100_WHOLE, A100_MIG, namespace, *WORKLOADS)
    assert main(["plan", path]) == code
    out = capsys.readouterr().out
    if mode == "enforce":
        # The API server refuses them at admission: the webhook's rule, before any node is tried.
        assert "pending  ml/train (shared)\n           - (never, admission): refused at admission" in out
        assert ("[sharing, enforce mode] container main: nodes offer nvidia.com/gpu only as exclusive GPUs, which "
                "class shared does not allow (it allows time-slicing, mps)") in out
        assert "placed " not in out
    else:
        assert "placed   ml/vllm-mig (shared) -> a100-mig" in out
        assert f"[class-rule, not enforced in {mode} mode] class shared does not allow MIG GPUs" in out


def test_over_budget_is_refused_by_the_shipped_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A MIG instance is one pod's alone (no margin): 0.99 of its 9.5 GiB and the CUDA context exceed it.
    greedy = pod("greedy", "nvidia.com/mig-1g.10gb", 1, ["--model", "m", "--gpu-memory-utilization", "0.99"])
    path = write(tmp_path, A100_MIG, greedy)
    assert main(["plan", path]) == 1
    assert "a100-mig (never, vram-budget): MIG 1g.10gb #0" in capsys.readouterr().out


def test_free_memory_the_conservative_rule_holds_is_marked_a_worst_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two GPUs behind the node's replicas: the device plugin picks one, so the plan holds the pod on both.
    node = {**H100_NODE, "metadata": {**H100_NODE["metadata"], "labels": {
        **H100_NODE["metadata"]["labels"], "nvidia.com/gpu.count": "2"}},
        "status": {"allocatable": {"cpu": "32", "nvidia.com/gpu": "8"}}}
    path = write(tmp_path, node, vllm_deployment("vllm", "0.3", 1))
    assert main(["plan", path, "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(g["known"], g["free_is_worst_case"]) for g in plan["gpus"]] == [(0, True), (0, True)]
    assert main(["plan", path]) == 0
    text = capsys.readouterr().out
    [header] = [line for line in text.splitlines() if line.startswith("NODE")]
    assert header.split() == ["NODE", "GPU", "BUDGET", "KNOWN", "WORST-CASE", "FREE", "PODS"]
    assert text.count("GiB*") == 2 and "note: * FREE is a worst case" in text


def test_node_selection_and_taints_narrow_the_nodes_as_kube_scheduler_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A pod pinned to one node pool is not "placed" on a node of another pool, nor on a tainted node it
    # does not tolerate (kube-scheduler's NodeAffinity and TaintToleration filters run before the extender).
    pool_b = {**H100_NODE, "metadata": {**H100_NODE["metadata"], "name": "h100-b",
                                         "labels": {**H100_NODE["metadata"]["labels"], "pool": "b"}}}
    tainted = {**H100_NODE, "metadata": {**H100_NODE["metadata"], "name": "h100-t"},
               "spec": {"taints": [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]}}
    pinned = vllm_deployment("chat", "0.30", 1)
    pinned["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "a"}
    path = write(tmp_path, pool_b, tainted, pinned)
    assert main(["plan", path, "-o", "json"]) == 1
    [pending] = json.loads(capsys.readouterr().out)["pending"]
    assert pending["reasons"]["h100-b"]["message"] == "node h100-b does not match the pod's nodeSelector pool=a"
    assert pending["reasons"]["h100-t"]["message"] == (
        "node h100-t has the taint dedicated=training:NoSchedule, which the pod does not tolerate")
    pinned["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "b"}
    assert main(["plan", write(tmp_path, pool_b, tainted, pinned), "-o", "json"]) == 0
    [placed] = json.loads(capsys.readouterr().out)["placed"]
    assert placed["node"] == "h100-b"


def quota_policy(tmp_path: Path, quota: str) -> str:
    from vramguard.policy import DEFAULT_POLICY_RESOURCE  # noqa: PLC0415

    text = (Path(__file__).parent.parent / "vramguard" / DEFAULT_POLICY_RESOURCE).read_text()
    path = tmp_path / "policy.yaml"
    path.write_text(text.replace("quotas: {}", f"quotas: {{team-a: {quota}}}"))
    return str(path)


ENFORCED = {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "team-a", "labels": {"vramguard.io/enforce": "enforce"}}}


def test_admission_counts_each_admitted_object_in_the_quota(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0.2 of the H100 (81559 MiB) and a CUDA context is 16.4 GiB a pod: two pods fit 40Gi, so the
    # first Deployment (2 replicas) is admitted; the second (1 replica) would make 49.2 GiB, as the
    # webhook would count the first's pods when the second arrives.
    policy = quota_policy(tmp_path, "40Gi")
    first, second = vllm_deployment("first", "0.20", 2), vllm_deployment("second", "0.20", 1)
    path = write(tmp_path, H100_NODE, ENFORCED, first, second)
    assert main(["plan", "--policy", policy, "-o", "json", path]) == 1
    result = json.loads(capsys.readouterr().out)
    assert [p["pod"] for p in result["placed"]] == ["team-a/first-0", "team-a/first-1"]
    [pending] = result["pending"]
    assert pending["pod"] == "team-a/second-0"
    assert pending["reasons"] == {"-": {"unresolvable": True, "rule": "admission", "message": ADMISSION_REFUSAL}}
    [finding] = pending["findings"]
    assert finding["rule"] == "quota" and finding["mode"] == "enforce"
    assert "namespace team-a would hold" in finding["message"] and "2 other pod(s)" in finding["message"]


def test_admission_outside_enforce_places_and_says_what_it_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = quota_policy(tmp_path, "10Gi")
    warned = {**ENFORCED, "metadata": {"name": "team-a", "labels": {"vramguard.io/enforce": "warn"}}}
    path = write(tmp_path, H100_NODE, warned, vllm_deployment("chat", "0.20", 1))
    assert main(["plan", "--policy", policy, path]) == 0
    out = capsys.readouterr().out
    assert "placed   team-a/chat-0 (best-effort) -> h100-1" in out
    assert "[quota, not enforced in warn mode] namespace team-a would hold" in out


def test_a_pod_naming_no_scheduler_is_judged_as_routed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The mutating webhook names vramguard's scheduler before the validating one judges: no finding.
    # Where the namespace opts out of routing, the pod keeps the default scheduler, which the
    # webhook refuses in enforce (nothing would check its GPU memory).
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "chat", "namespace": "team-a"},
           "spec": {"containers": vllm_deployment("x", "0.20", 1)["spec"]["template"]["spec"]["containers"]}}
    assert main(["plan", write(tmp_path, H100_NODE, ENFORCED, pod)]) == 0
    assert "placed   team-a/chat (best-effort) -> h100-1  [vllm: GPU 0]\n" in capsys.readouterr().out
    opted_out = {**ENFORCED, "metadata": {"name": "team-a", "labels": {
        "vramguard.io/enforce": "enforce", "vramguard.io/routing": "disabled"}}}
    assert main(["plan", write(tmp_path, H100_NODE, opted_out, pod)]) == 1
    out = capsys.readouterr().out
    assert "pending  team-a/chat (best-effort)\n           - (never, admission)" in out
    assert "[scheduler, enforce mode] spec.schedulerName default-scheduler does not call vramguard" in out


@pytest.mark.parametrize("corpus", ["kubeflow-trainer-torchtune-llama3.2-1b-runtime.yaml",
                                    "kserve-servingruntime-vllm.yaml"])
def test_templates_other_objects_run_from_place_no_pod(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], corpus: str
) -> None:
    """A ClusterTrainingRuntime or a ServingRuntime runs nothing by itself: its TrainJob or
    InferenceService does."""
    objects = list(yaml.safe_load_all((CORPUS / corpus).read_text()))
    path = write(tmp_path, H100_NODE, *[o for o in objects if isinstance(o, dict)])
    assert main(["plan", path, "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["placed"] == [] and plan["pending"] == []
