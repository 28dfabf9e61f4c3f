"""What the throughput benchmark needs to run HAMi's scheduler extender in the extender's place.

Every format here was read from HAMi's source at :data:`HAMI_VERSION`:

- the node annotations (:func:`node_annotations`): ``pkg/device/nvidia/device.go``
  (``RegisterAnnos``, ``HandshakeAnnos``, ``GetNodeDevices``, ``CheckHealth``),
  ``pkg/device/devices.go`` (``DeviceInfo``'s JSON fields, ``CheckHealth``: the handshake);
- what a pod asks for (:func:`pod_resources`): ``GenerateResourceRequests`` in
  ``pkg/device/nvidia/device.go``, with the resource names of ``charts/hami/values.yaml``;
- the device configuration (:func:`device_config`): the ``nvidia`` section of
  ``charts/hami/templates/scheduler/device-configmap.yaml`` with the chart's default values;
- the second scheduler's configuration (:func:`scheduler_config`):
  ``charts/hami/templates/scheduler/configmap.yaml`` and the ``managedResources`` of
  ``charts/hami/templates/_helpers.tpl``;
- the flags (:mod:`bench.hami.launch`): ``cmd/scheduler/main.go`` and
  ``pkg/scheduler/config/config.go`` (``--device-config-file``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import uuid
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

JSON = dict[str, Any]

HAMI_VERSION = "v2.10.0"
"""The HAMi release the formats of this module were read from (its ``VERSION`` file)."""
MODULE = "github.com/Project-HAMi/HAMi"
REGISTER_ANNOTATION = "hami.io/node-nvidia-register"
"""The devices of a node as HAMi's device plugin registers them: a JSON array of ``DeviceInfo``."""
HANDSHAKE_ANNOTATION = "hami.io/node-handshake"
"""The device plugin's liveness: ``Requesting_<time>`` from the scheduler, ``Reported_<time>`` back."""
NODE_LOCK_ANNOTATION = "hami.io/mutex.lock"
"""The node lock HAMi's bind takes; its device plugin releases it at Allocate."""

RESOURCE_COUNT = "nvidia.com/gpu"
RESOURCE_MEMORY = "nvidia.com/gpumem"
RESOURCE_MEMORY_PERCENTAGE = "nvidia.com/gpumem-percentage"
RESOURCE_CORES = "nvidia.com/gpucores"
RESOURCE_PRIORITY = "nvidia.com/priority"
MANAGED_RESOURCES = (
    # NVIDIA (the chart's resourceName, resourceMem, resourceCores, resourceMemPercentage, resourcePriority)
    RESOURCE_COUNT, RESOURCE_MEMORY, RESOURCE_CORES, RESOURCE_MEMORY_PERCENTAGE, RESOURCE_PRIORITY,
    "cambricon.com/vmlu",  # MLU
    "hygon.com/dcunum", "hygon.com/dcumem", "hygon.com/dcucores",  # DCU
    "metax-tech.com/gpu", "metax-tech.com/sgpu", "metax-tech.com/vcore", "metax-tech.com/vmemory",  # Metax
)
"""The extended resources HAMi's chart hands to the extender (``ignoredByScheduler: true``): those
of ``hami-vgpu.scheduler.managedResources`` with the chart's default values and optional vendors off."""

KUBE_QPS = 500
KUBE_BURST = 1000
"""HAMi's own API rate limit (``--kube-qps``/``--kube-burst``). Its default is client-go's (5 and
10), which the chart keeps: at that rate its per-pod writes (the pod's annotations at filter and at
bind, the node lock, the Binding, Events) would throttle a wave to a few pods per second. Given the
second scheduler's ``clientConnection`` here, so that the wave measures HAMi's work, not a limiter."""
NODE_LOCK_TIMEOUT = "1ms"
"""``--node-lock-timeout``. HAMi's bind locks the node (:data:`NODE_LOCK_ANNOTATION`) and its device
plugin releases the lock at Allocate, on the node; a control plane without kubelets has no device
plugin, and with the default 5 minutes only the first pod per node would ever bind. Every lock older
than this is taken as expired: HAMi releases it and takes its own, as it does for a stale lock."""


# --------------------------------------------------------------------------- building


def source_version(source: Path) -> str:
    """The release of a HAMi source tree (its ``VERSION`` file), after checking it is one."""
    go_mod = source / "go.mod"
    if not go_mod.is_file() or f"module {MODULE}\n" not in go_mod.read_text() + "\n":
        raise FileNotFoundError(f"{source} is not a HAMi source tree (no go.mod of {MODULE})")
    if not (source / "cmd" / "scheduler" / "main.go").is_file():
        raise FileNotFoundError(f"{source} has no cmd/scheduler")
    version_file = source / "VERSION"
    return version_file.read_text().strip() if version_file.is_file() else "unknown"


REPOSITORY = "https://github.com/Project-HAMi/HAMi"


def fetch_source(cache: Path) -> Path:
    """A source tree of HAMi at :data:`HAMI_VERSION` in ``cache``, cloned from :data:`REPOSITORY`
    the first time (``git``, network); raise :class:`RuntimeError` saying how to provide one."""
    tree = cache / f"hami-{HAMI_VERSION}"
    if (tree / "go.mod").is_file():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    clone = subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", HAMI_VERSION, REPOSITORY,
                            str(tree)], capture_output=True, text=True, timeout=600, check=False)
    if clone.returncode != 0:
        raise RuntimeError(f"no HAMi source tree: cloning {REPOSITORY} at {HAMI_VERSION} failed "
                           f"({clone.stderr.strip()[-200:] or clone.returncode}); pass --hami-source DIR "
                           f"(git clone --branch {HAMI_VERSION} {REPOSITORY} DIR)")
    return tree


def build_hami(source: Path, out_dir: Path) -> tuple[Path, str]:
    """Build HAMi's scheduler extender (``cmd/scheduler``, cgo) from the source tree ``source`` into
    ``out_dir``, once per release; return the executable and the release."""
    version = source_version(source)
    binary = out_dir / f"hami-scheduler-{version}"
    if binary.is_file() and version != "unknown":
        return binary, version
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CGO_ENABLED="1", GOFLAGS=f"{os.environ.get('GOFLAGS', '')} -mod=mod".strip())
    subprocess.run(["go", "build", "-trimpath", "-ldflags", f"-X {MODULE}/pkg/version.version={version}",
                    "-o", str(binary), "./cmd/scheduler"], cwd=source, env=env, check=True)
    return binary, version


def device_config() -> str:
    """HAMi's ``--device-config-file``: the ``nvidia`` section its chart writes, with the chart's
    defaults (MIG allow-lists left out: the benchmark's GPUs are time-sliced)."""
    config = {"nvidia": {
        "resourceCountName": RESOURCE_COUNT,
        "resourceMemoryName": RESOURCE_MEMORY,
        "resourceMemoryPercentageName": RESOURCE_MEMORY_PERCENTAGE,
        "resourceCoreName": RESOURCE_CORES,
        "resourcePriorityName": RESOURCE_PRIORITY,
        "overwriteEnv": False,
        "defaultMemory": 0,
        "defaultCores": 0,
        "defaultGPUNum": 1,
        "preConfiguredDeviceMemory": 0,
        "memoryFactor": 1,
        "deviceSplitCount": 10,
        "deviceMemoryScaling": 1,
        "deviceCoreScaling": 1,
        "enableNumaTopology": False,
        "gpuCorePolicy": "default",
        "libCudaLogLevel": "1",
        "runtimeClassName": "",
    }}
    return yaml.safe_dump(config, sort_keys=False)


# --------------------------------------------------------------------------- nodes


def gpu_uuid(node: str, index: int) -> str:
    """A stable NVML-style UUID for GPU ``index`` of ``node``."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{index}.{node}.gpu.bench')}"


def register_annotation(node: str, *, gpus: int, count: int, devmem_mib: int, product: str,
                        devcore: int = 100, mode: str = "hami-core") -> str:
    """The value of :data:`REGISTER_ANNOTATION` for ``gpus`` GPUs of ``devmem_mib`` MiB, each
    shareable by ``count`` pods (``DeviceInfo`` in ``pkg/device/devices.go``: ``id``, ``index``,
    ``count``, ``devmem``, ``devcore``, ``type``, ``numa``, ``mode``, ``health``)."""
    devices = [{"id": gpu_uuid(node, i), "index": i, "count": count, "devmem": devmem_mib, "devcore": devcore,
                "type": product, "numa": 0, "mode": mode, "health": True} for i in range(gpus)]
    return json_compact(devices)


def handshake_annotation(now: float | None = None) -> str:
    """:data:`HANDSHAKE_ANNOTATION` as HAMi writes it when it asks the device plugin for a report
    (``Requesting_`` and Go's ``time.DateTime`` in local time): a node HAMi has just asked, so it
    registers the devices without patching the node first. Once the request is 60 s old, HAMi keeps
    the node healthy as long as it advertises ``nvidia.com/gpu``."""
    return "Requesting_" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def node_annotations(node: str, *, gpus: int, count: int, devmem_mib: int, product: str,
                     now: float | None = None) -> dict[str, str]:
    """The annotations HAMi's device plugin leaves on a node of ``gpus`` GPUs (see
    :func:`register_annotation`); the node must also advertise ``nvidia.com/gpu``."""
    return {REGISTER_ANNOTATION: register_annotation(node, gpus=gpus, count=count, devmem_mib=devmem_mib,
                                                     product=product),
            HANDSHAKE_ANNOTATION: handshake_annotation(now)}


def registered_nodes(metrics: str) -> set[str]:
    """The nodes HAMi has registered devices of, from its ``/metrics`` (``hami_gpu_memory_limit_bytes``,
    one series per registered GPU, labelled with its node)."""
    nodes = set()
    for line in metrics.splitlines():
        if line.startswith("hami_gpu_memory_limit_bytes{") and 'node="' in line:
            nodes.add(line.split('node="', 1)[1].split('"', 1)[0])
    return nodes


# --------------------------------------------------------------------------- pods


def gpumem_mib(utilization: str, total_mib: int) -> int:
    """What a vLLM pod reserves on each of its GPUs, in whole MiB (rounded up): its
    ``--gpu-memory-utilization`` times the GPU's total memory, as vramguard's model counts it."""
    return math.ceil(Fraction(utilization) * total_mib)


def pod_resources(utilization: str, total_mib: int, gpus: int = 1) -> dict[str, str]:
    """The extended resources a pod asks HAMi for: ``gpus`` GPUs (``nvidia.com/gpu``) and, on each,
    the memory vLLM reserves (``nvidia.com/gpumem``, MiB: ``GenerateResourceRequests`` reads it as
    an integer per GPU)."""
    return {RESOURCE_COUNT: str(gpus), RESOURCE_MEMORY: str(gpumem_mib(utilization, total_mib))}


# --------------------------------------------------------------------------- the scheduler


def scheduler_config(like: Mapping[str, Any]) -> JSON:
    """The second kube-scheduler's configuration with HAMi as its extender, as HAMi's chart writes
    it: filter and bind (HAMi has no prioritize or preempt verb), ``nodeCacheCapable``, weight 1,
    a 30 s timeout, and its resources ``ignoredByScheduler`` (HAMi counts them, not kube-scheduler).
    The profile's name and the API rate limit (``clientConnection``) are those of ``like``, the
    shipped second-scheduler configuration, so the stock scheduler it is compared with is the same.
    The harness rewrites ``urlPrefix`` and ``tlsConfig`` (``e2e.services.localize_scheduler_config``)."""
    connection = like.get("clientConnection") or {}
    profiles = like.get("profiles") or [{"schedulerName": "hami-scheduler"}]
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": dict(connection),
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": profiles[0]["schedulerName"]}],
        "extenders": [{
            "urlPrefix": "https://127.0.0.1:443",
            "enableHTTPS": True,
            "tlsConfig": {"insecure": True},
            "filterVerb": "filter",
            "bindVerb": "bind",
            "nodeCacheCapable": True,
            "weight": 1,
            "httpTimeout": "30s",
            "managedResources": [{"name": name, "ignoredByScheduler": True} for name in MANAGED_RESOURCES],
        }],
    }


def write_manifests(root: Path, like: Mapping[str, Any]) -> Path:
    """A manifests tree for the e2e harness holding only ``scheduler/second-scheduler.yaml`` =
    :func:`scheduler_config`: no ServiceAccount, so the extender's identity gets the harness's
    cluster-admin binding (HAMi patches nodes and pods, lists ResourceQuotas, writes Events)."""
    scheduler = root / "scheduler"
    scheduler.mkdir(parents=True, exist_ok=True)
    (scheduler / "second-scheduler.yaml").write_text(yaml.safe_dump(scheduler_config(like), sort_keys=False))
    return root


def json_compact(value: Any) -> str:
    """JSON without spaces, as Go's encoder writes it."""
    return json.dumps(value, separators=(",", ":"))
