"""JAX / XLA: pre-allocation controlled by environment variables, whatever the program is.

JAX pre-allocates ``XLA_CLIENT_MEM_FRACTION`` (the older ``XLA_PYTHON_CLIENT_MEM_FRACTION``) of the
device's *total* memory at its first operation, 0.75 by default (since jaxlib 0.4.1). Setting both
makes jaxlib raise ("XLA_CLIENT_MEM_FRACTION is specified together with
XLA_PYTHON_CLIENT_MEM_FRACTION", ``jaxlib/xla_client.py`` ``generate_pjrt_gpu_plugin_options``,
jax v0.6.0-v0.9.0), and the value is read with ``float()``, so XLA's newer ``START+`` and
``START-CAP`` forms are refused there too. ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` allocates on
demand but keeps the fraction as the allocator's cap (``allow_growth``, ``xla/pjrt/gpu/gpu_helpers.cc``
``CreateBFCAllocator``): a bound, counted as the fraction. ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``
bypasses the allocator and its cap: the peak is then unknown. JAX is recognised only through these
variables, since ``python train.py`` says nothing.
"""

from __future__ import annotations

from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Overheads, Vram
from vramguard.engines.base import Findings, env_flag

NAME = "jax"
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
ALL_VARIABLES = (*FRACTION_VARIABLES, PREALLOCATE, ALLOCATOR)
DEFAULT_FRACTION = Fraction(3, 4)
RULE = (
    "the fraction is of the device's total memory, pre-allocated or, with preallocation off, the cap "
    "of on-demand growth (jax v0.4.1+, jaxlib/xla_client.py; xla/pjrt/gpu/gpu_helpers.cc)"
)


def applies(env: ContainerEnv) -> bool:
    """Whether the container's environment configures JAX's GPU memory."""
    return any(name in env.values for name in ALL_VARIABLES)


def claim(env: ContainerEnv, container: str) -> EngineClaim:
    """What a JAX process with this environment pre-allocates (or may grow to) on each GPU."""
    found = Findings.for_container(container)
    fractions: list[Fraction] = []
    flags = [flag for name in FRACTION_VARIABLES if (flag := env_flag(env, name, found)) is not None]
    # A fraction set from a Secret, or by an envFrom source or a sourced file, may be any value.
    unreadable = any(env.is_opaque(name) for name in FRACTION_VARIABLES)
    for name in FRACTION_VARIABLES:
        if name not in env.values and env.is_opaque(name):
            found.warn(f"env {name} may be set by {', '.join(env.opaque_sources)}, which vramguard cannot read")
    for flag in flags:
        value = found.fraction(flag)
        if value is None:
            unreadable = True
        else:
            fractions.append(value)
    if len(flags) > 1:
        found.error(
            f"sets both {' and '.join(FRACTION_VARIABLES)}: jaxlib refuses to start (\"XLA_CLIENT_MEM_FRACTION "
            "is specified together with XLA_PYTHON_CLIENT_MEM_FRACTION\"); remove the latter"
        )
    platform = (env.literal(ALLOCATOR) or "") == "platform"
    on_demand = _is_false(env.literal(PREALLOCATE))
    vram: Vram | None
    if platform:
        found.evidence.append(f"{ALLOCATOR}=platform")
        found.warn(
            f"JAX's platform allocator has no cap, so its peak VRAM is unknown; declare it with {VRAM_ANNOTATION}"
        )
        vram = None
    elif unreadable:
        vram = None
    else:
        if not fractions:
            found.evidence.append("JAX default memory fraction 0.75")
        if on_demand:
            found.evidence.append(f"{PREALLOCATE}={env.literal(PREALLOCATE)}: grows on demand up to the fraction")
        vram = Vram(fraction=max(fractions, default=DEFAULT_FRACTION))
    implicit = not fractions and vram is not None
    return EngineClaim(
        NAME, vram, None, tuple(found.evidence), tuple(found.warnings), tuple(found.errors), implicit, env_only=True,
        overheads=Overheads(rules=(RULE,)),
    )


def _is_false(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("false", "0", "no", "off")
