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
- evicts a released pod a ReplicaSet or StatefulSet owns that is still ``Unschedulable`` past the
  policy's ``release_timeout_seconds``, so it is recreated and decided again; each further pod of
  the same owner evicted so waits twice as long (to :data:`MAX_BACKOFF_DOUBLINGS` doublings), for
  an autoscaler that cannot add a node (its group at its maximum, no capacity).

A pod is left gated while another gate is on it, and while a node it may use is being re-read
(its pods not known for a moment). Pods released unchanged count on the room of the node they fit
first until they bind, across passes: replicas decided one by one do not all count on one room.

An API failure leaves the pod as it is and is retried with a per-pod backoff (a Warning Event after
:data:`FAILURES_BEFORE_WARNING` in a row); a failure of one pod's decision never stops the others.
The decision is taken on what the watches say, so a restart loses nothing (a gated pod is still
gated, a released one still carries its release time).
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

from cachetools import TTLCache
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
    other_gates,
    overdue,
    pins_nodes,
    recreatable,
    release_patch,
)

logger = logging.getLogger(__name__)

UNBOUND_PODS = {"fieldSelector": "spec.nodeName="}
ROUND_SECONDS = 1.0
"""How often the gated pods are looked at (a new one wakes the keeper at once)."""
HOLD_RECHECK_SECONDS = 30.0
MAX_RETRY_SECONDS = 60.0
"""The longest a pod waits before a failed patch or eviction is tried again (1 s, doubling)."""
FAILURES_BEFORE_WARNING = 3
MAX_BACKOFF_DOUBLINGS = 4
"""An owner's stuck pods wait at most 16 times ``release_timeout_seconds`` before eviction."""
EVICTIONS_REMEMBERED_SECONDS = 6 * 3600.0


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
        self._warned_held: set[str] = set()
        self._warned_stuck: set[str] = set()
        self._released: dict[str, tuple[str, tuple[Claim, ...]]] = {}
        """UID -> (the node it fit first, its claims), for pods released unchanged and not bound yet."""
        self._failures: dict[str, tuple[int, float]] = {}
        """UID -> (patches or evictions failed in a row, when to try again)."""
        self._evictions: TTLCache[str, int] = TTLCache(maxsize=10_000, ttl=EVICTIONS_REMEMBERED_SECONDS, timer=clock)
        """Owner UID -> its stuck pods evicted lately (each eviction restarts the owner's memory)."""
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
        for uid in [u for u in self._released if u not in self.pods]:
            del self._released[uid]
        self._forget_gone()
        self._wake.set()

    def upsert(self, obj: JSON) -> None:
        uid = pod_key(obj).uid
        if _kept(obj):
            self.pods[uid] = obj
            self._wake.set()
        else:
            self.pods.pop(uid, None)
            self._released.pop(uid, None)

    def delete(self, obj: JSON) -> None:
        # Bound (it left the watch of unbound pods) or deleted: the ledger now holds what it takes.
        uid = pod_key(obj).uid
        self.pods.pop(uid, None)
        self._released.pop(uid, None)
        self._forget_gone()

    def _forget_gone(self) -> None:
        # Not _released: a pod just released is out of the store until the watch brings it back.
        for records in (self._held, self._failures):
            for uid in [u for u in records if u not in self.pods]:
                del records[uid]
        self._warned_held &= self.pods.keys()
        self._warned_stuck &= self.pods.keys()

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
        for uid, (node, claims) in self._released.items():
            if self.state.ledger.holding(uid) is None:  # once bound, the ledger counts it itself
                this.taken.setdefault(node, []).extend(claims)
        for uid, pod in list(self.pods.items()):
            if self.pods.get(uid) is not pod:
                continue  # changed while an earlier pod was being decided: next round
            failed = self._failures.get(uid)
            if failed is not None and now < failed[1]:
                continue
            try:
                await self._visit(uid, pod, now, this)
            except Exception:
                # One pod's failure must not stop the others: it is retried after its backoff.
                logger.exception("deciding the gated GPU pod %s/%s failed", *_names(pod))
                await self._failed(uid, pod, "an internal error (see the extender's log)")

    async def _visit(self, uid: str, pod: JSON, now: float, this: _Pass) -> None:
        index = gate_index(pod)
        if index is not None:
            if other_gates(pod):
                return  # decided once the other gates are gone (the watch brings the change)
            last = self._held.get(uid)
            if last is None or now - last >= HOLD_RECHECK_SECONDS:
                await self._decide(uid, pod, index, this)
        elif self._ours(pod) and overdue(pod, self.wall_clock(), self._timeout_for(pod)):
            await self._recreate(uid, pod)

    def _timeout_for(self, pod: JSON) -> float:
        """The release timeout, doubled for each pod of the same owner evicted lately."""
        owner = recreatable(pod)
        evicted: int = self._evictions.get(owner, 0) if owner is not None else 0
        doublings: int = min(evicted, MAX_BACKOFF_DOUBLINGS)
        return float(self.state.policy.scale_up.release_timeout_seconds) * float(2**doublings)

    def _ours(self, pod: JSON) -> bool:
        """Whether a scheduler calling the extender places the pod: the release stamp is an annotation
        anyone who may edit a pod can write, so the extender evicts only pods it could have released."""
        spec = pod.get("spec")
        return isinstance(spec, Mapping) and spec.get("schedulerName") in self.state.policy.schedulers

    async def _decide(self, uid: str, pod: JSON, index: int, this: _Pass) -> None:
        settings = self.state.policy.scale_up
        if settings.autoscaler == "none" or not self._ours(pod):
            # Gated while scale-up was on, then turned off (or gated by hand for a scheduler that does
            # not call the extender): released as it is.
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
        if self.state.suspects and any(self.state.suspect_message(name) for name in eligible):
            return  # a node it may use is being re-read: its room is not known for the moment
        outcome = await self.verbs.filter(pod, eligible)
        choice = self.state.choose_class(pod)
        pod_claims = self.state.claims_for(pod, choice, pod_template_key(pod))
        claims, taken = pod_claims.claims, this.taken
        passing = [n for n in outcome.passing if n not in taken or self.state.ledger.fits(n, (*taken[n], *claims)).ok]
        crowded = [n for n in outcome.passing if n not in passing]
        key = exclusion_key(settings.autoscaler)
        decision: Release | Hold
        if not passing and pins_nodes(spec):
            decision = Release()  # no new node could match its selection: it waits where it is pinned
        else:
            refused = {name: await self._exclusion_value(name, key)
                       for name in (*outcome.failed, *outcome.unresolvable, *crowded)}
            fits, largest = self._fits_new_node(pod_claims, choice, eligible, this) if not passing else (None, "")
            decision = decide(passing, refused, fits, largest, key)
        if isinstance(decision, Release) and not decision.exclude and passing:
            taken.setdefault(passing[0], []).extend(claims)
        if isinstance(decision, Hold):
            self._held[uid] = self.clock()
            if uid not in self._warned_held:
                self._warned_held.add(uid)
                self.decisions.labels("held").inc()
                logger.info("holding %s/%s gated: %s", *_names(pod), decision.reason)
                await self._event(pod, "VRAMScaleUpHeld", decision.reason, "Warning")
            return
        assert isinstance(decision, Release)
        operations = release_patch(pod, index, key, decision.exclude, self.wall_clock())
        outcome_name = "narrowed" if decision.exclude else "released"
        done = await self._patch(uid, pod, operations, outcome_name)
        if done and not decision.exclude and passing:
            self._released[uid] = (passing[0], tuple(claims))
        if done and decision.exclude:
            await self._event(pod, "VRAMScaleUp", (
                f"no GPU node this pod may use has its VRAM now: it now excludes {len(decision.exclude)} node(s) "
                f"({key} NotIn), so the autoscaler adds a node for it"), "Normal")

    async def _exclusion_value(self, node: str, key: str) -> str | None:
        """The value of ``key`` that excludes ``node``; in Karpenter mode the node is given
        :data:`SCALE_UP_LABEL` first where it lacks vramguard's value (``None`` when that fails).

        A value set by anyone else is not trusted: one a NodePool gives every node would exclude
        the new nodes too."""
        selection = self.state.node_selection(node)
        value = selection.labels.get(key) if selection is not None else None
        if key != SCALE_UP_LABEL:
            return str(value) if isinstance(value, str) and value else None
        wanted = label_value_for(node)
        if value == wanted:
            return wanted
        if self.client is None:
            return None
        try:
            await self.client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {key: wanted}}})
        except ApiError as exc:
            logger.warning("cannot label node %s %s=%s: %s", node, key, wanted, exc.message or exc)
            return None
        return wanted

    def _fits_new_node(
        self, claims: PodClaims, choice: ClassChoice, eligible: list[str], this: _Pass
    ) -> tuple[bool | None, str]:
        """Whether a new node could take the pod: an empty node of the shape of some GPU node the pod
        may use (its node selection and taints: a pool it does not select is no answer), or a GPU of
        the policy's ``largest_gpu_memory``; and the largest GPU memory of those, for the reason
        (``None``: neither to tell, as for a pod whose pool is scaled to zero)."""
        if this.empty is None:
            this.empty = self._empty_shapes()
        shapes = this.empty
        names = sorted({shapes.of_node[n] for n in eligible if n in shapes.of_node})
        configured = self.state.policy.scale_up.largest_gpu_bytes()
        if not names and configured is None:
            return None, "none known"
        fits = bool(names) and any(
            v.verdict is Verdict.PASS for v in filter_nodes(shapes.ledger, names, claims, choice))
        if not fits and configured is not None:
            fits = fits_one_gpu(claims, configured)
        largest = max([configured or 0, *(shapes.largest[name] for name in names)])
        return fits, format_bytes(largest)

    def _empty_shapes(self) -> _EmptyShapes:
        """A ledger of one empty node per GPU node shape the cluster has (devices, sharing, budget;
        no pods, no foreign use), each node's empty copy, and each copy's largest GPU. Built once a
        pass."""
        shapes = _EmptyShapes(Ledger(self.state.policy.budget_rule()))
        made: dict[tuple[int, ...], str] = {}
        for name in self.state.node_names():
            shape = self.state.ledger.offer_kind(name)
            inventory = self.state.ledger.inventory(name)
            if shape is None or inventory is None or not inventory.devices:
                continue
            empty = made.get(shape)
            if empty is None:
                empty = made[shape] = f"empty-node-{len(made)}"
                shapes.ledger.upsert_node(
                    NodeInventory(empty, tuple(replace(d, foreign_bytes=0) for d in inventory.devices)))
                shapes.largest[empty] = max(d.memory_bytes for d in inventory.devices)
            shapes.of_node[name] = empty
        return shapes

    async def _patch(self, uid: str, pod: JSON, operations: list[dict[str, Any]], outcome: str) -> bool:
        if self.client is None:
            return False
        namespace, name = _names(pod)
        try:
            await self.client.patch(object_path("/api/v1/pods", namespace, name), operations, "json")
        except ApiError as exc:
            # 404: gone; 409/422: changed meanwhile (a test failed): the watch brings it back, and a
            # patch the API server keeps refusing (RBAC, validation) backs off and is reported.
            logger.info("releasing %s/%s not done: %s", namespace, name, exc.message or exc)
            if exc.status != 404:
                await self._failed(uid, pod, f"lifting the gate failed: {exc.message or exc}")
            return False
        self._failures.pop(uid, None)
        self._held.pop(uid, None)
        if self.pods.get(uid) is pod:
            del self.pods[uid]  # the watch brings it back released; until then it is not decided again
        self.decisions.labels(outcome).inc()
        logger.info("%s %s/%s", outcome, namespace, name)
        return True

    async def _failed(self, uid: str, pod: JSON, reason: str) -> None:
        """Back off the pod (1 s, doubling, at most :data:`MAX_RETRY_SECONDS`); warn once in a row of
        :data:`FAILURES_BEFORE_WARNING`."""
        count = self._failures.get(uid, (0, 0.0))[0] + 1
        self._failures[uid] = (count, self.clock() + min(2.0 ** (count - 1), MAX_RETRY_SECONDS))
        if count == FAILURES_BEFORE_WARNING:
            await self._event(pod, "VRAMScaleUpFailed", f"{reason} ({count} times in a row; retrying)", "Warning")

    async def _recreate(self, uid: str, pod: JSON) -> None:
        namespace, name = _names(pod)
        owner = recreatable(pod)
        if owner is None:
            if uid not in self._warned_stuck:
                self._warned_stuck.add(uid)
                await self._event(pod, "VRAMScaleUpStuck", (
                    "still unschedulable after its release; only a ReplicaSet's or a StatefulSet's pod is evicted to "
                    "be recreated (a Job would count it as failed): delete and create it again to have it decided "
                    "anew"), "Warning")
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
            if exc.status != 404:
                await self._failed(uid, pod, f"evicting the stuck pod failed: {exc.message or exc}")
            return
        self._evictions[owner] = self._evictions.get(owner, 0) + 1
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
    empty: _EmptyShapes | None = None
    """The empty node shapes (:meth:`GateKeeper._empty_shapes`), built for the first pod that needs them."""


@dataclass
class _EmptyShapes:
    """One empty node per GPU node shape the cluster has."""

    ledger: Ledger
    of_node: dict[str, str] = field(default_factory=dict)
    """Real node -> the empty node of its shape."""
    largest: dict[str, int] = field(default_factory=dict)
    """Empty node -> its largest GPU's memory."""


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
