"""The scale-up gate keeper: decides each gated GPU pod once and lifts its gate (docs/autoscaling.md).

It follows the pods no node holds yet (a watch of unbound pods; only those gated by vramguard or
released by it are kept) and, on the serving replica only, once the caches are synced:

- lifts :data:`~vramguard.scale_up.GATE` as :func:`vramguard.scale_up.decide` says, with the
  extender's own filter over the GPU nodes the pod may go to (taints and node selection checked
  here, as kube-scheduler checks them before it calls the extender), and an empty copy of each node
  shape the cluster has for "could a new node hold it";
- in Karpenter mode, first gives each GPU node to exclude the :data:`~vramguard.policy.SCALE_UP_LABEL`
  it lacks;
- re-decides held pods every :data:`HOLD_RECHECK_SECONDS` (a larger GPU may join), posting the
  Warning Event once;
- evicts a released pod a controller owns that is still ``Unschedulable`` past the policy's
  ``release_timeout_seconds``, so it is recreated and decided again.

An API failure leaves the pod as it is and is retried on the next round: the decision is taken on
what the watches say, so a restart loses nothing (a gated pod is still gated, a released one still
carries its release time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter
from prometheus_client.registry import CollectorRegistry

from extender.events import post_pod_event
from extender.verbs import Verbs
from vramguard.cluster import ClusterState, pod_key, pod_template_key
from vramguard.inventory import NodeInventory
from vramguard.io.kube import JSON, ApiError, KubeClient, object_path
from vramguard.ledger import Ledger
from vramguard.ledger_rule import Claim
from vramguard.node_selection import placement_refusal
from vramguard.placement import PodClaims, Verdict, filter_nodes
from vramguard.policy import SCALE_UP_LABEL, ClassChoice
from vramguard.quantity import format_bytes
from vramguard.scale_up import (
    GATE,
    RELEASED_ANNOTATION,
    Hold,
    Release,
    decide,
    exclusion_key,
    fits_one_gpu,
    gate_index,
    label_value_for,
    overdue,
    owned_by_controller,
    release_patch,
)

logger = logging.getLogger(__name__)

UNBOUND_PODS = {"fieldSelector": "spec.nodeName="}
ROUND_SECONDS = 1.0
"""How often the gated pods are looked at (a new one wakes the keeper at once)."""
HOLD_RECHECK_SECONDS = 30.0


class GateKeeper:
    """A store of the unbound pods vramguard gated or released, and the task that decides them."""

    def __init__(
        self,
        state: ClusterState,
        verbs: Verbs,
        client: KubeClient | None,
        registry: CollectorRegistry,
        *,
        serving: Callable[[], bool],
        synced: asyncio.Event,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.state = state
        self.verbs = verbs
        self.client = client
        self.serving = serving
        self.synced = synced
        self.clock = clock
        self.wall_clock = wall_clock
        self.pods: dict[str, JSON] = {}
        """UID -> the pod as the watch last said, for gated and released pods only."""
        self._held: dict[str, float] = {}
        """UID -> when a held pod was last decided."""
        self._warned: set[str] = set()
        self._wake = asyncio.Event()
        self.decisions = Counter(
            "vramguard_extender_scale_up_decisions",
            "Gated GPU pods decided, by outcome (released: an existing node has the VRAM; narrowed: released "
            "away from the GPU nodes that lack it, for the autoscaler to add one; held: no node shape could "
            "hold it; recreated: a released pod still unschedulable after the timeout, evicted).",
            ("outcome",), registry=registry,
        )

    # -- the watch of unbound pods (a Store) -----------------------------------------------------

    def replace(self, objects: list[JSON]) -> None:
        self.pods = {pod_key(pod).uid: pod for pod in objects if _kept(pod)}
        self._forget_gone()
        self._wake.set()

    def upsert(self, obj: JSON) -> None:
        uid = pod_key(obj).uid
        if _kept(obj):
            self.pods[uid] = obj
            self._wake.set()
        else:
            self.pods.pop(uid, None)

    def delete(self, obj: JSON) -> None:
        self.pods.pop(pod_key(obj).uid, None)
        self._forget_gone()

    def _forget_gone(self) -> None:
        for uid in [u for u in self._held if u not in self.pods]:
            del self._held[uid]
        self._warned &= self.pods.keys()

    # -- the task --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Decide the gated pods and watch the released ones, until cancelled."""
        await self.synced.wait()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ROUND_SECONDS)
            self._wake.clear()
            if not self.serving() or not self.pods:
                continue
            try:
                await self.round()
            except Exception:
                logger.exception("deciding the gated GPU pods failed; retrying")

    async def round(self) -> None:
        """One pass over the pods kept: gated ones decided, released ones checked."""
        now = self.clock()
        this = _Pass()
        for uid, pod in list(self.pods.items()):
            if self.pods.get(uid) is not pod:
                continue  # changed while an earlier pod was being decided: next round
            index = gate_index(pod)
            if index is not None:
                last = self._held.get(uid)
                if last is None or now - last >= HOLD_RECHECK_SECONDS:
                    await self._decide(uid, pod, index, this)
            elif self._ours(pod) and overdue(pod, self.wall_clock(),
                                             self.state.policy.scale_up.release_timeout_seconds):
                await self._recreate(uid, pod)

    def _ours(self, pod: JSON) -> bool:
        """Whether a scheduler calling the extender places the pod: the release stamp is an annotation
        anyone who may edit a pod can write, so the extender evicts only pods it could have released."""
        spec = pod.get("spec")
        return isinstance(spec, Mapping) and spec.get("schedulerName") in self.state.policy.schedulers

    async def _decide(self, uid: str, pod: JSON, index: int, this: _Pass) -> None:
        settings = self.state.policy.scale_up
        if settings.autoscaler == "none":
            # Gated while scale-up was on, then turned off: released as it is.
            await self._patch(uid, pod, release_patch(pod, index, "", (), self.wall_clock()), "released")
            return
        spec = pod.get("spec")
        spec = spec if isinstance(spec, Mapping) else {}
        gpu_nodes = [name for name in self.state.node_names() if self.state.node_offers(name)]
        eligible = []
        for name in gpu_nodes:
            selection = self.state.node_selection(name)
            if selection is not None and placement_refusal(spec, name, selection.labels, selection.taints) is None:
                eligible.append(name)
        outcome = await self.verbs.filter(pod, eligible)
        choice = self.state.choose_class(pod)
        pod_claims = self.state.claims_for(pod, choice, pod_template_key(pod))
        claims, taken = pod_claims.claims, this.taken
        passing = [n for n in outcome.passing if n not in taken or self.state.ledger.fits(n, (*taken[n], *claims)).ok]
        crowded = [n for n in outcome.passing if n not in passing]
        key = exclusion_key(settings.autoscaler)
        refused = {name: await self._exclusion_value(name, key)
                   for name in (*outcome.failed, *outcome.unresolvable, *crowded)}
        fits, largest = self._fits_new_node(pod_claims, choice, this) if not passing else (None, "")
        decision = decide(passing, refused, fits, largest, key)
        if isinstance(decision, Release) and not decision.exclude and passing:
            taken.setdefault(passing[0], []).extend(claims)
        if isinstance(decision, Hold):
            self._held[uid] = self.clock()
            if uid not in self._warned:
                self._warned.add(uid)
                self.decisions.labels("held").inc()
                logger.info("holding %s/%s gated: %s", *_names(pod), decision.reason)
                await self._event(pod, "VRAMScaleUpHeld", decision.reason, "Warning")
            return
        assert isinstance(decision, Release)
        operations = release_patch(pod, index, key, decision.exclude, self.wall_clock())
        outcome_name = "narrowed" if decision.exclude else "released"
        if await self._patch(uid, pod, operations, outcome_name) and decision.exclude:
            await self._event(pod, "VRAMScaleUp", (
                f"no GPU node this pod may use has its VRAM now: it now excludes {len(decision.exclude)} node(s) "
                f"({key} NotIn), so the autoscaler adds a node for it"), "Normal")

    async def _exclusion_value(self, node: str, key: str) -> str | None:
        """The value of ``key`` that excludes ``node``; in Karpenter mode the node is given
        :data:`SCALE_UP_LABEL` first where it has none (``None`` when that fails)."""
        selection = self.state.node_selection(node)
        value = selection.labels.get(key) if selection is not None else None
        if isinstance(value, str) and value:
            return value
        if key != SCALE_UP_LABEL or self.client is None:
            return None
        value = label_value_for(node)
        try:
            await self.client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {key: value}}})
        except ApiError as exc:
            logger.warning("cannot label node %s %s=%s: %s", node, key, value, exc.message or exc)
            return None
        return value

    def _fits_new_node(self, claims: PodClaims, choice: ClassChoice, this: _Pass) -> tuple[bool | None, str]:
        """Whether a new node could take the pod: an empty node of some GPU node shape the cluster
        has, or a GPU of the policy's ``largest_gpu_memory``; and the largest GPU memory known, for
        the reason (``None``: neither to tell)."""
        if this.empty is None:
            this.empty = self._empty_shapes()
        ledger, names, largest = this.empty
        configured = self.state.policy.scale_up.largest_gpu_bytes()
        if not names and configured is None:
            return None, "none known"
        fits = any(v.verdict is Verdict.PASS for v in filter_nodes(ledger, names, claims, choice)) if names else False
        if not fits and configured is not None:
            fits = fits_one_gpu(claims, configured)
        return fits, format_bytes(largest)

    def _empty_shapes(self) -> tuple[Ledger, list[str], int]:
        """A ledger of one empty node per GPU node shape the cluster has (devices, sharing, budget;
        no pods, no foreign use), their names, and the largest GPU memory known. Built once a pass."""
        ledger = Ledger(self.state.policy.budget_rule())
        names: list[str] = []
        shapes: set[tuple[int, ...]] = set()
        largest = self.state.policy.scale_up.largest_gpu_bytes() or 0
        for name in self.state.node_names():
            shape = self.state.ledger.offer_kind(name)
            inventory = self.state.ledger.inventory(name)
            if shape is None or inventory is None or not inventory.devices or shape in shapes:
                continue
            shapes.add(shape)
            empty = f"empty-node-{len(names)}"
            ledger.upsert_node(NodeInventory(empty, tuple(replace(d, foreign_bytes=0) for d in inventory.devices)))
            names.append(empty)
            largest = max([largest, *(d.memory_bytes for d in inventory.devices)])
        return ledger, names, largest

    async def _patch(self, uid: str, pod: JSON, operations: list[dict[str, Any]], outcome: str) -> bool:
        if self.client is None:
            return False
        namespace, name = _names(pod)
        try:
            await self.client.patch(object_path("/api/v1/pods", namespace, name), operations, "json")
        except ApiError as exc:
            # 404: gone; 409/422: changed meanwhile (the test of the gate failed): the watch brings it back.
            logger.info("releasing %s/%s not done: %s", namespace, name, exc.message or exc)
            return False
        self._held.pop(uid, None)
        if self.pods.get(uid) is pod:
            del self.pods[uid]  # the watch brings it back released; until then it is not decided again
        self.decisions.labels(outcome).inc()
        logger.info("%s %s/%s", outcome, namespace, name)
        return True

    async def _recreate(self, uid: str, pod: JSON) -> None:
        namespace, name = _names(pod)
        if not owned_by_controller(pod):
            if uid not in self._warned:
                self._warned.add(uid)
                await self._event(pod, "VRAMScaleUpStuck", (
                    "still unschedulable after its release; a pod no controller owns is not recreated: delete and "
                    "create it again to have it decided anew"), "Warning")
            return
        if self.client is None:
            return
        body = {
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        try:
            await self.client.create(object_path("/api/v1/pods", namespace, name) + "/eviction", body)
        except ApiError as exc:
            logger.info("evicting the stuck pod %s/%s refused: %s", namespace, name, exc.message or exc)
            return
        self.pods.pop(uid, None)
        self.decisions.labels("recreated").inc()
        await self._event(pod, "VRAMScaleUpRetry", (
            "still unschedulable after its release (its new node filled first, or the autoscaler counted GPU "
            "replicas, not VRAM): evicted so its controller recreates it and it is decided again"), "Normal")

    async def _event(self, pod: JSON, reason: str, message: str, kind: str) -> None:
        if self.client is not None:
            await post_pod_event(self.client, pod_key(pod), reason, message, kind)


@dataclass
class _Pass:
    """What one pass over the gated pods shares between its decisions."""

    taken: dict[str, list[Claim]] = field(default_factory=dict)
    """What the pods released unchanged in this pass will take, by the node they fit first: a wave
    of replicas decided at once must not all count on one node's room."""
    empty: tuple[Ledger, list[str], int] | None = None
    """The empty node shapes (:meth:`GateKeeper._empty_shapes`), built for the first pod that needs them."""


def _kept(pod: Mapping[str, Any]) -> bool:
    """Gated by vramguard, or released by it (its annotation), and not being deleted."""
    metadata = pod.get("metadata")
    if not isinstance(metadata, Mapping) or metadata.get("deletionTimestamp"):
        return False
    annotations = metadata.get("annotations")
    return gate_index(pod) is not None or (isinstance(annotations, Mapping) and RELEASED_ANNOTATION in annotations)


def _names(pod: Mapping[str, Any]) -> tuple[str, str]:
    metadata = pod.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    return str(metadata.get("namespace", "")), str(metadata.get("name", ""))


__all__ = ["GATE", "UNBOUND_PODS", "GateKeeper"]
