"""Custom workloads through the real API server: a LeaderWorkerSet and an InferenceService refused at create time.

The session cluster registers the shipped webhook configuration, generated from the default policy,
whose ``workload_kinds`` name LeaderWorkerSet and InferenceService; this module installs their
CRDs (minimal structural copies kept in ``e2e/crds``) and creates objects of both kinds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.test_webhook import Namespace, namespace, poll, raw

__all__ = ["namespace"]  # the fixture, shared with the webhook tests

CRDS = Path(__file__).parent / "crds"
CORPUS = Path(__file__).parent.parent / "tests" / "data" / "workloads"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@pytest.fixture(scope="module")
def crds(cluster: Any) -> Iterator[None]:
    """The LeaderWorkerSet, InferenceService and KubeAI Model CRDs, established."""
    if not hasattr(cluster, "state"):
        pytest.skip("installs CRDs as the local control plane's admin")
    names = []
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        status, body = raw(cluster, "POST", CRD_PATH, crd)
        assert status in (201, 409), body
        names.append(crd["metadata"]["name"])

    def established() -> bool:
        for name in names:
            _, body = raw(cluster, "GET", f"{CRD_PATH}/{name}")
            conditions = (body.get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return False
        return True

    poll("the CRDs are established", established)
    yield


def corpus(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = list(yaml.safe_load_all((CORPUS / name).read_text()))[-1]
    return copy.deepcopy(loaded)


def create(cluster: Any, ns: Namespace, obj: dict[str, Any], plural: str) -> tuple[int, dict[str, Any]]:
    group_version = obj["apiVersion"]
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": ns.name}}

    def served() -> tuple[int, dict[str, Any]] | None:
        # Discovery of a new CRD takes a moment: a 404 means "not served yet", not a verdict.
        status, body = raw(cluster, "POST", f"/apis/{group_version}/namespaces/{ns.name}/{plural}", obj)
        return None if status == 404 else (status, body)

    answer: tuple[int, dict[str, Any]] = poll(f"{plural} are served", served)
    return answer


def test_invalid_leaderworkerset_is_refused_at_create_time(
    cluster: Any, crds: None, namespace: Callable[[str], Namespace]
) -> None:
    ns = namespace("enforce")
    lws = corpus("lws-vllm-nnodes.yaml")
    lws["spec"]["leaderWorkerTemplate"]["size"] = 4  # 16 GPUs over 4 pods is 4 per pod, not 8
    status, body = create(cluster, ns, lws, "leaderworkersets")
    assert status == 403, body
    assert body["message"].startswith(
        'admission webhook "leaderworkersets.leaderworkerset.x-k8s.io.vramguard.io" denied the request: '
    )
    assert "LeaderWorkerSet leader: container vllm: vLLM: --tensor-parallel-size=16 = 16 GPUs over a group of 4 " \
        "pods = 4 per pod, but the container requests 8 nvidia.com/gpu" in body["message"]
    valid = corpus("lws-vllm-nnodes.yaml")
    status, body = create(cluster, ns, valid, "leaderworkersets")
    assert status == 201, body["message"]


def test_invalid_inferenceservice_is_refused_at_create_time(
    cluster: Any, crds: None, namespace: Callable[[str], Namespace]
) -> None:
    ns = namespace("enforce")
    isvc = corpus("kserve-isvc-huggingface.yaml")
    isvc["spec"]["predictor"]["model"]["args"][-1] = "--gpu-memory-utilization=1.5"
    status, body = create(cluster, ns, isvc, "inferenceservices")
    assert status == 403, body
    assert body["message"] == (
        'admission webhook "inferenceservices.serving.kserve.io.vramguard.io" denied the request: '
        "InferenceService predictor: container kserve-container: --gpu-memory-utilization=1.5 is outside (0, 1]"
    )
    status, body = create(cluster, ns, corpus("kserve-isvc-huggingface.yaml"), "inferenceservices")
    assert status == 201, body["message"]


def test_a_kubeai_model_vllm_would_refuse_is_refused_at_create_time(
    cluster: Any, crds: None, namespace: Callable[[str], Namespace]
) -> None:
    # A serving operator's object holds no pod template: the webhook reads it as KubeAI renders its
    # pods (vramguard.operators.kubeai), from KubeAI's published catalog manifest.
    ns = namespace("enforce")
    model = corpus("kubeai-model-llama-3.1-8b-instruct-fp8-l4.yaml")
    model["spec"]["args"] = [a.replace("=0.9", "=1.5") for a in model["spec"]["args"]]
    status, body = create(cluster, ns, model, "models")
    assert status == 403, body
    assert body["message"] == (
        'admission webhook "serving-operators.vramguard.io" denied the request: '
        "Model model: container server: --gpu-memory-utilization=1.5 is outside (0, 1]"
    )
    status, body = create(cluster, ns, corpus("kubeai-model-llama-3.1-8b-instruct-fp8-l4.yaml"), "models")
    assert status == 201, body["message"]
