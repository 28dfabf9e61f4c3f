"""Pods with ResourceClaims in the extender's filter and bind (the rules: :mod:`vramguard.dra.tenancy`).

kube-scheduler calls the extender for such pods only where its configuration lists no
``managedResources`` (an extender that lists some is interested only in pods asking for one of
them, and a claim is no resource): the shipped second-scheduler configuration does so.

filter narrows the nodes its ledger let through to those where the pod's claims fit every device
they could get. bind runs after the scheduler's PreBind has written the claims' allocation: it
reads each claim from the API server (the watch may lag the write), checks the devices they got,
and holds what the pod adds there until the claims' watch shows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.cluster import ClusterState, pod_key
from vramguard.dra.pods import uses_claims
from vramguard.dra.tenancy import ClaimPlacement, device_tenants, place_claims, pod_rank, used_claims
from vramguard.io.dra import RESOURCE_CLAIMS
from vramguard.io.kube import ApiError, KubeClient, object_path
from vramguard.policy import ClassChoice


def refused_nodes(
    state: ClusterState, pod: Mapping[str, Any], nodes: list[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Among ``nodes`` (those the ledger let through), where the pod's claims do not fit, with why:
    ``(failed, unresolvable)``, unresolvable where only a claim sized for the device could fit."""
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    if not uses_claims(pod) or not state.dra.watched:
        return failed, unresolvable
    sizing = state.choose_class(pod).enforcement == "enforce"
    tenants = device_tenants(state.dra, pod_key(pod).uid, pod_rank(pod))
    for node in nodes:
        refusals = place_claims(state.dra, pod, node, sizing=sizing, tenants=tenants).refusals
        if refusals:
            target = failed if all(r.resolvable for r in refusals) else unresolvable
            target[node] = "; ".join(r.message for r in refusals)
    return failed, unresolvable


async def read_claims(client: KubeClient, state: ClusterState, pod: Mapping[str, Any]) -> str:
    """Read the pod's claims from the API server into the DRA state (the scheduler wrote their
    allocation right before bind); returns why not, or ``""``."""
    key = pod_key(pod)
    for _, name in used_claims(pod):
        if name is None:
            continue  # not made yet: place() says so
        try:
            claim = await client.get(object_path(RESOURCE_CLAIMS, key.namespace, name))
        except ApiError as exc:
            return f"cannot read ResourceClaim {key.namespace}/{name}: {exc.message or exc}"
        state.dra.claims.upsert(dict(claim))
    return ""


def place(state: ClusterState, pod: Mapping[str, Any], node: str, choice: ClassChoice) -> tuple[ClaimPlacement, str]:
    """The pod's claims on the devices the scheduler allocated them on ``node``, and why bind must
    refuse (``""``: it may bind)."""
    placement = place_claims(state.dra, pod, node, sizing=choice.enforcement == "enforce", allocated=True)
    key = pod_key(pod)
    if placement.unplaced:
        return placement, f"pod {key.namespace}/{key.name}: {'; '.join(placement.unplaced)}; retrying"
    return placement, "; ".join(r.message for r in placement.refusals)
