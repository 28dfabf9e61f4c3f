"""The largest batch vLLM captures a CUDA graph for, read from its flags.

vLLM captures its graphs from the largest batch size down, into one memory pool, so the pool is
about what the largest batch needs (its activations), plus a little per graph. The graphs'
allowance is sized for the largest default, 512; a command that asks for more grows it in
proportion (:func:`largest_capture`). Where the default comes from, by version (read in the wheels):

===============  ===================================================================================
old engine (V0)  the smallest of 1, 2, 4, 8, 16, ... 8192 at or above ``--max-num-seqs`` (default
                 256): ``VllmConfig._set_cudagraph_sizes`` (``config.py``, v0.6.6 to v0.9.2)
V1 to v0.9.x     ``--cuda-graph-sizes`` (from v0.9.0; default ``[512]``): one value is the largest of
                 ``[1, 2, 4] + range(8, N + 1, 8)``, several are the list (``config.py`` v0.9.2)
V1 v0.10-v0.11   the same flag, defaulting to ``[min(max_num_seqs x 2, 512)]``
                 (``config/scheduler.py`` v0.11.0): never above 512 unless set
from v0.12      ``--max-cudagraph-capture-size`` (default ``min(max_num_seqs x 2, 512)``) or the list
                 ``--cudagraph-capture-sizes`` (``config/vllm.py`` v0.20.2 ``_set_cudagraph_sizes``)
any V1           ``--compilation-config`` / ``-O`` JSON keys ``cudagraph_capture_sizes``,
                 ``max_capture_size`` (to v0.11) and ``max_cudagraph_capture_size``, also written as
                 dotted arguments (``-O.max_cudagraph_capture_size=1024``, ``utils/argparse_utils.py``)
===============  ===================================================================================

The largest of every size the command names is taken (vLLM may bound it by
``--max-num-batched-tokens``, which only makes it smaller).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from vramguard.engines.base import Options, parse_positive_int

REFERENCE = 512
"""The largest batch captured by default in any version, which the graphs' allowance is sized for."""
MAX_NUM_SEQS = ("--max-num-seqs",)
SIZE_LISTS = ("--cuda-graph-sizes", "--cudagraph-capture-sizes")
MAX_CAPTURE = ("--max-cudagraph-capture-size",)
COMPILATION = ("--compilation-config", "-O")
CAPTURE_KEYS = frozenset({"cudagraph_capture_sizes", "max_capture_size", "max_cudagraph_capture_size"})
MAX_JSON = 64 * 1024
"""A compilation config longer than this is not read (a pod's arguments are bounded anyway)."""
V0_SIZES_UP_TO = 8192


def largest_capture(args: Sequence[str], options: Options, old_engine: bool) -> tuple[int, str] | None:
    """The largest batch the command has vLLM capture a graph for, and the flag that says so, where it
    is above :data:`REFERENCE`; ``None`` where the default's 512 or less holds."""
    found: list[tuple[int, str]] = []
    flag = options.last(MAX_CAPTURE)
    if flag is not None and flag.value is not None and (value := parse_positive_int(flag.value)) is not None:
        found.append((value, flag.evidence()))
    flag = options.last(SIZE_LISTS)
    if flag is not None:
        sizes = list(_values_after(args, flag.position, flag.value))
        if sizes:
            found.append((max(sizes), f"{flag.name} ... {max(sizes)}"))
    found.extend(_compilation_sizes(args))
    if old_engine:
        flag = options.last(MAX_NUM_SEQS)
        if flag is not None and flag.value is not None and (seqs := parse_positive_int(flag.value)) is not None:
            found.append((_v0_capture(seqs), f"{flag.evidence()} (the old engine captures up to it)"))
    if not found:
        return None
    largest = max(found)
    return largest if largest[0] > REFERENCE else None


def _v0_capture(seqs: int) -> int:
    """The old engine's largest capture for ``--max-num-seqs``: the smallest of 1, 2, 4, 8k at or above it."""
    if seqs <= 4:
        return 4 if seqs > 2 else seqs
    return min(-(-seqs // 8) * 8, V0_SIZES_UP_TO)


def _values_after(args: Sequence[str], position: int, first: str | None) -> Iterator[int]:
    """The integers of a list option (``nargs="+"``): its value, then the words up to the next option."""
    if first is None or position < 0:
        return
    words = [first, *args[position + 2:]] if "=" not in args[position] else [first, *args[position + 1:]]
    for word in words:
        if word.startswith("-"):
            return
        for part in word.replace(",", " ").split():
            value = parse_positive_int(part.strip("[]"))
            if value is not None:
                yield value


def _compilation_sizes(args: Sequence[str]) -> Iterator[tuple[int, str]]:
    """Sizes a compilation config names: a JSON object after ``--compilation-config``/``-O`` (also
    ``=``-joined, ``_`` for ``-``), or dotted keys (``-O.max_cudagraph_capture_size=1024``)."""
    for index, word in enumerate(args):
        name, sep, value = word.partition("=")
        base, dot, key = name.partition(".")
        if base.replace("_", "-") not in COMPILATION:
            continue
        if not sep:
            value = args[index + 1] if index + 1 < len(args) else ""
        if dot:
            if key in CAPTURE_KEYS:
                yield from _sizes_of(_json(value) if value[:1] == "[" else value, word if sep else f"{word} {value}")
        elif value[:1] == "{":
            config = _json(value)
            if isinstance(config, dict):
                for key, sizes in config.items():
                    if key in CAPTURE_KEYS:
                        yield from _sizes_of(sizes, f"{base} {key}")


def _sizes_of(value: Any, evidence: str) -> Iterator[tuple[int, str]]:
    items = value if isinstance(value, list) else [value]
    numbers = [n for n in (_integer(item) for item in items) if n is not None]
    if numbers:
        yield max(numbers), evidence


def _integer(item: Any) -> int | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return item if 0 < item < 10**6 else None
    return parse_positive_int(item) if isinstance(item, str) else None


def _json(text: str) -> Any:
    if len(text) > MAX_JSON:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
