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

Other settings put memory outside the fraction (jaxlib 0.10.2 and XLA's ``se_gpu_pjrt_client.cc``,
``gpu_helpers.cc``): ``TF_FORCE_UNIFIED_MEMORY`` lets the fraction exceed the device (oversubscription);
``XLA_FLAGS`` may add an allocator of its own (``--xla_gpu_enable_nccl_user_buffers``, a collective
pool beside the main one; ``--xla_gpu_temp_buffer_use_separate_color``, one of fraction 1.0;
``--xla_gpu_command_buffer_update_mode``, the VMM allocator); ``JAX_PJRT_CLIENT_CREATE_OPTIONS``
replaces the plugin's options, the fraction among them. Any of these set, or any of the variables
above set from a source vramguard cannot read, makes the VRAM unknown.
"""

from __future__ import annotations

from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Overheads, Vram
from vramguard.engines.base import Findings, env_flag, hidden_settings

NAME = "jax"
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
UNIFIED_MEMORY = "TF_FORCE_UNIFIED_MEMORY"
XLA_FLAGS = "XLA_FLAGS"
CREATE_OPTIONS = "JAX_PJRT_CLIENT_CREATE_OPTIONS"
ALL_VARIABLES = (*FRACTION_VARIABLES, PREALLOCATE, ALLOCATOR)
CAP_VARIABLES = (ALLOCATOR, UNIFIED_MEMORY, XLA_FLAGS, CREATE_OPTIONS)
"""Variables that can lift or bypass the fraction: unknown VRAM when the spec does not show them."""
OUTSIDE_FLAGS = (
    "--xla_gpu_enable_nccl_user_buffers", "--xla_gpu_temp_buffer_use_separate_color",
    "--xla_gpu_command_buffer_update_mode",
)
"""``XLA_FLAGS`` entries that allocate device memory outside the fraction's allocator."""
FALSE_VALUES = ("false", "False", "0")
"""What ``XLA_PYTHON_CLIENT_PREALLOCATE`` reads as off (``jaxlib/xla_client.py``: ``preallocate not in
('false', 'False', '0')``); any other value preallocates."""
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
    platform = (env.literal(ALLOCATOR) or "").strip().lower() == "platform"
    on_demand = (env.literal(PREALLOCATE) or "").strip() in FALSE_VALUES
    outside = _outside_the_fraction(env)
    vram: Vram | None
    if platform:
        found.evidence.append(f"{ALLOCATOR}=platform")
        found.warn(
            f"JAX's platform allocator has no cap, so its peak VRAM is unknown; declare it with {VRAM_ANNOTATION}"
        )
        vram = None
    elif outside is not None:
        found.evidence.append(outside)
        found.warn(
            f"{outside}: JAX holds memory outside its fraction there, so its peak VRAM is unknown; declare it "
            f"with {VRAM_ANNOTATION}"
        )
        vram = None
    elif unreadable or hidden_settings(env, CAP_VARIABLES, "JAX", found):
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


def _outside_the_fraction(env: ContainerEnv) -> str | None:
    """The literal setting that puts device memory outside the fraction's allocator, if any."""
    unified = (env.literal(UNIFIED_MEMORY) or "").strip().lower()
    if unified in ("1", "true"):
        return f"env {UNIFIED_MEMORY}={unified}"
    options = env.literal(CREATE_OPTIONS)
    if options is not None and options.strip():
        return f"env {CREATE_OPTIONS}={options.strip()[:64]}"
    flags = env.literal(XLA_FLAGS) or ""
    for word in flags.split():
        name, _, value = word.partition("=")
        if name in OUTSIDE_FLAGS and value.strip().lower() not in ("false", "0", "always_update"):
            return f"XLA_FLAGS {word[:96]}"
    return None
