"""Engines spread over several pods: the GPUs one pod uses are the total parallel size over its nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.demand import derive_pod_demand

VLLM = "vllm/vllm-openai:v0.21.0"
SGLANG = "lmsysorg/sglang:v0.5.4"
LWS_LEADER_SCRIPT = (
    "bash /vllm-workspace/examples/online_serving/multi-node-serving.sh leader "
    "--ray_cluster_size=$(LWS_GROUP_SIZE); python3 -m vllm.entrypoints.openai.api_server --port 8080 "
    "--model meta-llama/Meta-Llama-3.1-405B-Instruct --tensor-parallel-size 8 --pipeline_parallel_size 2 "
    "--gpu-memory-utilization 0.9"
)


@dataclass
class Case:
    """A pod, the group it belongs to, and what must come out."""

    id: str
    pod: dict[str, Any]
    group_size: int | None = None
    errors: list[str] = field(default_factory=list)
    """Substrings, one per expected error (no other error allowed)."""
    warnings: list[str] = field(default_factory=list)
    engine: str | None = None
    """The engine the container must be read as, where the case is about recognising it."""


CASES = [
    Case(
        "vllm-nnodes-leader",
        pod(container(image=VLLM, gpus=8, command=[
            "vllm", "serve", "m", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
            "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--gpu-memory-utilization", "0.9"])),
    ),
    Case(
        "vllm-nnodes-headless-worker",
        pod(container(image=VLLM, gpus=8, command=[
            "vllm", "serve", "m", "-tp", "16", "--nnodes", "2", "--node-rank", "1", "--headless",
            "--gpu-memory-utilization", "0.9"])),
    ),
    Case(
        "vllm-nnodes-real-mismatch",
        pod(container(image=VLLM, gpus=4, command=[
            "vllm", "serve", "m", "--tensor-parallel-size", "16", "--nnodes", "2", "--gpu-memory-utilization", "0.9"])),
        errors=["vLLM: --tensor-parallel-size 16 = 16 GPUs over --nnodes 2 = 8 per pod, but the container "
                "requests 4 nvidia.com/gpu; make them equal"],
    ),
    Case(
        "vllm-nnodes-uneven",
        pod(container(image=VLLM, gpus=4, command=[
            "vllm", "serve", "m", "--tensor-parallel-size", "3", "--nnodes", "2", "--gpu-memory-utilization", "0.9"])),
        errors=["cannot split evenly over 2 pods"],
    ),
    Case(
        "vllm-lws-leader-in-its-group",
        pod(container(image=VLLM, gpus=8, command=["sh", "-c", LWS_LEADER_SCRIPT])),
        group_size=2,
    ),
    Case(
        "vllm-lws-leader-pod-annotation",
        pod(container(image=VLLM, gpus=8, command=["sh", "-c", LWS_LEADER_SCRIPT]),
            annotations={"leaderworkerset.sigs.k8s.io/size": "2"}),
    ),
    Case(
        "vllm-lws-leader-group-mismatch",
        pod(container(image=VLLM, gpus=8, command=["sh", "-c", LWS_LEADER_SCRIPT]),
            annotations={"leaderworkerset.sigs.k8s.io/size": "4"}),
        errors=["--tensor-parallel-size 8 x --pipeline_parallel_size 2 = 16 GPUs over a group of 4 pods = 4 per pod"],
    ),
    Case(
        "vllm-ray-script-alone-warns",
        pod(container(image=VLLM, gpus=8, command=["sh", "-c", LWS_LEADER_SCRIPT])),
        warnings=["through Ray, so vramguard assumes the engine spans 2 pods of 8 nvidia.com/gpu"],
    ),
    Case(
        "vllm-ray-executor-flag",
        pod(container(image=VLLM, gpus=4, command=[
            "vllm", "serve", "m", "-tp", "4", "-pp", "2", "--distributed-executor-backend", "ray",
            "--gpu-memory-utilization", "0.9"])),
        warnings=["spans 2 pods of 4"],
    ),
    Case(
        "vllm-ray-not-a-multiple",
        pod(container(image=VLLM, gpus=3, command=[
            "vllm", "serve", "m", "-tp", "4", "--distributed-executor-backend", "ray",
            "--gpu-memory-utilization", "0.9"])),
        errors=["vLLM: -tp 4 = 4 GPUs, but the container requests 3 nvidia.com/gpu"],
    ),
    Case(
        "vllm-single-node-mismatch-names-flags",
        pod(container(image=VLLM, gpus=1, command=[
            "vllm", "serve", "m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
            "--gpu-memory-utilization", "0.3"])),
        errors=["vLLM: --tensor-parallel-size 2 x --pipeline-parallel-size 1 = 2 GPUs, but the container "
                "requests 1 nvidia.com/gpu; make them equal"],
    ),
    Case(
        "vllm-data-parallel-local-on-each-node",
        pod(container(image=VLLM, gpus=2, command=[
            "vllm", "serve", "m", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
            "--data-parallel-start-rank", "2", "--headless", "--gpu-memory-utilization", "0.9"])),
    ),
    Case(
        # llm-d's wide-EP recipe: a LeaderWorkerSet group of 2 pods, each with --data-parallel-size-local
        # ranks, already this pod's count (vllm/config/parallel.py "Number of local data parallel groups").
        "vllm-data-parallel-local-in-a-group",
        pod(container(image=VLLM, gpus=8, command=[
            "vllm", "serve", "m", "--data-parallel-size", "16", "--data-parallel-size-local", "8",
            "--enable-expert-parallel", "--gpu-memory-utilization", "0.9"])),
        group_size=2,
    ),
    Case(
        "vllm-data-parallel-local-mismatch-in-a-group",
        pod(container(image=VLLM, gpus=4, command=[
            "vllm", "serve", "m", "--data-parallel-size", "16", "--data-parallel-size-local", "8",
            "--gpu-memory-utilization", "0.9"])),
        group_size=2,
        errors=["vLLM: --data-parallel-size-local 8 = 8 GPUs, but the container requests 4"],
    ),
    Case(
        # Ray's symmetric-run (python/ray/scripts/symmetric_run.py, Ray 2.49+): each pod of the group runs the
        # same command; the engine spans both pods' 8 GPUs through Ray.
        "vllm-ray-symmetric-run-in-a-group",
        pod(container(image=VLLM, gpus=8, command=[
            "ray", "symmetric-run", "--address", "leader:6379", "--min-nodes", "2", "--",
            "vllm", "serve", "m", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
            "--distributed-executor-backend", "ray", "--gpu-memory-utilization", "0.9"])),
        group_size=2,
        engine="vllm",
    ),
    Case(
        # vLLM's docs/serving/data_parallel_deployment.md: "only the API server on the first node and
        # all engines on the second node": --data-parallel-size-local 0 runs no engine here.
        "vllm-data-parallel-api-server-only",
        pod(container(image=VLLM, gpus=1, command=[
            "vllm", "serve", "m", "--data-parallel-size", "4", "--data-parallel-size-local", "0",
            "--data-parallel-address", "10.99.48.128", "--data-parallel-rpc-port", "13345"])),
        warnings=["runs only its API server"],
    ),
    Case(
        # vllm/entrypoints/cli/serve.py run_headless: "data_parallel_size_local must be > 0 in headless mode".
        "vllm-data-parallel-headless-without-engines",
        pod(container(image=VLLM, gpus=1, command=[
            "vllm", "serve", "m", "--headless", "--data-parallel-size", "4", "--data-parallel-size-local=0"])),
        errors=["would not start"],
    ),
    Case(
        # Kthena's data-parallel example (volcano-sh/kthena v1.0.0): one DP rank per pod, --data-parallel-rank
        # set, so each pod runs data_parallel_size_local = 1 (engine/arg_utils.py v0.20.2).
        "vllm-data-parallel-rank-per-pod",
        pod(container(image=VLLM, gpus=1, command=[
            "vllm", "serve", "m", "--data-parallel-size", "2", "--data-parallel-rank", "1",
            "--data-parallel-address", "leader", "--gpu-memory-utilization", "0.9"])),
    ),
    Case(
        "sglang-nnodes",
        pod(container(image=SGLANG, gpus=8, command=[
            "python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "16", "--nnodes", "2",
            "--node-rank", "0", "--dist-init-addr", "sglang-0.sglang:5000", "--mem-fraction-static", "0.85"])),
    ),
    Case(
        "sglang-nnodes-mismatch",
        pod(container(image=SGLANG, gpus=8, command=[
            "python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "16", "--nnodes", "4",
            "--mem-fraction-static", "0.85"])),
        errors=["SGLang: --tp 16 = 16 GPUs over --nnodes 4 = 4 per pod, but the container requests 8"],
    ),
    Case(
        "sglang-lws-group",
        pod(container(image=SGLANG, gpus=8, command=[
            "python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "16",
            "--mem-fraction-static", "0.85"])),
        group_size=2,
    ),
    Case(
        "single-pod-group-is-no-group",
        pod(container(image=SGLANG, gpus=8, command=[
            "python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "16",
            "--mem-fraction-static", "0.85"])),
        group_size=1,
        errors=["SGLang: --tp 16 = 16 GPUs, but the container requests 8"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_multi_node_arithmetic(case: Case) -> None:
    demand = derive_pod_demand(case.pod, group_size=case.group_size)
    assert len(demand.errors) == len(case.errors), demand.errors
    for expected, actual in zip(case.errors, demand.errors, strict=True):
        assert expected in actual
    for expected in case.warnings:
        assert any(expected in w for w in demand.warnings), demand.warnings
    if case.engine is not None:
        assert demand.containers[0].engine == case.engine
    # The per-GPU reservation does not depend on how many nodes the engine spans.
    reservation = demand.containers[0].reservation
    if case.id == "vllm-data-parallel-api-server-only":
        assert reservation is not None and reservation.share_on(80 * 2**30) == 0
    elif reservation is not None and reservation.fraction is not None:
        assert reservation.fraction in (Fraction(9, 10), Fraction(17, 20), Fraction(3, 10))
