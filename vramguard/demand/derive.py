"""From a pod (or a workload's pod template) to what each GPU container will reserve per GPU."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vramguard import vendors
from vramguard.codecs import (
    CLASS_FINDINGS_ANNOTATION,
    ENFORCE_LABEL,
    PLACEMENT_ANNOTATION,
    QOS_CLASS_LABEL,
    VRAM_ANNOTATION,
    is_vramguard_key,
    vram_annotation,
)
from vramguard.demand.allowances import DEFAULT_TABLE, AllowanceTable
from vramguard.demand.annotations import declared_vram
from vramguard.demand.commandline import Budget, container_env
from vramguard.demand.foreign import FOREIGN_RESOURCES, KAI_CONTAINER, ForeignShare, foreign_share, kai_container
from vramguard.demand.model import ContainerDemand, EngineClaim, Parallel, PodDemand, Vram, claim_conflicts
from vramguard.demand.processes import engine_title, read_command
from vramguard.engines.base import Findings, parse_positive_int
from vramguard.quantity import MAX_QUANTITY_TEXT, QuantityError, excerpt, parse_quantity

__all__ = [
    "DEFAULT_OPTIONS",
    "GROUP_SIZE_ANNOTATION",
    "MAX_DEVICES",
    "DemandOptions",
    "derive_container_demand",
    "derive_pod_demand",
    "engine_title",
    "reads_annotation",
]

DEFAULT_GPU_RESOURCES = vendors.DEFAULT_GPU_RESOURCES
DEFAULT_GPU_RESOURCE_PREFIXES = vendors.DEFAULT_PARTITION_PREFIXES
UNKNOWN_ENGINE = f"no known engine and no {VRAM_ANNOTATION} annotation"
"""The start of the warning for a GPU container whose VRAM nothing says."""
GROUP_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
"""Set by LeaderWorkerSet on each pod of a group: the number of pods one engine spans."""

MAX_DEVICES = 1024
"""The most GPU devices one pod may hold, per container and in all: more than any node hands out
(8 GPUs x 128 time-slicing replicas; 8 x 16 is already rare, MIG gives at most 7 per GPU). Every
later step makes one claim per device, so this bounds what an absurd request costs."""


def reads_annotation(key: object) -> bool:
    """Whether demand reads the annotation ``key``: vramguard's own, and the LeaderWorkerSet group
    size (the pods a multi-node engine spans). Slimmed objects and template keys keep exactly these."""
    return is_vramguard_key(key) or key == GROUP_SIZE_ANNOTATION


@dataclass(frozen=True, slots=True)
class DemandOptions:
    """Which extended resources are GPUs (exact names, and prefixes such as ``nvidia.com/mig-``)."""

    gpu_resources: frozenset[str] = frozenset(DEFAULT_GPU_RESOURCES)
    gpu_resource_prefixes: tuple[str, ...] = DEFAULT_GPU_RESOURCE_PREFIXES
    allowances: AllowanceTable = DEFAULT_TABLE
    """The bytes of each allowance an engine's processes hold beside its share (the policy's)."""

    def is_gpu(self, resource: str) -> bool:
        """Whether ``resource`` names a GPU device (a whole GPU, a replica or a MIG instance)."""
        return resource in self.gpu_resources or resource.startswith(self.gpu_resource_prefixes)


DEFAULT_OPTIONS = DemandOptions()


def derive_pod_demand(
    pod: Mapping[str, Any],
    options: DemandOptions = DEFAULT_OPTIONS,
    group_size: int | None = None,
    files: Mapping[str, Mapping[str, str]] | None = None,
) -> PodDemand:
    """The GPU demand of a pod or pod template (a mapping with ``metadata`` and ``spec``).

    ``group_size`` is the number of pods one engine spans (a LeaderWorkerSet's ``size``), when the
    workload says; a pod of a LeaderWorkerSet says it itself in its ``size`` annotation.
    ``files``: by container name, the scripts it sees whose text is known (ConfigMap volumes of the
    same input, :mod:`vramguard.demand.config_maps`), so that a command running one is read.
    Never raises on malformed input: what cannot be read becomes an error or a warning.
    """
    metadata = pod.get("metadata")
    annotations = _string_map(metadata.get("annotations") if isinstance(metadata, dict) else None)
    if group_size is None:
        group_size = parse_positive_int(annotations.get(GROUP_SIZE_ANNOTATION, ""))
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return PodDemand()
    containers: list[ContainerDemand] = []
    # One budget for the whole pod: a pod of many containers costs no more than one of one container.
    budget = Budget(whose="its pod's")
    names = [str(c.get("name")) for key in ("containers",) for c in _items(spec.get(key))]
    kai_target = kai_container(annotations, names)
    for field_name, is_init_list in (("initContainers", True), ("containers", False)):
        entries = spec.get(field_name)
        if not isinstance(entries, list):
            continue
        for container in entries:
            if not isinstance(container, dict):
                continue
            # A sidecar (an init container that restarts) runs beside the app containers and
            # beside every init container after it.
            sidecar = is_init_list and container.get("restartPolicy") == "Always"
            init = is_init_list and not sidecar
            scripts = files.get(str(container.get("name"))) if files else None
            demand = derive_container_demand(
                container, annotations, init, options, group_size, budget, scripts,
                kai_target is not None and container.get("name") == kai_target,
            )
            if demand is not None:
                containers.append(replace(demand, sidecar=True) if sidecar else demand)
    errors = [e for c in containers for e in c.errors]
    warnings = [w for c in containers for w in c.warnings]
    warnings.extend(_misspellings(annotations, spec, options))
    return PodDemand(tuple(containers), tuple(errors), tuple(warnings))


OTHER_GPU_RESOURCES = {
    "nvidia.com/gpumem": "HAMi", "nvidia.com/gpumem-percentage": "HAMi", "nvidia.com/gpucores": "HAMi",
    "volcano.sh/vgpu-number": "Volcano", "volcano.sh/vgpu-memory": "Volcano", "volcano.sh/vgpu-cores": "Volcano",
    "aliyun.com/gpu-mem": "gpushare", "aliyun.com/gpu-count": "gpushare",
}
"""GPU resources of other sharing systems (their device plugins advertise them): a container asking
for one uses a GPU that vramguard's GPU resources do not name."""
COMPUTE_SHARES = frozenset({"nvidia.com/gpucores", "volcano.sh/vgpu-cores"})
"""Other systems' shares of a GPU's compute, which change nothing vramguard counts."""
GPU_ANNOTATIONS = {"gpu-fraction": "KAI scheduler", "gpu-memory": "KAI scheduler"}
"""Annotations another scheduler gives a GPU share with (KAI scheduler's fractions and memory)."""
# What a pod may carry under vramguard.io/ (the placement and findings are the Binding's).
POD_ANNOTATIONS = (VRAM_ANNOTATION, PLACEMENT_ANNOTATION, CLASS_FINDINGS_ANNOTATION)
MISSPELLING_CUTOFF = 0.85
"""``difflib`` ratio above which a name reads as a misspelling of one vramguard knows."""


def _misspellings(annotations: Mapping[str, str], spec: Mapping[str, Any], options: DemandOptions) -> list[str]:
    """Warnings for names that look meant for vramguard but are not what it reads: a misspelled
    ``vramguard.io/*`` annotation, a declaration naming no container, a resource name one letter
    off a GPU resource (the container then asks for no GPU, and no node offers that resource)."""
    found: list[str] = []
    pod_containers = [c for key in ("initContainers", "containers") for c in _items(spec.get(key))]
    for key in list(annotations)[:MAX_ANNOTATIONS_CHECKED]:
        if key == KAI_CONTAINER:
            names = {c["name"] for c in pod_containers if isinstance(c.get("name"), str)}
            if annotations[key] not in names:
                found.append(
                    f"annotation {key} names {excerpt(annotations[key])}, no container of the pod: "
                    "KAI scheduler refuses it, and its GPU share is not counted"
                )
            continue
        if "vram" not in key.lower() or key in POD_ANNOTATIONS:
            continue  # the cheap tests first: this runs for every pod the services see
        target, _, named = key.partition(VRAM_ANNOTATION + ".")
        if not target and named:
            names = {c["name"] for c in pod_containers if isinstance(c.get("name"), str)}
            if named not in names:
                found.append(
                    f"annotation {excerpt(key)} names no container of the pod "
                    f"({', '.join(sorted(names)[:8]) or 'none'}): nothing reads it"
                )
        elif key in (QOS_CLASS_LABEL, ENFORCE_LABEL):
            found.append(f"{key} is a label, not an annotation: nothing reads it as an annotation")
        else:
            close = difflib.get_close_matches(key, POD_ANNOTATIONS, n=1, cutoff=MISSPELLING_CUTOFF)
            if close or is_vramguard_key(key):
                hint = f"; did you mean {close[0]}?" if close else f" (it reads {VRAM_ANNOTATION}[.<container>])"
                found.append(f"annotation {excerpt(key)} is not one vramguard reads{hint}")
    gpu_names = sorted(options.gpu_resources)
    for container in pod_containers:
        resources = container.get("resources")
        resources = resources if isinstance(resources, Mapping) else {}
        asked = {name: options.is_gpu(name) for s in ("limits", "requests") for name in _items_keys(resources.get(s))}
        counted = any(asked.values())
        for resource, is_gpu in asked.items():
            if is_gpu:
                continue
            if resource in FOREIGN_RESOURCES or resource in COMPUTE_SHARES:
                continue  # read as a declaration (vramguard.demand.foreign), or a share of compute only
            if resource in OTHER_GPU_RESOURCES:
                system = OTHER_GPU_RESOURCES[resource]
                found.append(
                    f"container {excerpt(str(container.get('name')))}: {excerpt(resource)} is {system}'s, which "
                    "vramguard does not read: "
                    + ("its engine is counted on the whole GPU, not under the share it sets"
                       if counted else f"this GPU's memory is not checked (declare {VRAM_ANNOTATION})")
                )
                continue
            accelerator = next((name for prefix, name in vendors.OTHER_ACCELERATORS.items()
                                if resource.startswith(prefix)), None)
            vendor = vendors.vendor_of(resource)
            if accelerator is not None or vendor is not None:
                what = accelerator if accelerator is not None else f"{vendor.name if vendor else 'other'} GPU"
                found.append(
                    f"container {excerpt(str(container.get('name')))}: {excerpt(resource)} is an {what} resource that "
                    "the policy's gpu_resources do not name, so its memory is not checked"
                )
                continue
            if "gpu" not in resource.lower():
                continue
            close = difflib.get_close_matches(resource, gpu_names, n=1, cutoff=MISSPELLING_CUTOFF)
            if close:
                found.append(
                    f"container {excerpt(str(container.get('name')))}: resource {excerpt(resource)} is no GPU "
                    f"resource (no node offers it, and the pod waits); did you mean {close[0]}?"
                )
    return list(dict.fromkeys(found))


MAX_ANNOTATIONS_CHECKED = 256
"""Annotations looked at for misspellings; a pod with thousands is read no slower."""


def _items(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value[:MAX_DEVICES] if isinstance(item, Mapping)] if isinstance(value, list) else []


def _items_keys(value: Any) -> list[str]:
    return [key for key in list(value)[:64] if isinstance(key, str)] if isinstance(value, Mapping) else []


def derive_container_demand(
    container: Mapping[str, Any],
    annotations: Mapping[str, str],
    init: bool = False,
    options: DemandOptions = DEFAULT_OPTIONS,
    group_size: int | None = None,
    budget: Budget | None = None,
    files: Mapping[str, str] | None = None,
    kai_target: bool = False,
) -> ContainerDemand | None:
    """The demand of one container, or ``None`` when it asks for no GPU resource. Its command line
    is read within ``budget`` (shared by the pod's containers), or a budget of its own, with the
    scripts ``files`` holds by path. Another sharing system's declaration (:mod:`vramguard.demand.foreign`;
    ``kai_target``: the container KAI's pod annotations apply to) counts as one."""
    raw_name = container.get("name")
    name = raw_name if isinstance(raw_name, str) else "<unnamed>"
    found = Findings.for_container(name)
    requested = _gpu_request(container, options, found)
    # KAI refuses a fraction beside a GPU resource: its annotations apply to a container asking none.
    foreign = foreign_share(container, annotations, kai_target and requested is None)
    if requested is None and foreign is not None and foreign.gpus > 0:
        requested = (foreign.resource, foreign.gpus)
    if requested is None:
        return None
    resource, gpus = requested
    budget = budget if budget is not None else Budget()
    env = container_env(container, budget, files)
    raw_image = container.get("image")
    image = raw_image if isinstance(raw_image, str) else ""

    reading = read_command(container, env, image, gpus, found, options.allowances, budget)
    claim, mps = reading.claim, reading.mps
    if claim is not None and claim.parallel is not None:
        _check_parallel(claim, claim.parallel, resource, gpus, group_size, found)
    declared = declared_vram(annotations, name, found)
    if foreign is not None:
        declared, claim = _foreign(foreign, declared, claim, found)
    if env.opaque_sources and claim is None and declared is None:
        found.warn(
            f"envFrom ({', '.join(env.opaque_sources)}) may set engine variables vramguard cannot see"
        )
    engine = claim.engine if claim is not None else None
    vram = claim.vram if claim is not None else None
    # No reservation: no declaration, no MPS limit and no claim (see ContainerDemand.reservation).
    if declared is None and mps.limit_bytes is None and claim is None and not found.errors and not reading.refused:
        found.warn(
            f"{UNKNOWN_ENGINE}, so its VRAM is unknown; "
            f"declare it, e.g. {vram_annotation(name)}: 16Gi"
        )
    found.errors.extend(claim_conflicts(name, engine, vram, declared, mps.limit_bytes, None))
    # Built once, with its findings: a frozen dataclass of 15 fields is not cheap to copy.
    return ContainerDemand(
        name=name,
        resource=resource,
        gpus=gpus,
        init=init,
        engine=engine,
        claim=vram,
        declared=declared,
        mps_limit=mps.limit_bytes,
        sm_percent=mps.sm_percent,
        implicit_default=claim.implicit_default if claim is not None else False,
        default_warning=claim.default_warning if claim is not None else None,
        env_only=claim.env_only if claim is not None else False,
        engine_version=claim.version if claim is not None else None,
        layout=claim.parallel.layout if claim is not None and claim.parallel is not None else "",
        rules=claim.overheads.rules if claim is not None else (),
        evidence=tuple(dict.fromkeys(found.evidence)),
        warnings=tuple(dict.fromkeys(found.warnings)),
        errors=tuple(dict.fromkeys(found.errors)),
    )


def _foreign(
    share: ForeignShare, declared: Vram | None, claim: EngineClaim | None, found: Findings
) -> tuple[Vram | None, EngineClaim | None]:
    """Another system's share as the container's declaration (a ``vramguard.io/vram`` one wins), and
    the engine's claim as the engine sees the device under it: where the system makes its cap the
    device's total and enforces it, a fraction of the cap, with everything else the process holds
    (its allowances) inside the cap too."""
    if share.problem is not None:
        found.error(share.problem)
        return declared, claim
    if share.vram is None:
        return declared, claim
    if declared is None:
        declared = share.vram
        found.evidence.append(f"{share.system}: {share.evidence}")
    vram = claim.vram if claim is not None else None
    if share.virtual_total and claim is not None and vram is not None and vram.fraction is not None:
        cap = share.vram
        scaled = (
            Vram(vram.fraction * cap.fraction)
            if cap.fraction is not None
            else Vram(bytes=max(int(vram.fraction * (cap.bytes or 0)), 1))
        )
        found.evidence.append(
            f"{engine_title(claim.engine)} sees {share.system}'s cap as the device: {vram.plain().describe()} of "
            f"{cap.describe()} is {scaled.describe()}, and all it holds stays within the cap"
        )
        claim = replace(claim, vram=scaled)
    return declared, claim


def _check_parallel(
    claim: EngineClaim, parallel: Parallel, resource: str, gpus: int, group_size: int | None, found: Findings
) -> None:
    """Check the engine's parallel sizes against the GPUs the container asks for.

    An engine spread over several pods (``--nnodes``, a LeaderWorkerSet group) uses on each pod its
    total parallel size divided by the pods; a Ray executor may span pods the spec does not show,
    so a total that is a whole multiple of the container's GPUs is accepted with a warning.
    """
    title = engine_title(claim.engine)
    nodes = None if parallel.per_pod else parallel.nodes or group_size
    if nodes is not None and nodes > 1:
        source = parallel.nodes_flag or f"a group of {nodes} pods"
        if parallel.total % nodes == 0 and parallel.total // nodes == gpus:
            return
        if parallel.total % nodes:
            found.error(
                f"{title}: {parallel.describe()}, which {source} cannot split evenly over {nodes} pods"
            )
            return
        found.error(
            f"{title}: {parallel.describe()} over {source} = {parallel.total // nodes} per pod, "
            f"but the container requests {gpus} {resource}; make them equal"
        )
        return
    if parallel.total == gpus:
        return
    if parallel.ray and parallel.total > gpus and parallel.total % gpus == 0:
        found.warn(
            f"{title}: {parallel.describe()} through Ray, so vramguard assumes the engine spans "
            f"{parallel.total // gpus} pods of {gpus} {resource}"
        )
        return
    found.error(
        f"{title}: {parallel.describe()}, but the container requests {gpus} {resource}; make them equal"
    )


def _gpu_request(
    container: Mapping[str, Any], options: DemandOptions, found: Findings
) -> tuple[str, int] | None:
    """The GPU resource and device count a container asks for (limits, else requests)."""
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return None
    asked: dict[str, Any] = {}
    for section in ("requests", "limits"):  # limits last: they are what the device plugin honours
        values = resources.get(section)
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(key, str) and options.is_gpu(key):
                    asked[key] = value
    if not asked:
        return None
    if len(asked) > 1:
        found.error(f"asks for several GPU resources ({', '.join(sorted(asked))}); use one")
    resource, raw = next(iter(asked.items())) if len(asked) == 1 else sorted(asked.items())[0]
    count = _device_count(raw)
    if count is None:
        found.error(f"{resource}: {excerpt(repr(raw), quote=False)} is not a whole number of devices")
        return resource, 1
    if count == 0:
        return None
    if count > MAX_DEVICES:
        # No node offers that many; capping keeps every later step (one claim per device) bounded.
        shown = excerpt(str(raw), quote=False)
        found.error(f"{resource}: {shown} devices is more than any node offers (at most {MAX_DEVICES})")
        return resource, MAX_DEVICES
    return resource, count


def _device_count(raw: Any) -> int | None:
    """A quantity of devices as a whole number; ``None`` when it is not one (``0.5``, ``-1``, ``x``), and
    more than :data:`MAX_DEVICES` when it is too long to read."""
    if type(raw) is int:  # the common cases first: JSON numbers and plain digit strings
        return raw if raw >= 0 else None
    if type(raw) is str and raw.isascii() and raw.isdigit() and len(raw) <= MAX_QUANTITY_TEXT:
        return int(raw)
    try:
        value = parse_quantity(str(raw))
    except QuantityError as exc:
        return MAX_DEVICES + 1 if exc.reason == "huge" else None
    if value.denominator != 1 or value < 0:
        return None
    return int(value)


def _string_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
