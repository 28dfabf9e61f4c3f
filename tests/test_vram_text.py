"""VRAM per GPU as text: the ``vramguard.io/vram`` annotation and a class's ``max_vram_per_gpu`` are read
by one parser, so both accept and refuse the same texts."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vramguard.demand.annotations import parse_declaration
from vramguard.demand.model import Vram
from vramguard.engines.base import Findings
from vramguard.policy import parse_vram_limit
from vramguard.quantity import GiB, MiB

CASES = [
    pytest.param("0.25", Vram(fraction=Fraction(1, 4)), id="fraction"),
    pytest.param("1", Vram(fraction=Fraction(1)), id="one-is-the-whole-gpu"),
    pytest.param("2.0", None, id="fraction-above-one"),
    pytest.param("0", None, id="zero"),
    pytest.param(" 12Gi ", Vram(bytes=12 * GiB), id="quantity-with-spaces"),
    pytest.param("1Mi", Vram(bytes=MiB), id="least-bytes"),
    pytest.param("100", None, id="bytes-without-a-unit"),
    pytest.param("1023Ki", None, id="under-a-mebibyte"),
    pytest.param("12 GB", None, id="junk"),
    pytest.param("\u0661", None, id="non-ascii-digit"),
]


def annotation(text: str) -> Vram | None:
    found = Findings.for_container("c")
    vram = parse_declaration(text, "vramguard.io/vram", found)
    assert (vram is None) == bool(found.errors)
    return vram


def limit(text: str) -> Vram | None:
    try:
        return parse_vram_limit(text)
    except ValueError:
        return None


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_annotation_and_class_limit_read_vram_alike(text: str, expected: Vram | None) -> None:
    assert annotation(text) == expected
    assert limit(text) == expected
