"""Dynamic Resource Allocation (resource.k8s.io/v1): GPUs published in ResourceSlices, DeviceClasses,
ResourceClaims and their templates, read defensively (never raising), and the rule that a claim's
memory covers what its workload's engine reserves.

- :mod:`vramguard.dra.devices`: ResourceSlices -> :class:`DraInventory` of :class:`DraDevice`
- :mod:`vramguard.dra.classes`: DeviceClasses and the CEL selectors vramguard understands
- :mod:`vramguard.dra.claims`: claim requests, allocations and the memory they consume per device
- :mod:`vramguard.dra.pods`: which claims a pod and its containers use
- :mod:`vramguard.dra.sizing`: a request's memory against its containers' reservations
- :mod:`vramguard.dra.state`: the cluster model's DRA part, fed by watch events (or input files)
- :mod:`vramguard.dra.review`: admission's and audit's questions about a pod's claims
- :mod:`vramguard.dra.tenancy`: placement of pods with claims: the engines on each device
- :mod:`vramguard.dra.allocate`: the scheduler's allocator as ``vramguard plan`` models it
- :mod:`vramguard.dra.views`: DRA devices as ``kubectl vram nodes`` rows and metric aggregates
"""

from vramguard.dra.allocate import Allocation, DraBook
from vramguard.dra.claims import (
    EXTENDED_RESOURCE_CLAIM_ANNOTATION,
    AllocatedDevice,
    ClaimAllocation,
    ClaimRequest,
    ClaimSpec,
    DeviceRequest,
    DeviceUsage,
    Share,
    device_usage,
    read_allocation,
    read_claim,
    read_claim_spec,
    read_claim_template,
    result_memory,
)
from vramguard.dra.classes import (
    ANY_DEVICE,
    DeviceClassInfo,
    Selector,
    class_for_extended_resource,
    parse_expression,
    read_device_class,
    read_selectors,
)
from vramguard.dra.devices import (
    NVIDIA_GPU_DRIVER,
    DraDevice,
    DraInventory,
    RequestPolicy,
    Sharing,
    read_resource_slices,
)
from vramguard.dra.fields import memory_text
from vramguard.dra.pods import (
    ClaimUse,
    ExtendedResourceClaim,
    PodClaimSource,
    container_claim_uses,
    extended_resource_claim,
    pod_claim_sources,
)
from vramguard.dra.review import (
    AllocatedShortfall,
    ClaimReview,
    DraContext,
    RequestReport,
    audit_allocations,
    review_claim_spec,
    review_pod_claims,
)
from vramguard.dra.sizing import Need, RequestCheck, Shortfall, check_request, reserved_on
from vramguard.dra.state import DraState
from vramguard.dra.views import NodeProductUsage, dra_rows, per_node_product

__all__ = [
    "ANY_DEVICE",
    "EXTENDED_RESOURCE_CLAIM_ANNOTATION",
    "NVIDIA_GPU_DRIVER",
    "AllocatedDevice",
    "AllocatedShortfall",
    "Allocation",
    "ClaimAllocation",
    "ClaimRequest",
    "ClaimReview",
    "ClaimSpec",
    "ClaimUse",
    "DeviceClassInfo",
    "DeviceRequest",
    "DeviceUsage",
    "DraBook",
    "DraContext",
    "DraDevice",
    "DraInventory",
    "DraState",
    "ExtendedResourceClaim",
    "Need",
    "NodeProductUsage",
    "PodClaimSource",
    "RequestCheck",
    "RequestPolicy",
    "RequestReport",
    "Selector",
    "Share",
    "Sharing",
    "Shortfall",
    "audit_allocations",
    "check_request",
    "class_for_extended_resource",
    "container_claim_uses",
    "device_usage",
    "dra_rows",
    "extended_resource_claim",
    "memory_text",
    "parse_expression",
    "per_node_product",
    "pod_claim_sources",
    "read_allocation",
    "read_claim",
    "read_claim_spec",
    "read_claim_template",
    "read_device_class",
    "read_resource_slices",
    "read_selectors",
    "reserved_on",
    "result_memory",
    "review_claim_spec",
    "review_pod_claims",
]
