"""Shell syntax: a script as ``sh`` parses it, into the tree :mod:`vramguard.demand.shell` walks.

POSIX ``sh`` with the bash forms start-up scripts use (``[[ ]]``, ``$'...'``, ``function``, ``|&``,
``&>``, arrays, read as unknown values). Parsing is one left-to-right pass driven by regular
expressions that never scan the same text twice: no input makes it slower than linear. A script
longer than :data:`MAX_SCRIPT_CHARS`, nested deeper than :data:`MAX_NESTING`, or holding more
commands or words than the container's :class:`~vramguard.demand.commandline.Budget` allows is
:class:`~vramguard.demand.commandline.Unreadable`, as is one that does not parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramguard.demand.commandline import Budget, Unreadable

MAX_SCRIPT_CHARS = 64 * 1024
"""The longest shell script read; start-up scripts are a few hundred characters."""
MAX_NESTING = 32
"""Compound commands, substitutions and function calls nested in one another."""


# ---------------------------------------------------------------------------------------------
# The syntax tree
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lit:
    """Literal text of a word; ``quoted``: inside quotes or escaped (not split, not a keyword)."""

    text: str
    quoted: bool


@dataclass(frozen=True, slots=True)
class Param:
    """``$NAME``, ``${NAME}``, ``${NAME<op>arg}``; ``opaque`` for forms whose value is not computed."""

    name: str
    op: str
    arg: Word | None
    quoted: bool
    text: str
    opaque: bool = False


@dataclass(frozen=True, slots=True)
class Subst:
    """``$(...)`` or backticks: the commands run, the output is unknown."""

    script: Script
    quoted: bool
    text: str


@dataclass(frozen=True, slots=True)
class Opaque:
    """A value vramguard does not compute (``$((...))``): its text stands for it."""

    text: str
    quoted: bool


Part = Lit | Param | Subst | Opaque
Word = tuple[Part, ...]


@dataclass(slots=True)
class Simple:
    """A simple command: assignments, then words (the first names the command)."""

    assignments: list[tuple[str, Word | None]]
    """``NAME=value`` before the command; ``None``: an array, an unknown value."""
    words: list[Word]


@dataclass(slots=True)
class Group:
    """A compound command: its bodies in order (conditions, branches, loop bodies)."""

    kind: str
    """``brace``, ``subshell``, ``if``, ``case``, ``loop``, ``for`` or ``arith``."""
    bodies: list[Script]
    words: list[Word] | None = None
    """``for NAME in WORDS`` (``None``: the positional parameters), ``case WORD in``."""
    name: str | None = None


@dataclass(slots=True)
class Function:
    """A function definition: ``name() body``."""

    name: str
    body: Command


Command = Simple | Group | Function


@dataclass(slots=True)
class AndOr:
    """Pipelines joined by ``&&`` and ``||``, started in the background when ``&`` ends them."""

    pipelines: list[list[Command]]
    background: bool


Script = list[AndOr]


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

_BLANKS = re.compile(r"(?:[ \t\r]+|\\\n)*(?:#[^\n]*)?")
"""Blanks, line continuations, and a comment to the end of the line: always matches."""
_OPERATOR = re.compile(
    r"&&|\|\||;;&|;;|;&|\|&|&>>|&>|[0-9]*(?:<<<|<<-|<<|>>|<&|>&|<>|>\||<|>)|[|&;()\n]"
)
_REDIRECTION = re.compile(r"[0-9]*[<>]|&>")
_RESERVED = re.compile(
    r"(if|then|elif|else|fi|do|done|case|esac|while|until|for|select|in|function|\{|\}|!|\[\[)"
    r"(?=[ \t\r\n;&|()<>]|$)"
)
_PLAIN = re.compile(r"[^ \t\r\n|&;()<>\\'\"$`]+")
_BRACE_PLAIN = re.compile(r"[^}\\'\"$`]+")
_DOUBLE_PLAIN = re.compile(r"[^\"\\$`]+")
NAME = re.compile(r"[A-Za-z_]\w*", re.ASCII)
_PARAM = re.compile(r"(#)?([A-Za-z_]\w*|[0-9]+|[@*#?$!-])", re.ASCII)
_PARAM_OP = re.compile(r":?[-=+?]|##?|%%?|//?|:|\^\^?|,,?|@")
_ANSI_C = re.compile(r"([^'\\]*(?:\\.[^'\\]*)*)'", re.S)
_ANSI_ESCAPE = re.compile(r"\\(.)", re.S)
_ANSI_CHARS = {"n": "\n", "t": "\t", "r": "\r", "e": "\x1b", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
_BACKTICK = re.compile(r"([^`\\]*(?:\\.[^`\\]*)*)`", re.S)
_BACKTICK_ESCAPE = re.compile(r"\\([`$\\])")
_PARENS = re.compile(r"[()]")
ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)\+?=", re.ASCII)
_SEPARATORS = frozenset({";", "\n"})
_CASE_ENDS = frozenset({";;", ";&", ";;&"})


def parse_script(text: str, budget: Budget) -> Script:
    """The syntax tree of a script; :class:`Unreadable` when it is too long, too deep or not shell."""
    if len(text) > MAX_SCRIPT_CHARS:
        raise Unreadable(
            f"its shell script is {len(text) // 1024} KiB, longer than the {MAX_SCRIPT_CHARS // 1024} KiB "
            "vramguard reads"
        )
    return _Parser(text, budget, 0).script()


class _Parser:
    """A recursive-descent parser over ``text``, one position moving forward."""

    __slots__ = ("budget", "depth", "heredocs", "peeked", "pos", "text")

    def __init__(self, text: str, budget: Budget, depth: int) -> None:
        self.text = text
        self.pos = 0
        self.budget = budget
        self.depth = depth
        self.heredocs: list[tuple[str, bool]] = []
        self.peeked: tuple[int, str | None] = (-1, None)
        """The operator at a position, once looked for there (the parser asks several times)."""

    def fail(self, what: str) -> Unreadable:
        line = self.text.count("\n", 0, self.pos) + 1
        return Unreadable(f"its shell script does not parse ({what} on line {line})")

    def script(self) -> Script:
        body = self.commands(frozenset(), frozenset())
        if self.pos < len(self.text):
            raise self.fail(f"unexpected {self.text[self.pos]!r}")
        return body

    # -- tokens ------------------------------------------------------------------------------

    def blanks(self) -> None:
        self.pos = _BLANKS.match(self.text, self.pos).end()  # type: ignore[union-attr]

    def operator(self) -> str | None:
        if self.peeked[0] != self.pos:
            self.blanks()
            match = _OPERATOR.match(self.text, self.pos)
            self.peeked = (self.pos, match.group() if match is not None else None)
        return self.peeked[1]

    def reserved(self) -> str | None:
        self.blanks()
        match = _RESERVED.match(self.text, self.pos)
        return match.group(1) if match is not None else None

    def take(self, token: str) -> None:
        self.pos += len(token)
        if token == "\n" and self.heredocs:
            self.skip_heredocs()

    def expect_operator(self, token: str) -> None:
        if self.operator() != token:
            raise self.fail(f"{token!r} expected")
        self.take(token)

    def expect_word(self, word: str) -> None:
        if self.reserved() != word:
            raise self.fail(f"{word!r} expected")
        self.pos += len(word)

    def newlines(self) -> None:
        while self.operator() == "\n":
            self.take("\n")

    def skip_heredocs(self) -> None:
        """Skip the bodies of the here-documents opened on the line just ended."""
        text = self.text
        for delimiter, strip_tabs in self.heredocs:
            while self.pos < len(text):
                end = text.find("\n", self.pos)
                line_end = len(text) if end < 0 else end
                line = text[self.pos:line_end]
                self.pos = line_end + 1 if end >= 0 else line_end
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break
        self.heredocs.clear()

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise Unreadable(f"its shell script nests more than {MAX_NESTING} levels deep, more than vramguard reads")

    # -- lists and commands --------------------------------------------------------------------

    def commands(self, stop_words: frozenset[str], stop_operators: frozenset[str]) -> Script:
        """And-or lists up to a stop word (``fi``), a stop operator (``)``) or the end."""
        self.enter()
        items: Script = []
        while True:
            while (token := self.operator()) in _SEPARATORS:
                self.take(token)
            if self.pos >= len(self.text) or token in stop_operators or self.reserved() in stop_words:
                break
            pipelines = self.and_or()
            token = self.operator()
            background = token == "&"
            if token == "&" or token in _SEPARATORS:
                self.take(token)
            elif not (self.pos >= len(self.text) or token in stop_operators or self.reserved() in stop_words):
                raise self.fail(f"unexpected {token or self.text[self.pos]!r}")
            items.append(AndOr(pipelines, background))
        self.depth -= 1
        return items

    def and_or(self) -> list[list[Command]]:
        pipelines = [self.pipeline()]
        while (token := self.operator()) in ("&&", "||"):
            self.take(token)
            self.newlines()
            pipelines.append(self.pipeline())
        return pipelines

    def pipeline(self) -> list[Command]:
        if self.reserved() == "!":
            self.pos += 1
        commands = [self.command()]
        while (token := self.operator()) in ("|", "|&"):
            self.take(token)
            self.newlines()
            commands.append(self.command())
        return commands

    def command(self) -> Command:
        self.budget.command()
        word = self.reserved()
        node: Command
        if word == "{":
            self.pos += 1
            node = Group("brace", [self.commands(frozenset({"}"}), frozenset())])
            self.expect_word("}")
        elif word == "if":
            node = self.if_command()
        elif word in ("while", "until"):
            self.pos += len(word)
            condition = self.commands(frozenset({"do"}), frozenset())
            node = Group("loop", [condition, self.do_done()])
        elif word in ("for", "select"):
            node = self.for_command(word)
        elif word == "case":
            node = self.case_command()
        elif word == "function":
            self.pos += len(word)
            self.blanks()
            name = NAME.match(self.text, self.pos)
            if name is None:
                raise self.fail("a function name expected")
            self.pos = name.end()
            if self.operator() == "(":
                self.take("(")
                self.expect_operator(")")
            return self.function_body(name.group())
        elif word == "[[":
            return self.conditional()
        elif self.operator() == "(":
            if self.text.startswith("((", self.pos):
                self.pos = self.arithmetic_end(self.pos + 2)
                node = Group("arith", [])
            else:
                self.take("(")
                node = Group("subshell", [self.commands(frozenset(), frozenset({")"}))])
                self.expect_operator(")")
        else:
            return self.simple()
        self.redirections()
        return node

    def function_body(self, name: str) -> Function:
        self.newlines()
        return Function(name, self.command())

    def if_command(self) -> Group:
        bodies: list[Script] = []
        word: str | None = "if"
        while word in ("if", "elif"):
            self.pos += len(word)
            bodies.append(self.commands(frozenset({"then"}), frozenset()))
            self.expect_word("then")
            bodies.append(self.commands(frozenset({"elif", "else", "fi"}), frozenset()))
            word = self.reserved()
        if word == "else":
            self.pos += len(word)
            bodies.append(self.commands(frozenset({"fi"}), frozenset()))
        self.expect_word("fi")
        return Group("if", bodies)

    def do_done(self) -> Script:
        self.expect_word("do")
        body = self.commands(frozenset({"done"}), frozenset())
        self.expect_word("done")
        return body

    def for_command(self, word: str) -> Group:
        self.pos += len(word)
        self.blanks()
        if self.text.startswith("((", self.pos):
            self.pos = self.arithmetic_end(self.pos + 2)
            name: str | None = None
            words: list[Word] | None = []
        else:
            match = NAME.match(self.text, self.pos)
            if match is None:
                raise self.fail(f"a variable name expected after {word!r}")
            self.pos = match.end()
            name, words = match.group(), None
            self.newlines()
            if self.reserved() == "in":
                self.pos += 2
                words = []
                while self.operator() is None and self.pos < len(self.text):
                    words.append(self.word())
        if self.operator() in _SEPARATORS:
            self.take(self.text[self.pos])
        self.newlines()
        return Group("for", [self.do_done()], words, name)

    def case_command(self) -> Group:
        self.pos += 4
        self.blanks()
        subject = self.word()
        self.newlines()
        self.expect_word("in")
        arms: list[Script] = []
        while True:
            self.newlines()
            if self.reserved() == "esac":
                break
            if self.operator() == "(":
                self.take("(")
            while True:
                self.blanks()
                self.word()  # a pattern: matched against a value vramguard does not evaluate
                token = self.operator()
                if token == "|":
                    self.take(token)
                    continue
                if token == ")":
                    self.take(token)
                    break
                raise self.fail("')' expected after a case pattern")
            arms.append(self.commands(frozenset({"esac"}), _CASE_ENDS))
            token = self.operator()
            if token in _CASE_ENDS:
                self.take(token)
            elif self.reserved() != "esac":
                raise self.fail("';;' or 'esac' expected")
        self.expect_word("esac")
        return Group("case", arms, [subject])

    def conditional(self) -> Simple:
        """``[[ ... ]]``: its operators are words; only its substitutions run anything."""
        self.pos += 2
        words: list[Word] = [(Lit("[[", False),)]
        text = self.text
        while True:
            self.blanks()
            if self.pos >= len(text):
                raise self.fail("']]' expected")
            if text.startswith("]]", self.pos):
                self.pos += 2
                return Simple([], words)
            token = self.operator()
            if token is not None:
                self.take(token)
            else:
                words.append(self.word())

    def arithmetic_end(self, start: int) -> int:
        """The position after the ``))`` closing ``((`` or ``$((`` (``start`` is after the opening)."""
        depth = 2
        pos = start
        while depth:
            match = _PARENS.search(self.text, pos)
            if match is None:
                raise self.fail("an unclosed '(('")
            depth += 1 if match.group() == "(" else -1
            pos = match.end()
        return pos

    def simple(self) -> Command:
        assignments: list[tuple[str, Word | None]] = []
        words: list[Word] = []
        start = self.pos
        while True:
            token = self.operator()
            if self.pos >= len(self.text):
                break
            if token is not None:
                if _REDIRECTION.match(token):
                    self.redirection(token)
                    continue
                if token == "(" and len(words) == 1 and not assignments and self.pos > start:
                    name = "".join(p.text for p in words[0] if isinstance(p, Lit))
                    self.take("(")
                    self.expect_operator(")")
                    return self.function_body(name)
                break
            word = self.word()
            assignment = _assignment(word) if not words else None
            if assignment is None:
                words.append(word)
            elif assignment[1] == () and self.text.startswith("(", self.pos):
                self.take("(")  # an array: NAME=(...), an unknown value
                while (token := self.operator()) != ")":
                    if token == "\n":
                        self.take(token)
                    elif token is not None or self.pos >= len(self.text):
                        raise self.fail("')' expected after an array")
                    else:
                        self.word()
                self.take(")")
                assignments.append((assignment[0], None))
            else:
                assignments.append(assignment)
        if self.pos == start:
            raise self.fail(f"unexpected {self.operator() or 'end'!r}")
        return Simple(assignments, words)

    def redirections(self) -> None:
        while (token := self.operator()) is not None and _REDIRECTION.match(token):
            self.redirection(token)

    def redirection(self, token: str) -> None:
        self.take(token)
        self.blanks()
        if self.operator() is not None or self.pos >= len(self.text):
            raise self.fail(f"a target expected after {token!r}")
        target = self.word()
        kind = token.lstrip("0123456789")
        if kind in ("<<", "<<-"):
            delimiter = "".join(p.text for p in target if isinstance(p, Lit))
            self.heredocs.append((delimiter, kind == "<<-"))

    # -- words ---------------------------------------------------------------------------------

    def word(self) -> Word:
        """One word: literal runs, quotes and expansions, up to a blank or an operator."""
        text = self.text
        parts: list[Part] = []
        start = self.pos
        while self.pos < len(text):
            if len(parts) > self.budget.parts:
                self.budget.word(len(parts))
            match = _PLAIN.match(text, self.pos)
            if match is not None:
                parts.append(Lit(match.group(), False))
                self.pos = match.end()
                continue
            if text[self.pos] in " \t\r\n|&;()<>":
                break
            self.special(parts, quoted=False)
        if self.pos == start:
            raise self.fail(f"unexpected {text[self.pos:self.pos + 1] or 'end'!r}")
        self.budget.word(len(parts))
        return tuple(parts)

    def special(self, parts: list[Part], quoted: bool) -> None:
        """A backslash, a quote, ``$`` or a backtick at the current position."""
        text = self.text
        pos = self.pos
        char = text[pos]
        if char == "\\":
            following = text[pos + 1:pos + 2]
            if following == "\n":
                self.pos += 2
            else:
                parts.append(Lit(following or "\\", True))
                self.pos += 1 + len(following)
        elif char == "'":
            end = text.find("'", pos + 1)
            if end < 0:
                raise self.fail("an unclosed ' quote")
            parts.append(Lit(text[pos + 1:end], True))
            self.pos = end + 1
        elif char == '"':
            self.double_quoted(parts)
        elif char == "$":
            self.dollar(parts, quoted)
        else:
            self.backtick(parts, quoted)

    def double_quoted(self, parts: list[Part]) -> None:
        text = self.text
        self.pos += 1
        parts.append(Lit("", True))  # "" is a word of its own
        while True:
            if self.pos >= len(text):
                raise self.fail('an unclosed " quote')
            if len(parts) > self.budget.parts:
                self.budget.word(len(parts))
            match = _DOUBLE_PLAIN.match(text, self.pos)
            if match is not None:
                parts.append(Lit(match.group(), True))
                self.pos = match.end()
                continue
            char = text[self.pos]
            if char == '"':
                self.pos += 1
                return
            if char == "\\":
                following = text[self.pos + 1:self.pos + 2]
                if following == "\n":
                    self.pos += 2
                elif following and following in '$`"\\':
                    parts.append(Lit(following, True))
                    self.pos += 2
                else:
                    parts.append(Lit("\\", True))
                    self.pos += 1
            elif char == "$":
                self.dollar(parts, True)
            else:
                self.backtick(parts, True)

    def dollar(self, parts: list[Part], quoted: bool) -> None:
        text = self.text
        start = self.pos
        following = text[start + 1:start + 2]
        if text.startswith("$((", start):
            self.pos = self.arithmetic_end(start + 3)
            parts.append(Opaque(text[start:self.pos], quoted))
        elif following == "(":
            self.pos = start + 2
            script = self.commands(frozenset(), frozenset({")"}))
            self.expect_operator(")")
            parts.append(Subst(script, quoted, text[start:self.pos]))
        elif following == "{":
            self.parameter(parts, quoted)
        elif following == "'" and not quoted:
            match = _ANSI_C.match(text, start + 2)
            if match is None:
                raise self.fail("an unclosed $' quote")
            text_value = _ANSI_ESCAPE.sub(lambda m: _ANSI_CHARS.get(m.group(1), m.group(1)), match.group(1))
            parts.append(Lit(text_value, True))
            self.pos = match.end()
        elif following == '"' and not quoted:
            self.pos = start + 1
            self.double_quoted(parts)
        elif (name := NAME.match(text, start + 1)) is not None:
            self.pos = name.end()
            parts.append(Param(name.group(), "", None, quoted, text[start:self.pos]))
        elif following and following in "0123456789@*#?$!-":
            self.pos = start + 2
            parts.append(Param(following, "", None, quoted, text[start:self.pos]))
        else:
            self.pos = start + 1
            parts.append(Lit("$", quoted))

    def parameter(self, parts: list[Part], quoted: bool) -> None:
        """``${...}``: a name, an operator, and a word up to the closing brace."""
        self.enter()
        text = self.text
        start = self.pos
        self.pos += 2
        opaque = text.startswith("!", self.pos)  # ${!name}: indirection
        self.pos += opaque
        match = _PARAM.match(text, self.pos)
        if match is None:
            raise self.fail("a bad ${...} substitution")
        length, name = match.group(1), match.group(2)
        self.pos = match.end()
        if text.startswith("[", self.pos):  # an array element: a value vramguard does not keep
            opaque = True
        operator = _PARAM_OP.match(text, self.pos)
        op = operator.group() if operator is not None else ""
        self.pos += len(op)
        arg = self.brace_word(quoted) if not text.startswith("}", self.pos) else None
        if not text.startswith("}", self.pos):
            raise self.fail("an unclosed ${")
        self.pos += 1
        self.depth -= 1
        opaque = opaque or op not in ("", ":-", "-", ":=", "=", ":+", "+", ":?", "?") or bool(length and op)
        parts.append(Param(name, "#" if length else op, arg, quoted, text[start:self.pos], opaque))

    def brace_word(self, quoted: bool) -> Word:
        """The word inside ``${NAME op ...}``: blanks and operators are literal; it ends at ``}``."""
        text = self.text
        parts: list[Part] = []
        while self.pos < len(text) and text[self.pos] != "}":
            if len(parts) > self.budget.parts:
                self.budget.word(len(parts))
            match = _BRACE_PLAIN.match(text, self.pos)
            if match is not None:
                parts.append(Lit(match.group(), quoted))
                self.pos = match.end()
            elif quoted and text[self.pos] == "'":  # inside "${...}" a single quote is a character
                parts.append(Lit("'", True))
                self.pos += 1
            else:
                self.special(parts, quoted)
        self.budget.word(len(parts))
        return tuple(parts)

    def backtick(self, parts: list[Part], quoted: bool) -> None:
        match = _BACKTICK.match(self.text, self.pos + 1)
        if match is None:
            raise self.fail("an unclosed ` quote")
        inner = _BACKTICK_ESCAPE.sub(lambda m: m.group(1), match.group(1))
        child = _Parser(inner, self.budget, self.depth + 1)
        child.enter()
        parts.append(Subst(child.script(), quoted, self.text[self.pos:match.end()]))
        self.pos = match.end()


def _assignment(word: Word) -> tuple[str, Word] | None:
    """``(NAME, value)`` when a word is ``NAME=value`` (``NAME+=value`` appends: read as a new value)."""
    first = word[0]
    if not isinstance(first, Lit) or first.quoted:
        return None
    match = ASSIGNMENT.match(first.text)
    if match is None:
        return None
    rest = first.text[match.end():]
    return match.group(1), ((Lit(rest, False),) if rest else ()) + word[1:]
