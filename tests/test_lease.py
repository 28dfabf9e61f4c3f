"""The agent's Lease decides whether its report is trusted: stale or missing -> the conservative rule."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from vramguard.cluster import ClusterState
from vramguard.codecs import AGENT_REPORT_ANNOTATION, agent_lease_name
from vramguard.lease import (
    AgentLease,
    distrust_reason,
    format_micro_time,
    lease_body,
    parse_lease,
    parse_micro_time,
)
from vramguard.placement import describe_fit
from vramguard.policy import default_policy

NOW = 1_790_000_000.0  # 2026-09-21T...
NAMESPACE = "vramguard-system"
H100_MIB = 81559


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def lease(node: str, renewed: float, duration: int = 40, namespace: str = NAMESPACE) -> dict[str, Any]:
    return lease_body(namespace, node, f"vramguard-agent-{node}-x1", duration, renewed)


@pytest.mark.parametrize(
    ("lease_obj", "reason"),
    [
        pytest.param(AgentLease("l", "a", NOW - 10, 40), None, id="fresh"),
        pytest.param(None, "agent report not trusted: no agent lease ns/l", id="missing"),
        pytest.param(AgentLease("l", "a", NOW - 40, 40),
                     f"agent report stale: lease ns/l expired at {format_micro_time(NOW)[:19]}Z", id="expired-now"),
        pytest.param(AgentLease("l", "a", None, 40),
                     "agent report not trusted: lease ns/l has no renewTime or leaseDurationSeconds", id="no-renew"),
        pytest.param(AgentLease("l", "a", NOW, None),
                     "agent report not trusted: lease ns/l has no renewTime or leaseDurationSeconds",
                     id="no-duration"),
        pytest.param(AgentLease("l", "a", NOW + 3600, 40),
                     f"agent report not trusted: lease ns/l renewed in the future ({format_micro_time(NOW + 3600)})",
                     id="renewed-in-the-future"),
    ],
)
def test_distrust_reason(lease_obj: AgentLease | None, reason: str | None) -> None:
    assert distrust_reason(lease_obj, "ns/l", NOW) == reason


@pytest.mark.parametrize(
    ("obj", "parsed"),
    [
        pytest.param(lease("n", NOW), AgentLease("vramguard-agent-n", "vramguard-agent-n-x1", NOW, 40), id="agent"),
        pytest.param({"metadata": {"name": "x"}, "spec": {"renewTime": "yesterday", "leaseDurationSeconds": True}},
                     AgentLease("x", None, None, None), id="junk-fields"),
        pytest.param({"metadata": {"name": "x"}, "spec": {"renewTime": "2026-01-01T00:00:00", "holderIdentity": 7,
                                                          "leaseDurationSeconds": -5}},
                     AgentLease("x", None, None, None), id="naive-time-negative-duration"),
        pytest.param({"metadata": {}}, None, id="no-name"),
        pytest.param({"metadata": {"name": "x"}, "spec": "junk"}, AgentLease("x", None, None, None), id="spec-junk"),
    ],
)
def test_parse_lease(obj: dict[str, Any], parsed: AgentLease | None) -> None:
    assert parse_lease(obj) == parsed


def test_lease_names_and_times() -> None:
    assert agent_lease_name("gpu-1") == "vramguard-agent-gpu-1"
    long = agent_lease_name("n" * 253)
    assert len(long) == 253 and long != agent_lease_name("n" * 252 + "m")
    assert parse_micro_time(format_micro_time(NOW + 0.25)) == NOW + 0.25
    assert parse_micro_time("x" * 100) is None


# -- the cluster model -----------------------------------------------------------------------------


def report_node(name: str, uids: dict[str, str]) -> dict[str, Any]:
    """Two H100s with 4 time-slicing replicas each; the agent reports which GPU each pod got."""
    placements = {uid: {"vllm": [gpu]} for uid, gpu in uids.items()}
    report = {"version": 1, "gpus": [{"id": "0"}, {"id": "1"}], "pods": placements}
    return {
        "metadata": {
            "name": name,
            "labels": {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": str(H100_MIB),
                       "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.replicas": "4",
                       "nvidia.com/gpu.sharing-strategy": "time-slicing"},
            "annotations": {AGENT_REPORT_ANNOTATION: json.dumps(report)},
        },
        "status": {"allocatable": {"nvidia.com/gpu": "8"}},
    }


def vllm(uid: str, node: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": "ml"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
                            "args": ["--gpu-memory-utilization", "0.30"],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
        "status": {"phase": "Running"},
    }


def four_pods_state(clock: Clock) -> ClusterState:
    """p0, p1 reported on GPU 0, p2 on GPU 1: with the report a fourth 0.30 fits, without it not."""
    state = ClusterState(default_policy(), clock=clock)
    state.nodes.replace([report_node("n", {"p0": "0", "p1": "0", "p2": "1"})])
    state.pods.replace([vllm(f"p{i}", "n") for i in range(3)])
    return state


def fourth(state: ClusterState) -> tuple[bool, str]:
    pod = vllm("p3")
    claims = state.claims_for(pod, state.choose_class(pod)).claims
    fit = state.ledger.fits("n", claims)
    return fit.ok, describe_fit(fit, claims) if not fit.ok else ""


def test_a_fresh_lease_makes_the_report_count_and_its_expiry_falls_back_to_the_conservative_rule() -> None:
    clock = Clock()
    state = four_pods_state(clock)
    ok, message = fourth(state)
    assert not ok and "agent report not trusted: no agent lease vramguard-system/vramguard-agent-n" in message

    state.leases.replace([lease("n", NOW - 5)])
    assert fourth(state) == (True, "")

    clock.now = NOW + 35  # renewed at NOW - 5 for 40 s: expires at NOW + 35, with no event at all
    assert state.refresh_agent_reports() == ["n"]
    ok, message = fourth(state)
    assert not ok
    assert message.endswith(f"agent report stale: lease vramguard-system/vramguard-agent-n expired at "
                            f"{format_micro_time(NOW + 35)[:19]}Z")
    inventory = state.ledger.inventory("n")
    assert inventory is not None and inventory.placements == {} and inventory.distrust in inventory.notes

    state.leases.upsert(lease("n", clock.now))  # the agent is back
    assert fourth(state) == (True, "")
    assert state.refresh_agent_reports() == []  # nothing changed since


@pytest.mark.parametrize(
    ("change", "trusted"),
    [
        pytest.param(lambda s: s.leases.delete(lease("n", NOW)), False, id="lease-deleted"),
        pytest.param(lambda s: s.leases.upsert(lease("n", NOW, namespace="tenant")), True,
                     id="lease-of-another-namespace-ignored"),
        pytest.param(lambda s: s.leases.upsert(lease("other", NOW - 100)), True, id="another-node-lease"),
        pytest.param(lambda s: s.leases.replace([]), False, id="relist-without-it"),
    ],
)
def test_lease_events(change: Any, trusted: bool) -> None:
    state = four_pods_state(Clock())
    state.leases.replace([lease("n", NOW)])
    assert fourth(state)[0]
    change(state)
    assert fourth(state)[0] is trusted


def test_a_node_without_a_report_needs_no_lease() -> None:
    state = ClusterState(default_policy(), clock=Clock())
    node = report_node("n", {})
    del node["metadata"]["annotations"]
    state.nodes.replace([node])
    inventory = state.ledger.inventory("n")
    assert inventory is not None and inventory.distrust is None and inventory.notes == ()


def test_kubectl_vram_says_which_reports_it_set_aside() -> None:
    from vramguard.cli.kubectl_vram import ClusterSnapshot, build_state, report_notes  # noqa: PLC0415

    nodes = [report_node("fresh", {}), report_node("stale", {}), report_node("unleased", {})]
    now = time.time()
    leases = [lease("fresh", now), lease("stale", now - 3600)]
    notes = report_notes(build_state(ClusterSnapshot(nodes=nodes, leases=leases), default_policy()))
    assert [n.split(":")[0] for n in notes] == ["node stale", "node unleased"]
    assert "agent report stale: lease vramguard-system/vramguard-agent-stale expired at" in notes[0]
    assert notes[1].endswith("no agent lease vramguard-system/vramguard-agent-unleased; counted as if unreported")
