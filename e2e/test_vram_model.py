"""The VRAM model on the real control plane: what binds is what the engines would really hold.

Each expected count is computed here from the engines' own rules (cited per test) and the shipped
policy's amounts (``vramguard/default_policy.yaml``: a CUDA context 512Mi per process per GPU, CUDA
graphs 1Gi where the engine keeps them outside its share, communication buffers 1Gi with parallel
peers, a margin of 0.03 on shared devices and none on exclusive ones), never from vramguard's output.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.scenario import pin_to_test, require_extender, violations_on_own_nodes
from e2e.test_extender import add_nodes, create_all, scheduling_message, settle

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20
GiB = 1 << 30
CONTEXT = 512 * MiB
GRAPHS = GiB
COMMUNICATION = GiB
SHARED_MARGIN = Fraction(3, 100)


def server_pod(name: str, image: str, args: list[str], unique: str, gpus: int = 1) -> dict[str, Any]:
    """An inference server pod in the form the projects publish (image entrypoint, args only)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": pin_to_test({
            "containers": [{
                "name": "server",
                "image": image,
                "args": args,
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }],
        }, unique),
    }


def shared_budget(memory_mib: int) -> int:
    """A shared device's budget under the shipped policy: its memory less the margin, rounded down."""
    keep = 1 - SHARED_MARGIN
    return memory_mib * MiB * keep.numerator // keep.denominator


def test_many_small_vllm_pods_bind_only_as_many_as_really_fit(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    """20 vLLM v0.10.0 servers at 0.044 on one A100 80GB time-sliced 20 ways. Each holds 0.044 of the
    device, its CUDA context, and its CUDA graphs, which v0.9.1 to v0.19.1 capture after sizing the KV
    cache (vllm/v1/executor/abstract.py initialize_from_config, then compile_or_warm_up_model)."""
    require_extender(cluster)
    model = gpu_nodes.gpu_model("A100-80GB")
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("a100", model, gpus=1, replicas=20))
    each = int(Fraction(44, 1000) * model.memory_mib * MiB) + CONTEXT + GRAPHS
    fitting = shared_budget(model.memory_mib) // each
    assert fitting < 20  # the replica count alone would admit all of them
    pods = [
        server_pod(f"small-{i}", "vllm/vllm-openai:v0.10.0", ["--model", "m", "--gpu-memory-utilization", "0.044"],
                   unique)
        for i in range(20)
    ]
    create_all(core_v1, namespace, pods)
    placed = settle(core_v1, namespace, fitting, timeout=120)
    assert sorted(n for n in placed.values() if n) == [node] * fitting
    pending = [name for name, n in placed.items() if n is None]
    assert len(pending) == 20 - fitting
    assert "VRAM budget free" in scheduling_message(core_v1.read_namespaced_pod(pending[0], namespace))
    assert violations_on_own_nodes(cluster, unique) == []


def test_vllm_at_its_default_share_binds_alone_on_an_empty_shared_gpu(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    """vLLM v0.21.0 without the flag: 0.92 of the device (vllm/config/cache.py, 0.92 since v0.20.0),
    graphs inside it (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1 since v0.20.0), plus its
    context: it fits the shared H100's budget, as it runs there alone."""
    require_extender(cluster)
    model = gpu_nodes.gpu_model("H100-80GB")
    assert int(Fraction(92, 100) * model.memory_mib * MiB) + CONTEXT <= shared_budget(model.memory_mib)
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", model, gpus=1, replicas=4))
    create_all(core_v1, namespace, [server_pod("default-share", "vllm/vllm-openai:v0.21.0", ["--model", "m"], unique)])
    assert settle(core_v1, namespace, 1) == {"default-share": node}


def test_tensor_parallel_8_at_095_binds_on_a_dedicated_node(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    """TP 8 at 0.95 on eight exclusive H100s: each GPU holds 0.95, a context and the communication
    buffers (allocated before vLLM's memory snapshot since v0.11.0, vllm/v1/worker/gpu_worker.py),
    which fits a device one pod owns (no margin there)."""
    require_extender(cluster)
    model = gpu_nodes.gpu_model("H100-80GB")
    assert int(Fraction(95, 100) * model.memory_mib * MiB) + CONTEXT + COMMUNICATION <= model.memory_mib * MiB
    [node] = add_nodes(core_v1, unique, gpu_nodes.exclusive("h100x8", model, gpus=8))
    args = ["--model", "m", "--gpu-memory-utilization", "0.95", "--tensor-parallel-size", "8"]
    pod = server_pod("tp8", "vllm/vllm-openai:v0.21.0", args, unique, gpus=8)
    create_all(core_v1, namespace, [pod])
    assert settle(core_v1, namespace, 1) == {"tp8": node}


def test_two_tgi_servers_at_045_do_not_share_a_gpu(cluster: Any, core_v1: Any, namespace: str, unique: str) -> None:
    """TGI sizes its KV cache from max(0, free - (1 - fraction) x total), free counting every process
    (text-generation-inference v3.3.x, server/text_generation_server/utils/import_utils.py
    get_cuda_free_memory): the second of two at 0.45 would get no KV cache at all."""
    require_extender(cluster)
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", gpus=1, replicas=4))
    image = "ghcr.io/huggingface/text-generation-inference:3.3.4"
    pods = [server_pod(f"tgi-{i}", image, ["--model-id", "m", "--cuda-memory-fraction", "0.45"], unique)
            for i in range(2)]
    create_all(core_v1, namespace, pods)
    placed = settle(core_v1, namespace, 1)
    assert sorted(n for n in placed.values() if n) == [node]
    [pending] = [name for name, n in placed.items() if n is None]
    assert "caps the whole GPU's use" in scheduling_message(core_v1.read_namespaced_pod(pending, namespace))


def test_a_declaration_below_vllms_flag_counts_vllms_share_on_a_larger_gpu(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    """``vramguard.io/vram: 64Gi``, honest for vLLM at 0.75 on an 80 GB H100, lands on an H200: vLLM
    takes 0.75 of the device it finds (vllm/worker/worker.py determine_num_available_blocks,
    ``total_gpu_memory * gpu_memory_utilization``), so that is what the H200 holds, and a 40Gi pod
    no longer fits beside it (the 64Gi alone would have let it)."""
    require_extender(cluster)
    h100, h200 = gpu_nodes.gpu_model("H100-80GB"), gpu_nodes.gpu_model("H200")
    assert int(Fraction(3, 4) * h100.memory_mib * MiB) + CONTEXT + GRAPHS <= 64 * GiB
    held = int(Fraction(3, 4) * h200.memory_mib * MiB) + CONTEXT + GRAPHS  # v0.10.0: graphs outside its share
    assert 64 * GiB + 40 * GiB <= shared_budget(h200.memory_mib) < held + 40 * GiB
    _, big = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", h100, gpus=1, replicas=4),
                       gpu_nodes.time_sliced("h200", h200, gpus=1, replicas=4))
    first = server_pod("declared", "vllm/vllm-openai:v0.10.0", ["--model", "m", "--gpu-memory-utilization", "0.75"],
                       unique)
    second = server_pod("beside", "registry.example/trainer:1", [], unique)
    first["metadata"]["annotations"] = {"vramguard.io/vram": "64Gi"}
    second["metadata"]["annotations"] = {"vramguard.io/vram": "40Gi"}
    for pod in (first, second):
        pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] = big
    create_all(core_v1, namespace, [first])
    assert settle(core_v1, namespace, 1) == {"declared": big}
    create_all(core_v1, namespace, [second])
    placed = settle(core_v1, namespace, 1)
    assert placed == {"declared": big, "beside": None}
    assert "VRAM budget free" in scheduling_message(core_v1.read_namespaced_pod("beside", namespace))
    assert violations_on_own_nodes(cluster, unique) == []


def test_a_gpu_sidecar_is_counted_beside_the_init_container_after_it(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    """A native sidecar (an init container with ``restartPolicy: Always``) keeps running while the
    init containers after it run: kube-scheduler asks for both together (v1.36
    pkg/api/v1/resource/helpers.go PodRequests), and so do their engines' shares on the one GPU."""
    require_extender(cluster)
    model = gpu_nodes.gpu_model("H100-80GB")
    each = int(Fraction(45, 100) * model.memory_mib * MiB) + CONTEXT + GRAPHS
    small = int(Fraction(1, 10) * model.memory_mib * MiB) + CONTEXT + GRAPHS
    assert each + small <= shared_budget(model.memory_mib) < 2 * each + small
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", model, gpus=1, replicas=4))
    engine = {"image": "vllm/vllm-openai:v0.10.0", "args": ["--model", "m", "--gpu-memory-utilization", "0.45"],
              "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    pod = server_pod("sidecar", "registry.example/web:1", [], unique)
    pod["spec"]["containers"][0].pop("resources")
    pod["spec"]["initContainers"] = [
        {"name": "embedder", "restartPolicy": "Always", **engine},
        {"name": "warm-cache", **engine},
    ]
    create_all(core_v1, namespace, [pod])
    assert settle(core_v1, namespace, 1) == {"sidecar": node}
    create_all(core_v1, namespace, [server_pod(
        "small", "vllm/vllm-openai:v0.10.0", ["--model", "m", "--gpu-memory-utilization", "0.1"], unique)])
    placed = settle(core_v1, namespace, 1)
    assert placed == {"sidecar": node, "small": None}
    assert violations_on_own_nodes(cluster, unique) == []
