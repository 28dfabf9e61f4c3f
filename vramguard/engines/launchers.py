"""Recognising how a process was launched: ``python -m module``, console scripts, image entrypoints."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

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


NON_GPU_PROGRAMS = frozenset({"sleep", "tail", "tee", "cat", "curl", "wget", "nginx", "envoy"})
"""Programs a start-up script runs beside an engine that hold no GPU memory: waiting and logging
(``sleep infinity``, ``tail -f``, ``| tee``), health checks and proxies; and Ray's commands of
:data:`RAY_DAEMON_COMMANDS`. Every other program may use the GPU. Shell builtins (``echo``, ``wait``,
``cd``, ...) start no process at all."""

RAY = "ray"
RAY_OPTIONS_WITH_VALUE = frozenset({"--logging-level", "--logging-format"})
"""The ``ray`` command's own options that take a value, before its subcommand (``cli`` in
``python/ray/scripts/scripts.py``, Ray 2.x)."""
RAY_DAEMON_COMMANDS = frozenset({
    "start", "stop", "status", "health-check", "metrics", "list", "get", "summary", "logs", "memory", "timeline",
    "stack", "global-gc", "local-dump", "drain-node", "check-open-ports", "disable-usage-stats",
    "enable-usage-stats", "job status", "job stop", "job logs", "job list", "job delete",
})
"""The ``ray`` subcommands that start, stop or query Ray's daemons and run no code of the user's
(``python/ray/scripts/scripts.py``, ``python/ray/util/state/state_cli.py``,
``python/ray/dashboard/modules/job/cli.py``, Ray 2.x): they hold no GPU memory, and the GPU workers
``ray start`` hosts for an engine are that engine's own claim. The others may run anything:
``ray job submit -- ENTRYPOINT`` runs its entrypoint (:func:`ray_job_entrypoint`), ``ray exec`` and
``ray submit`` a command or script on the cluster, ``ray symmetric-run -- ENTRYPOINT`` its entrypoint
(:func:`ray_entrypoint`)
beside the Ray it starts."""
RAY_JOB_SUBMIT_OPTIONS_WITH_VALUE = frozenset({
    "--address", "--job-id", "--submission-id", "--runtime-env", "--runtime-env-json", "--working-dir",
    "--metadata-json", "--entrypoint-num-cpus", "--entrypoint-num-gpus", "--entrypoint-memory",
    "--entrypoint-resources", "--entrypoint-label-selector", "--verify", "--headers", "--log-style", "--log-color",
})
"""``ray job submit``'s options that take a value (``submit`` in ``python/ray/dashboard/modules/job/cli.py``,
``add_common_job_options`` in its ``cli_utils.py``, ``CLICK_LOGGING_OPTIONS`` in
``python/ray/autoscaler/_private/cli_logger.py``, Ray 2.x); its flags are ``--no-wait`` and ``-v``."""
RAY_JOB_DETACHED = "--no-wait"
"""The flag with which ``ray job submit`` returns once the job is submitted, without waiting for it."""


@dataclass(frozen=True, slots=True)
class Entrypoint:
    """The command a wrapper has run for it, elsewhere than in its own process."""

    argv: list[str]
    detached: bool
    """The wrapper returns at once and the command runs on, as if started in the background."""
    starts_ray: bool = False
    """The wrapper first starts or joins a Ray cluster in this container, as ``ray start`` does."""


def ray_command(argv: Sequence[str]) -> tuple[str, Sequence[str]]:
    """The subcommand of a ``ray`` command line and the words after it: ``ray --logging-level info job
    submit -- CMD`` → ``("job submit", ["--", "CMD"])``; ``("", [])`` where none is given."""
    index = 1
    while index < len(argv) and argv[index].startswith("-"):
        index += 2 if argv[index] in RAY_OPTIONS_WITH_VALUE else 1
    if index >= len(argv):
        return "", ()
    if argv[index] == "job" and index + 1 < len(argv):
        return f"job {argv[index + 1]}", argv[index + 2 :]
    return argv[index], argv[index + 1 :]


def ray_entrypoint(argv: Sequence[str]) -> Entrypoint | None:
    """What a ``ray`` command line runs for its caller: ``ray job submit``'s entrypoint
    (:func:`ray_job_entrypoint`), or ``ray symmetric-run [RAY START OPTIONS] -- ENTRYPOINT...``'s. The
    latter runs ``ray start`` on every node with the options before ``--`` (the head where ``--address``
    is this node's), waits for ``--min-nodes``, and runs the entrypoint on the head node
    (``python/ray/scripts/symmetric_run.py``, Ray 2.49+; the Ray docs' Slurm guide): each pod of a group
    runs the same command, and the engine's Ray workers on the others hold what the entrypoint's engine
    says, so the entrypoint is read in each. ``None`` without ``--`` or an entrypoint after it."""
    if program(argv) != RAY:
        return None
    command, rest = ray_command(argv)
    if command != "symmetric-run":
        return ray_job_entrypoint(argv)
    if "--" not in rest:
        return None
    entrypoint = list(rest[list(rest).index("--") + 1 :])
    return Entrypoint(entrypoint, detached=False, starts_ray=True) if entrypoint else None


def ray_job_entrypoint(argv: Sequence[str]) -> Entrypoint | None:
    """What ``ray job submit [OPTIONS] -- ENTRYPOINT...`` runs: the job's driver, which the job supervisor
    starts on the Ray head node as ``shlex.join`` of the words run by a shell (``submit`` in
    ``python/ray/dashboard/modules/job/cli.py``, ``_exec_entrypoint`` in ``job_supervisor.py``, Ray 2.x):
    the same words as run directly. With ``--no-wait`` the command returns once the job is submitted.

    ``None`` for any other command line, and where the entrypoint cannot be told from the options: no
    ``--``, or a word before it that is no option nor an option's value."""
    if program(argv) != RAY:
        return None
    command, rest = ray_command(argv)
    if command != "job submit":
        return None
    detached = False
    index = 0
    while index < len(rest) and rest[index] != "--":
        word = rest[index]
        if not word.startswith("-"):
            return None
        detached = detached or word == RAY_JOB_DETACHED
        index += 2 if word in RAY_JOB_SUBMIT_OPTIONS_WITH_VALUE else 1
    entrypoint = list(rest[index + 1 :])
    return Entrypoint(entrypoint, detached) if entrypoint else None


def uses_no_gpu(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs one of :data:`NON_GPU_PROGRAMS`, or ``ray`` with one of
    :data:`RAY_DAEMON_COMMANDS` or none (its help, its version)."""
    executable = program(argv)
    if executable == RAY:
        command, _ = ray_command(argv)
        return not command or command in RAY_DAEMON_COMMANDS
    return executable in NON_GPU_PROGRAMS
