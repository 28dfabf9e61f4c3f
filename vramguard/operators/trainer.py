"""Kubeflow Trainer's ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``): the trainer pods of a training run.

From Kubeflow Trainer's source (kubeflow/trainer v2.3.0):

- a TrainJob names its runtime (``spec.runtimeRef``, a ``ClusterTrainingRuntime`` by default), whose
  JobSet template holds the pods; the trainer job's container is ``node``;
- ``spec.trainer.image``, ``command``, ``args`` and ``env`` go to that container, and
  ``spec.trainer.resourcesPerNode`` is merged key by key over its resources
  (``pkg/runtime/framework/plugins/jobset/builder.go``); ``runtimePatches`` cannot change resources;
- the trainer pods number ``spec.trainer.numNodes``, else the runtime's ``mlPolicy.numNodes``, else 1.

The runtime is another object (read on its own as a workload kind); here the TrainJob's own trainer
container is read: training, whose VRAM is unknown unless declared, so each GPU counts whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.operators.common import count, env_entries, mapping, pod, string, words
from vramguard.template_part import TemplatePart

__all__ = ["train_job_parts"]

CONTAINER = "node"


def train_job_parts(obj: Mapping[str, Any], notes: list[str]) -> list[TemplatePart]:
    """The trainer pods a ``TrainJob`` asks for beyond its runtime (notes: what the runtime decides)."""
    spec = mapping(obj.get("spec"))
    trainer = mapping(spec.get("trainer"))
    runtime = string(mapping(spec.get("runtimeRef")).get("name")) or "(none)"
    resources = mapping(trainer.get("resourcesPerNode"))
    if not resources:
        notes.append(
            f"TrainJob: its trainer's GPUs are those of runtime {runtime}, read on its own (a ClusterTrainingRuntime "
            "or TrainingRuntime in the input)"
        )
        return []
    container: dict[str, Any] = {"name": CONTAINER, "resources": dict(resources)}
    image = string(trainer.get("image"))
    if image:
        container["image"] = image
    for key in ("command", "args"):
        if trainer.get(key) is not None:
            container[key] = words(trainer.get(key))
    if trainer.get("env") is not None:
        container["env"] = env_entries(trainer.get("env"))
    nodes = count(trainer.get("numNodes")) or 1
    notes.append(
        f"TrainJob: the trainer container of runtime {runtime} with spec.trainer's resourcesPerNode, on "
        f"{nodes} node{'s' if nodes != 1 else ''} (numNodes); a training run's VRAM is unknown unless declared"
    )
    return [TemplatePart("trainer", pod(obj, [container]), nodes)]
