"""Workload kinds from the policy, objects of kinds nobody described, and one bad document among many."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.demand import DemandOptions
from vramguard.policy import Policy, PolicyError, default_policy
from vramguard.workloads import object_parts, parts_demand, template_parts, unread_warning

OPTIONS = DemandOptions()
VLLM = "vllm/vllm-openai:v0.21.0"
RAY_WORKER = "ray start --address=$(LWS_LEADER_ADDRESS) --block"


def gpu_container(name: str = "main", gpus: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": VLLM, "resources": {"limits": {"nvidia.com/gpu": gpus}}, **extra}


def lws(size: Any, replicas: Any = 1, leader_args: list[str] | None = None, gpus: int = 8) -> dict[str, Any]:
    args = leader_args or ["m", "--tensor-parallel-size", "16", "--gpu-memory-utilization", "0.9"]
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "x", "namespace": "ns"},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": size,
                "leaderTemplate": {"spec": {"containers": [gpu_container("leader", gpus, args=args)]}},
                "workerTemplate": {"spec": {"containers": [
                    gpu_container("worker", gpus, command=["sh", "-c", RAY_WORKER])
                ]}},
            },
        },
    }


@pytest.mark.parametrize(
    ("obj", "pods", "errors"),
    [
        pytest.param(lws(2, 3), {"leader": 3, "worker": 3}, [], id="lws-replicas-times-size-minus-one"),
        pytest.param(lws("2", "3"), {"leader": 3, "worker": 3}, [], id="lws-string-numbers"),
        pytest.param(lws(None), {"leader": 1, "worker": 0}, ["16 GPUs, but the container requests 8"],
                     id="lws-size-absent-is-one-pod"),
        pytest.param(lws(4), {"leader": 1, "worker": 3}, ["over a group of 4 pods = 4 per pod"],
                     id="lws-group-size-mismatch"),
        pytest.param(lws(True, -2), {"leader": 1, "worker": 0}, ["16 GPUs, but the container requests 8"],
                     id="lws-lying-fields-count-defaults"),
        pytest.param(lws(2, 10**12), {"leader": 1 << 20, "worker": 1 << 20}, [], id="lws-huge-replicas-capped"),
    ],
)
def test_leaderworkerset_arithmetic(obj: dict[str, Any], pods: dict[str, int], errors: list[str]) -> None:
    parts = object_parts(obj, default_policy().workload_kinds)
    assert parts is not None
    assert {p.name: p.pods for p in parts} == pods
    demands = parts_demand(parts, OPTIONS)
    found = [e for d in demands for e in d.errors]
    assert len(found) == len(errors), found
    for expected, actual in zip(errors, found, strict=True):
        assert expected in actual
    worker = demands[1].containers[0]
    assert worker.engine == "vllm"  # from the leader's command
    assert not any("no known engine" in w for w in demands[1].warnings)


def test_worker_with_its_own_declaration_keeps_it() -> None:
    obj = lws(2)
    worker = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    worker["metadata"] = {"annotations": {"vramguard.io/vram": "20Gi"}}
    parts = object_parts(obj, default_policy().workload_kinds)
    assert parts is not None
    demands = parts_demand(parts, OPTIONS)
    assert demands[1].containers[0].engine is None
    assert demands[1].containers[0].reservation is not None


def test_star_over_a_huge_list_is_bounded() -> None:
    groups = [{"groupName": f"g{i}", "replicas": 1, "template": {"spec": {"containers": [gpu_container()]}}}
              for i in range(10_000)]
    obj = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "r"},
           "spec": {"workerGroupSpecs": groups}}
    parts = object_parts(obj, default_policy().workload_kinds)
    assert parts is not None and len(parts) == 64


IN_HOUSE = """
workload_kinds:
  - group: ml.example.com
    kind: ModelServer
    resource: modelservers
    versions: [v1]
    templates:
      - name: server
        path: spec.podTemplate
        replicas: [spec.scale.max|spec.scale.min]
  - group: apps.nvidia.com
    kind: NIMService
    resource: nimservices
    versions: [v1alpha1]
    templates:
      - {name: nim, path: spec, form: container, container_name: nim, replicas: [spec.replicas]}
"""


def policy_with(extra: str) -> Policy:
    base = yaml.safe_load(Path("vramguard/default_policy.yaml").read_text())
    base["workload_kinds"] = yaml.safe_load(extra)["workload_kinds"]
    return Policy.from_yaml(yaml.safe_dump(base))


def test_an_in_house_kind_is_read_by_configuration() -> None:
    policy = policy_with(IN_HOUSE)
    server = {"apiVersion": "ml.example.com/v1", "kind": "ModelServer", "metadata": {"name": "s"},
              "spec": {"scale": {"min": 1, "max": 5}, "podTemplate": {"spec": {"containers": [
                  gpu_container(command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.4"])]}}}}
    parts = object_parts(server, policy.workload_kinds)
    assert parts is not None and [(p.name, p.pods) for p in parts] == [("server", 5)]
    nim = {"apiVersion": "apps.nvidia.com/v1alpha1", "kind": "NIMService", "metadata": {"name": "n"},
           "spec": {"image": {"repository": "nvcr.io/nim/meta/llama3-8b-instruct", "tag": "1.0.0"},
                    "replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}}
    parts = object_parts(nim, policy.workload_kinds)
    assert parts is not None and parts[0].pods == 2
    assert parts_demand(parts, OPTIONS)[0].containers[0].gpus == 1
    # Another group's kind of the same name is not this one.
    other = {**server, "apiVersion": "other.example.com/v1"}
    assert object_parts(other, policy.workload_kinds) is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        pytest.param({"group": "g", "kind": "K", "resource": "ks", "versions": ["v1"],
                      "templates": [{"name": "t", "path": "spec..template"}]}, "is not a dotted path", id="bad-path"),
        pytest.param({"group": "g", "kind": "K", "resource": "ks", "versions": ["v1"],
                      "templates": [{"name": "t", "path": "spec.t", "replicas": ["spec.n * 2"]}]},
                     "is not a replica factor", id="bad-factor"),
        pytest.param({"group": "g", "kind": "K", "resource": "ks", "versions": [],
                      "templates": [{"name": "t", "path": "spec.t"}]}, "versions", id="no-versions"),
        pytest.param({"group": "g", "kind": "K", "resource": "ks", "versions": ["v1"], "templates": [],
                      "extra": 1}, "extra", id="unknown-field"),
    ],
)
def test_bad_workload_kinds_are_refused_at_load(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        policy_with(yaml.safe_dump({"workload_kinds": [entry]}))


def test_a_kind_named_twice_is_refused() -> None:
    entry = {"group": "g", "kind": "K", "resource": "ks", "versions": ["v1"],
             "templates": [{"name": "t", "path": "spec.t"}]}
    with pytest.raises(PolicyError, match=r"named twice: K\.g"):
        policy_with(yaml.safe_dump({"workload_kinds": [entry, entry]}))


def test_template_parts_never_raise_on_wrong_types() -> None:
    kind = default_policy().workload_kinds[0]
    for spec in (None, 3, "x", [], {"leaderWorkerTemplate": 7}, {"leaderWorkerTemplate": {"leaderTemplate": []}}):
        assert template_parts({"kind": "LeaderWorkerSet", "spec": spec}, kind) == []


UNREAD = """\
apiVersion: serving.example.com/v1alpha1
kind: ModelServer
metadata: {name: llama}
spec:
  image: {repository: nvcr.io/nim/meta/llama3-8b-instruct, tag: 1.0.0}
  resources:
    limits:
      nvidia.com/gpu: 1
---
apiVersion: v1
kind: ConfigMap
metadata: {name: plain}
data: {a: b}
"""

POD = """\
apiVersion: v1
kind: Pod
metadata: {name: ok}
spec:
  containers:
  - name: vllm
    image: vllm/vllm-openai:v0.21.0
    args: [--gpu-memory-utilization, "0.3"]
    resources: {limits: {nvidia.com/gpu: 1}}
"""


def cli(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramguard", *args], input=stdin, capture_output=True,
                          text=True, check=False)


@pytest.mark.parametrize("command", ["explain", "plan"])
def test_unread_kind_asking_for_a_gpu_is_never_silent(command: str) -> None:
    # explain reads a Pod beside it; plan has no Nodes, so a Pod would stay pending (exit 1).
    result = cli(command, "-o", "json", "-", stdin=UNREAD + ("---\n" + POD if command == "explain" else ""))
    assert result.returncode == 3, result.stdout
    out = json.loads(result.stdout)
    text = json.dumps(out)
    assert "ModelServer (serving.example.com) is a kind vramguard does not read" in text
    assert "spec.resources.limits" in text and "workload_kinds" in text
    skipped = out["skipped"] if command == "plan" else [r for r in out if r["skipped"]]
    assert len(skipped) == 1  # the ConfigMap asks for no GPU: nothing to say


def test_explain_text_says_skipped() -> None:
    result = cli("explain", "-", stdin=UNREAD)
    assert result.returncode == 3
    assert "skipped: vramguard does not read this kind" in result.stdout


@pytest.mark.parametrize("command", ["explain", "plan"])
def test_one_bad_document_does_not_hide_the_others(command: str, tmp_path: Path) -> None:
    path = tmp_path / "mixed.yaml"
    broken = "---\nkind: Pod\nmetadata: {name: [broken\n---\n- 1\n---\n"
    path.write_text(POD + broken + POD.replace("name: ok", "name: ok2"))
    result = cli(command, "-o", "json", str(path), stdin="")
    assert result.returncode == 2
    assert f"{path}: document 2: not valid YAML or JSON at line " in result.stderr
    assert f"{path}: document 3: expected a Kubernetes object" in result.stderr
    assert "ok2" in result.stdout and '"ok"' in result.stdout.replace("default/ok", '"ok"')
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("model_format", "engine"),
    [pytest.param("huggingface", "vllm", id="huggingface-runs-the-hf-server"),
     pytest.param("pytorch", None, id="other-formats-are-not-guessed")],
)
def test_kserve_model_without_runtime(model_format: str, engine: str | None) -> None:
    isvc = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": {"name": "m"},
            "spec": {"predictor": {"model": {"modelFormat": {"name": model_format}, "args": ["--model_id=x"],
                                             "resources": {"limits": {"nvidia.com/gpu": 1}}}}}}
    parts = object_parts(isvc, default_policy().workload_kinds)
    assert parts is not None
    assert parts_demand(parts, OPTIONS)[0].containers[0].engine == engine


@pytest.mark.parametrize(
    ("extra", "kinds"),
    [pytest.param("", 25, id="omitted-means-the-shipped-kinds"),
     pytest.param("workload_kinds: []\n", 0, id="empty-reads-none")],
)
def test_a_policy_without_workload_kinds_reads_the_shipped_ones(extra: str, kinds: int) -> None:
    # The shipped webhook configuration registers the shipped kinds whatever policy is in force.
    policy = Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none]}}\n" + extra)
    assert len(policy.workload_kinds) == kinds


UNREAD_FORMS = {
    # NVIDIA Dynamo's DynamoGraphDeployment: services.<name>.resources.limits.gpu (its docs' examples).
    "dynamo": ({"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoGraphDeployment", "metadata": {"name": "d"},
                "spec": {"services": {"VllmWorker": {"resources": {"limits": {"gpu": "1"}}}}}},
               "spec.services.VllmWorker.resources.limits"),
    # KubeAI's Model: resourceProfile names a GPU profile and a count.
    "kubeai": ({"apiVersion": "kubeai.org/v1", "kind": "Model", "metadata": {"name": "m"},
                "spec": {"engine": "VLLM", "resourceProfile": "nvidia-gpu-l4:1"}},
               "spec.resourceProfile ('nvidia-gpu-l4:1')"),
    # The NIM operator's NIMService with DRA resources.
    "nim-dra": ({"apiVersion": "apps.nvidia.com/v1alpha1", "kind": "NIMService", "metadata": {"name": "n"},
                 "spec": {"draResources": [{"resourceClaimTemplateName": "gpu"}]}},
                "spec.draResources"),
    # HAMi's resources in a kind nobody described.
    "hami": ({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
              "spec": {"resources": {"limits": {"nvidia.com/gpumem": "3000"}}}},
             "spec.resources.limits"),
}


@pytest.mark.parametrize(("obj", "path"), UNREAD_FORMS.values(), ids=UNREAD_FORMS.keys())
def test_every_form_of_asking_for_a_gpu_in_an_unread_kind_is_warned_about(obj: dict[str, Any], path: str) -> None:
    warning = unread_warning(obj, DemandOptions().is_gpu)
    assert warning is not None and f"asks for a GPU at {path}" in warning, warning
    assert "workload_kinds" in warning


def test_an_unread_kind_without_any_gpu_form_is_not_warned_about() -> None:
    obj = {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
           "spec": {"resources": {"limits": {"cpu": "1"}}, "accelerator": "none", "resourceProfile": "cpu:4"}}
    assert unread_warning(obj, DemandOptions().is_gpu) is None


KNATIVE_CONTAINER = gpu_container(args=["--gpu-memory-utilization", "0.5"])
NOTED = {
    # Knative Serving knative-v1.23.0: the revision's scale is bounded only by the max-scale annotation
    # (config/core/configmaps/autoscaler.yaml: max-scale "0", no bound, by default).
    "knative": ({"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": {"name": "k"},
                 "spec": {"template": {"spec": {"containers": [KNATIVE_CONTAINER]}}}},
                "max-scale"),
    # Argo Workflows v4.1.2: withItems, withParam and withSequence fan a step out at run time.
    "argo": ({"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "w"},
              "spec": {"templates": [{"name": "t", "container": gpu_container()},
                                     {"name": "fan", "steps": [[{"name": "s", "template": "t",
                                                                 "withItems": [1, 2, 3]}]]}]}},
             "withItems"),
    # KServe v0.20.0: an LLMInferenceService's containers are merged into LLMInferenceServiceConfig presets.
    "llmisvc": ({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LLMInferenceService", "metadata": {"name": "l"},
                 "spec": {"template": {"containers": [{"name": "main",
                                                       "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}},
                "LLMInferenceServiceConfig"),
}


@pytest.mark.parametrize(("obj", "word"), NOTED.values(), ids=NOTED.keys())
def test_a_kinds_assumption_is_said_with_each_object(obj: dict[str, Any], word: str) -> None:
    # explain: a warning on the object; plan: a note naming it. Each counts one pod per template.
    result = cli("explain", "-o", "json", "--gpu-memory", "80Gi", "-", stdin=yaml.safe_dump(obj))
    [report] = json.loads(result.stdout)
    assert [t["pods"] for t in report["templates"]] == [1] and any(word in w for w in report["warnings"])
    plan = json.loads(cli("plan", "-o", "json", "-", stdin=yaml.safe_dump(obj)).stdout)
    assert any(n.startswith(f"{obj['kind']} default/") and word in n for n in plan["notes"])

