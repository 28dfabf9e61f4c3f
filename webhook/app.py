"""The webhook's HTTP side: ``POST /validate`` decodes an AdmissionReview, asks the rules, encodes
the answer; ``POST /mutate`` answers the mutating webhook (:mod:`vramguard.mutation`) the same way.

Two error channels, kept apart: a request that is not a usable AdmissionReview is answered with
an HTTP 4xx and ``{"error": ...}`` (the API server then applies the failure policy); a pod that
breaks a rule is answered 200 with ``allowed: false`` and a message for the user.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from vramguard.admission import (
    SUPPORTED_KINDS,
    AdmissionRules,
    ClusterView,
    Code,
    Decision,
    Operation,
    Subject,
    fit_warning,
)
from vramguard.cluster import HOLD_GRACE, ClusterState, HeldAdmission
from vramguard.demand.objects import pod_template
from vramguard.dra.pods import pod_claim_sources
from vramguard.io.http import Readiness, RequestError, create_app, read_model
from vramguard.io.jsoncodec import json_response
from vramguard.operators import operator_versions
from vramguard.policy import Policy, PolicyFile
from vramguard.workloads import WorkloadKind, find_kind
from webhook.models import AdmissionRequest, AdmissionReview, review_response
from webhook.quota_holds import QuotaHolds, decide_with_shared_holds

__all__ = ["BODY_LIMIT", "STATE_KEY", "PolicySource", "WebhookState", "create_webhook_app"]

logger = logging.getLogger(__name__)

NamespaceLookup = Callable[[str], Awaitable[Mapping[str, Any] | None]]
PodLookup = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]
"""``(namespace, name)`` -> the Pod read from the API server, ``None`` when it does not exist."""
ClaimLookup = Callable[[str, str, str], Awaitable[Mapping[str, Any] | None]]
"""``(collection, namespace, name)`` -> a ResourceClaim (``resourceclaims``) or ResourceClaimTemplate
(``resourceclaimtemplates``) read from the API server, ``None`` when it does not exist."""
MAX_STORED_OBJECT = 1_572_864
"""The largest object the API server stores: etcd's default ``--max-request-bytes`` (1.5 MiB)."""
JSON_ESCAPE = 6
"""Bytes the API server's JSON may write for one byte of an object: Go's encoding/json writes ``<``,
``>`` and ``&`` as ``\u003c`` (six bytes), so a 1.45 MB pod of them is an 8.7 MB review."""
REVIEW_ENVELOPE = 1 << 20
"""The rest of an AdmissionReview (user info, options), generously."""
BODY_LIMIT = 2 * JSON_ESCAPE * MAX_STORED_OBJECT + REVIEW_ENVELOPE
"""Every review the API server can send is read (19 MiB): the object and, on UPDATE, the old object,
each at the stored limit and escaped at worst. A review past the limit would be a 413, which the
failure policy turns into an unreviewed admission where the namespace does not enforce."""
LARGE_REVIEW = 2 << 20
"""A review larger than this holds a slot of :data:`LARGE_REVIEWS_AT_ONCE` while it is read and judged."""
LARGE_REVIEWS_AT_ONCE = 2
"""Large reviews judged at once: each costs several times its size in memory while it is decoded, so a
burst of padded pods waits its turn (within the API server's timeout) instead of exhausting the
webhook's memory limit."""
# The API server gives the webhook at most timeoutSeconds (5 s in the shipped configuration);
# a namespace the watch has not delivered yet is fetched within a fraction of that.
NAMESPACE_LOOKUP_TIMEOUT = 1.5
REVIEWED_SUBRESOURCES = ("ephemeralcontainers",)
"""Subresources whose reviews carry the whole Pod and change what it holds (``kubectl debug``)."""
HOLD_CHECKS_AT_ONCE = 16
"""Pods of pending admissions read from the API server at the same time."""


class PolicySource:
    """The policy in force: a fixed one, or a file re-read when it changes (keeping the last good one)."""

    def __init__(self, policy: Policy, file: PolicyFile | None = None) -> None:
        """Serve ``policy``; with ``file``, :meth:`refresh` picks up its changes."""
        self._file = file
        self.policy = policy
        self.rules = AdmissionRules(policy)

    @classmethod
    def from_file(cls, file: PolicyFile) -> PolicySource:
        """Follow a policy file (already loaded and valid)."""
        return cls(file.policy, file)

    def refresh(self) -> bool:
        """Re-read the file if it changed; return True when a new policy is in force."""
        if self._file is None:
            return False
        policy, problem = self._file.reload()
        if problem is not None:
            logger.error("%s", problem)
        if policy is self.policy:
            return False
        if policy.demand_options() != self.policy.demand_options():
            logger.warning("gpu_resources changed in the policy; restart the webhook to re-read every pod with them")
        self.policy = policy
        self.rules = AdmissionRules(policy)
        logger.info("policy reloaded from %s", self._file.path)
        return True


class WebhookState:
    """The policy and the cluster as the webhook sees them; builds a :class:`ClusterView` per review."""

    def __init__(
        self,
        policy: PolicySource,
        *,
        namespace_lookup: NamespaceLookup | None = None,
        claim_lookup: ClaimLookup | None = None,
        pod_lookup: PodLookup | None = None,
        quota_holds: QuotaHolds | None = None,
    ) -> None:
        """Start with an empty cluster model; informers (or tests) fill it.

        ``namespace_lookup`` fetches a namespace the watch has not shown yet (a namespace created
        just before its first pod): without it such a namespace would get the default mode.
        ``pod_lookup`` reads the pods of pending admissions (see :meth:`check_holds`): without it
        they are believed until the watch shows them or they expire.
        """
        self.policy = policy
        self.cluster = ClusterState(policy.policy)
        """The cluster model, fed every live pod: quota sums, offers, and the ledger of bound GPU pods
        (to check direct placements)."""
        self._lookup = namespace_lookup
        self._claim_lookup = claim_lookup
        """Reads a claim or template the watch has not shown yet (``kubectl apply`` of a template
        and its pod together): without it such a pod would pass unchecked."""
        self._pod_lookup = pod_lookup
        self.quota_holds = quota_holds
        """Where the replicas share the quota's pending admissions; ``None``: this replica alone."""

    def refresh_policy(self) -> bool:
        """Re-read the policy file; a new policy reaches the rules and the cluster model's budgets."""
        if not self.policy.refresh():
            return False
        self.cluster.set_policy(self.policy.policy)
        return True

    def gpus_over_budget(self) -> int:
        """Devices of the cluster model whose worst case exceeds their budget."""
        ledger = self.cluster.ledger
        return sum(
            1 for node in ledger.node_names() for row in ledger.usage(node, pods=False) if row.over_budget
        )

    async def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        """The namespace's labels from the watch, else from the API server; ``None`` if unknown."""
        labels = self.cluster.namespace_labels.get(namespace)
        if labels is not None or self._lookup is None:
            return labels
        try:
            async with asyncio.timeout(NAMESPACE_LOOKUP_TIMEOUT):
                obj = await self._lookup(namespace)
        except Exception as exc:  # any failure means "use the default mode", logged
            logger.warning("cannot read namespace %s (%s); using the policy's default enforcement", namespace, exc)
            return None
        if obj is None:
            return None
        self.cluster.upsert_namespace(obj)
        return self.cluster.namespace_labels.get(namespace)

    async def check_holds(self, namespace: str, exclude: str | None) -> bool:
        """Ask the API server about the pods of the namespace's pending admissions (other than pod
        ``exclude``), once each is :data:`HOLD_GRACE` old; drop those whose pod does not exist.
        Returns whether any was dropped.

        Any caller that reaches the webhook can send it a review, and an admitted review holds quota:
        a forged one must not refuse real pods. So before a quota refusal counts a hold, its pod is
        read; a forged hold is dropped by the first review it would refuse, having delayed it by the
        grace and these reads, and only one younger than the grace can still refuse.
        """
        holds = self.cluster.unconfirmed_holds(namespace, exclude)
        if self._pod_lookup is None or not holds:
            return False
        lookup = self._pod_lookup
        limit = asyncio.Semaphore(HOLD_CHECKS_AT_ONCE)
        dropped: list[str] = []

        async def settle(hold: HeldAdmission) -> None:
            async with limit:
                try:
                    pod = await lookup(namespace, hold.name)
                except Exception as exc:  # the hold stays counted: the API server could not say
                    logger.warning("cannot read pod %s/%s of a pending admission (%s)", namespace, hold.name, exc)
                    return
            if self.cluster.settle_hold(hold.uid, pod):
                dropped.append(hold.name)

        try:
            async with asyncio.timeout(HOLD_GRACE + NAMESPACE_LOOKUP_TIMEOUT):
                await asyncio.sleep(max(0.0, HOLD_GRACE - min(hold.age for hold in holds)))
                await asyncio.gather(*(settle(hold) for hold in holds))
        except TimeoutError:
            logger.warning("reading the pods of %d pending admission(s) in %s timed out", len(holds), namespace)
        if dropped:
            logger.warning(
                "namespace %s: %d admission(s) held against the quota have no pod (%s): reviews not sent "
                "by the API server, or pods it refused after admission",
                namespace, len(dropped), ", ".join(sorted(dropped)[:5]),
            )
        return bool(dropped)

    async def view(self, subject: Subject, uid: str | None) -> ClusterView:
        """What the rules need to know about the cluster for ``subject``."""
        labels = await self.namespace_labels(subject.namespace)
        node = _node_name(subject.obj) if subject.kind == "Pod" else ""
        cluster = self.cluster
        node_offers = cluster.node_offers(node) if node else None
        usage = None
        if self.policy.rules.quota_bytes(subject.namespace) is not None:
            usage = cluster.usage_with_dra(subject.namespace, exclude=uid if subject.kind == "Pod" else None)
        ledger = cluster.ledger if node else None
        held_back = cluster.suspect_message(node) if node else None
        dra = None
        if cluster.dra.watched:
            await self._read_missing_claims(subject)
            dra = cluster.dra_context()
        return ClusterView(labels, cluster.offers(), node_offers, usage, ledger, held_back, dra)


    async def _read_missing_claims(self, subject: Subject) -> None:
        """Read from the API server the claims and templates the pod names that the watches have not
        delivered yet, into the model (as the watch would); failures leave them unknown (a note)."""
        if self._claim_lookup is None:
            return
        template = pod_template(subject.obj, subject.kind)
        if template is None:
            return
        dra = self.cluster.dra
        for source in pod_claim_sources(template):
            if source.template_name and dra.template(subject.namespace, source.template_name) is None:
                wanted = ("resourceclaimtemplates", source.template_name, dra.templates)
            elif source.claim_name and dra.claim(subject.namespace, source.claim_name) is None:
                wanted = ("resourceclaims", source.claim_name, dra.claims)
            else:
                continue
            collection, name, store = wanted
            try:
                async with asyncio.timeout(NAMESPACE_LOOKUP_TIMEOUT):
                    obj = await self._claim_lookup(collection, subject.namespace, name)
            except Exception as exc:  # any failure leaves the claim unknown, which the review notes
                logger.warning("cannot read %s %s/%s (%s)", collection, subject.namespace, name, exc)
                continue
            if obj is not None:
                store.upsert(dict(obj))


STATE_KEY = web.AppKey("vramguard_webhook_state", WebhookState)


class _Metrics:
    def __init__(self, registry: CollectorRegistry, state: WebhookState) -> None:
        self.reviews = Counter(
            "vramguard_webhook_reviews_total",
            "AdmissionReviews answered, by object kind, operation and result "
            "(allowed, denied, warned, audited, skipped: no GPU or not validated).",
            labelnames=("kind", "operation", "result"),
            registry=registry,
        )
        self.mutations = Counter(
            "vramguard_webhook_mutations_total",
            "Pods the mutating webhook answered, by what it did (routed: to the vramguard scheduler; "
            "limited: memory limits written; unchanged; skipped: not a Pod CREATE).",
            labelnames=("result",),
            registry=registry,
        )
        gpu_pods = Gauge(
            "vramguard_webhook_gpu_pods", "Live GPU pods the webhook counts for quotas.", registry=registry
        )
        gpu_pods.set_function(lambda: len(state.cluster.records))
        pending = Gauge(
            "vramguard_webhook_pending_admissions",
            "GPU pods admitted but not yet seen by the pod watch.",
            registry=registry,
        )
        pending.set_function(state.cluster.pending_admissions)
        over = Gauge(
            "vramguard_webhook_gpus_over_budget",
            "GPUs whose bound pods may hold more than the GPU's VRAM budget (pods placed past vramguard, "
            "e.g. direct placements that raced at admission); `vramguard audit` names them.",
            registry=registry,
        )
        over.set_function(state.gpus_over_budget)


_METRICS_KEY = web.AppKey("vramguard_webhook_metrics", _Metrics)
_LARGE_REVIEWS_KEY = web.AppKey("vramguard_webhook_large_reviews", asyncio.Semaphore)


def create_webhook_app(
    state: WebhookState, *, registry: CollectorRegistry, readiness: Readiness | None = None
) -> web.Application:
    """The webhook application: ``POST /validate`` and ``POST /mutate``, plus the probes and metrics
    of ``vramguard.io.http``."""
    app = create_app(
        registry=registry, readiness=readiness, metrics_prefix="vramguard_webhook", client_max_size=BODY_LIMIT
    )
    app[STATE_KEY] = state
    app[_METRICS_KEY] = _Metrics(registry, state)
    app[_LARGE_REVIEWS_KEY] = asyncio.Semaphore(LARGE_REVIEWS_AT_ONCE)
    app.router.add_post("/validate", validate)
    app.router.add_post("/mutate", mutate)
    return app


@contextlib.asynccontextmanager
async def _review_slot(request: web.Request) -> AsyncIterator[None]:
    """Hold one of the large reviews' slots while a review over :data:`LARGE_REVIEW` is handled."""
    declared = request.content_length
    if declared is not None and declared <= LARGE_REVIEW:
        yield
        return
    async with request.app[_LARGE_REVIEWS_KEY]:
        yield


async def mutate(request: web.Request) -> web.Response:
    """Answer one AdmissionReview of the mutating webhook: a Pod being created gets the patch of
    :meth:`AdmissionRules.mutation` (routing, enforced limits); anything else is allowed unchanged."""
    async with _review_slot(request):
        return await _mutate(request)


async def validate(request: web.Request) -> web.Response:
    """Answer one AdmissionReview (see the module docstring for the error channels)."""
    async with _review_slot(request):
        return await _validate(request)


async def _mutate(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    metrics = request.app[_METRICS_KEY]
    review = await read_model(request, AdmissionReview)
    admission = review.request
    gvk = admission.kind
    pod_create = (gvk.group, gvk.version, gvk.kind) == ("", "v1", "Pod") and admission.operation == "CREATE"
    if not pod_create or admission.subResource:
        metrics.mutations.labels("skipped").inc()
        return json_response(review_response(admission.uid, True))
    subject = _subject(admission)
    # The same view as /validate: a claim template created just before its pod is read directly.
    view = await state.view(subject, _object_uid(subject.obj))
    mutation = state.policy.rules.mutation(subject.namespace, subject.obj, view)
    if mutation.routed_to:
        metrics.mutations.labels("routed").inc()
    if mutation.injections:
        metrics.mutations.labels("limited").inc()
    if not mutation.patch:
        metrics.mutations.labels("unchanged").inc()
    return json_response(review_response(admission.uid, True, warnings=mutation.notes, patch=mutation.patch))


async def _validate(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    metrics = request.app[_METRICS_KEY]
    review = await read_model(request, AdmissionReview)
    admission = review.request
    kind = admission.kind.kind
    if admission.operation in ("DELETE", "CONNECT") or admission.subResource not in ("", *REVIEWED_SUBRESOURCES):
        # Nothing to validate: deleting frees VRAM, subresources (status, scale, ...) carry no pod spec.
        metrics.reviews.labels(_kind_label(kind), admission.operation, "skipped").inc()
        return json_response(review_response(admission.uid, True))
    subject = _subject(admission, state.policy.rules.policy.workload_kinds)
    uid = _object_uid(subject.obj)
    name = _object_name(subject.obj)
    holds = (
        subject.kind == "Pod" and admission.operation == "CREATE" and bool(uid) and bool(name)
        and not admission.dryRun and state.policy.rules.quota_bytes(subject.namespace) is not None
    )
    decision: Decision | None = None

    async def decide() -> tuple[bool, str | None]:
        nonlocal decision
        decision = state.policy.rules.review(subject, await state.view(subject, uid))
        if _over_quota(decision) and await state.check_holds(subject.namespace, uid):
            # Pending admissions the API server disowned were counted: decide again without them.
            decision = state.policy.rules.review(subject, await state.view(subject, uid))
        if holds and decision.allowed and decision.wants_gpu and uid:
            state.cluster.hold_admission(uid, subject.namespace, name, decision.claims, _node_name(subject.obj))
            return True, uid
        return False, None

    if holds and state.quota_holds is not None:
        problem = await decide_with_shared_holds(state.quota_holds, state.cluster, subject.namespace, decide)
    else:
        problem = None
        await decide()
    assert decision is not None
    if problem is not None:
        decision = _unshared(decision, problem)
        if not decision.allowed and uid:
            state.cluster.drop_hold(uid)
    metrics.reviews.labels(kind, admission.operation, _result(decision)).inc()
    return json_response(
        review_response(
            admission.uid,
            decision.allowed,
            message=decision.message,
            warnings=decision.warnings,
            audit_annotations=decision.audit_annotations,
        )
    )


def _subject(admission: AdmissionRequest, workload_kinds: Sequence[WorkloadKind] = ()) -> Subject:
    """The object under review; a request the webhook cannot read is a :class:`RequestError` 400.

    Besides the built-in kinds, the policy's ``workload_kinds`` are read in the versions it names,
    and the serving operators' kinds in the versions their readers know.
    """
    gvk = admission.kind
    expected = SUPPORTED_KINDS.get(gvk.kind)
    extra = find_kind(workload_kinds, gvk.kind, gvk.group)
    if extra is not None and gvk.version in extra.versions:
        expected = (gvk.group, gvk.version)
    elif extra is None and gvk.version in operator_versions(gvk.group, gvk.kind):
        expected = (gvk.group, gvk.version)  # a serving operator's kind (vramguard.operators)
    if expected is None or expected != (gvk.group, gvk.version):
        supported = ", ".join(f"{'/'.join(filter(None, gv))} {k}" for k, gv in SUPPORTED_KINDS.items())
        raise RequestError(
            400,
            f"vramguard does not validate {gvk.group or 'core'}/{gvk.version} {gvk.kind}; it validates {supported} "
            "(check the rules of the ValidatingWebhookConfiguration)",
        )
    obj = admission.object
    if obj is None:
        raise RequestError(400, f"request.object is missing for {admission.operation}")
    if obj.get("kind") not in (None, gvk.kind):
        raise RequestError(400, f"request.object is a {obj.get('kind')!r}, but request.kind is {gvk.kind}")
    metadata = obj.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError(400, "request.object.metadata is not an object")
    namespace = admission.namespace or (metadata or {}).get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise RequestError(400, f"request.namespace is missing; {gvk.kind} objects are namespaced")
    operation: Operation = "CREATE" if admission.operation == "CREATE" else "UPDATE"
    old = admission.oldObject if operation == "UPDATE" else None
    user = admission.userInfo
    return Subject(gvk.kind, operation, namespace, obj, old, user.username, user.groups)


def _object_uid(obj: Mapping[str, Any]) -> str | None:
    # The API server sets metadata.uid (and a generated name) before validating admission runs.
    metadata = obj.get("metadata")
    uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


def _object_name(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) else ""


def _unshared(decision: Decision, problem: str) -> Decision:
    """The decision when the admission could not be shared with the other replicas: it may count too
    little of the quota, so it is refused where the namespace enforces, and said elsewhere."""
    text = f"namespace VRAM quota: {problem}, so the admissions of the other webhook replicas are not counted"
    if decision.mode == "enforce" and decision.allowed:
        return replace(decision, allowed=False, message=f"{text}; retry")
    return replace(decision, warnings=(*decision.warnings, fit_warning(f"would deny: {text}")))


def _over_quota(decision: Decision) -> bool:
    return any(finding.code is Code.QUOTA for finding in decision.problems)


def _node_name(obj: Mapping[str, Any]) -> str:
    spec = obj.get("spec")
    node = spec.get("nodeName") if isinstance(spec, Mapping) else None
    return node if isinstance(node, str) else ""


def _result(decision: Decision) -> str:
    if not decision.wants_gpu:
        return "skipped"
    if not decision.allowed:
        return "denied"
    if decision.violations:
        return "warned" if decision.mode == "warn" else "audited"
    return "allowed"


def _kind_label(kind: str) -> str:
    # Skipped requests are counted before the kind is checked; keep the label set bounded.
    return kind if kind in SUPPORTED_KINDS else "other"
