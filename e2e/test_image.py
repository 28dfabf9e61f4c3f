"""The services run from the built image, as the shipped manifests run them.

A cluster of this module's own runs the extender and the webhook as containers of
``$VRAMGUARD_IMAGE`` (``make image`` builds it; ``scripts/image.sh env`` prints the variables)
with host network, a read-only root, user 65532, no capabilities, the TLS Secret and the policy
ConfigMap mounted as files (see ``e2e.containers``). On it: the seed's scenario (what fits is
bound, the rest stays Pending) and a webhook denial.

Skipped without the image or a container engine; in CI (``CI=true``) a skip is a failure, since CI
builds the image first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import containers, demo, gpu_nodes, kube, services
from e2e.cluster import Cluster
from e2e.test_webhook import BAD_UTILIZATION, Namespace, denial, pod, vllm_container


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def image() -> str:
    """The image under test; skipped (failed in CI) when it is not there."""
    image = containers.image_from_environment()
    reason = None
    if image is None:
        reason = f"${containers.IMAGE_ENV} is not set (make image-e2e, or env $(scripts/image.sh env) pytest ...)"
    elif not containers.image_present(image):
        reason = f"no image {image} in {containers.engine()} (make image)"
    if reason is not None:
        if _in_ci():
            pytest.fail(f"CI must run the image e2e: {reason}")
        pytest.skip(reason)
    assert image is not None
    return image


@pytest.fixture(scope="module")
def image_cluster(
    image: str, local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A control plane whose extender and webhook run as containers of ``image``."""
    cluster = Cluster.up(
        tmp_path_factory.mktemp("image-cluster"), kube_version=local_control_plane.version, vramguard="on", image=image
    )
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.mark.parametrize("service", ["extender", "webhook"])
def test_service_runs_as_the_chart_runs_it(image_cluster: Cluster, service: services.ServiceName) -> None:
    name = containers.container_name(service, image_cluster.directory)
    inspected = containers.inspect(name)
    host = inspected["HostConfig"]
    assert inspected["State"]["Running"]
    assert host["ReadonlyRootfs"] is True
    assert host["NetworkMode"] == "host"
    # What the service process itself runs with: non-root, no capabilities at all, no new privileges.
    status = containers.main_process_status(name)
    assert status["Uid"].split() == ["65532"] * 4
    assert status["Gid"].split() == ["65532"] * 4
    assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"] == "1"
    mounts = {mount["Destination"]: mount for mount in inspected["Mounts"]}
    for target in (containers.TLS_MOUNT, containers.POLICY_MOUNT):
        assert not mounts[target]["RW"], f"{target} is mounted read-only"
    shipped = containers.shipped_container(service)
    args = inspected["Config"]["Cmd"]
    assert args[0] == service
    # Everything the manifest passes, but the listen addresses, is passed as shipped.
    kept = [arg for arg in shipped["args"] if not arg.startswith(("--listen=", "--ops-listen="))]
    assert [arg for arg in args if arg in kept] == kept


def test_seed_scenario_places_what_fits(image_cluster: Cluster) -> None:
    core = image_cluster.core_v1()
    gpu_nodes.create_gpu_node(core, demo.NODE)
    try:
        assert demo.act(image_cluster, "Act 1", "0.20") == 4
        time.sleep(1.0)  # let the deletions reach the extender's watch
        assert demo.act(image_cluster, "Act 2", "0.30") == 3
    finally:
        gpu_nodes.delete_nodes(core, [demo.NODE.name])


@pytest.fixture
def enforced(image_cluster: Cluster, unique: str) -> Iterator[Namespace]:
    """A namespace where the webhook enforces; removed afterwards."""
    created = Namespace(image_cluster, f"image-enforce-{unique}", {"vramguard.io/enforce": "enforce"})
    yield created
    created.cleanup()


def test_webhook_in_the_image_refuses_an_invalid_pod(enforced: Namespace) -> None:
    with pytest.raises(kube.api_exception()) as refused:
        enforced.create_pod(pod("bad", vllm_container("1.5")))
    assert denial(refused.value) == f'admission webhook "pods.vramguard.io" denied the request: {BAD_UTILIZATION}'
