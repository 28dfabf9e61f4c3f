"""One pod template of a workload, and how many pods it runs: what every reader of workloads gives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.demand.derive import GROUP_SIZE_ANNOTATION

__all__ = ["TemplatePart", "with_group_size"]


@dataclass(frozen=True, slots=True)
class TemplatePart:
    """One pod template of an object and how many pods it runs at full scale."""

    name: str
    """``leader``, ``worker[gpu-group]``: the template's name, with the element ``*`` matched."""
    template: Mapping[str, Any]
    pods: int
    group_size: int | None = None
    engine_from: str | None = None
    files: Mapping[str, Mapping[str, str]] | None = None
    """By container name, the scripts it sees from ConfigMaps of the input (:class:`vramguard.workloads.Inputs`)."""


def with_group_size(template: Mapping[str, Any], size: int) -> Mapping[str, Any]:
    """The template with the group size its pods will carry (as LeaderWorkerSet annotates them)."""
    metadata = template.get("metadata") if isinstance(template.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    annotations = metadata.get("annotations") if isinstance(metadata.get("annotations"), Mapping) else {}
    assert isinstance(annotations, Mapping)
    stamped = {**annotations, GROUP_SIZE_ANNOTATION: str(size)}
    return {**template, "metadata": {**metadata, "annotations": stamped}}
