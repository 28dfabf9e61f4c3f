"""Pods assembled from parts of a described kind (Argo's containerSet, sidecars, initContainers and script, KServe's
multi-node workerSpec, OME's inline pod specs under a runner), the fields of a described kind no template reads,
and Argo's ``{{...}}`` parameters in the containers' commands.

Sources: argoproj/argo-workflows v4.1.2 (``pkg/apis/workflow/v1alpha1/workflow_types.go`` UserContainer,
``container_set_template_types.go``; ``workflow/controller/workflowpod.go`` addSidecars, addInitContainers,
substitutePodParams; ``workflow/controller/operator.go`` executeScript; ``workflow/common/util.go`` ProcessArgs;
``util/template/simple_template.go``), kserve/kserve v0.20.0 (``pkg/apis/serving/v1beta1/predictor.go`` WorkerSpec,
``pkg/apis/serving/v1alpha1/servingruntime_types.go``), sgl-project/ome v0.1.5
(``pkg/apis/ome/v1beta1/inference_service.go`` EngineSpec, ``reconcilers/common/podspec_reconciler.go``,
``utils/merging.go`` MergeRuntimeContainers).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from vramguard.cli.explain import explain_object
from vramguard.demand import DemandOptions, PodDemand
from vramguard.demand.derive import derive_pod_demand
from vramguard.pod_spec_patch import fill_containers, unknown_parameter
from vramguard.policy import default_policy
from vramguard.template_part import TemplatePart
from vramguard.workloads import WorkloadKind, object_parts, parts_demand, unread_paths

POLICY = default_policy()
OPTIONS = DemandOptions(frozenset(POLICY.gpu_resources), POLICY.gpu_resource_prefixes)
VLLM = "vllm/vllm-openai:v0.11.0"
GPU = {"limits": {"nvidia.com/gpu": 1}}


def vllm(name: str = "main", *args: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": VLLM, "command": ["vllm", "serve", "m", *args], "resources": GPU, **extra}


def plain(name: str, gpus: int = 1) -> dict[str, Any]:
    return {"name": name, "image": "nvidia/cuda:12.4.0-base-ubuntu22.04", "command": ["nvidia-smi"],
            "resources": {"limits": {"nvidia.com/gpu": gpus}}}


def workflow(*templates: dict[str, Any], kind: str = "Workflow", **spec: Any) -> dict[str, Any]:
    body = {"entrypoint": templates[0]["name"], "templates": list(templates), **spec}
    if kind == "CronWorkflow":
        return {"apiVersion": "argoproj.io/v1alpha1", "kind": kind, "metadata": {"name": "w"},
                "spec": {"schedules": ["* * * * *"], "workflowSpec": body}}
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": kind, "metadata": {"name": "w"}, "spec": body}


def read(obj: dict[str, Any]) -> tuple[list[TemplatePart], list[PodDemand], list[str]]:
    notes: list[str] = []
    parts = object_parts(obj, POLICY.workload_kinds, notes=notes)
    assert parts is not None
    return parts, parts_demand(parts, OPTIONS), notes


def gpu_containers(obj: dict[str, Any]) -> dict[str, tuple[str, int, Fraction | None]]:
    """``template/container`` -> (engine, GPUs, share) of each GPU container read."""
    parts, demands, _ = read(obj)
    return {
        f"{part.name}/{c.name}": (str(c.engine), c.gpus,
                                  c.reservation.fraction if c.reservation is not None else None)
        for part, demand in zip(parts, demands, strict=True) for c in demand.containers
    }


# -- Argo: containerSet, sidecars, initContainers, script ------------------------------------------


@pytest.mark.parametrize("kind", ["Workflow", "WorkflowTemplate", "CronWorkflow"])
def test_argo_container_set_sidecars_and_init_containers_are_read(kind: str) -> None:
    obj = workflow(
        {"name": "serve", "containerSet": {"containers": [vllm("a", "--gpu-memory-utilization", "0.5"),
                                                          {"name": "b", "image": "busybox"}]},
         "sidecars": [plain("gpu-sidecar")], "initContainers": [plain("gpu-check")]},
        {"name": "eval", "container": {"image": "busybox", "command": ["true"]},
         "sidecars": [vllm("server", "--gpu-memory-utilization", "0.8")]},
        kind=kind,
    )
    assert gpu_containers(obj) == {
        "container-set[serve]/gpu-check": ("None", 1, None),
        "container-set[serve]/a": ("vllm", 1, Fraction("0.5")),
        "container-set[serve]/gpu-sidecar": ("None", 1, None),
        "container[eval]/server": ("vllm", 1, Fraction("0.8")),
    }
    parts, _, notes = read(obj)
    assert [p.pods for p in parts] == [1, 1]
    assert not any("does not read" in n for n in notes), notes


def test_an_argo_pod_spec_patch_applies_to_a_container_set_pod() -> None:
    # The template's podSpecPatch merges containers by name (strategic merge, workflow/util/util.go).
    obj = workflow({"name": "t", "containerSet": {"containers": [{"name": "a", "image": "busybox"}]},
                    "podSpecPatch": '{"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": 2}}}]}'})
    assert gpu_containers(obj) == {"container-set[t]/a": ("None", 2, None)}


def test_an_argo_script_is_read_as_the_file_its_container_runs() -> None:
    # executeScript: source is written to /argo/staging/script, the container's last argument.
    obj = workflow({"name": "s", "script": {
        "image": VLLM, "command": ["bash"], "resources": GPU,
        "source": "set -e\nvllm serve m --gpu-memory-utilization 0.45\n"}})
    assert gpu_containers(obj) == {"script[s]/main": ("vllm", 1, Fraction("0.45"))}
    [part], _, _ = read(obj)
    [container] = part.template["spec"]["containers"]
    assert container["args"] == ["/argo/staging/script"] and "source" not in container
    assert part.files == {"main": {"/argo/staging/script": "set -e\nvllm serve m --gpu-memory-utilization 0.45\n"}}


def test_an_empty_argo_script_adds_no_argument() -> None:
    obj = workflow({"name": "s", "script": {"image": "busybox", "command": ["true"], "source": "", "resources": GPU}})
    [part], _, _ = read(obj)
    assert "args" not in part.template["spec"]["containers"][0] and part.files is None


# -- KServe multi-node, OME inline pod specs ----------------------------------------------------------


def kserve_multinode(worker: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": {"name": "llama"},
            "spec": {"predictor": {
                "model": {"modelFormat": {"name": "huggingface"}, "storageUri": "pvc://m",
                          "args": ["--gpu-memory-utilization", "0.85"], "resources": {"limits": {"nvidia.com/gpu": 8}}},
                "workerSpec": worker}}}


def test_a_kserve_worker_spec_is_read_with_the_head_engine_and_a_note_on_its_count() -> None:
    obj = kserve_multinode({"pipelineParallelSize": 2, "tensorParallelSize": 8, "containers": [
        {"name": "worker-container", "resources": {"requests": {"nvidia.com/gpu": "8"}}}]})
    assert gpu_containers(obj) == {
        "predictor/kserve-container": ("vllm", 8, Fraction("0.85")),
        "worker/worker-container": ("vllm", 8, Fraction("0.85")),  # the head's Ray cluster spans its GPUs
    }
    _, _, notes = read(obj)
    assert any("spec.predictor.workerSpec" in n and "one worker pod is counted" in n for n in notes), notes


def test_a_kserve_worker_spec_without_containers_still_says_how_kserve_counts_its_pods() -> None:
    parts, _, notes = read(kserve_multinode({"pipelineParallelSize": 2}))
    assert [p.name for p in parts] == ["predictor"]
    assert any("workerSpec" in n and "sets the GPUs" in n for n in notes)


@pytest.mark.parametrize("kind", ["ServingRuntime", "ClusterServingRuntime"])
def test_a_kserve_runtime_worker_spec_is_read(kind: str) -> None:
    obj = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": kind, "metadata": {"name": "rt"}, "spec": {
        "containers": [vllm("kserve-container", "--gpu-memory-utilization", "0.7")],
        "workerSpec": {"containers": [{"name": "worker-container", "image": VLLM,
                                       "command": ["ray", "start", "--block"], "resources": GPU}]}}}
    assert gpu_containers(obj) == {
        "runtime/kserve-container": ("vllm", 1, Fraction("0.7")),
        "worker/worker-container": ("vllm", 1, Fraction("0.7")),
    }


def ome_runtime(engine: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "ome.io/v1beta1", "kind": "ServingRuntime", "metadata": {"name": "srt"},
            "spec": {"engineConfig": engine}}


def test_ome_inline_containers_run_beside_the_runner() -> None:
    obj = ome_runtime({
        "initContainers": [plain("warm-up")],
        "containers": [{"name": "ome-container", "args": ["--gpu-memory-utilization", "0.6"]}, plain("exporter")],
        "runner": vllm("ome-container", "--served-model-name", "m"),
    })
    assert gpu_containers(obj) == {
        "engine/warm-up": ("None", 1, None), "engine/ome-container": ("vllm", 1, Fraction("0.6")),
        "engine/exporter": ("None", 1, None),
    }
    [part], _, _ = read(obj)
    merged = part.template["spec"]["containers"][0]
    # MergeRuntimeContainers: the runner over the container of its name, the container's args first.
    assert merged["image"] == VLLM and merged["args"] == ["--gpu-memory-utilization", "0.6"]


def test_an_ome_runner_alone_is_the_pod_and_inline_leader_containers_are_read() -> None:
    obj = ome_runtime({"runner": vllm("ome-container", "--gpu-memory-utilization", "0.9"),
                       "leader": {"containers": [plain("leader-sidecar")],
                                  "runner": vllm("ome-container", "--gpu-memory-utilization", "0.8")}})
    parts, demands, notes = read(obj)
    assert {(p.name, c.name) for p, d in zip(parts, demands, strict=True) for c in d.containers} == {
        ("engine", "ome-container"), ("engine-leader", "leader-sidecar"), ("engine-leader", "ome-container")}
    assert not any("does not read" in n for n in notes)


def test_an_ome_component_without_a_runner_is_named() -> None:
    # ReconcilePodSpec takes its first container as the main one; the shipped entry reads runners only, so
    # the GPU containers of a component without one are named, never passed over.
    _, _, notes = read(ome_runtime({"containers": [vllm("engine", "--gpu-memory-utilization", "0.9")]}))
    assert any("spec.engineConfig.containers[0].resources.limits" in n and "does not read" in n for n in notes)


# -- Fields of a described kind that no template reads --------------------------------------------


def test_a_gpu_at_a_field_the_entry_does_not_read_is_named() -> None:
    # An entry describing only Argo's container templates (an older policy): the sidecar's GPU is named.
    argo = next(k for k in POLICY.workload_kinds if k.kind == "Workflow")
    narrow = argo.model_copy(update={"templates": (argo.templates[0].model_copy(update={"sidecars": ()}),)})
    obj = workflow({"name": "t", "container": plain("main"), "sidecars": [plain("sc")],
                    "initContainers": [plain("ic")]})
    notes: list[str] = []
    object_parts(obj, [narrow], notes=notes)
    [note] = [n for n in notes if "does not read" in n]
    assert "Workflow (argoproj.io) w asks for a GPU at spec.templates[0].sidecars[0].resources.limits" in note
    assert "spec.templates[0].initContainers" not in note  # the entry's init_containers read them
    report = explain_object(obj, None, POLICY.model_copy(update={"workload_kinds": (narrow,)}))
    assert note in report["warnings"]


def test_every_unread_field_is_found_past_many_read_ones() -> None:
    # Twelve GPU templates read, then one a kind does not describe (a resource template's manifest holds no
    # container; a GPU limit in an unknown field): the scan skips what is read, so it is not crowded out.
    templates = [{"name": f"t{i}", "container": plain("main")} for i in range(12)]
    templates.append({"name": "odd", "gpuTask": {"resources": {"limits": {"nvidia.com/gpu": 4}}}})
    obj = workflow(*templates)
    _, _, notes = read(obj)
    assert any("spec.templates[12].gpuTask.resources.limits" in n for n in notes), notes


def test_a_kserve_pod_spec_predictor_does_not_read_the_worker_spec_for_it() -> None:
    # The predictor's own pod spec is read as a pod spec: its workerSpec is another pod, read by its own
    # template; without that template the worker's GPUs are named.
    isvc = next(k for k in POLICY.workload_kinds if k.kind == "InferenceService" and k.group == "serving.kserve.io")
    without = isvc.model_copy(update={"templates": tuple(t for t in isvc.templates if t.name != "worker")})
    obj = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": {"name": "i"},
           "spec": {"predictor": {"containers": [vllm("kserve-container", "--gpu-memory-utilization", "0.5")],
                                  "workerSpec": {"containers": [plain("worker-container")]}}}}
    notes: list[str] = []
    object_parts(obj, [without], notes=notes)
    assert any("spec.predictor.workerSpec.containers[0].resources.limits" in n for n in notes), notes
    notes.clear()
    object_parts(obj, [isvc], notes=notes)
    assert not any("does not read" in n for n in notes), notes


def test_unread_paths_takes_the_fields_read_and_their_own() -> None:
    obj = {"spec": {"a": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
                    "ab": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
                    "list": [{"resources": {"limits": {"amd.com/gpu": 1}}}]}}
    assert unread_paths(obj, ["spec.a"]) == ["spec.ab.resources.limits", "spec.list[0].resources.limits"]
    assert unread_paths(obj, ["spec.a", "spec.ab", "spec.list[0]"]) == []


def test_a_template_note_needs_its_path() -> None:
    kind = WorkloadKind.model_validate({
        "group": "example.com", "kind": "Thing", "resource": "things", "versions": ["v1"],
        "templates": [{"name": "x", "path": "spec.x", "note": "x is counted once"}]})
    notes: list[str] = []
    object_parts({"apiVersion": "example.com/v1", "kind": "Thing", "spec": {}}, [kind], notes=notes)
    assert notes == []
    object_parts({"apiVersion": "example.com/v1", "kind": "Thing", "spec": {"x": {"spec": {}}}}, [kind], notes=notes)
    assert notes == ["x is counted once"]


# -- Argo's parameters in the containers ---------------------------------------------------------------


def share(obj: dict[str, Any]) -> tuple[Fraction | None, list[str], list[str]]:
    """The share of the one GPU container, the demand's errors and warnings."""
    _, demands, _ = read(obj)
    [demand] = [d for d in demands if d.containers]
    [container] = demand.containers
    fraction = container.reservation.fraction if container.reservation is not None else None
    return fraction, list(demand.errors), list(demand.warnings)


def test_an_input_parameter_after_a_flag_is_read_as_argo_fills_it() -> None:
    # vLLM takes the last --gpu-memory-utilization: the input's value, 0.95, not the 0.5 before it.
    obj = workflow({"name": "serve", "inputs": {"parameters": [
        {"name": "extra", "value": "--gpu-memory-utilization 0.95"}]}, "container": {
        "image": VLLM, "resources": GPU,
        "command": ["sh", "-c", "vllm serve m --gpu-memory-utilization 0.5 {{inputs.parameters.extra}}"]}})
    assert share(obj)[:2] == (Fraction("0.95"), [])


@pytest.mark.parametrize("tag", ["{{workflow.parameters.u}}", "{{ workflow.parameters.u }}"])
def test_a_workflow_parameter_in_an_argument_is_its_value(tag: str) -> None:
    obj = workflow({"name": "serve", "container": {
        "image": VLLM, "resources": GPU, "args": ["vllm", "serve", "m", "--gpu-memory-utilization", tag]}},
        arguments={"parameters": [{"name": "u", "value": "0.7"}]})
    assert share(obj)[:2] == (Fraction("0.7"), [])


def test_a_cron_workflow_fills_from_its_workflow_spec() -> None:
    obj = workflow({"name": "serve", "container": {
        "image": VLLM, "resources": GPU,
        "args": ["vllm", "serve", "m", "--gpu-memory-utilization", "{{workflow.parameters.u}}"]}},
        kind="CronWorkflow", arguments={"parameters": [{"name": "u", "value": 0.65}]})
    assert share(obj)[:2] == (Fraction("0.65"), [])


def test_the_argument_a_step_passes_is_the_input() -> None:
    obj = workflow(
        {"name": "main", "steps": [[{"name": "s", "template": "serve",
                                     "arguments": {"parameters": [{"name": "util", "value": "0.55"}]}}]]},
        {"name": "serve", "inputs": {"parameters": [{"name": "util", "default": "0.9"}]}, "container": {
            "image": VLLM, "resources": GPU, "env": [{"name": "UTIL", "value": "{{inputs.parameters.util}}"}],
            "args": ["vllm", "serve", "m", "--gpu-memory-utilization", "$(UTIL)"]}})
    assert share(obj)[:2] == (Fraction("0.55"), [])


@pytest.mark.parametrize("obj", [
    pytest.param(workflow({"name": "serve", "container": {
        "image": VLLM, "resources": GPU,
        "args": ["vllm", "serve", "m", "--gpu-memory-utilization", "{{workflow.parameters.u}}"]}}),
        id="workflow-parameter-without-value"),
    pytest.param(workflow(
        {"name": "main", "steps": [[{"name": "s", "template": "serve", "withItems": ["0.3", "0.95"],
                                     "arguments": {"parameters": [{"name": "extra", "value": "{{item}}"}]}}]]},
        {"name": "serve", "inputs": {"parameters": [{"name": "extra"}]}, "script": {
            "image": VLLM, "resources": GPU, "command": ["bash"],
            "source": "vllm serve m --gpu-memory-utilization 0.5 \\\n"
                      "  --gpu-memory-utilization {{inputs.parameters.extra}}\n"}}),
        id="item-in-a-script"),
    pytest.param(workflow({"name": "serve", "inputs": {"parameters": [{"name": "extra"}]}, "container": {
        "image": VLLM, "resources": GPU,
        "command": ["sh", "-c", "vllm serve m --gpu-memory-utilization 0.5 {{inputs.parameters.extra}}"]}}),
        id="input-without-value-after-the-flag"),
    pytest.param(workflow({"name": "serve", "container": {
        "image": VLLM, "resources": GPU, "env": [{"name": "U", "value": "{{=sprig.trim(workflow.parameters.u)}}"}],
        "args": ["vllm", "serve", "m", "--gpu-memory-utilization", "$(U)"]}}),
        id="expression-in-env"),
])
def test_a_parameter_without_a_value_makes_the_vram_unknown_not_wrong(obj: dict[str, Any]) -> None:
    fraction, errors, warnings = share(obj)
    assert fraction is None and errors == []
    assert any("ARGO_" in w for w in warnings), warnings


def test_a_pods_own_arguments_are_literal() -> None:
    # Argo fills a pod's command before the pod exists: a pod is never filled here.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [
        vllm("main", "--gpu-memory-utilization", "{{workflow.parameters.u}}")]}}
    demand = derive_pod_demand(pod, OPTIONS)
    assert any("{{workflow.parameters.u}} is not a number" in e for e in demand.errors)
    [part] = object_parts(pod, POLICY.workload_kinds) or []
    assert part.template["spec"]["containers"][0]["command"][-1] == "{{workflow.parameters.u}}"


def test_fill_containers() -> None:
    spec = {"containers": [{"name": "c", "image": "r/i:{{inputs.parameters.tag}}", "command": ["{{a}}", "x"],
                            "args": ["{{ b }}-{{c}}"], "env": [{"name": "E", "value": "{{a}}"}, {"name": "F"}],
                            "resources": {"limits": {"nvidia.com/gpu": "{{a}}"}}, "source": "{{c}}"}],
            "initContainers": [{"name": "i", "args": ["plain"]}]}
    filled = fill_containers(spec, {"a": "1", "b": "{{c}}", "inputs.parameters.tag": "v1"}, "source")
    [c] = filled["containers"]
    assert c["image"] == "r/i:v1" and c["command"] == ["1", "x"]
    assert c["args"] == [f"{unknown_parameter('c')}-{unknown_parameter('c')}"]  # a value's tag is unknown too
    assert c["env"] == [{"name": "E", "value": "1"}, {"name": "F"}]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "{{a}}"}}  # quantities hold no parameter
    assert c["source"] == unknown_parameter("c") == "${ARGO_c}"
    assert filled["initContainers"] is spec["initContainers"]
    assert fill_containers({"containers": [{"name": "c", "args": ["x"]}]}, {}) == {"containers": [
        {"name": "c", "args": ["x"]}]}
    assert unknown_parameter(" inputs.parameters.gpu-util ") == "${ARGO_inputs_parameters_gpu_util}"


def test_filling_is_bounded() -> None:
    value = "x" * (1 << 16)
    spec = {"containers": [{"name": "c", "args": ["{{v}}"] * 64}]}
    [c] = fill_containers(spec, {"v": value})["containers"]
    filled = [a for a in c["args"] if a == value]
    assert 0 < len(filled) <= 16 and all(a in (value, unknown_parameter("v")) for a in c["args"])
