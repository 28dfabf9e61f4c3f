"""Never silent: every published object in the corpus that asks for an accelerator in any form (a GPU
resource of any vendor, another sharing system's resource or annotation, a DRA field, a GPU profile, an
accelerator vramguard does not read) yields, in `vramguard explain`, a container read with its GPUs or a
warning that says what was not read (for a kind vramguard does not read, the unread-kind warning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vramguard.cli.explain import explain_object
from vramguard.demand.objects import load_each_document
from vramguard.policy import default_policy
from vramguard.workloads import gpu_request_paths, read_inputs

DATA = Path(__file__).parent / "data"
FILES = sorted((DATA / "workloads").glob("*.yaml"))


def asks(obj: Any) -> list[str]:
    """Where the object asks for an accelerator, with every resource name counted (not only the policy's)."""
    return gpu_request_paths(obj, lambda name: "/" in name and any(
        word in name.lower() for word in ("gpu", "mig-", "neuron", "tpu", "gaudi", "_nps")
    ))


def test_the_corpus_has_every_vendor_and_training() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in FILES)
    assert "amd.com/gpu" in text and "kind: TrainJob" in text and len(FILES) >= 80


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_object_asking_for_an_accelerator_is_read_or_warned_about(path: Path) -> None:
    documents = load_each_document(path.read_text(encoding="utf-8"))
    objects = [o for d in documents for o in d.objects]
    inputs = read_inputs(objects)
    policy = default_policy()
    for obj in objects:
        if not asks(obj):
            continue
        report = explain_object(obj, 80 * 2**30, policy, inputs=inputs)
        read = [c for c in report["containers"] if c["gpus"]]
        assert read or report["warnings"] or report["errors"], (obj.get("kind"), asks(obj))


def test_a_kind_nobody_reads_that_asks_for_a_gpu_is_flagged() -> None:
    # Kubeflow's TFJob (kubeflow.org/v1) is no shipped workload kind: skipped, with the warning.
    tfjob = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "t"}, "spec": {"tfReplicaSpecs": {
        "Worker": {"replicas": 2, "template": {"spec": {"containers": [
            {"name": "tensorflow", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}}}}
    report = explain_object(tfjob, None, default_policy())
    assert report["skipped"] and any("TFJob" in w for w in report["warnings"])


def test_an_accelerator_the_policy_does_not_name_is_warned_about() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "gaudi", "image": "x", "resources": {"limits": {"habana.ai/gaudi": 1}}},
        {"name": "amd", "image": "x", "resources": {"limits": {"amd.com/cpx_nps4": 1}}},
    ]}}
    nvidia_only = default_policy().model_copy(update={"gpu_resources": ("nvidia.com/gpu",),
                                                      "gpu_resource_prefixes": ("nvidia.com/mig-",)})
    report = explain_object(pod, None, nvidia_only)
    assert report["containers"] == []
    assert any("habana.ai/gaudi" in w and "Intel Gaudi" in w for w in report["warnings"])
    assert any("amd.com/cpx_nps4" in w and "AMD GPU" in w for w in report["warnings"])
