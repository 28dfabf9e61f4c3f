"""The extender's bind on the real control plane: it trusts only the API server.

Anyone who reaches the extender can POST to it. These tests do what such a client could: a forged
filter body followed by a bind, and a bind of a pod that is none of the extender's business. Each
checks the outcome in the API server: no GPU over its budget, no pod bound where it should not be.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from e2e import gpu_nodes, services
from e2e.scenario import ledger_from_api, private_node, require_extender, violations_on_own_nodes
from e2e.test_extender import add_nodes, settle, vllm_pod

pytestmark = pytest.mark.timeout(240)


def extender_post(cluster: Any, verb: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to the extender's ``verb`` over HTTPS, as kube-scheduler does; (status, JSON).

    The one place the tests reach the extender, so its TLS settings (a client certificate) are set once."""
    request = urllib.request.Request(
        f"{cluster.state.vramguard['extender']}/{verb}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, context=cluster.client_ssl_context(), timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def wired_scheduler(cluster: Any) -> str:
    """The scheduler profile that calls the extender in this cluster."""
    second = getattr(getattr(cluster, "config", None), "second_scheduler", False)
    return services.SECOND_SCHEDULER_NAME if second else "default-scheduler"


def test_forged_filter_body_then_bind_cannot_overcommit_a_gpu(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", gpus=1, replicas=4))
    held = vllm_pod("held", "0.5", unique)
    held["spec"]["schedulerName"] = wired_scheduler(cluster)
    core_v1.create_namespaced_pod(namespace, held)
    assert settle(core_v1, namespace, 1) == {"held": node}

    big = vllm_pod("big", "0.9", unique)
    big["spec"]["schedulerName"] = wired_scheduler(cluster)
    core_v1.create_namespaced_pod(namespace, big)  # the scheduler leaves it pending: 0.5 + 0.9 > 0.9
    real = cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/big")
    forged = json.loads(json.dumps(real))
    forged["spec"]["containers"][0]["args"][-1] = "0.05"  # same name and UID, a tenth of the claim
    status, answer = extender_post(cluster, "filter", {"Pod": forged, "NodeNames": [node]})
    assert status == 200 and answer["NodeNames"] == [node], answer

    status, answer = extender_post(cluster, "bind", {
        "PodName": "big", "PodNamespace": namespace, "PodUID": real["metadata"]["uid"], "Node": node,
    })
    assert status == 200 and "VRAM budget free" in answer["Error"], answer
    assert core_v1.read_namespaced_pod("big", namespace).spec.node_name is None
    state = ledger_from_api(cluster)
    assert violations_on_own_nodes(cluster, unique) == []  # other tests' nodes have their own states
    for row in state.ledger.usage(node):
        assert row.worst_bytes <= row.budget


def test_bind_refuses_a_cpu_pod_of_another_scheduler_onto_a_tainted_node(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    spec = private_node(gpu_nodes.time_sliced("tainted", "H100-80GB", gpus=1, replicas=4), unique)
    gpu_nodes.create_gpu_node(core_v1, spec)  # tainted: only this test's pods tolerate it
    web = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web"},
        # No scheduler serves this name: the pod stays pending unless someone binds it.
        "spec": {"schedulerName": f"other-{unique}", "containers": [{"name": "web", "image": "nginx"}]},
    }
    core_v1.create_namespaced_pod(namespace, web)
    uid = core_v1.read_namespaced_pod("web", namespace).metadata.uid
    cases = {
        "as-is": uid,
        "empty-uid": "",
        "other-uid": "0d0c4b8e-0000-4000-8000-000000000000",
    }
    for case, pod_uid in cases.items():
        status, answer = extender_post(cluster, "bind", {
            "PodName": "web", "PodNamespace": namespace, "PodUID": pod_uid, "Node": spec.name,
        })
        assert status == 200 and answer["Error"].startswith("refused: "), (case, answer)
    assert "belongs to scheduler" in extender_post(cluster, "bind", {
        "PodName": "web", "PodNamespace": namespace, "PodUID": uid, "Node": spec.name})[1]["Error"]
    time.sleep(1.0)  # a Binding created by mistake would show by now
    assert core_v1.read_namespaced_pod("web", namespace).spec.node_name is None


@pytest.mark.parametrize(
    "body",
    [
        {"Pod": {"metadata": [1, 2]}, "NodeNames": []},
        {"Pod": {"metadata": {"name": "p", "labels": {"vramguard.io/qos-class": {"a": 1}}}}, "NodeNames": []},
        {"Pod": {"metadata": {"name": "p", "labels": {"app": 7}}}, "NodeNames": []},
    ],
    ids=["metadata-list", "label-object", "label-number"],
)
def test_wrong_types_are_a_400_over_https(cluster: Any, body: dict[str, Any]) -> None:
    require_extender(cluster)
    for verb in ("filter", "prioritize"):
        status, answer = extender_post(cluster, verb, body)
        assert status == 400 and "Pod" in answer.get("error", ""), (verb, answer)
