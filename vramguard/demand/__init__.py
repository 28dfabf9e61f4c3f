"""The demand model: how many GPUs each container asks for and how much VRAM it takes on each."""

from vramguard.demand.derive import (
    DEFAULT_OPTIONS,
    MAX_DEVICES,
    DemandOptions,
    derive_container_demand,
    derive_pod_demand,
)
from vramguard.demand.model import ContainerDemand, EngineClaim, PodDemand, Vram

__all__ = [
    "DEFAULT_OPTIONS",
    "MAX_DEVICES",
    "ContainerDemand",
    "DemandOptions",
    "EngineClaim",
    "PodDemand",
    "Vram",
    "derive_container_demand",
    "derive_pod_demand",
]
