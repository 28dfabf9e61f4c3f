"""``kubectl vram`` and the table rendering, on a cluster given as objects (no API server)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from e2e import gpu_nodes
from vramguard.cli import kubectl_vram
from vramguard.cli.kubectl_vram import (
    ClusterSnapshot,
    build_parser,
    build_state,
    choose_policy,
    node_rows,
    pod_holdings,
)
from vramguard.policy import Policy, PolicyError, default_policy
from vramguard.report import gpu_table, pods_table, render_table

GiB = 1 << 30
MiB = 1 << 20
CUDA_CONTEXT = 512 * MiB
"""What the pods' vLLM (v0.21.0: CUDA graphs estimated inside its share) holds beside its share on its GPU."""


def node(spec: gpu_nodes.GPUNodeSpec) -> dict[str, Any]:
    """A Node object as the API server returns it."""
    return {**gpu_nodes.node_manifest(spec), "status": gpu_nodes.node_status(spec)}


def vllm_pod(name: str, utilization: float, node_name: str | None, namespace: str = "default",
             **annotations: str) -> dict[str, Any]:
    """A bound vLLM pod asking for one GPU."""
    spec: dict[str, Any] = {"containers": [{
        "name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
        "args": ["--model", "m", "--gpu-memory-utilization", str(utilization)],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }]}
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "annotations": annotations},
            "spec": spec, "status": {"phase": "Running"}}


def snapshot(*pods: dict[str, Any]) -> ClusterSnapshot:
    """Two nodes: one H100 time-sliced x4, one with two exclusive H100s."""
    return ClusterSnapshot(
        nodes=[node(gpu_nodes.time_sliced("ts", "H100-80GB", gpus=1, replicas=4)),
               node(gpu_nodes.exclusive("ex", "H100-80GB", gpus=2))],
        namespaces=[{"metadata": {"name": "default", "labels": {}}}],
        pods=list(pods),
    )


def test_nodes_table_has_every_gpu_with_budget_reserved_free_pods() -> None:
    state = build_state(snapshot(vllm_pod("a", 0.3, "ts"), vllm_pod("b", 0.2, "ts")), default_policy())
    rows = node_rows(state)
    assert [(r.node, r.gpu) for r in rows] == [("ex", "0"), ("ex", "1"), ("ts", "0")]
    ts = rows[-1]
    assert ts.sharing == "time-slicing" and ts.replicas == 4
    assert ts.pods == ("default/a", "default/b")
    # Each pod: its share and its CUDA context.
    share = int(Fraction(3, 10) * ts.memory_bytes) + int(Fraction(2, 10) * ts.memory_bytes)
    assert ts.reserved_bytes == share + 2 * CUDA_CONTEXT
    # A shared GPU keeps the default 3% margin; a GPU one pod owns keeps none.
    assert ts.budget_bytes == ts.memory_bytes * 97 // 100
    assert [r.budget_bytes for r in rows[:2]] == [r.memory_bytes for r in rows[:2]]
    assert ts.free_bytes == ts.budget_bytes - ts.reserved_bytes and not ts.over_budget
    table = gpu_table(rows)
    assert table.splitlines()[0].split() == [
        "NODE", "GPU", "PRODUCT", "SHARING", "AGENT", "BUDGET", "KNOWN", "WORST-CASE", "FREE", "PODS"]
    assert "time-slicing x4" in table and "default/a,default/b" in table
    # One GPU behind the node's replicas: where the pods are is known without an agent.
    assert ts.agent == "none" and ts.known_bytes == ts.reserved_bytes and "*" not in table


def test_a_worst_case_is_never_shown_as_plain_free_memory() -> None:
    # Two exclusive GPUs, one pod of one GPU, no agent report: it may be on either, so the
    # conservative rule holds it on both. FREE is marked, and a line says why and what to do.
    state = build_state(snapshot(vllm_pod("b", 0.5, "ex")), default_policy())
    rows = [r for r in node_rows(state) if r.node == "ex"]
    assert [(r.known_bytes, r.unplaced_bytes > 0, r.agent) for r in rows] == [(0, True, "none")] * 2
    table = gpu_table(rows)
    assert all("GiB*" in line for line in table.splitlines()[1:3])
    [note] = [line for line in table.splitlines() if line.startswith("* ")]
    assert note.startswith("* ex: FREE is a worst case: no agent report, so the GPUs its pods hold are not known")
    assert note.endswith("run the node agent to see where they are")
    assert rows[0].to_json()["free_is_worst_case"] is True


def test_overcommitted_gpu_shows_negative_free() -> None:
    pods = [vllm_pod(f"p{i}", 0.3, "ts") for i in range(4)]
    row = node_rows(build_state(snapshot(*pods), default_policy()))[-1]
    assert row.over_budget and row.free_bytes < 0
    assert "(OVER)" in gpu_table([row])
    assert row.to_json()["over_budget"] is True


def test_unbound_pods_hold_nothing() -> None:
    rows = node_rows(build_state(snapshot(vllm_pod("pending", 0.5, None)), default_policy()))
    assert all(r.reserved_bytes == 0 for r in rows)


def test_pods_say_what_they_hold_and_why() -> None:
    snap = snapshot(vllm_pod("a", 0.3, "ts"), vllm_pod("b", 0.5, "ex", "team"))
    state = build_state(snap, default_policy())
    holdings = {h.name: h for h in pod_holdings(state, snap.bound_pods)}
    a = holdings["a"].containers[0]
    assert a.engine == "vllm" and a.devices == ("0",)
    assert a.evidence == ("--gpu-memory-utilization 0.3",)
    assert a.bytes_per_gpu == int(Fraction(3, 10) * 81559 * MiB) + CUDA_CONTEXT
    assert a.vram == "0.3 of the GPU + 512.0 MiB"
    assert holdings["b"].containers[0].devices == ("?",)  # two GPUs: the device plugin's choice
    assert [h.name for h in pod_holdings(state, snap.bound_pods, "team")] == ["b"]
    table = pods_table(list(holdings.values()))
    assert "--gpu-memory-utilization 0.3" in table
    assert json.loads(json.dumps([h.to_json() for h in holdings.values()]))[0]["containers"][0]["engine"] == "vllm"


def test_render_table_aligns_columns() -> None:
    assert render_table(("A", "BB"), [("xxx", "y")]) == "A     BB\nxxx   y\n"


def test_policy_choice_order(tmp_path: Path) -> None:
    custom = tmp_path / "policy.yaml"
    custom.write_text("classes: {x: {sharing: [none]}}\ndefault_class: x\n")
    assert choose_policy(custom, "ignored")[1] == str(custom)
    configmap = "classes: {y: {sharing: [mps]}}\ndefault_class: y\n"
    policy, source = choose_policy(None, configmap)
    assert source == "ConfigMap vramguard-system/vramguard-policy" and policy.default_class == "y"
    assert choose_policy(None, None) == (default_policy(), "built-in")
    with pytest.raises(PolicyError):
        choose_policy(None, "classes: 3")


def test_main_prints_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    snap = snapshot(vllm_pod("a", 0.3, "ts"))
    monkeypatch.setattr(kubectl_vram, "read_cluster", lambda *_args, **_kw: (snap, None))
    assert kubectl_vram.main(["nodes", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "built-in" and len(out["gpus"]) == 3
    assert kubectl_vram.main(["pods"]) == 0
    assert "default" in capsys.readouterr().out


def test_unreadable_cluster_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*_args: Any, **_kw: Any) -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(kubectl_vram, "read_cluster", fail)
    assert kubectl_vram.main(["nodes"]) == 1
    assert "connection refused" in capsys.readouterr().err


def test_policy_is_a_policy() -> None:
    assert isinstance(default_policy(), Policy)


def test_output_formats_are_those_of_every_vramguard_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["nodes"]).output == "text"
    assert parser.parse_args(["pods", "-o", "json"]).output == "json"
    assert parser.parse_args(["nodes", "-o", "table"]).output == "table"  # the former name, still read
