"""``vramguard.io/vram`` declarations: a reservation per GPU, as a quantity (``12Gi``) or a fraction.

``vramguard.io/vram`` applies to every GPU container of the pod; ``vramguard.io/vram.<container>``
to one container and wins over the pod-wide one. A plain number up to 1 (``0.25``, ``1``) or with a
decimal point is a fraction of the GPU; anything else is a Kubernetes quantity of bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

from vramguard.codecs import vram_annotation
from vramguard.demand.model import Vram, VramError, parse_vram
from vramguard.engines.base import Findings
from vramguard.quantity import MAX_QUANTITY_TEXT, excerpt


def declared_vram(annotations: Mapping[str, str], container: str, found: Findings) -> Vram | None:
    """The declaration that applies to ``container``, recording evidence or an error."""
    if not annotations:
        return None
    for key in (vram_annotation(container), vram_annotation()):
        value = annotations.get(key)
        if value is None:
            continue
        vram = parse_declaration(value, key, found)
        if vram is not None:
            found.evidence.append(f"annotation {key}={value.strip()}")
        return vram
    return None


def parse_declaration(value: object, key: str, found: Findings) -> Vram | None:
    """Read one annotation value; errors name the annotation and the fix."""
    if not isinstance(value, str) or not value.strip():
        found.error(f"annotation {key} is empty; set a quantity such as 12Gi or a fraction such as 0.25")
        return None
    try:
        return parse_vram(value)
    except VramError as exc:
        text = value.strip()  # at most MAX_QUANTITY_TEXT characters, but where the reason is "huge"
        match exc.reason:
            case "fraction":
                found.error(f"annotation {key}={text}: a fraction of the GPU must be in (0, 1]")
            case "junk":
                found.error(f"annotation {key}={text} is neither a quantity (like 12Gi) nor a fraction (like 0.25)")
            case "small":
                found.error(f"annotation {key}={text} is under 1Mi; write a unit, for example 12Gi")
            case "huge":
                found.error(f"annotation {key}={excerpt(text)} is more than any GPU holds (a quantity of at most "
                            f"{MAX_QUANTITY_TEXT} characters, under 8Ei); write the VRAM per GPU, for example 12Gi")
        return None
