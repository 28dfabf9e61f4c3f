"""Kubernetes resource quantities (``12Gi``, ``500M``, ``1e9``) as exact numbers, and byte formatting.

The grammar is apimachinery's (``k8s.io/apimachinery/pkg/api/resource``)::

    <quantity> ::= <signedNumber><suffix>
    <suffix>   ::= Ki | Mi | Gi | Ti | Pi | Ei | n | u | m | "" | k | M | G | T | P | E
                 | e<signedNumber> | E<signedNumber>

It is stricter than the Kubernetes Python client's ``parse_quantity``, which also accepts what the
API server refuses (``NaN``, ``Infinity``, surrounding spaces, ``1_000``). The core must not import
the client (the ``core-is-pure`` import contract in pyproject.toml); a test checks both parsers agree on valid input.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import lru_cache

_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$",
    re.ASCII,
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

MiB = 1 << 20
GiB = 1 << 30


class QuantityError(ValueError):
    """The text is not a Kubernetes quantity."""


@lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Fraction:
    """Return the exact value of a Kubernetes quantity such as ``12Gi`` or ``0.5``."""
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(f"{text!r} is not a Kubernetes quantity (for example 12Gi or 16G)")
    try:
        number = Fraction(Decimal(match["number"]))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid decimals
        raise QuantityError(f"{text!r} is not a number") from exc
    suffix = match["suffix"]
    if not suffix:
        return number
    if suffix in _BINARY:
        return number * Fraction(1024 ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number * Fraction(10) ** _DECIMAL[suffix]
    exponent = int(suffix[1:])
    if abs(exponent) > 30:
        raise QuantityError(f"{text!r}: exponent out of range")
    return number * Fraction(10) ** exponent


def parse_bytes(text: str) -> int:
    """Return a quantity as whole bytes, rounding a fractional byte count up."""
    value = parse_quantity(text)
    if value < 0:
        raise QuantityError(f"{text!r} is negative")
    return -(-value.numerator // value.denominator)


def format_bytes(count: int) -> str:
    """Format a byte count the way people read GPU memory: ``71.7 GiB``, ``512.0 MiB``."""
    if abs(count) >= GiB:
        return f"{count / GiB:.1f} GiB"
    if abs(count) >= MiB:
        return f"{count / MiB:.1f} MiB"
    return f"{count} B"
