"""The benchmark's synthetic cluster: realistic variety of pod templates, no GPU overcommitted."""

from __future__ import annotations

import json
from collections import defaultdict

from bench.cluster_model import APPS, ClusterModel
from vramguard.cluster import ClusterState
from vramguard.policy import default_policy


def _template(pod: dict[str, object]) -> str:
    # What the extender derives a pod's demand from: its containers and VRAM annotations.
    metadata = pod["metadata"]
    spec = pod["spec"]
    assert isinstance(metadata, dict) and isinstance(spec, dict)
    return json.dumps([metadata.get("annotations"), spec["containers"]], sort_keys=True)


def test_running_pods_come_from_over_a_thousand_templates_one_per_app() -> None:
    model = ClusterModel(nodes=800, pods=5000)
    per_app: dict[str, set[str]] = defaultdict(set)
    for pod in model.pod_objects():
        per_app[pod["metadata"]["labels"]["app"]].add(_template(pod))
    assert len(per_app) == APPS >= 1000
    assert all(len(templates) == 1 for templates in per_app.values()), "replicas share their template"


def test_the_model_overcommits_no_gpu() -> None:
    model = ClusterModel(nodes=300, pods=3000)
    state = ClusterState(default_policy())
    state.namespaces.replace(model.namespaces())
    state.nodes.replace(model.node_objects())
    state.pods.replace(list(model.pod_objects()))
    assert state.ledger.pod_count() == 3000
    assert state.ledger.check_invariants() == []
