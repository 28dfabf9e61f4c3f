"""SGLang: ``python -m sglang.launch_server`` / ``sglang serve``.

``--mem-fraction-static`` is the share of GPU memory for weights and the KV cache pool; without it
SGLang computes a default from the GPU's size and the parallel layout, which the spec cannot show.
"""

from __future__ import annotations

from collections.abc import Sequence

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Vram
from vramguard.engines.base import Findings, Options, parallel_layout
from vramguard.engines.launchers import program, python_module

NAME = "sglang"
PROGRAM = "sglang"
"""The console script: ``sglang serve``."""
MODULES = frozenset({"sglang.launch_server"})
MEM_FRACTION = ("--mem-fraction-static",)
TENSOR = ("--tp-size", "--tp", "--tensor-parallel-size")
PIPELINE = ("--pp-size", "--pipeline-parallel-size")
DATA = ("--dp-size", "--dp", "--data-parallel-size")
DP_ATTENTION = ("--enable-dp-attention",)
NODES = ("--nnodes",)
"""Multi-node serving: ``--tp`` is the total over ``--nnodes`` pods (``--node-rank`` 0 to n-1)."""


def arguments(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments if ``argv`` starts SGLang, else ``None``."""
    if program(argv) == PROGRAM and len(argv) > 1 and argv[1] == "serve":
        return list(argv[2:])
    module = python_module(argv)
    if module is not None and module[0] in MODULES:
        return module[1]
    return None


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """What SGLang started with ``args`` will reserve on each of its GPUs."""
    del env, image
    found = Findings.for_container(container)
    options = Options(args)
    sizes = (TENSOR, PIPELINE) + (() if options.has(DP_ATTENTION) else (DATA,))
    parallel = parallel_layout(options, sizes, found, NODES)
    fraction_flag = options.last(MEM_FRACTION)
    vram: Vram | None = None
    if fraction_flag is None:
        found.warn(
            "relies on SGLang's default --mem-fraction-static, which depends on the GPU's size; "
            f"set it explicitly or declare {VRAM_ANNOTATION}"
        )
    else:
        fraction = found.fraction(fraction_flag)
        vram = Vram(fraction=fraction) if fraction is not None else None
    return EngineClaim(
        NAME, vram, parallel, tuple(found.evidence), tuple(found.warnings), tuple(found.errors)
    )
