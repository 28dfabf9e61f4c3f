"""``vramguard explain`` end to end through the console entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramguard.cli import main
from vramguard.quantity import GiB, MiB

CUDA_CONTEXT = 512 * MiB
"""What vLLM v0.21.0 holds beside its share on each GPU (its CUDA graphs are inside the share)."""

SEED = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: chat, namespace: team-a}
spec:
  template:
    spec:
      containers:
      - name: vllm
        image: vllm/vllm-openai:v0.21.0
        args: [--model, m, --gpu-memory-utilization, "0.2"]
        resources: {limits: {nvidia.com/gpu: 1}}
---
apiVersion: batch/v1
kind: CronJob
metadata: {name: nightly}
spec:
  jobTemplate:
    spec:
      template:
        spec:
          containers:
          - name: train
            image: trainer:1
            env: [{name: XLA_PYTHON_CLIENT_MEM_FRACTION, value: "1.5"}]
            resources: {limits: {nvidia.com/gpu: 1}}
---
apiVersion: v1
kind: Service
metadata: {name: chat}
"""


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(SEED)
    code, out, _ = run(capsys, "explain", "-o", "json", "--gpu-memory", "80Gi", str(manifest))
    reports = json.loads(out)
    assert code == 1  # the CronJob has an error
    assert [r["kind"] for r in reports] == ["Deployment", "CronJob", "Service"]
    container = reports[0]["containers"][0]
    assert [(a["name"], a["bytes"], a["processes"]) for a in container.pop("allowances")] == [
        ("CUDA context", CUDA_CONTEXT, 1)
    ]
    (rule,) = container["rules"]
    assert rule.startswith("image tag v0.21.0: CUDA graphs estimated inside the share")
    admission = reports[0].pop("admission")
    assert (admission["allowed"], admission["mode"], admission["class"]) == (True, "audit", "best-effort")
    assert reports[2]["admission"] is None  # a Service: nothing for the webhook
    assert reports[0] == {
        "kind": "Deployment",
        "name": "chat",
        "namespace": "team-a",
        "class": "best-effort",
        "enforcement": "audit",
        "refusals": [],
        "templates": [{"name": "deployment", "pods": 1, "gpu": True}],
        "skipped": False,
        "claims": [],
        "injected": [],
        "containers": [
            {
                "name": "vllm",
                "resource": "nvidia.com/gpu",
                "engine": "vllm",
                "engine_version": "0.21.0",
                "gpus": 1,
                "vram_fraction_per_gpu": 0.2,
                "share_bytes_per_gpu": 16 * GiB,
                "ceiling": False,
                "vram_bytes_per_gpu": 16 * GiB + CUDA_CONTEXT,
                "capped": False,
                "sm_percent": None,
                "evidence": ["--gpu-memory-utilization 0.2"],
                "rules": container["rules"],
            }
        ],
        "errors": [],
        "warnings": [],
    }
    assert reports[1]["errors"] == ["container train: env XLA_PYTHON_CLIENT_MEM_FRACTION=1.5 is outside (0, 1]"]
    assert reports[2]["containers"] == []


def test_bytes_round_up_and_null_without_gpu_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = {
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "containers": [
                {"name": "c", "image": "vllm/vllm-openai:v0.21.0", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ]
        },
    }
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(json.dumps(pod)))
    _, out, _ = run(capsys, "explain", "-o", "json", "-")
    [report] = json.loads(out)
    assert report["containers"][0]["vram_bytes_per_gpu"] is None
    assert report["containers"][0]["vram_fraction_per_gpu"] == 0.92
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(json.dumps({"kind": "List", "items": [pod]})))
    _, out, _ = run(capsys, "explain", "-o", "json", "--gpu-memory", "81559Mi", "-")
    (container,) = json.loads(out)[0]["containers"]
    share = -(-92 * 81559 * MiB // 100)  # ceil(0.92 x 81559 MiB) = 78679145186
    assert container["share_bytes_per_gpu"] == share
    assert container["vram_bytes_per_gpu"] == share + CUDA_CONTEXT


def test_text_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(SEED)
    code, out, _ = run(capsys, "explain", "--gpu-memory", "80Gi", str(manifest))
    assert code == 1
    assert "Deployment team-a/chat" in out
    assert "16.5 GiB" in out  # the share and the CUDA context
    assert "vllm: share 0.2 of the GPU = 16.0 GiB (vllm 0.21.0)" in out
    assert "vllm: + CUDA context 512.0 MiB (certain): " in out
    assert "error: container train" in out


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["explain", "missing.yaml"], "", "missing.yaml: no such file or directory"),
        (["explain", "-"], "a: [1, 2", "not valid YAML or JSON"),
        (["explain", "-"], "- 1\n- 2\n", "expected a Kubernetes object"),
        (["explain", "--gpu-memory", "lots", "-"], "{}", "not a Kubernetes quantity"),
    ],
    ids=["missing-file", "broken-yaml", "not-objects", "bad-gpu-memory"],
)
def test_unreadable_input_exits_2_without_traceback(args: list[str], stdin: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vramguard", *args], input=stdin, capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


REFUSED = """
apiVersion: v1
kind: Namespace
metadata: {name: dev, labels: {vramguard.io/qos-class: shared, vramguard.io/enforce: enforce}}
---
apiVersion: v1
kind: Pod
metadata: {name: mig-infer, namespace: dev}
spec:
  containers:
  - name: vllm
    image: vllm/vllm-openai:v0.21.0
    args: [--model, m, --gpu-memory-utilization, "0.5"]
    resources: {limits: {nvidia.com/mig-1g.10gb: 1}}
---
apiVersion: v1
kind: Pod
metadata: {name: too-big, namespace: prod}
spec:
  containers:
  - name: vllm
    image: vllm/vllm-openai:v0.21.0
    args: [--model, m, --gpu-memory-utilization, "1.0"]
    resources: {limits: {nvidia.com/gpu: 1}}
"""


def test_explain_names_the_refusing_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A class rule (change the policy or the class) is told apart from the VRAM budget (change the workload)."""
    manifest = tmp_path / "m.yaml"
    manifest.write_text(REFUSED)
    code, out, _ = run(capsys, "explain", "-o", "json", "--gpu-memory", "80Gi", str(manifest))
    reports = {r["name"]: r for r in json.loads(out)}
    assert code == 1
    assert reports["mig-infer"]["refusals"] == [{
        "rule": "class-rule", "enforced": True,
        "message": "container vllm: class shared does not allow MIG GPUs (nvidia.com/mig-1g.10gb)",
    }]
    # The budget holds in every mode. Nothing in the input says the cluster runs DRA, so its
    # nvidia.com/gpu is the device plugin's: no DRA refusal beside it.
    assert [(r["rule"], r["enforced"]) for r in reports["too-big"]["refusals"]] == [("vram-budget", True)]
    # With a DRA object in the input, the NVIDIA chart's class serves nvidia.com/gpu (extendedResourceName)
    # and the stand-in device of --gpu-memory cannot hold it either (audit mode only records that).
    template = ("---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: one-gpu}\n"
                "spec: {spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]}}}\n")
    manifest.write_text(REFUSED + template)
    code, out, _ = run(capsys, "explain", "-o", "json", "--gpu-memory", "80Gi", str(manifest))
    reports = {r["name"]: r for r in json.loads(out)}
    assert [(r["rule"], r["enforced"]) for r in reports["too-big"]["refusals"]] == [
        ("vram-budget", True), ("extended-resource-memory", False)
    ]
    manifest.write_text(REFUSED)
    code, out, _ = run(capsys, "explain", "--gpu-memory", "80Gi", str(manifest))
    assert "refusal [class-rule, refused]: container vllm: class shared does not allow MIG GPUs" in out
    # The whole GPU and the CUDA context: more than even a GPU the pod owns alone (no margin) holds.
    assert (
        "refusal [vram-budget, refused]: container vllm: needs 80.5 GiB per GPU (1 of the GPU + 512.0 MiB), more "
        "than the 80.0 GiB VRAM budget of a 80.0 GiB GPU"
    ) in out


LIMITED = """
apiVersion: v1
kind: Namespace
metadata: {name: team, labels: {vramguard.io/qos-class: shared}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: vllm, namespace: team}
spec:
  template:
    spec:
      containers:
      - name: vllm
        image: vllm/vllm-openai:v0.21.0
        args: ["--model", "m", "--gpu-memory-utilization", "0.45"]
        resources: {limits: {nvidia.com/gpu: 1}}
"""


def test_explain_shows_the_memory_limits_admission_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.yaml").write_text(LIMITED)
    policy = tmp_path / "policy.yaml"
    shipped = (Path(__file__).parent.parent / "vramguard" / "default_policy.yaml").read_text()
    policy.write_text(shipped.replace("enforce_memory_limits: false", "enforce_memory_limits: true"))
    _, out, _ = run(capsys, "explain", "--policy", str(policy), "--gpu-memory", "80Gi", str(tmp_path / "m.yaml"))
    # vLLM v0.21.0: 0.45 x 80 GiB and one CUDA context (512 MiB), in MiB.
    mib = int(0.45 * 80 * 1024) + 512
    assert (
        f"written at admission (enforce_memory_limits): vllm NVIDIA_GPU_MEMORY_REQUEST={mib}, "
        f"vllm NVIDIA_GPU_MEMORY_LIMIT={mib}" in out
    ), out
    _, out, _ = run(capsys, "explain", "--policy", str(policy), str(tmp_path / "m.yaml"))
    assert "class shared writes GPU memory limits at admission: pass --gpu-memory to see them" in out
    _, out, _ = run(capsys, "explain", "--gpu-memory", "80Gi", str(tmp_path / "m.yaml"))
    assert "written at admission" not in out  # the shipped policy writes none


QUOTA_NAMESPACE = """
apiVersion: v1
kind: Namespace
metadata: {name: team-a, labels: {vramguard.io/enforce: MODE}}
---
apiVersion: v1
kind: Node
metadata:
  name: h100
  labels: {nvidia.com/gpu.count: "1", nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3, nvidia.com/gpu.memory: "81559",
           nvidia.com/gpu.replicas: "4", nvidia.com/gpu.sharing-strategy: time-slicing}
status: {allocatable: {nvidia.com/gpu: "4"}}
---
apiVersion: v1
kind: Pod
metadata: {name: running, namespace: team-a, uid: 0b5c}
spec:
  nodeName: h100
  containers:
  - {name: vllm, image: "vllm/vllm-openai:v0.21.0", args: [--model, m, --gpu-memory-utilization, "0.3"],
     resources: {limits: {nvidia.com/gpu: 1}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: chat, namespace: team-a}
spec:
  replicas: 2
  template:
    spec:
      containers:
      - {name: vllm, image: "vllm/vllm-openai:v0.21.0", args: [--model, m, --gpu-memory-utilization, "0.3"],
         resources: {limits: {nvidia.com/gpu: 1}}}
"""


@pytest.mark.parametrize(("mode", "code"), [("enforce", 1), ("audit", 0)])
def test_explain_answers_as_the_admission_webhook(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, code: int
) -> None:
    # A 60Gi quota: the running pod holds 0.3 of 79.6 GiB + 512 MiB (24.4 GiB); the Deployment's two
    # replicas would add 48.8 GiB. The webhook refuses the Deployment in enforce; explain says so.
    policy_text = (Path(__file__).parent.parent / "vramguard" / "default_policy.yaml").read_text()
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text.replace("quotas: {}", "quotas: {team-a: 60Gi}"))
    manifest = tmp_path / "m.yaml"
    manifest.write_text(QUOTA_NAMESPACE.replace("MODE", mode))
    result, out, _ = run(capsys, "explain", "-o", "json", "--policy", str(policy), str(manifest))
    assert result == code
    reports = {r["name"]: r for r in json.loads(out)}
    admission = reports["chat"]["admission"]
    assert admission["allowed"] is (mode != "enforce")
    [problem] = admission["problems"]
    assert problem["rule"] == "quota"
    assert "namespace team-a would hold" in problem["message"] and "1 other pod(s)" in problem["message"]
    # The running pod is not counted against itself.
    assert reports["running"]["admission"]["problems"] == []
    _, out, _ = run(capsys, "explain", "--policy", str(policy), str(manifest))
    head = "admission: refused (enforce mode)" if mode == "enforce" else (
        "admission: admitted in audit mode; refused where the namespace enforces")
    assert f"  {head}\n    [quota] namespace team-a would hold" in out


@pytest.mark.parametrize("command", ["explain", "plan"])
def test_an_unreadable_cluster_is_exit_2_in_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(QUOTA_NAMESPACE.replace("MODE", "enforce"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    code, out, err = run(capsys, command, "--cluster", "--kubeconfig", str(kubeconfig), str(manifest))
    assert code == 2 and out == ""
    assert err.startswith(f"vramguard {command}: cannot read the cluster: ") and "Traceback" not in err
