"""``vramguard audit`` on a cluster given as objects (no API server)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_kubectl_vram import snapshot, vllm_pod

from vramguard.cli import audit, kubectl_vram, main
from vramguard.cli.audit import audit_snapshot
from vramguard.policy import Policy, default_policy


def deployment(name: str, utilization: float, replicas: int = 1, **labels: str) -> dict[str, Any]:
    """A Deployment of vLLM pods."""
    pod = vllm_pod(name, utilization, None)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"replicas": replicas, "template": {"metadata": {"labels": labels}, "spec": pod["spec"]}}}


def test_clean_cluster() -> None:
    pod = vllm_pod("a", 0.3, "ts")
    pod["spec"]["schedulerName"] = "vramguard"
    report = audit_snapshot(snapshot(pod), default_policy())
    assert report.clean and not report.overcommitted
    assert json.loads(json.dumps(report.to_json()))["clean"] is True
    assert "Clean." in report.to_text()


def test_overcommitted_gpu_is_a_finding() -> None:
    report = audit_snapshot(snapshot(*(vllm_pod(f"p{i}", 0.3, "ts") for i in range(4))), default_policy())
    assert [(r.node, r.gpu) for r in report.overcommitted] == [("ts", "0")]
    assert any("may hold" in p for p in report.ledger_problems)
    assert not report.clean


def test_violations_follow_the_namespace_mode() -> None:
    snap = snapshot(vllm_pod("bad", 1.5, "ts"))
    snap.workloads = [deployment("tpl", 2.0), {**deployment("owned", 2.0),
                      "metadata": {"name": "owned", "namespace": "default",
                                   "ownerReferences": [{"controller": True, "kind": "Deployment", "name": "x"}]}}]
    report = audit_snapshot(snap, default_policy())
    found = {(f.kind, f.name): f for f in report.violating}
    assert set(found) == {("Pod", "bad"), ("Deployment", "tpl")}  # the controlled ReplicaSet-like one is skipped
    assert found[("Pod", "bad")].outcome == "audited"  # the default policy's mode is audit
    snap.namespaces = [{"metadata": {"name": "default", "labels": {"vramguard.io/enforce": "enforce"}}}]
    assert audit_snapshot(snap, default_policy()).violating[0].outcome == "denied"


def test_quota_counts_the_namespace() -> None:
    policy = Policy.model_validate({**default_policy().model_dump(mode="json"), "quotas": {"default": "40Gi"}})
    snap = snapshot(vllm_pod("a", 0.3, "ts"), vllm_pod("b", 0.3, "ts"))
    report = audit_snapshot(snap, policy)
    assert any("quota" in v for f in report.violating for v in f.violations)


def test_cli_exit_codes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(kubectl_vram, "read_custom_workloads", lambda *_a: ([], []))
    monkeypatch.setattr(kubectl_vram, "read_cluster", lambda *_a, **_k: (snapshot(vllm_pod("a", 0.3, "ts")), None))
    assert main(["audit", "--kubeconfig", "k"]) == audit.EXIT_CLEAN
    capsys.readouterr()
    bad = snapshot(*(vllm_pod(f"p{i}", 0.3, "ts") for i in range(4)))
    monkeypatch.setattr(kubectl_vram, "read_cluster", lambda *_a, **_k: (bad, None))
    assert main(["audit", "-o", "json"]) == audit.EXIT_FINDINGS
    assert json.loads(capsys.readouterr().out)["overcommitted_gpus"][0]["node"] == "ts"
    monkeypatch.setattr(kubectl_vram, "read_cluster", lambda *_a, **_k: (bad, "classes: 3"))
    assert main(["audit"]) == audit.EXIT_USAGE


@pytest.mark.parametrize(("labels", "outcome"), [
    ({}, None),
    ({"vramguard.io/qos-class": "shared"}, "audited"),
    ({"vramguard.io/qos-class": "shared", "vramguard.io/enforce": "warn"}, "warned"),
    ({"vramguard.io/qos-class": "shared", "vramguard.io/enforce": "enforce"}, "refused"),
], ids=["default-class-allows-it", "audit", "warn", "enforce"])
def test_placements_the_class_rules_would_refuse(labels: dict[str, str], outcome: str | None) -> None:
    """What switching a namespace to warn, then enforce, would do to the pods already running."""
    snap = snapshot(vllm_pod("whole", 0.5, "ex"), vllm_pod("shared", 0.3, "ts"))
    snap.namespaces = [{"metadata": {"name": "default", "labels": labels}}]
    report = audit_snapshot(snap, default_policy())
    found = [(f.name, f.node, f.rule, f.outcome) for f in report.placements]
    assert found == ([("whole", "ex", "class-rule", outcome)] if outcome else [])
    if outcome:
        assert not report.clean
        assert report.to_json()["placements"][0]["message"] == (
            "class shared does not allow unshared GPUs (node offers whole GPUs)")
        assert "Placements the class rules would refuse: 1" in report.to_text()


def test_the_policy_workload_kinds_are_reviewed() -> None:
    # A LeaderWorkerSet asking each GPU for 1.5 of itself: audit reviews it as the webhook would.
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "big", "namespace": "default", "uid": "uid-big"},
           "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 1, "leaderTemplate": {
               "spec": vllm_pod("leader", 1.5, None)["spec"]}}}}
    unknown = {**lws, "apiVersion": "example.com/v1", "metadata": {**lws["metadata"], "name": "other-group"}}
    snap = snapshot(vllm_pod("a", 0.3, "ts"))
    snap.workloads = [lws, unknown]
    found = {(f.kind, f.name) for f in audit_snapshot(snap, default_policy()).violating}
    assert found == {("LeaderWorkerSet", "big")}  # a kind of another group is not the table's


def test_cli_lists_the_policy_workload_kinds(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    asked: list[str] = []

    def custom(_kubeconfig: Any, _context: Any, kinds: Any) -> tuple[list[Any], list[str]]:
        asked.extend(k.kind for k in kinds)
        return [], ["RayCluster (ray.io) not read: forbidden"]

    monkeypatch.setattr(kubectl_vram, "read_cluster", lambda *_a, **_k: (snapshot(vllm_pod("a", 0.3, "ts")), None))
    monkeypatch.setattr(kubectl_vram, "read_custom_workloads", custom)
    assert main(["audit"]) == audit.EXIT_CLEAN
    assert "LeaderWorkerSet" in asked and "InferenceService" in asked
    # The serving operators' kinds too: a Model, a Workspace are audited as the pods they make.
    assert {"Model", "Workspace", "NIMService", "DynamoGraphDeployment", "VLLMRuntime"} <= set(asked)
    assert "warning: RayCluster (ray.io) not read: forbidden" in capsys.readouterr().err


def test_pending_gpu_pods_are_listed_with_each_nodes_reason() -> None:
    # ts: one H100 time-sliced x4 holding 0.6; ex: two exclusive H100s holding 0.5 each. A 0.9 pod
    # fits neither now; the scheduler's own reason is shown beside vramguard's.
    big = vllm_pod("big", 0.9, None)
    big["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "message": "0/2 nodes are available: 2 VRAM"}]}
    small = {**vllm_pod("small", 0.1, None), "status": {"phase": "Pending"}}
    snap = snapshot(vllm_pod("a", 0.6, "ts"), vllm_pod("b", 0.5, "ex"), vllm_pod("c", 0.5, "ex"), big, small)
    report = audit_snapshot(snap, default_policy())
    pending = {p.name: p for p in report.pending}
    assert sorted(pending) == ["big", "small"]
    assert pending["small"].reasons == ()  # a node would take it now
    reasons = pending["big"].reasons
    assert sorted(n for _, nodes in reasons for n in nodes) == ["ex", "ts"]
    assert {nodes: message for message, nodes in reasons} == {
        ("ex",): "pod needs 1 nvidia.com/gpu, node has 2 (0 free)",
        ("ts",): "GPU 0 (NVIDIA H100 80GB HBM3): 29.0 GiB of 77.3 GiB VRAM budget free, pod needs 72.2 GiB per GPU",
    }
    assert pending["big"].scheduler_message == "0/2 nodes are available: 2 VRAM"
    # Informational: a pod the VRAM keeps Pending is the guard working, not a finding.
    report.objects.clear()
    assert report.clean
    text = report.to_text()
    assert "GPU pods Pending (informational): 2" in text and "the scheduler says: 0/2 nodes" in text
    assert json.loads(json.dumps(report.to_json()))["pending"][0]["name"] == "big"


def test_a_serving_operators_object_is_audited_as_the_pods_it_makes() -> None:
    model = {"apiVersion": "kubeai.org/v1", "kind": "Model", "metadata": {"name": "m", "namespace": "default"},
             "spec": {"url": "hf://org/m", "resourceProfile": "nvidia-gpu-l4:1",
                      "args": ["--gpu-memory-utilization=1.5"]}}
    snap = snapshot()
    snap.workloads = [model]
    [finding] = audit_snapshot(snap, default_policy()).violating
    assert (finding.kind, finding.name) == ("Model", "m")
    assert "Model model: container server: --gpu-memory-utilization=1.5 is outside (0, 1]" in finding.violations[0]


def test_a_pod_naming_gpus_in_nvidia_visible_devices_is_a_finding() -> None:
    # It asks for no GPU, yet where the container toolkit honours the variable it reaches every GPU.
    exporter = {"name": "exporter", "image": "exporter:1", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
    reaching = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "exporter", "namespace": "default", "uid": "uid-exporter"},
                "spec": {"nodeName": "ts", "containers": [exporter]}}
    report = audit_snapshot(snapshot(reaching), default_policy())
    [finding] = report.violating
    assert (finding.kind, finding.name) == ("Pod", "exporter")
    assert finding.violations[0].startswith("container exporter sets NVIDIA_VISIBLE_DEVICES=all")


def test_gpu_nodes_vramguard_cannot_read_are_a_finding() -> None:
    snap = snapshot(vllm_pod("a", 0.3, "ts"))
    snap.nodes.append({"metadata": {"name": "bare"}, "status": {"allocatable": {"nvidia.com/gpu": "1"}}})
    report = audit_snapshot(snap, default_policy())
    assert report.unreadable == ["bare"] and not report.clean
    assert "GPU nodes vramguard cannot read: 1 (bare)" in report.to_text()
    assert report.to_json()["unreadable_gpu_nodes"] == ["bare"]


def test_gpu_pods_placed_by_a_scheduler_that_does_not_call_vramguard_are_listed() -> None:
    guarded = vllm_pod("guarded", 0.3, "ts")
    guarded["spec"]["schedulerName"] = "vramguard"
    before = vllm_pod("before", 0.3, "ts")  # no schedulerName: default-scheduler
    volcano = vllm_pod("volcano", 0.3, "ts")
    volcano["spec"]["schedulerName"] = "volcano"
    report = audit_snapshot(snapshot(guarded, before, volcano), default_policy())
    assert [(p.name, p.scheduler, p.node) for p in report.unguarded] == [
        ("before", "default-scheduler", "ts"), ("volcano", "volcano", "ts")
    ]
    # Informational: the ledger counts their VRAM (an overcommitted GPU is the finding); the last
    # line says pods are listed, not "Clean."
    assert report.clean
    text = report.to_text()
    assert "GPU pods placed by a scheduler that does not call vramguard (informational): 2" in text
    assert "Clean." not in text and "No findings: nothing would be refused and no GPU is overcommitted" in text
    assert report.to_json()["unguarded_pods"][1] == {
        "namespace": "default", "name": "volcano", "node": "ts", "scheduler": "volcano"}
    # Where the policy's schedulers include default-scheduler (the default-scheduler layout), it calls vramguard.
    policy = Policy.model_validate({**default_policy().model_dump(), "schedulers": ["default-scheduler", "vramguard"]})
    assert [p.name for p in audit_snapshot(snapshot(guarded, before), policy).unguarded] == []
