"""Whether a claim's memory covers what the engines using it will reserve.

DRA counts what a claim says, not what the process takes: a shareable device's memory is
bookkeeping in the scheduler, filled by ``capacity.requests.memory`` (or the device's default:
the whole GPU in ``memory`` mode, 0 in ``unlimited`` and share-count modes), and the driver
enforces nothing. vLLM at ``--gpu-memory-utilization 0.9`` takes 0.9 of the device however small
its claim; its co-tenants then run out of memory. The rule: on every device a request could get,
what it consumes there is at least what the containers using it reserve there (a fraction of the
device's memory, or bytes for a declaration or an MPS limit).

Sizes: a fraction is a fraction of the device allocated, unknown before scheduling, so each
device the class and selectors could match is checked and the largest one short of memory is
reported; the number to write is the reservation on that device, rounded up by its request policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from vramguard.demand.model import Vram
from vramguard.dra.claims import ClaimRequest, DeviceRequest
from vramguard.dra.classes import DeviceClassInfo, Selector
from vramguard.dra.devices import DraDevice
from vramguard.dra.fields import memory_text

_SHARING_WORDS = {
    "exclusive": "an exclusive device",
    "memory": "a memory-shared device",
    "unlimited": "a device shared without memory accounting (unlimited mode)",
    "shares": "a device shared by share count",
    "partial": "a shared device",
}


@dataclass(frozen=True, slots=True)
class Need:
    """What one container using a claim request will reserve on each of its devices."""

    container: str
    who: str
    """How messages name it: ``vLLM``, ``container app's declaration``."""
    vram: Vram
    init: bool = False
    """A regular init container: it runs before the app containers, beside the sidecars started
    before it."""
    copies: int = 1
    """Pods running this container at once on the same claim (a workload's replicas sharing one)."""
    floor: Vram | None = None
    """The engine's own claim beside a declaration: the container never holds less on a device."""
    sidecar: bool = False
    """An init container that keeps running (``restartPolicy: Always``)."""
    position: int = 0
    """Its place among the pod's containers (init containers first), which orders sidecars and inits."""

    def held(self, device: DraDevice) -> Vram:
        """What counts on ``device``: the declaration, or the engine's claim where that is larger."""
        size = device.memory_bytes
        if self.floor is not None and self.floor.on_device(size) > self.vram.on_device(size):
            return self.floor
        return self.vram

    def on(self, device: DraDevice) -> int:
        """Bytes it reserves on ``device`` (all its copies together)."""
        return self.copies * self.held(device).on_device(device.memory_bytes)

    def arithmetic(self, device: DraDevice) -> str:
        """``0.90 x 80Gi = 72Gi``, ``0.90 x 80Gi + 512Mi = 74240Mi`` (with the engine's allowances),
        ``16Gi``, or for copies ``3 x (0.30 x 80Gi = 24Gi) = 72Gi``."""
        vram = self.held(device)
        one = vram.on_device(device.memory_bytes)
        extra = vram.allowance_bytes
        plus = f" + {memory_text(extra)}" if extra else ""
        if vram.fraction is not None:
            single = f"{float(vram.fraction):.2f} x {memory_text(device.memory_bytes)}{plus} = {memory_text(one)}"
        elif extra:
            single = f"{memory_text(vram.share_on(device.memory_bytes))}{plus} = {memory_text(one)}"
        else:
            single = memory_text(one)
        if vram is not self.vram:
            single += " (the engine's own claim, above the declaration)"
        return single if self.copies == 1 else f"{self.copies} x ({single}) = {memory_text(self.on(device))}"


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A request that consumes less memory on a device than its containers reserve there."""

    claim: str
    """The name the message gives the claim (the pod's name for it, or the claim object's)."""
    request: DeviceRequest
    device: DraDevice
    consumed: int
    needs: tuple[Need, ...]
    required: int
    """Bytes to write in ``capacity.requests.memory`` (the need, rounded up by the device's policy)."""
    extended_resource: str | None = None
    """The extended resource when the claim is the scheduler's (the DRA extended-resource path)."""

    @property
    def reserved(self) -> int:
        """Bytes the containers reserve on the device."""
        return reserved_on(self.needs, self.device)

    def message(self) -> str:
        """The finding's text, with the number to write."""
        phase = largest_phase(self.needs, self.device)
        reserve = " and ".join(f"{n.who} will reserve {n.arithmetic(self.device)}" for n in phase)
        if self.extended_resource is not None:
            return (
                f"{self.extended_resource} on DRA device class {self.request.device_class} consumes "
                f"{memory_text(self.consumed)} of memory on {_SHARING_WORDS[self.device.sharing]} but {reserve}; "
                f"use a ResourceClaim with capacity.requests.memory: {memory_text(self.required)}"
            )
        if self.request.memory is None:
            asked = (
                f"sets no capacity.requests.memory, so it consumes {memory_text(self.consumed)} of "
                f"{_SHARING_WORDS[self.device.sharing]},"
            )
        else:
            asked = f"requests {memory_text(self.request.memory)} of memory"
        name = self.claim if self.request.name == self.claim else f"{self.claim} request {self.request.name}"
        return f"claim {name} {asked} but {reserve}; set capacity.requests.memory: {memory_text(self.required)}"


@dataclass(frozen=True, slots=True)
class RequestCheck:
    """The outcome of :func:`check_request`."""

    shortfall: Shortfall | None = None
    notes: tuple[str, ...] = ()
    """Why (part of) the check could not be made: an unknown class, no device known to match."""
    largest: DraDevice | None = None
    """The largest device the request could get (what fractions are sized on)."""


def largest_phase(needs: Sequence[Need], device: DraDevice) -> tuple[Need, ...]:
    """The containers that hold the most on ``device`` at once, in kube-scheduler's phases: the app
    containers with the sidecars, or one init container beside the sidecars started before it (the
    app phase where they tie)."""
    phases = [tuple(n for n in needs if not n.init)]
    phases += [
        (*(s for s in needs if s.sidecar and s.position < n.position), n) for n in needs if n.init
    ]
    return max(phases, key=lambda phase: sum(n.on(device) for n in phase))


def reserved_on(needs: Sequence[Need], device: DraDevice) -> int:
    """The most the containers hold on ``device`` at once (:func:`largest_phase`)."""
    return sum(n.on(device) for n in largest_phase(needs, device))


Candidates = Callable[[DeviceClassInfo, Selector], Sequence[DraDevice]]
"""The devices a class narrowed by a request's selectors could match (one per :func:`device_shape`)."""


def device_shape(device: DraDevice) -> tuple[object, ...]:
    """What a claim's check depends on: devices of one shape (a node's eight H100s) answer alike."""
    return device.memory_bytes, device.shareable, device.sharing, device.policy, device.shares


def distinct_shapes(devices: Iterable[DraDevice]) -> tuple[DraDevice, ...]:
    """The first device of each :func:`device_shape`, in order."""
    return tuple({device_shape(d): d for d in reversed(tuple(devices))}.values())[::-1]


def check_request(
    claim: str,
    request: ClaimRequest,
    needs: Sequence[Need],
    classes: Mapping[str, DeviceClassInfo],
    devices: Sequence[DraDevice],
    extended_resource: str | None = None,
    candidates: Candidates | None = None,
) -> RequestCheck:
    """Check one request (every ``firstAvailable`` alternative: any may be chosen) against the
    needs of the containers using it, on every device its class and selectors could match.
    ``candidates`` (cached by the caller) stands in for matching ``devices`` on every call."""
    if not needs:
        return RequestCheck()
    notes: list[str] = []
    worst: Shortfall | None = None
    largest: DraDevice | None = None
    for alternative in request.alternatives:
        device_class = classes.get(alternative.device_class)
        if device_class is None:
            notes.append(f"claim {claim}: DeviceClass {alternative.device_class} is not known; not checked")
            continue
        gpus = device_class.selects_gpus()
        if gpus is False:
            continue  # another kind of device (a NIC, an FPGA): no GPU memory to check
        if gpus is None:
            notes.append(
                f"claim {claim}: vramguard cannot read whether DeviceClass {alternative.device_class} selects "
                "GPUs (its selectors name no driver or type it knows); not checked"
            )
            continue
        matching = (
            candidates(device_class, alternative.selector)
            if candidates is not None
            else distinct_shapes(device_class.could_match(devices, alternative.selector))
        )
        if not matching:
            notes.append(
                f"claim {claim}: no known device matches DeviceClass {alternative.device_class}; "
                "its memory is checked once ResourceSlices show one"
            )
            continue
        for device in matching:
            consumed = alternative.consumes_on(device)
            if consumed is None:
                continue  # the device cannot serve this request; the allocator will not pick it
            if largest is None or device.memory_bytes > largest.memory_bytes:
                largest = device
            reserved = reserved_on(needs, device)
            if consumed >= reserved:
                continue
            required = device.consumes(reserved) if device.shareable else None
            candidate = Shortfall(
                claim, alternative, device, consumed, tuple(needs), required or reserved, extended_resource
            )
            if worst is None or reserved > worst.reserved:
                worst = candidate
    return RequestCheck(worst, tuple(notes), largest)
