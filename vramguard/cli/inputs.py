"""The manifests a command reads, as kubectl takes them: files, ``-`` for standard input, directories
(their ``.yaml``, ``.yml`` and ``.json`` files; with ``-R`` their subdirectories too), given as
arguments or with ``-f`` repeated. Each source is read on its own, so concatenating files can never
merge two objects."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from vramguard.demand.objects import Document, load_each_document
from vramguard.policy import read_failure

__all__ = ["InputError", "Source", "add_input_arguments", "read_sources"]

SUFFIXES = (".yaml", ".yml", ".json")


class InputError(Exception):
    """An input that cannot be read; the message names it."""


@dataclass(frozen=True, slots=True)
class Source:
    """One file (or standard input) and its documents."""

    name: str
    documents: tuple[Document, ...]


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """``FILE...``, ``-f FILE`` (repeatable) and ``-R``."""
    parser.add_argument("files", nargs="*", metavar="FILE|DIR|-",
                        help="manifest files or directories, or - for standard input")
    parser.add_argument("-f", "--filename", action="append", default=[], metavar="FILE|DIR|-",
                        help="a manifest file or directory, as kubectl takes it (repeatable)")
    parser.add_argument("-R", "--recursive", action="store_true",
                        help="read the directories given, their subdirectories included")


def read_sources(args: argparse.Namespace) -> list[Source]:
    """Every source the arguments name, in order; :class:`InputError` for one that cannot be read."""
    given = [*args.files, *args.filename]
    if not given:
        raise InputError("no input: name manifest files or directories, or - for standard input")
    sources: list[Source] = []
    for name in given:
        for path in _expand(name, recursive=args.recursive):
            try:
                text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"{path}: {read_failure(exc)}") from None
            sources.append(Source(path, tuple(load_each_document(text))))
    return sources


def _expand(name: str, *, recursive: bool) -> list[str]:
    if name == "-":
        return ["-"]
    path = Path(name)
    if not path.is_dir():
        return [name]
    found = path.rglob("*") if recursive else path.iterdir()
    files = sorted(str(p) for p in found if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise InputError(f"{name}: no .yaml, .yml or .json file{'' if recursive else ' (-R reads subdirectories)'}")
    return files
