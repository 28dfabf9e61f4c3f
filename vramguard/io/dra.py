"""The watches of resource.k8s.io/v1 objects that feed the cluster model's DRA state.

A cluster without DRA (``resource.k8s.io/v1`` not served, e.g. switched off by
``--runtime-config``) answers 404: those watches then keep an empty store, count as synced, and
log once (:attr:`vramguard.io.kube.Informer.may_be_absent`), so the service works as before.
"""

from __future__ import annotations

from vramguard.dra.state import DraState
from vramguard.io.runtime import Watch

RESOURCE_API = "/apis/resource.k8s.io/v1"
RESOURCE_SLICES = f"{RESOURCE_API}/resourceslices"
DEVICE_CLASSES = f"{RESOURCE_API}/deviceclasses"
RESOURCE_CLAIMS = f"{RESOURCE_API}/resourceclaims"
RESOURCE_CLAIM_TEMPLATES = f"{RESOURCE_API}/resourceclaimtemplates"


def dra_watches(state: DraState, *, templates: bool = True) -> list[Watch]:
    """Watches for ResourceSlices, DeviceClasses, ResourceClaims and (``templates``: admission
    needs them, the extender does not) ResourceClaimTemplates; marks ``state`` as watched."""
    state.watched = True
    watches = [
        Watch(RESOURCE_SLICES, state.slices, may_be_absent=True),
        Watch(DEVICE_CLASSES, state.classes, may_be_absent=True),
        Watch(RESOURCE_CLAIMS, state.claims, may_be_absent=True),
    ]
    if templates:
        watches.append(Watch(RESOURCE_CLAIM_TEMPLATES, state.templates, may_be_absent=True))
    return watches
