"""From a container spec to the argument vectors of the processes it will run.

Kubernetes first expands ``$(VAR)`` references in ``command`` and ``args`` from the container's
``env`` (``k8s.io/kubernetes/third_party/forked/golang/expansion``); the runtime then executes
``command + args`` (or the image's entrypoint with ``args``). Inference servers are often started
through a shell (``sh -c "pip install x && exec vllm serve ..."``), so shell scripts are split into
simple commands with :mod:`shlex`, and ``$VAR`` / ``${VAR}`` inside them are expanded from the
container's literal environment, the way the shell would see it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh", "busybox"})
PREFIX_COMMANDS = frozenset({"exec", "nohup", "time", "command", "builtin"})
_SHELL_VAR = re.compile(r"\$\{(\w+)(?::?[-=]([^}]*))?\}|\$(\w+)", re.ASCII)
_OPERATORS = "();<>|&\n"
_PUNCTUATION = frozenset(_OPERATORS)
_WHITESPACE = " \t\r"
_SHLEX_SPECIAL = frozenset("'\"\\#")
"""Characters that make :mod:`shlex` do more than split: quotes, the escape, the comment sign."""
_PLAIN_TOKEN = re.compile(r"[();<>|&\n]+|[^ \t\r();<>|&\n]+")
"""A run of operator characters, or of anything but operators and whitespace (shlex's two token kinds)."""
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=", re.ASCII)
MAX_SHELL_DEPTH = 4


@dataclass(frozen=True, slots=True)
class EnvValue:
    """One environment variable as the container will see it, when it can be known."""

    value: str | None
    """The literal value, ``None`` when it comes from a Secret, ConfigMap, field or resource."""
    source: str


@dataclass(slots=True)
class ContainerEnv:
    """The environment of a container, as far as the spec reveals it."""

    values: dict[str, EnvValue] = field(default_factory=dict)
    opaque_sources: list[str] = field(default_factory=list)
    """``envFrom`` sources whose variables cannot be seen (any name may come from them)."""

    def literal(self, name: str) -> str | None:
        """The variable's literal value, or ``None`` if unset or not visible in the spec."""
        entry = self.values.get(name)
        return entry.value if entry is not None else None

    def with_overrides(self, assignments: Mapping[str, str]) -> ContainerEnv:
        """A copy with ``NAME=value`` assignments from a shell command line applied."""
        values = dict(self.values)
        for name, value in assignments.items():
            values[name] = EnvValue(value, "shell assignment")
        return ContainerEnv(values, list(self.opaque_sources))


_FROM_REFERENCE = EnvValue(None, "valueFrom")
"""Every variable set from a Secret, ConfigMap, field or resource reads the same (immutable, shared)."""


def container_env(container: Mapping[str, Any]) -> ContainerEnv:
    """Read ``env`` and ``envFrom`` of a container, expanding ``$(VAR)`` in values as Kubernetes does."""
    env = ContainerEnv()
    env_from = container.get("envFrom")
    if isinstance(env_from, list):
        for source in env_from:
            if isinstance(source, dict):
                env.opaque_sources.append(_describe_env_from(source))
    entries = container.get("env")
    if not isinstance(entries, list):
        return env
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        name = entry["name"]
        if "valueFrom" in entry and entry.get("valueFrom") is not None:
            env.values[name] = _FROM_REFERENCE
            continue
        raw = entry.get("value", "")
        value = raw if isinstance(raw, str) else str(raw)
        env.values[name] = EnvValue(expand_kubernetes(value, env), "env")
    return env


def _describe_env_from(source: Mapping[str, Any]) -> str:
    for kind in ("configMapRef", "secretRef"):
        ref = source.get(kind)
        if isinstance(ref, dict):
            return f"{kind} {ref.get('name', '?')}"
    return "envFrom"


def expand_kubernetes(text: str, env: ContainerEnv) -> str:
    """Expand ``$(VAR)`` like the kubelet: unknown references stay verbatim, ``$$`` is a literal ``$``."""
    if "$" not in text:
        return text
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    length = len(text)
    while cursor < length:
        if text[cursor] == "$" and cursor + 1 < length:
            out.append(text[checkpoint:cursor])
            nxt = text[cursor + 1]
            if nxt == "$":
                out.append("$")
                advance = 1
            elif nxt == "(":
                close = text.find(")", cursor + 2)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = text[cursor + 2 : close]
                    value = env.literal(name)
                    out.append(value if value is not None else f"$({name})")
                    advance = close - cursor
            else:
                out.append("$" + nxt)
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


def expand_shell(word: str, env: ContainerEnv) -> str:
    """Expand ``$VAR``, ``${VAR}`` and ``${VAR:-default}`` in a shell word from the literal env."""
    if "$" not in word:
        return word

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        value = env.literal(name)
        if value is not None and (value or match.group(2) is None):
            return value
        if match.group(2) is not None and (value is None and name not in env.values):
            return match.group(2)
        return match.group(0)

    return _SHELL_VAR.sub(substitute, word)


@dataclass(frozen=True, slots=True)
class Invocation:
    """One process a container will start: its argument vector and the environment it sees."""

    argv: tuple[str, ...]
    env: ContainerEnv
    via_shell: bool = False


def container_argvs(container: Mapping[str, Any], env: ContainerEnv) -> tuple[list[str], list[str]]:
    """``command`` and ``args`` after Kubernetes' ``$(VAR)`` expansion (non-strings are dropped)."""
    # Most arguments hold no reference: only those with a ``$`` are expanded.
    command = [expand_kubernetes(a, env) if "$" in a else a for a in _strings(container.get("command"))]
    args = [expand_kubernetes(a, env) if "$" in a else a for a in _strings(container.get("args"))]
    return command, args


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    return [item if isinstance(item, str) else str(item) for item in value if item is not None]


def invocations(argv: Sequence[str], env: ContainerEnv, depth: int = 0) -> Iterator[Invocation]:
    """Every simple command an argument vector runs, looking through shells and prefix commands."""
    argv = list(argv)
    if not argv:
        return
    script = _shell_script(argv)
    if script is None:
        yield from _unwrap(argv, env, via_shell=depth > 0, depth=depth)
        return
    if depth >= MAX_SHELL_DEPTH:
        return
    shell_env = env
    for words in split_script(script):
        assignments, rest = _leading_assignments(words)
        if rest and rest[0] == "export":
            for word in rest[1:]:
                name, sep, value = word.partition("=")
                if sep:
                    assignments[name] = expand_shell(value, shell_env)
            shell_env = shell_env.with_overrides(assignments)
            continue
        if not rest:
            shell_env = shell_env.with_overrides(assignments)
            continue
        local_env = shell_env.with_overrides(assignments) if assignments else shell_env
        expanded = [expand_shell(w, local_env) for w in rest]
        yield from invocations(expanded, local_env, depth + 1)


def _shell_script(argv: Sequence[str]) -> str | None:
    """The script of ``sh -c SCRIPT`` / ``bash -lc SCRIPT`` / ``/bin/sh -ec SCRIPT``, else ``None``."""
    if _basename(argv[0]) not in SHELLS:
        return None
    index = 1
    if _basename(argv[0]) == "busybox":
        if len(argv) < 2 or argv[1] not in SHELLS:
            return None
        index = 2
    while index < len(argv):
        word = argv[index]
        if word.startswith("-") and not word.startswith("--") and len(word) > 1:
            if "c" in word[1:]:
                return argv[index + 1] if index + 1 < len(argv) else ""
            index += 1
            continue
        if word.startswith("+") or word in ("--login", "--norc", "--noprofile"):
            index += 1
            continue
        return None
    return None


def split_script(script: str) -> list[list[str]]:
    """Split a shell script into the words of each simple command (``&&``, ``;``, ``|``, newlines)."""
    commands: list[list[str]] = []
    current: list[str] = []
    skip_target = False
    for token in shell_tokens(script):
        if token and set(token) <= _PUNCTUATION:
            if "<" in token or ">" in token:
                skip_target = True  # a redirection: its target is a file name, not an argument
                continue
            if current:
                commands.append(current)
            current = []
        elif skip_target:
            skip_target = False
        elif token not in ("{", "}", "!"):
            current.append(token)
    if current:
        commands.append(current)
    return commands


def shell_tokens(script: str) -> list[str]:
    """The words and operators of a script, as :func:`shlex_tokens` reads them.

    A script without quotes, backslashes or comments (most ``sh -c`` lines) is split by one regular
    expression, which gives the same tokens as :mod:`shlex` at a tenth of the cost.
    """
    joined = script.replace("\\\n", " ")
    if _SHLEX_SPECIAL.isdisjoint(joined):
        return _PLAIN_TOKEN.findall(joined)
    return shlex_tokens(script)


def shlex_tokens(script: str) -> list[str]:
    """The tokens :mod:`shlex` reads in POSIX mode with the shell's operators as punctuation (a
    backslash-newline joins lines first).

    Unbalanced quotes end the script: the shell would refuse it too; the tokens read so far are kept.
    """
    lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=_OPERATORS)
    lexer.whitespace = _WHITESPACE
    lexer.whitespace_split = True
    tokens: list[str] = []
    try:
        for token in lexer:
            tokens.append(token)
    except ValueError:
        pass
    return tokens


def _leading_assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    assignments: dict[str, str] = {}
    index = 0
    while index < len(words) and _ASSIGNMENT.match(words[index]):
        name, _, value = words[index].partition("=")
        assignments[name] = value
        index += 1
    return assignments, words[index:]


def _unwrap(argv: list[str], env: ContainerEnv, via_shell: bool, depth: int) -> Iterator[Invocation]:
    """Strip ``exec``, ``env A=B``, ``nohup`` and the like; recurse into a nested shell."""
    while argv:
        head = _basename(argv[0])
        if head in PREFIX_COMMANDS:
            argv = _skip_options(argv[1:])
            continue
        if head == "env":
            rest = _skip_options(argv[1:])
            assignments, rest = _leading_assignments(rest)
            env = env.with_overrides(assignments)
            argv = rest
            continue
        break
    if not argv:
        return
    if _shell_script(argv) is not None:
        yield from invocations(argv, env, depth + 1)
        return
    yield Invocation(tuple(argv), env, via_shell)


def _skip_options(argv: list[str]) -> list[str]:
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        index += 1
    return argv[index:]


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]
