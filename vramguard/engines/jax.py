"""JAX / XLA: pre-allocation controlled by environment variables, whatever the program is.

JAX pre-allocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (newer releases: ``XLA_CLIENT_MEM_FRACTION``)
of the GPU at its first operation, 0.75 by default. ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` make it allocate on demand: the peak is then unknown.
JAX is recognised only through these variables, since ``python train.py`` says nothing.
"""

from __future__ import annotations

from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Vram
from vramguard.engines.base import Findings, env_flag

NAME = "jax"
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
ALL_VARIABLES = (*FRACTION_VARIABLES, PREALLOCATE, ALLOCATOR)


def applies(env: ContainerEnv) -> bool:
    """Whether the container's environment configures JAX's GPU memory."""
    return any(name in env.values for name in ALL_VARIABLES)


def claim(env: ContainerEnv, container: str) -> EngineClaim:
    """What a JAX process with this environment pre-allocates on each GPU."""
    found = Findings.for_container(container)
    fractions: list[Fraction] = []
    for name in FRACTION_VARIABLES:
        flag = env_flag(env, name, found)
        if flag is not None:
            value = found.fraction(flag)
            if value is not None:
                fractions.append(value)
    on_demand = _is_false(env.literal(PREALLOCATE)) or (env.literal(ALLOCATOR) or "") == "platform"
    vram: Vram | None
    if fractions:
        if len(set(fractions)) > 1:
            found.warn(f"{' and '.join(FRACTION_VARIABLES)} disagree; counting the larger")
        vram = Vram(fraction=max(fractions))
    elif on_demand:
        found.evidence.append(f"{PREALLOCATE}={env.literal(PREALLOCATE)}" if _is_false(
            env.literal(PREALLOCATE)) else f"{ALLOCATOR}=platform")
        found.warn(
            f"JAX allocates on demand, so its peak VRAM is unknown; declare it with {VRAM_ANNOTATION}"
        )
        vram = None
    else:
        found.evidence.append("JAX default pre-allocation 0.75")
        vram = Vram(fraction=Fraction(3, 4))
    implicit = not fractions and not on_demand
    return EngineClaim(
        NAME, vram, None, tuple(found.evidence), tuple(found.warnings), tuple(found.errors), implicit, env_only=True
    )


def _is_false(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("false", "0", "no", "off")
