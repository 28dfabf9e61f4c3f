"""The NIM operator's ``NIMService`` (``apps.nvidia.com/v1alpha1``).

From the operator's source (NVIDIA/k8s-nim-operator, v3.1.2):

- One Deployment of ``spec.replicas`` pods (``scale.hpa.maxReplicas`` at full scale when
  ``scale.enabled``), its container ``<name>-ctr`` running ``spec.image`` (``repository:tag``) with
  ``spec.command``, ``spec.args``, ``spec.env`` and ``spec.resources`` as given
  (``api/apps/v1alpha1/nimservice_types.go``; ``internal/controller/platform/standalone/nimservice.go``).
- ``spec.multiNode`` with ``parallelism.pipeline`` > 1 makes a LeaderWorkerSet of groups of
  ``pipeline`` pods (containers ``nim-leader`` and ``nim-worker``, each with ``spec.resources``;
  ``manifests/lws.yaml``), with ``NIM_TENSOR_PARALLEL_SIZE`` and ``NIM_PIPELINE_PARALLEL_SIZE`` set.
- ``spec.draResources`` gives the pods DRA claims (a claim or claim template by name).
- Without a GPU limit the operator adds ``nvidia.com/gpu`` only from a NIMCache's model profile,
  which is not in the manifest.

A NIM chooses its engine and memory settings at start, from its model profile: its VRAM is unknown
unless the pod declares it (``vramguard.io/vram``) or passes the engine's flag in ``spec.args``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.operators.common import capped, count, env_entries, full_scale, items, mapping, pod, string, words
from vramguard.template_part import TemplatePart, with_group_size

__all__ = ["nim_service_parts"]


def nim_service_parts(obj: Mapping[str, Any], notes: list[str]) -> list[TemplatePart]:
    """The pods of a ``NIMService`` (notes: what the manifest does not say)."""
    spec = mapping(obj.get("spec"))
    name = string(mapping(obj.get("metadata")).get("name")) or "nim"
    image = mapping(spec.get("image"))
    container: dict[str, Any] = {
        "image": f"{string(image.get('repository')) or 'nvcr.io/nim'}:{string(image.get('tag')) or 'latest'}",
        "env": env_entries(spec.get("env")),
        "resources": dict(mapping(spec.get("resources"))),
    }
    for key in ("command", "args"):
        if isinstance(spec.get(key), list):
            container[key] = words(spec[key])
    claims = _claims(spec.get("draResources"))
    if claims:
        container["resources"] = {**container["resources"], "claims": [{"name": c["name"]} for c in claims]}
    elif not _has_gpu(container["resources"]):
        notes.append(
            "NIMService: spec.resources names no GPU: the operator adds nvidia.com/gpu from the NIMCache's model "
            "profile, which is not in the manifest; set spec.resources.limits to see its GPUs here"
        )
    scale = mapping(spec.get("scale"))
    replicas = (
        full_scale(mapping(scale.get("hpa")).get("maxReplicas"), mapping(scale.get("hpa")).get("minReplicas"))
        if scale.get("enabled") is True
        else full_scale(spec.get("replicas"))
    )
    extra = {"resourceClaims": claims} if claims else {}
    parallelism = mapping(mapping(spec.get("multiNode")).get("parallelism"))
    pipeline = count(parallelism.get("pipeline")) or 1
    if pipeline <= 1:
        return [TemplatePart("deployment", pod(obj, [{**container, "name": f"{name}-ctr"}], **extra), replicas)]
    tensor = count(parallelism.get("tensor")) or 1
    env = [*container["env"], {"name": "NIM_TENSOR_PARALLEL_SIZE", "value": str(tensor)},
           {"name": "NIM_PIPELINE_PARALLEL_SIZE", "value": str(pipeline)}]
    leader = with_group_size(pod(obj, [{**container, "env": env, "name": "nim-leader"}], **extra), pipeline)
    worker = with_group_size(pod(obj, [{**container, "env": env, "name": "nim-worker"}], **extra), pipeline)
    return [TemplatePart("leader", leader, replicas, pipeline),
            TemplatePart("worker", worker, capped(replicas * (pipeline - 1)), pipeline)]


def _claims(value: Any) -> list[dict[str, str]]:
    """``draResources`` as the pod's ``resourceClaims`` (those naming a claim or a claim template)."""
    claims: list[dict[str, str]] = []
    for index, raw in enumerate(items(value)):
        entry = mapping(raw)
        for field in ("resourceClaimName", "resourceClaimTemplateName"):
            if string(entry.get(field)):
                claims.append({"name": f"claim-{index}", field: entry[field]})
    return claims


def _has_gpu(resources: Mapping[str, Any]) -> bool:
    return any("gpu" in str(name) for key in ("limits", "requests") for name in mapping(resources.get(key)))
