"""Workload kinds beyond the built-in ones: where their pod templates lie and how many pods each runs.

Serving and training projects run their pods through their own custom resources (LeaderWorkerSet,
KubeRay's RayCluster, KServe's InferenceService, JobSet, Kubeflow's training jobs). The policy's
``workload_kinds`` names each such kind with the paths of its pod templates and the fields whose
product is the number of pods each template runs, the way Kyverno and Gatekeeper let a platform
team describe its pod controllers; a new or in-house CRD needs an entry, not a release.

**Paths** are dotted field names. ``*`` stands for every element of a list or every value of a
mapping (Ray's ``workerGroupSpecs``, JobSet's ``replicatedJobs``, a training job's replica specs).
A path may list alternatives with ``|``: the first that is present is used (a LeaderWorkerSet's
leader runs its ``workerTemplate`` when it has no ``leaderTemplate``).

**Replicas** are a product of factors. A factor is a path, optionally ``- N`` (``size - 1``: the
workers of a LeaderWorkerSet group besides its leader); a path starting with ``@.`` is read in the
element ``*`` matched. An absent or unreadable factor counts as 1 (the projects' default), so a
kind of a newer version with other fields never breaks anything: its pods are still checked.

**Forms.** A path leads to a pod template (``metadata`` + ``spec``), a bare pod spec (KServe's
``predictor``) or a single container (KServe's ``predictor.model``); the last two take the
object's labels and annotations, which the project copies onto the pods.

**Group size.** ``group_size`` is the field giving the pods one engine spans (a LeaderWorkerSet's
``size``); a template's ``engine_from`` names the template whose engine command applies to
containers that start none themselves (the workers of a group often only join the leader's Ray
cluster).

**Pod spec patches.** ``pod_spec_patch`` names text fields holding strategic merge patches (YAML or
JSON) that the project lays over the pod spec it generates from a template, after substituting its own
parameters (Argo's ``podSpecPatch``): they are read as :mod:`vramguard.pod_spec_patch` describes, and
what cannot be read is said, never dropped silently.

**Pods assembled from parts.** A ``container`` form's ``pod_spec`` is the pod spec its container runs in,
the container laid over the one of its name there (OME's ``runner`` in its component's pod spec);
``sidecars`` and ``init_containers`` name lists of containers the pod runs beside the template's, or before
them (Argo's ``sidecars`` and ``initContainers``); ``script`` names a container field holding a script the
container runs as a file (Argo's ``script.source``); ``parameters`` fills the project's ``{{...}}``
parameters in the containers' commands first (Argo's).

**Nothing unread is silent.** Every field of an object of a described kind that asks for a GPU
(:func:`gpu_request_paths`) and that none of the kind's templates reads is named in a warning
(:func:`unread_paths`): a new field of the project, a form the entry does not describe.

**Runtimes.** ``runtime`` names the runtime an object completes (OME's InferenceService over the
ServingRuntime or ClusterServingRuntime it names): where that runtime is among the input's objects, each
field of the object listed in ``merge`` is read laid over the runtime's, as the project merges them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vramguard.demand import DemandOptions, PodDemand, derive_pod_demand
from vramguard.demand.config_maps import ConfigMaps, config_maps, with_config_maps
from vramguard.demand.derive import GPU_ANNOTATIONS, UNKNOWN_ENGINE
from vramguard.demand.objects import pod_template
from vramguard.operators import OPERATOR_RESOURCES, operator_parts, operator_versions
from vramguard.operators.common import MAX_REPLICAS, count
from vramguard.operators.ray_serve import with_serve_config
from vramguard.pod_spec_patch import (
    ArgoParameters,
    accelerators_named,
    fill_containers,
    is_accelerator,
    merge_pod_spec,
    read_patch,
)
from vramguard.quantity import excerpt
from vramguard.template_part import TemplatePart, with_group_size

__all__ = [
    "Inputs",
    "PodSpecPatch",
    "RuntimeRef",
    "ServedKind",
    "TemplateSpec",
    "WorkloadKind",
    "api_group",
    "find_kind",
    "gpu_request_paths",
    "kinds_to_list",
    "merge_runtime",
    "object_parts",
    "parts_demand",
    "read_inputs",
    "reads_kind",
    "serving_runtimes",
    "template_parts",
    "unread_paths",
    "unread_warning",
    "with_runtime",
    "workload_parts",
]

_PATH = re.compile(r"^@?(?:\.?[A-Za-z_][\w-]*|\.?\*)(?:\.(?:[A-Za-z_][\w-]*|\*))*$")
_FACTOR = re.compile(r"^\s*(?P<path>[^\s-][^\s]*)\s*(?:-\s*(?P<minus>\d{1,3}))?\s*$")
MAX_PODS = MAX_REPLICAS
"""More pods than any workload runs: a bound that keeps lying replica fields from costing memory."""
MAX_PARTS = 64
"""Templates read from one object at most (``*`` over a huge list is an attack, not a workload)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_path(text: str) -> str:
    for alternative in text.split("|"):
        if not _PATH.match(alternative.strip()):
            raise ValueError(f"{text!r} is not a dotted path (names, '*', '@.' for the matched element)")
    return text


class PodSpecPatch(_Strict):
    """Strategic merge patches written as text (YAML or JSON) that the project lays over the pod spec it
    generates from a template, in order (Argo's ``podSpecPatch``: the workflow's, then the template's)."""

    paths: tuple[str, ...] = Field(min_length=1, max_length=4)
    """Where each patch's text lies (``@.`` in the element the template's ``*`` matched)."""
    parameters: Literal["argo"] | None = None
    """How ``{{...}}`` parameters in the text are filled before it is read. ``argo``: ``workflow.parameters``
    from the workflow's ``arguments``, a template's ``inputs.parameters`` from what its steps and DAG tasks
    pass, else the input's ``value`` or ``default`` (a parameter without one value stays unfilled)."""
    workflow: str | None = None
    """The workflow spec those parameters come from (``spec``; a CronWorkflow's ``spec.workflowSpec``)."""

    @field_validator("paths")
    @classmethod
    def _paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            _check_one(path, "a patch path")
        return value

    @field_validator("workflow")
    @classmethod
    def _workflow(cls, value: str | None) -> str | None:
        return _check_plain(value) if value is not None else None


class ScriptFile(_Strict):
    """A script a container carries as text and runs as a file (Argo's ``script``: the executor writes its
    ``source`` to ``/argo/staging/script`` and adds that path to the container's arguments, ``executeScript``,
    ``workflow/controller/operator.go``)."""

    field: str = Field(min_length=1, max_length=63)
    """The container's field holding the script (``source``)."""
    path: str = Field(pattern=r"^/[^\s]{0,254}$")
    """The file it is written to, added as the container's last argument when the script is not empty."""


class Parameters(_Strict):
    """The ``{{...}}`` parameters the project fills in a template's containers before it makes the pod."""

    style: Literal["argo"]
    """``argo``: as for a pod spec patch (:attr:`PodSpecPatch.parameters`); in commands, arguments, the
    script and ``env`` values a tag with no single value in the object reads as unknown
    (:func:`vramguard.pod_spec_patch.fill_containers`)."""
    workflow: str = "spec"
    """The workflow spec the parameters come from (``spec``; a CronWorkflow's ``spec.workflowSpec``)."""

    @field_validator("workflow")
    @classmethod
    def _workflow(cls, value: str) -> str:
        return _check_plain(value)


class TemplateSpec(_Strict):
    """One pod template inside a workload kind."""

    name: str = Field(min_length=1, max_length=63)
    path: str
    """Where the template lies; ``a|b``: the first present."""
    form: Literal["template", "pod-spec", "container"] = "template"
    container_name: str = "main"
    """The name a ``container`` form gets (KServe names it ``kserve-container``)."""
    default_image: str | None = None
    """The image a ``container`` form without one runs (the project's runtime for it)."""
    default_image_formats: tuple[str, ...] = ()
    """The ``modelFormat.name`` values ``default_image`` serves (empty: any)."""
    replicas: tuple[str, ...] = ()
    """Factors whose product is the number of pods of this template (``spec.replicas``, ``size - 1``)."""
    engine_from: str | None = None
    """The template whose engine command also applies to this one's GPU containers without one."""
    group_size: str | None = None
    """The pods one engine of this template spans, where it is the template's own (``@.size`` of a
    RoleBasedGroup role's leader-worker pattern); else the kind's :attr:`WorkloadKind.group_size`."""
    pod_spec_patch: PodSpecPatch | None = None
    """Patches laid over this template's pod spec, read from the object (Argo's ``podSpecPatch``)."""
    pod_spec: str | None = None
    """The pod spec a ``container`` form's container runs in (``@.`` in the element): its containers and init
    containers join the pod, and the container is laid over the one of its name there by strategic merge, its
    ``args`` after that one's (OME's component pod spec and ``runner``: ``ReconcilePodSpec``,
    ``MergeRuntimeContainers``)."""
    sidecars: tuple[str, ...] = Field(default=(), max_length=4)
    """Lists of containers the pod runs beside the template's (Argo's ``@.sidecars``)."""
    init_containers: tuple[str, ...] = Field(default=(), max_length=4)
    """Lists of init containers the pod runs before them (Argo's ``@.initContainers``)."""
    script: ScriptFile | None = None
    """A script the ``container`` form runs as a file, read as any script the container runs."""
    parameters: Parameters | None = None
    """The project's ``{{...}}`` parameters, filled in the containers' commands before they are read."""
    note: str | None = Field(default=None, min_length=1, max_length=600)
    """What the reading assumes of this template, said with each object that has it (where its path is
    present): a pod count or GPUs the project computes from fields not read here."""

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _check_path(value)

    @field_validator("pod_spec")
    @classmethod
    def _pod_spec(cls, value: str | None) -> str | None:
        return _check_one(value) if value is not None else None

    @field_validator("sidecars", "init_containers")
    @classmethod
    def _lists(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            _check_one(path)
        return value

    @field_validator("group_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        return _check_path(value) if value is not None else None

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for factor in value:
            match = _FACTOR.match(factor)
            if match is None:
                raise ValueError(f"{factor!r} is not a replica factor (a path, optionally '- N')")
            _check_path(match["path"])
        return value


def _check_one(text: str, what: str = "the path") -> str:
    """A path to one field: names and ``@.``, no ``*``."""
    if "*" in text:
        raise ValueError(f"{text!r}: {what} names one field (no '*')")
    return _check_path(text)


def _check_plain(text: str) -> str:
    if not all(part and part != "*" and not part.startswith("@") for part in text.split(".")) or "|" in text:
        raise ValueError(f"{text!r} is not a plain dotted path")
    return _check_path(text)


class RuntimeRef(_Strict):
    """The runtime whose parts an object completes, and how (OME's ``MergeEngineSpec``: the object's
    fields over the runtime's, by strategic merge)."""

    name: str
    """Where the object names the runtime (``spec.runtime.name``)."""
    kinds: tuple[str, ...] = Field(min_length=1)
    """The runtime's kinds, in the object's API group, in the order the project looks them up."""
    merge: dict[str, str] = Field(min_length=1, max_length=8)
    """Each field of the object -> the runtime's field it is laid over (``spec.engine: spec.engineConfig``).
    A field the object does not set is not run at all, as the project runs no component the object omits."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_plain(value)

    @field_validator("merge")
    @classmethod
    def _merge(cls, value: dict[str, str]) -> dict[str, str]:
        for mine, theirs in value.items():
            _check_plain(mine)
            _check_plain(theirs)
        return value


class WorkloadKind(_Strict):
    """A custom resource that runs pods: its API group, versions, plural and pod templates."""

    group: str = Field(min_length=1)
    kind: str = Field(min_length=1)
    resource: str = Field(min_length=1)
    """The plural name, for the webhook's rules and RBAC."""
    versions: tuple[str, ...] = Field(min_length=1)
    templates: tuple[TemplateSpec, ...] = Field(min_length=1)
    group_size: str | None = None
    """The field giving the pods one engine spans (LeaderWorkerSet's ``spec.leaderWorkerTemplate.size``)."""
    namespaced: bool = True
    """Cluster-scoped kinds (ClusterServingRuntime) are read by the CLI but not sent to the webhook: the
    webhook reviews the namespaced objects that use them, not the runtime itself when it is applied."""
    runtime: RuntimeRef | None = None
    """The runtime an object of this kind names and completes, read merged where it is in the input."""
    note: str | None = Field(default=None, min_length=1, max_length=600)
    """What the reading assumes for every object of the kind, said with each (``explain``'s warnings,
    ``plan``'s notes): a pod count the object does not bound (Knative's autoscaling), a fan-out known only
    at run time (Argo), an engine that comes from a configuration not in the input (KServe's
    LLMInferenceServiceConfig)."""

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: str | None) -> str | None:
        return _check_path(value) if value is not None else None


Named = Mapping[tuple[str, str, str], Mapping[str, Any]]
"""Objects by ``(API group, kind, name)``."""


@dataclass(frozen=True, slots=True)
class Inputs:
    """What other objects of the same input tell about a workload: KServe's serving runtimes (see
    :func:`serving_runtimes`), ConfigMaps (:mod:`vramguard.demand.config_maps`), and every runtime kind's
    objects by name (for a kind's :class:`RuntimeRef`)."""

    runtimes: Mapping[str, Mapping[str, Any]]
    config_maps: ConfigMaps
    named: Named = field(default_factory=dict)


NO_INPUTS = Inputs({}, {})


def read_inputs(objects: Sequence[Mapping[str, Any]]) -> Inputs:
    """The serving runtimes, ConfigMaps and runtime objects among ``objects``."""
    named = {
        (api_group(obj), str(obj.get("kind")), str(_mapping(obj.get("metadata")).get("name"))): obj
        for obj in objects
        if obj.get("kind") in RUNTIME_KINDS
    }
    return Inputs(serving_runtimes(objects), config_maps(objects), named)


def api_group(obj: Mapping[str, Any]) -> str:
    """The API group of an object from its ``apiVersion`` (``""`` for the core group)."""
    version = obj.get("apiVersion")
    return version.rsplit("/", 1)[0] if isinstance(version, str) and "/" in version else ""


def find_kind(
    kinds: Sequence[WorkloadKind], kind: str, group: str | None = None
) -> WorkloadKind | None:
    """The table's entry for ``kind`` (and ``group`` when known), else ``None``."""
    for entry in kinds:
        if entry.kind == kind and (group is None or entry.group == group):
            return entry
    return None


def template_parts(
    obj: Mapping[str, Any],
    entry: WorkloadKind,
    runtimes: Mapping[str, Mapping[str, Any]] | None = None,
    notes: list[str] | None = None,
) -> list[TemplatePart]:
    """Every pod template of ``obj`` described by ``entry``, with its pods at full scale.

    ``runtimes`` maps a serving runtime's name (and ``format:<model format>`` for the runtime
    chosen by format) to its container: a ``container`` form naming one in its ``runtime`` field,
    or of a format one supports, is merged into it, as KServe merges a model into its runtime.
    A template's pod spec, sidecars and init containers join its pod, its parameters are filled, its script
    is a file its container runs, and its pod spec patches are laid over it (:class:`TemplateSpec`); what of
    the patches cannot be read goes to ``notes``, naming the template, with the template's ``note``.
    Never raises on malformed input: what cannot be read is left out.
    """
    return _read_templates(obj, entry, runtimes or {}, notes)[0]


def _read_templates(
    obj: Mapping[str, Any],
    entry: WorkloadKind,
    runtimes: Mapping[str, Mapping[str, Any]],
    notes: list[str] | None,
) -> tuple[list[TemplatePart], list[str]]:
    """:func:`template_parts`, and the fields of ``obj`` they read (dotted, ``[i]`` for list elements, as
    :func:`gpu_request_paths` writes them): a field below one of them is read."""
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    inherited = {key: metadata[key] for key in ("labels", "annotations") if isinstance(metadata.get(key), Mapping)}
    group_size = _positive(_first(obj, entry.group_size, None)) if entry.group_size else None
    parts: list[TemplatePart] = []
    read: list[str] = []
    for spec in entry.templates:
        parameters: ArgoParameters | None = None
        for match in _resolve(obj, spec.path):
            if len(parts) >= MAX_PARTS:
                return parts, read
            if spec.note is not None and notes is not None and spec.note not in notes:
                notes.append(spec.note)
            template, fields = _as_template(obj, match, spec, inherited, runtimes)
            if template is None:
                continue
            read.extend(fields)
            if spec.form != "template":
                read.append("metadata")  # the object's labels and annotations, which the project copies
            name = spec.name if match.label is None else f"{spec.name}[{match.label}]"
            element = match.element
            patch = spec.pod_spec_patch
            texts = [] if patch is None else [
                (path, where) for path in patch.paths
                if (where := _locate(obj, path, match)) is not None and isinstance(where[0], str)
            ]
            style = spec.parameters.style if spec.parameters is not None else patch.parameters if patch else None
            values: Mapping[str, str] = {}
            if style == "argo" and (spec.parameters is not None or texts):
                if parameters is None:
                    workflow = spec.parameters.workflow if spec.parameters is not None else None
                    workflow = workflow or (patch.workflow if patch is not None else None) or "spec"
                    parameters = ArgoParameters(_mapping(_first(obj, workflow, None)))
                values = parameters.values(_mapping(element))
            if spec.parameters is not None:
                script_field = spec.script.field if spec.script is not None else None
                pod = _mapping(template.get("spec"))
                filled = fill_containers(pod, values, script_field)
                template = template if filled is pod else {**template, "spec": filled}
            files: dict[str, dict[str, str]] | None = None
            if spec.script is not None:
                template, files = _script_files(template, spec.script)
            if patch is not None and texts:
                read.extend(where[1] for _, where in texts)
                template = _patched(obj, element, template, patch, values, name, notes)
            pods = 1
            for factor in spec.replicas:
                pods = min(pods * _factor(obj, element, factor), MAX_PODS)
            size = _positive(_first(obj, spec.group_size, element)) if spec.group_size else group_size
            if size is not None:
                template = with_group_size(template, size)
            parts.append(TemplatePart(name, template, pods, size, spec.engine_from, files or None))
    return parts, read


def _script_files(
    template: Mapping[str, Any], script: ScriptFile
) -> tuple[Mapping[str, Any], dict[str, dict[str, str]] | None]:
    """``template`` whose containers carrying a script run it from its file, and those files by container."""
    spec = _mapping(template.get("spec"))
    containers = spec.get("containers")
    if not isinstance(containers, list):
        return template, None
    files: dict[str, dict[str, str]] = {}
    rewritten: list[Any] = []
    for container in containers:
        text = container.get(script.field) if isinstance(container, Mapping) else None
        if not isinstance(container, Mapping) or not isinstance(text, str):
            rewritten.append(container)
            continue
        kept = {k: v for k, v in container.items() if k != script.field}
        if text:  # an empty script adds no argument (executeScript)
            kept["args"] = [*_list(container.get("args")), script.path]
            files[str(container.get("name"))] = {script.path: text}
        rewritten.append(kept)
    if not files and rewritten == containers:
        return template, None
    return {**template, "spec": {**spec, "containers": rewritten}}, files or None


def _patched(
    obj: Mapping[str, Any],
    element: Any,
    template: Mapping[str, Any],
    patch: PodSpecPatch,
    values: Mapping[str, str],
    name: str,
    notes: list[str] | None,
) -> Mapping[str, Any]:
    """``template`` with each patch text of ``patch`` read and laid over its pod spec, in order."""
    spec = _mapping(template.get("spec"))
    for path in patch.paths:
        text = _first(obj, path, element)
        if not isinstance(text, str) or not text.strip():
            continue
        where = f"{name}: {'its ' + path[2:] if path.startswith('@.') else path}"
        read, warnings = read_patch(text, values, where)
        if notes is not None:
            notes.extend(w for w in warnings if w not in notes)
        if read is not None:
            spec = merge_pod_spec(spec, read)
    return template if spec is template.get("spec") else {**template, "spec": spec}


GPU_FIELDS = frozenset({"resourceClaims", "draResources", "deviceClassName", "resourceClaimTemplateName"})
"""Fields that ask for devices through DRA, in pods and in operators' specs (NIM's ``draResources``)."""
GPU_PROFILE_FIELDS = frozenset({"resourceProfile", "gpuProfile", "accelerator", "acceleratorType"})
"""Fields operators size GPUs with (KubeAI's ``resourceProfile: nvidia-gpu-a100:8``): a GPU when the
value names one."""
PATCH_FIELDS = frozenset({"podSpecPatch"})
"""Fields holding a pod spec patch as text (Argo's): a GPU when the text names a GPU resource."""


def gpu_request_paths(
    value: Any,
    is_gpu: Callable[[str], bool],
    path: str = "",
    depth: int = 0,
    found: list[str] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> list[str]:
    """Where an object asks for a GPU in any form vramguard knows (``spec.x.resources.limits``):
    a GPU resource, another sharing system's resource or annotation, a ``gpu`` limit (NVIDIA
    Dynamo), a DRA field, a GPU profile. Used to warn about objects of kinds nobody described, and about
    the fields of described kinds that no template reads (``skip``: the fields read, not searched):
    they may run GPU pods vramguard cannot see.
    """
    found = [] if found is None else found
    if depth > 32 or len(found) >= 8:
        return found
    if isinstance(value, Mapping):
        for key, child in value.items():
            here = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str) or (skip is not None and skip(here)):
                continue
            if (key in ("limits", "requests") and isinstance(child, Mapping) and any(
                isinstance(name, str) and is_accelerator(name, is_gpu) for name in child
            )) or key in GPU_ANNOTATIONS or (key in GPU_FIELDS and child):
                found.append(here)
            elif key in GPU_PROFILE_FIELDS and isinstance(child, str) and "gpu" in child.lower():
                found.append(f"{here} ({excerpt(child)})")
            elif key in PATCH_FIELDS and isinstance(child, str) and (named := accelerators_named(child, is_gpu)):
                found.append(f"{here} ({', '.join(named)})")
            else:
                gpu_request_paths(child, is_gpu, here, depth + 1, found, skip)
    elif isinstance(value, list):
        for index, child in enumerate(value[:256]):
            here = f"{path}[{index}]"
            if skip is None or not skip(here):
                gpu_request_paths(child, is_gpu, here, depth + 1, found, skip)
    return found


def _any_gpu(name: str) -> bool:
    """A resource that may be a GPU, whatever the policy names (``example.com/gpu``): for the warnings only."""
    return "gpu" in name.lower()


def unread_paths(obj: Mapping[str, Any], read: Sequence[str], is_gpu: Callable[[str], bool] = _any_gpu) -> list[str]:
    """Where ``obj`` asks for a GPU (:func:`gpu_request_paths`) outside the fields ``read`` (and their
    own fields): what a described kind's templates leave unread."""
    exact = set(read)

    def covered(here: str) -> bool:
        return here in exact or any(here[:i] in exact for i, c in enumerate(here) if c in ".[")

    return gpu_request_paths(obj, lambda name: is_accelerator(name, is_gpu), skip=covered)


def _unread_note(obj: Mapping[str, Any], paths: Sequence[str]) -> str:
    metadata = _mapping(obj.get("metadata"))
    name = metadata.get("name") or metadata.get("generateName")
    return (
        f"{obj.get('kind')} ({api_group(obj) or 'core'}){f' {name}' if isinstance(name, str) else ''} asks for a "
        f"GPU at {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}, which its workload_kinds entry does "
        "not read: the containers there are not checked here; add a template (or its sidecars or "
        "init_containers) for that path to the entry"
    )


# -- reading paths ---------------------------------------------------------------------------------


class _Match(NamedTuple):
    """Where a template path led: the label and element ``*`` matched (and that element's path), and the
    node reached (and its path)."""

    label: str | None
    element: Any
    element_path: str
    node: Any
    path: str


def _resolve(obj: Mapping[str, Any], path: str) -> Iterator[_Match]:
    """Each match of the first alternative present in ``obj``."""
    for alternative in path.split("|"):
        matches = list(_walk(obj, alternative.strip().split("."), _Match(None, None, "", obj, "")))
        if matches:
            yield from matches
            return


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _walk(node: Any, keys: list[str], at: _Match) -> Iterator[_Match]:
    if not keys:
        if node is not None:
            yield at._replace(node=node)
        return
    key, rest = keys[0], keys[1:]
    if key == "*":
        if isinstance(node, list):
            for index, child in enumerate(node[:MAX_PARTS]):
                where = f"{at.path}[{index}]"
                yield from _walk(child, rest, _Match(_element_label(child, str(index)), child, where, child, where))
        elif isinstance(node, Mapping):
            for name, child in list(node.items())[:MAX_PARTS]:
                where = _join(at.path, str(name))
                yield from _walk(child, rest, _Match(str(name), child, where, child, where))
        return
    if isinstance(node, Mapping):
        yield from _walk(node.get(key), rest, at._replace(path=_join(at.path, key)))


def _locate(obj: Mapping[str, Any], path: str, at: _Match) -> tuple[Any, str] | None:
    """The value at the first alternative of ``path`` present (``@.``: in the element ``at`` matched), with
    its path in ``obj``."""
    for written in path.split("|"):
        alternative = written.strip()
        relative = alternative.startswith("@.")
        node: Any = at.element if relative else obj
        where = at.element_path if relative else ""
        for key in (alternative[2:] if relative else alternative).split("."):
            node = node.get(key) if isinstance(node, Mapping) else None
            where = _join(where, key)
        if node is not None:
            return node, where
    return None


def _element_label(child: Any, index: str) -> str:
    if isinstance(child, Mapping):
        for key in ("groupName", "name"):
            if isinstance(child.get(key), str):
                return str(child[key])
    return index


def _first(obj: Mapping[str, Any], path: str | None, element: Any) -> Any:
    """The value at the first alternative of ``path`` present (``@.``: in ``element``)."""
    if path is None:
        return None
    for written in path.split("|"):
        alternative = written.strip()
        node: Any = element if alternative.startswith("@.") else obj
        keys = alternative[2:].split(".") if alternative.startswith("@.") else alternative.split(".")
        for key in keys:
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is not None:
            return node
    return None


def _factor(obj: Mapping[str, Any], element: Any, factor: str) -> int:
    match = _FACTOR.match(factor)
    assert match is not None  # validated with the policy
    value = count(_first(obj, match["path"], element))
    value = 1 if value is None else value
    return max(value - int(match["minus"] or 0), 0)


def _positive(value: Any) -> int | None:
    found = count(value)
    return found if found else None


POD_SPEC_READ = ("containers", "initContainers", "ephemeralContainers", "resourceClaims")
"""The fields of a ``pod-spec`` form that ask for devices, all read; its other fields (KServe's
``workerSpec``) are not part of that pod."""


def _as_template(
    obj: Mapping[str, Any],
    match: _Match,
    spec: TemplateSpec,
    inherited: Mapping[str, Any],
    runtimes: Mapping[str, Mapping[str, Any]],
) -> tuple[Mapping[str, Any] | None, list[str]]:
    """The pod template ``match`` leads to in ``spec``'s form, with its pod spec, sidecars and init containers,
    and the fields of ``obj`` it reads; ``None`` where there is none."""
    node = match.node
    if not isinstance(node, Mapping):
        return None, []
    if spec.form == "template":
        template: Mapping[str, Any] = node
        read = [match.path]
    elif spec.form == "pod-spec":
        if not any(isinstance(node.get(key), list) for key in ("containers", "initContainers")):
            return None, []  # e.g. a KServe predictor given as a model, read by its own entry
        template = {"metadata": dict(inherited), "spec": node}
        read = [f"{match.path}.{key}" for key in POD_SPEC_READ]
    else:
        container = _container(node, spec, runtimes)
        read = [match.path]
        around = _locate(obj, spec.pod_spec, match) if spec.pod_spec is not None else None
        if around is not None and isinstance(around[0], Mapping):
            pod = _with_container(around[0], container)
            read.extend(f"{around[1]}.{key}" for key in POD_SPEC_READ)
        else:
            pod = {"containers": [container]}
        template = {"metadata": dict(inherited), "spec": pod}
    pod = _mapping(template.get("spec"))
    added: dict[str, list[Any]] = {}
    for key, paths in (("containers", spec.sidecars), ("initContainers", spec.init_containers)):
        for path in paths:
            found = _locate(obj, path, match)
            if found is not None and isinstance(found[0], list):
                added[key] = [*added.get(key, _list(pod.get(key))), *(c for c in found[0] if isinstance(c, Mapping))]
                read.append(found[1])
    if added:
        template = {**template, "spec": {**pod, **added}}
    return template, read


def _with_container(pod: Mapping[str, Any], runner: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod spec ``pod`` with ``runner`` laid over its container of the same name, else added (OME's
    ``resolveContainer`` and ``MergeRuntimeContainers``: strategic merge, the container's ``args`` first)."""
    name = runner.get("name")
    containers = _list(pod.get("containers"))
    base = next((c for c in containers if isinstance(c, Mapping) and c.get("name") == name), None)
    if base is None:
        return {**pod, "containers": [*containers, runner]}
    merged = merge_pod_spec({"containers": [base]}, {"containers": [runner]})["containers"][0]
    merged = {**merged, "args": [*_list(base.get("args")), *_list(runner.get("args"))]}
    return {**pod, "containers": [merged if c is base else c for c in containers]}


def _container(
    node: Mapping[str, Any], spec: TemplateSpec, runtimes: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """A ``container`` form's container, merged into its serving runtime's where one is known."""
    container = dict(node)
    runtime = runtimes.get(container["runtime"]) if isinstance(container.get("runtime"), str) else None
    model_format = container.get("modelFormat")
    if runtime is None and isinstance(model_format, Mapping) and isinstance(model_format.get("name"), str):
        runtime = runtimes.get(f"format:{model_format['name']}")
    if runtime is not None:
        container = merge_runtime(runtime, container)
    elif not isinstance(container.get("image"), str) and spec.default_image is not None:
        format_name = model_format.get("name") if isinstance(model_format, Mapping) else None
        if not spec.default_image_formats or format_name in spec.default_image_formats:
            container["image"] = spec.default_image
    container.setdefault("name", spec.container_name)
    return container


def merge_runtime(runtime: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """A model's container merged into its serving runtime's, as KServe does.

    The runtime gives the image and command; the model's ``args`` follow the runtime's, its ``env``
    entries replace the runtime's of the same name, and its ``resources`` replace the runtime's.
    """
    merged = dict(runtime)
    merged["args"] = [*_list(runtime.get("args")), *_list(model.get("args"))]
    env = {e.get("name"): e for e in _list(runtime.get("env")) if isinstance(e, Mapping)}
    env.update({e.get("name"): e for e in _list(model.get("env")) if isinstance(e, Mapping)})
    merged["env"] = list(env.values())
    for key in ("resources", "image"):
        if model.get(key) is not None:
            merged[key] = model[key]
    return merged


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def with_runtime(obj: Mapping[str, Any], entry: WorkloadKind, named: Named) -> Mapping[str, Any]:
    """``obj`` with each field its kind's :class:`RuntimeRef` lists laid over the named runtime's, where
    that runtime is among ``named`` (found by kind in the ref's order and by name: a file given to
    ``explain`` holds one namespace's runtimes); else ``obj`` as it is."""
    ref = entry.runtime
    name = _first(obj, ref.name, None) if ref is not None else None
    if ref is None or not isinstance(name, str):
        return obj
    runtime = next((named[key] for kind in ref.kinds if (key := (entry.group, kind, name)) in named), None)
    if runtime is None:
        return obj
    merged: Mapping[str, Any] = obj
    for mine, theirs in ref.merge.items():
        own, base = _first(obj, mine, None), _first(runtime, theirs, None)
        if isinstance(own, Mapping) and isinstance(base, Mapping):
            merged = _set(merged, mine.split("."), merge_pod_spec(base, own))
    return merged


def _set(obj: Mapping[str, Any], keys: Sequence[str], value: Any) -> dict[str, Any]:
    """A copy of ``obj`` with ``value`` at ``keys`` (the mappings on the way copied, not changed)."""
    head, rest = keys[0], keys[1:]
    return {**obj, head: _set(_mapping(obj.get(head)), rest, value) if rest else value}




def parts_demand(parts: Sequence[TemplatePart], options: DemandOptions) -> list[PodDemand]:
    """The demand of each part's pods, in order, engines shared within the group.

    A GPU container that starts no engine and declares nothing, in a template whose ``engine_from``
    names another, takes that template's engine claim: a LeaderWorkerSet's workers only join the
    Ray cluster or the distributed run the leader's command starts, with the same flags.
    """
    demands = [derive_pod_demand(part.template, options, files=part.files) for part in parts]
    by_name = {part.name: demand for part, demand in reversed(list(zip(parts, demands, strict=True)))}
    for index, part in enumerate(parts):
        # The same element's template first (a role's entry for that role's workers: worker[405b] takes
        # entry[405b]), then the one of that name.
        label = part.name[part.name.index("["):] if "[" in part.name else ""
        source = (by_name.get(part.engine_from + label) or by_name.get(part.engine_from)
                  if part.engine_from is not None else None)
        engines = [c for c in source.containers if c.engine is not None] if source is not None else []
        if not engines:
            continue
        leader = engines[0]
        containers = tuple(
            replace(
                c,
                engine=leader.engine,
                claim=leader.claim,
                implicit_default=leader.implicit_default,
                evidence=(*c.evidence, f"engine of the {part.engine_from} template: {', '.join(leader.evidence)}"),
                warnings=tuple(w for w in c.warnings if UNKNOWN_ENGINE not in w),
            )
            if c.engine is None and c.declared is None and c.mps_limit is None
            else c
            for c in demands[index].containers
        )
        demands[index] = PodDemand(
            containers,
            demands[index].errors,
            tuple(w for c in containers for w in c.warnings),
        )
    return demands


RUNTIME_KINDS = frozenset({"ServingRuntime", "ClusterServingRuntime"})
RUNTIME_CONTAINER = "kserve-container"


def serving_runtimes(objects: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The model-serving container of each KServe runtime among ``objects``, for :func:`template_parts`.

    Keyed by the runtime's name, and by ``format:<name>`` for each model format it auto-selects.
    """
    runtimes: dict[str, Mapping[str, Any]] = {}
    for obj in objects:
        if obj.get("kind") not in RUNTIME_KINDS:
            continue
        spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
        assert isinstance(spec, Mapping)
        containers = [c for c in _list(spec.get("containers")) if isinstance(c, Mapping)]
        chosen = next((c for c in containers if c.get("name") == RUNTIME_CONTAINER), None)
        if chosen is None and containers:
            chosen = containers[0]
        metadata = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
        assert isinstance(metadata, Mapping)
        if chosen is None or not isinstance(metadata.get("name"), str):
            continue
        runtimes[metadata["name"]] = chosen
        for model_format in _list(spec.get("supportedModelFormats")):
            if (
                isinstance(model_format, Mapping)
                and isinstance(model_format.get("name"), str)
                and model_format.get("autoSelect", False) is True
            ):
                runtimes.setdefault(f"format:{model_format['name']}", chosen)
    return runtimes


def object_parts(
    obj: Mapping[str, Any],
    kinds: Sequence[WorkloadKind],
    builtin_pods: Callable[[str, Mapping[str, Any]], int] | None = None,
    inputs: Inputs = NO_INPUTS,
    kind: str | None = None,
    notes: list[str] | None = None,
) -> list[TemplatePart] | None:
    """The pod templates of any object vramguard reads; ``None`` for a kind it does not read.

    Pods and the built-in workloads come from :func:`vramguard.demand.objects.pod_template`, with
    ``builtin_pods(kind, obj)`` pods (default 1); other kinds from the ``kinds`` table, else from
    the serving operators' readers (:mod:`vramguard.operators`), whose assumptions go to ``notes``.
    Each template gets what the ConfigMaps of ``inputs`` give its containers.
    """
    kind = kind if kind is not None else obj.get("kind") if isinstance(obj.get("kind"), str) else None
    if kind is None:
        return None
    template = pod_template(obj, kind)
    if template is not None:
        pods = builtin_pods(kind, obj) if builtin_pods is not None else 1
        parts = [TemplatePart(kind.lower(), template, pods)]
    else:
        has_version = isinstance(obj.get("apiVersion"), str)
        entry = find_kind(kinds, kind, api_group(obj) if has_version else None)
        if entry is not None:
            parts, read = _read_templates(with_runtime(obj, entry, inputs.named), entry, inputs.runtimes, notes)
            if entry.note is not None and notes is not None:
                notes.append(entry.note)
            if notes is not None and (unread := unread_paths(obj, read)):
                notes.append(_unread_note(obj, unread))
            if kind == "RayService" and entry.group == "ray.io":
                parts = with_serve_config(obj, parts, [] if notes is None else notes)
        else:
            found = operator_parts(obj, api_group(obj), kind, inputs.config_maps, [] if notes is None else notes)
            if found is None:
                return None
            parts = found
    if not inputs.config_maps:
        return parts
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    namespace = metadata.get("namespace") if isinstance(metadata.get("namespace"), str) else None
    return [_with_config_maps(part, namespace or "default", inputs.config_maps) for part in parts]


def _with_config_maps(part: TemplatePart, namespace: str, maps: ConfigMaps) -> TemplatePart:
    template, files = with_config_maps(part.template, namespace, maps)
    if template is part.template and not files:
        return part
    own = part.files or {}
    merged = {name: {**files.get(name, {}), **own.get(name, {})} for name in {*files, *own}}
    return replace(part, template=template, files=merged)


@dataclass(frozen=True, slots=True)
class ServedKind:
    """A kind whose objects are listed from the cluster: its group, name, plural and versions."""

    group: str
    kind: str
    resource: str
    versions: tuple[str, ...]


def kinds_to_list(kinds: Sequence[WorkloadKind]) -> list[ServedKind]:
    """The namespaced kinds of the ``kinds`` table, then the serving operators' kinds it does not
    describe (:mod:`vramguard.operators`): every kind of object vramguard reads pods from."""
    listed = [ServedKind(k.group, k.kind, k.resource, k.versions) for k in kinds if k.namespaced]
    described = {(k.group, k.kind) for k in kinds}
    listed += [ServedKind(group, kind, resource, versions) for group, kind, resource, versions in OPERATOR_RESOURCES
               if (group, kind) not in described]
    return listed


def workload_parts(
    obj: Mapping[str, Any] | None, kinds: Sequence[WorkloadKind], kind: str
) -> list[TemplatePart]:
    """The templates of a custom workload under review (the webhook names its kind): from the
    ``kinds`` table, else from a serving operator's reader; else ``[]``."""
    if obj is None:
        return []
    has_version = isinstance(obj.get("apiVersion"), str)
    entry = find_kind(kinds, kind, api_group(obj) if has_version else None)
    if entry is not None:
        return template_parts(obj, entry)
    return operator_parts(obj, api_group(obj), kind, {}, []) or []


def reads_kind(kinds: Sequence[WorkloadKind], kind: str, group: str | None) -> bool:
    """Whether vramguard reads objects of ``kind`` (in ``group``): the table's, or an operator's."""
    return find_kind(kinds, kind, group) is not None or (group is not None and bool(operator_versions(group, kind)))


def unread_warning(obj: Mapping[str, Any], is_gpu: Callable[[str], bool]) -> str | None:
    """A warning for an object of a kind vramguard does not read that asks for a GPU somewhere."""
    paths = gpu_request_paths(obj, is_gpu)
    if not paths:
        return None
    kind = obj.get("kind")
    group = api_group(obj) or "core"
    return (
        f"{kind} ({group}) is a kind vramguard does not read, yet it asks for a GPU at "
        f"{', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}: its pods are not checked here; "
        "describe it under workload_kinds in the policy (pod template paths and replica fields)"
    )
