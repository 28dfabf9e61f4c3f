"""Pod spec patches written as text in a workload (Argo's ``podSpecPatch``), read as the project applies them.

Argo Workflows (argoproj/argo-workflows v4.1.2) lets a workflow and each of its templates carry
``podSpecPatch``, "strategic merge patch to apply against the pod spec. Allows parameterization of container
fields which are not strings (e.g. resource limits)" (``pkg/apis/workflow/v1alpha1/workflow_types.go``):

- the workflow's patch, then the template's, are laid over the pod the controller generates from the
  template, after its parameters are substituted (``processPodSpecPatch`` and ``util.ApplyPodSpecPatch``,
  ``workflow/controller/workflowpod.go``, ``workflow/util/util.go``): the text is YAML or JSON, read as a
  ``PodSpec`` and applied with ``strategicpatch.StrategicMergePatch``; the template's container is the pod's
  container ``main`` (``MainContainerName``, ``workflow/common/common.go``);
- ``{{workflow.parameters.NAME}}`` is the workflow argument's ``value`` (``setGlobalParameters``,
  ``workflow/controller/operator.go``); ``{{inputs.parameters.NAME}}`` is the argument the calling step or
  DAG task passes, else the input's ``value``, else its ``default`` (``ProcessArgs``,
  ``workflow/common/util.go``); the entrypoint's arguments are the workflow's; a tag's spaces are trimmed
  (``util/template/simple_template.go``).

The same parameters are filled in the template's containers: Argo substitutes the whole template before it
makes the pod (``ProcessArgs``), and the pod again (``substitutePodParams``, ``workflow/controller/workflowpod.go``),
so a command, an argument, a script's ``source`` or an ``env`` value holding ``{{inputs.parameters.extra}}``
runs with the value. A tag this object gives no single value (``{{item}}``, a step's output, a parameter
passed at submit time, an expression) becomes a shell-style reference to a variable no spec sets
(:func:`unknown_parameter`), read as any unexpanded reference is: unknown, never as the literal text. A pod's
own command is literal: Argo has filled it before the pod exists, and nothing here touches pods.

A patch that does not read as a pod spec where containers ask for devices (containers not a list of named
mappings, resources not mappings) is not read: Argo unmarshals it into a ``PodSpec`` and fails the step.
Only what the object itself gives is used: a parameter with no value there, or whose callers pass
different values, stays unsubstituted, and a resource quantity that still holds one is not read (with a
warning). Strategic merge follows ``k8s.io/api`` v0.35.4 ``core/v1/types.go`` (Argo v4.1.2's version): the
lists below merge by their key, any other list and every scalar is replaced, ``null`` removes a field, and
the ``$patch: replace | delete`` and ``$retainKeys`` directives apply.

Everything is bounded: the text (:data:`MAX_PATCH_CHARS`), its YAML nodes, the nesting merged, the
templates and steps searched for arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from vramguard import vendors
from vramguard.demand.derive import OTHER_GPU_RESOURCES
from vramguard.demand.objects import MAX_SETTINGS_NODES, YamlTooLarge, load_yaml
from vramguard.quantity import excerpt

__all__ = [
    "MAX_PATCH_CHARS",
    "ArgoParameters",
    "accelerators_named",
    "fill_containers",
    "is_accelerator",
    "merge_pod_spec",
    "read_patch",
    "substitute",
    "unknown_parameter",
]

MAX_PATCH_CHARS = 64 << 10
"""A patch longer than this (before or after its parameters are substituted; real ones are a few lines) is
not read: the webhook reads it too, and YAML parsing in Python costs about a second per MiB."""
MAX_DEPTH = 32
"""Nesting merged at most; deeper values of the patch replace the base's whole."""
MAX_TEMPLATES = 256
"""Templates of one workflow searched for the steps and tasks that call a template."""
MAX_CALLERS = 256
"""Steps and tasks read for one template's arguments."""
MAX_CALL_DEPTH = 4
"""Callers followed up the call chain for an argument that is the caller's own input."""

MERGE_KEYS: Mapping[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "ports": "containerPort",
    "imagePullSecrets": "name", "hostAliases": "ip", "topologySpreadConstraints": "topologyKey",
    "schedulingGates": "name", "resourceClaims": "name",
}
"""The pod spec's lists that strategic merge merges element by element, and each one's merge key
(``patchStrategy:"merge"`` with ``patchMergeKey`` in ``k8s.io/api`` v0.35.4 ``core/v1/types.go``)."""

_TAG = re.compile(r"\{\{([^{}]{1,256})\}\}")
_RESOURCE = re.compile(
    r"(?<![\w./-])[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
"""An extended resource's name (a DNS subdomain, ``/``, a name), as it may appear in a patch's text."""


def is_accelerator(name: str, is_gpu: Callable[[str], bool] | None = None) -> bool:
    """Whether a resource name asks for an accelerator in a form vramguard knows: ``is_gpu`` (the policy's
    GPU resources), every vendor's GPU and partition resources, another sharing system's resources, a
    ``gpu`` limit, an accelerator vramguard does not read (:data:`vramguard.vendors.OTHER_ACCELERATORS`)."""
    return (
        (is_gpu is not None and is_gpu(name))
        or name in vendors.DEFAULT_GPU_RESOURCES
        or name.startswith(vendors.DEFAULT_PARTITION_PREFIXES)
        or name in OTHER_GPU_RESOURCES
        or name == "gpu"
        or vendors.vendor_of(name) is not None
        or name.startswith(tuple(vendors.OTHER_ACCELERATORS))
    )


def accelerators_named(text: str, is_gpu: Callable[[str], bool] | None = None) -> list[str]:
    """The accelerator resources a text names anywhere (a patch that cannot be parsed), in order, each once."""
    found: list[str] = []
    for match in _RESOURCE.finditer(text[:MAX_PATCH_CHARS]):
        name = match.group(0)
        if name not in found and is_accelerator(name, is_gpu):
            found.append(name)
            if len(found) >= 8:
                break
    return found


def substitute(text: str, values: Mapping[str, str]) -> str:
    """``text`` with each ``{{ tag }}`` that ``values`` gives replaced (spaces inside the braces trimmed);
    any other tag is left as written."""
    return _TAG.sub(lambda m: values.get(m.group(1).strip(), m.group(0)), text)


UNKNOWN_PREFIX = "ARGO_"
"""How the variable an unfilled parameter reads as begins (``{{inputs.parameters.extra}}``:
``${ARGO_inputs_parameters_extra}``)."""
_NOT_A_NAME = re.compile(r"\W", re.ASCII)
FILLED_FIELDS = ("command", "args", "image", "workingDir")
"""The container fields whose parameters are filled (with ``env`` values and the script field): the text a
pod runs. Resource quantities cannot hold a parameter (Argo refuses the template: ``podSpecPatch`` is there
for that)."""
UNKNOWN_FIELDS = ("command", "args")
"""The container fields where an unfilled parameter reads as unknown (with ``env`` values and the script
field); elsewhere (``image``) it stays as written."""


def unknown_parameter(tag: str) -> str:
    """The reference an unfilled ``{{tag}}`` reads as in a command, argument, script or ``env`` value:
    ``${ARGO_inputs_parameters_extra}``, a variable the spec does not set. Every reader of commands takes it
    as a value it cannot know (``unresolved_reference`` in :mod:`vramguard.engines.base`; an unset variable in
    a script), as it takes ``$(VAR)`` of a variable not in ``env``: an argument that may set a flag again,
    a flag's value that is not read."""
    return "${" + UNKNOWN_PREFIX + _NOT_A_NAME.sub("_", tag.strip())[:64] + "}"


def fill_containers(
    spec: Mapping[str, Any], values: Mapping[str, str], script_field: str | None = None
) -> Mapping[str, Any]:
    """The pod spec ``spec`` with the ``{{...}}`` parameters of its containers filled from ``values`` (see the
    module's notes), the unfilled ones of commands, arguments, ``env`` values and ``script_field`` made
    unknown (:func:`unknown_parameter`). ``spec`` itself when no container holds a parameter."""
    changed: dict[str, list[Any]] = {}
    for key in CONTAINER_LISTS:
        entries = spec.get(key)
        if not isinstance(entries, list):
            continue
        filled = [_fill_container(c, values, script_field) if isinstance(c, Mapping) else c for c in entries]
        if any(new is not old for new, old in zip(filled, entries, strict=True)):
            changed[key] = filled
    return {**spec, **changed} if changed else spec


def _fill_container(
    container: Mapping[str, Any], values: Mapping[str, str], script_field: str | None
) -> Mapping[str, Any]:
    budget = [MAX_FILLED_CHARS]
    filled: dict[str, Any] = {}
    for key in (*FILLED_FIELDS, *((script_field,) if script_field else ())):
        value = container.get(key)
        unknown = key in UNKNOWN_FIELDS or key == script_field
        if isinstance(value, str) and "{{" in value:
            filled[key] = _fill(value, values, unknown, budget)
        elif isinstance(value, list) and any(isinstance(v, str) and "{{" in v for v in value):
            filled[key] = [_fill(v, values, unknown, budget) if isinstance(v, str) else v for v in value]
    env = container.get("env")
    if isinstance(env, list) and any(
        isinstance(e, Mapping) and isinstance(e.get("value"), str) and "{{" in e["value"] for e in env
    ):
        filled["env"] = [
            {**e, "value": _fill(e["value"], values, True, budget)}
            if isinstance(e, Mapping) and isinstance(e.get("value"), str) else e
            for e in env
        ]
    return {**container, **filled} if filled else container


MAX_FILLED_CHARS = 1 << 20
"""Characters the parameters of one container may add at most; a tag past it is filled as unknown (a value
used a thousand times must not cost memory)."""


def _fill(text: str, values: Mapping[str, str], unknown: bool, budget: list[int]) -> str:
    """``text`` with each tag ``values`` gives filled, once, as Argo fills it; with ``unknown``, every tag left
    (one it does not give, or one a value brought: ``{{item}}`` a step passes) made unknown."""
    if "{{" not in text:
        return text

    def one(match: re.Match[str]) -> str:
        tag = match.group(1).strip()
        value = values.get(tag)
        if value is not None and len(value) <= budget[0]:
            budget[0] -= len(value)
            return value
        return unknown_parameter(tag) if unknown or value is not None else match.group(0)

    filled = _TAG.sub(one, text)
    if unknown and "{{" in filled:
        filled = _TAG.sub(lambda m: unknown_parameter(m.group(1)), filled)
    return filled


def read_patch(
    text: str, values: Mapping[str, str], where: str, is_gpu: Callable[[str], bool] | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The patch ``text`` as a pod spec patch, its parameters filled from ``values``, with the warnings
    (each starting with ``where``) for what could not be read: text too large, not YAML, not a mapping, a
    resource quantity still holding a parameter (that quantity left out). ``None`` when nothing is read."""
    if len(text) > MAX_PATCH_CHARS:
        return None, [f"{where} is over {MAX_PATCH_CHARS >> 10} KiB: not read{_naming(text, is_gpu)}"]
    filled = substitute(text, values)
    if len(filled) > MAX_PATCH_CHARS:
        return None, [f"{where} is over {MAX_PATCH_CHARS >> 10} KiB with its parameters: not read"
                      f"{_naming(text, is_gpu)}"]
    try:
        patch = load_yaml(filled, MAX_SETTINGS_NODES)
    except YamlTooLarge as exc:
        return None, [f"{where} is not read: {exc.problem}{_naming(text, is_gpu)}"]
    except yaml.YAMLError as exc:
        return None, [f"{where} is not YAML ({exc.__class__.__name__}): not read, and Argo fails the step"
                      f"{_naming(text, is_gpu)}"]
    if patch is None:
        return None, []
    problem = _not_a_pod_spec(patch)
    if problem is not None:
        return None, [f"{where} is not a pod spec ({problem}): not read, and Argo fails the step"
                      f"{_naming(text, is_gpu)}"]
    warnings: list[str] = []
    return _drop_unfilled(patch, where, is_gpu, warnings, 0), warnings


CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


def _not_a_pod_spec(patch: Any) -> str | None:
    """What keeps ``patch`` from reading as a ``PodSpec`` where containers ask for devices (Argo unmarshals
    the patch into one and fails the step when it cannot, ``ApplyPodSpecPatch``), or ``None``."""
    if not isinstance(patch, Mapping) or not all(isinstance(key, str) for key in patch):
        return "a mapping of fields"
    for key in CONTAINER_LISTS:
        containers = patch.get(key)
        if containers is None:
            continue
        if not isinstance(containers, list):
            return f"{key} must be a list"
        for container in containers:
            if not isinstance(container, Mapping) or not (
                isinstance(container.get("name"), str) or container.get("$patch") == "replace"
            ):
                return f"each of {key} must be a mapping with a name"
            resources = container.get("resources")
            if resources is not None and (not isinstance(resources, Mapping) or any(
                resources.get(part) is not None and not isinstance(resources.get(part), Mapping)
                for part in ("limits", "requests")
            )):
                return f"the resources of {key} {excerpt(str(container.get('name')))} must map names to quantities"
    return None


def _naming(text: str, is_gpu: Callable[[str], bool] | None) -> str:
    names = accelerators_named(text, is_gpu)
    return f"; it names {', '.join(names)}: those devices are not counted here" if names else ""


def _drop_unfilled(
    value: Any, where: str, is_gpu: Callable[[str], bool] | None, warnings: list[str], depth: int
) -> Any:
    """``value`` without the resource quantities that still hold a ``{{parameter}}``, each named in a warning."""
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        kept: dict[str, Any] = {}
        for key, child in value.items():
            if key in ("limits", "requests") and isinstance(child, Mapping):
                quantities = {}
                for name, quantity in child.items():
                    if isinstance(quantity, str) and _TAG.search(quantity):
                        what = "devices are" if is_accelerator(str(name), is_gpu) else "quantity is"
                        warnings.append(
                            f"{where} asks for {name}: {excerpt(quantity)}, a parameter this object gives no "
                            f"single value (no default, or callers that differ): those {what} not counted here"
                        )
                    else:
                        quantities[name] = quantity
                kept[key] = quantities
            else:
                kept[key] = _drop_unfilled(child, where, is_gpu, warnings, depth + 1)
        return kept
    if isinstance(value, list):
        return [_drop_unfilled(child, where, is_gpu, warnings, depth + 1) for child in value]
    return value


_DELETE = object()


def merge_pod_spec(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``patch`` laid over the pod spec ``base`` by Kubernetes' strategic merge (see the module's notes)."""
    merged = _merge_map(base, patch, 0)
    return merged if isinstance(merged, dict) else {}


def _merge_map(base: Mapping[str, Any], patch: Mapping[str, Any], depth: int) -> Any:
    directive = patch.get("$patch")
    if directive == "delete":
        return _DELETE
    if directive == "replace":
        return {k: v for k, v in patch.items() if not str(k).startswith("$")}
    merged = dict(base)
    for key, value in patch.items():
        if not isinstance(key, str) or key.startswith("$"):
            continue
        old = base.get(key)
        if value is None:
            merged.pop(key, None)
        elif depth < MAX_DEPTH and isinstance(value, Mapping) and isinstance(old, Mapping):
            result = _merge_map(old, value, depth + 1)
            if result is _DELETE:
                merged.pop(key, None)
            else:
                merged[key] = result
        elif depth < MAX_DEPTH and key in MERGE_KEYS and isinstance(value, list):
            merged[key] = _merge_list(old if isinstance(old, list) else [], value, MERGE_KEYS[key], depth + 1)
        elif isinstance(value, Mapping):
            merged[key] = {k: v for k, v in value.items() if not str(k).startswith("$") and v is not None}
        else:
            merged[key] = value
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        merged = {k: v for k, v in merged.items() if k in retain}
    return merged


def _merge_list(base: Sequence[Any], patch: Sequence[Any], key: str, depth: int) -> list[Any]:
    if any(isinstance(e, Mapping) and e.get("$patch") == "replace" for e in patch):
        return [e for e in patch if not (isinstance(e, Mapping) and e.get("$patch") == "replace")]
    merged = list(base)
    for element in patch:
        found = next((index for index, old in enumerate(merged)
                      if isinstance(element, Mapping) and isinstance(old, Mapping)
                      and key in element and old.get(key) == element.get(key)), None)
        if found is None:
            if not (isinstance(element, Mapping) and element.get("$patch") == "delete"):
                merged.append(_merge_map({}, element, depth) if isinstance(element, Mapping) else element)
            continue
        result = _merge_map(merged[found], element, depth)
        if result is _DELETE:
            del merged[found]
        else:
            merged[found] = result
    return merged


# -- Argo's parameters -----------------------------------------------------------------------------


def _text(value: Any) -> str | None:
    """A parameter's value as Argo's ``AnyString`` reads it from YAML (``true``, ``1``, ``0.5``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    return None


def _parameters(arguments: Any) -> list[Mapping[str, Any]]:
    found = arguments.get("parameters") if isinstance(arguments, Mapping) else None
    return [p for p in found[:MAX_CALLERS] if isinstance(p, Mapping) and isinstance(p.get("name"), str)] \
        if isinstance(found, list) else []


class ArgoParameters:
    """The values a workflow spec gives the ``{{...}}`` parameters of its templates (see the module's notes)."""

    def __init__(self, workflow: Mapping[str, Any]) -> None:
        self.globals = {
            f"workflow.parameters.{p['name']}": text
            for p in _parameters(workflow.get("arguments"))
            if (text := _text(p.get("value"))) is not None
        }
        templates = workflow.get("templates")
        self.templates = {
            str(t["name"]): t for t in (templates[:MAX_TEMPLATES] if isinstance(templates, list) else [])
            if isinstance(t, Mapping) and isinstance(t.get("name"), str)
        }
        # Each template's calls: (the calling template, or None for the workflow, and the arguments).
        self.calls: dict[str, list[tuple[Mapping[str, Any] | None, Any]]] = {}
        if isinstance(workflow.get("entrypoint"), str):
            self.calls[workflow["entrypoint"]] = [(None, workflow.get("arguments"))]
        read = 0
        for caller in self.templates.values():
            steps, dag = caller.get("steps"), caller.get("dag")
            tasks = dag.get("tasks") if isinstance(dag, Mapping) else None
            candidates = [step for group in (steps[:MAX_CALLERS] if isinstance(steps, list) else [])
                          for step in (group[:MAX_CALLERS] if isinstance(group, list) else [group])]
            candidates += tasks[:MAX_CALLERS] if isinstance(tasks, list) else []
            for step in candidates[:MAX_CALLERS]:
                if isinstance(step, Mapping) and isinstance(step.get("template"), str) and "templateRef" not in step:
                    self.calls.setdefault(step["template"], []).append((caller, step.get("arguments")))
            read += len(candidates)
            if read >= MAX_TEMPLATES * 16:
                break
        self._inputs: dict[str, dict[str, str]] = {}
        self._open: set[str] = set()

    def values(self, template: Mapping[str, Any]) -> dict[str, str]:
        """``workflow.parameters.*`` and the template's ``inputs.parameters.*`` that have one value."""
        name = template.get("name")
        inputs = self._resolve(name, template, 0) if isinstance(name, str) else self._own(template)
        return {**self.globals, **{f"inputs.parameters.{k}": v for k, v in inputs.items()}}

    def _own(self, template: Mapping[str, Any]) -> dict[str, str]:
        """The template's inputs from their own ``value``, else ``default``, globals substituted."""
        own: dict[str, str] = {}
        for param in _parameters(template.get("inputs")):
            text = _text(param.get("value"))
            text = _text(param.get("default")) if text is None else text
            if text is not None:
                own[param["name"]] = substitute(text, self.globals)
        return own

    def _resolve(self, name: str, template: Mapping[str, Any], depth: int) -> dict[str, str]:
        """The template's inputs as its callers pass them: one value where every call gives the same
        (an argument, else the input's own value); a call cycle or a chain past :data:`MAX_CALL_DEPTH`
        reads the inputs' own values."""
        if name in self._inputs:
            return self._inputs[name]
        own = self._own(template)
        calls = self.calls.get(name, [])
        if not calls or name in self._open or depth >= MAX_CALL_DEPTH:
            return own
        self._open.add(name)
        resolved: dict[str, str] = {}
        try:
            for param in _parameters(template.get("inputs")):
                seen: set[str | None] = set()
                for caller, arguments in calls[:MAX_CALLERS]:
                    given = next((p for p in _parameters(arguments) if p["name"] == param["name"]), None)
                    if given is None:
                        seen.add(own.get(param["name"]))
                        continue
                    text = _text(given.get("value"))  # valueFrom: known only when it runs
                    if text is None:
                        seen.add(None)
                        break
                    text = substitute(text, self.globals)
                    if caller is not None:
                        values = self._resolve(str(caller["name"]), caller, depth + 1)
                        text = substitute(text, {f"inputs.parameters.{k}": v for k, v in values.items()})
                    seen.add(text)
                    if len(seen) > 1:
                        break
                if len(seen) == 1 and (value := seen.pop()) is not None:
                    resolved[param["name"]] = value
        finally:
            self._open.discard(name)
        self._inputs[name] = resolved
        return resolved
