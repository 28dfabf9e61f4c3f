"""A synthetic but realistic GPU cluster for the extender benchmarks: Nodes and Pods as API JSON.

Nodes look like what GPU Feature Discovery and the NVIDIA device plugin publish for time-sliced
H100 80GB GPUs (4 replicas each), one to eight GPUs per node. Pods look like what the informer
receives from the API server: vLLM, SGLang-like and annotated containers with the metadata,
managedFields, volumes, tolerations and status of real pods, so that the memory measurement
includes the cost of parsing and dropping what the extender does not keep.

Everything is seeded: the same arguments give the same cluster.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

H100_MIB = 81559
H100_PRODUCT = "NVIDIA-H100-80GB-HBM3"
REPLICAS = 4
GPU_COUNTS = (1, 2, 4, 8)
"""GPUs per node, equally likely."""
UTILIZATIONS = ("0.10", "0.15", "0.20", "0.22")
"""vLLM ``--gpu-memory-utilization`` of the pods already running: four of the largest share one
H100's 0.9 budget, so no GPU is overcommitted even in the worst case of the device plugin's choice."""
ANNOTATED = ("6Gi", "10Gi", "12Gi")
APPS = 1009
"""Applications the running pods belong to, each a template of its own (its served model name):
a cluster of many teams' Deployments, not a few shapes repeated."""
"""``vramguard.io/vram`` amounts of the annotated pods already running."""

JSON = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """A kind of pod to schedule: a Deployment's replicas share one."""

    name: str
    utilization: str
    gpus: int = 1


NEW_POD_SHAPES: tuple[Shape, ...] = (
    Shape("chat-0.20", "0.20"),
    Shape("chat-0.30", "0.30"),
    Shape("embed-0.10", "0.10"),
    Shape("tp2-0.25", "0.25", gpus=2),
)


def node_name(index: int) -> str:
    """Names as a cloud provider gives them."""
    return f"gpu-node-{index:05d}"


def gpu_node(index: int, gpus: int) -> JSON:
    """A Node with ``gpus`` time-sliced H100 80GB GPUs, 4 replicas each, as the informer lists it."""
    name = node_name(index)
    labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": f"p5.{gpus * 6}xlarge",
        "topology.kubernetes.io/region": "us-east-1",
        "topology.kubernetes.io/zone": f"us-east-1{'abc'[index % 3]}",
        "nvidia.com/cuda.driver.major": "570",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/gfd.timestamp": "1760000000",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.machine": "PowerEdge-XE9680",
        "nvidia.com/gpu.memory": str(H100_MIB),
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": f"{H100_PRODUCT}-SHARED",
        "nvidia.com/gpu.replicas": str(REPLICAS),
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "single",
    }
    capacity = {
        "cpu": str(24 * gpus),
        "ephemeral-storage": "3750000000Ki",
        "hugepages-1Gi": "0",
        "memory": f"{256 * gpus}Gi",
        "nvidia.com/gpu": str(gpus * REPLICAS),
        "pods": "110",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"00000000-0000-4000-8000-{index:012d}",
            "resourceVersion": str(1000 + index),
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": labels,
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {"providerID": f"aws:///us-east-1a/i-{index:017x}"},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {"type": kind, "status": "False", "reason": f"Kubelet{kind}",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z"}
                for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
            ] + [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                  "lastHeartbeatTime": "2026-01-01T00:00:00Z"}],
            "nodeInfo": {"kubeletVersion": "v1.35.4", "containerRuntimeVersion": "containerd://2.1.4",
                         "osImage": "Ubuntu 24.04.2 LTS", "kernelVersion": "6.8.0-1024-aws",
                         "architecture": "amd64", "operatingSystem": "linux"},
            "addresses": [{"type": "InternalIP", "address": f"10.{index // 65536}.{index // 256 % 256}.{index % 256}"},
                          {"type": "Hostname", "address": name}],
        },
    }


_POD_TEMPLATE: JSON = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "generateName": "chat-7d9f8-",
        "labels": {"app": "chat", "pod-template-hash": "7d9f8"},
        "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8000"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "chat-7d9f8",
                             "uid": "5f1c2c8e-0000-4000-8000-000000000000", "controller": True,
                             "blockOwnerDeletion": True}],
        "managedFields": [
            {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
             "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {}},
                                         "f:ownerReferences": {".": {}}},
                          "f:spec": {"f:containers": {}, "f:volumes": {}}}},
            {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": "2026-01-01T00:01:00Z",
             "fieldsType": "FieldsV1", "subresource": "status",
             "fieldsV1": {"f:status": {"f:conditions": {}, "f:containerStatuses": {}, "f:phase": {}}}},
        ],
    },
    "spec": {
        "containers": [{
            "name": "vllm",
            "image": "vllm/vllm-openai:v0.21.0",
            "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", "0.20",
                     "--max-model-len", "8192", "--port", "8000", "--served-model-name", "chat"],
            "env": [{"name": "HF_HOME", "value": "/cache"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
            "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "32Gi"},
                          "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"}},
            "readinessProbe": {"httpGet": {"path": "/health", "port": 8000, "scheme": "HTTP"},
                               "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1,
                               "failureThreshold": 3},
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"},
                             {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                              "readOnly": True}],
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
            "imagePullPolicy": "IfNotPresent",
        }],
        "volumes": [{"name": "cache", "emptyDir": {}},
                    {"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    ]}}],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "schedulerName": "default-scheduler",
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
        "tolerations": [
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    },
    "status": {"phase": "Pending", "qosClass": "Burstable"},
}


_POD_TEMPLATE_TEXT = json.dumps(_POD_TEMPLATE)


def gpu_pod(name: str, namespace: str, uid: str, utilization: str | None = None, *, gpus: int = 1,
            vram: str | None = None, node: str | None = None, app: str = "chat") -> JSON:
    """A GPU pod as the API server returns it: running on ``node`` when given, else pending.

    ``utilization``: a vLLM container with that ``--gpu-memory-utilization``; ``vram``: an app
    whose VRAM is declared with the ``vramguard.io/vram`` annotation.
    """
    pod: JSON = json.loads(_POD_TEMPLATE_TEXT)  # fresh objects, as the informer's JSON decoder makes
    metadata = pod["metadata"]
    metadata.update(name=name, namespace=namespace, uid=uid, resourceVersion="1",
                    creationTimestamp="2026-01-01T00:00:00Z")
    metadata["labels"]["app"] = app
    container = pod["spec"]["containers"][0]
    args = container["args"]
    if vram is not None:
        metadata["annotations"]["vramguard.io/vram"] = vram
        container["image"] = "example.com/inference/server:2.3"
        container["args"] = ["--port", "8000", "--service", app]
    else:
        args[args.index("--gpu-memory-utilization") + 1] = utilization or "0.20"
        args[args.index("--served-model-name") + 1] = app
        if gpus > 1:
            args += ["--tensor-parallel-size", str(gpus)]
    container["resources"]["limits"]["nvidia.com/gpu"] = str(gpus)
    container["resources"]["requests"]["nvidia.com/gpu"] = str(gpus)
    if node is not None:
        pod["spec"]["nodeName"] = node
        ip = f"10.200.{hash(name) % 256}.{hash(uid) % 256}"
        pod["status"] = {
            "phase": "Running",
            "qosClass": "Burstable",
            "hostIP": "10.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": "2026-01-01T00:00:10Z",
            "conditions": [{"type": kind, "status": "True", "lastTransitionTime": "2026-01-01T00:00:10Z"}
                           for kind in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                                        "PodScheduled")],
            "containerStatuses": [{
                "name": container["name"], "ready": True, "restartCount": 0, "started": True,
                "image": container["image"], "imageID": container["image"] + "@sha256:" + "0" * 64,
                "containerID": "containerd://" + uid.replace("-", "") * 2,
                "state": {"running": {"startedAt": "2026-01-01T00:00:30Z"}},
            }],
        }
    return pod


def new_pod(shape: Shape, serial: int) -> JSON:
    """A pending replica of ``shape`` (a fresh name and UID)."""
    return gpu_pod(f"{shape.name}-{serial:06d}", "team-new", f"new-{shape.name}-{serial:08d}",
                   shape.utilization, gpus=shape.gpus, app=shape.name)


@dataclass(frozen=True)
class ClusterModel:
    """How many nodes and running pods, and the seed."""

    nodes: int = 5000
    pods: int = 50000
    seed: int = 4

    def node_gpus(self) -> list[int]:
        """GPUs of each node."""
        rng = random.Random(self.seed)
        return [rng.choice(GPU_COUNTS) for _ in range(self.nodes)]

    def node_objects(self) -> list[JSON]:
        """Every Node."""
        return [gpu_node(i, gpus) for i, gpus in enumerate(self.node_gpus())]

    def pod_objects(self) -> Iterator[JSON]:
        """The running pods, spread over the nodes in proportion to their replicas.

        Each node gets at most as many pods as it has GPUs times replicas, and pods are drawn so
        that no GPU can be overcommitted whatever the device plugin picked.
        """
        gpus = self.node_gpus()
        slots = [g * REPLICAS for g in gpus]
        total = sum(slots)
        if self.pods > total:
            raise ValueError(f"{self.pods} pods do not fit {total} replicas")
        # Largest-remainder apportionment, so the total is exact.
        shares = [self.pods * s / total for s in slots]
        counts = [int(s) for s in shares]
        short = self.pods - sum(counts)
        for i in sorted(range(self.nodes), key=lambda i: shares[i] - counts[i], reverse=True)[:short]:
            counts[i] += 1
        serial = 0
        for index, count in enumerate(counts):
            for _ in range(count):
                namespace = f"team-{serial % 40:02d}"
                name = f"svc-{serial % APPS:03d}-{serial:06x}"
                uid = f"{serial:08x}-1111-4000-8000-{index:012d}"
                # One Deployment per app, all its replicas of one template (APPS templates in all).
                app = serial % APPS
                if app % 5 == 0:
                    pod = gpu_pod(name, namespace, uid, vram=ANNOTATED[app // 5 % len(ANNOTATED)],
                                  node=node_name(index), app=f"svc-{app:03d}")
                else:
                    pod = gpu_pod(name, namespace, uid, UTILIZATIONS[app % len(UTILIZATIONS)],
                                  node=node_name(index), app=f"svc-{app:03d}")
                serial += 1
                yield pod

    def namespaces(self) -> list[JSON]:
        """The namespaces the pods live in."""
        return [{"metadata": {"name": n, "labels": {}}} for n in [*(f"team-{i:02d}" for i in range(40)), "team-new"]]
