"""KAITO's ``Workspace`` (``kaito.sh/v1alpha1``, ``v1beta1``): a StatefulSet of one pod per GPU node,
each holding every GPU of its node.

From KAITO's source (kaito-project/kaito, v0.12.0):

- ``resource`` and ``inference`` are top-level fields. ``resource.instanceType`` names a cloud SKU
  whose GPU count every pod asks for as ``nvidia.com/gpu`` (``pkg/sku/azure_sku_handler.go``,
  ``aws_sku_handler.go``; ``pkg/workspace/inference/preset_inferences.go``,
  ``GenerateInferencePodSpec``), or ``nvidia.com/mig-<profile>`` with a MIG ``partition``.
- The pods number ``status.targetNodeCount``, which KAITO estimates from the model's size; before it
  has, the deprecated ``resource.count`` (default 1) is what the manifest says.
- vLLM (the default runtime; ``kaito.sh/runtime: transformers`` picks Hugging Face transformers,
  whose VRAM is not known) runs with ``--gpu-memory-utilization=0.84`` (0.82 on an NVIDIA A10;
  ``pkg/model/interface.go``) and ``--tensor-parallel-size`` = the node's GPUs, with
  ``--pipeline-parallel-size`` = the nodes when there are several.
- ``inference.config`` names a ConfigMap whose ``inference_config.yaml`` has a ``vllm:`` section;
  ``presets/workspace/inference/vllm/inference_api.py`` appends each key as ``--key=value`` after the
  operator's flags, so the ConfigMap's values win.
- ``inference.template`` is a pod template of the user's own, read as it is.
- ``tuning`` instead of ``inference`` fine-tunes the preset (``method: qlora`` or ``lora``): KAITO runs a
  Job of one pod whose main container, named after the Workspace, asks for the SKU's GPUs
  (``pkg/workspace/manifests/manifests.go`` ``GenerateTuningJobManifest``,
  ``pkg/workspace/tuning/preset_tuning.go``; multi-node tuning is refused). Training grows toward the
  whole GPU, so it counts as unknown VRAM, a whole GPU: the Workspace has no pod template to declare
  it in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from vramguard.demand.config_maps import ConfigMaps
from vramguard.demand.objects import MAX_SETTINGS_NODES, YamlTooLarge, load_yaml
from vramguard.operators.common import count, full_scale, mapping, pod, string
from vramguard.template_part import TemplatePart, with_group_size

__all__ = ["SKUS", "workspace_parts"]

SKUS: Mapping[str, tuple[int, str]] = {
    # Azure (v0.12.0, with the SKUs earlier releases also knew)
    "standard_nc6s_v3": (1, "V100"), "standard_nc12s_v3": (2, "V100"), "standard_nc24s_v3": (4, "V100"),
    "standard_nc24rs_v3": (4, "V100"),
    "standard_nc4as_t4_v3": (1, "T4"), "standard_nc8as_t4_v3": (1, "T4"), "standard_nc16as_t4_v3": (1, "T4"),
    "standard_nc64as_t4_v3": (4, "T4"),
    "standard_nv6": (1, "M60"), "standard_nv12": (2, "M60"), "standard_nv24": (4, "M60"),
    "standard_nv12s_v3": (1, "M60"), "standard_nv24s_v3": (2, "M60"), "standard_nv48s_v3": (4, "M60"),
    "standard_nv36ads_a10_v5": (1, "NVIDIA A10"), "standard_nv72ads_a10_v5": (2, "NVIDIA A10"),
    "standard_nc24ads_a100_v4": (1, "A100"), "standard_nc48ads_a100_v4": (2, "A100"),
    "standard_nc96ads_a100_v4": (4, "A100"), "standard_nd96asr_a100_v4": (8, "A100"),
    "standard_nd96amsr_a100_v4": (8, "A100"),
    "standard_nc40ads_h100_v5": (1, "H100"), "standard_nc80adis_h100_v5": (2, "H100"),
    "standard_ncc40ads_h100_v5": (1, "H100"), "standard_nd96isr_h100_v5": (8, "H100"),
    "standard_nd96isr_h200_v5": (8, "H200"),
    # AWS (v0.12.0)
    "p4d.24xlarge": (8, "A100"), "p4de.24xlarge": (8, "A100"), "p5.48xlarge": (8, "H100"),
    "p5e.48xlarge": (8, "H200"), "p5en.48xlarge": (8, "H200"),
    **{f"g6.{size}": (1, "L4") for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "gr6.4xlarge": (1, "L4"), "gr6.8xlarge": (1, "L4"),
    "g6.12xlarge": (4, "L4"), "g6.24xlarge": (4, "L4"), "g6.48xlarge": (8, "L4"),
    **{f"g5.{size}": (1, "A10G") for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g5.12xlarge": (4, "A10G"), "g5.24xlarge": (4, "A10G"), "g5.48xlarge": (8, "A10G"),
}
"""Instance type (lower case: KAITO compares them case-insensitively) -> GPUs per node and GPU model."""
UTILIZATION = "0.84"
UTILIZATION_BY_MODEL = {"NVIDIA A10": "0.82"}
CONFIG_KEY = "inference_config.yaml"
IMAGE = "mcr.microsoft.com/aks/kaito/kaito-base:0.5.0"
TUNING_IMAGE = "mcr.microsoft.com/aks/kaito/kaito-tuning"
"""A stand-in for the preset's tuning image: no engine vramguard knows, so the VRAM is unknown."""
_DECLARE = "a pod template (inference.template) and the vramguard.io/vram annotation"


def workspace_parts(obj: Mapping[str, Any], maps: ConfigMaps, notes: list[str]) -> list[TemplatePart]:
    """The pods of a KAITO ``Workspace`` (notes: what was assumed or could not be read)."""
    resource = mapping(obj.get("resource"))
    inference = mapping(obj.get("inference"))
    metadata = mapping(obj.get("metadata"))
    name = string(metadata.get("name")) or "workspace"
    nodes = full_scale(mapping(obj.get("status")).get("targetNodeCount"), resource.get("count"))
    tuning = mapping(obj.get("tuning"))
    template = mapping(inference.get("template"))
    if template and not tuning:
        return [TemplatePart("workspace", template, nodes)]
    instance = string(resource.get("instanceType")) or ""
    sku = SKUS.get(instance.lower())
    if sku is None:
        notes.append(
            f"Workspace: instanceType {instance or '(none)'} is not a SKU KAITO's table names (or the nodes are "
            f"your own): its GPUs per node are not known; declare them with {_DECLARE}"
        )
        return []
    gpus, model = sku
    if tuning:
        return [_tuning_part(obj, name, gpus, tuning, notes)]
    partition = mapping(resource.get("partition"))
    gpu_resource = "nvidia.com/gpu"
    if partition.get("mode") == "mig" and string(partition.get("profile")):
        gpu_resource = f"nvidia.com/mig-{partition['profile']}"
        gpus = count(partition.get("count")) or gpus
    container: dict[str, Any] = {
        "name": name,
        "image": IMAGE,
        "resources": {"limits": {gpu_resource: gpus}, "requests": {gpu_resource: gpus}},
    }
    annotations = mapping(metadata.get("annotations"))
    if annotations.get("kaito.sh/runtime") == "transformers":
        container["command"] = ["python3", "/workspace/tfs/inference_api.py"]
        return [TemplatePart("workspace", pod(obj, [container]), nodes)]
    preset = string(mapping(inference.get("preset")).get("name")) or name
    args = [f"--model={preset}", f"--gpu-memory-utilization={UTILIZATION_BY_MODEL.get(model, UTILIZATION)}",
            f"--tensor-parallel-size={gpus}"]
    if nodes > 1:
        args.append(f"--pipeline-parallel-size={nodes}")
    args.extend(_config_args(string(inference.get("config")), string(metadata.get("namespace")) or "default",
                             maps, notes))
    container["command"] = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    container["args"] = args
    part = pod(obj, [container])
    return [TemplatePart("workspace", with_group_size(part, nodes) if nodes > 1 else part, nodes,
                         nodes if nodes > 1 else None)]



def _tuning_part(obj: Mapping[str, Any], name: str, gpus: int, tuning: Mapping[str, Any],
                 notes: list[str]) -> TemplatePart:
    """A tuning Workspace's Job pod: training, whose VRAM is not an engine's share."""
    method = string(tuning.get("method")) or "tuning"
    notes.append(
        f"a KAITO tuning Workspace fine-tunes ({method}) in a Job: training grows toward the whole GPU, so each "
        f"of its {gpus} GPU{'s' if gpus != 1 else ''} counts whole (KAITO's Job takes no pod template to "
        "declare it in)"
    )
    container = {"name": name, "image": TUNING_IMAGE,
                 "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}}
    return TemplatePart("tuning", pod(obj, [container]), 1)


def _config_args(config: str | None, namespace: str, maps: ConfigMaps, notes: list[str]) -> list[str]:
    """The ``vllm:`` settings of the Workspace's ConfigMap, as the arguments KAITO appends."""
    if config is None:
        return []
    data = maps.get((namespace, config))
    if data is None:
        notes.append(
            f"inference.config names ConfigMap {config}, not in the input: its vllm settings "
            "(gpu-memory-utilization among them) override KAITO's; pass it too"
        )
        return []
    try:
        settings = mapping(mapping(load_yaml(data.get(CONFIG_KEY) or "", MAX_SETTINGS_NODES)).get("vllm"))
    except YamlTooLarge as exc:
        notes.append(f"ConfigMap {config}: {CONFIG_KEY} is not read: {exc.problem}")
        return []
    except yaml.YAMLError as exc:
        notes.append(f"ConfigMap {config}: {CONFIG_KEY} is not YAML ({exc.__class__.__name__}): KAITO refuses it")
        return []
    args: list[str] = []
    for key, value in settings.items():
        if isinstance(value, bool):
            if value:
                args.append(f"--{key}")
        elif isinstance(value, str | int | float):
            args.append(f"--{key}={value}")
    return args
