"""One module per engine: how to recognise it, and what it reserves on each GPU it uses.

Engines started by a command (vLLM, SGLang, TGI) expose ``arguments(argv)``, which returns the
engine's own arguments when ``argv`` launches it, and ``claim(args, env, image, container)``.
Images whose entrypoint is an engine (``vllm/vllm-openai``, TGI's image) are run with ``args`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim
from vramguard.engines import sglang, tgi, vllm
from vramguard.engines.launchers import image_repository


@dataclass(frozen=True, slots=True)
class CommandEngine:
    """An engine recognised from the command line of a process."""

    name: str
    arguments: Callable[[Sequence[str]], list[str] | None]
    claim: Callable[[Sequence[str], ContainerEnv, str, str], EngineClaim]


COMMAND_ENGINES: tuple[CommandEngine, ...] = (
    CommandEngine(vllm.NAME, vllm.arguments, vllm.claim),
    CommandEngine(sglang.NAME, sglang.arguments, sglang.claim),
    CommandEngine(tgi.NAME, tgi.arguments, tgi.claim),
)

# Images whose ENTRYPOINT starts an engine, so that a container gives it only ``args``.
IMAGE_ENTRYPOINTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm/vllm-openai", ("vllm", "serve")),
    ("vllm-openai", ("vllm", "serve")),
    ("huggingface/text-generation-inference", (tgi.LAUNCHER,)),
    ("text-generation-inference", (tgi.LAUNCHER,)),
)


@lru_cache(maxsize=1024)
def image_entrypoint(image: str) -> tuple[str, ...] | None:
    """The entrypoint of a known engine image (by repository suffix, any registry), else ``None``."""
    repository = image_repository(image)
    for suffix, entrypoint in IMAGE_ENTRYPOINTS:
        if repository == suffix or repository.endswith("/" + suffix):
            return entrypoint
    return None


def recognise(argv: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim | None:
    """The claim of the engine that ``argv`` launches, or ``None`` when it launches none we know."""
    for engine in COMMAND_ENGINES:
        args = engine.arguments(argv)
        if args is not None:
            return engine.claim(args, env, image, container)
    return None
