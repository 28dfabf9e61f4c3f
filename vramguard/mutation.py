"""Mutating admission: what vramguard changes in a GPU pod as it is created (pure).

Three changes, each a JSON Patch the webhook's ``/mutate`` returns:

- **Routing.** A pod that asks for a GPU (a GPU resource of the policy, or a DRA claim whose class
  selects GPUs) and names no scheduler, or ``default-scheduler``, gets ``spec.schedulerName`` set to
  the policy's routing scheduler (``routing.scheduler``, else the first of ``schedulers`` that is not
  ``default-scheduler``), so workloads are guarded without being edited. Nothing is routed where
  ``default-scheduler`` itself calls the extender (it is among ``schedulers``), for a pod that
  names another scheduler (the validating webhook judges it by the namespace's mode), or for one
  created with ``spec.nodeName`` (no scheduler places it).

- **Enforced memory limits**, for classes with ``enforce_memory_limits``. Each GPU container gets
  its derived reservation per GPU (share and allowances) written as nvidia-container-toolkit's
  ``NVIDIA_GPU_MEMORY_REQUEST`` and ``NVIDIA_GPU_MEMORY_LIMIT`` (the ``apply-cuda-memory-limits``
  CDI hook, NVIDIA/nvidia-container-toolkit PR #2075: whole MiB as a plain decimal integer, request
  the soft and limit the hard limit, applied to each GPU of the container through NVML
  ``SetMemoryLimits_v1``; it needs CUDA 13.4's NVML, cgroup v2 and the hook in the node's CDI
  specs, and anywhere else the variables are inert). Where the class allows only MPS, also
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=<MiB>M,1=<MiB>M,...``, one entry per GPU).

  A value is written only when it is one number on every GPU the pod could get: a reservation in
  bytes, or a fraction where every device offered under the resource has the same memory. NVML
  refuses a limit above the device's memory, and the hook then fails the container, so a value is
  never larger than the smallest device offered. Never over a value the user set: a container that
  names any of the variables in ``env``, or takes variables from ``envFrom`` (whose contents the
  webhook does not read, and which ``env`` would override), is left as it is, with a note.

- **A scheduling gate**, ``vramguard.io/vram``, for GPU pods of the classes ``scale_up`` names,
  placed by a scheduler that calls the extender, except a DaemonSet's (its node is chosen for it):
  an autoscaler ignores the pod until the extender has decided whether an existing node can hold it
  (:mod:`vramguard.scale_up`); with the autoscaler's do-not-disrupt annotation too, where the policy
  protects them from scale-down.

A namespace labelled ``vramguard.io/routing: disabled`` gets none: its pods stay as written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vramguard.demand.model import ContainerDemand, PodDemand
from vramguard.demand.mps import MEM_LIMIT
from vramguard.dra.review import DraContext, claims_may_get_gpus
from vramguard.ledger import ResourceOffer
from vramguard.policy import ClassChoice, Policy
from vramguard.scale_up import add_gate_patch, protect_patch

__all__ = [
    "DEFAULT_SCHEDULER",
    "LIMIT_ENV",
    "REQUEST_ENV",
    "ROUTING_LABEL",
    "Injection",
    "Mutation",
    "plan_limits",
    "plan_mutation",
    "routing_scheduler",
]

DEFAULT_SCHEDULER = "default-scheduler"
ROUTING_LABEL = "vramguard.io/routing"
"""Namespace label: ``disabled`` keeps the namespace's pods on the scheduler they name."""
ROUTING_DISABLED = "disabled"
REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Injection:
    """One environment variable written into one container."""

    container: str
    name: str
    value: str


@dataclass(frozen=True, slots=True)
class Mutation:
    """What ``/mutate`` answers for one pod."""

    patch: tuple[dict[str, Any], ...] = ()
    routed_to: str | None = None
    injections: tuple[Injection, ...] = ()
    notes: tuple[str, ...] = ()
    """Why something was not done (returned as warnings)."""


def routing_scheduler(policy: Policy) -> str | None:
    """The scheduler GPU pods naming none are routed to; ``None`` when routing is off or pods naming
    none are guarded already (``default-scheduler`` calls the extender)."""
    if not policy.routing.enabled or DEFAULT_SCHEDULER in policy.schedulers:
        return None
    return policy.routing.scheduler or policy.schedulers[0]


def routes_namespace(labels: Mapping[str, str] | None) -> bool:
    """Whether the namespace's pods are routed (its label does not opt out)."""
    return (labels or {}).get(ROUTING_LABEL) != ROUTING_DISABLED


def plan_mutation(
    policy: Policy,
    pod: Mapping[str, Any],
    namespace: str,
    namespace_labels: Mapping[str, str] | None,
    demand: PodDemand,
    choice: ClassChoice,
    offers: Mapping[str, ResourceOffer],
    dra: DraContext | None = None,
) -> Mutation:
    """The patch for ``pod`` (see the module docstring)."""
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    if not routes_namespace(namespace_labels):
        return Mutation()
    patch: list[dict[str, Any]] = []
    notes: list[str] = []
    routed_to = None
    target = routing_scheduler(policy)
    named = spec.get("schedulerName")
    unnamed = named in (None, "", DEFAULT_SCHEDULER)
    wants_gpu = demand.wants_gpu or claims_may_get_gpus(pod, namespace, dra)
    if (
        target is not None
        and wants_gpu
        and unnamed
        and not spec.get("nodeName")
    ):
        patch.append({"op": "add", "path": "/spec/schedulerName", "value": target})
        routed_to = target
    scheduler = routed_to or (DEFAULT_SCHEDULER if unnamed else named)
    if (
        demand.wants_gpu
        and policy.scale_up.gates(choice.name)
        and scheduler in policy.schedulers
        and not spec.get("nodeName")
        and not _daemon_pod(pod)
    ):
        patch.extend(add_gate_patch(spec))
        if policy.scale_up.protect_from_scale_down:
            metadata = pod.get("metadata")
            patch.extend(protect_patch(metadata if isinstance(metadata, Mapping) else {}, policy.scale_up.autoscaler))
    injections: list[Injection] = []
    if choice.qos.enforce_memory_limits and demand.wants_gpu:
        injections, limit_notes = plan_limits(demand, offers, mps=tuple(choice.qos.sharing) == ("mps",))
        notes.extend(limit_notes)
        operations, injections, env_notes = _env_patch(spec, injections)
        patch.extend(operations)
        notes.extend(env_notes)
    return Mutation(tuple(patch), routed_to, tuple(injections), tuple(notes))


def _daemon_pod(pod: Mapping[str, Any]) -> bool:
    """A DaemonSet's pod: bound to its node by its controller, so no new node could take it."""
    metadata = pod.get("metadata")
    owners = metadata.get("ownerReferences") if isinstance(metadata, Mapping) else None
    return any(isinstance(o, Mapping) and o.get("kind") == "DaemonSet" and o.get("controller") is True
               for o in (owners if isinstance(owners, list) else ()))


def plan_limits(
    demand: PodDemand, offers: Mapping[str, ResourceOffer], *, mps: bool
) -> tuple[list[Injection], list[str]]:
    """The variables each GPU container gets, and why a container gets none."""
    injections: list[Injection] = []
    notes: list[str] = []
    for container in demand.containers:
        if container.gpus <= 0:
            continue
        per_gpu, why = _per_gpu_bytes(container, offers.get(container.resource))
        if per_gpu is None:
            notes.append(f"container {container.name}: GPU memory limit not written: {why}")
            continue
        mib = -(-per_gpu // MiB)
        injections.append(Injection(container.name, REQUEST_ENV, str(mib)))
        injections.append(Injection(container.name, LIMIT_ENV, str(mib)))
        if mps and container.mps_limit is None:
            entries = ",".join(f"{index}={mib}M" for index in range(container.gpus))
            injections.append(Injection(container.name, MEM_LIMIT, entries))
    return injections, notes


def _per_gpu_bytes(container: ContainerDemand, offer: ResourceOffer | None) -> tuple[int | None, str]:
    if not container.reservations:
        return None, "its VRAM is unknown (declare it with vramguard.io/vram)"
    if offer is None or not offer.sized:
        return None, f"no node offers {container.resource} with a known memory size yet"
    smallest = container.held_on(offer.smallest_bytes)
    largest = container.held_on(offer.largest_bytes)
    if smallest is None or largest is None:
        return None, "its VRAM is unknown (declare it with vramguard.io/vram)"
    if smallest != largest:
        return None, (
            f"its reservation depends on the GPU ({smallest // MiB}Mi to {largest // MiB}Mi on the "
            f"{container.resource} devices offered), and a limit is one number"
        )
    if smallest > offer.smallest_bytes:
        return None, f"its reservation ({smallest // MiB}Mi) is above the smallest GPU offered"
    return smallest, ""


WRITTEN = (REQUEST_ENV, LIMIT_ENV, MEM_LIMIT)


def _env_patch(
    spec: Mapping[str, Any], injections: Sequence[Injection]
) -> tuple[list[dict[str, Any]], list[Injection], list[str]]:
    """JSON Patch operations adding ``injections`` to the containers' ``env``, the injections
    written, and why a container was left as it is (see the module docstring)."""
    wanted: dict[str, list[Injection]] = {}
    for injection in injections:
        wanted.setdefault(injection.container, []).append(injection)
    operations: list[dict[str, Any]] = []
    written: list[Injection] = []
    notes: list[str] = []
    for field_name in ("initContainers", "containers"):
        containers = spec.get(field_name)
        if not isinstance(containers, list):
            continue
        for index, container in enumerate(containers):
            name = container.get("name") if isinstance(container, Mapping) else None
            if not isinstance(name, str) or name not in wanted:
                continue
            group = wanted.pop(name)
            env = container.get("env")
            own = sorted({
                str(e.get("name")) for e in (env if isinstance(env, list) else ())
                if isinstance(e, Mapping) and e.get("name") in WRITTEN
            })
            if own:
                notes.append(f"container {name}: {', '.join(own)} set by the pod; GPU memory limits left as they are")
                continue
            if container.get("envFrom"):
                notes.append(
                    f"container {name}: GPU memory limits not written: envFrom may set them, and env would override it"
                )
                continue
            values = [{"name": i.name, "value": i.value} for i in group]
            path = f"/spec/{field_name}/{index}/env"
            if isinstance(env, list):
                operations.extend({"op": "add", "path": path + "/-", "value": value} for value in values)
            else:
                operations.append({"op": "add", "path": path, "value": values})
            written.extend(group)
    return operations, written, notes

