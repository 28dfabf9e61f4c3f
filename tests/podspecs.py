"""Small builders for pod specs, so that test tables stay readable."""

from __future__ import annotations

from typing import Any


def container(
    name: str = "main",
    image: str = "example/app:1.0",
    command: list[str] | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | list[dict[str, Any]] | None = None,
    gpus: Any = 1,
    resource: str = "nvidia.com/gpu",
    **extra: Any,
) -> dict[str, Any]:
    """A container asking for ``gpus`` of ``resource`` (``gpus=None``: no GPU)."""
    spec: dict[str, Any] = {"name": name, "image": image}
    if command is not None:
        spec["command"] = command
    if args is not None:
        spec["args"] = args
    if isinstance(env, dict):
        spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
    elif env is not None:
        spec["env"] = env
    if gpus is not None:
        spec["resources"] = {"limits": {resource: gpus}}
    spec.update(extra)
    return spec


def pod(*containers: dict[str, Any], annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A Pod with the given containers."""
    metadata: dict[str, Any] = {"name": "p", "namespace": "default"}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {"containers": list(containers), **spec}}
