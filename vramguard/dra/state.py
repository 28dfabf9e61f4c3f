"""The DRA part of the cluster model: ResourceSlices, DeviceClasses, ResourceClaims,
ResourceClaimTemplates and the pods that use claims, fed by watch events, kept as parsed records
(never whole objects).

Each kind has a store with ``replace`` (a full list), ``upsert`` and ``delete``, as the informers
call them. What is derived (the inventory of complete pools, the memory claims consume per device)
is computed on demand and cached until the next change, so a burst of claim events costs one
recomputation. Touched from one event loop only, like :class:`vramguard.cluster.ClusterState`.

**Pods with claims** (:func:`claim_pod`): the live pods naming a claim or holding a claim the
scheduler made for their extended resources, slimmed to what their engines' reservations are
derived from. Admission sums the engines of every pod sharing a claim; placement adds up the
engines of the pods on a device. **Holds**: what a claim pod takes on each device from the moment
the extender binds it until the claims' watch shows it (see :meth:`DraState.hold`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vramguard.demand.derive import reads_annotation
from vramguard.dra.claims import (
    ClaimAllocation,
    ClaimSpec,
    DeviceUsage,
    device_usage,
    read_allocation,
    read_claim,
    read_claim_template,
    result_memory,
)
from vramguard.dra.classes import DeviceClassInfo, Selector, parse_expression, read_device_class
from vramguard.dra.devices import (
    DEFAULT_DRIVERS,
    NVIDIA_GPU_DRIVER,
    DraDevice,
    DraInventory,
    RequestPolicy,
    read_resource_slices,
)
from vramguard.dra.fields import items, mapping, object_name, text
from vramguard.dra.pods import pod_claim_sources
from vramguard.dra.sizing import distinct_shapes
from vramguard.quantity import MiB

if TYPE_CHECKING:
    from vramguard.dra.review import DraContext

JSON = dict[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")
KIND_STORES = {
    "ResourceSlice": "slices",
    "DeviceClass": "classes",
    "ResourceClaim": "claims",
    "ResourceClaimTemplate": "templates",
}
"""Which store holds each resource.k8s.io kind."""
NVIDIA_CLASSES = (
    DeviceClassInfo(
        "gpu.nvidia.com",
        parse_expression("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"),
        "nvidia.com/gpu",
    ),
    DeviceClassInfo(
        "mig.nvidia.com",
        parse_expression("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"),
    ),
)
"""The NVIDIA DRA driver chart's classes, assumed by the offline commands when their input has none."""


class KeyedStore:
    """An informer store keeping one parsed record per object key (name, or namespace/name)."""

    def __init__(self, parse: Callable[[JSON], Any], changed: Callable[[], None]) -> None:
        self.records: dict[str, Any] = {}
        self._parse = parse
        self._changed = changed

    def replace(self, objects: list[JSON]) -> None:
        """A full list: every record is read again."""
        self.records = {}
        for obj in objects:
            self._put(obj)
        self._changed()

    def upsert(self, obj: JSON) -> None:
        """An object added or modified."""
        self._put(obj)
        self._changed()

    def delete(self, obj: JSON) -> None:
        """An object deleted."""
        self.records.pop(_key(obj), None)
        self._changed()

    def _put(self, obj: JSON) -> None:
        key = _key(obj)
        if key.endswith("/"):
            return  # no name: nothing can refer to it
        record = self._parse(obj)
        if record is None:
            self.records.pop(key, None)
        else:
            self.records[key] = record


def _key(obj: Mapping[str, Any]) -> str:
    namespace, name = object_name(mapping(obj))
    return f"{namespace}/{name}"


class DraState:
    """DRA devices, classes and claims of the cluster, as the watches last said."""

    def __init__(self, drivers: tuple[str, ...] = DEFAULT_DRIVERS) -> None:
        """``drivers``: the DRA drivers whose devices are GPUs (``gpu.nvidia.com``)."""
        self._drivers = drivers
        self.watched = False
        """Whether watches feed this state (set by whoever starts them); unwatched, nothing is known
        about DRA and admission does not check claims."""
        self.generation = 0
        """Changes whenever anything DRA changes (cached answers derived from it are stale)."""
        self.devices_generation = 0
        """Changes when devices or classes do (claims and templates are looked up live)."""
        self._inventory: DraInventory | None = None
        self._usage: dict[str, DeviceUsage] | None = None
        self._usage_notes: tuple[str, ...] = ()
        self._namespaces: tuple[int, dict[str, list[tuple[ClaimSpec, ClaimAllocation | None, str]]]] | None = None
        self.slices = KeyedStore(lambda obj: obj, self._slices_changed)
        """ResourceSlices are kept whole (a pool is complete only with all its slices); they are few."""
        self.classes = KeyedStore(read_device_class, self._classes_changed)
        self.claims = KeyedStore(_claim_record, self._claims_changed)
        self.templates = KeyedStore(read_claim_template, self._changed)
        self.pods = KeyedStore(claim_pod, self._pods_changed)
        """Live pods using claims (:func:`claim_pod`), by namespace/name."""
        self.pods_generation = 0
        self._pods_by_uid: tuple[int, dict[str, JSON]] | None = None
        self.holds: dict[str, tuple[tuple[str, int], ...]] = {}
        """Pod UID -> ``(device uuid, bytes)`` its claims take, from its bind until its claims show it."""

    def _changed(self) -> None:
        self.generation += 1

    def _classes_changed(self) -> None:
        self.devices_generation += 1
        self._changed()

    def _slices_changed(self) -> None:
        self.devices_generation += 1
        self._inventory = None
        self._usage = None
        self._changed()

    def _claims_changed(self) -> None:
        self._usage = None
        self._changed()

    def _pods_changed(self) -> None:
        self.pods_generation += 1
        self._changed()

    # -- what the model answers -------------------------------------------------------------------

    def inventory(self) -> DraInventory:
        """The GPU and MIG devices of complete pools."""
        if self._inventory is None:
            self._inventory = read_resource_slices(list(self.slices.records.values()), self._drivers)
        return self._inventory

    def devices(self, node: str | None = None) -> tuple[DraDevice, ...]:
        """All DRA GPU devices, or one node's."""
        inventory = self.inventory()
        return inventory.devices if node is None else inventory.on_node(node)

    def device_classes(self) -> dict[str, DeviceClassInfo]:
        """DeviceClasses by name."""
        return {info.name: info for info in self.classes.records.values()}

    def claim(self, namespace: str, name: str) -> ClaimSpec | None:
        """The requests of a ResourceClaim, ``None`` when the watch has not shown it."""
        record = self.claims.records.get(f"{namespace}/{name}")
        return record[0] if record is not None else None

    def allocation(self, namespace: str, name: str) -> ClaimAllocation | None:
        """The allocation of a ResourceClaim, ``None`` when unknown or not allocated."""
        record = self.claims.records.get(f"{namespace}/{name}")
        return record[1] if record is not None else None

    def allocations(self) -> list[ClaimAllocation]:
        """Every allocated claim."""
        return [allocation for _, allocation, _ in self.claims.records.values() if allocation is not None]

    def template(self, namespace: str, name: str) -> ClaimSpec | None:
        """The claim a ResourceClaimTemplate makes, ``None`` when the watch has not shown it."""
        record: ClaimSpec | None = self.templates.records.get(f"{namespace}/{name}")
        return record

    def pod(self, uid: str) -> JSON | None:
        """A live pod using claims, by UID (``None`` when the watch has not shown it)."""
        if self._pods_by_uid is None or self._pods_by_uid[0] != self.pods_generation:
            index = {str(mapping(p.get("metadata")).get("uid") or ""): p for p in self.pods.records.values()}
            self._pods_by_uid = (self.pods_generation, index)
        return self._pods_by_uid[1].get(uid)

    def pods_naming(self, namespace: str, *, claim: str | None = None, template: str | None = None) -> list[JSON]:
        """The namespace's live pods naming ResourceClaim ``claim`` or ResourceClaimTemplate ``template``."""
        found = []
        for key, pod in self.pods.records.items():
            if not key.startswith(f"{namespace}/"):
                continue
            for source in pod_claim_sources(pod):
                if (claim and source.claim_name == claim) or (template and source.template_name == template):
                    found.append(pod)
                    break
        return found

    def hold(self, uid: str, pod: JSON, taken: tuple[tuple[str, int], ...]) -> None:
        """Keep what pod ``uid``'s claims take on each device (``(device uuid, bytes)``) while it is
        being bound: the claims' watch may not show its allocation yet when the next pod is checked.
        Counted only where no claim the watch shows is reserved for it; dropped when the pod goes."""
        self.pods.upsert(pod)
        self.holds[uid] = taken

    def release(self, uid: str) -> None:
        """Drop pod ``uid``'s hold (its Binding failed)."""
        self.holds.pop(uid, None)

    def live_holds(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The holds of pods still live (the others are dropped here)."""
        for uid in [u for u in self.holds if self.pod(u) is None]:
            del self.holds[uid]
        return self.holds

    def usage(self) -> dict[str, DeviceUsage]:
        """Per device uuid, the memory allocated claims consume there (cached until a change)."""
        if self._usage is None:
            notes: list[str] = []
            self._usage = device_usage(self.inventory(), self.allocations(), notes)
            self._usage_notes = tuple(dict.fromkeys(notes))
        return self._usage

    def node_usage(self, node: str) -> list[DeviceUsage]:
        """The node's DRA devices with what claims consume on each, in slice order."""
        usage = self.usage()
        return [usage[d.uuid] for d in self.devices(node) if d.uuid in usage]

    def context(self, plugin_nodes: Mapping[str, frozenset[str]] | None = None) -> DraContext:
        """What admission checks claims against (see :class:`vramguard.dra.review.DraContext`)."""
        from vramguard.dra.review import DraContext  # noqa: PLC0415 - review builds on this module

        return DraContext(
            self.device_classes(), self.devices(), self.claim, self.template, plugin_nodes or {}, self.pods_naming
        )

    def feed(self, objects: Iterable[Any], *, stand_in_memory: int | None = None) -> None:
        """Replace every store with the resource.k8s.io objects among ``objects`` (files given to the
        offline commands). Without a DeviceClass the NVIDIA chart's classes are assumed; without a
        ResourceSlice and with ``stand_in_memory``, one stand-in GPU of that memory in ``memory``
        mode (what ``--gpu-memory`` says the pods will get). With no ResourceSlice, ResourceClaim or
        ResourceClaimTemplate either, nothing says the cluster runs DRA: the assumed GPU class does
        not serve ``nvidia.com/gpu`` (a device plugin does, as on a cluster without DRA)."""
        by_store: dict[str, list[JSON]] = {name: [] for name in KIND_STORES.values()}
        for obj in objects:
            store = KIND_STORES.get(str(mapping(obj).get("kind")))
            if store is not None and str(mapping(obj).get("apiVersion", "")).startswith("resource.k8s.io/"):
                by_store[store].append(dict(obj))
        self.watched = True
        self.slices.replace(by_store["slices"])
        self.classes.replace(by_store["classes"])
        self.claims.replace(by_store["claims"])
        self.templates.replace(by_store["templates"])
        if not self.classes.records:
            dra_in_use = any(by_store[store] for store in ("slices", "claims", "templates"))
            self.classes.records = {
                f"/{c.name}": c if dra_in_use else replace(c, extended_resource=None) for c in NVIDIA_CLASSES
            }
        if not self.slices.records and stand_in_memory:
            self._inventory = DraInventory((_stand_in(stand_in_memory),), ())
        self.devices_generation += 1
        self._changed()

    def namespace_consumed(self, namespace: str, exclude_pod: str | None = None) -> tuple[int, int]:
        """Memory the namespace's claims hold on GPU devices, and how many claims hold some: an
        allocated claim what it consumes; one not allocated yet (its pod pending) what it will consume
        on the largest device its class could give it, so pending pods count for the quota too.
        Claims of pod UID ``exclude_pod`` (the pod under review: reserved for it, or made for it from
        a template) are left out."""
        held: dict[tuple[str, str, str, str | None], int] = {}
        pending = 0
        claims = 0
        devices = self.inventory().by_key()
        classes = self.device_classes()
        shapes: dict[tuple[str, Selector], tuple[DraDevice, ...]] = {}
        for spec, allocation, owner in self._by_namespace().get(namespace, ()):
            if exclude_pod and owner == exclude_pod:
                continue
            if allocation is None:
                amount = self._pending_bytes(spec, classes, shapes)
                pending += amount
                claims += amount > 0
                continue
            if exclude_pod and any(uid == exclude_pod for _, uid in allocation.reserved_for):
                continue
            counted = False
            for result in allocation.results:
                device = devices.get(result.key)
                if device is None:
                    continue
                held[(*result.key, result.share_id if device.shareable else None)] = result_memory(result, device)
                counted = True
            claims += counted
        return sum(held.values()) + pending, claims

    def _by_namespace(self) -> dict[str, list[tuple[ClaimSpec, ClaimAllocation | None, str]]]:
        """The claim records per namespace (rebuilt once per change)."""
        if self._namespaces is None or self._namespaces[0] != self.generation:
            index: dict[str, list[tuple[ClaimSpec, ClaimAllocation | None, str]]] = {}
            for record in self.claims.records.values():
                index.setdefault(record[0].namespace, []).append(record)
            self._namespaces = (self.generation, index)
        return self._namespaces[1]

    def _pending_bytes(
        self,
        spec: ClaimSpec,
        classes: Mapping[str, DeviceClassInfo],
        shapes: dict[tuple[str, Selector], tuple[DraDevice, ...]],
    ) -> int:
        """What a claim not allocated yet will consume: per request the most any alternative would on
        the devices its class could give it, times its devices (``shapes``: matches found so far)."""
        total = 0
        for request in spec.requests:
            most = 0
            for alternative in request.alternatives:
                device_class = classes.get(alternative.device_class)
                if device_class is None or not device_class.selects_gpus():
                    continue
                key = (alternative.device_class, alternative.selector)
                if key not in shapes:
                    shapes[key] = distinct_shapes(device_class.could_match(self.devices(), alternative.selector))
                amounts = [alternative.consumes_on(d) or 0 for d in shapes[key]]
                most = max(most, max(amounts, default=0) * alternative.count)
            total += most
        return total

    def notes(self) -> tuple[str, ...]:
        """What the inventory and the usage left out, and why."""
        self.usage()
        return (*self.inventory().notes, *self._usage_notes)


def _claim_record(obj: JSON) -> tuple[ClaimSpec, ClaimAllocation | None, str]:
    """A claim's requests, its allocation, and the UID of the pod that controls it (a claim made
    from a template for one pod, or the scheduler's extended-resource claim), or ``""``."""
    owners = mapping(obj.get("metadata")).get("ownerReferences")
    owner = next(
        (
            str(o.get("uid", ""))
            for o in (owners if isinstance(owners, list) else [])[:16]
            if isinstance(o, Mapping) and o.get("controller") is True and o.get("kind") == "Pod"
        ),
        "",
    )
    return read_claim(obj), read_allocation(obj), owner


def claim_pod(obj: JSON) -> JSON | None:
    """The fields of a live pod that uses claims (``spec.resourceClaims``, or the scheduler's claim
    for its extended resources) that its engines' reservations are derived from; ``None`` for any
    other pod. Also the watch's slimming, so the other pods cost nothing to keep."""
    metadata = mapping(obj.get("metadata"))
    spec = mapping(obj.get("spec"))
    status = mapping(obj.get("status"))
    if status.get("phase") in TERMINAL_PHASES:
        return None
    if not items(spec.get("resourceClaims")) and not isinstance(status.get("extendedResourceClaimStatus"), Mapping):
        return None
    annotations = mapping(metadata.get("annotations"))
    return {
        "metadata": {
            "name": text(metadata.get("name")),
            "namespace": text(metadata.get("namespace")),
            "uid": text(metadata.get("uid")),
            "creationTimestamp": text(metadata.get("creationTimestamp")),
            "annotations": {k: v for k, v in annotations.items() if reads_annotation(k)},
        },
        "spec": {
            key: spec[key]
            for key in ("containers", "initContainers", "resourceClaims", "nodeName", "schedulerName")
            if key in spec
        },
        "status": {
            key: status[key]
            for key in ("phase", "resourceClaimStatuses", "extendedResourceClaimStatus")
            if key in status
        },
    }


def _stand_in(memory: int) -> DraDevice:
    """A GPU of ``memory`` bytes shared in the NVIDIA driver's ``memory`` mode."""
    return DraDevice(
        uuid="stand-in",
        node="",
        driver=NVIDIA_GPU_DRIVER,
        pool="",
        name="gpu",
        type="gpu",
        product="--gpu-memory",
        memory_bytes=memory,
        shareable=True,
        sharing="memory",
        policy=RequestPolicy(default=memory, minimum=MiB, maximum=memory, step=MiB),
    )
