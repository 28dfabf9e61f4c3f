"""From a pod (or a workload's pod template) to what each GPU container will reserve per GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from vramguard import engines
from vramguard.codecs import VRAM_ANNOTATION, is_vramguard_key, vram_annotation
from vramguard.demand.allowances import DEFAULT_TABLE, AllowanceTable, with_allowances
from vramguard.demand.annotations import declared_vram
from vramguard.demand.commandline import ContainerEnv, container_argvs, container_env, invocations
from vramguard.demand.model import (
    Allowance,
    ContainerDemand,
    EngineClaim,
    Parallel,
    PodDemand,
    Vram,
    claim_conflicts,
)
from vramguard.demand.mps import read_mps
from vramguard.engines import jax
from vramguard.engines.base import Findings, parse_positive_int
from vramguard.engines.launchers import program
from vramguard.quantity import QuantityError, parse_quantity

DEFAULT_GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared")
DEFAULT_GPU_RESOURCE_PREFIXES = ("nvidia.com/mig-",)
GROUP_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
"""Set by LeaderWorkerSet on each pod of a group: the number of pods one engine spans."""


RAY_SCRIPTS = ("multi-node-serving.sh",)
"""vLLM's documented launcher of a Ray cluster across a LeaderWorkerSet group."""
MAX_DEVICES = 1024
"""The most GPU devices one pod may hold, per container and in all: more than any node hands out
(8 GPUs x 128 time-slicing replicas; 8 x 16 is already rare, MIG gives at most 7 per GPU). Every
later step makes one claim per device, so this bounds what an absurd request costs."""


def reads_annotation(key: object) -> bool:
    """Whether demand reads the annotation ``key``: vramguard's own, and the LeaderWorkerSet group
    size (the pods a multi-node engine spans). Slimmed objects and template keys keep exactly these."""
    return is_vramguard_key(key) or key == GROUP_SIZE_ANNOTATION


@dataclass(frozen=True, slots=True)
class DemandOptions:
    """Which extended resources are GPUs (exact names, and prefixes such as ``nvidia.com/mig-``)."""

    gpu_resources: frozenset[str] = frozenset(DEFAULT_GPU_RESOURCES)
    gpu_resource_prefixes: tuple[str, ...] = DEFAULT_GPU_RESOURCE_PREFIXES
    allowances: AllowanceTable = DEFAULT_TABLE
    """The bytes of each allowance an engine's processes hold beside its share (the policy's)."""

    def is_gpu(self, resource: str) -> bool:
        """Whether ``resource`` names a GPU device (a whole GPU, a replica or a MIG instance)."""
        return resource in self.gpu_resources or resource.startswith(self.gpu_resource_prefixes)


DEFAULT_OPTIONS = DemandOptions()


def derive_pod_demand(
    pod: Mapping[str, Any], options: DemandOptions = DEFAULT_OPTIONS, group_size: int | None = None
) -> PodDemand:
    """The GPU demand of a pod or pod template (a mapping with ``metadata`` and ``spec``).

    ``group_size`` is the number of pods one engine spans (a LeaderWorkerSet's ``size``), when the
    workload says; a pod of a LeaderWorkerSet says it itself in its ``size`` annotation.
    Never raises on malformed input: what cannot be read becomes an error or a warning.
    """
    metadata = pod.get("metadata")
    annotations = _string_map(metadata.get("annotations") if isinstance(metadata, dict) else None)
    if group_size is None:
        group_size = parse_positive_int(annotations.get(GROUP_SIZE_ANNOTATION, ""))
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return PodDemand()
    containers: list[ContainerDemand] = []
    for field_name, is_init_list in (("initContainers", True), ("containers", False)):
        entries = spec.get(field_name)
        if not isinstance(entries, list):
            continue
        for container in entries:
            if not isinstance(container, dict):
                continue
            # A sidecar (an init container that restarts) runs beside the app containers.
            init = is_init_list and container.get("restartPolicy") != "Always"
            demand = derive_container_demand(container, annotations, init, options, group_size)
            if demand is not None:
                containers.append(demand)
    errors = [e for c in containers for e in c.errors]
    warnings = [w for c in containers for w in c.warnings]
    return PodDemand(tuple(containers), tuple(errors), tuple(warnings))


def derive_container_demand(
    container: Mapping[str, Any],
    annotations: Mapping[str, str],
    init: bool = False,
    options: DemandOptions = DEFAULT_OPTIONS,
    group_size: int | None = None,
) -> ContainerDemand | None:
    """The demand of one container, or ``None`` when it asks for no GPU resource."""
    raw_name = container.get("name")
    name = raw_name if isinstance(raw_name, str) else "<unnamed>"
    found = Findings.for_container(name)
    requested = _gpu_request(container, options, found)
    if requested is None:
        return None
    resource, gpus = requested
    env = container_env(container)
    raw_image = container.get("image")
    image = raw_image if isinstance(raw_image, str) else ""

    claim = _engine_claim(container, env, image, name, found, options.allowances)
    if claim is not None:
        found.evidence.extend(claim.evidence)
        found.warnings.extend(claim.warnings)
        found.errors.extend(claim.errors)
        if claim.parallel is not None:
            _check_parallel(claim, claim.parallel, resource, gpus, group_size, found)
    mps = read_mps(env, gpus, found)
    declared = declared_vram(annotations, name, found)
    if env.opaque_sources and claim is None and declared is None:
        found.warn(
            f"envFrom ({', '.join(env.opaque_sources)}) may set engine variables vramguard cannot see"
        )
    engine = claim.engine if claim is not None else None
    vram = claim.vram if claim is not None else None
    # No reservation: no declaration, no MPS limit and no claim (see ContainerDemand.reservation).
    if declared is None and mps.limit_bytes is None and claim is None and not found.errors:
        found.warn(
            f"no known engine and no {VRAM_ANNOTATION} annotation, so its VRAM is unknown; "
            f"declare it, e.g. {vram_annotation(name)}: 16Gi"
        )
    found.errors.extend(claim_conflicts(name, engine, vram, declared, mps.limit_bytes, None))
    # Built once, with its findings: a frozen dataclass of 15 fields is not cheap to copy.
    return ContainerDemand(
        name=name,
        resource=resource,
        gpus=gpus,
        init=init,
        engine=engine,
        claim=vram,
        declared=declared,
        mps_limit=mps.limit_bytes,
        sm_percent=mps.sm_percent,
        implicit_default=claim.implicit_default if claim is not None else False,
        default_warning=claim.default_warning if claim is not None else None,
        env_only=claim.env_only if claim is not None else False,
        engine_version=claim.version if claim is not None else None,
        rules=claim.overheads.rules if claim is not None else (),
        evidence=tuple(found.evidence),
        warnings=tuple(dict.fromkeys(found.warnings)),
        errors=tuple(dict.fromkeys(found.errors)),
    )


def _check_parallel(
    claim: EngineClaim, parallel: Parallel, resource: str, gpus: int, group_size: int | None, found: Findings
) -> None:
    """Check the engine's parallel sizes against the GPUs the container asks for.

    An engine spread over several pods (``--nnodes``, a LeaderWorkerSet group) uses on each pod its
    total parallel size divided by the pods; a Ray executor may span pods the spec does not show,
    so a total that is a whole multiple of the container's GPUs is accepted with a warning.
    """
    title = _ENGINE_TITLES.get(claim.engine, claim.engine)
    nodes = parallel.nodes or group_size
    if nodes is not None and nodes > 1:
        source = parallel.nodes_flag or f"a group of {nodes} pods"
        if parallel.total % nodes == 0 and parallel.total // nodes == gpus:
            return
        if parallel.total % nodes:
            found.error(
                f"{title}: {parallel.describe()}, which {source} cannot split evenly over {nodes} pods"
            )
            return
        found.error(
            f"{title}: {parallel.describe()} over {source} = {parallel.total // nodes} per pod, "
            f"but the container requests {gpus} {resource}; make them equal"
        )
        return
    if parallel.total == gpus:
        return
    if parallel.ray and parallel.total > gpus and parallel.total % gpus == 0:
        found.warn(
            f"{title}: {parallel.describe()} through Ray, so vramguard assumes the engine spans "
            f"{parallel.total // gpus} pods of {gpus} {resource}"
        )
        return
    found.error(
        f"{title}: {parallel.describe()}, but the container requests {gpus} {resource}; make them equal"
    )


_ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "jax": "JAX", "tensorrt-llm": "TensorRT-LLM"}


def engine_title(engine: str) -> str:
    """How messages name an engine (``vllm`` -> ``vLLM``); an unknown name as it is."""
    return _ENGINE_TITLES.get(engine, engine)


def _gpu_request(
    container: Mapping[str, Any], options: DemandOptions, found: Findings
) -> tuple[str, int] | None:
    """The GPU resource and device count a container asks for (limits, else requests)."""
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return None
    asked: dict[str, Any] = {}
    for section in ("requests", "limits"):  # limits last: they are what the device plugin honours
        values = resources.get(section)
        if isinstance(values, dict):
            for key, value in values.items():
                if isinstance(key, str) and options.is_gpu(key):
                    asked[key] = value
    if not asked:
        return None
    if len(asked) > 1:
        found.error(f"asks for several GPU resources ({', '.join(sorted(asked))}); use one")
    resource, raw = next(iter(asked.items())) if len(asked) == 1 else sorted(asked.items())[0]
    count = _device_count(raw)
    if count is None:
        found.error(f"{resource}: {raw!r} is not a whole number of devices")
        return resource, 1
    if count == 0:
        return None
    if count > MAX_DEVICES:
        # No node offers that many; capping keeps every later step (one claim per device) bounded.
        found.error(f"{resource}: {raw} devices is more than any node offers (at most {MAX_DEVICES})")
        return resource, MAX_DEVICES
    return resource, count


def _device_count(raw: Any) -> int | None:
    """A quantity of devices as a whole number; ``None`` when it is not one (``0.5``, ``-1``, ``x``)."""
    if type(raw) is int:  # the common cases first: JSON numbers and plain digit strings
        return raw if raw >= 0 else None
    if type(raw) is str and raw.isascii() and raw.isdigit():
        return int(raw)
    try:
        value = parse_quantity(str(raw))
    except QuantityError:
        return None
    if value.denominator != 1 or value < 0:
        return None
    return int(value)


def _engine_claim(
    container: Mapping[str, Any], env: ContainerEnv, image: str, name: str, found: Findings,
    table: AllowanceTable,
) -> EngineClaim | None:
    command, args = container_argvs(container, env)
    candidates: list[Sequence[str]] = []
    if command:
        candidates.append(command + args)
    else:
        entrypoint = engines.image_entrypoint(image)
        if entrypoint is not None:
            candidates.append([*entrypoint, *args])
        elif args:
            candidates.append(args)  # an image without ENTRYPOINT runs its args as the command
    # Every process the candidates start, read once (a shell script is tokenised once).
    processes = [invocation for argv in candidates for invocation in invocations(argv, env)]
    claims: list[EngineClaim] = []
    for invocation in processes:
        claim = engines.recognise(invocation.argv, invocation.env, image, name)
        if claim is not None:
            claims.append(claim)
    if not claims:
        claims = [jax.claim(env, name)] if jax.applies(env) else []
    if not claims:
        return None
    if any(_starts_ray(invocation.argv) for invocation in processes):
        claims = [
            replace(c, parallel=replace(c.parallel, ray=True)) if c.parallel is not None else c for c in claims
        ]
    claims = [replace(c, vram=with_allowances(c.vram, c.engine, c.overheads, table)) for c in claims]
    return claims[0] if len(claims) == 1 else _together(claims, found)


def _together(claims: Sequence[EngineClaim], found: Findings) -> EngineClaim:
    """Several engine processes in one container, counted as running at once: their shares and
    allowances add up (a script may start them in the background, or choose one by a condition
    vramguard cannot evaluate; the sum is the worst case of both)."""
    found.warn(
        f"starts {len(claims)} engine processes; vramguard counts them as running together "
        f"(their VRAM summed); if only one runs, declare {VRAM_ANNOTATION}"
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


def _claim_size(claim: EngineClaim) -> Fraction:
    if claim.vram is None or claim.vram.fraction is None:
        return Fraction(-1) if claim.vram is None else Fraction(claim.vram.bytes or 0, 1 << 40)
    return claim.vram.fraction


def _string_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
