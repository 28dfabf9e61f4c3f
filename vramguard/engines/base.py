"""What every engine parser shares: reading flags the way argparse and clap do, and number checks."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import Parallel
from vramguard.quantity import excerpt

_DECIMAL = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$", re.ASCII)
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$", re.ASCII)
_NUMBER_STARTS = frozenset("0123456789.")
_REFERENCE = re.compile(
    r"\$\(([A-Za-z_]\w*)\)|\$\{[#!]?([A-Za-z_]\w*|[0-9@*#?!-])|\$([A-Za-z_]\w*|[0-9@*#?!-])|\$\(|`", re.ASCII
)
"""A reference left unexpanded: ``$(VAR)``, ``${VAR...}``, ``$VAR``, or a command substitution. Each
alternative stops at the first character it cannot take, so a search is linear in the text."""
COMMAND_OUTPUT = "$(...)"
"""What :func:`unresolved_reference` returns for a command substitution."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One occurrence of a command-line option: its name as written and its value (``None``: missing)."""

    name: str
    value: str | None
    separator: str = " "
    position: int = -1
    """Where it stands among the arguments (``-1``: not an argument, an environment variable)."""

    def evidence(self) -> str:
        """The flag as a person would type it (``--flag 0.3``, ``env NAME=0.3``)."""
        return self.name if self.value is None else f"{self.name}{self.separator}{excerpt(self.value, quote=False)}"


NEAR_MISS_CUTOFF = 0.9
"""``difflib`` ratio above which an unknown option reads as a misspelling: one or two letters off an
option of 20-odd characters (``--gpu-memory-utlization``: 0.98), while distinct options sharing words
stay apart (``--data-parallel-size`` against ``--tensor-parallel-size``: 0.86)."""


Version = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Abbreviations:
    """How an engine's argparse parser takes a prefix of a long option (``allow_abbrev``, which argparse
    turns on by default and neither vLLM nor SGLang turns off): ``--gpu-memory-util 0.95`` is
    ``--gpu-memory-utilization 0.95`` when no other option of the parser starts with ``--gpu-memory-util``,
    and an ambiguous prefix is an error (``ambiguous option: ... could match ...``). An exact name wins
    over a prefix. Single-dash options are matched the same way (``-t`` is ``-tp``).

    For each option vramguard reads, :attr:`shared` gives, by the engine versions whose parsers were
    built and listed (``scripts/engine_options.py``), the longest prefix it shares with another option
    of that parser (the whole name: only the whole name works). A prefix longer than that is the option.
    """

    shared: Mapping[str, tuple[tuple[Version, str], ...]]
    """Option -> ((version, longest prefix shared with another option in that version), ...), oldest first."""
    others: frozenset[str] = frozenset()
    """Options vramguard does not read that are prefixes of some it does (``--device`` of
    ``--device-memory-utilization``): written whole, they are themselves, not a prefix."""

    def at(self, version: Version | None) -> dict[str, str]:
        """The shared prefixes for ``version``. Between two versions listed, the shorter of the two
        (the one that takes more prefixes: a version in between may have either option set); an
        unknown version takes the shortest of all, so that a prefix any release takes is read."""
        prefixes: dict[str, str] = {}
        for option, rows in self.shared.items():
            if version is None:
                prefixes[option] = min((shared for _, shared in rows), key=len)
                continue
            listed = next((shared for since, shared in rows if since == version), None)
            before = [shared for since, shared in rows if since < version]
            after = [shared for since, shared in rows if since > version]
            if listed is not None:
                prefixes[option] = listed
            elif before and after:
                prefixes[option] = min(before[-1], after[0], key=len)
            else:
                prefixes[option] = before[-1] if before else after[0]
        return prefixes


class Options:
    """The options of one command line, read once: argparse and clap semantics, last occurrence wins.

    Both ``--flag value`` and ``--flag=value`` are read. A flag followed by nothing, or by another
    option, has no value (``Flag.value is None``): the engine itself would refuse to start. With
    ``underscores``, ``--gpu_memory_utilization`` means ``--gpu-memory-utilization`` (as in vLLM).
    With ``prefixes`` (:meth:`Abbreviations.at`), a prefix of an option is read as argparse reads it:
    the option, or an ambiguous one (:meth:`ambiguous`); ``exact`` names other options that are
    prefixes of those.
    """

    __slots__ = ("_ambiguous", "_counts", "_found", "_unreadable")

    def __init__(
        self,
        args: Sequence[str],
        underscores: bool = False,
        prefixes: Mapping[str, str] | None = None,
        exact: frozenset[str] = frozenset(),
    ) -> None:
        # name -> (index, as written, value, separator); a Flag is built only for the names asked for.
        found: dict[str, tuple[int, str, str | None, str]] = {}
        counts: dict[str, int] = {}
        unreadable: tuple[int, str] | None = None
        count = len(args)
        index = 0
        while index < count:
            word = args[index]
            if word == "--":
                break
            # Inline checks (this loop runs for every argument of every engine command).
            if word[:1] == "-" and not (word[1:2] in _NUMBER_STARTS and _NEGATIVE_NUMBER.match(word)):
                written, sep, value = word.partition("=")
                name = written  # the key is the canonical name; the flag keeps the user's spelling
                if underscores and name[:2] == "--" and "_" in name:
                    name = name.replace("_", "-")
                counts[name] = counts.get(name, 0) + 1
                if sep:
                    found[name] = (index, written, value, "=")
                elif index + 1 < count and _is_value(following := args[index + 1]):
                    found[name] = (index, written, following, " ")
                    index += 1
                else:
                    found[name] = (index, written, None, " ")
            elif ("$" in word or "`" in word) and unresolved_reference(word) is not None:
                unreadable = (index, word)
            index += 1
        self._found = found
        self._counts = counts
        self._unreadable = unreadable
        self._ambiguous: list[tuple[str, tuple[str, ...]]] = []
        if prefixes:
            self._resolve(prefixes, exact)

    def _resolve(self, prefixes: Mapping[str, str], exact: frozenset[str]) -> None:
        """Read each prefix of an option of ``prefixes`` as argparse does: the option (its last
        occurrence wins, whichever way it was written), or ambiguous."""
        found = self._found
        for name in [n for n in found if n not in prefixes and n not in exact and n[:1] == "-"]:
            dashes = "--" if name[:2] == "--" else "-"
            candidates = tuple(
                option for option in prefixes
                if option.startswith(name) and (option[:2] == "--") == (dashes == "--")
            )
            if not candidates:
                continue
            taken = [option for option in candidates if len(name) > len(prefixes[option])]
            entry = found.pop(name)
            if len(taken) != 1:
                self._ambiguous.append((entry[1], candidates))
                continue
            option = taken[0]
            self._counts[option] = self._counts.get(option, 0) + self._counts.pop(name, 0)
            current = found.get(option)
            if current is None or current[0] < entry[0]:
                found[option] = entry

    def ambiguous(self) -> list[tuple[str, tuple[str, ...]]]:
        """Prefixes the engine refuses as ambiguous: (as written, the options read that start with it)."""
        return list(self._ambiguous)

    def repeated(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` given more than once (clap, without ``args_override_self``, refuses them)."""
        return [name for name in names if self._counts.get(name, 0) > 1]

    def last(self, names: Iterable[str]) -> Flag | None:
        """The last occurrence of any of ``names`` (aliases such as ``-tp`` and ``--tensor-parallel-size``)."""
        best: tuple[int, str, str | None, str] | None = None
        found = self._found
        for name in names:
            hit = found.get(name)
            if hit is not None and (best is None or hit[0] > best[0]):
                best = hit
        return Flag(best[1], best[2], best[3], best[0]) if best is not None else None

    def unreadable_after(self, flag: Flag | None) -> str | None:
        """An argument the spec does not show (``$(EXTRA_ARGS)`` from a Secret, ``$FLAGS`` a script
        cannot know) after ``flag``, or anywhere when ``flag`` is ``None``: it may expand to options,
        the same flag again among them (the last occurrence wins)."""
        if self._unreadable is None:
            return None
        position, word = self._unreadable
        return word if flag is None or position > flag.position else None

    def has(self, names: Iterable[str]) -> bool:
        """Whether any of ``names`` is present, with or without a value."""
        return any(name in self._found for name in names)

    def report_misspellings(self, options: Iterable[str], engine: str, refusal: str, found: Findings) -> None:
        """An error for each :meth:`near_misses` of ``options``: ``engine``'s parser refuses an option it
        does not know (``refusal``, its message), so the pod would crash-loop; and for each
        :meth:`ambiguous` prefix, which it refuses too."""
        for written, meant in self.near_misses(options):
            found.error(f"{written}: {engine} has no such option and exits at start ({refusal}); did you mean {meant}?")
        for written, candidates in self._ambiguous:
            found.error(
                f"{written}: {engine} exits at start (\"ambiguous option\"): its parser takes a prefix of an option "
                f"only where no other option starts with it, and {', '.join(candidates)} and others do"
            )

    def near_misses(self, options: Iterable[str]) -> list[tuple[str, str]]:
        """Long options given that are none of ``options`` but within a letter or two of one of them
        (``--gpu-memory-utlization``), as ``(as written, meant)``, in the order given. An option spelt
        with ``_`` for ``-`` is a miss too, unless the engine reads it so (``underscores``), and an option
        extending one (``--data-parallel-size-local``) is no miss."""
        given = set(options)
        wanted = {name.replace("_", "-"): name for name in options if name.startswith("--")}
        misses: list[tuple[str, str]] = []
        for name, (_, written, _, _) in sorted(self._found.items(), key=lambda item: item[1][0]):
            canonical = name.replace("_", "-")
            if not canonical.startswith("--") or name in given:
                continue
            if canonical in wanted:
                misses.append((written, wanted[canonical]))
                continue
            if any(canonical.startswith(option + "-") for option in wanted):
                continue
            close = difflib.get_close_matches(canonical, sorted(wanted), n=1, cutoff=NEAR_MISS_CUTOFF)
            if close:
                misses.append((written, wanted[close[0]]))
        return misses


def _is_negative_number(word: str) -> bool:
    # The regex can match only when a digit or a point follows the sign: most flags skip it.
    return word[1:2] in _NUMBER_STARTS and bool(_NEGATIVE_NUMBER.match(word))


def _is_value(word: str) -> bool:
    return word[:1] != "-" or _is_negative_number(word)


@lru_cache(maxsize=4096)
def parse_fraction(text: str) -> Fraction | None:
    """A decimal number as an exact fraction; ``None`` when the text is not a plain number."""
    text = text.strip()
    if not _DECIMAL.match(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):  # pragma: no cover - the regex admits only decimals
        return None


def parse_positive_int(text: str) -> int | None:
    """A strictly positive integer, or ``None``."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 6:
        return None
    value = int(text)
    return value if value > 0 else None


def unresolved_reference(text: str) -> str | None:
    """The variable a value still refers to (``$(UTIL)``, ``$UTIL``), when it could not be expanded;
    :data:`COMMAND_OUTPUT` for a command substitution (``$(cat /etc/util)``, backticks)."""
    if "$" not in text and "`" not in text:  # every form starts with one of them
        return None
    match = _REFERENCE.search(text)
    if match is None:
        return None
    return match.group(1) or match.group(2) or match.group(3) or COMMAND_OUTPUT


def unknown_value(reference: str) -> str:
    """Why a value that still holds ``reference`` cannot be read, in words."""
    if reference == COMMAND_OUTPUT:
        return "it is the output of a command, which vramguard cannot know"
    return f"{reference} is not a literal env value in the spec, so vramguard cannot read it"


@dataclass(slots=True)
class Findings:
    """Evidence, warnings and errors collected while reading one engine's configuration."""

    container: str
    evidence: list[str]
    warnings: list[str]
    errors: list[str]
    default_warning: str | None = None
    """The warning that the VRAM comes from the engine's built-in default (also in ``warnings``)."""

    @classmethod
    def for_container(cls, container: str) -> Findings:
        """Empty findings for the named container."""
        return cls(container, [], [], [])

    def warn(self, message: str) -> None:
        """Record a warning about the container."""
        self.warnings.append(f"container {self.container}: {message}")

    def relies_on_default(self, message: str) -> None:
        """Record the warning that the container relies on the engine's default memory share."""
        self.warnings.append(message)
        self.default_warning = message

    def error(self, message: str) -> None:
        """Record an error about the container."""
        self.errors.append(f"container {self.container}: {message}")

    def fraction(self, flag: Flag, low_exclusive: Fraction = Fraction(0)) -> Fraction | None:
        """Read a flag's value as a fraction of the GPU in (0, 1], recording evidence or an error."""
        if flag.value is None:
            self.error(f"{flag.name} has no value")
            return None
        reference = unresolved_reference(flag.value)
        if reference is not None:
            self.warn(
                f"{flag.evidence()}: {unknown_value(reference)}; set the value literally or declare {VRAM_ANNOTATION}"
            )
            return None
        value = parse_fraction(flag.value)
        if value is None:
            self.error(f"{flag.evidence()} is not a number")
            return None
        if not low_exclusive < value <= 1:
            self.error(f"{flag.evidence()} is outside (0, 1]")
            return None
        self.evidence.append(flag.evidence())
        return value

    def overridden(self, flag: Flag | None, options: Options, engine: str) -> bool:
        """Whether an argument the spec does not show may set ``flag`` again (or set it at all, when
        ``flag`` is ``None``); records why."""
        word = options.unreadable_after(flag)
        if word is None:
            return False
        reference = unresolved_reference(word) or word
        setting = f"{flag.name} again after {flag.evidence()}" if flag is not None else "its memory flags"
        self.warn(
            f"{engine}: argument {excerpt(word)} may set {setting} ({unknown_value(reference)}), so its VRAM is "
            f"unknown; write the argument literally or declare {VRAM_ANNOTATION}"
        )
        return True

    def count(self, flag: Flag) -> int | None:
        """Read a flag's value as a positive integer (a parallel size), recording evidence or an error."""
        if flag.value is None:
            self.error(f"{flag.name} has no value")
            return None
        value = parse_positive_int(flag.value)
        if value is None:
            self.error(f"{flag.evidence()} is not a positive integer")
            return None
        self.evidence.append(flag.evidence())
        return value


def env_flag(env: ContainerEnv, name: str, found: Findings) -> Flag | None:
    """An environment variable read like a flag (``env NAME=value``); warns when it is not visible."""
    entry = env.values.get(name)
    if entry is None:
        return None
    if entry.value is None:
        found.warn(f"env {name} comes from {entry.source}, which vramguard cannot read")
        return None
    return Flag(f"env {name}", entry.value, "=")


def hidden_settings(env: ContainerEnv, names: Iterable[str], engine: str, found: Findings) -> bool:
    """Whether any variable of ``names`` (settings that can lift or replace the engine's memory cap)
    may hold a value the spec does not show: set from a Secret, a ConfigMap, a field or a resource,
    or by an ``envFrom`` source. The engine's VRAM is then unknown (the warning says why)."""
    hidden = [name for name in names if env.is_opaque(name)]
    if not hidden:
        return False
    entry = env.values.get(hidden[0])
    source = entry.source if entry is not None else ", ".join(env.opaque_sources)
    found.warn(
        f"env {', '.join(hidden[:4])} may be set from {source}, which vramguard cannot read; it can lift or "
        f"replace {engine}'s memory cap, so its VRAM is unknown; set it literally or declare {VRAM_ANNOTATION}"
    )
    return True


_ONE_GPU = {ray: Parallel(1, (), None, None, ray) for ray in (False, True)}


def parallel_layout(
    options: Options,
    sizes: Sequence[Sequence[str]],
    found: Findings,
    nodes: Sequence[str] = ("--nnodes",),
    ray: bool = False,
    per_pod: bool = False,
) -> Parallel | None:
    """The parallel sizes an engine's flags multiply to, and the nodes they say it spans.

    ``sizes`` lists each size's aliases; an absent size counts 1. ``None`` when a size is unreadable
    (the error is recorded).
    """
    total = 1
    written: list[str] = []
    canonical: list[str] = []
    for names in sizes:
        flag = options.last(names)
        if flag is not None and flag.value is not None and unresolved_reference(flag.value):
            # ``--tp-size $(PARALLELISM_SIZE)``: set when the pod is created (an operator's variable, OME's
            # GPUs per pod x pods): the GPUs the engine uses are not checked against the container's.
            found.evidence.append(flag.evidence())
            return None
        if flag is not None:
            size = found.count(flag)
            if size is None:
                return None
            total *= size
            written.append(flag.evidence())
            if size > 1:
                canonical.append(f"{names[0].lstrip('-')}={size}")
    node_count: int | None = None
    node_flag = options.last(nodes)
    if node_flag is not None and node_flag.value is not None and unresolved_reference(node_flag.value):
        # ``--nnodes $(LWS_GROUP_SIZE)``: set when the pod is created; the group's size says it.
        found.evidence.append(node_flag.evidence())
        node_flag = None
    if node_flag is not None:
        node_count = found.count(node_flag)
        if node_count is None:
            return None
    elif not written and not per_pod:
        return _ONE_GPU[ray]  # no flag at all, the common case: the same immutable value each time
    if node_count is not None and node_count > 1:
        canonical.append(f"{nodes[0].lstrip('-')}={node_count}")
    return Parallel(
        total, tuple(written), node_count, node_flag.evidence() if node_flag is not None else None, ray,
        per_pod, ",".join(canonical),
    )
