"""Never silent: every published object in the corpus (tests/data/workloads and tests/data/dra) that asks
for an accelerator in any form (a GPU resource of any vendor, another sharing system's resource or
annotation, a DRA field, a GPU profile, an accelerator vramguard does not read, or an operator's kind whose
pods get GPUs the object does not name) yields, in `vramguard explain`, a container read with its GPUs or
a warning or error that names the object: its kind, its name, or the resource it asks for. In an object of a
kind the policy describes, each container of a list that asks for one is read with GPUs or named (its path,
or the container): one container read does not excuse another passed over.

Each object is explained as the CLI explains it: with the ConfigMaps and runtimes of its file, and the DRA
objects of its file (ResourceClaims, templates, DeviceClasses) as the claims' context.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from vramguard.cli.explain import explain_object
from vramguard.cli.judge import Judge, is_subject, snapshot_of
from vramguard.demand.derive import GPU_ANNOTATIONS
from vramguard.demand.objects import load_each_document
from vramguard.pod_spec_patch import accelerators_named
from vramguard.policy import default_policy
from vramguard.workloads import PATCH_FIELDS, api_group, find_kind, gpu_request_paths, read_inputs

DATA = Path(__file__).parent / "data"
FILES = sorted([*(DATA / "workloads").glob("*.yaml"), *(DATA / "dra").glob("*.yaml")])
GPU_MEMORY = 80 * 2**30
WORDS = ("gpu", "mig-", "neuron", "tpu", "gaudi", "_nps")


def accelerator(name: str) -> bool:
    """Every vendor's accelerator resource, not only the policy's GPU resources."""
    return "/" in name and any(word in name.lower() for word in WORDS)


def dig(obj: Any, path: str) -> Any:
    for key in path.split("."):
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


IMPLICIT: Mapping[tuple[str, str], Callable[[Mapping[str, Any]], bool]] = {
    # Every GPU of the node resource.instanceType names (kaito v0.12.0 pkg/sku/, GenerateInferencePodSpec).
    ("kaito.sh", "Workspace"): lambda obj: True,
    # The GPUs of the NIMCache's model profile, where spec.resources names none (k8s-nim-operator v3.1.2).
    ("apps.nvidia.com", "NIMService"): lambda obj: True,
    # deploymentConfig.resources.gpu becomes the gpuType resource (vllmruntime_controller.go).
    ("production-stack.vllm.ai", "VLLMRuntime"): lambda obj: dig(obj, "spec.deploymentConfig.resources.gpu")
    not in (None, "", 0, "0"),
    # The trainer's GPUs are its runtime's unless resourcesPerNode says (kubeflow/trainer v2.3.0).
    ("trainer.kubeflow.org", "TrainJob"): lambda obj: True,
    # The engine and decoder are the runtime's engineConfig and decoderConfig (ome v0.1.5 MergeEngineSpec).
    ("ome.io", "InferenceService"): lambda obj: dig(obj, "spec.engine") is not None
    or dig(obj, "spec.decoder") is not None,
}
"""Operator kinds whose pods get GPUs without a GPU resource in the object."""


def asks(obj: Mapping[str, Any]) -> list[str]:
    """Where the object asks for an accelerator, every resource name counted (not only the policy's), in
    pod spec patches written as text (Argo's ``podSpecPatch``) too."""
    found = gpu_request_paths(obj, accelerator)
    implicit = IMPLICIT.get((api_group(obj), str(obj.get("kind"))))
    if implicit is not None and implicit(obj):
        found.append(f"{obj.get('kind')} (implicit)")
    return found


def _walk(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, child in value.items():
            yield str(key), child
            yield from _walk(child)
    elif isinstance(value, list):
        for child in value:
            yield from _walk(child)


def names(obj: Mapping[str, Any]) -> set[str]:
    """What a message may name the object by: its kind, its name, the accelerator resources, GPU
    annotations and DRA claims it asks for."""
    found = {str(obj.get("kind")), str(dig(obj, "metadata.name"))}
    for key, child in _walk(obj):
        if key in ("limits", "requests") and isinstance(child, Mapping):
            found.update(name for name in child if isinstance(name, str) and accelerator(name))
        elif key in GPU_ANNOTATIONS:
            found.add(key)
        elif key == "resourceClaims" and isinstance(child, list):
            found.update(str(c["name"]) for c in child if isinstance(c, Mapping) and c.get("name"))
        elif key in PATCH_FIELDS and isinstance(child, str):
            found.update(accelerators_named(child, accelerator))
    return found - {"None", ""}


def explained(objects: Sequence[Mapping[str, Any]]) -> Iterator[tuple[Mapping[str, Any], dict[str, Any]]]:
    """Each object to judge with its report, as ``vramguard explain --gpu-memory 80Gi`` makes it."""
    policy = default_policy()
    judge = Judge(policy, snapshot_of(objects), stand_in_memory=GPU_MEMORY)
    inputs = read_inputs(objects)
    for obj in filter(is_subject, objects):
        yield obj, explain_object(
            obj, GPU_MEMORY, policy, judge.state.namespace_labels, inputs, judge.state.dra_context()
        )


NOTES = frozenset(k.note for k in default_policy().workload_kinds if k.note is not None)
"""What a kind's entry says of every object of the kind (Argo's fan-out names "WorkflowTemplate")."""


def silent(obj: Mapping[str, Any], report: Mapping[str, Any]) -> bool:
    """Whether an object that asks for an accelerator is neither read with GPUs nor named in a message.
    Its kind's note, said of every object of the kind, names an implicit GPU (one the kind gives, as OME's
    runtime does) but not a resource the object itself asks for."""
    if any(c["gpus"] for c in report["containers"]):
        return False
    named = names(obj)
    implicit = IMPLICIT.get((api_group(obj), str(obj.get("kind"))))
    messages = [m for m in [*report["warnings"], *report["errors"]]
                if m not in NOTES or (implicit is not None and implicit(obj))]
    return not any(name in message for message in messages for name in named)


CONTAINER = re.compile(
    r"^(?P<container>.+\.(?:containers|initContainers|ephemeralContainers|sidecars)\[\d+\])"
    r"\.resources\.(?:limits|requests)$"
)
"""A container of a list asking for devices: every form of a described kind keeps its name."""
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def at(obj: Any, path: str) -> Any:
    """The value at a path as ``gpu_request_paths`` writes it (``spec.templates[0].sidecars[1]``)."""
    for key, index in _STEP.findall(path):
        if key:
            obj = obj.get(key) if isinstance(obj, Mapping) else None
        else:
            obj = obj[int(index)] if isinstance(obj, list) and int(index) < len(obj) else None
    return obj


def containers_passed_over(obj: Mapping[str, Any], report: Mapping[str, Any]) -> list[str]:
    """The containers of an object of a kind the policy describes that ask for an accelerator, yet are neither
    read with GPUs nor named (their path, or ``container NAME``) in a message: one container read does not
    excuse another passed over (an Argo template's GPU sidecar beside its main container)."""
    if find_kind(default_policy().workload_kinds, str(obj.get("kind")), api_group(obj)) is None:
        return []
    read = {c["name"] for c in report["containers"] if c["gpus"]}
    messages = [*report["warnings"], *report["errors"]]
    missed = []
    for path in asks(obj):
        match = CONTAINER.match(path)
        container = at(obj, match["container"]) if match else None
        name = container.get("name") if isinstance(container, Mapping) else None
        if not isinstance(name, str) or name in read:
            continue
        if not any(path in m or f"container {name}" in m for m in messages):
            missed.append(path)
    return missed


def test_the_corpus_has_every_vendor_dra_and_training() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in FILES)
    assert "amd.com/gpu" in text and "kind: TrainJob" in text and "kind: ResourceClaim" in text
    assert len(FILES) >= 80


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_object_asking_for_an_accelerator_is_read_or_named(path: Path) -> None:
    objects = [o for d in load_each_document(path.read_text(encoding="utf-8")) for o in d.objects]
    for obj, report in explained(objects):
        if asks(obj):
            assert not silent(obj, report), (obj.get("kind"), asks(obj), report["warnings"], report["errors"])
            assert not containers_passed_over(obj, report), (obj.get("kind"), report["warnings"])


def test_a_claim_is_read_with_the_dra_objects_of_its_file() -> None:
    # Project-HAMi/k8s-dra-driver v0.1.0 demo: pod-0's only GPU is claim single-gpu-0 (4Gi), read as one.
    text = (DATA / "dra" / "hami-dra-driver-demo.yaml").read_text(encoding="utf-8")
    objects = [o for d in load_each_document(text) for o in d.objects]
    [(pod, report)] = [(o, r) for o, r in explained(objects) if o.get("kind") == "Pod"]
    assert asks(pod) == ["spec.resourceClaims"]
    assert [(c["name"], c["gpus"], c["claims"]) for c in report["containers"]] == [
        ("ctr0", 1, ["single-gpu/single-gpu"])
    ]


IMPLICIT_CASES = {
    "kaito-unknown-instance": {
        "apiVersion": "kaito.sh/v1beta1", "kind": "Workspace", "metadata": {"name": "ws-unknown-sku"},
        "resource": {"instanceType": "Standard_Unknown_v9"}, "inference": {"preset": {"name": "phi-4-mini-instruct"}},
    },
    "nim-without-gpu-limit": {
        "apiVersion": "apps.nvidia.com/v1alpha1", "kind": "NIMService", "metadata": {"name": "nim-no-gpu-limit"},
        "spec": {"image": {"repository": "nvcr.io/nim/meta/llama-3.1-8b-instruct", "tag": "1.3.3"}, "replicas": 1},
    },
    "ome-isvc-runtime-not-in-the-input": {
        "apiVersion": "ome.io/v1beta1", "kind": "InferenceService", "metadata": {"name": "ome-no-runtime"},
        "spec": {"model": {"name": "llama"}, "runtime": {"name": "srt-llama"}, "engine": {"minReplicas": 1}},
    },
}


@pytest.mark.parametrize("obj", IMPLICIT_CASES.values(), ids=IMPLICIT_CASES.keys())
def test_an_implicit_gpu_that_is_not_read_is_named(obj: dict[str, Any]) -> None:
    # Their GPUs come from outside the object (a SKU table, a NIMCache profile, a runtime): a message
    # names the kind, not only the field it could not read.
    [(_, report)] = list(explained([obj]))
    assert asks(obj) and not any(c["gpus"] for c in report["containers"])
    assert not silent(obj, report), report["warnings"]


def test_a_kind_nobody_reads_that_asks_for_a_gpu_is_flagged() -> None:
    # Kubeflow's TFJob (kubeflow.org/v1) is no shipped workload kind: skipped, with the warning.
    tfjob = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "t"}, "spec": {"tfReplicaSpecs": {
        "Worker": {"replicas": 2, "template": {"spec": {"containers": [
            {"name": "tensorflow", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}}}}
    report = explain_object(tfjob, None, default_policy())
    assert report["skipped"] and any("TFJob" in w for w in report["warnings"])


def test_an_accelerator_the_policy_does_not_name_is_warned_about() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "gaudi", "image": "x", "resources": {"limits": {"habana.ai/gaudi": 1}}},
        {"name": "amd", "image": "x", "resources": {"limits": {"amd.com/cpx_nps4": 1}}},
    ]}}
    nvidia_only = default_policy().model_copy(update={"gpu_resources": ("nvidia.com/gpu",),
                                                      "gpu_resource_prefixes": ("nvidia.com/mig-",)})
    report = explain_object(pod, None, nvidia_only)
    assert report["containers"] == []
    assert any("habana.ai/gaudi" in w and "Intel Gaudi" in w for w in report["warnings"])
    assert any("amd.com/cpx_nps4" in w and "AMD GPU" in w for w in report["warnings"])


def _gpu(name: str) -> dict[str, Any]:
    return {"name": name, "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
            "resources": {"limits": {"nvidia.com/gpu": 1}}}


DESCRIBED_FORMS = {
    # Argo v4.1.2: a containerSet's containers, and a template's sidecars and initContainers beside a read main.
    "argo-container-set": {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "w"},
                           "spec": {"templates": [{"name": "t", "containerSet": {"containers": [_gpu("a")]}}]}},
    "argo-sidecar-beside-main": {
        "apiVersion": "argoproj.io/v1alpha1", "kind": "WorkflowTemplate", "metadata": {"name": "w"},
        "spec": {"templates": [{"name": "t", "container": _gpu("main"), "sidecars": [_gpu("sc")],
                                "initContainers": [_gpu("ic")]}]}},
    # KServe v0.20.0 multi-node: the workerSpec's containers beside the predictor's.
    "kserve-worker-spec": {
        "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": {"name": "i"},
        "spec": {"predictor": {"containers": [_gpu("kserve-container")],
                               "workerSpec": {"containers": [_gpu("worker-container")]}}}},
    # OME v0.1.5: a component's inline containers beside its runner, and a component without one (named).
    "ome-inline-beside-runner": {
        "apiVersion": "ome.io/v1beta1", "kind": "ServingRuntime", "metadata": {"name": "r"},
        "spec": {"engineConfig": {"containers": [_gpu("exporter")], "runner": _gpu("ome-container")}}},
    "ome-without-runner": {
        "apiVersion": "ome.io/v1beta1", "kind": "ServingRuntime", "metadata": {"name": "r"},
        "spec": {"decoderConfig": {"containers": [_gpu("decoder")]}}},
    # A field no template of the kind reads (a newer version's): named with its path.
    "unknown-field-of-a-described-kind": {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": "l"},
        "spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": [_gpu("worker")]}},
                                          "sidecarTemplate": {"spec": {"containers": [_gpu("extra")]}}}}},
}


@pytest.mark.parametrize("obj", DESCRIBED_FORMS.values(), ids=DESCRIBED_FORMS.keys())
def test_every_gpu_container_of_a_described_kind_is_read_or_named(obj: dict[str, Any]) -> None:
    [(_, report)] = list(explained([obj]))
    assert asks(obj) and not silent(obj, report), report["warnings"]
    assert not containers_passed_over(obj, report), (asks(obj), report["containers"], report["warnings"])
