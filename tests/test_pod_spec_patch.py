"""Argo's podSpecPatch: a strategic merge patch written as text, laid over the pod after its parameters.

Expectations come from argoproj/argo-workflows v4.1.2: ``podSpecPatch`` "holds strategic merge patch to
apply against the pod spec" (``pkg/apis/workflow/v1alpha1/workflow_types.go``); the workflow's patch, then
the template's, each with the template's parameters substituted (``processPodSpecPatch``,
``workflow/controller/workflowpod.go``), are YAML or JSON applied by ``strategicpatch.StrategicMergePatch``
(``ApplyPodSpecPatch``, ``workflow/util/util.go``); the template's container is the pod's ``main``
(``workflow/common/common.go``); an input parameter is the caller's argument, else its ``value`` or
``default`` (``ProcessArgs``, ``workflow/common/util.go``); ``workflow.parameters`` are the workflow
arguments' values (``setGlobalParameters``, ``workflow/controller/operator.go``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml

from vramguard.cli.explain import explain_object
from vramguard.demand import DemandOptions
from vramguard.pod_spec_patch import (
    MAX_PATCH_CHARS,
    ArgoParameters,
    accelerators_named,
    merge_pod_spec,
    read_patch,
    substitute,
)
from vramguard.policy import Policy, PolicyError, default_policy
from vramguard.workloads import gpu_request_paths, object_parts, parts_demand, unread_warning, workload_parts

KINDS = default_policy().workload_kinds

# argo-workflows v4.1.2 examples/pod-spec-patch-wf-tmpl.yaml, verbatim (its template's patch put in after).
TEMPLATE_PATCH = ('{"containers":[{"name":"main", "resources":{"limits":{"cpu": '
                  '"{{workflow.parameters.cpu-limit}}" }}}]}')
WF_AND_TEMPLATE_PATCH = """\
apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata:
  generateName: pod-spec-patch-
spec:
  entrypoint: hello-world
  arguments:
    parameters:
      - name: cpu-limit
        value: 100m
      - name: mem-limit
        value: 100Mi
  podSpecPatch: |
    containers:
      - name: main
        resources:
          limits:
            memory: "{{workflow.parameters.mem-limit}}"
  templates:
  - name: hello-world
    podSpecPatch: 'TEMPLATE_PATCH'
    container:
      image: busybox
      command: [echo]
      args: ["hello world"]
""".replace("TEMPLATE_PATCH", TEMPLATE_PATCH)


def workflow(templates: list[dict[str, Any]], kind: str = "Workflow", **spec: Any) -> dict[str, Any]:
    body = {"templates": templates, **spec}
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": kind, "metadata": {"name": "w"},
            "spec": {"workflowSpec": body} if kind == "CronWorkflow" else body}


def trainer(patch: str, inputs: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "train", "inputs": {"parameters": inputs or []}, "podSpecPatch": patch,
            "container": {"image": "trainer:1", "command": ["python", "train.py"],
                          "resources": {"limits": {"memory": "8Gi"}}}, **extra}


GPU_PATCH = 'containers: [{name: main, resources: {limits: {nvidia.com/gpu: "{{inputs.parameters.gpus}}"}}}]'


ARGO_NOTE = next(k.note for k in KINDS if k.kind == "Workflow")


def read(obj: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """Each template's name and pod spec, and what is said of the object beside the kind's note."""
    notes: list[str] = []
    parts = object_parts(obj, KINDS, notes=notes)
    assert parts is not None and ARGO_NOTE in notes
    return [(p.name, p.template["spec"]) for p in parts], [n for n in notes if n != ARGO_NOTE]


def gpus(obj: dict[str, Any]) -> list[tuple[str, str, int]]:
    parts = object_parts(obj, KINDS) or []
    return [(p.name, c.name, c.gpus) for p, d in zip(parts, parts_demand(parts, DemandOptions()), strict=True)
            for c in d.containers]


def test_the_workflows_patch_then_the_templates_reach_the_main_container() -> None:
    [(name, spec)], notes = read(yaml.safe_load(WF_AND_TEMPLATE_PATCH))
    [main] = spec["containers"]
    assert name == "container[hello-world]" and main["name"] == "main" and main["image"] == "busybox"
    assert main["resources"] == {"limits": {"memory": "100Mi", "cpu": "100m"}}
    assert main["args"] == ["hello world"]
    assert notes == []


@pytest.mark.parametrize(
    ("inputs", "calls", "expected"),
    [
        pytest.param([{"name": "gpus", "default": "2"}], [], 2, id="input-default"),
        pytest.param([{"name": "gpus", "value": 4, "default": "2"}], [], 4, id="input-value-over-default"),
        pytest.param([{"name": "gpus"}], [{"name": "gpus", "value": "{{workflow.parameters.n}}"}], 3,
                     id="step-argument-from-workflow-parameter"),
        pytest.param([{"name": "gpus", "default": "1"}], [{"name": "gpus", "value": "8"}], 8,
                     id="step-argument-over-default"),
        pytest.param([{"name": "gpus", "default": "{{ workflow.parameters.n }}"}], [], 3,
                     id="default-from-workflow-parameter-spaces-trimmed"),
    ],
)
def test_parameters_are_substituted_before_the_patch_is_read(
    inputs: list[dict[str, Any]], calls: list[dict[str, Any]], expected: int
) -> None:
    steps = {"name": "main", "steps": [[{"name": "s", "template": "train", "arguments": {"parameters": calls}}]]}
    obj = workflow([steps, trainer(GPU_PATCH, inputs)], entrypoint="main",
                   arguments={"parameters": [{"name": "n", "value": 3}]})
    assert gpus(obj) == [("container[train]", "main", expected)]
    assert read(obj)[0][0][1]["containers"][0]["resources"]["limits"]["memory"] == "8Gi"  # merged, not replaced


def test_a_dag_task_and_the_entrypoints_workflow_arguments_give_inputs() -> None:
    dag = {"name": "main", "dag": {"tasks": [{"name": "t", "template": "train",
                                              "arguments": {"parameters": [{"name": "gpus", "value": "2"}]}}]}}
    assert gpus(workflow([dag, trainer(GPU_PATCH, [{"name": "gpus"}])], entrypoint="main")) == [
        ("container[train]", "main", 2)]
    # The entrypoint gets the workflow's arguments (operator.go executeTemplate with Spec.Arguments).
    alone = workflow([trainer(GPU_PATCH, [{"name": "gpus"}])], entrypoint="train",
                     arguments={"parameters": [{"name": "gpus", "value": "4"}]})
    assert gpus(alone) == [("container[train]", "main", 4)]


def test_a_caller_passing_its_own_input_is_followed() -> None:
    outer = {"name": "outer", "inputs": {"parameters": [{"name": "k", "default": "6"}]},
             "steps": [[{"name": "s", "template": "train",
                         "arguments": {"parameters": [{"name": "gpus", "value": "{{inputs.parameters.k}}"}]}}]]}
    assert gpus(workflow([outer, trainer(GPU_PATCH, [{"name": "gpus"}])])) == [("container[train]", "main", 6)]


def test_callers_that_disagree_leave_the_quantity_unread_and_say_so() -> None:
    steps = {"name": "main", "steps": [[
        {"name": f"s{n}", "template": "train", "arguments": {"parameters": [{"name": "gpus", "value": str(n)}]}}
        for n in (1, 4)
    ]]}
    obj = workflow([steps, trainer(GPU_PATCH, [{"name": "gpus"}])])
    assert gpus(obj) == []
    [warning] = read(obj)[1]
    assert warning.startswith("container[train]: its podSpecPatch asks for nvidia.com/gpu")
    assert "{{inputs.parameters.gpus}}" in warning and "devices are not counted" in warning


def test_a_cron_workflows_patches_are_read_under_its_workflow_spec() -> None:
    obj = workflow([trainer("containers: [{name: main, resources: {limits: {amd.com/gpu: 2}}}]")],
                   kind="CronWorkflow", podSpecPatch="containers: [{name: main, env: [{name: A, value: b}]}]")
    [(_, spec)], _ = read(obj)
    assert spec["containers"][0]["env"] == [{"name": "A", "value": "b"}]
    assert gpus(obj) == [("container[train]", "main", 2)]


def test_a_script_template_is_patched_too() -> None:
    script = {"name": "s", "podSpecPatch": '{"containers": [{"name": "main", "resources": '
              '{"limits": {"nvidia.com/gpu": 1}}}]}', "script": {"image": "python:3", "source": "print(1)"}}
    assert gpus(workflow([script])) == [("script[s]", "main", 1)]


def test_the_webhook_reads_the_patch_too() -> None:
    obj = workflow([trainer(GPU_PATCH, [{"name": "gpus", "default": "2"}])], kind="WorkflowTemplate")
    [part] = workload_parts(obj, KINDS, "WorkflowTemplate")
    assert part.template["spec"]["containers"][0]["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "2"}


MAIN = {"name": "main", "image": "i", "args": ["a"], "env": [{"name": "A", "value": "1"}]}


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        # Containers merge by name; args, a list without a merge key, are replaced.
        pytest.param({"containers": [{"name": "main", "args": ["b"]}]},
                     {"containers": [{**MAIN, "args": ["b"]}]}, id="merge-by-name-replace-args"),
        pytest.param({"containers": [{"name": "main", "env": [{"name": "A", "value": "2"}, {"name": "B"}]}]},
                     {"containers": [{**MAIN, "env": [{"name": "A", "value": "2"}, {"name": "B"}]}]},
                     id="env-by-name"),
        pytest.param({"containers": [{"name": "side", "image": "s"}]},
                     {"containers": [MAIN, {"name": "side", "image": "s"}]}, id="a-new-container-is-added"),
        pytest.param({"containers": [{"name": "main", "args": None, "env": [{"name": "A", "$patch": "delete"}]}]},
                     {"containers": [{"name": "main", "image": "i", "env": []}]}, id="null-and-delete"),
        pytest.param({"containers": [{"$patch": "replace"}, {"name": "x", "image": "x"}]},
                     {"containers": [{"name": "x", "image": "x"}]}, id="replace-the-list"),
        pytest.param({"nodeSelector": {"gpu": "a100"}, "tolerations": [{"key": "k"}]},
                     {"containers": [MAIN], "nodeSelector": {"gpu": "a100"}, "tolerations": [{"key": "k"}]},
                     id="new-fields"),
    ],
)
def test_strategic_merge_of_a_pod_spec(patch: dict[str, Any], expected: dict[str, Any]) -> None:
    base = {"containers": [dict(MAIN)]}
    assert merge_pod_spec(base, patch) == expected
    assert base["containers"][0]["args"] == ["a"]  # the base is not changed


def test_substitution_leaves_what_it_does_not_know() -> None:
    values = {"inputs.parameters.a": "1"}
    assert substitute("{{inputs.parameters.a}} {{ inputs.parameters.a }} {{item}} {{=1+1}}", values) == (
        "1 1 {{item}} {{=1+1}}")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("containers: [{name: main, resources: {limits: {nvidia.com/gpu: 1}}", "is not YAML",
                     id="not-yaml"),
        pytest.param("- name: main\n  resources: {limits: {nvidia.com/gpu: 1}}\n", "is not a pod spec", id="a-list"),
        # Argo unmarshals the patch into a PodSpec and fails the step when it cannot (ApplyPodSpecPatch).
        pytest.param("containers: {main: {resources: {limits: {nvidia.com/gpu: 1}}}}",
                     "is not a pod spec (containers must be a list)", id="containers-not-a-list"),
        pytest.param("containers: [{resources: {limits: {nvidia.com/gpu: 1}}}]",
                     "each of containers must be a mapping with a name", id="container-without-name"),
        pytest.param("a: &a [nvidia.com/gpu, nvidia.com/gpu]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                     + "".join(f"c{i}: &c{i} [{', '.join(['*' + ('b' if i == 0 else f'c{i - 1}')] * 10)}]\n"
                               for i in range(5)), "aliases expand", id="alias-bomb"),
        pytest.param("containers: []\n# nvidia.com/gpu\n" + "#" * MAX_PATCH_CHARS, "is over 64 KiB", id="huge"),
    ],
)
def test_a_patch_that_cannot_be_read_is_said_with_the_gpu_it_names(text: str, problem: str) -> None:
    obj = workflow([trainer(text)])
    assert gpus(obj) == []
    [warning] = read(obj)[1]
    assert warning.startswith("container[train]: its podSpecPatch ") and problem in warning, warning
    assert "it names nvidia.com/gpu: those devices are not counted here" in warning
    report = explain_object(obj, 80 << 30, default_policy())
    assert warning in report["warnings"]


def test_a_huge_patch_is_refused_before_it_is_parsed() -> None:
    text = "containers:\n" + "  - {name: main, resources: {limits: {nvidia.com/gpu: 1}}}\n" * 20_000
    assert len(text) > MAX_PATCH_CHARS
    start = time.perf_counter()
    patch, [warning] = read_patch(text, {}, "t: podSpecPatch")
    assert patch is None and "over 64 KiB" in warning and time.perf_counter() - start < 0.5
    # A parameter's value that makes the text too large is refused as well.
    patch, [warning] = read_patch("x: '{{workflow.parameters.p}}'", {"workflow.parameters.p": "y" * MAX_PATCH_CHARS},
                                  "t: podSpecPatch")
    assert patch is None and "with its parameters" in warning


def test_many_templates_and_steps_are_bounded() -> None:
    steps = [{"name": f"m{i}", "steps": [[{"name": f"s{j}", "template": f"m{i + 1}"} for j in range(300)]
                                         for _ in range(3)]} for i in range(300)]
    start = time.perf_counter()
    params = ArgoParameters({"templates": [*steps, trainer(GPU_PATCH, [{"name": "gpus", "default": "1"}])]})
    assert params.values({"name": "train", "inputs": {"parameters": [{"name": "gpus", "default": "1"}]}})[
        "inputs.parameters.gpus"] == "1"
    assert time.perf_counter() - start < 2


def test_an_unfilled_cpu_quantity_is_left_out_and_said() -> None:
    patch, [warning] = read_patch('containers: [{name: main, resources: {limits: {cpu: "{{item}}", '
                                  "nvidia.com/gpu: 1}}}]", {}, "container[t]: its podSpecPatch")
    assert patch == {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}
    assert "asks for cpu: '{{item}}'" in warning and "quantity is not counted" in warning


def test_a_gpu_in_a_patch_is_a_gpu_request_of_the_object() -> None:
    obj = workflow([trainer(GPU_PATCH)])
    assert gpu_request_paths(obj, DemandOptions().is_gpu) == ["spec.templates[0].podSpecPatch (nvidia.com/gpu)"]
    assert accelerators_named("habana.ai/gaudi: 1, cpu: 2, example.com/foo: 1, nvidia.com/mig-1g.10gb: 1") == [
        "habana.ai/gaudi", "nvidia.com/mig-1g.10gb"]
    # Where no entry describes the kind, the object is flagged, never passed over.
    warning = unread_warning(obj, DemandOptions().is_gpu)
    assert warning is not None and "asks for a GPU at spec.templates[0].podSpecPatch (nvidia.com/gpu)" in warning


def test_a_patch_path_names_one_field() -> None:
    entry = {"group": "g", "kind": "K", "resource": "ks", "versions": ["v1"],
             "templates": [{"name": "t", "path": "spec.t.*.c", "form": "container",
                            "pod_spec_patch": {"paths": ["spec.t.*.patch"]}}]}
    with pytest.raises(PolicyError, match="a patch path names one field"):
        Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none]}}\n"
                         + yaml.safe_dump({"workload_kinds": [entry]}))
