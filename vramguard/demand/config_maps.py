"""ConfigMaps of the same input, given to a pod's containers as the kubelet gives them.

A manifest often keeps the engine's settings or its start script in a ConfigMap beside the
workload: ``envFrom: [{configMapRef: ...}]``, ``valueFrom: {configMapKeyRef: ...}``, or a ConfigMap
volume holding ``start.sh`` that ``command: [bash, /scripts/start.sh]`` runs. When that ConfigMap is
in the input (``vramguard explain -f dir/``), its values are read as the container will see them:

- ``envFrom`` (with its ``prefix``) becomes ``env`` entries before the container's own, which win,
  as in Kubernetes; ``configMapKeyRef`` becomes the key's value;
- a ConfigMap volume (or a ``projected`` volume's ConfigMap sources), with its ``items``, gives the
  container a file at each path it mounts (``subPath`` included), which a shell runs, sources or
  executes (:attr:`vramguard.demand.commandline.ContainerEnv.files`).

A reference to a ConfigMap that is not in the input stays as it was: opaque, as the services see it.
Only the CLI reads this: the admission webhook and the extender never see ConfigMaps' data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vramguard.demand.shell_syntax import NAME

__all__ = ["ConfigMaps", "config_maps", "with_config_maps"]

ConfigMaps = Mapping[tuple[str, str], Mapping[str, str]]
"""``(namespace, name)`` -> the ConfigMap's ``data``."""
CONTAINER_LISTS = ("initContainers", "containers")


def config_maps(objects: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
    """The ``data`` of every ConfigMap among ``objects``, by namespace (``default`` when unset) and name."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    for obj in objects:
        metadata = obj.get("metadata")
        data = obj.get("data")
        if obj.get("kind") != "ConfigMap" or not isinstance(metadata, Mapping) or not isinstance(data, Mapping):
            continue
        name = metadata.get("name")
        if isinstance(name, str):
            namespace = metadata.get("namespace")
            key = (namespace if isinstance(namespace, str) and namespace else "default", name)
            found[key] = {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
    return found


def with_config_maps(
    template: Mapping[str, Any], namespace: str, maps: ConfigMaps
) -> tuple[Mapping[str, Any], dict[str, dict[str, str]]]:
    """``template`` with the environment its ConfigMaps give, and the files each container sees (by
    container name, then path). Unchanged, with no files, when it references none of ``maps``."""
    spec = template.get("spec")
    if not maps or not isinstance(spec, Mapping):
        return template, {}
    volumes = _volume_files(spec.get("volumes"), namespace, maps)
    files: dict[str, dict[str, str]] = {}
    changed: dict[str, list[Any]] = {}
    for key in CONTAINER_LISTS:
        entries = spec.get(key)
        if not isinstance(entries, list):
            continue
        rewritten = [_with_env(c, namespace, maps) if isinstance(c, Mapping) else c for c in entries]
        if any(new is not old for new, old in zip(rewritten, entries, strict=True)):
            changed[key] = rewritten
        for container in entries:
            if isinstance(container, Mapping) and isinstance(container.get("name"), str):
                seen = _mounted(container, volumes)
                if seen:
                    files[container["name"]] = seen
    if not changed:
        return template, files
    return {**template, "spec": {**spec, **changed}}, files


def _with_env(container: Mapping[str, Any], namespace: str, maps: ConfigMaps) -> Mapping[str, Any]:
    """The container with the variables of known ConfigMaps written as literal ``env`` entries."""
    env_from = container.get("envFrom") if isinstance(container.get("envFrom"), list) else []
    env = container.get("env") if isinstance(container.get("env"), list) else []
    assert isinstance(env_from, list) and isinstance(env, list)
    kept: list[Any] = []
    given: list[dict[str, str]] = []
    for source in env_from:
        ref = source.get("configMapRef") if isinstance(source, Mapping) else None
        data = _data(ref, namespace, maps)
        if data is None:
            kept.append(source)
            continue
        prefix = source.get("prefix") if isinstance(source.get("prefix"), str) else ""
        given.extend({"name": prefix + k, "value": v} for k, v in data.items() if NAME.fullmatch(prefix + k))
    resolved = [_literal(entry, namespace, maps) for entry in env]
    if not given and all(new is old for new, old in zip(resolved, env, strict=True)):
        return container
    updated = {**container, "env": [*given, *resolved]}
    if len(kept) != len(env_from):
        updated["envFrom"] = kept
    return updated


def _literal(entry: Any, namespace: str, maps: ConfigMaps) -> Any:
    """An ``env`` entry set from a known ConfigMap's key, as a literal; any other entry unchanged."""
    source = entry.get("valueFrom") if isinstance(entry, Mapping) else None
    ref = source.get("configMapKeyRef") if isinstance(source, Mapping) else None
    data = _data(ref, namespace, maps)
    key = ref.get("key") if isinstance(ref, Mapping) else None
    if data is None or not isinstance(key, str) or key not in data:
        return entry  # a missing key keeps the container from starting: nothing to read
    return {"name": entry.get("name"), "value": data[key]}


def _data(ref: Any, namespace: str, maps: ConfigMaps) -> Mapping[str, str] | None:
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str):
        return None
    return maps.get((namespace, ref["name"]))


def _volume_files(volumes: Any, namespace: str, maps: ConfigMaps) -> dict[str, dict[str, str]]:
    """By volume name, the files a ConfigMap or projected volume of known ConfigMaps holds."""
    found: dict[str, dict[str, str]] = {}
    for volume in volumes if isinstance(volumes, list) else []:
        if not isinstance(volume, Mapping) or not isinstance(volume.get("name"), str):
            continue
        projected = volume.get("projected")
        sources = [volume.get("configMap")]
        if isinstance(projected, Mapping) and isinstance(projected.get("sources"), list):
            sources.extend(s.get("configMap") for s in projected["sources"] if isinstance(s, Mapping))
        files: dict[str, str] = {}
        for source in sources:
            data = _data(source, namespace, maps)
            if data is None:
                continue
            assert isinstance(source, Mapping)
            items = source.get("items")
            if isinstance(items, list) and items:
                for item in items:
                    if isinstance(item, Mapping) and item.get("key") in data and isinstance(item.get("path"), str):
                        files[item["path"]] = data[item["key"]]
            else:
                files.update(data)
        if files:
            found[volume["name"]] = files
    return found


def _mounted(container: Mapping[str, Any], volumes: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The files a container sees at its mounts of ``volumes``, by absolute path, and by path
    relative to its ``workingDir`` (``start.sh``, ``./start.sh``)."""
    files: dict[str, str] = {}
    mounts = container.get("volumeMounts")
    for mount in mounts if isinstance(mounts, list) else []:
        if not isinstance(mount, Mapping) or not isinstance(mount.get("mountPath"), str):
            continue
        volume = volumes.get(str(mount.get("name")))
        if volume is None:
            continue
        path = mount["mountPath"].rstrip("/") or "/"
        sub = mount.get("subPath")
        if isinstance(sub, str) and sub:
            if sub in volume:
                files[path] = volume[sub]
            continue
        for relative, text in volume.items():
            files[f"{path.rstrip('/')}/{relative}"] = text
    working = container.get("workingDir")
    if isinstance(working, str) and working.startswith("/"):
        base = working.rstrip("/") + "/"
        for path, text in list(files.items()):
            if path.startswith(base):
                files.setdefault(path[len(base):], text)
                files.setdefault("./" + path[len(base):], text)
    return files
