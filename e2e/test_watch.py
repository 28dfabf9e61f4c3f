"""Watch events over the extender's size limit, on the real control plane.

The extender runs with ``--max-watch-event-bytes 256Ki``; a bound GPU pod carries an annotation of
80,000 ``<`` characters, which the API server escapes to ``\\u003c`` (480 KB on the wire). Such an
event is never decoded and never skipped: it forces a re-list. The extender must stay ready, count
the event, and still release the VRAM of the pod when it is deleted (its DELETED event is just as
oversized), so that a later pod fits where the deleted one was.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import build, gpu_nodes
from e2e.cluster import Cluster
from e2e.procs import http_status
from e2e.scenario import pinned_vllm_pod, private_node

pytestmark = pytest.mark.timeout(300)

EVENT_LIMIT = "256Ki"
BLOB = "<" * 80_000
"""Under the API server's 256 KiB limit on annotations; escaped six-fold, over the extender's limit."""


@pytest.fixture(scope="module")
def small_limit_cluster(
    local_control_plane: build.Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A control plane of its own whose extender reads watch events of at most 256 KiB."""
    cluster = Cluster.up(
        tmp_path_factory.mktemp("watch-limit"),
        vramguard="on",
        service_args={"extender": ["--max-watch-event-bytes", EVENT_LIMIT]},
    )
    try:
        yield cluster
    finally:
        cluster.down()


def extender_get(cluster: Cluster, path: str) -> str:
    """GET a path of the extender's operational port (``/metrics``)."""
    with urllib.request.urlopen(cluster.ops_url("extender") + path, timeout=5) as response:
        body: bytes = response.read()
        return body.decode()


def metric(cluster: Cluster, name: str, **labels: str) -> float:
    """The value of one sample of the extender's metrics (0 when absent)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    selector = re.escape("{" + wanted + "}") if labels else ""
    pattern = re.compile(rf"^{re.escape(name)}{selector} (\S+)$", re.MULTILINE)
    match = pattern.search(extender_get(cluster, "/metrics"))
    return float(match.group(1)) if match else 0.0


def wait_for(what: str, probe: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def node_of(core_v1: Any, namespace: str, name: str) -> str | None:
    node: str | None = core_v1.read_namespaced_pod(name, namespace).spec.node_name
    return node


def test_oversized_watch_events_force_a_relist_and_deleted_pods_still_free_their_vram(
    small_limit_cluster: Cluster, unique: str
) -> None:
    cluster = small_limit_cluster
    core_v1 = cluster.core_v1()
    namespace = f"e2e-watch-{unique}"
    core_v1.create_namespace({"metadata": {"name": namespace}})
    node = private_node(gpu_nodes.time_sliced("h100", "H100-80GB", gpus=1, replicas=4), unique)
    gpu_nodes.create_gpu_node(core_v1, node)
    ready_url = cluster.ops_url("extender") + "/readyz"
    wait_for("the extender to know the node",
             lambda: metric(cluster, "vramguard_node_budget_bytes", node=node.name,
                            product="NVIDIA H100 80GB HBM3") > 0)
    before = metric(cluster, "vramguard_watch_oversized_events_total", resource="pods")

    # 1. A bound GPU pod whose watch events are over the limit: counted, re-listed, still held.
    core_v1.create_namespaced_pod(namespace, pinned_vllm_pod("big", unique, "0.6", {"note": BLOB}))
    wait_for("big to be bound", lambda: node_of(core_v1, namespace, "big") == node.name)
    wait_for("the oversized event to be counted",
             lambda: metric(cluster, "vramguard_watch_oversized_events_total", resource="pods") > before)
    assert metric(cluster, "vramguard_watch_restarts_total", resource="pods", reason="oversized") >= 1
    wait_for("the extender to be ready again", lambda: http_status(ready_url) == 200)
    assert metric(cluster, "vramguard_watch_healthy", resource="pods") == 1
    reserved = {"node": node.name, "product": "NVIDIA H100 80GB HBM3"}
    wait_for("the re-list to end", lambda: metric(cluster, "vramguard_nodes_held_back") == 0)
    # The ledger's series are rendered every few seconds, off the request path: waited for, not read at once.
    wait_for("big's VRAM to be held after the re-list",
             lambda: metric(cluster, "vramguard_node_reserved_bytes", **reserved) > 0)

    # 2. Deleting it (an oversized DELETED event) still frees its VRAM: a later pod fits.
    counted = metric(cluster, "vramguard_watch_oversized_events_total", resource="pods")
    core_v1.delete_namespaced_pod("big", namespace, grace_period_seconds=0)
    wait_for("the DELETED event to be counted",
             lambda: metric(cluster, "vramguard_watch_oversized_events_total", resource="pods") > counted)
    wait_for("big's VRAM to be released", lambda: metric(cluster, "vramguard_node_reserved_bytes", **reserved) == 0)
    core_v1.create_namespaced_pod(namespace, pinned_vllm_pod("later", unique, "0.6"))
    wait_for("later to be bound where big was", lambda: node_of(core_v1, namespace, "later") == node.name)
    assert http_status(ready_url) == 200
    core_v1.delete_namespace(namespace)
    gpu_nodes.delete_nodes(core_v1, [node.name])
