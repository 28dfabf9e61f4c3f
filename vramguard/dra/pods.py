"""How a pod reaches DRA devices: its ``spec.resourceClaims`` and the containers that use them.

A pod names claims in ``spec.resourceClaims[]`` (``name`` plus exactly one of
``resourceClaimName``, an existing claim, or ``resourceClaimTemplateName``, from which the
resourceclaim controller makes one per pod and records its name in
``status.resourceClaimStatuses``). A container uses a claim through ``resources.claims[]``
(``name``, optionally ``request`` to use one of its requests only). On the DRA extended-resource
path the pod names no claim: the scheduler creates one and records it, and which container got
which request, in ``status.extendedResourceClaimStatus``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.dra.fields import items, mapping, text

MAX_POD_CLAIMS = 128
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
"""Set by the resourceclaim controller on a claim it makes from a template: the pod's name for it
(``spec.resourceClaims[].name``); the claim's controlling owner is the pod."""


@dataclass(frozen=True, slots=True)
class PodClaimSource:
    """An entry of ``spec.resourceClaims``: where the claim the pod calls ``name`` comes from."""

    name: str
    claim_name: str | None = None
    """``resourceClaimName``: an existing claim, shared by every pod naming it."""
    template_name: str | None = None
    """``resourceClaimTemplateName``: a claim made for this pod from the template."""
    generated_name: str | None = None
    """The claim made from the template, once ``status.resourceClaimStatuses`` says."""

    @property
    def allocated_claim(self) -> str | None:
        """The name of the ResourceClaim object behind it, when known."""
        return self.claim_name or self.generated_name


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """A container's use of one of the pod's claims (``resources.claims[]``)."""

    container: str
    claim: str
    """The pod's name for the claim (``spec.resourceClaims[].name``)."""
    request: str | None = None
    """One request of the claim, or ``None`` for all of them."""
    init: bool = False
    """A regular init container (runs before the app containers)."""


def pod_claim_sources(pod: Mapping[str, Any]) -> tuple[PodClaimSource, ...]:
    """The pod's claims (``spec.resourceClaims``), with the generated names from its status."""
    spec = mapping(pod.get("spec"))
    generated: dict[str, str] = {}
    for raw_entry in items(mapping(pod.get("status")).get("resourceClaimStatuses"))[:MAX_POD_CLAIMS]:
        entry = mapping(raw_entry)
        name, claim = text(entry.get("name")), text(entry.get("resourceClaimName"))
        if name and claim:
            generated[name] = claim
    sources: list[PodClaimSource] = []
    for raw_entry in items(spec.get("resourceClaims"))[:MAX_POD_CLAIMS]:
        entry = mapping(raw_entry)
        name = text(entry.get("name"))
        if not name:
            continue
        sources.append(
            PodClaimSource(
                name,
                text(entry.get("resourceClaimName")) or None,
                text(entry.get("resourceClaimTemplateName")) or None,
                generated.get(name),
            )
        )
    return tuple(sources)


def uses_claims(pod: Mapping[str, Any]) -> bool:
    """Whether the pod names any claim (``spec.resourceClaims``)."""
    return bool(items(mapping(pod.get("spec")).get("resourceClaims")))


def container_claim_uses(pod: Mapping[str, Any]) -> tuple[ClaimUse, ...]:
    """Every container's ``resources.claims`` entries, init containers first."""
    spec = mapping(pod.get("spec"))
    uses: list[ClaimUse] = []
    for field_name in ("initContainers", "containers"):
        for raw_container in items(spec.get(field_name)):
            container = mapping(raw_container)
            name = text(container.get("name")) or "<unnamed>"
            init = field_name == "initContainers" and container.get("restartPolicy") != "Always"
            for raw_entry in items(mapping(container.get("resources")).get("claims"))[:MAX_POD_CLAIMS]:
                entry = mapping(raw_entry)
                claim = text(entry.get("name"))
                if claim:
                    uses.append(ClaimUse(name, claim, text(entry.get("request")) or None, init))
    return tuple(uses)


@dataclass(frozen=True, slots=True)
class ExtendedResourceClaim:
    """``status.extendedResourceClaimStatus``: the scheduler's claim for the pod's extended resources."""

    claim_name: str
    requests: tuple[tuple[str, str, str], ...]
    """``(container, resource, request)`` of each request mapping."""


def extended_resource_claim(pod: Mapping[str, Any]) -> ExtendedResourceClaim | None:
    """The claim the scheduler made for the pod on the DRA extended-resource path, once recorded."""
    raw = mapping(mapping(pod.get("status")).get("extendedResourceClaimStatus"))
    name = text(raw.get("resourceClaimName"))
    if not name:
        return None
    mappings = tuple(
        (text(m.get("containerName")) or "", text(m.get("resourceName")) or "", text(m.get("requestName")) or "")
        for m in (mapping(m) for m in items(raw.get("requestMappings"))[:MAX_POD_CLAIMS])
    )
    return ExtendedResourceClaim(name, mappings)
