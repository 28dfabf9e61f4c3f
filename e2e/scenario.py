"""Helpers for scenario tests that share the session cluster: private nodes, pinned pods, the ledger.

Each test creates GPU nodes tainted and labelled with its own id; its pods tolerate the taint and
select the label, so no other test's pod lands there and no test sees another's pods.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest

from e2e import gpu_nodes
from vramguard.cluster import ClusterState
from vramguard.lease import DEFAULT_AGENT_NAMESPACE
from vramguard.policy import default_policy

TEST_LABEL = "e2e.vramguard.io/test"
AGENT_LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{DEFAULT_AGENT_NAMESPACE}/leases"


def require_extender(cluster: Any) -> None:
    """Skip unless the vramguard extender is wired into ``cluster``."""
    if not getattr(cluster, "state", None) or "extender" not in (cluster.state.vramguard or {}):
        pytest.skip("the vramguard extender is not wired into this cluster")


def private_node(spec: gpu_nodes.GPUNodeSpec, unique: str) -> gpu_nodes.GPUNodeSpec:
    """``spec`` renamed with the test's id, labelled and tainted so only its pods can use it."""
    return dataclasses.replace(
        spec,
        name=f"{spec.name}-{unique}",
        extra_labels={TEST_LABEL: unique},
        taints=({"key": TEST_LABEL, "value": unique, "effect": "NoSchedule"},),
    )


def pin_to_test(spec: dict[str, Any], unique: str) -> dict[str, Any]:
    """A pod spec that selects, and tolerates, the test's private nodes."""
    return {
        **spec,
        "nodeSelector": {TEST_LABEL: unique},
        "tolerations": [{"key": TEST_LABEL, "operator": "Equal", "value": unique, "effect": "NoSchedule"}],
    }


def pinned_vllm_pod(
    name: str, unique: str, utilization: str = "0.30", annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """A one-GPU vLLM pod at ``utilization`` that runs only on the test's private nodes."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": pin_to_test({
            "containers": [{
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.21.0",
                "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", utilization],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }],
        }, unique),
    }


def violations_on_own_nodes(cluster: Any, unique: str) -> list[str]:
    """The ledger rebuilt from the API server alone, checked against the rule, on the nodes of the
    test named by ``unique`` (other tests' nodes share the control plane, with their own states)."""
    return [v for v in ledger_from_api(cluster).ledger.check_invariants() if unique in v]


def ledger_from_api(cluster: Any) -> ClusterState:
    """The ledger rebuilt from the API server alone, as a restarted extender would build it."""
    state = ClusterState(default_policy())
    state.leases.replace(cluster.request("GET", AGENT_LEASES)["items"])
    state.nodes.replace(cluster.request("GET", "/api/v1/nodes")["items"])
    state.namespaces.replace(cluster.request("GET", "/api/v1/namespaces")["items"])
    # Every pod, as the webhook's feed: the model's ledger keeps the bound, live GPU pods among them.
    state.pods.replace(cluster.request("GET", "/api/v1/pods")["items"])
    return state


def wait_for(what: str, check: Callable[..., Any], timeout: float = 60.0, interval: float = 0.25) -> Any:
    """``check()``'s first truthy answer, polled every ``interval`` seconds; fails the test after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
