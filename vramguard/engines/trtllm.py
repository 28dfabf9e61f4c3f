"""TensorRT-LLM: ``trtllm-serve`` (also behind ``trtllm-llmapi-launch``), PyTorch backend.

The KV cache takes ``free_gpu_memory_fraction`` (``--kv_cache_free_gpu_memory_fraction``, default
0.9) of the memory *free after the model loads*, every process on the device counted
(``tensorrt_llm/_torch/pyexecutor/_util.py`` ``configure_kv_cache_capacity``; ``KvCacheConfig`` in
``tensorrt_llm/llmapi/llm_args.py``). What it holds therefore depends on the weights and on what
co-tenants hold when it starts, which no manifest says: it fills most of whatever is free. vramguard
counts it as unknown VRAM (a whole device, or refused where the class rejects unknown VRAM) unless
the container declares its VRAM.
"""

from __future__ import annotations

from collections.abc import Sequence

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Overheads
from vramguard.engines.base import Findings, Options, parallel_layout
from vramguard.engines.launchers import program

NAME = "tensorrt-llm"
PROGRAM = "trtllm-serve"
LAUNCHER = "trtllm-llmapi-launch"
"""A wrapper script that runs the command after it under MPI."""
FREE_FRACTION = ("--kv_cache_free_gpu_memory_fraction", "--free_gpu_memory_fraction")
TENSOR = ("--tp_size",)
PIPELINE = ("--pp_size",)
RULE = (
    "the KV cache takes --kv_cache_free_gpu_memory_fraction (default 0.9) of the memory free after the "
    "model loads, co-tenants counted (TensorRT-LLM _torch/pyexecutor/_util.py): not predictable from "
    "the manifest"
)


def arguments(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments if ``argv`` starts ``trtllm-serve`` (directly or through the launcher)."""
    if program(argv) == LAUNCHER:
        argv = argv[1:]
    if program(argv) != PROGRAM:
        return None
    rest = list(argv[1:])
    return rest[1:] if rest[:1] == ["serve"] else rest


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """TensorRT-LLM's claim: unknown VRAM, with the reason and the flags read."""
    del env, image
    found = Findings.for_container(container)
    options = Options(args)
    parallel = parallel_layout(options, (TENSOR, PIPELINE), found)
    fraction = options.last(FREE_FRACTION)
    if fraction is not None:
        found.evidence.append(fraction.evidence())
    share = fraction.evidence() if fraction is not None else "default 0.9"
    found.warn(
        f"TensorRT-LLM sizes its KV cache from the memory free when it starts ({share} of it), "
        f"so its VRAM depends on the model and its co-tenants; declare {VRAM_ANNOTATION} "
        "or give it a whole GPU"
    )
    return EngineClaim(
        NAME, None, parallel, tuple(found.evidence), tuple(found.warnings), tuple(found.errors),
        overheads=Overheads(rules=(RULE,)),
    )
