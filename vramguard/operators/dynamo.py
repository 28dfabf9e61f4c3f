"""NVIDIA Dynamo's ``DynamoGraphDeployment`` (``nvidia.com/v1alpha1``, ``v1beta1``).

From Dynamo's source (ai-dynamo/dynamo, ``deploy/operator``):

- v1alpha1: each entry of ``spec.services`` runs ``replicas`` (``autoscaling.maxReplicas`` at full
  scale when enabled) groups of ``multinode.nodeCount`` pods (1 without ``multinode``), every pod
  with the service's GPU limit ("Total number of GPUs is NumberOfNodes * GPU",
  ``api/v1alpha1/common.go``). The pod is ``extraPodSpec`` with ``extraPodSpec.mainContainer`` as
  its container ``main`` (``internal/consts/consts.go``); ``resources.limits.gpu`` (and
  ``requests.gpu``) become ``nvidia.com/gpu``, or the resource ``gpuType`` names, and ``custom``
  entries become resources of their own names (``internal/controller_common/resource.go``).
  ``spec.envs`` and the service's ``envs`` are merged, the service's winning (``internal/dynamo/graph.go``).
- v1beta1: ``spec.components[]`` each carry a ``podTemplate`` and ``replicas``.

The engine is the worker's own command (``python3 -m dynamo.vllm``, ``dynamo.sglang``, ``dynamo.trtllm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.operators.common import capped, count, env_entries, full_scale, items, mapping, string
from vramguard.template_part import TemplatePart, with_group_size

__all__ = ["graph_parts"]

MAIN = "main"
MAX_SERVICES = 64


def graph_parts(obj: Mapping[str, Any], notes: list[str]) -> list[TemplatePart]:
    """The pods of each service (or component) of a ``DynamoGraphDeployment``."""
    spec = mapping(obj.get("spec"))
    if isinstance(spec.get("components"), list):
        return _components(obj, spec)
    graph_env = env_entries(spec.get("envs"))
    parts: list[TemplatePart] = []
    for name, raw in list(mapping(spec.get("services")).items())[:MAX_SERVICES]:
        service = mapping(raw)
        nodes = count(mapping(service.get("multinode")).get("nodeCount")) or 1
        autoscaling = mapping(service.get("autoscaling"))
        replicas = (
            full_scale(autoscaling.get("maxReplicas"), service.get("replicas"))
            if autoscaling.get("enabled") is True
            else full_scale(service.get("replicas"))
        )
        extra = dict(mapping(service.get("extraPodSpec")))
        main = dict(mapping(extra.pop("mainContainer", None)))
        env = {e["name"]: e for e in [*graph_env, *env_entries(service.get("envs")), *env_entries(main.get("env"))]}
        main.update(name=MAIN, env=list(env.values()), resources=_resources(mapping(service.get("resources"))))
        containers = [main, *(c for c in items(extra.pop("containers", None)) if isinstance(c, Mapping))]
        metadata = mapping(service.get("extraPodMetadata"))
        template: Mapping[str, Any] = {
            "metadata": {key: dict(mapping(metadata.get(key))) for key in ("labels", "annotations")},
            "spec": {**extra, "containers": containers},
        }
        if nodes > 1:
            template = with_group_size(template, nodes)
        parts.append(TemplatePart(str(name), template, capped(replicas * nodes), nodes if nodes > 1 else None))
    if not parts:
        notes.append("spec.services lists no service")
    return parts


def _components(obj: Mapping[str, Any], spec: Mapping[str, Any]) -> list[TemplatePart]:
    parts = []
    for index, raw in enumerate(items(spec.get("components"))[:MAX_SERVICES]):
        component = mapping(raw)
        template = mapping(component.get("podTemplate"))
        if template:
            name = string(component.get("name")) or str(index)
            parts.append(TemplatePart(name, template, full_scale(component.get("replicas"))))
    return parts


def _resources(resources: Mapping[str, Any]) -> dict[str, Any]:
    """Dynamo's ``{requests, limits}: {gpu, gpuType, custom, cpu, memory}`` as a container's resources."""
    converted: dict[str, Any] = {}
    for key in ("limits", "requests"):
        item = mapping(resources.get(key))
        found: dict[str, Any] = {k: v for k, v in mapping(item.get("custom")).items() if isinstance(k, str)}
        for plain in ("cpu", "memory"):
            if item.get(plain) is not None:
                found[plain] = item[plain]
        if item.get("gpu") not in (None, ""):
            found[string(item.get("gpuType")) or "nvidia.com/gpu"] = item["gpu"]
        if found:
            converted[key] = found
    if isinstance(resources.get("claims"), list):
        converted["claims"] = resources["claims"]
    return converted
