"""Which programs a container starts, with which arguments and environment, and which run at once.

The runtime executes one argument vector. When it is a shell (``sh -c SCRIPT``, ``bash -lc``, also
nested), the script is parsed (:mod:`vramguard.demand.shell_syntax`) and walked once, in order.

**What runs together.** Commands joined by ``;``, newlines, ``&&`` and ``||`` run one after the
other: each finishes before the next starts (a server that never exits keeps the later ones from
running at all). What runs at the same time is a *phase*: one foreground command, or all the
commands of a pipeline (``a | b``), together with every command started in the background (``&``)
before it and not yet waited for (a ``wait`` without operands ends them). The commands of one
background job all count as running at once and to the end of the script. ``exec CMD`` replaces the
shell: nothing after it runs. ``ray job submit -- CMD`` runs CMD, in the background with ``--no-wait``
(:func:`~vramguard.engines.launchers.ray_entrypoint`). ``if``/``case`` branches and loop bodies are
walked once, each branch as its own phases, so that the largest counts; a job started in the background
inside a loop may run any number of times at once, and is marked :attr:`Invocation.repeated`.

**Values.** ``$VAR``, ``${VAR}``, ``${VAR:-default}`` (``-``, ``=``, ``+``, ``?``, with and
without ``:``), ``$1``, ``"$@"`` and ``$#`` are expanded, with field splitting of unquoted results.
A variable the shell assigns is seen by later commands; by their environment only once exported
(``export``, ``declare -x``, ``set -a``, or inherited from the container), and ``A=1 cmd`` sets it
for ``cmd`` alone. A value the script may or may not assign (in a branch, a loop, after ``&&`` or
``||``) takes every value it may have: the largest number when all are numbers, else unknown.
``source FILE``, ``. FILE`` and ``read`` make the variables they may set unknown; so does a
default (``${VAR:-0.3}``) for a variable that an ``envFrom`` source or a ``valueFrom`` may set.
An unknown value stays in the argument as the text that produced it (``${UTIL}``,
``$(cat /etc/util)``), which the engines read as a value they cannot know. A command substitution
runs its commands before the command that uses it (beside the background jobs); its output is unknown.
Pathname expansion (``*``) is not performed.

**Bounded work.** The walk counts every command and word it expands, and every character expansion
adds, against the container's :class:`~vramguard.demand.commandline.Budget`; functions and ``eval``
nest at most :data:`~vramguard.demand.shell_syntax.MAX_NESTING` deep, shells
:data:`MAX_SHELL_DEPTH`. Past any limit the command line is
:class:`~vramguard.demand.commandline.Unreadable`: the reason is kept, and the container's VRAM is
unknown.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import Any, Generic, TypeVar

from vramguard.demand.commandline import Budget, ContainerEnv, EnvValue, Unreadable
from vramguard.demand.shell_syntax import (
    ASSIGNMENT,
    MAX_NESTING,
    NAME,
    Command,
    Function,
    Group,
    Lit,
    Opaque,
    Param,
    Script,
    Simple,
    Subst,
    Word,
    parse_script,
)
from vramguard.engines.launchers import RAY, ray_entrypoint

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh", "busybox"})
PREFIX_COMMANDS = frozenset({"exec", "nohup", "time", "command", "builtin"})
"""Commands that run the command after their options in the same process."""
SHELL_BUILTINS = frozenset({
    ":", "true", "false", "test", "[", "[[", "echo", "printf", "cd", "pwd", "kill", "ulimit", "umask",
    "shopt", "alias", "unalias", "hash", "type", "getopts", "break", "continue", "let",
})
"""Builtins that start no process and change nothing vramguard reads (the walker interprets
``export``, ``set``, ``source`` and the like itself)."""
MAX_SHELL_DEPTH = 4
"""Shells started by shells (``sh -c "bash -c '...'"``)."""
MAX_CANDIDATES = 8
"""Values a variable assigned under a condition may keep; more are one unknown value."""

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Walking
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Invocation:
    """One process a container will start: its argument vector and the environment it sees.

    ``env`` is live: it shows the environment as the process starts, and is valid only during the
    call that receives it."""

    argv: tuple[str, ...]
    env: ContainerEnv
    repeated: bool = False
    """Started in the background inside a loop: any number of it may run at once."""


@dataclass(frozen=True, slots=True)
class Phase(Generic[T]):
    """Processes running at the same time: the background processes ``started[since:until]`` and
    the foreground ones."""

    since: int
    until: int
    foreground: tuple[T, ...]


@dataclass(slots=True)
class Launch(Generic[T]):
    """What a container's command runs, as each process was classified, in phases."""

    started: list[T] = field(default_factory=list)
    """Processes started in the background, in order."""
    phases: list[Phase[T]] = field(default_factory=list)
    refusal: str | None = None
    """Why the command line was not read to its end (it is then :class:`Unreadable`)."""


def launch(argv: Sequence[str], env: ContainerEnv, classify: Callable[[Invocation], T], budget: Budget) -> Launch[T]:
    """Walk what ``argv`` runs, classifying each process as it starts (see the module docstring).

    Never raises: a command line that cannot be read is stopped where it became unreadable, and
    :attr:`Launch.refusal` says why."""
    walk = _Walk(env, classify, budget)
    result = walk.result
    try:
        walk.run(list(argv))
    except Unreadable as exc:
        result.refusal = str(exc)
    return result


@dataclass(frozen=True, slots=True)
class _Var:
    """A shell variable: the values it may have (``None`` among them: unset), or ``None``: unknown."""

    values: tuple[str | None, ...] | None
    exported: bool
    source: str
    generation: int = 0


_UNKNOWN_SOURCE = "a value the script chooses by a condition"
_ABSENT = _Var((None,), False, "unset")


class _Exported(Mapping[str, EnvValue]):
    """The environment a process started now receives: the exported variables."""

    __slots__ = ("walk",)

    def __init__(self, walk: _Walk[Any]) -> None:
        self.walk = walk

    def __getitem__(self, name: str) -> EnvValue:
        walk = self.walk
        var = walk.var(name)
        if var is None or not var.exported or var.generation < walk.cleared:
            raise KeyError(name)
        if var.generation < walk.opaque_generation:
            return EnvValue(None, walk.opaque_reason)
        if var.values is None:
            return EnvValue(None, var.source)
        assigned = [value for value in var.values if value is not None]
        if not assigned:
            raise KeyError(name)  # unset
        value = _largest(assigned)
        return EnvValue(value, var.source if value is not None else _UNKNOWN_SOURCE)

    def __iter__(self) -> Iterator[str]:
        names = dict.fromkeys(self.walk.env.values)
        names.update(dict.fromkeys(self.walk.vars))
        return (name for name in names if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Walk(Generic[T]):
    """The state of one walk: the shell's variables, the phases so far, the limits."""

    def __init__(self, env: ContainerEnv, classify: Callable[[Invocation], T], budget: Budget) -> None:
        self.env = env
        self.classify = classify
        self.budget = budget
        self.result: Launch[T] = Launch()
        self.vars: dict[str, _Var] = {}
        self.journal: list[tuple[str, _Var | None]] = []
        self.functions: dict[str, Command] = {}
        self.positional: list[str] | None = []
        self.generation = 0
        self.opaque_generation = 0
        self.opaque_reason = ""
        self.cleared = 0
        """Variables older than this are not passed to processes (``env -i``)."""
        self.allexport = False
        self.ifs_changed = False
        self.conditional = 0
        self.loops = 0
        self.repeating = False
        self.stopped = False
        self.since = 0
        self.collector: list[T] | None = None
        self.nesting = 0
        self.shells = 0

    # -- variables -----------------------------------------------------------------------------

    def var(self, name: str) -> _Var | None:
        """The variable as the shell sees it now, ``None`` when it is not set anywhere visible."""
        var = self.vars.get(name)
        if var is not None:
            return var
        entry = self.env.values.get(name)
        if entry is None:
            return None
        return _Var((entry.value,) if entry.value is not None else None, True, entry.source)

    def values(self, name: str) -> tuple[str | None, ...] | None:
        """The values a variable may have (``None`` among them: unset); ``None``: unknown."""
        var = self.var(name)
        if var is None:
            return None if self.opaque_generation or self.env.opaque_sources else (None,)
        if var.generation < self.opaque_generation:
            return None
        return var.values

    def assign(self, name: str, value: str | None, export: bool = False, temporary: bool = False) -> None:
        """Assign a variable (``value`` ``None``: unknown); under a condition it may keep its old value."""
        if name == "IFS":
            self.ifs_changed = True
        old = self.var(name)
        values: tuple[str | None, ...] | None = (value,) if value is not None else None
        if self.conditional and not temporary:
            values = _merge(self.values(name), values)
        exported = export or temporary or self.allexport or (old is not None and old.exported)
        self.generation += 1
        self.set(name, _Var(values, exported, "the script", self.generation))

    def set(self, name: str, var: _Var) -> None:
        self.journal.append((name, self.vars.get(name)))
        self.vars[name] = var

    def undo(self, mark: int) -> None:
        """Take back every assignment made since the journal had ``mark`` entries."""
        while len(self.journal) > mark:
            name, old = self.journal.pop()
            if old is None:
                self.vars.pop(name, None)
            else:
                self.vars[name] = old

    def process_env(self) -> ContainerEnv:
        opaque = list(self.env.opaque_sources)
        if self.opaque_generation:
            opaque.append(self.opaque_reason)
        return ContainerEnv(_Exported(self), opaque, self.env.files)

    # -- isolation -----------------------------------------------------------------------------

    def isolated(self, walk: Callable[[], None]) -> None:
        """Run ``walk`` as a subshell: what it assigns, exports, sets or stops does not last."""
        saved = (len(self.journal), self.positional, self.opaque_generation, self.opaque_reason, self.cleared,
                 self.allexport, self.ifs_changed, self.stopped)
        try:
            walk()
        finally:
            self.undo(saved[0])
            (_, self.positional, self.opaque_generation, self.opaque_reason, self.cleared, self.allexport,
             self.ifs_changed, self.stopped) = saved

    def collect(self, walk: Callable[[], None]) -> list[T]:
        """The processes ``walk`` starts, gathered as running at once instead of in phases."""
        outer = self.collector
        gathered: list[T] = []
        self.collector = gathered
        try:
            walk()
        finally:
            self.collector = outer
        return gathered

    def emit(self, processes: Sequence[T]) -> None:
        if not processes:
            return
        if self.collector is not None:
            self.collector.extend(processes)
        else:
            self.result.phases.append(Phase(self.since, len(self.result.started), tuple(processes)))

    # -- the script ----------------------------------------------------------------------------

    def script(self, script: Script) -> None:
        for item in script:
            if self.stopped:
                return
            if item.background:
                self.background(item.pipelines)
            else:
                self.and_or(item.pipelines)

    def and_or(self, pipelines: list[list[Command]]) -> None:
        self.pipeline(pipelines[0])
        if len(pipelines) == 1:
            return
        self.conditional += 1  # the commands after && or || may not run
        try:
            for pipeline in pipelines[1:]:
                if self.stopped:
                    break
                self.pipeline(pipeline)
        finally:
            self.conditional -= 1

    def pipeline(self, commands: list[Command]) -> None:
        if len(commands) == 1:
            self.command(commands[0])
            return

        def members() -> None:
            for command in commands:
                self.isolated(partial(self.command, command))

        self.emit(self.collect(members))

    def background(self, pipelines: list[list[Command]]) -> None:
        self.detach(partial(self.and_or, pipelines))

    def detach(self, walk: Callable[[], None]) -> None:
        """Run ``walk`` as a background job: what it starts runs beside everything after it."""
        repeating = self.repeating
        self.repeating = repeating or self.loops > 0
        try:
            started = self.collect(lambda: self.isolated(walk))
        finally:
            self.repeating = repeating
        if self.collector is not None:
            self.collector.extend(started)
        elif started:
            self.result.started.extend(started)
            self.result.phases.append(Phase(self.since, len(self.result.started), ()))

    def command(self, command: Command) -> None:
        if isinstance(command, Simple):
            self.simple(command)
        elif isinstance(command, Function):
            self.functions[command.name] = command.body
        elif command.kind == "brace":
            self.script(command.bodies[0])
        elif command.kind == "subshell":
            self.isolated(lambda: self.script(command.bodies[0]))
        elif command.kind != "arith":
            self.compound(command)

    def compound(self, group: Group) -> None:
        """``if``, ``case`` and loops: every branch walked once, under a condition."""
        self.conditional += 1
        looping = group.kind in ("loop", "for")
        self.loops += looping
        try:
            if group.kind == "for" and group.name is not None:
                fields = self.positional if group.words is None else self.fields_of(group.words)
                if fields is None or fields:  # the variable takes each value in turn: the largest counts
                    self.assign(group.name, _largest(fields) if fields is not None else None)
            elif group.kind == "case" and group.words:
                self.fields_of(group.words)
            for body in group.bodies:
                self.script(body)
        finally:
            self.conditional -= 1
            self.loops -= looping

    def simple(self, command: Simple) -> None:
        self.budget.command()
        assignments = [(name, self.joined(value) if value is not None else None) for name, value in command.assignments]
        argv = self.fields_of(command.words)
        if not argv:
            for name, value in assignments:
                self.assign(name, value)
            return
        if not assignments:
            self.run(argv)
            return
        mark = len(self.journal)
        for name, value in assignments:
            self.assign(name, value, temporary=True)
        try:
            self.run(argv)
        finally:
            self.undo(mark)

    # -- one command -----------------------------------------------------------------------------

    def run(self, argv: list[str]) -> None:
        """Run an argument vector: prefixes, builtins, functions, shells, or a process. A wrapper that has
        its command run for it (``ray job submit -- CMD``) runs that command, in the background where
        the wrapper does not wait for it."""
        replaces = with_env = detached = False
        cleared, mark = self.cleared, len(self.journal)
        try:
            while argv:
                head = _basename(argv[0])
                if head in PREFIX_COMMANDS:
                    replaces = replaces or head == "exec"
                    argv = _skip_options(argv[1:])
                elif head == "env":
                    with_env = True
                    argv = self.env_command(argv[1:])
                elif head == RAY and (entrypoint := ray_entrypoint(argv)) is not None:
                    detached = detached or entrypoint.detached
                    if entrypoint.starts_ray:
                        self.dispatch([RAY, "start"])  # the Ray cluster it joins, as ray start does
                    argv = entrypoint.argv
                else:
                    break
            if argv and detached:
                self.detach(partial(self.dispatch, argv))
            elif argv:
                self.dispatch(argv)
        finally:
            if with_env:
                self.undo(mark)  # env's changes were for its command alone
            self.cleared = cleared
        if replaces and argv and not self.conditional:
            self.stopped = True  # exec: the shell is gone, nothing after it runs

    def env_command(self, argv: list[str]) -> list[str]:
        """``env [-i] [-u NAME] [NAME=VALUE]... COMMAND``: the environment COMMAND runs with."""
        index = 0
        while index < len(argv) and argv[index].startswith("-"):
            option = argv[index]
            if option in ("-i", "--ignore-environment", "-"):
                self.generation += 1
                self.cleared = self.generation
            elif option in ("-u", "--unset") and index + 1 < len(argv):
                index += 1
                self.set(argv[index], _ABSENT)
            elif option.startswith("--unset="):
                self.set(option[8:], _ABSENT)
            index += 1
        while index < len(argv) and (match := ASSIGNMENT.match(argv[index])) is not None:
            self.assign(match.group(1), argv[index][match.end():], temporary=True)
            index += 1
        return argv[index:]

    def dispatch(self, argv: list[str]) -> None:
        head = _basename(argv[0])
        builtin = _BUILTINS.get(head)
        if builtin is not None:
            builtin(self, argv)
        elif head in SHELL_BUILTINS:
            return
        elif head in self.functions:
            self.call(self.functions[head], argv[1:])
        elif (shell := _shell_script(argv, self.env.files)) is not None:
            self.shell(*shell)
        elif (script := _shell_file(self.env.files, argv[0])) is not None:
            self.shell(script, argv[1:])  # a script executed by its path: its shebang names a shell
        else:
            self.emit((self.classify(Invocation(tuple(argv), self.process_env(), self.repeating)),))

    def call(self, body: Command, args: list[str]) -> None:
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise Unreadable(f"its shell functions call each other more than {MAX_NESTING} levels deep")
        positional, stopped = self.positional, self.stopped
        self.positional = args
        try:
            self.command(body)
        finally:
            self.positional, self.stopped = positional, stopped
            self.nesting -= 1

    def shell(self, script: str, positional: list[str]) -> None:
        """A shell started by the command line or by a script: its script walked in a subshell."""
        if self.shells >= MAX_SHELL_DEPTH:
            raise Unreadable(f"it starts shells nested more than {MAX_SHELL_DEPTH} deep, more than vramguard reads")
        tree = parse_script(script, self.budget)

        def walk() -> None:
            self.positional = positional
            self.script(tree)

        self.shells += 1
        try:
            self.isolated(walk)
        finally:
            self.shells -= 1

    # -- builtins that change the shell ------------------------------------------------------------

    def declare(self, argv: list[str]) -> None:
        """``export``, ``declare``, ``local``, ``readonly``, ``typeset``: ``NAME[=VALUE]`` words."""
        export = argv[0] == "export"
        for word in argv[1:]:
            if word.startswith(("-", "+")):
                export = export or ("x" in word and word.startswith("-"))
                continue
            match = ASSIGNMENT.match(word)
            if match is not None:
                self.assign(match.group(1), word[match.end():], export=export)
            elif export and (var := self.var(word)) is not None and not var.exported:
                self.set(word, _Var(var.values, True, var.source, var.generation))

    def unset(self, argv: list[str]) -> None:
        for name in argv[1:]:
            if not name.startswith("-"):
                self.generation += 1
                values = _merge(self.values(name), (None,)) if self.conditional else (None,)
                self.set(name, _Var(values, False, "the script", self.generation))

    def set_options(self, argv: list[str]) -> None:
        """``set``: ``-a``/``+a`` (``-o allexport``) and new positional parameters."""
        index = 1
        while index < len(argv):
            word = argv[index]
            if word == "--":
                index += 1
                break
            if word in ("-o", "+o") and index + 1 < len(argv):
                if argv[index + 1] == "allexport":
                    self.allexport = word == "-o"
                index += 2
                continue
            if not word.startswith(("-", "+")):
                break
            if "a" in word:
                self.allexport = word.startswith("-")
            index += 1
        if index < len(argv) or "--" in argv[1:]:
            self.positional = None if self.conditional else argv[index:]

    def shift(self, argv: list[str]) -> None:
        count = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else 1
        if self.positional is not None:
            self.positional = None if self.conditional else self.positional[count:]

    def source(self, argv: list[str]) -> None:
        """``source FILE`` / ``. FILE``: read in this shell when its text is known; else it may start
        anything and set any variable."""
        known = self.env.files.get(argv[1]) if len(argv) > 1 else None
        if known is not None:
            self.nesting += 1
            if self.nesting > MAX_NESTING:
                raise Unreadable(f"its scripts source each other more than {MAX_NESTING} levels deep")
            positional, arguments = self.positional, argv[2:]
            if arguments:
                self.positional = arguments  # ``source FILE ARGS``: $1... while it runs
            try:
                self.script(parse_script(known, self.budget))
            finally:
                if arguments:
                    self.positional = positional
                self.nesting -= 1
            return
        self.emit((self.classify(Invocation(tuple(argv), self.process_env(), self.repeating)),))
        self.generation += 1
        self.opaque_generation = self.generation
        self.opaque_reason = f"the file {argv[1] if len(argv) > 1 else '?'} that the script sources"

    def evaluate(self, argv: list[str]) -> None:
        """``eval WORDS``: the words joined, read as a script in this shell."""
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise Unreadable(f"its shell evals nest more than {MAX_NESTING} levels deep")
        try:
            self.script(parse_script(" ".join(argv[1:]), self.budget))
        finally:
            self.nesting -= 1

    def read(self, argv: list[str]) -> None:
        for name in argv[1:]:
            if NAME.fullmatch(name):
                self.assign(name, None)

    def wait(self, argv: list[str]) -> None:
        if len(argv) == 1 and not self.conditional and self.collector is None:
            self.since = len(self.result.started)  # every background job has ended

    def leave(self, argv: list[str]) -> None:
        """``exit`` and ``return``: nothing after them runs."""
        del argv
        if not self.conditional:
            self.stopped = True

    def trap(self, argv: list[str]) -> None:
        """``trap ACTION SIGNAL...``: the action may run at any later point; walked under a condition."""
        if len(argv) > 2 and not argv[1].startswith("-"):
            self.conditional += 1
            try:
                self.script(parse_script(argv[1], self.budget))
            finally:
                self.conditional -= 1

    # -- expansion -----------------------------------------------------------------------------

    def fields_of(self, words: Sequence[Word]) -> list[str]:
        out: list[str] = []
        for word in words:
            out.extend(self.fields(word))
        return out

    def fields(self, word: Word) -> list[str]:
        """A word's fields after expansion and field splitting (an unknown part keeps its text)."""
        self.budget.word(len(word))
        fields: list[str] = []
        current: list[str] = []
        started = False
        for part in word:
            if isinstance(part, Lit):
                current.append(part.text)
                started = started or part.quoted or bool(part.text)
                continue
            if isinstance(part, Param) and part.name in ("@", "*") and not part.op and self.positional is not None:
                if part.quoted and part.name == "@":
                    self.budget.expand(sum(map(len, self.positional)))
                    if self.positional:
                        current.append(self.positional[0])
                        for positional in self.positional[1:]:
                            fields.append("".join(current))
                            current = [positional]
                        started = True
                    continue
                joined = " ".join(self.positional)
                self.budget.expand(len(joined))
                value: str | None = joined
            else:
                value = self.value(part)
            if value is None:
                current.append(_unknown(part))
                started = True
            elif part.quoted or not value:
                current.append(value)
                started = started or part.quoted
            elif self.ifs_changed:
                current.append(part.text)  # split by a separator the script chose: unknown
                started = True
            else:
                first, *rest = _FIELD_SEPARATORS.split(value)
                current.append(first)
                if rest:
                    if started or first:
                        fields.append("".join(current))
                    *middle, last = rest
                    fields.extend(middle)
                    current = [last]
                    started = bool(last)
                else:
                    started = True
        if started:
            fields.append("".join(current))
        return fields

    def joined(self, word: Word) -> str:
        """A word expanded without field splitting (an assignment's value, a default)."""
        self.budget.word(len(word))
        out: list[str] = []
        for part in word:
            if isinstance(part, Lit):
                out.append(part.text)
            else:
                value = self.value(part)
                out.append(_unknown(part) if value is None else value)
        return "".join(out)

    def value(self, part: Param | Subst | Opaque) -> str | None:
        """What one expansion produces; ``None`` when it cannot be known."""
        if isinstance(part, Subst):
            self.emit(self.collect(lambda: self.isolated(lambda: self.script(part.script))))
            return None
        if isinstance(part, Opaque):
            return None
        default = self.joined(part.arg) if part.arg is not None else ""
        if part.opaque:
            return None
        result = self.parameter(part, default)
        if result is not None:
            self.budget.expand(len(result))
        return result

    def parameter(self, part: Param, default: str) -> str | None:
        name, op = part.name, part.op
        if name.isdigit() or name in ("#", "@", "*"):
            candidates = self.special(name)
        elif name in ("?", "$", "!", "-"):
            return None
        else:
            candidates = self.values(name)
        if candidates is None:
            return None
        results: list[str | None] = []
        for value in candidates:
            unset = value is None or (op.startswith(":") and value == "")
            if op == "":
                results.append(value)  # unset and not in the spec: the image may set it
            elif op == "#":
                results.append(str(len(value or "")))
            elif op in (":-", "-", ":=", "="):
                results.append(default if unset else value)
            elif op in (":+", "+"):
                results.append("" if unset else default)
            else:
                results.append(None if unset else value)  # ${NAME:?message}: the shell stops when unset
        if op == "" and any(value is not None for value in results):
            # Unset, $NAME is empty: the flag before it has no value and the engine does not start.
            results = [value for value in results if value is not None]
        chosen = _largest(results)
        if op in (":=", "=") and chosen is not None and NAME.fullmatch(name):
            self.assign(name, chosen)
        return chosen

    def special(self, name: str) -> tuple[str | None, ...] | None:
        positional = self.positional
        if positional is None:
            return None
        if name == "#":
            return (str(len(positional)),)
        if name in ("@", "*"):
            return (" ".join(positional),)
        index = int(name)
        if index == 0:
            return ("sh",)
        return (positional[index - 1],) if index <= len(positional) else (None,)



_FIELD_SEPARATORS = re.compile(r"[ \t\n]+")

_BUILTINS: dict[str, Callable[[_Walk[Any], list[str]], None]] = {
    "export": _Walk.declare, "declare": _Walk.declare, "typeset": _Walk.declare, "local": _Walk.declare,
    "readonly": _Walk.declare, "unset": _Walk.unset, "set": _Walk.set_options, "shift": _Walk.shift,
    "source": _Walk.source, ".": _Walk.source, "eval": _Walk.evaluate, "read": _Walk.read, "wait": _Walk.wait,
    "exit": _Walk.leave, "return": _Walk.leave, "trap": _Walk.trap,
}


def _merge(old: tuple[str | None, ...] | None, new: tuple[str | None, ...] | None) -> tuple[str | None, ...] | None:
    """The values a variable may have after an assignment that may not happen."""
    if old is None or new is None:
        return None
    merged = tuple(dict.fromkeys(old + new))
    return merged if len(merged) <= MAX_CANDIDATES else None


def _largest(results: Sequence[str | None]) -> str | None:
    """One value for several possible ones: the same one, or the largest number; else unknown."""
    distinct = list(dict.fromkeys(results))
    if len(distinct) == 1:
        return distinct[0]
    numbers = [(_number(value), value) for value in distinct]
    if any(number is None for number, _ in numbers):
        return None
    return max(numbers, key=lambda pair: pair[0])[1]  # type: ignore[arg-type,return-value]


_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)", re.ASCII)


def _number(value: str | None) -> Fraction | None:
    if value is None or len(value) > 64 or not _DECIMAL.fullmatch(value.strip()):
        return None
    return Fraction(value.strip())


def _shell_script(argv: Sequence[str], files: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """``(SCRIPT, positional parameters)`` of ``sh -c SCRIPT [NAME ARGS...]``, ``bash -lc``,
    ``/bin/sh -ec``, ``busybox sh -c``, ``bash FILE ARGS...`` of a file in ``files``; else ``None``."""
    shell = _basename(argv[0])
    if shell not in SHELLS:
        return None
    index = 1
    if shell == "busybox":
        if len(argv) < 2 or argv[1] not in SHELLS:
            return None
        index = 2
    while index < len(argv):
        word = argv[index]
        if word.startswith("-") and not word.startswith("--") and len(word) > 1:
            if "c" in word[1:]:
                script = argv[index + 1] if index + 1 < len(argv) else ""
                return script, list(argv[index + 3:])
            index += 1
            continue
        if word.startswith("+") or word in ("--login", "--norc", "--noprofile"):
            index += 1
            continue
        known = files.get(word)
        return (known, list(argv[index + 1:])) if known is not None else None
    return None


_SHEBANG = re.compile(r"#!\s*(\S+)(?:[ \t]+(\S+))?")


def _shell_file(files: Mapping[str, str], path: str) -> str | None:
    """The text of a script in ``files`` run by its path, when a shell runs it (its shebang names
    one, or it has none: the kernel refuses it, and a shell that runs it reads it as a script)."""
    text = files.get(path)
    if text is None:
        return None
    shebang = _SHEBANG.match(text)
    if shebang is None:
        return text
    program = _basename(shebang[1])
    if program == "env" and shebang[2] is not None:
        program = _basename(shebang[2])
    return text if program in SHELLS else None


def _skip_options(argv: list[str]) -> list[str]:
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        index += 1
    return argv[index:]


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _unknown(part: Param | Subst | Opaque) -> str:
    """The text standing for an expansion whose value is unknown. An arithmetic expansion's value is
    one number, never several words, so its text loses its blanks: a variable holding it (``N=$((
    ${RANK:-0} * 8 ))``) still expands to one argument (``--data-parallel-start-rank $N``)."""
    return "".join(part.text.split()) if isinstance(part, Opaque) else part.text
