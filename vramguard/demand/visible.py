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

The variable may also come from the image: NVIDIA's CUDA base images set ``NVIDIA_VISIBLE_DEVICES
all`` (``nvidia/cuda`` ``base`` Dockerfiles, "nvidia-container-runtime"), and the serving images
built on them inherit it. The device plugin overrides it only for containers that request GPUs; so
a container of such an image that requests none sees every GPU of its node (the k8s-device-plugin
README: "If you don't request GPUs when using the device plugin with NVIDIA images all the GPUs on
the machine will be exposed inside your container"), unless it sets the variable itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.engines.launchers import image_name
from vramguard.quantity import excerpt

__all__ = ["CUDA_IMAGES", "VISIBLE_DEVICES", "DeviceReach", "device_reaches"]

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
NO_DEVICE_VALUES = frozenset({"void", "none", ""})
"""Values that give no GPU (nvidia-container-toolkit, ``internal/config/image/cuda_image.go``)."""
CONTAINER_LISTS = (("containers", "container"), ("initContainers", "init container"),
                   ("ephemeralContainers", "ephemeral container"))
MAX_CONTAINERS = 256
"""Containers of each list looked at (a pod has far fewer; the API server allows any number)."""
MAX_ENV = 4096
"""``env`` entries looked at per container, as :mod:`vramguard.demand.commandline` reads them."""
CUDA_IMAGES = frozenset({
    "nvidia/cuda",
    # Built on nvidia/cuda: vLLM (docker/Dockerfile), SGLang (docker/Dockerfile), TGI (Dockerfile, its
    # runtime stage); NGC's own images set the variable alike.
    "vllm/vllm-openai", "lmsysorg/sglang", "huggingface/text-generation-inference",
    "nvidia/tritonserver", "nvidia/pytorch",
})
"""Images (owner/name, any registry or tag) that set ``NVIDIA_VISIBLE_DEVICES=all`` themselves."""
FROM_IMAGE = "all (from its image)"


@dataclass(frozen=True, slots=True)
class DeviceReach:
    """One container that names its own GPUs."""

    container: str
    kind: str
    """``container``, ``init container`` or ``ephemeral container``."""
    value: str
    """The value as written, or where it comes from (``from secretKeyRef``)."""

    @property
    def inherited(self) -> bool:
        """The variable comes from the container's image, not from its spec."""
        return self.value == FROM_IMAGE

    def describe(self) -> str:
        """The finding in words."""
        if self.inherited:
            return (
                f"{self.kind} {self.container} asks for no GPU, and its image sets {VISIBLE_DEVICES}=all (NVIDIA's "
                "CUDA images do): where the NVIDIA container toolkit accepts the variable from unprivileged "
                "containers (its default), it sees every GPU of its node, which no scheduler counted for it; "
                f"request the GPU as a resource, or set {VISIBLE_DEVICES}=void"
            )
        return (
            f"{self.kind} {self.container} sets {VISIBLE_DEVICES}={self.value}: where the NVIDIA container "
            "toolkit accepts the variable from unprivileged containers (its default), it reaches GPUs that "
            "no scheduler counted for it; request the GPUs as a resource instead"
        )


def device_reaches(pod: Mapping[str, Any], is_gpu: Callable[[str], bool] | None = None) -> list[DeviceReach]:
    """Every container of ``pod`` (a Pod or a pod template) that sets ``NVIDIA_VISIBLE_DEVICES`` to a
    value that may name GPUs; with ``is_gpu`` (which resources are GPUs), also every container of a
    :data:`CUDA_IMAGES` image that requests no GPU and leaves the variable to its image."""
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
            written, value = _setting(container)
            if not written and is_gpu is not None and _inherits_all(container, is_gpu):
                value = FROM_IMAGE
            if value is not None:
                name = container.get("name")
                found.append(DeviceReach(name if isinstance(name, str) else "<unnamed>", kind, value))
    return found


def _inherits_all(container: Mapping[str, Any], is_gpu: Callable[[str], bool]) -> bool:
    """A container of a :data:`CUDA_IMAGES` image asking for no GPU, by resource or by claim."""
    image = container.get("image")
    if not isinstance(image, str) or image_name(image) not in CUDA_IMAGES:
        return False
    resources = container.get("resources")
    if not isinstance(resources, Mapping):
        return True
    if resources.get("claims"):
        return False  # a DRA claim gives it its devices
    for section in ("limits", "requests"):
        asked = resources.get(section)
        if isinstance(asked, Mapping) and any(isinstance(name, str) and is_gpu(name) for name in asked):
            return False
    return True


def _setting(container: Mapping[str, Any]) -> tuple[bool, str | None]:
    """Whether the container sets the variable, and to what when that may name GPUs (``None``: no GPU)."""
    entries = container.get("env")
    if not isinstance(entries, list):
        return False, None
    written = False
    setting: str | None = None
    for entry in entries[:MAX_ENV]:
        if not isinstance(entry, Mapping) or entry.get("name") != VISIBLE_DEVICES:
            continue
        written = True
        source = entry.get("valueFrom")
        if isinstance(source, Mapping) and source:
            setting = f"(from {next(iter(source))})"
            continue
        raw = entry.get("value", "")
        value = raw if isinstance(raw, str) else str(raw)
        # The last entry of a name wins, as the kubelet passes them in order.
        setting = None if value.strip().lower() in NO_DEVICE_VALUES else excerpt(value, quote=False)
    return written, setting
