"""``vramguard plan`` for a newcomer: the example Nodes, the conservative rule said once, duplicates, CRDs."""

from __future__ import annotations

from pathlib import Path

import yaml

from vramguard.cli.plan import CONSERVATIVE_NOTE, make_plan
from vramguard.inventory import read_inventory
from vramguard.policy import default_policy

ROOT = Path(__file__).parent.parent
NODES = ROOT / "examples" / "nodes.yaml"
CORPUS = ROOT / "tests" / "data" / "workloads"


def objects(*texts: str) -> list[dict[str, object]]:
    return [o for text in texts for o in yaml.safe_load_all(text) if o]


def test_example_nodes_cover_h100_h200_and_every_sharing_strategy() -> None:
    seen = set()
    for node in objects(NODES.read_text()):
        inventory = read_inventory(node)
        assert not inventory.notes, inventory.notes
        seen |= {(d.product, d.sharing) for d in inventory.devices}
    assert {sharing for _, sharing in seen} == {"none", "time-slicing", "mps", "mig"}
    assert {product.split(" ")[1] for product, _ in seen} >= {"H100", "H200"}


def test_seed_on_example_nodes_places_everything_and_says_why_empty_gpus_hold_memory() -> None:
    plan = make_plan(objects(NODES.read_text(), (ROOT / "examples" / "seed.yaml").read_text()), default_policy())
    assert not plan.pending
    assert plan.notes.count(CONSERVATIVE_NOTE) == 1


def test_no_conservative_note_when_every_reserving_gpu_has_pods() -> None:
    plan = make_plan(objects(NODES.read_text()), default_policy())
    assert CONSERVATIVE_NOTE not in plan.notes


def test_duplicate_names_are_flagged_and_planned_once() -> None:
    deployment = (CORPUS / "deployment-vllm-gke.yaml").read_text()
    plan = make_plan(objects(NODES.read_text(), deployment, deployment), default_policy())
    assert any("Deployment default/vllm-gemma-deployment appears more than once" in n for n in plan.notes)
    assert len(plan.placed + plan.pending) == 1  # its nodeSelector asks for L4s: pending, once


def test_a_leaderworkerset_is_planned_pod_by_pod() -> None:
    plan = make_plan(objects(NODES.read_text(), (CORPUS / "lws-vllm-nnodes.yaml").read_text()), default_policy())
    names = sorted(entry["pod"] for entry in plan.placed + plan.pending)
    assert names == ["serving/deepseek-leader-0", "serving/deepseek-worker-0"]
    assert {entry["node"] for entry in plan.placed} == {"h100-exclusive"}
