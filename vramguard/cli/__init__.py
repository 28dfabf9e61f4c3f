"""The ``vramguard`` command line: one sub-command per module in this package.

The CLI is the top layer and may import anything. Sub-commands that start a service (the extender,
the webhook, the agent) or talk to the API server still import it inside their handlers, for
start-up time only: aiohttp and the Kubernetes client take about 0.3 s each to import, which
``vramguard explain`` and ``kubectl vram --help`` should not pay. The layers are checked by
``lint-imports`` (the contracts in pyproject.toml), not by where an import sits.
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
