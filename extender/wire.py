"""The scheduler extender wire format (``k8s.io/kube-scheduler/extender/v1``).

Go's encoding/json without JSON tags: field names are PascalCase (``Pod``, ``NodeNames``,
``FailedNodes``). Only the fields vramguard reads are modelled; the rest is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_CONTAINER_DEPTH = 254
"""How deep a pod's containers may nest arrays and objects: orjson's own limit, so that the check
costs one orjson encoding (about a microsecond) in every case but a refused one. The API server's
typed container fields nest under 10 levels; a forged body nesting about a thousand would exhaust
the stack of the standard library's encoder where demand is keyed by template."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """What makes ``pod`` unlike any object the API server would send, or ``None``.

    The fields the extender reads must have the API's types (labels and annotations map strings to
    strings), so that a forged body is a 400 naming the field, not a 500 deep in the core."""
    metadata = pod.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return "metadata must be an object"
    for field_name in ("name", "namespace", "uid"):
        value = (metadata or {}).get(field_name)
        if value is not None and not isinstance(value, str):
            return f"metadata.{field_name} must be a string"
    for field_name in ("labels", "annotations"):
        values = (metadata or {}).get(field_name)
        if values is None:
            continue
        if not isinstance(values, dict):
            return f"metadata.{field_name} must be an object"
        for key, value in values.items():
            if not isinstance(value, str):
                return f"metadata.{field_name}[{key!r}] must be a string, not {type(value).__name__}"
    spec = pod.get("spec")
    if spec is not None and not isinstance(spec, dict):
        return "spec must be an object"
    for field_name in ("initContainers", "containers"):
        if spec and _nests_too_deep(spec.get(field_name)):
            return f"spec.{field_name} nests deeper than {MAX_CONTAINER_DEPTH} levels"
    return None


def _nests_too_deep(value: Any) -> bool:
    """Whether ``value`` nests arrays and objects more than :data:`MAX_CONTAINER_DEPTH` levels deep.

    orjson encodes up to that depth; only what it refuses (too deep, or an integer beyond 64 bits)
    is walked, iteratively, so that the check itself cannot exhaust the stack."""
    try:
        orjson.dumps(value, default=repr)
        return False
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        pass
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= MAX_CONTAINER_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _checked_pod(pod: dict[str, Any]) -> dict[str, Any]:
    problem = pod_problem(pod)
    if problem is not None:
        raise ValueError(problem)
    return pod


ApiPod = Annotated[dict[str, Any], AfterValidator(_checked_pod)]
"""A Pod in a request body: refused (a 400 naming the field) when :func:`pod_problem` finds one."""


class ExtenderArgs(_Wire):
    """The body of ``filter`` and ``prioritize``.

    With ``nodeCacheCapable: true`` the scheduler sends ``NodeNames`` and ``Nodes`` is null;
    otherwise it sends whole ``Nodes``, which the extender refuses (:data:`NODE_CACHE_REQUIRED`).
    """

    Pod: ApiPod
    Nodes: Any = None
    """Only whether it is there matters: whole Nodes are refused unread."""
    NodeNames: list[str] | None = None

    def whole_nodes(self) -> bool:
        """Whether the candidates came as whole Nodes (``nodeCacheCapable: false``), not names."""
        return self.NodeNames is None and self.Nodes is not None

    def node_names(self) -> list[str]:
        """The candidate nodes' names (none when they came as whole Nodes: see :meth:`whole_nodes`)."""
        return self.NodeNames or []


NODE_CACHE_REQUIRED = (
    "vramguard: the scheduler sent whole Node objects (its extenders entry has nodeCacheCapable: false); "
    "only nodeCacheCapable: true is supported: set it in the scheduler configuration "
    "(counted in vramguard_extender_node_cache_refused_total)"
)


def sends_whole_nodes(body: bytes) -> bool:
    """Whether a filter or prioritize body is from a scheduler with ``nodeCacheCapable: false``,
    read from the raw bytes so that megabytes of Nodes are never turned into objects.

    Go encodes ``ExtenderArgs`` in field order (Pod, Nodes, NodeNames) without omitempty, so such a
    body ends with ``"NodeNames":null}``; a body from any other encoder is caught after parsing by
    :meth:`ExtenderArgs.whole_nodes`.
    """
    return body.rstrip().endswith(b'"NodeNames":null}')


class ExtenderBindingArgs(_Wire):
    """The body of ``bind``."""

    PodName: str
    PodNamespace: str
    PodUID: str
    Node: str


def filter_result(
    passing: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    error: str = "",
) -> dict[str, Any]:
    """``ExtenderFilterResult``: ``NodeNames`` always a list (null would filter out every node);
    ``Nodes`` null, as only node-cache capable schedulers are served."""
    return {
        "Nodes": None,
        "NodeNames": passing,
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": error,
    }


def host_priorities(scores: dict[str, int]) -> list[dict[str, Any]]:
    """``HostPriorityList``: one ``{"Host", "Score"}`` per node, scores 0..10."""
    return [{"Host": host, "Score": score} for host, score in scores.items()]


def binding_result(error: str = "") -> dict[str, str]:
    """``ExtenderBindingResult``: an empty ``Error`` means bound."""
    return {"Error": error}


class MetaPod(_Wire):
    """``MetaPod``: a pod named by its UID."""

    UID: str = Field(max_length=128)


class MetaVictims(_Wire):
    """``MetaVictims``: the victims on one node, by UID (``nodeCacheCapable: true``)."""

    Pods: list[MetaPod] | None = None
    NumPDBViolations: int = 0


class Victims(_Wire):
    """``Victims``: the victims on one node as whole pods (``nodeCacheCapable: false``)."""

    Pods: list[dict[str, Any]] | None = None
    NumPDBViolations: int = 0

    def uids(self) -> list[str]:
        """The victims' UIDs."""
        uids = []
        for pod in self.Pods or ():
            metadata = pod.get("metadata")
            uid = metadata.get("uid") if isinstance(metadata, dict) else None
            if isinstance(uid, str):
                uids.append(uid)
        return uids


class ExtenderPreemptionArgs(_Wire):
    """The body of ``preempt``: the pod and the scheduler's victims per candidate node, as UIDs
    (``NodeNameToMetaVictims``) when the extender is node-cache capable, else as pods."""

    Pod: ApiPod
    NodeNameToVictims: dict[str, Victims | None] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims | None] | None = None

    def proposed(self) -> dict[str, tuple[list[str], int]]:
        """Node -> (victim UIDs, PodDisruptionBudget violations), whichever form they came in."""
        if self.NodeNameToMetaVictims is not None:
            return {
                node: ([p.UID for p in v.Pods or ()], v.NumPDBViolations) if v is not None else ([], 0)
                for node, v in self.NodeNameToMetaVictims.items()
            }
        return {
            node: (v.uids(), v.NumPDBViolations) if v is not None else ([], 0)
            for node, v in (self.NodeNameToVictims or {}).items()
        }


def preemption_result(victims: dict[str, tuple[list[str], int]]) -> dict[str, Any]:
    """``ExtenderPreemptionResult``: the nodes the extender accepts, each with the victims it requires.

    A node left out is not preempted on; a node listed with no victims is an error to the scheduler,
    so the caller lists only nodes with victims.
    """
    return {
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": uid} for uid in uids], "NumPDBViolations": pdb}
            for node, (uids, pdb) in victims.items()
        }
    }
