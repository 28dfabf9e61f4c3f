"""Kubernetes resource quantities (``12Gi``, ``500M``, ``1e9``) as exact numbers, and byte formatting.

The grammar is apimachinery's (``k8s.io/apimachinery/pkg/api/resource``)::

    <quantity> ::= <signedNumber><suffix>
    <suffix>   ::= Ki | Mi | Gi | Ti | Pi | Ei | n | u | m | "" | k | M | G | T | P | E
                 | e<signedNumber> | E<signedNumber>

It is stricter than the Kubernetes Python client's ``parse_quantity``, which also accepts what the
API server refuses (``NaN``, ``Infinity``, surrounding spaces, ``1_000``). The core must not import
the client (the ``core-is-pure`` import contract in pyproject.toml); a test checks both parsers agree on valid input.

Quantities come from users (annotations, resources, environment variables), so every parser and formatter
here is bounded: text longer than :data:`MAX_QUANTITY_TEXT` and byte counts above :data:`MAX_BYTES` are
refused with a reason (``huge``) before any arithmetic, messages quote at most a few dozen characters of
what they refuse, and the formatters take any ``int``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import lru_cache
from typing import Literal

_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$",
    re.ASCII,
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

MiB = 1 << 20
GiB = 1 << 30

MAX_QUANTITY_TEXT = 64
"""The longest quantity text read. The largest byte count (19 digits) with nine decimals, a sign and a
suffix fits; longer text names nothing a GPU holds, and is refused before it is turned into a number."""
MAX_BYTES = (1 << 63) - 1
"""The most bytes a quantity may name: the API server caps a binary-suffixed quantity at 2^63-1
(k8s.io/apimachinery v0.36.3 pkg/api/resource/quantity.go ``ParseQuantity``, "The max is just a simple
cap", at math.go's ``maxAllowed``), so ``8Ei`` and above are no amount of memory."""
MAX_EXPONENT = 30
"""The largest decimal exponent read (``1e30``); more is refused before ``10**exponent`` is computed."""
_EXCERPT = 32
"""How many characters of a refused text a message quotes."""

QuantityReason = Literal["junk", "huge"]


class QuantityError(ValueError):
    """The text is not a Kubernetes quantity or not an amount of bytes (``reason`` ``junk``), or is
    longer than :data:`MAX_QUANTITY_TEXT` or names more than :data:`MAX_BYTES` (``huge``). The message
    quotes the text cut short."""

    def __init__(self, message: str, reason: QuantityReason = "junk") -> None:
        super().__init__(message)
        self.reason: QuantityReason = reason


def excerpt(text: str, *, quote: bool = True) -> str:
    """``text`` for a message, in quotes (its ``repr``) unless ``quote`` is false, cut to a few dozen
    characters and followed by its length when longer: a 256 KiB annotation value does not become a
    256 KiB message."""
    shown = repr if quote else str
    if len(text) <= _EXCERPT:
        return shown(text)
    return f"{shown(text[:_EXCERPT])}... ({len(text)} characters)"


@lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Fraction:
    """Return the exact value of a Kubernetes quantity such as ``12Gi`` or ``0.5``."""
    if len(text) > MAX_QUANTITY_TEXT:
        raise QuantityError(
            f"{excerpt(text)} is longer than {MAX_QUANTITY_TEXT} characters, more than any quantity needs", "huge"
        )
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(f"{excerpt(text)} is not a Kubernetes quantity (for example 12Gi or 16G)")
    try:
        number = Fraction(Decimal(match["number"]))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid decimals
        raise QuantityError(f"{excerpt(text)} is not a number") from exc
    suffix = match["suffix"]
    if not suffix:
        return number
    if suffix in _BINARY:
        return number * Fraction(1024 ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number * Fraction(10) ** _DECIMAL[suffix]
    exponent = int(suffix[1:])
    if abs(exponent) > MAX_EXPONENT:
        raise QuantityError(
            f"{excerpt(text)}: exponent out of range (at most {MAX_EXPONENT})", "huge" if exponent > 0 else "junk"
        )
    return number * Fraction(10) ** exponent


def parse_bytes(text: str) -> int:
    """Return a quantity as whole bytes, rounding a fractional byte count up; at most :data:`MAX_BYTES`."""
    value = parse_quantity(text)
    if value < 0:
        raise QuantityError(f"{excerpt(text)} is negative")
    if value > MAX_BYTES:
        raise QuantityError(f"{excerpt(text)} is more bytes than a quantity may name (2^63-1, just under 8Ei)", "huge")
    return -(-value.numerator // value.denominator)


def format_bytes(count: int) -> str:
    """Format a byte count the way people read GPU memory: ``71.7 GiB``, ``512.0 MiB``. Total: a count
    beyond :data:`MAX_BYTES` (no quantity names one) reads ``at least 8 EiB``."""
    if abs(count) > MAX_BYTES:
        return _beyond(count, "8 EiB")
    if abs(count) >= GiB:
        return f"{count / GiB:.1f} GiB"
    if abs(count) >= MiB:
        return f"{count / MiB:.1f} MiB"
    return f"{count} B"


def quantity_text(count: int) -> str:
    """Bytes the way quotas are written: ``176Gi``, ``70.5Gi``, ``512Mi``. Total: a count beyond
    :data:`MAX_BYTES` reads ``at least 8Ei``."""
    if abs(count) > MAX_BYTES:
        return _beyond(count, "8Ei")
    if count >= GiB or count == 0:
        text = f"{count / GiB:.1f}".removesuffix(".0")
        return f"{text}Gi"
    return f"{count / MiB:.0f}Mi"


def _beyond(count: int, eight_ei: str) -> str:
    """A count past :data:`MAX_BYTES` either way, never turned into a float or into decimal text (both
    fail on large enough integers)."""
    return f"at least {eight_ei}" if count > 0 else f"at most -{eight_ei}"
