"""``vramguard plan``: the seed's scenario and friends, from a manifest file to placements."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.cli import main

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


def vllm_deployment(name: str, utilization: str, replicas: int, namespace: str = "team-a") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas, "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{
            "name": "vllm",
            "image": "vllm/vllm-openai:v0.9.0",
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
        assert pending["reasons"]["h100-1"] == {
            "unresolvable": False,
            "message": "GPU 0 (NVIDIA H100 80GB HBM3): 0.0 GiB of 71.7 GiB VRAM budget free, "
            "pod needs 23.9 GiB per GPU",
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
    assert "h100-1 (never): class guaranteed does not allow time-slicing GPUs (node offers time-slicing)" in out
    assert "NODE    GPU" in out


def test_bound_pods_count_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bound: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {"name": "old", "namespace": "team-b", "uid": "u-old",
                     "annotations": {"vramguard.io/vram": "60Gi"}},
        "spec": {"nodeName": "h100-1", "containers": [
            {"name": "app", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": 1}}}
        ]},
    }
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", "0.2", 1), bound)
    assert main(["plan", path, "-o", "json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert [(p["pod"], p["bound"]) for p in plan["placed"]] == [("team-b/old", True)]
    assert plan["pending"][0]["pod"] == "team-a/vllm-0"


def test_policy_file_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("default_class: loose\nclasses: {loose: {sharing: [time-slicing], headroom: 0}}")
    path = write(tmp_path, H100_NODE, vllm_deployment("vllm", "0.25", 4))
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
