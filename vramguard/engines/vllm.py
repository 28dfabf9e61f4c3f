"""vLLM: ``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``, the ``vllm-openai`` image.

vLLM pre-allocates ``--gpu-memory-utilization`` × the device's *total* memory on every GPU it uses,
whatever else runs there. It uses tensor × pipeline × prefill-context parallel × local data parallel
GPUs, in total over the ``--nnodes`` pods (or the Ray cluster) it spans. Its argument parser
accepts ``_`` for ``-`` in option names, and the last occurrence wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Parallel, Vram
from vramguard.engines.base import Findings, Options, parallel_layout
from vramguard.engines.launchers import image_tag, program, python_module, version_from_tag

NAME = "vllm"
PROGRAM = "vllm"
"""The console script: ``vllm serve``."""
MODULES = frozenset({"vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server"})
DEFAULT_SINCE_0_21 = Fraction(92, 100)
DEFAULT_BEFORE_0_21 = Fraction(9, 10)
UTILIZATION = ("--gpu-memory-utilization",)
KV_CACHE_BYTES = ("--kv-cache-memory-bytes", "--kv-cache-memory")
PARALLEL_SIZES = (
    ("tensor", ("--tensor-parallel-size", "-tp")),
    ("pipeline", ("--pipeline-parallel-size", "-pp")),
    ("prefill-context", ("--prefill-context-parallel-size", "-pcp")),
)
DATA_PARALLEL = ("--data-parallel-size", "-dp")
DATA_PARALLEL_LOCAL = ("--data-parallel-size-local", "-dpl")
_SIZES = tuple(names for _, names in PARALLEL_SIZES)
_SIZES_WITH_DATA = (*_SIZES, DATA_PARALLEL)
_SIZES_WITH_LOCAL_DATA = (*_SIZES, DATA_PARALLEL_LOCAL)
NODES = ("--nnodes",)
"""Multi-node serving without Ray: the parallel sizes are totals over ``--nnodes`` pods."""
EXECUTOR = ("--distributed-executor-backend",)


def arguments(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments if ``argv`` starts vLLM's OpenAI server, else ``None``."""
    if program(argv) == PROGRAM and len(argv) > 1 and argv[1] == "serve":
        return list(argv[2:])
    module = python_module(argv)
    if module is None:
        return None
    name, rest = module
    if name in MODULES:
        return rest
    if name == "vllm.entrypoints.cli.main" and rest[:1] == ["serve"]:
        return rest[1:]
    return None


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """What vLLM started with ``args`` in an image ``image`` will reserve on each of its GPUs."""
    del env  # vLLM reads no environment variable for its memory share
    found = Findings.for_container(container)
    options = Options(args, underscores=True)
    parallel = _parallel(options, found)
    vram: Vram | None
    implicit = False
    kv_bytes = options.last(KV_CACHE_BYTES)
    utilization = options.last(UTILIZATION)
    if kv_bytes is not None:
        found.evidence.append(kv_bytes.evidence())
        found.warn(
            f"{kv_bytes.name} sizes the KV cache directly, so vLLM ignores --gpu-memory-utilization "
            f"and its total VRAM is unknown; declare it with the {VRAM_ANNOTATION} annotation"
        )
        vram = None
    elif utilization is not None:
        fraction = found.fraction(utilization)
        vram = Vram(fraction=fraction) if fraction is not None else None
    elif options.has(("--config",)):
        config = options.last(("--config",))
        found.evidence.append(config.evidence() if config else "--config")
        found.warn(
            "--gpu-memory-utilization may be set in the --config file, which vramguard cannot read; "
            f"pass it on the command line or declare {VRAM_ANNOTATION}"
        )
        vram = None
    else:
        vram = Vram(fraction=_implicit_default(image, found))
        implicit = True
    return EngineClaim(
        NAME, vram, parallel, tuple(found.evidence), tuple(found.warnings), tuple(found.errors), implicit,
        default_warning=found.default_warning,
    )


def _parallel(options: Options, found: Findings) -> Parallel | None:
    sizes = _SIZES_WITH_LOCAL_DATA if options.has(DATA_PARALLEL_LOCAL) else _SIZES_WITH_DATA
    executor = options.last(EXECUTOR)
    ray = executor is not None and executor.value == "ray"
    return parallel_layout(options, sizes, found, NODES, ray)


def _implicit_default(image: str, found: Findings) -> Fraction:
    version = version_from_tag(image_tag(image))
    if version is None:
        default, why = DEFAULT_SINCE_0_21, "image version unknown, assuming v0.21.0 or later"
    elif version < (0, 21, 0):
        default, why = DEFAULT_BEFORE_0_21, f"image tag {image_tag(image)} is before v0.21.0"
    else:
        default, why = DEFAULT_SINCE_0_21, f"image tag {image_tag(image)}"
    found.evidence.append(f"vLLM default --gpu-memory-utilization {float(default):g} ({why})")
    found.relies_on_default(
        f"container {found.container} relies on vLLM's default --gpu-memory-utilization "
        f"({float(default):g} of the GPU); set it explicitly"
    )
    return default
