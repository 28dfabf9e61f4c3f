"""A record kept in one ConfigMap's data key, written over the ``resourceVersion`` it was read at:
of two writers at once the API server lets one through and answers the other 409 (a conflict)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramguard.io.kube import ApiError, KubeClient, object_path

CONFIGMAPS = "/api/v1/configmaps"


@dataclass(frozen=True, slots=True)
class StoredText:
    """A record's text as read (``None``: no ConfigMap, or no such key) and the version to write over
    (``None``: the ConfigMap does not exist yet)."""

    text: str | None
    version: str | None


class ConfigRecord:
    """Reads and writes data key ``key`` of ConfigMaps in ``namespace``."""

    def __init__(self, client: KubeClient, namespace: str, key: str, labels: dict[str, str]) -> None:
        self.client = client
        self.namespace = namespace
        self.key = key
        self.labels = labels

    def path(self, name: str) -> str:
        """The ConfigMap's API path."""
        return object_path(CONFIGMAPS, self.namespace, name)

    async def read(self, name: str) -> StoredText:
        """The record; an empty one when there is none. :class:`ApiError` when unreadable."""
        try:
            obj = await self.client.get(self.path(name))
        except ApiError as exc:
            if exc.status == 404:
                return StoredText(None, None)
            raise
        version = (obj.get("metadata") or {}).get("resourceVersion")
        text = (obj.get("data") or {}).get(self.key)
        return StoredText(text if isinstance(text, str) else None, version if isinstance(version, str) else None)

    async def write(
        self, name: str, version: str | None, text: str, annotations: dict[str, str] | None = None
    ) -> str | None:
        """Replace the record read at ``version`` (``None``: create it) with ``text``; the version it
        was stored at (``""`` when the answer has none), ``None`` on a conflict (written meanwhile:
        read again). :class:`ApiError` for any other failure."""
        metadata: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": dict(self.labels)}
        if annotations:
            metadata["annotations"] = annotations
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                                "data": {self.key: text}}
        try:
            if version is None:
                stored = await self.client.create(object_path(CONFIGMAPS, self.namespace, "").rstrip("/"), body)
            else:
                metadata["resourceVersion"] = version
                stored = await self.client.replace(self.path(name), body)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise
        written = (stored.get("metadata") or {}).get("resourceVersion") if isinstance(stored, dict) else None
        return written if isinstance(written, str) else ""
