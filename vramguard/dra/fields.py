"""Defensive readers for fields of resource.k8s.io/v1 objects.

Every object here may come from a client that lies: any field may be missing, of the wrong type
or huge. These helpers never raise; what they cannot read they report as a note (a string) into
the caller's list and return ``None`` or an empty value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.quantity import MAX_BYTES, MAX_QUANTITY_TEXT, MiB, QuantityError, parse_bytes

MAX_TEXT = 253
"""The longest name or attribute text kept (a DNS subdomain's limit); longer values are cut."""


def mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def items(value: Any) -> list[Any]:
    """``value`` when it is a list, else an empty one."""
    return value if isinstance(value, list) else []


def text(value: Any) -> str | None:
    """A string field, cut to :data:`MAX_TEXT`; ``None`` when it is not a string."""
    return value[:MAX_TEXT] if isinstance(value, str) else None


def integer(value: Any) -> int | None:
    """An integer field (JSON numbers only, not booleans); ``None`` otherwise."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def quantity_bytes(value: Any, where: str, notes: list[str]) -> int | None:
    """A Quantity (a string, or a JSON number) as whole bytes rounded up; ``None`` with a note when
    it is not a non-negative quantity."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        notes.append(f"{where}: {_short(value)} is not a quantity; ignored")
        return None
    shown = str(value)
    try:
        count = parse_bytes(shown) if len(shown) <= MAX_QUANTITY_TEXT else None
    except QuantityError:
        count = None
    if count is None or count > MAX_BYTES:
        notes.append(f"{where}: {_short(value)} is not a non-negative quantity of at most 8Ei; ignored")
        return None
    return count


def memory_text(count: int) -> str:
    """Bytes as a Quantity people write in a claim, never below ``count``: ``72Gi``, ``73404Mi``."""
    if count == 0:
        return "0"
    if count % (1 << 30) == 0:
        return f"{count >> 30}Gi"
    mib = -(-count // MiB)
    return f"{mib}Mi"


def attribute(attributes: Mapping[str, Any], name: str, domain: str) -> Any:
    """The value of a device attribute written ``name`` or ``<domain>/name`` (unqualified names
    belong to the driver's domain), unwrapped from its ``{string|int|bool|version: ...}`` form."""
    entry = attributes.get(name)
    if entry is None:
        entry = attributes.get(f"{domain}/{name}")
    entry = mapping(entry)
    for kind in ("string", "version", "int", "bool"):
        if kind in entry:
            return entry[kind]
    return None


def capacity_entry(capacity: Mapping[str, Any], name: str, domain: str) -> Mapping[str, Any] | None:
    """The capacity ``name`` (or ``<domain>/name``) of a device, ``None`` when absent."""
    entry = capacity.get(name)
    if entry is None:
        entry = capacity.get(f"{domain}/{name}")
    return entry if isinstance(entry, Mapping) else None


def object_name(obj: Mapping[str, Any]) -> tuple[str, str]:
    """``(namespace, name)`` of an object; empty strings when missing."""
    metadata = mapping(obj.get("metadata"))
    return text(metadata.get("namespace")) or "", text(metadata.get("name")) or ""


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
