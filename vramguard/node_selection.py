"""Whether a pod may go to a node at all: taints and tolerations, and required node selection.

kube-scheduler checks these before it asks the extender, but ``bind`` is reachable by any client
that can talk to the extender, so bind checks them again before it binds with its own (cluster-wide)
permission. The rules follow upstream (``k8s.io/api/core/v1`` ``Toleration.ToleratesTaint`` and
``k8s.io/component-helpers/scheduling/corev1/nodeaffinity``):

- Only ``NoSchedule`` and ``NoExecute`` taints keep a pod off a node (``PreferNoSchedule`` is a
  preference). A toleration with an empty effect matches every effect; an empty key with
  ``Exists`` tolerates every taint; ``Equal`` (or no operator) compares the values.
- ``spec.nodeSelector``: every label must be on the node with that value.
- ``requiredDuringSchedulingIgnoredDuringExecution``: the node must match at least one term; a term
  matches when all its ``matchExpressions`` (labels) and ``matchFields`` (only ``metadata.name``)
  hold. A term that is empty or malformed matches nothing, as upstream.

Objects come from the API server, but every field is checked for its type: anything malformed
tolerates nothing and selects nothing, so a bad object is refused, never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
"""The taint effects that keep a pod that does not tolerate them off a node."""


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Upstream ``Toleration.ToleratesTaint``: effect, key, then operator and value."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def untolerated_taint(taints: Any, tolerations: Any) -> Mapping[str, Any] | None:
    """The first ``NoSchedule``/``NoExecute`` taint no toleration tolerates, or ``None``."""
    usable = [t for t in tolerations if isinstance(t, Mapping)] if isinstance(tolerations, list) else []
    for taint in taints if isinstance(taints, list) else ():
        if not isinstance(taint, Mapping) or taint.get("effect") not in BLOCKING_EFFECTS:
            continue
        if not any(tolerates(toleration, taint) for toleration in usable):
            return taint
    return None


def describe_taint(taint: Mapping[str, Any]) -> str:
    """``key=value:Effect`` as kubectl prints a taint."""
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


def _int(text: Any) -> int | None:
    """Go's ``strconv.ParseInt(s, 10, 64)``: an optional sign and decimal digits only."""
    if not isinstance(text, str):
        return None
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not digits.isascii() or not digits.isdigit():
        return None
    value = int(text)
    return value if -(1 << 63) <= value < (1 << 63) else None


def label_requirement_holds(requirement: Any, labels: Mapping[str, str]) -> bool:
    """One ``matchExpressions`` entry (a NodeSelectorRequirement) against ``labels``; malformed ones do
    not hold."""
    if not isinstance(requirement, Mapping):
        return False
    key, operator = requirement.get("key"), requirement.get("operator")
    values = requirement.get("values") or []
    if not isinstance(key, str) or not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        return False
    present = key in labels
    if operator == "In":
        return bool(values) and present and labels[key] in values
    if operator == "NotIn":
        return bool(values) and (not present or labels[key] not in values)
    if operator == "Exists":
        return not values and present
    if operator == "DoesNotExist":
        return not values and not present
    if operator in ("Gt", "Lt"):
        bound = _int(values[0]) if len(values) == 1 else None
        actual = _int(labels.get(key))
        if bound is None or actual is None:
            return False
        return actual > bound if operator == "Gt" else actual < bound
    return False


def _field_requirement_holds(requirement: Any, node_name: str) -> bool:
    """One ``matchFields`` entry: only ``metadata.name`` with ``In``/``NotIn`` and one value."""
    if not isinstance(requirement, Mapping) or requirement.get("key") != "metadata.name":
        return False
    values = requirement.get("values")
    if not isinstance(values, list) or len(values) != 1 or not isinstance(values[0], str):
        return False
    if requirement.get("operator") == "In":
        return node_name == values[0]
    if requirement.get("operator") == "NotIn":
        return node_name != values[0]
    return False


def _term_matches(term: Any, node_name: str, labels: Mapping[str, str]) -> bool:
    if not isinstance(term, Mapping):
        return False
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not isinstance(expressions, list) or not isinstance(fields, list) or not (expressions or fields):
        return False  # upstream: an empty term matches no node
    return all(label_requirement_holds(r, labels) for r in expressions) and all(
        _field_requirement_holds(r, node_name) for r in fields
    )


def _required_terms(spec: Mapping[str, Any]) -> Sequence[Any] | None:
    """The required node affinity terms, ``None`` when the pod has none, ``[]`` when malformed."""
    affinity = spec.get("affinity")
    if affinity is None:
        return None
    if not isinstance(affinity, Mapping):
        return []
    node_affinity = affinity.get("nodeAffinity")
    if node_affinity is None:
        return None
    if not isinstance(node_affinity, Mapping):
        return []
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return None
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    return terms if isinstance(terms, list) else []


def node_selection_mismatch(spec: Mapping[str, Any], node_name: str, labels: Any) -> str | None:
    """Why the pod's required node selection excludes the node, or ``None`` when it allows it."""
    node_labels: Mapping[str, str] = (
        {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(labels, Mapping) else {}
    )
    selector = spec.get("nodeSelector")
    if selector is not None:
        if not isinstance(selector, Mapping):
            return "the pod's nodeSelector is malformed"
        for key, value in selector.items():
            if node_labels.get(key) != value:
                return f"node {node_name} does not match the pod's nodeSelector {key}={value}"
    terms = _required_terms(spec)
    if terms is not None and not any(_term_matches(term, node_name, node_labels) for term in terms):
        return f"node {node_name} does not match the pod's required node affinity"
    return None


def placement_refusal(spec: Mapping[str, Any], node_name: str, labels: Any, taints: Any) -> str | None:
    """Why the pod may not go to the node (an untolerated taint, or its node selection), or ``None``."""
    taint = untolerated_taint(taints, spec.get("tolerations"))
    if taint is not None:
        return f"node {node_name} has the taint {describe_taint(taint)}, which the pod does not tolerate"
    return node_selection_mismatch(spec, node_name, labels)
