"""One module per engine: how to recognise it, and what it reserves on each GPU it uses.

Engines started by a command (vLLM, SGLang, TGI) expose ``arguments(argv)``, which returns the
engine's own arguments when ``argv`` launches it, and ``claim(args, env, image, container)``.
Images whose entrypoint is an engine (``vllm/vllm-openai``, TGI's image and its vendor builds) are
run with ``args`` only. Wrappers that take an engine's own flags (NVIDIA Dynamo's ``dynamo.vllm`` and
``dynamo.sglang`` workers, KServe's Hugging Face server with its vLLM backend) read as that engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim
from vramguard.engines import kserve, sglang, tgi, trtllm, vllm
from vramguard.engines.base import Options
from vramguard.engines.launchers import image_repository, is_python, program, python_module


@dataclass(frozen=True, slots=True)
class CommandEngine:
    """An engine recognised from the command line of a process."""

    name: str
    arguments: Callable[[Sequence[str]], list[str] | None]
    claim: Callable[[Sequence[str], ContainerEnv, str, str], EngineClaim]
    programs: frozenset[str] = frozenset()
    """The executables (base names) that start the engine, besides ``python -m``: ``arguments`` is
    ``None`` for any other program, which lets :func:`recognise` skip every engine at once."""


def _module_arguments(modules: frozenset[str]) -> Callable[[Sequence[str]], list[str] | None]:
    """The arguments after ``python -m MODULE`` for one of ``modules``, else ``None``."""

    def arguments(argv: Sequence[str]) -> list[str] | None:
        module = python_module(argv)
        return module[1] if module is not None and module[0] in modules else None

    return arguments


def _huggingface_server(argv: Sequence[str]) -> list[str] | None:
    """KServe's Hugging Face server: its vLLM backend takes vLLM's engine flags (the default)."""
    module = python_module(argv)
    if module is None or module[0] != "huggingfaceserver":
        return None
    options = Options(module[1], underscores=True)
    backend = options.last(("--backend",))
    return module[1] if backend is None or backend.value in (None, "auto", "vllm") else None


def _wrapped(
    claim: Callable[[Sequence[str], ContainerEnv, str, str], EngineClaim],
) -> Callable[[Sequence[str], ContainerEnv, str, str], EngineClaim]:
    """An engine inside another project's image: that image's tag says nothing of the engine's version."""

    def wrapped_claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
        del image
        return claim(args, env, "", container)

    return wrapped_claim


COMMAND_ENGINES: tuple[CommandEngine, ...] = (
    CommandEngine(vllm.NAME, vllm.arguments, vllm.claim, frozenset({vllm.PROGRAM})),
    CommandEngine(sglang.NAME, sglang.arguments, sglang.claim, frozenset({sglang.PROGRAM})),
    CommandEngine(tgi.NAME, tgi.arguments, tgi.claim, frozenset({tgi.LAUNCHER, *tgi.ENTRYPOINT_SCRIPTS})),
    CommandEngine(trtllm.NAME, trtllm.arguments, trtllm.claim, frozenset({trtllm.PROGRAM, trtllm.LAUNCHER})),
    # NVIDIA Dynamo's workers take the flags of the engine they wrap.
    CommandEngine(vllm.NAME, _module_arguments(frozenset({"dynamo.vllm"})), _wrapped(vllm.claim)),
    CommandEngine(sglang.NAME, _module_arguments(frozenset({"dynamo.sglang"})), _wrapped(sglang.claim)),
    CommandEngine(vllm.NAME, _huggingface_server, kserve.claim),
)

ENGINE_PROGRAMS = frozenset().union(*(engine.programs for engine in COMMAND_ENGINES))

# Images whose ENTRYPOINT starts an engine, so that a container gives it only ``args``.
IMAGE_ENTRYPOINTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm/vllm-openai", ("vllm", "serve")),
    ("vllm-openai", ("vllm", "serve")),
    ("huggingface/text-generation-inference", (tgi.LAUNCHER,)),
    ("text-generation-inference", (tgi.LAUNCHER,)),
    ("kserve/huggingfaceserver", ("python", "-m", "huggingfaceserver")),
)

# Vendor builds of TGI (the clouds' "deep learning containers") keep the launcher as entrypoint
# under their own repository names: ``huggingface-text-generation-inference-cu124...``,
# ``huggingface-pytorch-tgi-inference``.
_TGI_VENDOR_REPOSITORY = re.compile(r"text-generation-inference|(?:^|[-_])tgi(?:[-_]|$)")


@lru_cache(maxsize=1024)
def image_entrypoint(image: str) -> tuple[str, ...] | None:
    """The entrypoint of a known engine image (by repository suffix, any registry), else ``None``."""
    repository = image_repository(image)
    for suffix, entrypoint in IMAGE_ENTRYPOINTS:
        if repository == suffix or repository.endswith("/" + suffix):
            return entrypoint
    if _TGI_VENDOR_REPOSITORY.search(repository.rsplit("/", 1)[-1]):
        return (tgi.LAUNCHER,)
    return None


def recognise(argv: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim | None:
    """The claim of the engine that ``argv`` launches, or ``None`` when it launches none we know."""
    executable = program(argv)
    if executable not in ENGINE_PROGRAMS and not is_python(executable):
        return None  # most processes of a script (pip, mkdir, ray) start no engine: skip asking each
    return recognise_each(argv, env, image, container)


def recognise_each(argv: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim | None:
    """:func:`recognise` without its shortcut: every engine is asked in turn."""
    for engine in COMMAND_ENGINES:
        args = engine.arguments(argv)
        if args is not None:
            return engine.claim(args, env, image, container)
    return None
