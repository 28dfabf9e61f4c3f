"""What the operator readers share: reading fields of any shape, and building the pods they make."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vramguard.dra.fields import items, mapping

__all__ = ["capped", "count", "env_entries", "full_scale", "items", "mapping", "metadata_of", "pod", "string", "words"]

MAX_REPLICAS = 1 << 20
"""More pods than any workload runs (a lying replica field costs no memory)."""


def count(value: Any) -> int | None:
    """A non-negative count given as a number or a string of digits, at most :data:`MAX_REPLICAS`;
    ``None`` otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return min(value, MAX_REPLICAS) if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.strip().isdigit() and len(value) <= 7:
        return min(int(value), MAX_REPLICAS)
    return None


def capped(pods: int) -> int:
    """A product of counts, at most :data:`MAX_REPLICAS` pods."""
    return min(pods, MAX_REPLICAS)


def full_scale(*values: Any) -> int:
    """The pods at full scale: the first of ``values`` that is a positive count (the maximum an
    autoscaler may reach, then the replicas), else 1 (a workload that scales from zero still runs
    pods when it serves)."""
    for value in values:
        found = count(value)
        if found:
            return found
    return 1


def words(value: Any) -> list[str]:
    """A command or argument list as the words a container gets (numbers written out, the rest left out)."""
    return [str(word) for word in items(value) if isinstance(word, str | int | float) and not isinstance(word, bool)]


def string(value: Any) -> str | None:
    """A string field, ``None`` when it is not one."""
    return value if isinstance(value, str) else None


def env_entries(value: Any) -> list[dict[str, Any]]:
    """Environment variables given as a list of ``{name, value|valueFrom}`` or as a mapping."""
    if isinstance(value, Mapping):
        return [{"name": str(k), "value": v if isinstance(v, str) else str(v)} for k, v in value.items()]
    return [dict(e) for e in items(value) if isinstance(e, Mapping) and isinstance(e.get("name"), str)]


def metadata_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The labels and annotations an operator's pods carry: the object's own."""
    metadata = mapping(obj.get("metadata"))
    return {key: dict(mapping(metadata.get(key))) for key in ("labels", "annotations") if metadata.get(key)}


def pod(obj: Mapping[str, Any], containers: Sequence[Mapping[str, Any]], **spec: Any) -> dict[str, Any]:
    """A pod template with ``containers`` and the object's labels and annotations."""
    return {"metadata": dict(metadata_of(obj)), "spec": {**spec, "containers": list(containers)}}
