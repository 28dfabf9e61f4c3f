"""What a container's processes claim together: each process read once, then the phase that holds most.

The command line is walked by :func:`vramguard.demand.shell.launch`; each process it starts is
read here as it starts, with the environment it gets:

- an **engine** (vLLM, SGLang, TGI, TensorRT-LLM, or any program whose environment configures JAX):
  its claim, with the policy's allowances;
- a program in :data:`~vramguard.engines.launchers.NON_GPU_PROGRAMS` (``sleep``, ``tail``, ``curl``,
  ``nginx``, ...) or Ray's daemons: nothing;
- **any other program**: it may use the GPU, and nobody can say how much.

Then, phase by phase (what runs at the same time, see :mod:`vramguard.demand.shell`), the engines of
a phase add up, and the container claims its largest phase. A phase in which an
engine runs beside another program that may use the GPU, or beside copies of itself started in a
loop, has unknown VRAM: counting the engine alone would under-count, and a finding names the
program and how to declare the container's total. A program that runs alone, before the engine
(``python download.py && vllm serve ...``), is a set-up step and is not counted. MPS limits bind
each client process: a phase holds the sum of its processes' limits, known only if each has one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from vramguard import engines
from vramguard.codecs import VRAM_ANNOTATION, vram_annotation
from vramguard.demand.allowances import AllowanceTable, with_allowances
from vramguard.demand.commandline import Budget, ContainerEnv, Unreadable, container_argvs
from vramguard.demand.model import Allowance, EngineClaim, Vram
from vramguard.demand.mps import NO_MPS, MpsSettings, read_mps
from vramguard.demand.shell import Invocation, Launch, launch
from vramguard.engines import jax
from vramguard.engines.base import Findings
from vramguard.engines.launchers import program, uses_no_gpu
from vramguard.quantity import excerpt

RAY_SCRIPTS = ("multi-node-serving.sh",)
"""vLLM's documented launcher of a Ray cluster across a LeaderWorkerSet group."""
MAX_GPU_PROCESSES = 64
"""Programs that may use the GPU one container may start; more is not read (unknown VRAM)."""
_ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "jax": "JAX", "tensorrt-llm": "TensorRT-LLM"}


def engine_title(engine: str) -> str:
    """How messages name an engine (``vllm`` -> ``vLLM``); an unknown name as it is."""
    return _ENGINE_TITLES.get(engine, engine)


@dataclass(frozen=True, slots=True)
class Reading:
    """What the container's command line says about its VRAM."""

    claim: EngineClaim | None
    """The engines' claim (``vram`` ``None`` when unknown); ``None`` when no engine runs."""
    mps: MpsSettings
    refused: bool = False
    """The command line was not read to its end; a warning says why."""


@dataclass(frozen=True, slots=True)
class _Process:
    claim: EngineClaim | None = None
    unknown: str | None = None
    """A program that may use the GPU, not recognised: its command line, shortened."""
    mps: MpsSettings = NO_MPS
    repeated: bool = False

    @property
    def uses_gpu(self) -> bool:
        return self.claim is not None or self.unknown is not None


_NO_GPU = _Process()


def read_command(
    container: Mapping[str, Any], env: ContainerEnv, image: str, gpus: int, found: Findings,
    table: AllowanceTable, budget: Budget,
) -> Reading:
    """Read the processes the container runs and what they claim together (findings into ``found``)."""
    reader = _Reader(image, gpus, found, table)
    try:
        argv = _argv(container, env, image, budget)
    except Unreadable as exc:
        walked: Launch[_Process] = Launch(refusal=str(exc))
    else:
        walked = launch(argv, env, reader.classify, budget)
    if walked.refusal is not None:
        declare = f"declare it, e.g. {vram_annotation(found.container)}: 16Gi"
        found.warn(f"{walked.refusal}, so its VRAM is unknown; {declare}")
        first = next((p.claim for p in reader.processes if p.claim is not None), None)
        claim = replace(first, vram=None, implicit_default=False, default_warning=None) if first else None
        return Reading(claim, MpsSettings(sm_percent=read_mps(env, gpus, found).sm_percent), refused=True)
    if not any(p.uses_gpu for p in reader.processes):
        # No program that may use the GPU (no command at all, or only ``sleep``): the container's
        # own environment says what a process started in it later would use.
        claim = _with_allowances(jax.claim(env, found.container), table) if jax.applies(env) else None
        if claim is not None:
            _record(claim, found)
        return Reading(claim, read_mps(env, gpus, found))
    return _combine(walked, reader, found)


def _argv(container: Mapping[str, Any], env: ContainerEnv, image: str, budget: Budget) -> list[str]:
    """The argument vector the runtime executes: ``command + args``, else the image's known
    entrypoint with ``args``, else ``args`` (an image without ENTRYPOINT runs them as the command)."""
    command, args = container_argvs(container, env, budget)
    if command:
        return command + args
    entrypoint = engines.image_entrypoint(image)
    return [*entrypoint, *args] if entrypoint is not None else args


class _Reader:
    """Reads each process as the walk starts it."""

    def __init__(self, image: str, gpus: int, found: Findings, table: AllowanceTable) -> None:
        self.image = image
        self.gpus = gpus
        self.found = found
        self.table = table
        self.processes: list[_Process] = []
        self.ray = False
        """A process starts or joins a Ray cluster, which may span pods."""

    def classify(self, invocation: Invocation) -> _Process:
        argv = invocation.argv
        if _starts_ray(argv):
            self.ray = True
            return _NO_GPU
        if uses_no_gpu(argv):
            return _NO_GPU
        if len(self.processes) >= MAX_GPU_PROCESSES:
            raise Unreadable(f"it starts more than {MAX_GPU_PROCESSES} programs that may use the GPU")
        env = invocation.env
        name = self.found.container
        claim = engines.recognise(argv, env, self.image, name)
        if claim is None and jax.applies(env):
            claim = jax.claim(env, name)
        if claim is not None:
            claim = _with_allowances(claim, self.table)
            _record(claim, self.found)
        unknown = None if claim is not None else excerpt(" ".join(argv))
        process = _Process(claim, unknown, read_mps(env, self.gpus, self.found), invocation.repeated)
        self.processes.append(process)
        return process


def _with_allowances(claim: EngineClaim, table: AllowanceTable) -> EngineClaim:
    return replace(claim, vram=with_allowances(claim.vram, claim.engine, claim.overheads, table))


def _record(claim: EngineClaim, found: Findings) -> None:
    found.evidence.extend(claim.evidence)
    found.warnings.extend(claim.warnings)
    found.errors.extend(claim.errors)


def _combine(walked: Launch[_Process], reader: _Reader, found: Findings) -> Reading:
    """The largest phase's claim, and the largest phase's MPS limits (see the module docstring)."""
    phases = _gpu_phases(walked)
    worst: EngineClaim | None = None
    why_unknown: str | None = None
    for members in phases:
        claims = [p.claim for p in members if p.claim is not None]
        if not claims:
            continue  # a set-up step, or programs vramguard does not know running without an engine
        why_unknown = why_unknown or _why_unknown(members, engine_title(claims[0].engine), found.container)
        claim = claims[0] if len(claims) == 1 else _together(claims, found)
        if worst is None or _claim_size(claim) > _claim_size(worst):
            worst = claim
    if worst is not None and why_unknown is not None:
        found.warn(why_unknown)
        worst = replace(worst, vram=None, implicit_default=False, default_warning=None)
    if worst is not None and reader.ray and worst.parallel is not None:
        worst = replace(worst, parallel=replace(worst.parallel, ray=True))
    sm = [p.mps.sm_percent for p in reader.processes if p.mps.sm_percent is not None]
    return Reading(worst, MpsSettings(_mps_limit(phases), max(sm, default=None)))


def _gpu_phases(walked: Launch[_Process]) -> list[list[_Process]]:
    """The processes that may use the GPU of each phase, each set of them once."""
    # The background ones by position: a phase's are a slice of them.
    started = [index for index, process in enumerate(walked.started) if process.uses_gpu]
    phases: dict[tuple[int, ...], list[_Process]] = {}
    for phase in walked.phases:
        window = started[bisect_left(started, phase.since):bisect_left(started, phase.until)]
        members = [walked.started[index] for index in window]
        members += [process for process in phase.foreground if process.uses_gpu]
        if members:
            phases.setdefault(tuple(map(id, members)), members)
    return list(phases.values())


def _why_unknown(members: Sequence[_Process], title: str, container: str) -> str | None:
    """Why a phase in which an engine runs has unknown VRAM, if it has."""
    unknown = f"so its VRAM is unknown; declare the container's total, e.g. {vram_annotation(container)}: 40Gi"
    stranger = next((p.unknown for p in members if p.unknown is not None), None)
    if stranger is not None:
        return f"{stranger} may use the GPU while {title} runs, and vramguard cannot tell how much, {unknown}"
    if any(p.repeated and p.claim is not None for p in members):
        return f"starts {title} in the background inside a loop, so any number may run at once, {unknown}"
    return None


def _mps_limit(phases: Sequence[Sequence[_Process]]) -> int | None:
    """The largest sum of the phases' MPS limits; ``None`` when a process of any phase has none
    (or may run many times at once)."""
    largest = 0
    for members in phases:
        limits = [p.mps.limit_bytes for p in members]
        if any(limit is None for limit in limits) or any(p.repeated for p in members):
            return None
        largest = max(largest, sum(limit for limit in limits if limit is not None))
    return largest or None


def _together(claims: Sequence[EngineClaim], found: Findings) -> EngineClaim:
    """Several engine processes running at once in one container: their shares and allowances add up."""
    found.warn(
        f"starts {len(claims)} engine processes that run at once; vramguard counts their VRAM summed; "
        f"if only one runs, declare {VRAM_ANNOTATION}"
    )
    first = max(claims, key=_claim_size)
    vrams = [c.vram for c in claims]
    if any(v is None for v in vrams):
        return replace(first, vram=None)
    fraction = sum((v.fraction for v in vrams if v is not None and v.fraction is not None), Fraction(0))
    extra = tuple(
        Allowance(f"{engine_title(c.engine)} process share", c.vram.bytes, "another engine process in the container")
        for c in claims if c.vram is not None and c.vram.bytes is not None
    )
    allowances = tuple(a for v in vrams if v is not None for a in v.allowances)
    if fraction > 1:
        found.error(f"its engine processes together claim {float(fraction):g} of the GPU, more than all of it")
    if fraction == 0:
        vram = Vram(bytes=extra[0].bytes, allowances=extra[1:] + allowances)
    else:
        vram = Vram(fraction=min(fraction, Fraction(1)), allowances=extra + allowances)
    return replace(first, vram=vram, implicit_default=any(c.implicit_default for c in claims))


def _starts_ray(argv: Sequence[str]) -> bool:
    """Whether a process joins or starts a Ray cluster (``ray start``, vLLM's multi-node script)."""
    if program(argv) == "ray" and list(argv[1:2]) == ["start"]:
        return True
    return bool(argv) and (argv[0].endswith(RAY_SCRIPTS) or (len(argv) > 1 and argv[1].endswith(RAY_SCRIPTS)))


def _claim_size(claim: EngineClaim) -> tuple[bool, Fraction]:
    """An order of claims by size; an unknown claim (which holds a whole GPU) is the largest."""
    vram = claim.vram
    if vram is None:
        return True, Fraction(0)
    return False, vram.fraction if vram.fraction is not None else Fraction(vram.bytes or 0, 1 << 40)
