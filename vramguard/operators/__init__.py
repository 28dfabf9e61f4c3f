"""Serving operators' custom resources, read as the pods their controllers make.

Some operators describe their pods with fields of their own instead of a pod template (a resource
profile, a cloud instance type, a ``gpu:`` count), so a ``workload_kinds`` entry of paths cannot
describe them. Each module here turns one kind into the pod templates its controller renders, from
that operator's source (cited in each module): which container, image, command and arguments, which
GPU resources, how many pods at full scale.

A ``workload_kinds`` entry of the policy for the same group and kind takes precedence: an operator
of another version, or one configured otherwise, is described there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vramguard.demand.config_maps import ConfigMaps
from vramguard.operators import dynamo, kaito, kubeai, nim, production_stack, trainer
from vramguard.template_part import TemplatePart

__all__ = ["OPERATOR_KINDS", "OPERATOR_RESOURCES", "operator_parts", "operator_versions"]

Reader = Callable[[Mapping[str, Any], ConfigMaps, list[str]], list[TemplatePart]]

OPERATOR_KINDS: Mapping[tuple[str, str], Reader] = {
    ("kubeai.org", "Model"): lambda obj, _maps, notes: kubeai.model_parts(obj, notes),
    ("kaito.sh", "Workspace"): kaito.workspace_parts,
    ("apps.nvidia.com", "NIMService"): lambda obj, _maps, notes: nim.nim_service_parts(obj, notes),
    ("nvidia.com", "DynamoGraphDeployment"): lambda obj, _maps, notes: dynamo.graph_parts(obj, notes),
    ("production-stack.vllm.ai", "VLLMRuntime"): lambda obj, _maps, notes: production_stack.runtime_parts(obj, notes),
    ("trainer.kubeflow.org", "TrainJob"): lambda obj, _maps, notes: trainer.train_job_parts(obj, notes),
}
"""``(API group, kind)`` -> its reader."""
OPERATOR_RESOURCES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("kubeai.org", "Model", "models", ("v1",)),
    ("kaito.sh", "Workspace", "workspaces", ("v1alpha1", "v1beta1")),
    ("apps.nvidia.com", "NIMService", "nimservices", ("v1alpha1",)),
    ("nvidia.com", "DynamoGraphDeployment", "dynamographdeployments", ("v1alpha1", "v1beta1")),
    ("production-stack.vllm.ai", "VLLMRuntime", "vllmruntimes", ("v1alpha1",)),
    ("trainer.kubeflow.org", "TrainJob", "trainjobs", ("v1alpha1",)),
)
"""Each reader's kind as the API serves it: group, kind, plural, versions (the webhook's rules)."""


def operator_versions(group: str, kind: str) -> tuple[str, ...]:
    """The versions of an operator's kind vramguard reads; ``()`` for a kind it has no reader of."""
    return next((versions for g, k, _, versions in OPERATOR_RESOURCES if (g, k) == (group, kind)), ())


def operator_parts(
    obj: Mapping[str, Any], group: str, kind: str, maps: ConfigMaps, notes: list[str]
) -> list[TemplatePart] | None:
    """The pods an operator makes for ``obj``; ``None`` when no reader knows its kind.
    What a reader had to assume, or could not read, goes to ``notes``."""
    reader = OPERATOR_KINDS.get((group, kind))
    return reader(obj, maps, notes) if reader is not None else None
