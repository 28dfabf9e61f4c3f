"""Containers that reach GPUs through ``NVIDIA_VISIBLE_DEVICES`` rather than a GPU request.

The NVIDIA container toolkit gives a container the GPUs its ``NVIDIA_VISIBLE_DEVICES`` names. The
device plugin sets the variable for the containers that request GPUs (its default
``deviceListStrategy: envvar``), but a container may set it itself, and the toolkit honours it for
unprivileged containers unless ``accept-nvidia-visible-devices-envvar-when-unprivileged = false``
(its default is ``true``). A container that sets it to ``all`` or to device ids thus reaches GPUs
that no scheduler counted for it: a pod asking for no GPU at all, a container asking for one GPU and
naming every GPU of the node, an ephemeral container added to a running pod (``kubectl debug``).

``void``, ``none`` and the empty value give no GPU (``none`` the driver's libraries only). A value
from a Secret, a ConfigMap or ``envFrom`` may be anything, and counts as a reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.quantity import excerpt

__all__ = ["VISIBLE_DEVICES", "DeviceReach", "device_reaches"]

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
NO_DEVICE_VALUES = frozenset({"void", "none", ""})
"""Values that give no GPU (nvidia-container-toolkit, ``internal/config/image/cuda_image.go``)."""
CONTAINER_LISTS = (("containers", "container"), ("initContainers", "init container"),
                   ("ephemeralContainers", "ephemeral container"))
MAX_CONTAINERS = 256
"""Containers of each list looked at (a pod has far fewer; the API server allows any number)."""
MAX_ENV = 4096
"""``env`` entries looked at per container, as :mod:`vramguard.demand.commandline` reads them."""


@dataclass(frozen=True, slots=True)
class DeviceReach:
    """One container that names its own GPUs."""

    container: str
    kind: str
    """``container``, ``init container`` or ``ephemeral container``."""
    value: str
    """The value as written, or where it comes from (``from secretKeyRef``)."""

    def describe(self) -> str:
        """The finding in words."""
        return (
            f"{self.kind} {self.container} sets {VISIBLE_DEVICES}={self.value}: where the NVIDIA container "
            "toolkit accepts the variable from unprivileged containers (its default), it reaches GPUs that "
            "no scheduler counted for it; request the GPUs as a resource instead"
        )


def device_reaches(pod: Mapping[str, Any]) -> list[DeviceReach]:
    """Every container of ``pod`` (a Pod or a pod template) that sets ``NVIDIA_VISIBLE_DEVICES`` to a
    value that may name GPUs."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return []
    found: list[DeviceReach] = []
    for field, kind in CONTAINER_LISTS:
        containers = spec.get(field)
        if not isinstance(containers, list):
            continue
        for container in containers[:MAX_CONTAINERS]:
            if not isinstance(container, Mapping):
                continue
            value = _setting(container)
            if value is not None:
                name = container.get("name")
                found.append(DeviceReach(name if isinstance(name, str) else "<unnamed>", kind, value))
    return found


def _setting(container: Mapping[str, Any]) -> str | None:
    """What the container sets the variable to, when that may name GPUs; ``None`` otherwise."""
    entries = container.get("env")
    if not isinstance(entries, list):
        return None
    setting: str | None = None
    for entry in entries[:MAX_ENV]:
        if not isinstance(entry, Mapping) or entry.get("name") != VISIBLE_DEVICES:
            continue
        source = entry.get("valueFrom")
        if isinstance(source, Mapping) and source:
            setting = f"(from {next(iter(source))})"
            continue
        raw = entry.get("value", "")
        value = raw if isinstance(raw, str) else str(raw)
        # The last entry of a name wins, as the kubelet passes them in order.
        setting = None if value.strip().lower() in NO_DEVICE_VALUES else excerpt(value, quote=False)
    return setting
