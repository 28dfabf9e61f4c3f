"""Class rules in the extender follow the namespace's enforcement mode; findings are recorded at bind."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extender.findings import EVENT_REASON, FindingsReporter
from tests.builders import gpu_node, vllm_pod
from tests.test_extender import FakeKube, make
from vramguard.codecs import CLASS_FINDINGS_ANNOTATION as FINDINGS_ANNOTATION
from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL


class EventKube(FakeKube):
    """Also accepts Events, as the API server does."""

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        if path.endswith("/events"):
            self.calls.append(("POST", path, body))
            return {}
        return await super().create(path, body)


def mig_node(name: str) -> dict[str, Any]:
    labels = {
        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "0", "nvidia.com/gpu.memory": "40960",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig-1g.10gb.count": "3", "nvidia.com/mig-1g.10gb.memory": "9728",
    }
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/mig-1g.10gb": "3"}
    return {"metadata": {"name": name, "labels": labels}, "status": {"capacity": capacity, "allocatable": capacity}}


def mig_pod(name: str) -> dict[str, Any]:
    pod = vllm_pod(name, "0.8")
    resources = pod["spec"]["containers"][0]["resources"]
    resources["limits"] = {"nvidia.com/mig-1g.10gb": "1"}
    resources.pop("requests", None)
    return pod


def setup(mode: str | None, qos: str | None) -> tuple[Any, Any, EventKube, CollectorRegistry]:
    state, verbs, _ = make([gpu_node("whole", gpus=8, replicas=1, sharing="none"), mig_node("mig")])
    labels = {k: v for k, v in ((ENFORCE_LABEL, mode), (QOS_CLASS_LABEL, qos)) if v is not None}
    state.namespaces.replace([{"metadata": {"name": "default", "labels": labels}}])
    fake = EventKube(state, {})
    verbs.client = fake
    registry = CollectorRegistry()
    verbs.findings = FindingsReporter(fake, registry)  # type: ignore[arg-type]
    return state, verbs, fake, registry


CASES = [
    # mode, class, whole-GPU pod's outcome, MIG pod's outcome, events
    pytest.param(None, None, "whole", "mig", 0, id="shipped-policy-places-everything"),
    pytest.param("enforce", None, "whole", "mig", 0, id="default-class-allows-them-even-in-enforce"),
    pytest.param("audit", "shared", "whole", "mig", 0, id="audit-records-no-event"),
    pytest.param("warn", "shared", "whole", "mig", 2, id="warn-one-event-per-pod"),
    pytest.param("enforce", "shared", "refused", "refused", 0, id="enforce-refuses"),
]


@pytest.mark.parametrize(("mode", "qos", "whole", "mig", "events"), CASES)
async def test_class_rules_follow_the_mode(mode: str | None, qos: str | None, whole: str, mig: str,
                                           events: int) -> None:
    _, verbs, fake, registry = setup(mode, qos)
    training = vllm_pod("train", "0.9", gpus=8)
    outcomes = []
    for pod, node in ((training, "whole"), (mig_pod("infer"), "mig")):
        fake.pods[pod["metadata"]["name"]] = pod
        outcome = await verbs.filter(pod, ["whole", "mig"])
        if node not in outcome.passing:
            assert "class shared does not allow" in outcome.unresolvable[node]
            outcomes.append("refused")
            continue
        assert await verbs.bind(pod["metadata"]["name"], "default", pod["metadata"]["uid"], node) == ""
        outcomes.append(node)
        annotations = pod["metadata"]["annotations"]
        if qos == "shared":
            (finding,) = json.loads(annotations[FINDINGS_ANNOTATION])
            assert finding["rule"] == "class-rule" and finding["class"] == "shared"
        else:
            assert FINDINGS_ANNOTATION not in annotations
    assert outcomes == [whole, mig]
    posted = [body for _, path, body in fake.calls if path.endswith("/events")]
    assert len(posted) == events
    assert all(e["reason"] == EVENT_REASON and e["type"] == "Warning" for e in posted)
    counted = registry.get_sample_value("vramguard_extender_class_findings_total",
                                        {"rule": "class-rule", "mode": mode or "audit"})
    assert (counted or 0) == (2 if qos == "shared" and mode != "enforce" else 0)


async def test_over_budget_is_refused_in_audit_mode() -> None:
    _, verbs, fake, _ = setup("audit", "shared")
    pods = [mig_pod(f"p{i}") for i in range(4)]  # three 1g.10gb instances
    placed = []
    for pod in pods:
        fake.pods[pod["metadata"]["name"]] = pod
        outcome = await verbs.filter(pod, ["mig"])
        if outcome.passing:
            assert await verbs.bind(pod["metadata"]["name"], "default", pod["metadata"]["uid"], "mig") == ""
            fake.deliver(pod["metadata"]["name"])
            placed.append(pod["metadata"]["name"])
    assert placed == ["p0", "p1", "p2"]
