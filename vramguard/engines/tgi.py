"""Hugging Face Text Generation Inference: ``text-generation-launcher`` (the image's entrypoint).

``--cuda-memory-fraction`` (or env ``CUDA_MEMORY_FRACTION``; the flag wins, as clap reads the
environment only for absent flags) defaults to 1.0: the whole GPU. clap takes long options whole (no
``infer_long_args``) and refuses one given twice. ``--num-shard`` (env
``NUM_SHARD``) is the number of GPUs; without it TGI shards over every GPU it can see.

The fraction is a **ceiling on the device**, not a share of its own: at warm-up TGI sizes its KV
cache from ``max(0, free - (1 - fraction x wiggle room) x total)``
(``server/text_generation_server/utils/import_utils.py`` ``get_cuda_free_memory``, called from
``models/flash_causal_lm.py``; v3.0.0-v3.3.7), where *free* counts every process on the device. So
it fills the device up to that fraction of its total, co-tenants included: started after them it
gets the fraction less what they hold, and a second TGI at 0.45 beside a first gets nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Overheads, Parallel, Vram
from vramguard.engines.base import Findings, Options, env_flag, hidden_settings
from vramguard.engines.launchers import program

NAME = "tgi"
LAUNCHER = "text-generation-launcher"
ENTRYPOINT_SCRIPTS = frozenset({"tgi-entrypoint.sh"})
"""TGI's own image runs the launcher through this script, which passes its arguments on."""
MEMORY_FRACTION = ("--cuda-memory-fraction",)
MEMORY_FRACTION_ENV = "CUDA_MEMORY_FRACTION"
NUM_SHARD = ("--num-shard",)
NUM_SHARD_ENV = "NUM_SHARD"
DEFAULT_FRACTION = Fraction(1)
CEILING_RULE = (
    "TGI's --cuda-memory-fraction caps the whole device's use, co-tenants included (its context and "
    "CUDA graphs are inside it); it counts at least half a device, so that no two share one "
    "(text-generation-inference v3.x, server/text_generation_server/utils/import_utils.py "
    "get_cuda_free_memory)"
)


def arguments(argv: Sequence[str]) -> list[str] | None:
    """The launcher's arguments if ``argv`` starts TGI, else ``None``."""
    if program(argv) == LAUNCHER or program(argv) in ENTRYPOINT_SCRIPTS:
        return list(argv[1:])
    return None


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """What TGI started with ``args`` will reserve on each of its GPUs."""
    del image
    found = Findings.for_container(container)
    options = Options(args)
    options.report_misspellings((*MEMORY_FRACTION, *NUM_SHARD), "TGI's launcher", '"unexpected argument"', found)
    for name in options.repeated((*MEMORY_FRACTION, *NUM_SHARD)):
        # clap 4 without args_override_self (launcher/src/main.rs, v2.0.0 to v3.3.7): no last-one-wins.
        found.error(f"{name} is given twice: TGI's launcher exits at start (\"cannot be used multiple times\")")
    flag = options.last(MEMORY_FRACTION) or env_flag(env, MEMORY_FRACTION_ENV, found)
    vram: Vram | None
    implicit = flag is None
    if flag is None and hidden_settings(env, (MEMORY_FRACTION_ENV,), "TGI", found):
        # clap reads every launcher option from its upper-case variable when the flag is absent.
        vram, implicit = None, False
    elif flag is None:
        found.evidence.append("TGI default --cuda-memory-fraction 1.0")
        found.relies_on_default(
            f"container {container} relies on TGI's default --cuda-memory-fraction (1.0: the whole "
            "GPU); set it explicitly to share the GPU"
        )
        vram = Vram(fraction=DEFAULT_FRACTION, ceiling=True)
    else:
        fraction = found.fraction(flag)
        overridden = found.overridden(flag if flag.position >= 0 else None, options, "TGI")
        vram = Vram(fraction=fraction, ceiling=True) if fraction is not None and not overridden else None
    shards = options.last(NUM_SHARD) or env_flag(env, NUM_SHARD_ENV, found)
    count = found.count(shards) if shards is not None else None
    parallel = Parallel(count, (shards.evidence(),)) if shards is not None and count is not None else None
    return EngineClaim(
        NAME, vram, parallel, tuple(found.evidence), tuple(found.warnings), tuple(found.errors), implicit,
        default_warning=found.default_warning, overheads=Overheads(rules=(CEILING_RULE,)),
    )

