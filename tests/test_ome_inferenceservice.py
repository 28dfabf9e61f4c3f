"""OME's InferenceService (ome.io/v1beta1), read over the runtime it names.

sgl-project/ome v0.1.5: the spec's ``engine`` and ``decoder`` (``pkg/apis/ome/v1beta1/inference_service.go``)
are laid over the runtime's ``engineConfig`` and ``decoderConfig`` by strategic merge, the InferenceService's
fields winning (``MergeEngineSpec``, ``pkg/controller/v1beta1/inferenceservice/utils/merging.go``); a
component the InferenceService does not set is not run. The runtime is looked up namespaced first, then
cluster-scoped (``pkg/runtimeselector/fetcher.go`` ``GetRuntime``).
"""

from __future__ import annotations

from typing import Any

import pytest

from vramguard.admission import AdmissionRules, ClusterView, Subject
from vramguard.codecs import ENFORCE_LABEL
from vramguard.demand import DemandOptions
from vramguard.pod_spec_patch import merge_pod_spec
from vramguard.policy import default_policy
from vramguard.webhook_config import webhook_configuration
from vramguard.workloads import object_parts, parts_demand, read_inputs, workload_parts

POLICY = default_policy()
VLLM = "vllm/vllm-openai:v0.10.1"


def runtime(kind: str = "ClusterServingRuntime", utilization: str = "0.9") -> dict[str, Any]:
    """A runtime whose engine runs vLLM on one GPU (after ome v0.1.5 config/runtimes/vllm/)."""
    return {"apiVersion": "ome.io/v1beta1", "kind": kind, "metadata": {"name": "vllm-rt"}, "spec": {"engineConfig": {
        "runner": {"name": "ome-container", "image": VLLM,
                   "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                   "args": ["--gpu-memory-utilization", utilization],
                   "env": [{"name": "A", "value": "1"}],
                   "resources": {"limits": {"cpu": "8", "nvidia.com/gpu": 1}}}}}}


def isvc(engine: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "llama"}, "runtime": {"name": "vllm-rt"}}
    if engine is not None:
        spec["engine"] = engine
    return {"apiVersion": "ome.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "team"}, "spec": spec}


def read(*objects: dict[str, Any]) -> list[tuple[str, int, list[tuple[str, str | None, int, float | None]]]]:
    """The last object's templates: name, pods, and each GPU container's name, engine, GPUs and fraction."""
    notes: list[str] = []
    parts = object_parts(objects[-1], POLICY.workload_kinds, inputs=read_inputs(objects), notes=notes)
    assert parts is not None
    demands = parts_demand(parts, DemandOptions(frozenset(POLICY.gpu_resources), POLICY.gpu_resource_prefixes))
    return [
        (part.name, part.pods, [
            (c.name, c.engine, c.gpus, float(c.reservation.fraction)
             if c.reservation is not None and c.reservation.fraction is not None else None)
            for c in demand.containers
        ])
        for part, demand in zip(parts, demands, strict=True)
    ]


def test_strategic_merge_lays_the_object_over_the_runtime() -> None:
    # Strategic merge patch: maps key by key, env by name (patchMergeKey), args replaced (no strategy).
    base = {"runner": {"args": ["--a"], "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                       "resources": {"limits": {"cpu": "8", "nvidia.com/gpu": 1}}}, "minReplicas": 1}
    override = {"runner": {"args": ["--b"], "env": [{"name": "B", "value": "3"}],
                           "resources": {"limits": {"nvidia.com/gpu": 2}}}, "maxReplicas": 4}
    assert merge_pod_spec(base, override) == {
        "runner": {"args": ["--b"], "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "3"}],
                   "resources": {"limits": {"cpu": "8", "nvidia.com/gpu": 2}}},
        "minReplicas": 1, "maxReplicas": 4,
    }


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        # The runtime's runner, at the InferenceService's replicas (maxReplicas, at full scale).
        pytest.param({"minReplicas": 1, "maxReplicas": 3}, [("engine", 3, [("ome-container", "vllm", 1, 0.9)])],
                     id="runner-from-the-runtime"),
        # The InferenceService's runner fields win: its args replace the runtime's, its GPUs too.
        pytest.param({"runner": {"args": ["--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2"],
                                 "resources": {"limits": {"nvidia.com/gpu": 2}}}},
                     [("engine", 1, [("ome-container", "vllm", 2, 0.5)])], id="runner-overridden"),
        # No engine in the InferenceService: OME runs none (MergeEngineSpec returns nil).
        pytest.param(None, [], id="no-engine-no-pods"),
    ],
)
def test_an_inferenceservice_is_read_over_its_runtime(engine: dict[str, Any] | None, expected: list[Any]) -> None:
    assert read(runtime(), isvc(engine)) == expected


def test_the_namespaced_runtime_is_found_first() -> None:
    found = read(runtime("ClusterServingRuntime", "0.9"), runtime("ServingRuntime", "0.6"), isvc({}))
    assert found == [("engine", 1, [("ome-container", "vllm", 1, 0.6)])]


def test_without_its_runtime_only_its_own_runner_is_read_and_the_note_says_so() -> None:
    own = isvc({"runner": {"resources": {"limits": {"nvidia.com/gpu": 2}}}})
    notes: list[str] = []
    parts = object_parts(own, POLICY.workload_kinds, notes=notes)
    assert parts is not None and [(p.name, p.pods) for p in parts] == [("engine", 1)]
    assert any("OME InferenceService" in n and "spec.runtime" in n for n in notes)


def test_the_webhook_registers_the_inferenceservice_and_reads_it_alone() -> None:
    names = {w["name"] for w in webhook_configuration(POLICY)["webhooks"]}
    assert "inferenceservices.ome.io.vramguard.io" in names
    # A cluster-scoped runtime is not reviewed when it is applied, only through what uses it.
    assert not any(name.startswith("clusterservingruntimes.") for name in names)
    runner = {"image": VLLM, "command": ["vllm", "serve", "m"], "args": ["--gpu-memory-utilization", "1.5"],
              "resources": {"limits": {"nvidia.com/gpu": 1}}}
    bad = isvc({"runner": runner})
    assert [p.name for p in workload_parts(bad, POLICY.workload_kinds, "InferenceService")] == ["engine"]
    decision = AdmissionRules(POLICY).review(
        Subject("InferenceService", "CREATE", "team", bad), ClusterView({ENFORCE_LABEL: "enforce"}, {})
    )
    assert not decision.allowed and "InferenceService engine: " in (decision.message or "")
