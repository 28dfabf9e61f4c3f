"""From a container spec to the argument vector the runtime executes, and the environment it sees.

Kubernetes first expands ``$(VAR)`` references in ``command`` and ``args`` (and in ``env`` values,
from the entries before them) from the container's environment
(``k8s.io/kubernetes/third_party/forked/golang/expansion``); the runtime then executes
``command + args`` (or the image's entrypoint with ``args``). A shell among those processes is read
by :mod:`vramguard.demand.shell`.

Variables set from a Secret, a ConfigMap key, a field or a resource (``valueFrom``), and every
variable an ``envFrom`` source may set, cannot be read from the spec: they are *opaque*, and
whatever depends on them is unknown (see :meth:`ContainerEnv.is_opaque`).

Every step is linear in its input, and what expansion may produce is bounded by a :class:`Budget`
per container: a ``$(A)`` repeated a million times, each ``A`` itself a long value, would otherwise
build gigabytes from a pod of one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_COMMANDS = 1_000
"""Simple commands a container's shell scripts may run, counted as they are parsed and as they are
walked (a function's body counts at every call): far more than any start-up script has."""
MAX_WORD_PARTS = 5_000
"""Pieces of shell words (literal text, quotes, expansions) a container's scripts may hold, counted
as they are parsed and as they are expanded."""
MAX_ARGUMENTS = 4096
"""Words of ``command`` and ``args`` read; a longer command line is not read."""
MAX_ENV_ENTRIES = 4096
"""``env`` entries read; those after them count as an opaque source (any name may come from them)."""
MAX_EXPANSION_CHARS = 1 << 20
"""Characters that expansion (``$(VAR)``, ``$VAR``, ``${VAR:-...}``) may add for one container,
beyond the text of the spec itself."""


class Unreadable(Exception):
    """A container's command line that vramguard does not read: too large, too deep, or not shell.

    The message says why, in words that fit after ``container NAME:``; its VRAM is then unknown."""


@dataclass(slots=True)
class Budget:
    """The work command lines may cost (one container's, or all of a pod's); :class:`Unreadable`
    once it is spent."""

    commands: int = MAX_COMMANDS
    parts: int = MAX_WORD_PARTS
    chars: int = MAX_EXPANSION_CHARS
    whose: str = "its"
    """Whose scripts the messages name: a container's own (``its``) or its pod's."""

    def command(self) -> None:
        """Count one simple command parsed or walked."""
        self.commands -= 1
        if self.commands < 0:
            raise Unreadable(
                f"{self.whose} shell scripts run more than {MAX_COMMANDS} commands, more than vramguard reads"
            )

    def word(self, parts: int) -> None:
        """Count the pieces of one word parsed or expanded."""
        self.parts -= parts
        if self.parts < 0:
            raise Unreadable(
                f"{self.whose} shell scripts hold more than {MAX_WORD_PARTS} words and quotes, "
                "more than vramguard reads"
            )

    def references(self, count: int) -> None:
        """Count ``count`` Kubernetes ``$(VAR)`` references about to be expanded (against the words)."""
        self.parts -= count
        if self.parts < 0:
            raise Unreadable(
                f"{self.whose} command lines hold more than {MAX_WORD_PARTS} $(VAR) references and shell words, "
                "more than vramguard reads"
            )

    def expand(self, produced: int) -> None:
        """Count ``produced`` characters of expansion."""
        self.chars -= produced
        if self.chars < 0:
            raise Unreadable(
                f"{self.whose} variables expand to more than {MAX_EXPANSION_CHARS >> 20} MiB of text, "
                "more than vramguard reads"
            )


@dataclass(frozen=True, slots=True)
class EnvValue:
    """One environment variable as the container will see it, when it can be known."""

    value: str | None
    """The literal value, ``None`` when it comes from a Secret, ConfigMap, field or resource."""
    source: str


@dataclass(slots=True)
class ContainerEnv:
    """The environment of a container (or of one process of it), as far as the spec reveals it."""

    values: Mapping[str, EnvValue] = field(default_factory=dict)
    opaque_sources: Sequence[str] = field(default_factory=list)
    """Sources whose variables cannot be seen, so that any name may come from them: ``envFrom``
    ConfigMaps and Secrets, a file a shell script sources."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Scripts the container sees whose text is known (ConfigMap volumes of the same input), by
    path: a shell runs, sources or executes them as the walk reads them."""

    def literal(self, name: str) -> str | None:
        """The variable's literal value, or ``None`` if unset or not visible in the spec."""
        entry = self.values.get(name)
        return entry.value if entry is not None else None

    def is_opaque(self, name: str) -> bool:
        """Whether the variable may hold a value the spec does not show: it is set from a reference,
        or it is not set in ``env`` while an opaque source may set it."""
        entry = self.values.get(name)
        if entry is not None:
            return entry.value is None
        return bool(self.opaque_sources)


_FROM_REFERENCE = EnvValue(None, "valueFrom")
"""Every variable set from a Secret, ConfigMap, field or resource reads the same (immutable, shared)."""


def container_env(
    container: Mapping[str, Any], budget: Budget | None = None, files: Mapping[str, str] | None = None
) -> ContainerEnv:
    """Read ``env`` and ``envFrom`` of a container, expanding ``$(VAR)`` in values as Kubernetes does.

    A value whose expansion would exceed the budget is opaque (as if set from a reference).
    ``files``: the scripts the container sees, by path (see :attr:`ContainerEnv.files`)."""
    budget = budget if budget is not None else Budget()
    values: dict[str, EnvValue] = {}
    opaque: list[str] = []
    env = ContainerEnv(values, opaque, files or {})
    env_from = container.get("envFrom")
    if isinstance(env_from, list):
        for source in env_from:
            if isinstance(source, dict):
                opaque.append(_describe_env_from(source))
    entries = container.get("env")
    if not isinstance(entries, list):
        return env
    if len(entries) > MAX_ENV_ENTRIES:
        opaque.append(f"the env entries after the first {MAX_ENV_ENTRIES}")
        entries = entries[:MAX_ENV_ENTRIES]
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        name = entry["name"]
        if "valueFrom" in entry and entry.get("valueFrom") is not None:
            values[name] = _FROM_REFERENCE
            continue
        raw = entry.get("value", "")
        value = raw if isinstance(raw, str) else str(raw)
        if "$" in value:
            expanded = expand_kubernetes(value, env, max(budget.chars, 0))
            if expanded is None:
                values[name] = EnvValue(None, f"env (its references expand past {MAX_EXPANSION_CHARS >> 20} MiB)")
                continue
            budget.chars -= max(0, len(expanded) - len(value))
            value = expanded
        values[name] = EnvValue(value, "env")
    return env


def _describe_env_from(source: Mapping[str, Any]) -> str:
    for kind in ("configMapRef", "secretRef"):
        ref = source.get(kind)
        if isinstance(ref, dict):
            return f"{kind} {ref.get('name', '?')}"
    return "envFrom"


def expand_kubernetes(text: str, env: ContainerEnv, limit: int = MAX_EXPANSION_CHARS) -> str | None:
    """Expand ``$(VAR)`` like the kubelet: unknown references stay verbatim, ``$$`` is a literal ``$``.

    ``None`` when the values substituted would add more than ``limit`` characters. Linear in
    ``text``: the kubelet scans for the closing parenthesis afresh at every ``$(`` (quadratic on
    ``$($($(...``); here no ``$(`` after the last ``)`` is scanned, since none of them can close.
    """
    if "$" not in text:
        return text
    last_close = text.rfind(")") + 1
    head, tail = text[:last_close], text[last_close:]
    added = 0

    def substitute(match: re.Match[str]) -> str:
        nonlocal added
        name = match.group(1)
        if name is None:
            return "$"  # "$$"
        value = env.literal(name)
        if value is None:
            return match.group()
        added += len(value)
        if added > limit:
            raise _TooLong
        return value

    try:
        head = _KUBERNETES_REFERENCE.sub(substitute, head) if "$" in head else head
    except _TooLong:
        return None
    # After the last ")" a "$" takes the next character as it is: only "$$" changes.
    return head + tail.replace("$$", "$")


_KUBERNETES_REFERENCE = re.compile(r"\$(?:\(([^)]*)\)|\$)")
"""``$(NAME)`` (up to the next ``)``) or ``$$``. The kubelet also takes any other character after a
``$`` as it is, which changes nothing: that character starts neither form."""


class _TooLong(Exception):
    """Raised inside a substitution to stop it once the limit is passed."""


def container_argvs(container: Mapping[str, Any], env: ContainerEnv, budget: Budget) -> tuple[list[str], list[str]]:
    """``command`` and ``args`` after Kubernetes' ``$(VAR)`` expansion (non-strings are dropped).

    Raises :class:`Unreadable` when they hold more than :data:`MAX_ARGUMENTS` words, or when the
    expansion would exceed the budget."""
    command, args = container.get("command"), container.get("args")
    words = sum(len(value) for value in (command, args) if isinstance(value, list))
    if words > MAX_ARGUMENTS:
        raise Unreadable(f"its command line has {words} words, more than the {MAX_ARGUMENTS} vramguard reads")
    return _expanded(command, env, budget), _expanded(args, env, budget)


def _expanded(value: Any, env: ContainerEnv, budget: Budget) -> list[str]:
    out: list[str] = []
    for word in _strings(value):
        if "$" not in word:  # most arguments hold no reference: only those with a ``$`` are expanded
            out.append(word)
            continue
        budget.references(word.count("$("))
        expanded = expand_kubernetes(word, env, max(budget.chars, 0))
        if expanded is None:
            raise Unreadable(
                f"its command's $(VAR) references expand past {MAX_EXPANSION_CHARS >> 20} MiB, "
                "more than vramguard reads"
            )
        budget.expand(max(0, len(expanded) - len(word)))
        out.append(expanded)
    return out


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    return [item if isinstance(item, str) else str(item) for item in value if item is not None]
