"""``vramguard.io/vram`` declarations: a reservation per GPU, as a quantity (``12Gi``) or a fraction.

``vramguard.io/vram`` applies to every GPU container of the pod; ``vramguard.io/vram.<container>``
to one container and wins over the pod-wide one. A plain number up to 1 (``0.25``, ``1``) or with a
decimal point is a fraction of the GPU; anything else is a Kubernetes quantity of bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction

from vramguard.codecs import vram_annotation
from vramguard.demand.model import Vram
from vramguard.engines.base import Findings
from vramguard.quantity import MiB, QuantityError, parse_bytes

_PLAIN_NUMBER = re.compile(r"^\s*(?:\d+\.\d*|\.\d+|\d+)\s*$", re.ASCII)


def declared_vram(annotations: Mapping[str, str], container: str, found: Findings) -> Vram | None:
    """The declaration that applies to ``container``, recording evidence or an error."""
    for key in (vram_annotation(container), vram_annotation()):
        value = annotations.get(key)
        if value is None:
            continue
        vram = parse_declaration(value, key, found)
        if vram is not None:
            found.evidence.append(f"annotation {key}={value}")
        return vram
    return None


def parse_declaration(value: object, key: str, found: Findings) -> Vram | None:
    """Read one annotation value; errors name the annotation and the fix."""
    if not isinstance(value, str) or not value.strip():
        found.error(f"annotation {key} is empty; set a quantity such as 12Gi or a fraction such as 0.25")
        return None
    text = value.strip()
    if _PLAIN_NUMBER.match(text) and ("." in text or Fraction(text) <= 1):
        fraction = Fraction(text)
        if not 0 < fraction <= 1:
            found.error(f"annotation {key}={value}: a fraction of the GPU must be in (0, 1]")
            return None
        return Vram(fraction=fraction)
    try:
        count = parse_bytes(text)
    except QuantityError:
        found.error(f"annotation {key}={value} is neither a quantity (like 12Gi) nor a fraction (like 0.25)")
        return None
    if count < MiB:
        found.error(f"annotation {key}={value} is under 1Mi; write a unit, for example 12Gi")
        return None
    return Vram(bytes=count)
