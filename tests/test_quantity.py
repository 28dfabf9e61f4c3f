"""Kubernetes quantities: agreement with the Kubernetes client on valid input, strictness on the rest."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity as client_parse_quantity

from vramguard.quantity import GiB, QuantityError, format_bytes, parse_bytes, parse_quantity

VALID = st.builds(
    lambda number, suffix: number + suffix,
    st.from_regex(r"[0-9]{1,6}(\.[0-9]{1,3})?", fullmatch=True),
    st.sampled_from(["", "Ki", "Mi", "Gi", "Ti", "k", "M", "G", "T", "m", "e3", "E2"]),
)


@given(VALID)
def test_agrees_with_the_kubernetes_client(text: str) -> None:
    assert parse_quantity(text) == Fraction(client_parse_quantity(text))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12Gi", 12 * GiB), ("16G", 16 * 10**9), ("0.5Gi", GiB // 2), ("1e9", 10**9), ("1500m", 2)],
    ids=["binary", "decimal", "fractional-binary", "exponent", "milli-rounds-up"],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "NaN", "Infinity", " 12Gi", "12 Gi", "12GB", "12gi", "1_000", "Gi", "-", "1e99"])
def test_rejects_what_the_api_server_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


def test_negative_bytes_rejected() -> None:
    with pytest.raises(QuantityError):
        parse_bytes("-1Gi")


@pytest.mark.parametrize(("count", "text"), [(8 * GiB, "8.0 GiB"), (512 << 20, "512.0 MiB"), (12, "12 B")])
def test_format_bytes(count: int, text: str) -> None:
    assert format_bytes(count) == text
