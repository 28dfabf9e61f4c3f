"""Karpenter, built from its Go source, run against the harness's control plane with its ``kwok``
cloud provider (no cloud: a NodeClaim becomes a Node object the provider creates itself).

- **Build**: ``go install sigs.k8s.io/karpenter/kwok@v1.15.0``, cached under
  ``$XDG_CACHE_HOME/vramguard/karpenter/<version>/``. Its go.mod asks for Go 1.26.9, so the build
  takes the approved newer toolchain from the module proxy (``GOTOOLCHAIN``), for this build only.
- **CRDs**: the module's own (``kwok/charts/crds`` and ``kwok/apis/crds``): NodePool, NodeClaim,
  NodeOverlay, CapacityBuffer and KWOKNodeClass.
- **Instance types**: a JSON file (``INSTANCE_TYPES_FILE_PATH``, the provider's
  ``kwok/cloudprovider`` format); an offering's requirements become the new node's labels, which is
  how a node gets GPU Feature Discovery's labels here.
- **The kubelet's part**: nobody runs a kubelet on these nodes, so :class:`Karpenter` marks each new
  node Ready (Karpenter initializes a node only once it is) and deletes the pods that terminate on
  them, as a kubelet would finish them (Karpenter's drain waits for them).

The process runs with leader election off, batching shortened (``BATCH_IDLE_DURATION``,
``BATCH_MAX_DURATION``), node repair off, and its metrics and probes on free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.error
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from e2e import build
from e2e.procs import ManagedProcess, free_ports, http_status

MODULE = "sigs.k8s.io/karpenter"
VERSION = "v1.15.0"
TOOLCHAIN = "go1.27.3"
"""sigs.k8s.io/karpenter v1.15.0's go.mod says ``go 1.26.9``: the Go release the module proxy serves for it."""
NODEPOOL_LABEL = "karpenter.sh/nodepool"
CRD_DIRECTORIES = ("kwok/charts/crds", "kwok/apis/crds")


@dataclass(frozen=True)
class KarpenterBuild:
    """The built provider and the module's source (for its CRDs)."""

    binary: Path
    module_dir: Path

    def crds(self) -> list[dict[str, Any]]:
        """The CustomResourceDefinitions the provider needs."""
        found: list[dict[str, Any]] = []
        for directory in CRD_DIRECTORIES:
            for path in sorted((self.module_dir / directory).glob("*.yaml")):
                found.extend(d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict))
        return found


def cache_dir() -> Path:
    return build.cache_root().parent / "karpenter" / VERSION


def ensure_built(log: build.Log = build._stderr) -> KarpenterBuild:
    """The provider binary, built once per version (concurrent callers build once)."""
    directory = cache_dir()
    env = {"GOTOOLCHAIN": TOOLCHAIN, "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}
    binary = directory / "kwok"
    with build._locked(directory.parent / f"{VERSION}.lock"):
        if not binary.is_file():
            started = time.monotonic()
            log(f"building {MODULE}/kwok@{VERSION} (Go {TOOLCHAIN}) ...")
            directory.mkdir(parents=True, exist_ok=True)
            build.run_go(["install", "-trimpath", "-ldflags=-s -w", f"{MODULE}/kwok@{VERSION}"], cwd=directory,
                         env={**env, "GOBIN": str(directory)})
            log(f"built {binary} in {time.monotonic() - started:.0f}s")
        info = json.loads(build.run_go(["mod", "download", "-json", f"{MODULE}@{VERSION}"], cwd=directory, env=env))
    return KarpenterBuild(binary, Path(info["Dir"]))


def gpu_instance_type(name: str, *, gpus: int, replicas: int, product: str, memory_mib: int,
                      price: float = 4.0) -> dict[str, Any]:
    """One instance type of time-sliced GPUs: ``gpus * replicas`` of ``nvidia.com/gpu``, with the
    labels GPU Feature Discovery would give its nodes as offering requirements."""
    labels = {
        "nvidia.com/gpu.product": f"{product}-SHARED", "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
    }
    return {
        "name": name, "architecture": "amd64", "operatingSystems": ["linux"],
        "resources": {"cpu": "16", "memory": "128Gi", "ephemeral-storage": "100Gi", "pods": "110",
                      "nvidia.com/gpu": str(gpus * replicas)},
        "offerings": [{"Price": price, "Available": True, "Requirements": [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["test-zone-a"]},
            *({"key": key, "operator": "In", "values": [value]} for key, value in labels.items()),
        ]}],
    }


def node_pool(name: str, instance_type: str, *, labels: Mapping[str, str], taints: Sequence[Mapping[str, str]] = (),
              consolidate_after: str = "5s", limit_gpus: int = 64) -> dict[str, Any]:
    """A NodePool of ``instance_type`` nodes that consolidates empty and underused nodes."""
    return {
        "apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name},
        "spec": {
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"},
                    "requirements": [
                        {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [instance_type]},
                        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                    ],
                    "taints": [dict(t) for t in taints],
                    "expireAfter": "Never",
                },
            },
            "disruption": {"consolidationPolicy": "WhenEmptyOrUnderutilized", "consolidateAfter": consolidate_after,
                           "budgets": [{"nodes": "100%"}]},
            "limits": {"nvidia.com/gpu": str(limit_gpus)},
        },
    }


NODE_CLASS = {"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass", "metadata": {"name": "default"},
              "spec": {"nodeRegistrationDelay": "0s"}}


class Karpenter:
    """The provider process against ``cluster``, and the kubelet's part for its nodes."""

    def __init__(self, cluster: Any, built: KarpenterBuild, directory: Path) -> None:
        self.cluster = cluster
        self.built = built
        self.directory = directory
        self.process: ManagedProcess | None = None
        self._stop = threading.Event()
        self._kubelet: threading.Thread | None = None
        self.errors: list[str] = []

    def install(self, instance_types: Sequence[Mapping[str, Any]], pools: Sequence[Mapping[str, Any]]) -> None:
        """Create the CRDs, the node class and the pools; start the provider; wait for it."""
        for crd in self.built.crds():
            self._create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        for crd in self.built.crds():
            self._wait(f"CRD {crd['metadata']['name']} established", lambda c=crd: any(
                cond["type"] == "Established" and cond["status"] == "True"
                for cond in self.cluster.request(
                    "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{c['metadata']['name']}"
                ).get("status", {}).get("conditions", [])))
        self._create("/apis/karpenter.kwok.sh/v1alpha1/kwoknodeclasses", NODE_CLASS)
        for pool in pools:
            self._create("/apis/karpenter.sh/v1/nodepools", pool)
        self.directory.mkdir(parents=True, exist_ok=True)
        types = self.directory / "instance-types.json"
        types.write_text(json.dumps(list(instance_types)))
        metrics, health = free_ports(2)
        env = {
            **os.environ, "KUBECONFIG": str(self.cluster.kubeconfig), "DISABLE_LEADER_ELECTION": "true",
            "METRICS_PORT": str(metrics), "HEALTH_PROBE_PORT": str(health), "LOG_LEVEL": "debug",
            "BATCH_IDLE_DURATION": "200ms", "BATCH_MAX_DURATION": "2s", "INSTANCE_TYPES_FILE_PATH": str(types),
            "FEATURE_GATES": "NodeRepair=false",
        }
        self.process = ManagedProcess.start("karpenter", [str(self.built.binary)], log_path=self.directory /
                                            "karpenter.log", pid_dir=self.directory, cwd=self.directory, env=env,
                                            die_with_parent=True)
        self._wait("karpenter ready", lambda: http_status(f"http://127.0.0.1:{health}/readyz") == 200, 60)
        for pool in pools:
            self._wait(f"NodePool {pool['metadata']['name']} ready", lambda p=pool: any(
                cond["type"] == "Ready" and cond["status"] == "True"
                for cond in self.cluster.request(
                    "GET", f"/apis/karpenter.sh/v1/nodepools/{p['metadata']['name']}"
                ).get("status", {}).get("conditions", [])))
        self._kubelet = threading.Thread(target=self._act_as_kubelet, name="karpenter-kubelet", daemon=True)
        self._kubelet.start()

    def nodeclaims(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.request("GET", "/apis/karpenter.sh/v1/nodeclaims")["items"]
        return items

    def nodes(self) -> list[dict[str, Any]]:
        """The nodes Karpenter made (those of a NodePool), not being deleted."""
        found: list[dict[str, Any]] = self.cluster.request(
            "GET", f"/api/v1/nodes?labelSelector={NODEPOOL_LABEL}")["items"]
        return [n for n in found if not n["metadata"].get("deletionTimestamp")]

    def log_tail(self, lines: int = 60) -> str:
        return self.process.log_tail(lines) if self.process is not None else ""

    def stop(self) -> None:
        """Stop the provider and the kubelet stand-in (the control plane goes with the cluster)."""
        self._stop.set()
        if self._kubelet is not None:
            self._kubelet.join(10)
        if self.process is not None:
            self.process.stop()

    # -- the kubelet's part ----------------------------------------------------------------

    def _act_as_kubelet(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._kubelet_pass()
            except Exception as error:  # a pass that failed is retried; the errors are kept for the test
                self.errors.append(repr(error))

    def _kubelet_pass(self) -> None:
        names = set()
        for node in self.nodes():
            names.add(node["metadata"]["name"])
            conditions = node.get("status", {}).get("conditions") or []
            if not any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet stand-in",
                         "lastHeartbeatTime": now, "lastTransitionTime": now}
                self.cluster.request("PATCH", f"/api/v1/nodes/{node['metadata']['name']}/status",
                                     {"status": {"conditions": [ready]}}, content_type="application/merge-patch+json")
        if not names:
            return
        for pod in self.cluster.request("GET", "/api/v1/pods?fieldSelector=spec.nodeName!%3D")["items"]:
            metadata = pod["metadata"]
            if metadata.get("deletionTimestamp") and pod["spec"].get("nodeName") in names:
                with contextlib.suppress(urllib.error.HTTPError):  # gone meanwhile
                    self.cluster.request(
                        "DELETE", f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}",
                        {"gracePeriodSeconds": 0})

    # -- helpers ---------------------------------------------------------------------------

    def _create(self, collection: str, obj: Mapping[str, Any]) -> None:
        try:
            self.cluster.request("POST", collection, obj)
        except urllib.error.HTTPError as error:
            if error.code != 409:
                raise RuntimeError(f"creating {obj['kind']}: {error.code} {error.read().decode()}") from error

    @staticmethod
    def _wait(what: str, check: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(urllib.error.URLError, OSError):
                if check():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.25)


@contextlib.contextmanager
def running(cluster: Any, built: KarpenterBuild, directory: Path, instance_types: Sequence[Mapping[str, Any]],
            pools: Sequence[Mapping[str, Any]]) -> Iterator[Karpenter]:
    """Karpenter installed into ``cluster`` for the duration of the block."""
    karpenter = Karpenter(cluster, built, directory)
    try:
        karpenter.install(instance_types, pools)
        yield karpenter
    finally:
        karpenter.stop()
