"""The ``kubernetes`` Python client, typed as ``Any`` at this boundary.

The client's own annotations are partial; the harness and tests treat its objects as dynamic.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any


def kubernetes_module() -> Any:
    """The ``kubernetes`` package (imported on first use: it is slow to import)."""
    return importlib.import_module("kubernetes")


def api_client(kubeconfig: Path) -> Any:
    """A ``kubernetes.client.ApiClient`` for ``kubeconfig`` (its current context)."""
    return kubernetes_module().config.new_client_from_config(config_file=str(kubeconfig))


def core_v1(client: Any) -> Any:
    """``kubernetes.client.CoreV1Api`` on ``client``."""
    return kubernetes_module().client.CoreV1Api(client)


def version_api(client: Any) -> Any:
    """``kubernetes.client.VersionApi`` on ``client`` (``GET /version``)."""
    return kubernetes_module().client.VersionApi(client)


def api_exception() -> type[Exception]:
    """``kubernetes.client.exceptions.ApiException`` (for ``except`` clauses)."""
    exception: type[Exception] = kubernetes_module().client.exceptions.ApiException
    return exception
