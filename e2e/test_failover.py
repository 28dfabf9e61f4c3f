"""Two extenders against one API server: one leader binds, a SIGKILLed leader is replaced.

The replicas sit behind a Service proxy that routes each new connection to a ready replica, as
kube-proxy does; only the leader is ready. Every check of the outcome is made on the API server's
objects alone (the ledger rebuilt from them), never on an extender's view.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.cluster import Cluster
from e2e.procs import http_status
from e2e.scenario import violations_on_own_nodes
from e2e.test_extender import add_nodes, create_all, vllm_pod
from extender.verbs import NOT_LEADER

pytestmark = pytest.mark.timeout(420)

NAMESPACE = "default"
LEASE = "/apis/coordination.k8s.io/v1/namespaces/vramguard-system/leases/vramguard-extender"
LEASE_DURATION = 15.0
RETRY_PERIOD = 2.0
# The earliest a standby serves when the leader dies without releasing the Lease: it waits the
# Lease out, then the takeover grace.
EXPIRY_TAKEOVER = 2 * LEASE_DURATION - 2 * RETRY_PERIOD


@pytest.fixture(scope="module")
def ha_cluster(local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster.up(tmp_path_factory.mktemp("ha"), kube_version=local_control_plane.version,
                         extender_replicas=2, service_args={"extender": ["--drain-delay", "2"]})
    try:
        yield cluster
    finally:
        cluster.down()


def replicas(cluster: Cluster) -> list[int]:
    """The replicas' indexes, the ready one (the leader) first."""
    ops = cluster.state.vramguard_ops if cluster.state else {}
    indexes = sorted(int(key.rpartition("-")[2]) for key in ops if key.startswith("extender-"))
    return sorted(indexes, key=lambda i: http_status(f"{ops[f'extender-{i}']}/readyz") != 200)


def ready(cluster: Cluster, replica: int) -> bool:
    assert cluster.state is not None
    return http_status(f"{cluster.state.vramguard_ops[f'extender-{replica}']}/readyz") == 200


def post(cluster: Cluster, replica: int, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST to one replica directly, with kube-scheduler's client certificate."""
    assert cluster.state is not None
    request = urllib.request.Request(f"{cluster.state.vramguard[f'extender-{replica}']}/{verb}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                     method="POST")
    with urllib.request.urlopen(request, context=cluster.client_ssl_context(), timeout=30) as response:
        answer: dict[str, Any] = json.load(response)
        return answer


def bound(core_v1: Any, prefix: str) -> dict[str, str | None]:
    return {p.metadata.name: p.spec.node_name for p in core_v1.list_namespaced_pod(NAMESPACE).items
            if p.metadata.name.startswith(prefix)}


def wait_bound(core_v1: Any, prefix: str, count: int, timeout: float) -> dict[str, str | None]:
    deadline = time.monotonic() + timeout
    while True:
        pods = bound(core_v1, prefix)
        if sum(1 for node in pods.values() if node) >= count or time.monotonic() > deadline:
            return pods
        time.sleep(0.25)


def test_only_the_leader_serves_and_a_killed_leader_is_replaced(ha_cluster: Cluster, unique: str) -> None:
    cluster = ha_cluster
    core_v1 = cluster.core_v1()
    leader, standby = replicas(cluster)
    assert ready(cluster, leader) and not ready(cluster, standby)
    holder = cluster.request("GET", LEASE)["spec"]["holderIdentity"]
    assert holder

    # The standby refuses the verbs, whatever a client sends it.
    pod = vllm_pod("probe", "0.3", unique)
    answer = post(cluster, standby, "filter", {"Pod": pod, "NodeNames": ["anything"]})
    assert answer["Error"] == NOT_LEADER
    answer = post(cluster, standby, "bind", {"PodName": "probe", "PodNamespace": NAMESPACE, "PodUID": "u",
                                             "Node": "anything"})
    assert answer["Error"] == NOT_LEADER

    # 4 GPUs time-sliced 4 ways: three 0.30 pods fit on each (0.90), twelve in all.
    add_nodes(core_v1, unique, *[gpu_nodes.time_sliced(f"g{i}", "H100-80GB", replicas=4) for i in range(4)])
    for i in range(8):
        core_v1.create_namespaced_pod(NAMESPACE, vllm_pod(f"w{i:02}-{unique}", "0.30", unique))
    wait_bound(core_v1, "w", 4, timeout=60)

    # SIGKILL the leader mid-wave: no release, the standby must wait the Lease out.
    [proc] = [p for p in cluster.processes if p.name == f"vramguard-extender-{leader}"]
    killed = time.monotonic()
    proc.send(signal.SIGKILL)
    for i in range(8, 16):
        core_v1.create_namespaced_pod(NAMESPACE, vllm_pod(f"w{i:02}-{unique}", "0.30", unique))
    while not ready(cluster, standby):
        assert time.monotonic() - killed < 3 * LEASE_DURATION + 30, "the standby never took over"
        time.sleep(0.2)
    took_over = time.monotonic() - killed
    new_holder = cluster.request("GET", LEASE)["spec"]["holderIdentity"]
    assert new_holder and new_holder != holder
    # The Lease is taken after 15 s unrenewed, then the takeover grace (15 s) lets the dead
    # leader's last Bindings arrive before the new leader places anything.
    print(f"failover: standby serving {took_over:.1f}s after the leader was SIGKILLed")
    # The standby saw the last renewal up to a retry period before the kill and tries every retry
    # period: without the grace it would serve after 13-17 s.
    assert took_over >= EXPIRY_TAKEOVER, took_over

    pods = wait_bound(core_v1, "w", 12, timeout=120)
    placed = sum(1 for node in pods.values() if node)
    print(f"bound {placed} of {len(pods)} pods, {time.monotonic() - killed:.1f}s after the kill")
    assert len(pods) == 16, "no pod lost"
    assert placed == 12, pods
    assert violations_on_own_nodes(cluster, unique) == []



def wait_leader(cluster: Cluster, timeout: float) -> tuple[int, float]:
    """The replica that becomes ready (the leader) and the seconds it took."""
    started = time.monotonic()
    while True:
        ranked = replicas(cluster)
        if ranked and ready(cluster, ranked[0]):
            return ranked[0], time.monotonic() - started
        assert time.monotonic() - started < timeout, "no replica became the leader"
        time.sleep(0.1)


def test_a_rolling_update_during_a_wave_of_200_pods_binds_every_fitting_pod(ha_cluster: Cluster, unique: str) -> None:
    cluster = ha_cluster
    core_v1 = cluster.core_v1()
    wait_leader(cluster, timeout=3 * LEASE_DURATION + 30)

    # 50 GPUs time-sliced 4 ways, 0.30 per pod: 3 pods per GPU, 150 of the 200 fit. (One GPU per
    # node: without an agent's report the pods' GPU on a node is unknown, so the rule assumes the
    # worst, all on one GPU.)
    add_nodes(core_v1, unique, *[gpu_nodes.time_sliced(f"r{i:02}", "H100-80GB", replicas=4) for i in range(50)])
    pods = [vllm_pod(f"roll{i:03}-{unique}", "0.30", unique) for i in range(200)]
    handovers = []
    with ThreadPoolExecutor(max_workers=1) as creator:
        wave = creator.submit(create_all, core_v1, NAMESPACE, pods)
        # Roll twice while the wave is created and scheduled: new replicas start, the old ones get
        # SIGTERM, drain for --drain-delay and release the Lease, as a Deployment's RollingUpdate does.
        for rolled in (30, 90):
            wait_bound(core_v1, "roll", rolled, timeout=120)
            stopped = time.monotonic()
            cluster.roll_extender()
            wait_leader(cluster, timeout=EXPIRY_TAKEOVER)
            handovers.append(time.monotonic() - stopped)
        wave.result(timeout=120)
    print("rolling update: new leader serving " + ", ".join(f"{h:.1f}s" for h in handovers)
          + " after the new replicas were started and the old ones got SIGTERM")
    # A released Lease is taken within a retry period, without waiting out the Lease and the
    # takeover grace (what a SIGKILLed leader costs, see above). The handover also counts starting
    # the new replicas and the old ones' drain, which take longer on a busy machine; that bound
    # separates the two paths whatever the load.
    assert all(h < EXPIRY_TAKEOVER for h in handovers), handovers

    placed = wait_bound(core_v1, "roll", 150, timeout=180)
    assert len(placed) == 200, "no pod lost"
    assert sum(1 for node in placed.values() if node) == 150, placed
    assert violations_on_own_nodes(cluster, unique) == []
