"""Taints, tolerations and required node selection, case by case as upstream decides them."""

from __future__ import annotations

from typing import Any

import pytest

from vramguard.node_selection import node_selection_mismatch, placement_refusal, tolerates, untolerated_taint

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("toleration", "taint", "expected"),
    [
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, GPU_TAINT, True),
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}, GPU_TAINT, True),
        ({"key": "nvidia.com/gpu", "value": "present"}, GPU_TAINT, True),
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "other"}, GPU_TAINT, False),
        ({"key": "other", "operator": "Exists"}, GPU_TAINT, False),
        ({"operator": "Exists"}, GPU_TAINT, True),
        ({"operator": "Exists", "effect": "NoExecute"}, GPU_TAINT, False),
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, GPU_TAINT, False),
        ({"key": "k", "operator": "Equal"}, {"key": "k", "effect": "NoSchedule"}, True),
        ({"key": "nvidia.com/gpu", "operator": "Bogus", "value": "present"}, GPU_TAINT, False),
    ],
    ids=["exists-same-key-effect", "equal-same-value", "operator-defaults-to-equal", "equal-other-value",
         "exists-other-key", "empty-key-exists-tolerates-all", "effect-differs", "exists-key-effect-differs",
         "equal-both-values-empty", "unknown-operator"],
)
def test_toleration_matches_taint(toleration: dict[str, Any], taint: dict[str, Any], expected: bool) -> None:
    assert tolerates(toleration, taint) is expected


@pytest.mark.parametrize(
    ("taints", "tolerations", "blocking"),
    [
        ([GPU_TAINT], [], GPU_TAINT),
        ([{"key": "soft", "effect": "PreferNoSchedule"}], [], None),
        ([{"key": "evict", "effect": "NoExecute"}], [{"key": "evict", "operator": "Exists"}], None),
        ([{"key": "evict", "effect": "NoExecute"}], [], {"key": "evict", "effect": "NoExecute"}),
        ([GPU_TAINT, {"key": "b", "effect": "NoSchedule"}], [{"key": "nvidia.com/gpu", "operator": "Exists"}],
         {"key": "b", "effect": "NoSchedule"}),
        (None, None, None),
        ("not-a-list", [], None),
        ([GPU_TAINT], "not-a-list", GPU_TAINT),
        ([GPU_TAINT], [7, {"operator": "Exists"}], None),
    ],
    ids=["no-toleration", "prefer-no-schedule-ignored", "no-execute-tolerated", "no-execute-untolerated",
         "second-taint-untolerated", "none", "taints-wrong-type", "tolerations-wrong-type", "bad-entry-skipped"],
)
def test_untolerated_taint(taints: Any, tolerations: Any, blocking: Any) -> None:
    assert untolerated_taint(taints, tolerations) == blocking


LABELS = {"zone": "a", "gpu": "h100", "gpus": "8"}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    """A spec with required node affinity made of ``terms``."""
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    """One matchExpressions term."""
    requirement: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        requirement["values"] = list(values)
    return {"matchExpressions": [requirement]}


@pytest.mark.parametrize(
    ("spec", "matches"),
    [
        ({}, True),
        ({"nodeSelector": {"zone": "a"}}, True),
        ({"nodeSelector": {"zone": "b"}}, False),
        ({"nodeSelector": {"missing": "x"}}, False),
        ({"nodeSelector": ["zone"]}, False),
        (required(expr("zone", "In", "a", "b")), True),
        (required(expr("zone", "In", "b")), False),
        (required(expr("zone", "In")), False),
        (required(expr("zone", "NotIn", "b")), True),
        (required(expr("zone", "NotIn", "a")), False),
        (required(expr("absent", "NotIn", "a")), True),
        (required(expr("gpu", "Exists")), True),
        (required(expr("absent", "Exists")), False),
        (required(expr("absent", "DoesNotExist")), True),
        (required(expr("gpu", "DoesNotExist")), False),
        (required(expr("gpus", "Gt", "4")), True),
        (required(expr("gpus", "Gt", "8")), False),
        (required(expr("gpus", "Lt", "16")), True),
        (required(expr("gpus", "Lt", "8")), False),
        (required(expr("gpu", "Gt", "4")), False),
        (required(expr("gpus", "Gt", "four")), False),
        (required(expr("zone", "Like", "a")), False),
        (required(expr("zone", "In", "b"), expr("gpu", "In", "h100")), True),
        (required({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                        {"key": "gpu", "operator": "In", "values": ["a100"]}]}), False),
        (required({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}), True),
        (required({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}), False),
        (required({"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}]}), True),
        (required({"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["n1"]}]}), False),
        (required({}), False),
        (required(), False),
        ({"nodeSelector": {"zone": "a"}, **required(expr("zone", "In", "b"))}, False),
        ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}}, True),
        ({"affinity": "junk"}, False),
        (required({"matchExpressions": [{"key": "zone", "operator": "In", "values": [1]}]}), False),
    ],
    ids=["nothing-required", "selector-match", "selector-other-value", "selector-label-missing",
         "selector-wrong-type", "in", "in-no-match", "in-no-values", "notin", "notin-no-match", "notin-absent",
         "exists", "exists-absent", "doesnotexist", "doesnotexist-present", "gt", "gt-equal", "lt", "lt-equal",
         "gt-label-not-int", "gt-value-not-int", "unknown-operator", "terms-are-ored", "expressions-are-anded",
         "field-name-in", "field-name-in-other", "field-name-notin", "field-other-key", "empty-term",
         "no-terms", "selector-and-affinity-both-apply", "preferred-only", "affinity-wrong-type",
         "value-wrong-type"],
)
def test_required_node_selection(spec: dict[str, Any], matches: bool) -> None:
    assert (node_selection_mismatch(spec, "n1", LABELS) is None) is matches


@pytest.mark.parametrize(
    ("spec", "taints", "fragment"),
    [
        ({}, [GPU_TAINT], "taint nvidia.com/gpu=present:NoSchedule"),
        ({"tolerations": [{"operator": "Exists"}], "nodeSelector": {"zone": "b"}}, [GPU_TAINT], "nodeSelector zone=b"),
        ({"tolerations": [{"operator": "Exists"}]}, [GPU_TAINT], None),
    ],
    ids=["taint", "selector-after-tolerated-taint", "allowed"],
)
def test_placement_refusal_says_why(spec: dict[str, Any], taints: Any, fragment: str | None) -> None:
    refusal = placement_refusal(spec, "n1", LABELS, taints)
    assert refusal is None if fragment is None else fragment in (refusal or "")
