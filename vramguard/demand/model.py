"""What a container will reserve on each GPU it gets, and the evidence for it."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Literal

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.quantity import MAX_QUANTITY_TEXT, MiB, QuantityError, excerpt, format_bytes, parse_bytes


@dataclass(frozen=True, slots=True)
class Allowance:
    """Memory a container's processes hold on each GPU outside the engine's share, by cause.

    ``bytes`` is the amount per process on a GPU of any product; ``by_product`` overrides it for
    named products (a policy setting), and ``count`` is the processes per GPU it applies to.
    """

    name: str
    """What it is for: ``CUDA context``, ``CUDA graphs``, ``communication buffers``, ..."""
    bytes: int
    source: str = ""
    """Where the rule and its default come from (the engine's file and version, or the policy key)."""
    count: int = 1
    by_product: tuple[tuple[str, int], ...] = ()
    estimate: bool = True
    """Whether the engine may hold less, or nothing (graphs, buffers, a reserve): an estimate never counts
    past the device (:meth:`Vram.on_device`). A CUDA context is certain: every process makes one before
    its engine measures memory."""

    def bytes_for(self, product: str) -> int:
        """The allowance on a device of ``product`` (an empty name: the default amount)."""
        for name, amount in self.by_product:
            if name == product:
                return amount * self.count
        return self.bytes * self.count

    def describe(self, product: str = "") -> str:
        """``CUDA context 512.0 MiB`` (``2 x`` when it counts several processes)."""
        times = f"{self.count} x " if self.count != 1 else ""
        return f"{self.name} {times}{format_bytes(self.bytes_for(product) // self.count)}"


@dataclass(frozen=True, slots=True)
class Vram:
    """VRAM per GPU: a share (a fraction of the device's memory, or an exact byte count) and the
    allowances held beside it.

    A *ceiling* share caps the device's total use, everyone's included (TGI's
    ``--cuda-memory-fraction``): the engine's own overheads are inside it, it fills what is free up
    to the fraction (so at most the budget), and it counts at least just over half of a device's
    budget, so that no two ceiling engines ever share a device (the second to start would find the
    first's memory taken and get none of its own). Its allowances are what it holds beyond the
    ceiling (vLLM's CUDA graphs, captured after a device-wide budget is sized).
    """

    fraction: Fraction | None = None
    bytes: int | None = None
    allowances: tuple[Allowance, ...] = ()
    ceiling: bool = False

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError("Vram needs exactly one of fraction or bytes")

    def share_on(self, device_bytes: int) -> int:
        """The share alone on a device of ``device_bytes``: a fraction is rounded down (rounding up
        would let three claims of 0.3 exceed a budget of 0.9 by a byte or two)."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(self.fraction * device_bytes)

    def on_device(self, device_bytes: int, product: str = "", whole: int | None = None) -> int:
        """Whole bytes this claim holds on a device of ``device_bytes`` memory: the share and the
        allowances (for ``product``). ``whole``: the device's budget (or MPS share), which a ceiling
        share counts at least half of, plus one byte."""
        share = self.share_on(device_bytes)
        if self.ceiling:
            # It fills what is free up to its fraction, so it never takes more than the budget; what it
            # holds beyond the ceiling (graphs captured after the budget is sized) comes on top.
            share = share if whole is None else max(min(share, whole), whole // 2 + 1)
        certain = share + sum(a.bytes_for(product) for a in self.allowances if not a.estimate)
        held = certain + sum(a.bytes_for(product) for a in self.allowances if a.estimate)
        # Estimates never count past the device: the share and the context are what the engine
        # certainly holds (:meth:`capped_on` says when an estimate was cut).
        return device_bytes if certain <= device_bytes < held else held

    def capped_on(self, device_bytes: int, product: str = "", whole: int | None = None) -> bool:
        """Whether the estimated allowances do not fit beside the certain part (the share, the CUDA
        context) on a device of ``device_bytes``: :meth:`on_device` then counts the whole device, and
        the engine fails at start if its overheads are as large as estimated."""
        share = self.share_on(device_bytes)
        if self.ceiling and whole is not None:
            share = max(min(share, whole), whole // 2 + 1)
        certain = share + sum(a.bytes_for(product) for a in self.allowances if not a.estimate)
        return certain <= device_bytes < certain + sum(a.bytes_for(product) for a in self.allowances if a.estimate)

    @property
    def allowance_bytes(self) -> int:
        """The allowances' default amounts, summed (for a ceiling share, those held beyond it)."""
        return sum(a.bytes_for("") for a in self.allowances)

    def plain(self) -> Vram:
        """The share alone, without allowances or the ceiling rule."""
        if not self.allowances and not self.ceiling:
            return self
        return Vram(self.fraction, self.bytes)

    def exceeds(self, other: Vram, device_bytes: int | None) -> bool | None:
        """Whether this claim is larger than ``other``; ``None`` when it depends on an unknown size."""
        if device_bytes is not None:
            return self.on_device(device_bytes) > other.on_device(device_bytes)
        mine, theirs = self.allowance_bytes, other.allowance_bytes
        if self.fraction is not None and other.fraction is not None:
            if self.fraction >= other.fraction and mine >= theirs:
                return self.fraction > other.fraction or mine > theirs
            if self.fraction <= other.fraction and mine <= theirs:
                return False
            return None
        if self.bytes is not None and other.bytes is not None:
            return self.bytes + mine > other.bytes + theirs
        return None

    def describe(self) -> str:
        """Human form: ``0.3 of the GPU``, ``16.0 GiB``, ``0.3 of the GPU + 1.5 GiB``."""
        if self.fraction is not None:
            text = f"{float(self.fraction):g} of the GPU"
        else:
            assert self.bytes is not None
            text = format_bytes(self.bytes)
        extra = self.allowance_bytes
        if self.ceiling:
            beyond = f" + {format_bytes(extra)} beyond it" if extra else ""
            return f"{text}, a ceiling on the whole device's use{beyond}"
        return f"{text} + {format_bytes(extra)}" if extra else text


LEAST_VRAM_BYTES = MiB
"""The least VRAM a reservation or a limit may name in bytes: less is a number whose unit was left out
(``12`` meant as ``12Gi``), and no GPU workload fits in it."""
_PLAIN_NUMBER = re.compile(r"^(?:\d+\.\d*|\.\d+|\d+)$", re.ASCII)


class VramError(ValueError):
    """Text that is not VRAM per GPU. ``reason``: ``"fraction"`` (a fraction outside (0, 1]),
    ``"small"`` (bytes under :data:`LEAST_VRAM_BYTES`), ``"huge"`` (text longer than
    :data:`~vramguard.quantity.MAX_QUANTITY_TEXT` or bytes above :data:`~vramguard.quantity.MAX_BYTES`)
    or ``"junk"`` (neither a quantity nor a fraction); callers word the message for where the text came from."""

    def __init__(self, text: str, reason: Literal["fraction", "small", "huge", "junk"]) -> None:
        super().__init__(f"{excerpt(text)}: {reason}")
        self.reason = reason


def parse_vram(text: str) -> Vram:
    """VRAM per GPU, as the ``vramguard.io/vram`` annotation and a class's ``max_vram_per_gpu`` write it:
    a plain number up to 1 (``0.25``, ``1``) or with a decimal point is a fraction of the GPU, anything
    else a Kubernetes quantity of bytes (``12Gi``). Raises :class:`VramError`."""
    text = text.strip()
    if len(text) > MAX_QUANTITY_TEXT:
        raise VramError(text, "huge")
    if _PLAIN_NUMBER.match(text) and ("." in text or Fraction(text) <= 1):
        fraction = Fraction(text)
        if not 0 < fraction <= 1:
            raise VramError(text, "fraction")
        return Vram(fraction=fraction)
    try:
        count = parse_bytes(text)
    except QuantityError as exc:
        raise VramError(text, exc.reason) from None
    if count < LEAST_VRAM_BYTES:
        raise VramError(text, "small")
    return Vram(bytes=count)


@dataclass(frozen=True, slots=True)
class Parallel:
    """The GPUs an engine's parallel flags add up to, over all the pods (nodes) it spans."""

    total: int
    """The parallel sizes multiplied: GPUs of the whole engine, on every node together."""
    flags: tuple[str, ...] = ()
    """The size flags as the user wrote them (``--tensor-parallel-size 8``)."""
    nodes: int | None = None
    """Nodes (pods) the engine says it spans (``--nnodes 2``), when its command says."""
    nodes_flag: str | None = None
    ray: bool = False
    """The engine runs its workers through a Ray cluster, which may span several pods."""
    per_pod: bool = False
    """The sizes multiply to the GPUs of each pod, not of the whole engine (vLLM's
    ``--data-parallel-size-local``): a group of pods does not divide them."""
    layout: str = ""
    """The sizes given, canonical whatever alias or spelling was used (``tensor-parallel-size=2``,
    comma-separated): what, beside the GPU count, decides the graphs and buffers a rank holds."""

    def describe(self) -> str:
        """The arithmetic as written: ``--tensor-parallel-size 2 x --pipeline-parallel-size 1 = 2 GPUs``."""
        if not self.flags:
            return f"no parallel-size flag = {self.total} GPU"
        return f"{' x '.join(self.flags)} = {self.total} GPU{'s' if self.total != 1 else ''}"


@dataclass(frozen=True, slots=True)
class Overheads:
    """What an engine's processes hold on each GPU besides its share, as the engine's source says;
    the policy's allowances give the bytes (:mod:`vramguard.demand.allowances`)."""

    processes: int = 1
    """Processes of the engine on each of its GPUs, each with its own CUDA context."""
    graphs: str | None = None
    """Why CUDA graphs are held outside the share (the rule and its source); ``None``: inside it, or none.
    For a ceiling share, graphs held beyond the ceiling (captured after a device-wide budget is sized)."""
    graphs_scale: Fraction = Fraction(1)
    """The graphs' allowance times this (they grow with tensor parallelism)."""
    communication: str | None = None
    """Why communication buffers (NCCL, custom all-reduce) are held: the engine has peers."""
    reserve_bytes: int = 0
    """Bytes the engine keeps for itself outside its share by its own estimate (SGLang)."""
    reserve_source: str = ""
    scratch_bytes: int = 0
    """Activations the engine's memory profiling misses, held beyond the share and a ceiling alike
    (vLLM's hybrid models: :mod:`vramguard.engines.vllm_hybrid`)."""
    scratch_source: str = ""
    rules: tuple[str, ...] = ()
    """The engine's memory rules that applied, each with its source (for ``explain``)."""


NO_OVERHEADS = Overheads()


@dataclass(frozen=True, slots=True)
class EngineClaim:
    """What an inference or training engine inside the container will allocate, per GPU."""

    engine: str
    vram: Vram | None
    parallel: Parallel | None = None
    """GPUs the engine's own flags say it will use (e.g. vLLM's tensor × pipeline parallel size)."""
    evidence: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    implicit_default: bool = False
    """The VRAM comes from the engine's built-in default, not from anything the spec says."""
    default_warning: str | None = None
    """The warning (among ``warnings``) that says so, which a class forbidding defaults replaces."""
    env_only: bool = False
    """The engine was recognised only from environment variables (JAX), which any container can set."""
    overheads: Overheads = NO_OVERHEADS
    version: str | None = None
    """The engine version the rules were chosen for (from the image tag), or ``None`` when unknown."""


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    """The GPU demand of one container that asks for a GPU resource."""

    name: str
    resource: str
    gpus: int
    init: bool = False
    """A regular init container: it runs to completion before the app containers start."""
    sidecar: bool = False
    """An init container that restarts (``restartPolicy: Always``): it starts in its turn among the
    init containers and keeps running beside those after it and beside the app containers."""
    engine: str | None = None
    claim: Vram | None = None
    """What the engine allocates per GPU, when known."""
    declared: Vram | None = None
    """The reservation declared by a ``vramguard.io/vram`` annotation."""
    mps_limit: int | None = None
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for the container's GPUs, in bytes (the largest one)."""
    sm_percent: int | None = None
    implicit_default: bool = False
    """The engine's claim is its built-in default (vLLM's 0.92, TGI's 1.0, JAX's 0.75)."""
    default_warning: str | None = None
    """The warning (among ``warnings``) that the claim is the engine's default (see :class:`EngineClaim`)."""
    env_only: bool = False
    """The engine was recognised only from environment variables (see :attr:`EngineClaim.env_only`)."""
    engine_version: str | None = None
    layout: str = ""
    """The engine's parallel layout (:attr:`Parallel.layout`)."""
    rules: tuple[str, ...] = ()
    """The engine's memory rules that decided the claim, each with its source (for ``explain``)."""
    evidence: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def reservation(self) -> Vram | None:
        """What to hold for this container on each of its GPUs; ``None`` when unknown.

        A declaration is a reservation. Otherwise the MPS pinned limit bounds what the process may
        take; otherwise the engine's own claim. Whether the claim fits inside the other two is checked
        by :meth:`conflicts`.
        """
        if self.declared is not None:
            return self.declared
        if self.mps_limit is not None:
            return Vram(bytes=self.mps_limit)
        return self.claim

    @property
    def reservations(self) -> tuple[Vram, ...]:
        """Everything the container may hold on each of its GPUs; on a device the largest counts.
        Empty when its VRAM is unknown.

        A declaration never counts below what the engine's own flags reserve on the device it lands
        on: a declaration written for one GPU size is too small on a larger one when the engine
        claims a fraction, so beside a declaration the engine's claim counts too.
        """
        held = self.reservation
        if held is None:
            return ()
        if self.declared is not None and self.claim is not None and self.claim != held:
            return (held, self.claim)
        return (held,)

    def describe_reservation(self) -> str:
        """:attr:`reservations` in words: ``16.0 GiB``, ``64.0 GiB, or vllm's 0.75 of the GPU + 1.5 GiB
        where that is more``, ``unknown (holds a whole GPU)``."""
        first, *more = self.reservations or (None,)
        if first is None:
            return "unknown (holds a whole GPU)"
        return ", or ".join([first.describe(), *(f"{self.engine}'s {v.describe()} where that is more" for v in more)])

    def held_on(self, device_bytes: int, product: str = "", whole: int | None = None) -> int | None:
        """Bytes the container holds on a device of ``device_bytes`` (the largest of
        :attr:`reservations`); ``None`` when unknown."""
        return max((v.on_device(device_bytes, product, whole) for v in self.reservations), default=None)

    def conflicts(self, device_bytes: int | None) -> list[str]:
        """Errors that show only once the device size is known (``None``: check what can be checked)."""
        return claim_conflicts(self.name, self.engine, self.claim, self.declared, self.mps_limit, device_bytes)


def claim_conflicts(
    name: str, engine: str | None, claim: Vram | None, declared: Vram | None, mps_limit: int | None,
    device_bytes: int | None,
) -> list[str]:
    """A container's engine claim against its declaration and its MPS limit (see :meth:`ContainerDemand.conflicts`).

    A function of the fields, so that a demand can be checked before it is built.
    """
    problems: list[str] = []
    if claim is None or (declared is None and mps_limit is None):
        return problems
    # A declaration is compared with the engine's share; the MPS limit also bounds the allowances,
    # since it counts CUDA's own allocations (the context) of the client process.
    for bound, label, held in (
        (declared, f"its {VRAM_ANNOTATION} declaration", claim.plain()),
        (Vram(bytes=mps_limit) if mps_limit is not None else None, "its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", claim),
    ):
        if bound is None:
            continue
        if held.exceeds(bound, device_bytes):
            size = f" on a {format_bytes(device_bytes)} GPU" if device_bytes else ""
            problems.append(
                f"container {name}: {engine} claims {_claim_text(held, device_bytes)}"
                f"{size}, more than {label} ({bound.describe()})"
            )
    return problems


def _claim_text(claim: Vram, device_bytes: int | None) -> str:
    if device_bytes is not None and claim.fraction is not None:
        return f"{claim.describe()} = {format_bytes(claim.on_device(device_bytes))}"
    return claim.describe()


@dataclass(frozen=True, slots=True)
class PodDemand:
    """The GPU demand of a pod (or a workload's pod template)."""

    containers: tuple[ContainerDemand, ...] = ()
    errors: tuple[str, ...] = ()
    """Every error, the containers' included, each naming its container."""
    warnings: tuple[str, ...] = ()

    @property
    def wants_gpu(self) -> bool:
        """Whether any container asks for a GPU resource."""
        return bool(self.containers)

    def phases(self) -> tuple[tuple[ContainerDemand, ...], ...]:
        """The containers that run at once, in kube-scheduler's order (its ``PodRequests``): each
        regular init container beside the sidecars started before it, then every sidecar beside the
        app containers. A pod needs, of each resource, the most any one phase holds.

        Sidecars come first in each phase, in their order, so that a sidecar keeps its device from
        one phase to the next.
        """
        sidecars: list[ContainerDemand] = []
        phases: list[tuple[ContainerDemand, ...]] = []
        for container in self.containers:
            if container.sidecar:
                sidecars.append(container)
            elif container.init:
                phases.append((*sidecars, container))
        phases.append((*sidecars, *(c for c in self.containers if not c.init and not c.sidecar)))
        return tuple(phases)

    def devices_per_resource(self) -> dict[str, int]:
        """How many devices of each resource the pod holds at once: the most of any phase."""
        most: dict[str, int] = {}
        for phase in self.phases():
            counts: dict[str, int] = {}
            for container in phase:
                counts[container.resource] = counts.get(container.resource, 0) + container.gpus
            for resource, count in counts.items():
                most[resource] = max(most.get(resource, 0), count)
        return most

    def conflicts(self, device_bytes: int | None) -> list[str]:
        """Size-dependent errors of all containers for a device of ``device_bytes``."""
        return [problem for c in self.containers for problem in c.conflicts(device_bytes)]

    def env_only_guesses(self) -> tuple[str, ...]:
        """Containers whose reservation rests only on an engine recognised from its environment."""
        return tuple(c.name for c in self.containers if c.env_only and c.declared is None and c.mps_limit is None)

    def distrusting_env_only(self) -> PodDemand:
        """This demand with :meth:`env_only_guesses` counted as unknown VRAM (the engine not believed)."""
        guesses = set(self.env_only_guesses())
        if not guesses:
            return self
        containers = tuple(
            replace(c, claim=None, implicit_default=False) if c.name in guesses else c for c in self.containers
        )
        return replace(self, containers=containers)
