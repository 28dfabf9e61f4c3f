"""The ``vramguard`` command line: one sub-command per module in this package.

Sub-commands that need network services (the extender, the webhook, the agent) import them lazily
inside their handlers, so the pure core stays importable without aiohttp, kubernetes or pynvml.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vramguard.cli import commands


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for every sub-command."""
    parser = argparse.ArgumentParser(
        prog="vramguard",
        description="VRAM-aware admission and scheduling for shared NVIDIA GPUs.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in commands.REGISTRY:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vramguard`` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
