"""Recognising how a process was launched: ``python -m module``, console scripts, image entrypoints."""

from __future__ import annotations

import re
from collections.abc import Sequence

_PYTHON = re.compile(r"^python(?:\d+(?:\.\d+)?)?$", re.ASCII)
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})


def program(argv: Sequence[str]) -> str:
    """The base name of the executable: ``/usr/local/bin/vllm`` → ``vllm``."""
    return argv[0].rsplit("/", 1)[-1] if argv else ""


def is_python(executable: str) -> bool:
    """Whether an executable's base name is a Python interpreter (``python``, ``python3.11``)."""
    return bool(_PYTHON.match(executable))


def python_module(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` for ``python3 -u -m pkg.mod args...``; ``None`` for anything else."""
    if not argv or not is_python(program(argv)):
        return None
    index = 1
    while index < len(argv):
        word = argv[index]
        if word == "-m":
            if index + 1 >= len(argv):
                return None
            return argv[index + 1], list(argv[index + 2 :])
        if word.startswith("-m") and len(word) > 2:
            return word[2:], list(argv[index + 1 :])
        if not word.startswith("-"):
            return None
        index += 2 if word in _PYTHON_OPTIONS_WITH_VALUE else 1
    return None


def image_repository(image: str) -> str:
    """The repository part of an image reference: ``docker.io/vllm/vllm-openai:v0.8.5`` → ``.../vllm-openai``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


def image_name(image: str) -> str:
    """The owner and name of an image's repository, whatever the registry or mirror path before them:
    ``registry.example.com/mirror/vllm/vllm-openai:v0.9.2`` → ``vllm/vllm-openai``; a repository of one
    element (``vllm-openai:latest``, Docker Hub's library) is that element."""
    return "/".join(image_repository(image).split("/")[-2:])


def image_tag(image: str) -> str | None:
    """The tag of an image reference, or ``None`` (no tag, or pinned by digest only)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    return last.split(":", 1)[1] or None


def version_from_tag(tag: str | None) -> tuple[int, int, int] | None:
    """``v0.20.1`` / ``0.21.0-cu128`` → ``(0, 20, 1)``; ``latest`` / ``nightly`` → ``None``."""
    if tag is None:
        return None
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:$|[-+._])", tag)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


NON_GPU_PROGRAMS = frozenset({"sleep", "tail", "tee", "cat", "curl", "wget", "nginx", "envoy", "ray"})
"""Programs a start-up script runs beside an engine that hold no GPU memory: waiting and logging
(``sleep infinity``, ``tail -f``, ``| tee``), health checks and proxies, and Ray's daemons (the GPU
workers Ray hosts for an engine are that engine's own claim). Every other program may use the GPU.
Shell builtins (``echo``, ``wait``, ``cd``, ...) start no process at all."""


def uses_no_gpu(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs one of :data:`NON_GPU_PROGRAMS`."""
    return program(argv) in NON_GPU_PROGRAMS
