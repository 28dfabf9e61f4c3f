"""The demand model's error in the field: predictions against the agent's measurements
(:mod:`vramguard.accuracy`), its gauges in the extender's exposition and its listing in ``vramguard audit``."""

from __future__ import annotations

import json
import time
from fractions import Fraction
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from extender.metrics import MODEL_FAMILIES, render_ledger_now
from tests.builders import H100_MIB, gpu_node, vllm_pod
from tests.podspecs import container
from vramguard.accuracy import DECLARED_ENGINE, UNKNOWN_VERSION, Skip, model_accuracy, predict_on_device
from vramguard.cli.audit import audit_snapshot
from vramguard.cli.kubectl_vram import ClusterSnapshot
from vramguard.cluster import ClusterState
from vramguard.codecs import AGENT_REPORT_ANNOTATION, VRAM_ANNOTATION, AgentReport
from vramguard.demand import DEFAULT_OPTIONS, derive_pod_demand
from vramguard.inventory import Gpu
from vramguard.lease import DEFAULT_AGENT_NAMESPACE, lease_body
from vramguard.ledger import MEASURED_TOLERANCE_BYTES
from vramguard.policy import default_policy
from vramguard.quantity import GiB, MiB

NOW = 1_790_000_000.0
H100 = H100_MIB * MiB
PRODUCT = "NVIDIA H100 80GB HBM3"
JSON = dict[str, Any]


def reported(node: JSON, used: dict[str, dict[str, int]],
             placements: dict[str, dict[str, tuple[str, ...]]] | None = None) -> JSON:
    """``node`` carrying an agent report: ``used`` per pod UID and device, ``placements`` per container."""
    report = AgentReport(placements=placements or {}, used=used)
    node["metadata"]["annotations"] = {AGENT_REPORT_ANNOTATION: report.encode()}
    return node


def lease(node: JSON, now: float) -> JSON:
    return lease_body(DEFAULT_AGENT_NAMESPACE, node["metadata"]["name"], "agent", 40, now)


def cluster(nodes: list[JSON], pods: list[JSON], *, fresh: bool = True) -> ClusterState:
    state = ClusterState(default_policy(), clock=lambda: NOW)
    state.leases.replace([lease(n, NOW) for n in nodes] if fresh else [])
    state.nodes.replace(nodes)
    state.pods.replace(pods)
    return state


def predicted(pod: JSON, container_index: int = 0) -> int:
    """The pod's reservation on an H100 (the model's own numbers, allowances included)."""
    reservation = derive_pod_demand(pod, DEFAULT_OPTIONS).containers[container_index].reservation
    assert reservation is not None
    return reservation.on_device(H100, PRODUCT)


def tagged_vllm(name: str, image: str, utilization: str, node: str) -> JSON:
    pod = vllm_pod(name, utilization, node=node)
    pod["spec"]["containers"][0]["image"] = image
    return pod


def test_a_pod_over_its_prediction_is_listed_one_within_is_not_and_the_sums_add_up() -> None:
    over, within = vllm_pod("over", "0.5", "n"), vllm_pod("within", "0.3", "n")
    unmeasured = vllm_pod("idle", "0.2", "n")
    used_over = predicted(over) + MEASURED_TOLERANCE_BYTES + GiB
    used_within = predicted(within) + MEASURED_TOLERANCE_BYTES  # allocator slack: not over
    node = reported(gpu_node("n"), {"uid-over": {"0": used_over}, "uid-within": {"0": used_within}})
    accuracy = model_accuracy(cluster([node], [over, within, unmeasured]))

    assert predicted(over) > int(Fraction(1, 2) * H100), "the allowances (CUDA context) are part of the prediction"
    assert list(accuracy.engines) == [("vllm", "0.21.0")]
    totals = accuracy.engines[("vllm", "0.21.0")]
    assert totals.pod_devices == 2, "the pod without a measurement is ignored"
    assert totals.predicted_bytes == predicted(over) + predicted(within)
    assert totals.measured_bytes == used_over + used_within
    assert totals.pods_over == 1
    [sample] = accuracy.over_prediction()
    assert (sample.namespace, sample.name, sample.node, sample.device) == ("default", "over", "n", "0")
    assert (sample.engine, sample.version, sample.predicted, sample.measured) == (
        "vllm", "0.21.0", predicted(over), used_over)
    assert sample.excess == MEASURED_TOLERANCE_BYTES + GiB
    assert accuracy.skipped == {}


def test_sums_are_kept_per_engine_version_and_declarations_apart() -> None:
    old = tagged_vllm("old", "vllm/vllm-openai:v0.21.0", "0.4", "n")
    latest = tagged_vllm("latest", "vllm/vllm-openai:latest", "0.4", "n")
    declared = vllm_pod("declared", "0.4", "n")
    declared["metadata"]["annotations"] = {VRAM_ANNOTATION: "40Gi"}  # above vLLM's 0.4 of an H100
    node = reported(gpu_node("n"), {"uid-old": {"0": 10 * GiB}, "uid-latest": {"0": 11 * GiB},
                                    "uid-declared": {"0": 45 * GiB}})
    accuracy = model_accuracy(cluster([node], [old, latest, declared]))

    assert sorted(accuracy.engines) == [(DECLARED_ENGINE, UNKNOWN_VERSION), ("vllm", "0.21.0"),
                                        ("vllm", UNKNOWN_VERSION)]
    assert accuracy.engines[("vllm", "0.21.0")].predicted_bytes == predicted(old)
    assert accuracy.engines[("vllm", UNKNOWN_VERSION)].predicted_bytes == predicted(latest)
    assert accuracy.engines[("vllm", UNKNOWN_VERSION)].measured_bytes == 11 * GiB
    declared_totals = accuracy.engines[(DECLARED_ENGINE, UNKNOWN_VERSION)]
    assert (declared_totals.predicted_bytes, declared_totals.measured_bytes) == (40 * GiB, 45 * GiB)
    assert [s.name for s in accuracy.over_prediction()] == ["declared"]


def test_placements_attribute_each_device_to_its_container() -> None:
    spec = {"containers": [
        container(name="a", image="vllm/vllm-openai:v0.21.0", args=["--gpu-memory-utilization", "0.3"]),
        container(name="b", image="vllm/vllm-openai:v0.21.0", args=["--gpu-memory-utilization", "0.2"]),
    ], "nodeName": "n"}
    pod = {"metadata": {"name": "two", "namespace": "ml", "uid": "uid-two"}, "spec": spec,
           "status": {"phase": "Running"}}
    used = {"uid-two": {"0": 5 * GiB, "1": 40 * GiB}}
    node = reported(gpu_node("n", gpus=2), used, {"uid-two": {"a": ("0",), "b": ("1",)}})
    accuracy = model_accuracy(cluster([node], [pod]))
    totals = accuracy.engines[("vllm", "0.21.0")]
    assert totals.predicted_bytes == predicted(pod, 0) + predicted(pod, 1)
    assert [(s.device, s.predicted) for s in accuracy.over_prediction()] == [("1", predicted(pod, 1))]

    unplaced = model_accuracy(cluster([reported(gpu_node("n", gpus=2), used)], [pod]))
    assert unplaced.engines == {}, "two GPU containers and no placement: which one uses the device is unknown"
    assert unplaced.skipped == {Skip.NO_PLACEMENT: 2}


def test_what_has_no_prediction_is_skipped_never_guessed() -> None:
    unknown = {"metadata": {"name": "mystery", "namespace": "default", "uid": "uid-mystery"},
               "spec": {"containers": [container()], "nodeName": "n"}, "status": {"phase": "Running"}}
    node = reported(gpu_node("n"), {"uid-mystery": {"0": 9 * GiB}, "uid-gone": {"0": GiB}})
    accuracy = model_accuracy(cluster([node], [unknown]))
    assert accuracy.engines == {}
    assert accuracy.skipped == {Skip.NO_PREDICTION: 1, Skip.NO_RECORD: 1}


def test_a_stale_report_measures_nothing() -> None:
    pod = vllm_pod("over", "0.5", "n")
    node = reported(gpu_node("n"), {"uid-over": {"0": 70 * GiB}})
    accuracy = model_accuracy(cluster([node], [pod], fresh=False))
    assert accuracy.engines == {} and accuracy.skipped == {}


def test_predict_on_device_sizes_the_share_for_the_device() -> None:
    demand = derive_pod_demand(vllm_pod("p", "0.5", "n"), DEFAULT_OPTIONS)
    small = Gpu("0", 0, "small", 40 * GiB, "none", 1, "nvidia.com/gpu")
    big = Gpu("0", 0, "big", 80 * GiB, "none", 1, "nvidia.com/gpu")
    on_small, on_big = predict_on_device(demand, None, small), predict_on_device(demand, None, big)
    assert isinstance(on_small, tuple) and isinstance(on_big, tuple)
    assert on_big[2] - on_small[2] == 20 * GiB, "half of each device, the same allowances"
    assert predict_on_device(demand, None, Gpu("0", 0, "?", 0, "none", 1, "nvidia.com/gpu")) == Skip.DEVICE_SIZE
    assert predict_on_device(demand, {"vllm": ("1",)}, big) == Skip.NOT_PLACED


def samples(exposition: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition.decode())
        for sample in family.samples
    }


def test_the_gauges_are_in_the_extenders_exposition_per_engine_and_version_only() -> None:
    empty = render_ledger_now(cluster([gpu_node("n")], []))
    for name, help_text in MODEL_FAMILIES:
        assert f"# HELP {name} {help_text}\n# TYPE {name} gauge\n".encode() in empty

    over = vllm_pod("over", "0.5", "n")
    used = predicted(over) + 2 * GiB
    state = cluster([reported(gpu_node("n"), {"uid-over": {"0": used}})], [over])
    found = samples(render_ledger_now(state))
    labels = frozenset({("engine", "vllm"), ("version", "0.21.0")})
    assert found[("vramguard_model_predicted_bytes", labels)] == predicted(over)
    assert found[("vramguard_model_measured_bytes", labels)] == used
    assert found[("vramguard_model_measured_pod_devices", labels)] == 1
    assert found[("vramguard_model_pods_over_prediction", labels)] == 1
    model_series = {key for key in found if key[0].startswith("vramguard_model_")}
    assert {label for _, labels in model_series for label, _ in labels} == {"engine", "version"}


def test_audit_lists_the_pods_over_their_prediction() -> None:
    now = time.time()  # the audit's model reads the real clock for the agents' Leases
    over, within = vllm_pod("over", "0.5", "n"), vllm_pod("within", "0.3", "n")
    used = predicted(over) + 3 * GiB
    node = reported(gpu_node("n"), {"uid-over": {"0": used}, "uid-within": {"0": GiB}})
    report = audit_snapshot(ClusterSnapshot(nodes=[node], pods=[over, within], leases=[lease(node, now)]),
                            default_policy())
    model = json.loads(json.dumps(report.to_json()))["model_accuracy"]
    assert [(p["name"], p["node"], p["device"], p["engine"], p["version"], p["predicted_bytes"],
             p["measured_bytes"]) for p in model["over_prediction"]] == [
        ("over", "n", "0", "vllm", "0.21.0", predicted(over), used)]
    assert model["engines"][0]["pod_devices"] == 2
    text = report.to_text()
    assert "Pods using more VRAM than the model predicted (informational): 1" in text
    row = next(line for line in text.splitlines() if line.startswith("default") and " over " in line)
    assert row.split()[1:6] == ["over", "n", "0", "vllm", "0.21.0"]
    assert "3.0 GiB" in row
