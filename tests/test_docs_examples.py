"""The docs' CLI examples run, and print what the docs show.

Every ``vramguard explain`` and ``vramguard plan`` command in a code block of the docs or the README
is run on the files it names: a file the page shows (a YAML block whose first line is ``# NAME``)
or one of the repository (``examples/``). The lines shown after a command are its output: each must
be what the command prints, line after line, ``...`` standing for anything (a whole line of it
for any number of lines). A command naming a file that neither holds is a placeholder
(``POD``, ``my-app.yaml``), and one with ``--cluster`` needs a cluster: neither is run here, and
the test says how many ran, so that a page cannot drift away from the program unnoticed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vramguard.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
COMMANDS = ("explain", "plan")
BLOCK = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
FILE_HEADER = re.compile(r"#\s*([\w.-]+\.ya?ml)\n")


@dataclass(frozen=True)
class Example:
    page: str
    argv: tuple[str, ...]
    shown: tuple[str, ...]
    """The lines the page shows after the command (its output)."""


def page_files(text: str) -> dict[str, str]:
    """The files a page shows: YAML blocks whose first line is ``# NAME``."""
    files = {}
    for language, body in BLOCK.findall(text):
        header = FILE_HEADER.match(body)
        if language in ("yaml", "yml") and header:
            files[header.group(1)] = body
    return files


def examples(page: Path) -> Iterator[Example]:
    """The ``vramguard explain|plan`` commands of the page's code blocks, each with the lines after it."""
    text = page.read_text()
    for _, body in BLOCK.findall(text):
        lines = body.splitlines()
        starts = [i for i, line in enumerate(lines) if _command(line) is not None]
        for n, start in enumerate(starts):
            argv = _command(lines[start])
            assert argv is not None
            end = starts[n + 1] if n + 1 < len(starts) else len(lines)
            shown = tuple(line for line in lines[start + 1:end] if line.strip())
            if shown and shown[0].split()[0] in ("kubectl", "helm", "vramguard", "$"):
                shown = ()  # a block of commands, not an output
            yield Example(page.name, argv, shown)


def _command(line: str) -> tuple[str, ...] | None:
    line = line.removeprefix("$ ").strip()
    if not line.startswith("vramguard ") or line.split()[1] not in COMMANDS:
        return None
    words = shlex.split(line, comments=True)
    return tuple(words[1:]) if len(words) > 1 and words[1] in COMMANDS else None


def runnable(example: Example, files: dict[str, str]) -> bool:
    """Whether every file the command names is the page's or the repository's (``--cluster``
    needs a cluster: e2e/test_adoption.py runs both commands with it)."""
    if "--cluster" in example.argv:
        return False
    paths = [a for a in example.argv[1:] if not a.startswith("-") and re.search(r"\.(ya?ml|json)$|/$", a)]
    return bool(paths) and all(p in files or (ROOT / p).exists() for p in paths)


def matches(shown: tuple[str, ...], printed: list[str]) -> str | None:
    """``None`` when ``printed`` has the ``shown`` lines in order (``...`` for anything), else why not."""
    position = 0
    skipping = False
    for line in shown:
        if line.strip() == "...":
            skipping = True
            continue
        pattern = re.compile(
            r"\s+".join(".*".join(map(re.escape, word.split("..."))) for word in line.split()) + r"\s*"
        )
        found = next(
            (i for i in range(position, len(printed) if skipping else min(position + 1, len(printed)))
             if pattern.fullmatch(printed[i].strip())),
            None,
        )
        if found is None:
            return f"shown line not printed{' next' if not skipping else ''}: {line!r}"
        position, skipping = found + 1, False
    return None


ALL = [(page, example) for page in PAGES for example in examples(page)]


def test_the_docs_have_examples_to_run() -> None:
    ran = [e for page, e in ALL if runnable(e, page_files(page.read_text()))]
    # explain in the quickstart and the VRAM model; plan in the quickstart and explain-and-plan.
    assert len([e for e in ran if e.shown]) >= 3, ran
    assert {e.argv[0] for e in ran} == set(COMMANDS)


@pytest.mark.parametrize(
    ("page", "example"), ALL, ids=[f"{e.page}:{' '.join(e.argv)}" for _, e in ALL]
)
def test_docs_example(
    page: Path, example: Example, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = page_files(page.read_text())
    if not runnable(example, files):
        pytest.skip("names a placeholder file")
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    code = main(list(example.argv))
    out = capsys.readouterr().out
    assert code in (0, 1, 3), f"exit {code}: {out}"
    problem = matches(example.shown, out.splitlines())
    assert problem is None, f"{problem}\n--- printed ---\n{out}"


def test_matching_follows_the_shown_lines() -> None:
    printed = ["Pod default/chat", "  a   1", "  b   2", "  c   3"]
    assert matches(("Pod default/chat", "a 1", "...", "c 3"), printed) is None
    assert matches(("Pod default/chat", "a 1", "c 3"), printed) is not None  # b is not shown: say "..."
    assert matches(("a ...",), printed[1:]) is None
    assert matches(("a 2",), printed[1:]) is not None
