"""Fixtures for the end-to-end suite: one real control plane per test session.

Run against a local control plane built from source (the default)::

    .venv/bin/python -m pytest e2e

or against an existing cluster, e.g. kind (see e2e/kind/README.md)::

    .venv/bin/python -m pytest e2e --kubeconfig ~/.kube/config

The control plane is built before the first test runs (outside the per-test timeout); a cold
build takes minutes, a cached one nothing.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import build, karpenter
from e2e.cluster import Cluster, ExistingCluster, VramguardMode

E2E_DIR = Path(__file__).resolve().parent
LOCAL_CLUSTER_FIXTURES = frozenset({"cluster", "control_plane", "local_control_plane"})


def pytest_addoption(parser: pytest.Parser) -> None:
    """Options of the e2e suite (all in the ``vramguard e2e`` group)."""
    group = parser.getgroup("vramguard-e2e", "vramguard end-to-end tests")
    group.addoption(
        "--kubeconfig",
        dest="e2e_kubeconfig",
        default=None,
        help="run the e2e tests against the cluster of this kubeconfig instead of starting one",
    )
    group.addoption(
        "--e2e-kube-version",
        dest="e2e_kube_version",
        default=None,
        help="Kubernetes version or minor for the local control plane (default $KUBE_VERSION or 1.36)",
    )
    group.addoption(
        "--e2e-default-scheduler",
        dest="e2e_default_scheduler",
        action="store_true",
        help="wire the extender into the session cluster's default scheduler (default: the layout the "
        "chart installs, a second scheduler named 'vramguard' that the mutating webhook routes GPU pods to)",
    )
    group.addoption(
        "--e2e-no-vramguard",
        dest="e2e_no_vramguard",
        action="store_true",
        help="do not start the vramguard extender and webhook even if they are available",
    )


def _uses_local_cluster(item: pytest.Item) -> bool:
    return E2E_DIR in Path(str(item.path)).resolve().parents and bool(
        LOCAL_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the control plane once collection shows it is needed, before any test timeout runs."""
    config = session.config
    if config.getoption("collectonly") or not any(_uses_local_cluster(item) for item in session.items):
        return
    if config.getoption("e2e_kubeconfig") and not any(
        "local_control_plane" in getattr(item, "fixturenames", ()) for item in session.items
    ):
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    # A cold build takes minutes: show its progress instead of capturing it.
    suspended = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with suspended:
            build.ensure_built(config.getoption("e2e_kube_version"))
            if any("karpenter_build" in getattr(item, "fixturenames", ()) for item in session.items):
                karpenter.ensure_built()
    except build.BuildError as error:
        raise pytest.UsageError(f"cannot build the Kubernetes control plane or Karpenter for the e2e tests: "
                                f"{error}") from error


def _session_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str, vramguard: VramguardMode
) -> Iterator[Any]:
    kubeconfig = request.config.getoption("e2e_kubeconfig")
    if kubeconfig:
        yield ExistingCluster(Path(kubeconfig).expanduser(), request.config.getoption("e2e_kube_version"))
        return
    local = Cluster.up(
        tmp_path_factory.mktemp(name),
        kube_version=request.config.getoption("e2e_kube_version"),
        second_scheduler=not request.config.getoption("e2e_default_scheduler"),
        vramguard=vramguard,
    )
    try:
        yield local
    finally:
        local.down()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The cluster with vramguard wired in (each service whose ``--help`` works), for the session.

    With ``--kubeconfig`` it is that existing cluster instead.
    """
    vramguard: VramguardMode = "off" if request.config.getoption("e2e_no_vramguard") else "auto"
    yield from _session_cluster(request, tmp_path_factory, "cluster", vramguard)


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A cluster without vramguard, for tests of the control plane itself (the smoke tests).

    With ``--kubeconfig`` it is that existing cluster instead.
    """
    yield from _session_cluster(request, tmp_path_factory, "control-plane", "off")


@pytest.fixture(scope="session")
def local_control_plane(request: pytest.FixtureRequest) -> build.Binaries:
    """The built binaries, for tests that start clusters of their own (skipped with --kubeconfig)."""
    if request.config.getoption("e2e_kubeconfig"):
        pytest.skip("starts its own control plane; not run against --kubeconfig clusters")
    return build.ensure_built(request.config.getoption("e2e_kube_version"))


@pytest.fixture(scope="session")
def karpenter_build(local_control_plane: build.Binaries) -> karpenter.KarpenterBuild:
    """Karpenter's kwok provider, built from source (built at collection when a test needs it)."""
    return karpenter.ensure_built()


@pytest.fixture(scope="session")
def core_v1(cluster: Any) -> Any:
    """``kubernetes.client.CoreV1Api`` on ``cluster``, as the admin."""
    return cluster.core_v1()


@pytest.fixture
def unique() -> str:
    """A short random suffix for object names, so tests never collide."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def namespace(core_v1: Any, unique: str) -> Iterator[str]:
    """A namespace of the test's own, deleted afterwards."""
    name = f"e2e-{unique}"
    core_v1.create_namespace({"metadata": {"name": name}})
    yield name
    core_v1.delete_namespace(name)
