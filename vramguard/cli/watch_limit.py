"""``--max-watch-event-bytes``, shared by the services that watch the API server."""

from __future__ import annotations

import argparse

from vramguard.quantity import QuantityError, parse_bytes

MIN_EVENT_LIMIT = 64 << 10
"""Below this even ordinary pods (a few KiB to tens of KiB of JSON) would force re-lists."""
MAX_EVENT_LIMIT = 1 << 30


def add_max_watch_event_bytes(parser: argparse.ArgumentParser) -> None:
    """Add ``--max-watch-event-bytes`` (default: None, meaning the service's default of 16 MiB)."""
    parser.add_argument(
        "--max-watch-event-bytes",
        type=parse_event_limit,
        default=None,
        metavar="BYTES",
        help="longest watch event read (a quantity, e.g. 16Mi, the default); a longer one is not decoded "
        "but forces a re-list, its nodes held back until then",
    )


def parse_event_limit(text: str) -> int:
    """A byte quantity between 64Ki and 1Gi; ``argparse.ArgumentTypeError`` saying why otherwise."""
    try:
        value = parse_bytes(text)
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not MIN_EVENT_LIMIT <= value <= MAX_EVENT_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 64Ki..1Gi")
    return value
