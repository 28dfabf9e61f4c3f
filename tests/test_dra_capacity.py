"""A DRA claim's ``capacity.requests.memory``: enforced in the container by HAMi's driver (a limit, as
an MPS pinned limit), only allocated by NVIDIA's (the container's own number counts, and a warning says
so). The manifests are the drivers' own demos, their sources in each file's header."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vramguard.cli import main

DATA = Path(__file__).parent / "data" / "dra"
GiB = 1 << 30


def explain(name: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    main(["explain", str(DATA / name), "--gpu-memory", "80Gi", "-o", "json"])
    reports: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return [r for r in reports if r["containers"]]


def test_hamis_dra_driver_enforces_the_claims_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # Project-HAMi/k8s-dra-driver v0.1.0 demo: a pod using claim single-gpu-0 (4Gi, 30 cores) of class
    # hami-core-gpu.project-hami.io; HAMi-core holds the container to 4Gi (CUDA_DEVICE_MEMORY_LIMIT_0).
    [report] = explain("hami-dra-driver-demo.yaml", capsys)
    [container] = report["containers"]
    assert container["vram_bytes_per_gpu"] == 4 * GiB
    assert any("HAMi's DRA driver enforces" in e for e in container["evidence"])
    assert not any("no known engine" in w for w in report["warnings"])


def test_a_pod_whose_gpu_is_only_a_claim_gets_the_webhooks_answer(capsys: pytest.CaptureFixture[str]) -> None:
    # The demo's pod-0 asks for no GPU resource: its GPU is the claim alone. It is judged like any GPU pod
    # (class, mode), as the mutating webhook routes it like one.
    [report] = explain("hami-dra-driver-demo.yaml", capsys)
    assert report["admission"] == {**report["admission"], "allowed": True, "mode": "audit", "class": "best-effort"}


def test_nvidias_consumable_capacity_is_not_enforced(capsys: pytest.CaptureFixture[str]) -> None:
    # kubernetes-sigs/dra-driver-nvidia-gpu demo (consumable shares, main): 4Gi allocated of a GPU, no
    # limit in the container: a test container of no known engine stays unknown (a whole GPU), and said.
    [report] = explain("nvidia-dra-consumable-memory-sharing.yaml", capsys)
    [container] = report["containers"]
    assert container["vram_bytes_per_gpu"] is None
    assert any("does not enforce in the container" in w for w in report["warnings"])
