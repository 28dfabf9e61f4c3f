"""Admission's DRA questions, answered from what the cluster model knows (pure).

For a pod (or a workload's pod template):

- **claims** (``spec.resourceClaims``): for each request a container uses (``resources.claims``),
  the memory the request consumes on each device its class and selectors could match must cover
  what the containers using it reserve there (:func:`vramguard.dra.sizing.check_request`). The
  claim comes from its ResourceClaimTemplate or its ResourceClaim, as the watches show them (or
  the API server, read by the webhook when the watch has not shown it). One that does not exist
  cannot be checked: for a pod whose containers reserve memory that is a refusal
  (:attr:`ClaimReview.missing`; the pod's controller retries, a person re-applies once the
  template exists), for a workload a note (its pods are checked when they are made).
- **a claim shared by pods** (``resourceClaimName``): every pod naming it runs its own engines on
  the claim's devices, so the request must cover the engines of all of them together: the live
  pods already naming it, and this pod (``replicas`` times for a workload's template).
- **the DRA extended-resource path**: a container asking an extended resource that a DeviceClass
  serves (``extendedResourceName``) gets a claim the scheduler writes without any capacity
  request, on nodes whose device plugin does not advertise the resource. On a shareable device it
  consumes the policy default: the whole GPU in ``memory`` mode, 0 in ``unlimited`` and share-count
  modes, where the engine's reservation is never accounted.

For a ResourceClaim or ResourceClaimTemplate created after the pods that use it
(:func:`review_claim_users`): checked against those pods as each pod is checked against it, the
engines of every pod naming a ResourceClaim together, each pod still waiting for its claim from
a ResourceClaimTemplate on its own. Otherwise a request that would consume no memory on a device
shared without memory accounting is worth a warning (:func:`review_claim_spec`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cachetools import LRUCache

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand import DemandOptions, PodDemand, derive_container_demand, derive_pod_demand
from vramguard.demand.derive import UNKNOWN_ENGINE, engine_title
from vramguard.demand.model import ContainerDemand
from vramguard.dra.claims import (
    MAX_RESERVED_FOR,
    ClaimAllocation,
    ClaimRequest,
    ClaimSpec,
    DeviceRequest,
    result_memory,
)
from vramguard.dra.classes import ANY_DEVICE, DeviceClassInfo, Selector, class_for_extended_resource
from vramguard.dra.devices import DraDevice
from vramguard.dra.fields import items, mapping, memory_text, text
from vramguard.dra.pods import (
    ClaimUse,
    PodClaimSource,
    container_claim_uses,
    extended_resource_claim,
    pod_claim_sources,
)
from vramguard.dra.sizing import Need, Shortfall, check_request, distinct_shapes, reserved_on
from vramguard.dra.state import DraState

ClaimLookup = Callable[[str, str], ClaimSpec | None]
"""``(namespace, name)`` -> the claim's requests, ``None`` when not known."""
PodsLookup = Callable[..., Sequence[Mapping[str, Any]]]
"""``(namespace, claim=..., template=...)`` -> the live pods naming that claim or template."""


def _no_pods(namespace: str, *, claim: str | None = None, template: str | None = None) -> Sequence[Mapping[str, Any]]:
    return ()


@dataclass(frozen=True, slots=True)
class DraContext:
    """What admission knows about DRA in the cluster (the webhook's watches, or ``plan``'s files)."""

    classes: Mapping[str, DeviceClassInfo] = field(default_factory=dict)
    devices: tuple[DraDevice, ...] = ()
    claim: ClaimLookup = lambda namespace, name: None
    template: ClaimLookup = lambda namespace, name: None
    plugin_nodes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Per extended resource, the nodes whose device plugin advertises it: DRA does not serve it there."""
    pods_naming: PodsLookup = _no_pods
    """The live pods naming a claim or template (shared claims add up their engines)."""
    _devices: dict[tuple[object, ...], tuple[DraDevice, ...]] = field(default_factory=dict, compare=False, repr=False)
    _extended: dict[str, DeviceClassInfo | None] = field(default_factory=dict, compare=False, repr=False)
    """Answers computed once per context (the cluster model builds a new one when DRA objects change)."""

    def candidates(self, device_class: DeviceClassInfo, selector: Selector = ANY_DEVICE) -> tuple[DraDevice, ...]:
        """The devices the class narrowed by ``selector`` could match, one per shape (cached)."""
        key = ("match", device_class, selector)
        if key not in self._devices:
            self._devices[key] = distinct_shapes(device_class.could_match(self.devices, selector))
        return self._devices[key]

    def dra_served(self, device_class: DeviceClassInfo, resource: str) -> tuple[DraDevice, ...]:
        """The devices of ``device_class`` where DRA serves ``resource``: on nodes whose device plugin
        does not advertise it (one per shape, cached)."""
        key = ("served", device_class, resource)
        if key not in self._devices:
            plugin = self.plugin_nodes.get(resource, frozenset())
            served = [d for d in device_class.could_match(self.devices) if d.node not in plugin]
            self._devices[key] = distinct_shapes(served)
        return self._devices[key]

    def extended_class(self, resource: str) -> DeviceClassInfo | None:
        """The class serving extended resource ``resource`` through DRA, if any (cached)."""
        if resource not in self._extended:
            self._extended[resource] = class_for_extended_resource(self.classes, resource)
        return self._extended[resource]


@dataclass(frozen=True, slots=True)
class RequestReport:
    """One claim request a pod's containers use, sized on the largest device it could get."""

    claim: str
    """The pod's name for the claim."""
    request: str
    memory: int | None
    """``capacity.requests.memory`` (the first alternative's), ``None`` when not set."""
    device: DraDevice | None
    """The largest device the request could get; ``None`` when no known device matches."""
    consumed: int | None
    """What the request consumes on that device."""
    needs: tuple[Need, ...]
    reserved: int | None
    """What the containers using it reserve on that device."""
    count: int = 1
    """Devices the request takes."""
    per_pod: bool = True
    """Made for this pod from a template (a named claim is shared, and counted once allocated)."""
    users: tuple[ContainerDemand, ...] = ()
    """Every container of the pod using the request, read as if it asked for its devices (an
    engine's claim, a declaration, or unknown VRAM)."""

    @property
    def quota_bytes(self) -> int:
        """What the request holds for the namespace's quota: on each of its devices the more of what
        it consumes and what its containers reserve (0 when no device is known)."""
        return max(self.consumed or 0, self.reserved or 0) * self.count


@dataclass(frozen=True, slots=True)
class ClaimReview:
    """What :func:`review_pod_claims` found."""

    shortfalls: tuple[Shortfall, ...] = ()
    """Claim requests that consume less than their containers reserve (violations)."""
    extended: tuple[Shortfall, ...] = ()
    """Extended resources on the DRA path that consume less than the containers reserve (violations)."""
    errors: tuple[str, ...] = ()
    """Demand errors of containers using claims (violations)."""
    notes: tuple[str, ...] = ()
    """What could not be checked, and the demand's warnings (notes)."""
    uses_claims: bool = False
    """Whether a container uses a claim of the pod."""
    requests: tuple[RequestReport, ...] = ()
    """Every request a container uses, with the claim's memory next to the containers' reservation."""
    missing: tuple[str, ...] = ()
    """Claims or templates that do not exist, used by containers that reserve memory (cannot be checked)."""

    @property
    def per_pod_bytes(self) -> int:
        """Memory the pod's own claims (made from templates) hold, for the namespace's quota."""
        return sum(r.quota_bytes for r in self.requests if r.per_pod)

    @property
    def found_anything(self) -> bool:
        """Whether there is anything to report, or GPU claims to count (for the namespace's quota)."""
        return bool(
            self.shortfalls
            or self.missing
            or self.extended
            or self.errors
            or self.notes
            or any(r.device is not None for r in self.requests)
        )


def review_pod_claims(
    pod: Mapping[str, Any], namespace: str, demand: PodDemand, context: DraContext, replicas: int = 1
) -> ClaimReview:
    """Check a pod's (or pod template's) claims and extended resources on the DRA path; ``replicas``:
    the pods a workload's template makes (they all share a claim it names)."""
    reading = _reading(pod)
    shortfalls: list[Shortfall] = []
    errors: list[str] = []
    notes: list[str] = []
    absent: list[str] = []
    reports: list[RequestReport] = []
    uses = container_claim_uses(pod)
    sources = {s.name: s for s in pod_claim_sources(pod)}
    work = 0
    for claim_name, source in sources.items():
        if work > MAX_CLAIM_USES:
            break
        spec = None
        if source.template_name:
            spec = context.template(namespace, source.template_name)
            missing = f"ResourceClaimTemplate {source.template_name}"
        elif source.claim_name:
            spec = context.claim(namespace, source.claim_name)
            missing = f"ResourceClaim {source.claim_name}"
        else:
            continue
        claim_uses = [u for u in uses if u.claim == claim_name]
        if spec is None:
            if claim_uses:
                probe = ClaimRequest(claim_name, (DeviceRequest(claim_name, ""),))
                needs = _needs(claim_uses, probe, reading, errors, notes)
                if needs:
                    absent.append(
                        f"claim {claim_name}: {missing} does not exist (or cannot be read), so the memory it gives "
                        f"{' and '.join(dict.fromkeys(n.who for n in needs))} cannot be checked; create it first "
                        "(a workload's controller retries its pods)"
                    )
                else:
                    notes.append(f"claim {claim_name}: {missing} is not known yet, so its memory is not checked")
            continue
        notes.extend(spec.notes)
        others = (
            [p for p in context.pods_naming(namespace, claim=source.claim_name) if _name(p) != _name(pod)]
            if source.claim_name
            else []
        )
        for request in spec.requests:
            if not any(may_select_gpus(context.classes.get(a.device_class)) for a in request.alternatives):
                continue  # another kind of device (a NIC): its users hold no GPU memory through it
            users = [u for u in claim_uses if u.request in (None, request.name)]
            work += len(users)
            if work > MAX_CLAIM_USES:
                errors.append(CLAIM_USES_REFUSAL)
                break
            read: list[ContainerDemand] = []
            needs = _needs(users, request, reading, errors, notes, read)
            if source.claim_name:
                needs = _shared(needs, replicas, others, source.claim_name, request)
            check = check_request(
                claim_name, request, needs, context.classes, context.devices, candidates=context.candidates
            )
            notes.extend(check.notes)
            if check.shortfall is not None:
                shortfalls.append(check.shortfall)
            if not users:
                continue
            alternative = request.alternatives[0]
            device = check.largest
            used = alternative.consumes_on(device) if device is not None else None
            reserved = reserved_on(needs, device) if device is not None else None
            reports.append(
                RequestReport(
                    claim_name,
                    request.name,
                    alternative.memory,
                    device,
                    used,
                    tuple(needs),
                    reserved,
                    alternative.count,
                    source.template_name is not None,
                    tuple(read),
                )
            )
    extended = _extended(demand, context, notes)
    return ClaimReview(
        tuple(shortfalls),
        tuple(extended),
        tuple(dict.fromkeys(errors)),
        tuple(dict.fromkeys(notes)),
        bool(uses and sources),
        tuple(reports),
        tuple(absent),
    )


def _shared(
    own: list[Need], replicas: int, others: Sequence[Mapping[str, Any]], claim: str, request: ClaimRequest
) -> list[Need]:
    """The needs on a claim several pods name: this pod's (times its workload's ``replicas``, up to
    the 256 pods a claim can be reserved for) and those of the other live pods naming it."""
    copies = min(max(replicas, 1), MAX_RESERVED_FOR)
    needs = [replace(n, who=f"{n.who} (in each of {copies} pods)", copies=copies) if copies > 1 else n for n in own]
    for other in others:
        needs.extend(
            replace(n, who=f"{n.who} of pod {_name(other)}") for n in pod_request_needs(other, claim, None, request)
        )
    return needs


def pod_request_needs(
    pod: Mapping[str, Any], claim: str, allocation: ClaimAllocation | None, request: ClaimRequest
) -> list[Need]:
    """What the containers of ``pod`` using ``request`` of the ResourceClaim object ``claim`` reserve
    on each of its devices (``allocation``: the claim's, which names the pod's claim when it was made
    from a template and the pod's status does not say so yet)."""
    reading = _reading(pod)
    sources = frozenset(
        s.name
        for s in reading.sources(pod)
        if s.allocated_claim == claim
        or (s.template_name and allocation is not None and allocation.pod_claim_name == s.name
            and _uid(pod) in {uid for _, uid in allocation.reserved_for})
    )
    return _source_needs(pod, sources, request, reading)


def _source_needs(
    pod: Mapping[str, Any], sources: frozenset[str], request: ClaimRequest, reading: _PodReading | None = None
) -> list[Need]:
    """The needs of the pod's containers that use ``request`` of the pod's claims named ``sources``
    (remembered with the pod's reading: the same list, not a copy, for the same sources and request)."""
    reading = reading if reading is not None else _reading(pod)
    key = (sources, request.name, max(a.count for a in request.alternatives), request.mps is not None)
    needs = reading.needs.get(key)
    if needs is None:
        uses = [u for u in reading.uses(pod) if u.claim in sources and u.request in (None, request.name)]
        needs = reading.needs[key] = _needs(uses, request, reading, [], [])
    return needs


def _name(pod: Mapping[str, Any]) -> str:
    return text(mapping(pod.get("metadata")).get("name")) or ""


def _uid(pod: Mapping[str, Any]) -> str:
    return text(mapping(pod.get("metadata")).get("uid")) or ""


def _annotations(pod: Mapping[str, Any]) -> dict[str, str]:
    return {
        k: v
        for k, v in mapping(mapping(pod.get("metadata")).get("annotations")).items()
        if isinstance(k, str) and isinstance(v, str)
    }


@dataclass(frozen=True, slots=True)
class _Container:
    spec: Mapping[str, Any]
    init: bool
    """A regular init container."""
    sidecar: bool
    position: int


def _containers(pod: Mapping[str, Any]) -> dict[str, _Container]:
    spec = mapping(pod.get("spec"))
    found: dict[str, _Container] = {}
    for field_name in ("initContainers", "containers"):
        for raw in items(spec.get(field_name)):
            container = mapping(raw)
            name = text(container.get("name"))
            if name and name not in found:
                restarts = field_name == "initContainers" and container.get("restartPolicy") == "Always"
                found[name] = _Container(container, field_name == "initContainers" and not restarts, restarts,
                                         len(found))
    return found


MAX_CLAIM_USES = 256
"""Containers' uses of claim requests one review or filter checks (each a sizing on every device the
request may get). Real pods have a few (8 containers each using 8 claims of 4 requests would be 256);
the API server allows a pod tens of thousands (32 claims of 32 requests each, used by every container),
which would hold the webhook, and the extender at each scheduling attempt, for seconds. Past the bound
the claims are not checked: the pod is refused where the namespace enforces, and placed nowhere."""


def claim_uses_over_bound(pod: Mapping[str, Any], requests: Callable[[str], int]) -> bool:
    """Whether the pod's containers use its claims' requests more than :data:`MAX_CLAIM_USES` times;
    ``requests``: the number of requests of the pod's claim of that name (0 when unknown)."""
    # As a review counts them: a use naming a request checks that one, a use of the whole claim every request.
    uses = _reading(pod).uses(pod)
    return sum(1 if use.request else requests(use.claim) or 1 for use in uses) > MAX_CLAIM_USES


CLAIM_USES_REFUSAL = (
    f"the pod's containers use its claims' requests more than the {MAX_CLAIM_USES} times vramguard "
    "checks: the memory of its claims cannot be checked; use fewer claims or requests per container"
)


@dataclass(slots=True)
class _PodReading:
    """A pod's containers and annotations, read once, and each container's demand as a claim's
    devices give it, derived once per container and device count (and MPS daemon): a pod naming many
    claims of many requests, each used by many containers, would otherwise derive the same container
    thousands of times (a 70 KB pod took 12 s of a review)."""

    containers: Mapping[str, _Container]
    annotations: Mapping[str, str]
    demands: dict[tuple[str, int, str | None], ContainerDemand | None] = field(default_factory=dict)
    needs: dict[tuple[frozenset[str], str, int, bool], list[Need]] = field(default_factory=dict)
    _sources: tuple[PodClaimSource, ...] | None = None
    _uses: tuple[ClaimUse, ...] | None = None

    def sources(self, pod: Mapping[str, Any]) -> tuple[PodClaimSource, ...]:
        """The pod's claims (:func:`pod_claim_sources`), read once."""
        if self._sources is None:
            self._sources = tuple(pod_claim_sources(pod))
        return self._sources

    def uses(self, pod: Mapping[str, Any]) -> tuple[ClaimUse, ...]:
        """Its containers' uses of them (:func:`container_claim_uses`), read once."""
        if self._uses is None:
            self._uses = tuple(container_claim_uses(pod))
        return self._uses


_READINGS: LRUCache[tuple[str, str], _PodReading] = LRUCache(maxsize=1024)
"""Readings of live pods, by UID and resourceVersion (which name one content of the pod): the other pods
of a shared claim, and those the tenancy and audit views read claim by claim."""


def _reading(pod: Mapping[str, Any]) -> _PodReading:
    metadata = mapping(pod.get("metadata"))
    uid, version = text(metadata.get("uid")), text(metadata.get("resourceVersion"))
    if not uid or not version:
        return _PodReading(_containers(pod), _annotations(pod))
    reading = _READINGS.get((uid, version))
    if reading is None:
        reading = _READINGS[(uid, version)] = _PodReading(_containers(pod), _annotations(pod))
    return reading


def _needs(
    users: Sequence[ClaimUse],
    request: ClaimRequest,
    reading: _PodReading,
    errors: list[str],
    notes: list[str],
    read: list[ContainerDemand] | None = None,
) -> list[Need]:
    """What each container using ``request`` reserves on each of its devices (``read``: gets every
    such container's demand, those of unknown VRAM included)."""
    count = max(a.count for a in request.alternatives)
    resource = f"devices of claim request {request.name}"
    needs: list[Need] = []
    for use in users:
        entry = reading.containers.get(use.container)
        if entry is None:
            continue
        key = (use.container, count, request.name if request.mps is not None else None)
        if key in reading.demands:
            demand = reading.demands[key]
            if demand is not None and demand.resource != resource:
                demand = replace(demand, resource=resource)
        else:
            demand = reading.demands[key] = _derive(entry, request, count, resource, reading.annotations)
        if demand is None:
            continue
        if read is not None:
            read.append(demand)
        errors.extend(demand.errors)
        notes.extend(demand.warnings)
        need = _need(demand, entry.init, entry.sidecar, entry.position)
        if need is not None:
            needs.append(need)
    return needs


ENFORCING_CLASSES: Mapping[str, str] = {
    "hami-core-gpu.project-hami.io": (
        "HAMi's DRA driver enforces in the container (HAMi-core's CUDA_DEVICE_MEMORY_LIMIT_<i> and "
        "libvgpu.so, Project-HAMi/k8s-dra-driver v0.1.0)"
    ),
}
"""DeviceClasses whose driver holds a container to its claim's ``capacity.requests.memory``: the memory
is an enforced limit, as an MPS pinned limit is. Other drivers (NVIDIA's ``gpu.nvidia.com``, whose
consumable capacity only allocates) enforce nothing: there the engine's own number counts."""


def may_select_gpus(info: DeviceClassInfo | None) -> bool:
    """Whether a claim of this DeviceClass may get a GPU: a class not known yet, one whose selectors name a
    GPU driver or cannot be read, or one of :data:`ENFORCING_CLASSES` (GPU slices of another driver)."""
    return info is None or info.selects_gpus() is not False or info.name in ENFORCING_CLASSES


def claims_may_get_gpus(pod: Mapping[str, Any], namespace: str, context: DraContext | None) -> bool:
    """Whether any of the pod's claims may get a GPU (:func:`may_select_gpus`); a claim or template not
    known yet counts, and every claim does where the DRA objects are not watched (``context`` ``None``)."""
    sources = pod_claim_sources(pod)
    if not sources or context is None:
        return bool(sources)
    for source in sources:
        spec: ClaimSpec | None = None
        if source.claim_name:
            spec = context.claim(namespace, source.claim_name)
        elif source.template_name:
            spec = context.template(namespace, source.template_name)
        if spec is None or any(
            may_select_gpus(context.classes.get(alternative.device_class))
            for request in spec.requests
            for alternative in request.alternatives
        ):
            return True
    return False


def _enforced(request: ClaimRequest) -> tuple[int, str] | None:
    """The memory a claim request's driver enforces per device, and which driver; ``None`` where not
    every alternative is of an enforcing class with a memory request."""
    found = [(a.memory, ENFORCING_CLASSES.get(a.device_class)) for a in request.alternatives]
    if not found or any(memory is None or why is None for memory, why in found):
        return None
    memory = max(m for m, _ in found if m is not None)
    return memory, next(why for _, why in found if why is not None)


def _derive(
    entry: _Container, request: ClaimRequest, count: int, resource: str, annotations: Mapping[str, str]
) -> ContainerDemand | None:
    """The engine's reading of the container, as if it asked for the request's devices as a resource:
    the same engines, declarations, MPS limits and parallel-size checks as for device-plugin GPUs."""
    probe = {**entry.spec, "resources": {"limits": {resource: count}}}
    if request.mps is not None:
        # The claim's MPS daemon limits every client, as the client variables would (the
        # container's own settings win).
        own = {e.get("name") for e in items(entry.spec.get("env")) if isinstance(e, Mapping)}
        given = [e for e in request.mps.env(count) if e["name"] not in own]
        probe["env"] = [*items(entry.spec.get("env")), *given]
    demand = derive_container_demand(probe, annotations, entry.init, DemandOptions(frozenset({resource}), ()))
    enforced = _enforced(request)
    if demand is not None and enforced is not None and demand.declared is None and demand.mps_limit is None:
        memory, why = enforced
        demand = replace(
            demand, mps_limit=memory,
            evidence=(*demand.evidence, f"claim request {request.name}: capacity.requests.memory "
                                        f"{memory_text(memory)}, which {why}"),
            warnings=tuple(w for w in demand.warnings if UNKNOWN_ENGINE not in w),
        )
    elif demand is not None and any(a.memory is not None for a in request.alternatives):
        demand = replace(demand, warnings=(*demand.warnings, (
            f"container {demand.name}: claim request {request.name} asks for capacity.requests.memory, which its "
            "driver allocates but does not enforce in the container: the container's own number counts"
        )))
    if demand is not None and request.mps is not None:
        source = f"the MPS daemon of claim request {request.name} (GpuConfig): "
        demand = replace(demand, evidence=tuple(
            source + e.removeprefix("env ") if e.startswith("env CUDA_MPS_") else e for e in demand.evidence))
    return demand


def _need(demand: ContainerDemand, init: bool, sidecar: bool, position: int) -> Need | None:
    """What the container reserves per device; a declaration never below the engine's own claim."""
    reservations = demand.reservations
    if not reservations:
        return None
    if demand.declared is not None:
        who = f"the {VRAM_ANNOTATION} declaration of container {demand.name}"
    elif demand.mps_limit is not None:
        who = f"the MPS limit of container {demand.name}"
    else:
        who = engine_title(demand.engine or "") or f"container {demand.name}"
    floor = reservations[1] if len(reservations) > 1 else None
    return Need(demand.name, who, reservations[0], init, floor=floor, sidecar=sidecar, position=position)


def _extended(demand: PodDemand, context: DraContext, notes: list[str]) -> list[Shortfall]:
    """Containers asking an extended resource that a DeviceClass serves through DRA."""
    found: list[Shortfall] = []
    for index, container in enumerate(demand.containers):
        device_class = context.extended_class(container.resource)
        if device_class is None or not device_class.selects_gpus():
            continue
        devices = context.dra_served(device_class, container.resource)
        need = _need(container, container.init, container.sidecar, index)
        if need is None or not devices:
            continue
        request = ClaimRequest(
            f"container-{index}-request-0",
            (DeviceRequest(f"container-{index}-request-0", device_class.name, count=container.gpus),),
        )
        check = check_request(
            f"container {container.name}",
            request,
            [need],
            {device_class.name: device_class},
            devices,
            container.resource,
        )
        notes.extend(check.notes)
        if check.shortfall is not None:
            found.append(check.shortfall)
    return found


def review_claim_spec(spec: ClaimSpec, context: DraContext, kind: str) -> tuple[str, ...]:
    """Warnings for a ResourceClaim or ResourceClaimTemplate on its own (no pod known yet): a request
    without ``capacity.requests.memory`` that consumes no memory on a shareable device its class
    could get, so whatever engine uses it is not accounted on that device."""
    warnings: list[str] = list(spec.notes)
    for request in spec.requests:
        for alternative in request.alternatives:
            device_class = context.classes.get(alternative.device_class)
            if device_class is None or alternative.memory is not None or alternative.admin_access:
                continue
            if not device_class.selects_gpus():
                continue
            free = [
                d
                for d in context.candidates(device_class, alternative.selector)
                if d.shareable and alternative.consumes_on(d) == 0
            ]
            if free:
                warnings.append(
                    f"{kind} {spec.name} request {alternative.name} consumes no memory on {free[0].sharing}-mode "
                    f"shared GPUs ({free[0].label}), so the memory its pods' engines take is not accounted; "
                    "set capacity.requests.memory"
                )
    return tuple(warnings)


def review_claim_users(spec: ClaimSpec, kind: str, context: DraContext) -> tuple[Shortfall, ...]:
    """A ResourceClaim or ResourceClaimTemplate checked against the live pods that already name it,
    as each of them is checked against it at admission: a ResourceClaim against the engines of all
    its pods together (they share it), a ResourceClaimTemplate against each pod whose claim the
    resourceclaim controller has not made yet (those made before keep their old requests)."""
    if kind == "ResourceClaim":
        groups = [(pod, frozenset(s.name for s in pod_claim_sources(pod) if s.claim_name == spec.name))
                  for pod in context.pods_naming(spec.namespace, claim=spec.name)]
        users = [groups] if groups else []
    else:
        users = [
            [(pod, names)]
            for pod in context.pods_naming(spec.namespace, template=spec.name)
            if (names := frozenset(s.name for s in pod_claim_sources(pod)
                                   if s.template_name == spec.name and s.generated_name is None))
        ]
    found: dict[str, Shortfall] = {}
    for group in users:
        for request in spec.requests:
            needs = [
                replace(n, who=f"{n.who} of pod {_name(pod)}")
                for pod, names in group
                for n in _source_needs(pod, names, request)
            ]
            check = check_request(
                spec.name, request, needs, context.classes, context.devices, candidates=context.candidates
            )
            if check.shortfall is not None:
                found.setdefault(check.shortfall.message(), check.shortfall)
    return tuple(found.values())


@dataclass(frozen=True, slots=True)
class AllocatedShortfall:
    """An allocated claim whose pods' containers reserve more on its device than it consumes there."""

    namespace: str
    claim: str
    node: str
    device: DraDevice
    consumed: int
    needs: tuple[Need, ...]
    pods: tuple[str, ...]

    @property
    def reserved(self) -> int:
        """What the containers reserve on the device."""
        return reserved_on(self.needs, self.device)

    def message(self) -> str:
        """``claim ns/c consumes 8Gi of gpu-0 (...) on node-a but vLLM will reserve 0.90 x 80Gi = 72Gi``."""
        reserve = " and ".join(f"{n.who} will reserve {n.arithmetic(self.device)}" for n in self.needs)
        return (
            f"claim {self.namespace}/{self.claim} consumes {memory_text(self.consumed)} of {self.device.label} "
            f"on node {self.node or '?'} but {reserve}"
        )


def audit_allocations(state: DraState, pods: Iterable[Mapping[str, Any]]) -> list[AllocatedShortfall]:
    """Allocated claims whose pods' containers (pods in ``status.reservedFor``, among ``pods``)
    reserve more memory on the allocated device than the claim consumes there."""
    by_name = {
        (text(mapping(p.get("metadata")).get("namespace")) or "", text(mapping(p.get("metadata")).get("name")) or ""): p
        for p in pods
    }
    devices = state.inventory().by_key()
    found: list[AllocatedShortfall] = []
    for allocation in state.allocations():
        users = [
            by_name[(allocation.namespace, name)]
            for name, _ in allocation.reserved_for
            if (allocation.namespace, name) in by_name
        ]
        for result in allocation.results:
            device = devices.get(result.key)
            if device is None:
                continue
            request = result.request.split("/", 1)[0]
            needs: list[Need] = []
            for pod in users:
                needs.extend(allocated_needs(pod, allocation, request))
            if not needs:
                continue
            consumed = result_memory(result, device)
            if reserved_on(needs, device) > consumed:
                found.append(
                    AllocatedShortfall(
                        allocation.namespace,
                        allocation.name,
                        device.node,
                        device,
                        consumed,
                        tuple(needs),
                        tuple(name for name, _ in allocation.reserved_for),
                    )
                )
    return found


def allocated_needs(pod: Mapping[str, Any], allocation: ClaimAllocation, request: str) -> list[Need]:
    """The needs of the pod's containers that use ``request`` of the allocated claim (what they reserve
    on each device allocated to that request)."""
    if allocation.extended_resource:
        status = extended_resource_claim(pod)
        if status is None or status.claim_name != allocation.name:
            return []
        names = {container for container, _, mapped in status.requests if mapped == request}
        demand = derive_pod_demand(pod, DemandOptions(frozenset({r for _, r, _ in status.requests}), ()))
        return [
            n for position, c in enumerate(demand.containers) if c.name in names
            for n in [_need(c, c.init, c.sidecar, position)] if n is not None
        ]
    count_request = ClaimRequest(request, (DeviceRequest(request, "", count=1),))
    return pod_request_needs(pod, allocation.name, allocation, count_request)
