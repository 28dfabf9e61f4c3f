"""Ray Serve LLM applications inside a KubeRay ``RayService``'s ``serveConfigV2``.

``serveConfigV2`` is a YAML string. An application built by Ray Serve LLM
(``import_path: ray.serve.llm:build_openai_app``, or ``build_llm_deployment``) lists ``llm_configs``
under ``args``, each with ``engine_kwargs`` that Ray passes to vLLM's ``AsyncEngineArgs`` as they are
(ray-project/ray, ``python/ray/llm/_internal/serve/engines/vllm/vllm_models.py``): Ray sets no
``gpu_memory_utilization`` of its own, so vLLM's default applies when it is absent. Each replica takes
``tensor_parallel_size`` x ``pipeline_parallel_size`` placement bundles of one GPU each, packed onto
the GPU worker pods; ``runtime_env.env_vars`` are set in the replicas' processes.

So every GPU of the GPU worker groups may hold one replica's vLLM process: the worker containers
(which start only ``ray start``) are read as running vLLM with the largest of the applications'
settings. Fractional GPU bundles (``placement_group_config``) put several processes on one GPU,
which is said in a note and left unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction
from typing import Any

import yaml

from vramguard.demand.objects import MAX_SETTINGS_NODES, YamlTooLarge, load_yaml
from vramguard.operators.common import count, items, mapping, string
from vramguard.template_part import TemplatePart

__all__ = ["with_serve_config"]

LLM_BUILDERS = ("ray.serve.llm:build_openai_app", "ray.serve.llm:build_llm_deployment")
PLACED_BY_RAY = frozenset({"tensor_parallel_size", "pipeline_parallel_size"})
"""Engine settings Ray carries out with placement bundles across the worker pods."""
MAX_CONFIG_CHARS = 64 << 10
"""A serveConfigV2 larger than this (real ones are a few KiB) is not parsed: the webhook reads it
too, and YAML parsing in Python costs about a second per MiB."""
MAX_CONFIGS = 64
"""LLM configs read from one RayService (YAML aliases can repeat one list many times over)."""


def with_serve_config(obj: Mapping[str, Any], parts: list[TemplatePart], notes: list[str]) -> list[TemplatePart]:
    """``parts`` of a RayService with its Ray Serve LLM engine settings given to the GPU workers."""
    text = mapping(obj.get("spec")).get("serveConfigV2")
    if not isinstance(text, str) or "llm_configs" not in text:
        return parts
    if len(text) > MAX_CONFIG_CHARS:
        notes.append(f"serveConfigV2 is over {MAX_CONFIG_CHARS >> 10} KiB: not read; declare the workers' VRAM")
        return parts
    try:
        config = load_yaml(text, MAX_SETTINGS_NODES)
    except YamlTooLarge as exc:
        notes.append(f"serveConfigV2 is not read: {exc.problem}; declare the workers' VRAM")
        return parts
    except yaml.YAMLError as exc:
        notes.append(f"serveConfigV2 is not YAML ({exc.__class__.__name__}): Ray Serve refuses it")
        return parts
    configs = [(app, llm) for app in items(mapping(config).get("applications"))[:MAX_CONFIGS]
               if string(mapping(app).get("import_path")) in LLM_BUILDERS
               for llm in items(mapping(mapping(app).get("args")).get("llm_configs"))[:MAX_CONFIGS]]
    if len(configs) > MAX_CONFIGS:
        notes.append(f"serveConfigV2 has over {MAX_CONFIGS} LLM configs: not read; declare the workers' VRAM")
        return parts
    engines = [_engine(app, llm, notes) for app, llm in configs]
    known = [e for e in engines if e is not None]
    if not known or len(known) != len(engines):
        return parts
    # Each GPU may hold any application's replica: the largest share counts (the same engine on all).
    # A setting that is no number counts as the most: vLLM's reading of it then says what is wrong.
    chosen = max(known, key=lambda e: _share(e[0].get("gpu_memory_utilization")))
    return [_with_engine(part, *chosen) for part in parts]


def _share(value: Any) -> Fraction:
    """An application's ``gpu_memory_utilization`` for choosing the largest; unset is vLLM's
    default (at most the whole device), anything else unreadable the most."""
    if value is None:
        return Fraction(1)
    try:
        return Fraction(str(value)) if len(str(value)) <= 32 else Fraction(2)
    except (ValueError, ZeroDivisionError):
        return Fraction(2)


def _engine(app: Any, llm: Any, notes: list[str]) -> tuple[dict[str, Any], dict[str, str]] | None:
    """One LLM config's vLLM settings and environment; ``None`` (with a note) when it cannot be read."""
    config = mapping(llm)
    name = string(mapping(app).get("name")) or "application"
    kwargs = dict(mapping(config.get("engine_kwargs")))
    bundles = items(mapping(config.get("placement_group_config")).get("bundles"))
    if any(isinstance(b, Mapping) and isinstance(b.get("GPU"), float) and b["GPU"] < 1 for b in bundles):
        notes.append(f"Ray Serve application {name}: fractional GPU bundles put several vLLM processes on "
                     "one GPU; declare the workers' VRAM")
        return None
    tp = kwargs.get("tensor_parallel_size") or 1
    pp = kwargs.get("pipeline_parallel_size") or 1
    utilization = kwargs.get("gpu_memory_utilization")
    notes.append(
        f"Ray Serve LLM application {name}: vLLM on each GPU of the GPU workers at "
        f"{utilization if utilization is not None else 'its default'} gpu_memory_utilization "
        f"(tensor {tp} x pipeline {pp} GPUs per replica, placed by Ray)"
    )
    env = {str(k): str(v) for k, v in mapping(mapping(config.get("runtime_env")).get("env_vars")).items()}
    return kwargs, env


def _with_engine(part: TemplatePart, kwargs: Mapping[str, Any], env: Mapping[str, str]) -> TemplatePart:
    """The part with its GPU containers that start no program of their own running vLLM so."""
    spec = mapping(part.template.get("spec"))
    containers = items(spec.get("containers"))
    if not any(_gpu_worker(c) for c in containers):
        return part
    options: list[str] = []
    for key, value in kwargs.items():
        if key in PLACED_BY_RAY or isinstance(value, Mapping | list) or value is None or value is False:
            continue
        options.append(f"--{str(key).replace('_', '-')}")
        if value is not True:
            options.append(str(value))
    replica = (count(kwargs.get("tensor_parallel_size")) or 1) * (count(kwargs.get("pipeline_parallel_size")) or 1)
    rewritten = [
        {**c, "command": ["vllm", "serve", "model", *options, *_layout(replica, _gpus(c))], "args": [],
         "env": [*items(c.get("env")), *({"name": k, "value": v} for k, v in env.items())]}
        if _gpu_worker(c) else c
        for c in containers
    ]
    return replace(part, template={**part.template, "spec": {**spec, "containers": rewritten}})


def _layout(replica: int, gpus: int) -> list[str]:
    """How the pod's GPUs hold replicas of ``replica`` GPUs each, as vLLM's own flags say it: one
    replica per GPU is data parallel (no peers, no communication buffers); a replica over several
    GPUs is tensor parallel over the pod's share of it."""
    if replica <= 1:
        return ["--data-parallel-size", str(gpus)]
    tensor = min(replica, gpus)
    if gpus % tensor:
        return ["--tensor-parallel-size", str(gpus)]
    data = ["--data-parallel-size", str(gpus // tensor)] if gpus // tensor > 1 else []
    return ["--tensor-parallel-size", str(tensor), *data]


def _gpus(container: Mapping[str, Any]) -> int:
    resources = mapping(container.get("resources"))
    for key in ("limits", "requests"):
        for name, value in mapping(resources.get(key)).items():
            if "gpu" in str(name) and count(value):
                return count(value) or 1
    return 1


def _gpu_worker(container: Any) -> bool:
    """A container asking for a GPU that starts nothing itself (KubeRay runs ``ray start`` in it)."""
    if not isinstance(container, Mapping) or container.get("command") or container.get("args"):
        return False
    resources = mapping(container.get("resources"))
    return any("gpu" in str(name) for key in ("limits", "requests") for name in mapping(resources.get(key)))
