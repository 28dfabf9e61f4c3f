"""Filter, score and choose GPUs for a pod: pure functions over the ledger, the demand and the policy.

The extender turns a pod into claims once (:func:`pod_claims`), then asks for each node whether it
fits (:func:`filter_node`), how well (:func:`score_node`), and at bind which devices to record
(:func:`choose_gpus`) before reserving them in the ledger.

**Init containers.** A regular init container runs before the app containers and the kubelet hands
its devices on to them, so a pod's devices of a resource number ``max(largest init container, sum of
app containers)``. vramguard gives every one of those devices the largest of the app container's
amount and every init container's amount. That over-reserves only when an init container uses more
VRAM than an app container on the same resource, which is rare (GPU init containers mostly warm a
cache), and it never under-reserves whichever devices the init container gets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION, ClassFindingRecord, Placement
from vramguard.demand.model import PodDemand, Vram
from vramguard.inventory import Gpu, Sharing
from vramguard.ledger import Claim, DeviceUsage, Fit, Ledger, QuickRefusal, ResourceOffer, Shortfall
from vramguard.ledger_fast import too_few_replicas
from vramguard.policy import ClassChoice
from vramguard.quantity import GiB, MiB, format_bytes

MAX_SCORE = 10
_SHARING_ADJECTIVE = {"none": "unshared", "time-slicing": "time-slicing", "mps": "MPS", "mig": "MIG"}
_SHARING_OFFER = {"none": "whole GPUs", "time-slicing": "time-slicing", "mps": "MPS", "mig": "MIG instances"}
# How well a sharing strategy isolates a pod's memory from its neighbours: a GPU less isolated than
# anything a class allows breaks a guarantee the pod relies on; a more isolated one only costs more.
_ISOLATION: dict[str, int] = {"time-slicing": 1, "mps": 2, "none": 3, "mig": 3}


class Rule(StrEnum):
    """Which rule refused a node: says whether to change the workload or the policy."""

    VRAM_BUDGET = "vram-budget"
    """The arithmetic: the pod's VRAM does not fit a GPU's budget (every enforcement mode)."""
    CLASS_RULE = "class-rule"
    """The class does not allow the node's sharing strategy; refuses only in ``enforce`` namespaces."""
    CLASS_GUARANTEE = "class-guarantee"
    """The node's GPUs are less isolated than anything the class allows (every mode)."""
    RESOURCE_MISSING = "resource-missing"
    """The node offers no GPU, or not the resource the pod asks for."""
    NODE_UNKNOWN = "node-unknown"
    """vramguard does not know the node, or the memory size of its GPUs, yet."""
    VRAM_UNKNOWN = "vram-unknown"
    """The pod's VRAM is unknown and its class does not place such pods."""


VRAM_REFUSAL = "VRAM budget free"
"""The words every refusal of a node for the VRAM budget carries (the scheduler's event shows them)."""
UNKNOWN_VRAM_REFUSAL = "VRAM unknown and class"
"""The words of the refusal of a pod whose VRAM is unknown, in a class that does not place such pods."""


def is_vram_refusal(message: str) -> bool:
    """Whether a filter's reason for a node is the pod's VRAM: the budget, or a VRAM nobody knows."""
    return VRAM_REFUSAL in message or UNKNOWN_VRAM_REFUSAL in message


@dataclass(frozen=True, slots=True)
class ClassFinding:
    """A node's sharing strategy that the pod's class does not allow, for one resource."""

    class_name: str
    resource: str
    forbidden: tuple[Sharing, ...]
    guarantee: bool
    """The node is less isolated than the class allows: a refusal in every mode."""
    unreadable: bool = False
    """Not a class rule: vramguard cannot read the node's GPUs, so no budget is checked there (a
    refusal where the namespace enforces; elsewhere the pod is placed as the stock scheduler would)."""

    @property
    def rule(self) -> Rule:
        """:attr:`Rule.CLASS_GUARANTEE`, :attr:`Rule.CLASS_RULE`, or :attr:`Rule.NODE_UNKNOWN`."""
        if self.unreadable:
            return Rule.NODE_UNKNOWN
        return Rule.CLASS_GUARANTEE if self.guarantee else Rule.CLASS_RULE

    @property
    def message(self) -> str:
        """``class best-effort does not allow unshared GPUs (node offers whole GPUs)``."""
        if self.unreadable:
            return (f"the node's {self.resource} GPUs are of unknown memory (vramguard cannot read them): "
                    "placed without a VRAM check, as the namespace does not enforce")
        kinds = ", ".join(_SHARING_ADJECTIVE[s] for s in self.forbidden)
        offered = ", ".join(_SHARING_OFFER[s] for s in self.forbidden)
        return f"class {self.class_name} does not allow {kinds} GPUs (node offers {offered})"

    def record(self) -> ClassFindingRecord:
        """The finding as recorded on the pod (:data:`vramguard.codecs.CLASS_FINDINGS_ANNOTATION`)."""
        return ClassFindingRecord(
            rule=str(self.rule), class_name=self.class_name, resource=self.resource,
            sharing=self.forbidden, message=self.message,
        )

    def to_json(self) -> dict[str, object]:
        """The finding as data (annotations, ``-o json``)."""
        return self.record().model_dump(mode="json", by_alias=True)


class Verdict(StrEnum):
    """A node's answer to the filter."""

    PASS = "pass"
    FAIL = "fail"
    """Does not fit now; may fit once other pods leave (preemption may help)."""
    UNRESOLVABLE = "unresolvable"
    """Can never fit this node, whatever is evicted."""


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """The filter's answer for one node, with the message for the pod's FailedScheduling event."""

    verdict: Verdict
    message: str = ""
    rule: Rule | None = None
    """The rule that refused the node (``None`` when it passes)."""
    findings: tuple[ClassFinding, ...] = ()
    """Class rules the node breaks that the namespace's mode does not enforce (it passes anyway)."""

    @property
    def ok(self) -> bool:
        """Whether the node passes."""
        return self.verdict is Verdict.PASS


@dataclass(frozen=True, slots=True)
class Refusal:
    """A reason to refuse a pod that needs no node to know: its rule, whether the namespace's mode
    enforces it, and the text for people."""

    rule: Rule
    message: str
    enforced: bool = True

    def to_json(self) -> dict[str, object]:
        """The refusal as data."""
        return {"rule": str(self.rule), "enforced": self.enforced, "message": self.message}


NO_MARGIN = Fraction(0)


def pod_refusals(
    demand: PodDemand, choice: ClassChoice, mig_prefixes: Sequence[str], gpu_memory: int | None = None,
    margin: Fraction = NO_MARGIN,
) -> list[Refusal]:
    """What refuses the pod on every node: VRAM unknown in a class that rejects it, a MIG resource
    in a class without MIG (a class rule: enforced only in ``enforce``), a reservation above the
    budget of a GPU of ``gpu_memory`` bytes that keeps ``margin`` free (the VRAM budget, every mode;
    pass the smallest margin any device keeps, so that the refusal holds on every one)."""
    refusals: list[Refusal] = []
    for container in demand.containers:
        if not container.reservations and choice.qos.unknown_vram == "reject":
            refusals.append(Refusal(Rule.VRAM_UNKNOWN, (
                f"container {container.name}: {UNKNOWN_VRAM_REFUSAL} {choice.name} does not place such pods; "
                f"declare it with the annotation {VRAM_ANNOTATION}.{container.name}"
            )))
        if container.resource.startswith(tuple(mig_prefixes)) and "mig" not in choice.qos.sharing:
            refusals.append(Refusal(
                Rule.CLASS_RULE,
                f"container {container.name}: class {choice.name} does not allow MIG GPUs ({container.resource})",
                choice.enforcement == "enforce",
            ))
        if gpu_memory is not None and container.reservations:
            budget = gpu_memory - -(-gpu_memory * margin.numerator // margin.denominator)
            vram = max(container.reservations, key=lambda v: v.on_device(gpu_memory, whole=budget))
            need = vram.on_device(gpu_memory, whole=budget)
            if need > budget:
                kept = f" (keeping {float(margin):.0%} free)" if margin else ""
                refusals.append(Refusal(Rule.VRAM_BUDGET, (
                    f"container {container.name}: needs {format_bytes(need)} per GPU "
                    f"({vram.describe()}), more than the {format_bytes(budget)} VRAM budget of a "
                    f"{format_bytes(gpu_memory)} GPU{kept}"
                )))
    return refusals


@dataclass(frozen=True, slots=True)
class PodClaims:
    """A pod's claims under its class, computed once and used for every node."""

    uid: str
    claims: tuple[Claim, ...] = ()
    init: tuple[tuple[str, str, int, int], ...] = ()
    """Init containers as (container, resource, first claim, devices): each uses the devices of its
    claims ``first claim`` onward, which later phases reuse (see :meth:`PodDemand.phases`)."""
    refusal: str | None = None
    """Why the pod can be placed on no node (its class rejects unknown VRAM)."""

    @property
    def resources(self) -> tuple[str, ...]:
        """The GPU resources the pod asks for."""
        return tuple(dict.fromkeys(c.resource for c in self.claims))


@dataclass(frozen=True, slots=True)
class Assignment:
    """The devices chosen for a pod at bind: claims ready for :meth:`Ledger.reserve`, and per container."""

    node: str
    claims: tuple[Claim, ...]
    containers: Mapping[str, tuple[str, ...]]
    """Container name -> the device ids vramguard intends it to use (init containers included)."""

    def annotation(self) -> str:
        """The decision as compact JSON, for the pod's ``vramguard.io/`` annotation."""
        return Placement(node=self.node, containers=self.containers).encode()


def pod_claims(demand: PodDemand, choice: ClassChoice, uid: str = "") -> PodClaims:
    """The claims a pod makes, one per device replica, under its class's rule for unknown VRAM."""
    if not choice.qos.trust_env_only_engines:
        demand = demand.distrusting_env_only()  # an engine named only by env vars is unknown VRAM
    unknown = [c.name for c in demand.containers if c.reservation is None]
    if unknown and choice.qos.unknown_vram == "reject":
        names = ", ".join(unknown)
        return PodClaims(uid, refusal=(
            f"container {names}: {UNKNOWN_VRAM_REFUSAL} {choice.name} does not place such pods; "
            f"declare it with the annotation {VRAM_ANNOTATION} (e.g. {VRAM_ANNOTATION}.{unknown[0]}: 16Gi)"
        ))
    claims: list[Claim] = []
    init: list[tuple[str, str, int, int]] = []
    for resource in dict.fromkeys(c.resource for c in demand.containers):
        # One slot per device the pod holds of the resource at once; a slot counts the largest of
        # what any phase puts on it (sidecars keep theirs, init containers and apps take turns).
        slots: list[list[Vram | None]] = []
        owners: list[str] = []
        for phase in reversed(demand.phases()):  # the app containers' phase first: they own the slots
            position = 0
            for container in phase:
                if container.resource != resource:
                    continue
                amounts = container.reservations or (None,)
                if container.init:
                    init.append((container.name, resource, len(claims) + position, container.gpus))
                for _ in range(container.gpus):
                    if position == len(slots):
                        slots.append([])
                        owners.append(container.name)
                    slots[position].extend(amounts)
                    position += 1
        claims.extend(
            Claim(resource, owner, tuple(dict.fromkeys(amounts))) for owner, amounts in zip(owners, slots, strict=True)
        )
    return PodClaims(uid, tuple(claims), tuple(init))


def filter_node(ledger: Ledger, node: str, pod: PodClaims, choice: ClassChoice) -> NodeVerdict:
    """Whether the pod's claims fit ``node`` without any device exceeding its budget, under its class.

    Unresolvable: the node lacks a resource the pod asks for, the class forbids the node's sharing,
    or the claims do not fit even the empty node. Otherwise a failure names each device's numbers.
    """
    return filter_nodes(ledger, (node,), pod, choice)[0]


class FilterMemo:
    """What one filter request reuses across its nodes (one pod, one class): the verdict of the
    node's devices alone per kind of node, and the text of each bound refusal, built once per
    distinct refusal and one string per distinct text (the scheduler counts equal reasons as one
    line of its event)."""

    __slots__ = ("fits", "messages", "static", "texts")

    def __init__(self) -> None:
        self.static: dict[tuple[int, ...], tuple[NodeVerdict | None, tuple[ClassFinding, ...]]] = {}
        self.messages: dict[QuickRefusal, str] = {}
        self.texts: dict[str, str] = {}
        self.fits: dict[int, tuple[Fit, str]] = {}

    def described(self, fit: Fit, claims: Sequence[Claim]) -> str:
        """The filter's reason for a failed fit, once per verdict object (nodes of a kind the pod
        fails even empty share one verdict, the ledger's): a fit short of VRAM only, in the words of
        its kind (:func:`_kind_fit_text`, one string per text); otherwise :func:`describe_fit`."""
        kept = self.fits.get(id(fit))
        if kept is None:
            words = _kind_fit_text(fit, claims) if not fit.unresolvable else None
            text = self.texts.setdefault(words, words) if words is not None else describe_fit(fit, claims)
            # The verdict is kept with its text, so its id cannot be reused during the request.
            kept = self.fits[id(fit)] = (fit, text)
        return kept[1]

    def message(self, refusal: QuickRefusal, claims: Sequence[Claim]) -> str:
        """The reason for a bound refusal, shared by every node refused the same way."""
        text = self.messages.get(refusal)
        if text is None:
            words = _refusal_text(refusal, claims)
            # Rooms that round alike give one text: one string object for all their nodes.
            text = self.messages[refusal] = self.texts.setdefault(words, words)
        return text


def filter_nodes(
    ledger: Ledger, nodes: Sequence[str], pod: PodClaims, choice: ClassChoice, memo: FilterMemo | None = None
) -> list[NodeVerdict]:
    """:func:`filter_node` for each of ``nodes``, with the pod's part of the work done once.

    With a ``memo`` (a filter request's), nodes of one kind share the check of their devices, and a
    node whose bound already refuses the pod (:meth:`Ledger.quick_refusal`) fails without the full
    check, with a reason shared by every node refused the same way; same verdicts, shorter texts.
    """
    if pod.refusal is not None:
        return [NodeVerdict(Verdict.UNRESOLVABLE, pod.refusal, Rule.VRAM_UNKNOWN)] * len(nodes)
    if not pod.claims:
        return [_PASS] * len(nodes)  # no GPU asked for: nothing of vramguard's to check
    resources = pod.resources
    uid = pod.uid or None
    verdicts = []
    for node in nodes:
        if memo is None:
            offers = ledger.offers(node)
            if offers is None:
                verdicts.append(_unknown(node))
                continue
            verdict, findings = _static_verdict(offers, resources, choice)
        else:
            kind = ledger.offer_kind(node)
            if kind is None:
                verdicts.append(_unknown(node))
                continue
            static = memo.static.get(kind)
            if static is None:
                static = memo.static[kind] = _static_verdict(ledger.offers(node) or {}, resources, choice)
            verdict, findings = static
            if verdict is None:
                judged = ledger.judge(node, pod.claims, uid)
                if isinstance(judged, QuickRefusal):
                    verdict = NodeVerdict(Verdict.FAIL, memo.message(judged, pod.claims), Rule.VRAM_BUDGET, findings)
                elif judged.ok:
                    verdict = NodeVerdict(Verdict.PASS, findings=findings) if findings else _PASS
                else:
                    verdict = NodeVerdict(
                        Verdict.UNRESOLVABLE if judged.unresolvable else Verdict.FAIL,
                        memo.described(judged, pod.claims),
                        Rule.VRAM_BUDGET,
                        findings,
                    )
        if verdict is None:
            # The VRAM budget holds in every enforcement mode: that is the product.
            fit = ledger.fits(node, pod.claims, uid)
            if fit.ok:
                verdict = NodeVerdict(Verdict.PASS, findings=findings) if findings else _PASS
            else:
                verdict = NodeVerdict(
                    Verdict.UNRESOLVABLE if fit.unresolvable else Verdict.FAIL,
                    describe_fit(fit, pod.claims),
                    Rule.VRAM_BUDGET,
                    findings,
                )
        verdicts.append(verdict)
    return verdicts


Groups = list[tuple[NodeVerdict, list[str]]]
"""Verdicts, each with the nodes it is for."""


def filter_grouped(
    ledger: Ledger, nodes: Sequence[str], pod: PodClaims, choice: ClassChoice, memo: FilterMemo
) -> tuple[Groups, list[str]]:
    """The verdicts :func:`filter_nodes` would give, for the nodes the ledger's bound index decides
    (:meth:`Ledger.split_by_bound`: one bisection per kind of node, no work per node but its
    name), in groups of nodes sharing one verdict, so that a filter of thousands of nodes builds
    its answer a group at a time; and the nodes left to :func:`filter_nodes`."""
    if pod.refusal is not None or not pod.claims:
        return [(v, [node]) for node, v in zip(nodes, filter_nodes(ledger, nodes, pod, choice, memo), strict=True)], []
    split = ledger.split_by_bound(nodes, pod.claims, pod.uid or None)
    if split is None:
        return [], list(nodes)
    splits, rest = split
    groups: Groups = []
    for part in splits:
        static = memo.static.get(part.kind)
        if static is None:
            offers = ledger.offers(part.example) or {}
            static = memo.static[part.kind] = _static_verdict(offers, pod.resources, choice)
        verdict, findings = static
        if verdict is not None:
            for names in (part.passing, part.refused, part.refused_counting, part.unresolvable, part.undecided,
                          part.stacked, part.stacked_counting, *part.short.values()):
                groups.append((verdict, names))
            continue
        rest.extend(part.undecided)
        if part.passing:
            groups.append((NodeVerdict(Verdict.PASS, findings=findings) if findings else _PASS, part.passing))
        for names, counting in ((part.refused, False), (part.refused_counting, True)):
            if names:
                text = _kind_refusal_text(part.device, part.need, pod.claims, counting=counting)
                groups.append((NodeVerdict(Verdict.FAIL, memo.texts.setdefault(text, text), Rule.VRAM_BUDGET, findings),
                               names))
        for names, counting in ((part.stacked, False), (part.stacked_counting, True)):
            if names:
                text = _kind_refusal_text(part.device, part.need, pod.claims, counting=counting, devices=2)
                groups.append((NodeVerdict(Verdict.FAIL, memo.texts.setdefault(text, text), Rule.VRAM_BUDGET, findings),
                               names))
        for free, names in part.short.items():
            text = too_few_replicas(len(pod.claims), part.resource, part.slots, part.slots - free)
            groups.append((NodeVerdict(Verdict.FAIL, memo.texts.setdefault(text, text), Rule.VRAM_BUDGET, findings),
                           names))
        if part.unresolvable:
            # The pod fails the kind even empty: every node of it has the same verdict (the ledger's).
            groups.append((filter_nodes(ledger, part.unresolvable[:1], pod, choice, memo)[0], part.unresolvable))
    return groups, rest


def _unknown(node: str) -> NodeVerdict:
    return NodeVerdict(Verdict.FAIL, f"node {node} is not known to vramguard yet", Rule.NODE_UNKNOWN)




def _kind_refusal_text(
    device: Gpu, need: int, claims: Sequence[Claim], *, counting: bool, devices: int = 1
) -> str:
    """The filter's reason for a node short of VRAM: the kind of device and what the pod needs, no
    node's own numbers, so every node failing the same way gives one line and the scheduler's event
    counts them together (``GPU (NVIDIA H100 80GB HBM3): VRAM budget free below the pod's 23.9 GiB
    per GPU``). ``devices``: how many of the pod's GPU replicas the worst case puts on one device
    (more than one: how many, and so how much, differs from node to node; the line does not say).
    Each device's room: ``kubectl vram nodes``; bind's refusal names the device and its numbers."""
    kind = f"MIG {device.mig_profile}" if device.mig_profile is not None else "GPU"
    text = f"{kind} ({device.product}): {VRAM_REFUSAL} below " + (
        f"the pod's {format_bytes(need)} per GPU" if devices <= 1
        else "what the pod needs where the device plugin gives several of its GPU replicas one GPU"
    )
    if any(None in c.vram for c in claims):
        text += f"; its VRAM is unknown, so it takes a whole GPU (declare {VRAM_ANNOTATION})"
    text += _ceiling_note(claims)
    if counting:
        text += "; counting pods whose GPU is not known yet"
    return text


def _kind_fit_text(fit: Fit, claims: Sequence[Claim]) -> str | None:
    """A failed fit short of VRAM alone (no other problem), in the words of
    :func:`_kind_refusal_text` for its device with most room; ``None`` for any other failure."""
    if fit.problems or not fit.shortfalls:
        return None
    first = min(fit.shortfalls, key=lambda s: (-s.free, s.device.index))
    counting = any(s.unknown_pods for s in fit.shortfalls)
    return _kind_refusal_text(first.device, first.need, claims, counting=counting, devices=first.devices)


def _refusal_text(refusal: QuickRefusal, claims: Sequence[Claim]) -> str:
    """:func:`_kind_refusal_text` for a node refused on its bound outside the index, with why its
    agent report was set aside, if it was."""
    text = _kind_refusal_text(refusal.device, refusal.need, claims, counting=bool(refusal.unknown_pods))
    if refusal.distrust is not None:
        text += f"; {refusal.distrust}"
    return text


def class_findings(
    offers: Mapping[str, ResourceOffer], resources: Sequence[str], choice: ClassChoice
) -> list[ClassFinding]:
    """The sharing strategies the node offers under ``resources`` that the class does not allow."""
    allowed = frozenset(choice.qos.sharing)
    least_isolation = min(_ISOLATION[s] for s in allowed)
    findings = []
    for resource in resources:
        offer = offers.get(resource)
        forbidden = tuple(sorted(offer.sharing - allowed)) if offer is not None else ()
        if forbidden:
            guarantee = any(_ISOLATION[s] < least_isolation for s in forbidden)
            findings.append(ClassFinding(choice.name, resource, forbidden, guarantee))
    return findings


def _static_verdict(
    offers: Mapping[str, ResourceOffer], resources: Sequence[str], choice: ClassChoice
) -> tuple[NodeVerdict | None, tuple[ClassFinding, ...]]:
    """What the node's devices alone decide: no GPU, no such resource, forbidden sharing, unknown size.

    A class rule refuses only in an ``enforce`` namespace, or where it protects the pod (a GPU less
    isolated than its class allows); otherwise it is returned as a finding and the node stays in.
    """
    if not offers:
        return NodeVerdict(
            Verdict.UNRESOLVABLE, "node has no GPUs (no GPU Feature Discovery labels)", Rule.RESOURCE_MISSING
        ), ()
    for resource in resources:
        if resource not in offers:
            return NodeVerdict(
                Verdict.UNRESOLVABLE, f"node offers no {resource} (it has {', '.join(offers)})", Rule.RESOURCE_MISSING
            ), ()
    findings = class_findings(offers, resources, choice)
    for finding in findings:
        if finding.guarantee or choice.enforcement == "enforce":
            return NodeVerdict(Verdict.UNRESOLVABLE, finding.message, finding.rule), ()
    for resource in resources:
        sizeless = offers[resource].sizeless
        if sizeless is None:
            continue
        if choice.enforcement == "enforce":
            return NodeVerdict(
                Verdict.UNRESOLVABLE,
                f"{sizeless.label}: memory size unknown, so the pod's VRAM cannot be checked there (no GPU Feature "
                "Discovery, GKE, Karpenter or instance-type label, no agent report); run the vramguard agent there",
                Rule.NODE_UNKNOWN,
            ), ()
        # Outside enforce, vramguard must not keep a pod off a node the stock scheduler would use.
        unguarded = ClassFinding(choice.name, resource, (), False, unreadable=True)
        return NodeVerdict(Verdict.PASS, findings=(*findings, unguarded)), ()
    return None, tuple(findings)


_PASS = NodeVerdict(Verdict.PASS)


def describe_fit(fit: Fit, claims: Sequence[Claim]) -> str:
    """The message of a failed fit: the device with most room first, its numbers, then the others."""
    whole = any(None in c.vram for c in claims)
    parts = list(fit.problems)
    shortfalls = sorted(fit.shortfalls, key=lambda s: (-s.free, s.device.index))
    if shortfalls:
        first = shortfalls[0]
        text = _shortfall_text(first)
        if whole:
            text += f"; its VRAM is unknown, so it takes a whole GPU (declare {VRAM_ANNOTATION})"
        text += _ceiling_note(claims)
        if first.unknown_pods:
            text += f"; counting {_pods(first.unknown_pods)} whose GPU is not known yet"
        if len(shortfalls) > 1:
            text += "; also " + ", ".join(_short_label(s.device) for s in shortfalls[1:])
        parts.insert(0, text)
    return "; ".join(parts)


def _ceiling_note(claims: Sequence[Claim]) -> str:
    """Why a ceiling engine needs more than its share: it counts at least half a budget."""
    if not any(v is not None and v.ceiling for c in claims for v in c.vram):
        return ""
    return (
        "; its engine's fraction caps the whole GPU's use (TGI; vLLM's V1 engine v0.6.5 to v0.9.0; SGLang's and newer "
        "vLLM's defaults), so it counts at least half a GPU's budget and never shares one with another such"
    )


def _short_label(device: Gpu) -> str:
    """``GPU 1`` or ``MIG 3g.40gb #0``: the device's label without the product."""
    if device.mig_profile is not None:
        return f"MIG {device.mig_profile} #{device.index}"
    return f"GPU {device.index}"


def _shortfall_text(shortfall: Shortfall) -> str:
    free = max(shortfall.free, 0)
    head = (
        f"{shortfall.device.label}: {_like(free, shortfall.budget)} of {format_bytes(shortfall.budget)} "
        f"{VRAM_REFUSAL}, pod needs "
    )
    if shortfall.devices <= 1:
        return head + f"{format_bytes(shortfall.need)} per GPU"
    return head + (
        f"{format_bytes(shortfall.need)} on it ({shortfall.devices} of its GPU replicas may be given "
        "the same GPU)"
    )


def _like(count: int, reference: int) -> str:
    """``count`` in the unit ``format_bytes`` picks for ``reference`` (``0.0 GiB`` of ``71.7 GiB``)."""
    if reference >= GiB:
        return f"{count / GiB:.1f} GiB"
    if reference >= MiB:
        return f"{count / MiB:.1f} MiB"
    return format_bytes(count)


def _pods(count: int) -> str:
    return f"{count} pod" if count == 1 else f"{count} pods"


def score_node(ledger: Ledger, node: str, pod: PodClaims, choice: ClassChoice, *, checked: bool = False) -> int:
    """0..10 for a node the pod fits: ``binpack`` favours the fullest devices that still fit (less
    fragmentation), ``spread`` the emptiest with the fewest co-tenants (less jitter). 0 if it fails.

    ``checked=True`` skips the filter for nodes that just passed it (the scheduler prioritizes only those).
    """
    if not checked and not filter_node(ledger, node, pod, choice).ok:
        return 0
    if not pod.claims or ledger.inventory(node) is None:
        return 0
    rows = ledger.usage(node, pods=False)
    usage = {u.device.id: u for u in rows}
    added: dict[str, tuple[int, int]] = {}
    for claim, target in zip(pod.claims, _plan(rows, pod, choice.qos.scoring), strict=True):
        device = claim.gpu or target
        if device is None or device not in usage:
            continue
        row = usage[device]
        amount = claim.bytes_on(row.device.memory_bytes, _whole(row))
        before = added.get(device, (0, 0))
        added[device] = (before[0] + amount, before[1] + 1)
    if not added:
        return 0
    fullness = []
    crowding = []
    for device, (amount, slots) in added.items():
        row = usage[device]
        fullness.append(min(1.0, (row.expected_bytes + amount) / row.budget) if row.budget else 1.0)
        crowding.append(min(1.0, (row.slots_used + slots) / row.device.replicas))
    mean_full = sum(fullness) / len(fullness)
    mean_crowd = sum(crowding) / len(crowding)
    score = mean_full if choice.qos.scoring == "binpack" else 1 - (mean_full + mean_crowd) / 2
    # The class's order of sharing strategies is its preference: each rank gets its own band of
    # scores, so a less preferred node (or one the class allows only outside enforce) ranks below
    # every node of a preferred kind, and binpack or spread orders the nodes within a band.
    bands = len(choice.qos.sharing) + 1
    band = bands - 1 - _preference_rank(ledger, node, pod, choice)
    return max(0, min(MAX_SCORE, round((band + score) / bands * MAX_SCORE)))


def _preference_rank(ledger: Ledger, node: str, pod: PodClaims, choice: ClassChoice) -> int:
    """0 for the class's first sharing strategy, 1 for the next, ...; ``len(sharing)`` if not allowed."""
    offers = ledger.offers(node) or {}
    order = choice.qos.sharing
    rank = 0
    for resource in pod.resources:
        offer = offers.get(resource)
        if offer is None:
            continue
        ranks = [order.index(s) if s in order else len(order) for s in offer.sharing]
        rank = max(rank, min(ranks, default=0))
    return rank


def _whole(row: DeviceUsage) -> int:
    return row.budget // row.device.replicas if row.device.sharing == "mps" else row.budget


def choose_gpus(ledger: Ledger, node: str, pod: PodClaims, choice: ClassChoice) -> Assignment | None:
    """The devices to record for each claim and container; ``None`` when the node is unknown.

    A claim whose device is known (given on the claim, or the only device of its resource) keeps it.
    For the others this is vramguard's intended placement, from the expected usage (known plus intended
    claims): ``binpack`` takes the fullest device that still has room, ``spread`` the emptiest. The
    device plugin may still pick another replica; the ledger's accounting does not rely on it.
    """
    if ledger.inventory(node) is None:
        return None
    targets = _plan(ledger.usage(node, pods=False), pod, choice.qos.scoring)
    chosen = [replace(claim, intended=target) for claim, target in zip(pod.claims, targets, strict=True)]
    containers: dict[str, list[str]] = {}
    for claim in chosen:
        target = claim.gpu or claim.intended
        if target is not None:
            containers.setdefault(claim.container, []).append(target)
    for name, _resource, first, count in pod.init:
        devices = [c.gpu or c.intended for c in chosen[first:first + count]]
        containers[name] = [d for d in devices if d is not None]
    return Assignment(node, tuple(chosen), {k: tuple(v) for k, v in containers.items()})


def _plan(rows: Sequence[DeviceUsage], pod: PodClaims, scoring: str) -> list[str | None]:
    """The device intended for each of the pod's claims, largest claims first (see :func:`choose_gpus`)."""
    state = {u.device.id: [u.expected_bytes, u.slots_used] for u in rows}
    by_id = {u.device.id: u for u in rows}
    targets: list[str | None] = [None] * len(pod.claims)
    order = sorted(range(len(pod.claims)), key=lambda i: _largest(pod.claims[i], rows), reverse=True)
    for i in order:
        claim = pod.claims[i]
        known = claim.gpu if claim.gpu in by_id else _only_device(rows, claim.resource)
        pick = known if known is not None else _pick(rows, state, claim, scoring)
        targets[i] = pick
        if pick is not None:
            _take(state, by_id[pick], claim)
    return targets


def _only_device(rows: Sequence[DeviceUsage], resource: str) -> str | None:
    devices = [u.device.id for u in rows if u.device.resource == resource]
    return devices[0] if len(devices) == 1 else None


def _largest(claim: Claim, rows: Sequence[DeviceUsage]) -> int:
    sizes = [claim.bytes_on(u.device.memory_bytes, _whole(u)) for u in rows if u.device.resource == claim.resource]
    return max(sizes, default=0)


def _take(state: dict[str, list[int]], row: DeviceUsage, claim: Claim) -> None:
    state[row.device.id][0] += claim.bytes_on(row.device.memory_bytes, _whole(row))
    state[row.device.id][1] += 1


def _pick(rows: Sequence[DeviceUsage], state: Mapping[str, list[int]], claim: Claim, scoring: str) -> str | None:
    candidates = []
    for row in rows:
        if row.device.resource != claim.resource:
            continue
        used, slots = state[row.device.id]
        if slots >= row.device.replicas:
            continue
        amount = claim.bytes_on(row.device.memory_bytes, _whole(row))
        room = row.budget - used - amount
        candidates.append((room >= 0, row, used, slots))
    if not candidates:
        return None
    fitting = [c for c in candidates if c[0]] or candidates
    if scoring == "binpack":
        best = min(fitting, key=lambda c: (c[1].budget - c[2], c[1].device.index))
    else:
        best = min(fitting, key=lambda c: (c[3], c[2] - c[1].budget, c[1].device.index))
    return best[1].device.id


def apply_intended(claims: Sequence[Claim], containers: Mapping[str, Sequence[str]]) -> tuple[Claim, ...]:
    """Claims with the devices recorded at bind set as intended (to rebuild the ledger from pods)."""
    position: dict[str, int] = {}
    result = []
    for claim in claims:
        devices = containers.get(claim.container, ())
        index = position.get(claim.container, 0)
        position[claim.container] = index + 1
        result.append(replace(claim, intended=devices[index]) if index < len(devices) else claim)
    return tuple(result)
