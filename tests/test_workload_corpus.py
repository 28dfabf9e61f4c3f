"""A corpus of workloads as the projects people deploy with publish them, read end to end.

Every file under tests/data/workloads is explained with the shipped policy; each template must
come out with its pods at full scale, and each GPU container with its engine, devices and share.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramguard.admission import workload_pods
from vramguard.demand import DemandOptions
from vramguard.demand.objects import load_each_document
from vramguard.policy import default_policy
from vramguard.quantity import GiB, MiB
from vramguard.workloads import object_parts, parts_demand, read_inputs

CORPUS = Path(__file__).parent / "data" / "workloads"

# file -> [(template, pods, [(container, engine, gpus, fraction or bytes per GPU, or None)])] for the
# last object of the file (runtimes come first); templates without GPU containers are listed with [].
Expected = list[tuple[str, int, list[tuple[str, str | None, int, float | int | None]]]]
EXPECTED: dict[str, Expected] = {
    "lws-vllm-ray.yaml": [
        # vllm-openai:latest names no version: vLLM's newest default, the whole device (a ceiling).
        ("leader", 2, [("vllm-leader", "vllm", 8, 1.0)]),
        ("worker", 2, [("vllm-worker", "vllm", 8, 1.0)]),  # the leader's command, over the group of 2
    ],
    "lws-sglang.yaml": [
        ("leader", 1, [("sglang-leader", "sglang", 1, 0.85)]),
        ("worker", 1, [("sglang-worker", "sglang", 1, 0.85)]),
    ],
    "lws-vllm-nnodes.yaml": [
        ("leader", 1, [("vllm", "vllm", 8, 0.9)]),
        ("worker", 1, [("vllm", "vllm", 8, 0.9)]),
    ],
    "lws-worker-template-only.yaml": [
        ("leader", 1, [("tgi", "tgi", 1, 0.5)]),
        ("worker", 3, [("tgi", "tgi", 1, 0.5)]),
    ],
    "lws-vllm-ray-pod-leader.yaml": [("pod", 1, [("vllm-leader", "vllm", 8, 0.95)])],
    "raycluster-gpu-workers.yaml": [
        ("head", 1, []),
        ("worker[gpu-group]", 4, [("ray-worker", None, 1, None)]),  # maxReplicas: full scale
    ],
    "raycluster-multihost.yaml": [("head", 1, []), ("worker[hosts]", 4, [("ray-worker", "jax", 4, 0.5)])],
    "rayservice-vllm.yaml": [("head", 1, []), ("worker[gpu-group]", 2, [("llm", None, 2, None)])],
    # Ray Serve LLM in serveConfigV2: vLLM with the application's engine_kwargs on every worker GPU.
    "rayservice-llm-serve-qwen.yaml": [("head", 1, []), ("worker[gpu-group]", 1, [("ray-worker", "vllm", 4, 0.75)])],
    "rayservice-llm-deepseek-tp8-pp2.yaml": [
        ("head", 1, []),
        ("worker[gpu-group]", 2, [("ray-worker", "vllm", 8, 0.92)]),
    ],
    "rayjob-gpu.yaml": [("head", 1, []), ("worker[gpu]", 2, [("ray-worker", None, 1, None)])],
    "kserve-isvc-huggingface.yaml": [("predictor", 1, [("kserve-container", "vllm", 1, 0.8)])],
    "kserve-isvc-with-runtime.yaml": [("predictor", 2, [("kserve-container", "vllm", 2, 0.7)])],
    "kserve-isvc-hf-autoselect.yaml": [("predictor", 1, [("kserve-container", "vllm", 1, 0.6)])],
    "kserve-isvc-custom-vllm.yaml": [("predictor", 3, [("kserve-container", "vllm", 1, 0.45)])],
    "kserve-isvc-tgi-transformer.yaml": [
        ("predictor", 1, [("kserve-container", "tgi", 2, 0.6)]),
        ("transformer", 1, []),
    ],
    "kserve-servingruntime-vllm.yaml": [("runtime", 1, [("kserve-container", "vllm", 1, 0.5)])],
    # The framework shorthands run TorchServe and TF Serving: no engine vramguard reads, a whole GPU.
    "kserve-isvc-legacy-pytorch-gpu.yaml": [("predictor", 1, [("kserve-container", None, 1, None)])],
    "kserve-isvc-legacy-tensorflow-gpu.yaml": [("predictor", 1, [("kserve-container", None, 1, None)])],
    # A tuning Workspace trains in a Job of one pod: unknown VRAM, a whole GPU (KAITO v0.12.0).
    "kaito-workspace-tuning-phi-3.yaml": [("tuning", 1, [("workspace-tuning-phi-3", None, 1, None)])],
    "jobset-pytorch.yaml": [("job[workers]", 4, [("pytorch", None, 8, None)])],
    "jobset-vllm-leader-workers.yaml": [
        ("job[leader]", 1, [("vllm", "vllm", 4, 0.88)]),
        ("job[worker]", 1, [("ray", None, 4, None)]),
    ],
    "pytorchjob.yaml": [
        ("replica[Master]", 1, [("pytorch", None, 1, None)]),
        ("replica[Worker]", 3, [("pytorch", None, 1, None)]),
    ],
    "mpijob.yaml": [("replica[Launcher]", 1, []), ("replica[Worker]", 2, [("tensorflow-benchmarks", None, 1, None)])],
    "deployment-vllm-gke.yaml": [("deployment", 1, [("inference-server", "vllm", 1, 0.95)])],
    "deployment-tgi-gke-dlc.yaml": [("deployment", 1, [("inference-server", "tgi", 2, 0.9)])],
    "statefulset-sglang.yaml": [("statefulset", 2, [("sglang", "sglang", 8, 0.8)])],
    "deployment-dynamo-vllm.yaml": [("deployment", 2, [("main", "vllm", 2, 0.7)])],
    "deployment-dynamo-sglang.yaml": [("deployment", 1, [("main", "sglang", 1, 0.6)])],
    "deployment-production-stack.yaml": [("deployment", 1, [("vllm", "vllm", 1, 0.8)])],
    "deployment-aibrix.yaml": [("deployment", 1, [("vllm-openai", "vllm", 1, 0.9)])],
    "deployment-nim.yaml": [("deployment", 1, [("nim", None, 1, 0.9)])],  # declared
    "job-jax.yaml": [("job", 2, [("train", "jax", 1, 0.5)])],
    # Serving operators' own kinds, read as their controllers render the pods (vramguard.operators);
    # the expectations and their sources are in each file's header.
    "kubeai-model-llama-3.1-8b-instruct-fp8-l4.yaml": [("model", 1, [("server", "vllm", 1, 0.9)])],
    # Pods at full scale: maxReplicas, else replicas, else one (a Model scales from zero).
    "kubeai-model-llama-3.1-405b-instruct-fp8-a100-80b.yaml": [("model", 1, [("server", "vllm", 8, 0.98)])],
    "kubeai-model-llama-3.1-8b-l4-2-replicas.yaml": [("model", 2, [("server", "vllm", 1, 0.6)])],
    "kaito-workspace-phi-4-mini.yaml": [("workspace", 1, [("workspace-phi-4-mini", "vllm", 1, 0.84)])],
    "kaito-workspace-custom-config.yaml": [
        ("workspace", 1, [("workspace-deepseek-r1-distill-qwen-14b", "vllm", 1, 0.95)]),
    ],
    "kaito-workspace-llama-3.3-70b-instruct.yaml": [
        ("workspace", 2, [("workspace-llama-3-3-70b-instruct", "vllm", 2, 0.95)]),
    ],
    "nimservice-basic-gpu-limit.yaml": [("deployment", 1, [("meta-llama-3-2-1b-instruct-ctr", None, 1, None)])],
    "nimservice-multinode-lws.yaml": [
        ("leader", 1, [("nim-leader", None, 8, None)]),
        ("worker", 1, [("nim-worker", None, 8, None)]),
    ],
    # Engine defaults: a vLLM image of unknown version, SGLang without --mem-fraction-static: the whole GPU.
    "dynamo-vllm-agg.yaml": [("Frontend", 1, []), ("worker", 1, [("main", "vllm", 1, 1.0)])],
    "dynamo-vllm-disagg.yaml": [
        ("Frontend", 1, []),
        ("VllmDecodeWorker", 1, [("main", "vllm", 1, 1.0)]),
        ("VllmPrefillWorker", 1, [("main", "vllm", 1, 1.0)]),
    ],
    "dynamo-sglang-agg.yaml": [("Frontend", 1, []), ("decode", 1, [("main", "sglang", 1, 1.0)])],
    "dynamo-sglang-disagg-multinode.yaml": [
        ("Frontend", 1, []),
        ("decode", 2, [("main", "sglang", 4, 0.82)]),
        ("prefill", 2, [("main", "sglang", 4, 0.82)]),
    ],
    "vllmruntime-sample.yaml": [("deployment", 2, [("vllm", "vllm", 1, 0.8)])],
    # Other sharing systems' declarations (vramguard.demand.foreign); the share is the declaration,
    # HAMi's percentage the cap vLLM's fraction applies to (0.95 of 0.3 stays within 0.3).
    "hami-gpumem.yaml": [("pod", 1, [("ubuntu-container", None, 1, 3000 * MiB)])],
    "hami-gpumem-percentage-vllm.yaml": [("deployment", 1, [("vllm", "vllm", 2, 0.3)])],
    "kai-gpu-fraction-non-default-container.yaml": [("pod", 1, [("gpu-workload", None, 1, 0.5)])],
    "volcano-vgpu-multi-container.yaml": [
        ("pod", 1, [("ubuntu-container", None, 2, 2000 * MiB), ("ubuntu-container1", None, 2, 3000 * MiB)]),
    ],
    "gpushare-binpack-1.yaml": [("deployment", 1, [("binpack-1", None, 1, 2 * GiB)])],
    "cronjob-vllm-batch.yaml": [("cronjob", 1, [("batch", "vllm", 1, 0.3)])],
    # AMD GPUs (amd.com/gpu): vLLM on ROCm sizes its share of the HIP total as on CUDA; rocm/vllm tags carry
    # vLLM's version after "vllm" (0.6.4 here: default 0.9, the old engine's device-wide budget).
    "amd-vllm-serve-deployment.yaml": [("deployment", 1, [("mistral-7b", "vllm", 1, 0.9)])],
    # llm-d's AMD P/D patches (no image in the patch: the version unknown, the newest default, the device).
    "llm-d-amd-pd-decode.yaml": [("deployment", 1, [("modelserver", "vllm", 4, 1.0)])],
    "llm-d-amd-pd-prefill.yaml": [("deployment", 4, [("modelserver", "vllm", 1, 1.0)])],
    "llm-d-amd-moriio-decode.yaml": [("deployment", 1, [("modelserver", "vllm", 2, None)])],  # KV bytes
    # The kinds of 2025-2026 serving and training projects, read from their pod templates (workload_kinds);
    # expectations from each file's header (its project's types and docs at the tag cited there).
    # LLMInferenceService's containers take their image and command from KServe's config: unknown VRAM.
    # A wide-EP role's arguments use ${LWS_WORKER_INDEX:-0}, which vramguard cannot read: unknown VRAM.
    # A vLLM-Omni container (--omni) sums its stages' fractions per GPU from a file: unknown VRAM.
    "aibrix-sglang-tp-1p1d.yaml": [
        ("role[routing]", 1, []),
        ("role[prefill]", 2, [("prefill", "sglang", 1, 0.8)]),
        ("role[decode]", 2, [("decode", "sglang", 1, 0.8)]),
    ],
    "aibrix-vllm-pool-xpyd.yaml": [
        ("role[prefill]", 4, [("prefill", "vllm", 1, 0.9)]),
        ("role[decode]", 3, [("decode", "vllm", 1, 0.9)]),
    ],
    "argo-coreweave-gpu-say-workflow.yaml": [("script[gpu-echo]", 1, [("main", None, 1, None)])],
    "gaie-vllm-gpu-grpc-deployment.yaml": [("deployment", 1, [("vllm-server", "vllm", 1, 0.9)])],
    # rtalaricw/vllm:0.1 is no image of vLLM's: its version is unknown, so vLLM's newest default, the whole
    # device (a ceiling), as for lws-vllm-ray.yaml.
    "knative-coreweave-vllm-ksvc.yaml": [("revision", 1, [("kfserving-container", "vllm", 1, 1.0)])],
    "knative-gke-gemma3-vllm-ksvc.yaml": [("revision", 1, [("vllm", "vllm", 1, 0.95)])],
    "kserve-isvc-triton-huggingface-gpu.yaml": [
        ("predictor", 1, [("kserve-container", None, 1, None)]),
        ("transformer", 1, []),
    ],
    "kserve-llmisvc-deepseek-dp-ep-multinode-gpu.yaml": [
        ("server", 1, [("main", None, 8, None)]),
        ("worker", 1, [("main", None, 8, None)]),
    ],
    "kserve-llmisvc-qwen2-7b-pd-gpu.yaml": [
        ("server", 1, [("main", None, 1, None)]),
        ("prefill", 2, [("main", None, 1, None)]),
    ],
    "kserve-llmisvc-qwen2-7b-single-gpu.yaml": [("server", 3, [("main", None, 1, None)])],
    "kthena-data-parallel-deployment.yaml": [
        ("entry[leader]", 1, [("engine", "vllm", 1, 0.9)]),
        ("worker[leader]", 1, [("example-vllm-worker", "vllm", 1, 0.9)]),
    ],
    "kthena-gpu-pd-disaggregation.yaml": [
        ("entry[prefill]", 1, [("prefill", "vllm", 1, 0.9)]),
        ("entry[decode]", 1, [("decode", "vllm", 1, 0.9)]),
    ],
    "kthena-multi-node.yaml": [
        ("entry[405b]", 2, [("leader", "vllm", 8, 1.0)]),
        ("worker[405b]", 2, [("worker", "vllm", 8, 1.0)]),
    ],
    # A TrainJob's own trainer container (resourcesPerNode on numNodes pods); its runtime is read on its own.
    "kubeflow-trainer-kai-trainjob.yaml": [("trainer", 4, [("node", None, 1, None)])],
    "kubeflow-trainer-torchtune-llama3.2-1b-runtime.yaml": [
        ("job[dataset-initializer]", 1, []),
        ("job[model-initializer]", 1, []),
        ("job[node]", 1, [("node", None, 2, None)]),
    ],
    "llmd-pd-disaggregatedset.yaml": [
        ("leader[prefill]", 8, [("modelserver", "vllm", 1, 1.0)]),
        ("leader[decode]", 2, [("modelserver", "vllm", 4, 1.0)]),
        ("worker[prefill]", 0, [("modelserver", "vllm", 1, 1.0)]),
        ("worker[decode]", 0, [("modelserver", "vllm", 4, 1.0)]),
    ],
    # The start rank $(( ${LWS_WORKER_INDEX:-0} * DP_SIZE_LOCAL )) is one number, never options; the
    # decode role's image is a placeholder, so vLLM's default reads as the whole device.
    "llmd-wide-ep-disaggregatedset.yaml": [
        ("leader[prefill]", 1, [("vllm", "vllm", 8, 0.8)]),
        ("leader[decode]", 1, [("vllm", "vllm", 8, 1.0)]),
        ("worker[prefill]", 1, [("vllm", "vllm", 8, 0.8)]),
        ("worker[decode]", 1, [("vllm", "vllm", 8, 1.0)]),
    ],
    # OME's InferenceService over the runtime it names (MergeEngineSpec, ome v0.1.5): the runtime's leader
    # and worker runners, minReplicas groups of a leader and worker.size workers.
    "ome-inferenceservice-deepseek-v3-pd.yaml": [
        ("engine-leader", 1, [("ome-container", "sglang", 8, 0.849)]),
        ("engine-worker", 1, [("ome-container", "sglang", 8, 0.849)]),
        ("decoder-leader", 1, [("ome-container", "sglang", 8, 0.835)]),
        ("decoder-worker", 1, [("ome-container", "sglang", 8, 0.835)]),
    ],
    "ome-srt-deepseek-rdma-pd-rt.yaml": [
        ("engine-leader", 1, [("ome-container", "sglang", 8, 0.849)]),
        ("engine-worker", 1, [("ome-container", "sglang", 8, 0.849)]),
        ("decoder-leader", 1, [("ome-container", "sglang", 8, 0.835)]),
        ("decoder-worker", 1, [("ome-container", "sglang", 8, 0.835)]),
    ],
    "ome-srt-mistral-7b-instruct-pd-rt.yaml": [
        ("engine", 1, [("ome-container", "sglang", 2, 0.9)]),
        ("decoder", 1, [("ome-container", "sglang", 2, 0.9)]),
    ],
    "ome-vllm-llama-3-1-8b-instruct-rt.yaml": [("engine", 1, [("ome-container", "vllm", 1, 0.9)])],
    "rbg-pd-disagg-leader-worker.yaml": [
        ("role[router]", 1, []),
        ("role[prefill]", 8, [("sglang", "sglang", 1, 1.0)]),
        ("role[decode]", 8, [("sglang", "sglang", 1, 1.0)]),
    ],
    "rbg-sglang-pd-v1alpha1.yaml": [
        ("role[router]", 1, []),
        ("role[prefill]", 1, [("sglang-prefill", "sglang", 2, 1.0)]),
        ("role[decode]", 1, [("sglang-decode", "sglang", 2, 0.9)]),
    ],
    "rbg-vllm-pd-disagg-mooncake-te.yaml": [
        ("role[router]", 1, []),
        ("role[prefill]", 1, [("vllm", "vllm", 1, 1.0)]),
        ("role[decode]", 1, [("vllm", "vllm", 1, 1.0)]),
    ],
    "vllm-omni-llmd-qwen3-omni-deployment.yaml": [("deployment", 1, [("modelserver", "vllm", 2, None)])],
    "volcano-mindspore-gpu.yaml": [("task[mpimaster]", 1, []), ("task[mpiworker]", 2, [("mpiworker", None, 1, None)])],
    # AMD: a partition resource (amd.com/cpx_nps4, ROCm/k8s-device-plugin v1.31.0.10) is a device of its own;
    # vllm/vllm-openai-rocm tags are vLLM's version (v0.27.1: default 0.92, vllm/config/cache.py).
    "amd-pytorch-cpx-nps4-pod.yaml": [("pod", 1, [("pytorch-gpu-container", None, 1, None)])],
    "llm-d-amd-optimized-baseline-vllm-rocm.yaml": [("deployment", 2, [("modelserver", "vllm", 2, 0.92)])],
    "kserve-llmisvc-qwen2-7b-amd-no-scheduler.yaml": [("server", 2, [("main", None, 1, None)])],
    # --data-parallel-size-local GPUs per pod; an empty --kv-cache-memory-bytes= is unset (vllm/engine/arg_utils.py).
    "llm-d-wide-ep-lws-decode.yaml": [
        ("leader", 1, [("vllm", "vllm", 8, 0.9)]),
        ("worker", 1, [("vllm", "vllm", 8, 0.9)]),
    ],
    # Argo: one pod per container template; a podSpecPatch is applied to the pod (workflow_types.go, v4.1.2)
    # after its parameters: gpu_count is what the step passes, workflow.parameters.trainer_gpu_count = '1'.
    "argo-coreweave-sd-finetune-workflowtemplate.yaml": [
        ("container[model-downloader]", 1, []),
        ("container[model-finetuner]", 1, [("main", None, 1, None)]),
        ("container[serializer]", 1, []),
    ],
    "argo-cron-workflow-gpu.yaml": [("container[hello-world-with-time]", 1, [("main", None, 1, None)])],
    # Argo v4.1.2: a containerSet's containers keep their names; a template's sidecars and initContainers
    # join its pod (workflowpod.go addSidecars, addInitContainers).
    "argo-container-set-gpu-workflow.yaml": [("container-set[main]", 1, [("a", None, 1, None)])],
    "argo-sidecar-vllm-workflow.yaml": [("container[sidecar-example]", 1, [("vllm", "vllm", 1, 0.85)])],
    "argo-init-container-gpu-workflow.yaml": [("container[init-container-example]", 1, [("hello", None, 1, None)])],
    # Argo fills {{workflow.parameters.*}} and {{inputs.parameters.*}} in the command before the pod runs:
    # the input's default adds --gpu-memory-utilization 0.9 after the workflow's 0.6, and vLLM takes the last.
    "argo-vllm-arguments-parameters.yaml": [("container[serve]", 1, [("main", "vllm", 1, 0.9)])],
    # KServe multi-node: the workerSpec's worker pod, one counted (KServe computes the count, with a warning).
    "kserve-isvc-multinode-workerspec.yaml": [
        ("predictor", 1, []),
        ("worker", 1, [("worker-container", None, 8, None)]),
    ],
    # Kubeflow Trainer v2.3.0: the TrainJob after its runtime in the same file.
    "kubeflow-trainer-flux-lammps-gpus.yaml": [("trainer", 2, [("node", None, 1, None)])],
    "kubeflow-trainer-multi-step-trainingruntime.yaml": [("trainer", 2, [])],
}

KNOWN_MISREADS: dict[str, str] = {}
"""Files whose expectation (from the project's source) vramguard does not meet yet: strict xfails."""


def test_the_corpus_is_large_and_every_file_has_an_expectation() -> None:
    files = sorted(p.name for p in CORPUS.glob("*.yaml"))
    assert files == sorted(EXPECTED)
    assert len(files) >= 25


ERRORS = {
    # As published, its ConfigMap's tensor-parallel-size: 2 overrides KAITO's on a one-GPU instance.
    "kaito-workspace-custom-config.yaml": [
        "container workspace-deepseek-r1-distill-qwen-14b: vLLM: --tensor-parallel-size=2 = 2 GPUs, but the "
        "container requests 1 nvidia.com/gpu; make them equal"
    ],
}
"""The errors of published manifests that are wrong as published (each explained in its file)."""


def read(name: str) -> Expected:
    """What the shipped policy makes of the last object of a corpus file."""
    policy = default_policy()
    documents = load_each_document((CORPUS / name).read_text(encoding="utf-8"))
    assert all(d.error is None for d in documents)
    objects = [o for d in documents for o in d.objects]
    parts = object_parts(objects[-1], policy.workload_kinds, workload_pods, read_inputs(objects))
    assert parts is not None, "the kind is read"
    demands = parts_demand(parts, DemandOptions(frozenset(policy.gpu_resources), policy.gpu_resource_prefixes))
    out = []
    errors = [e for demand in demands for e in demand.errors]
    assert errors == ERRORS.get(name, [])
    for part, demand in zip(parts, demands, strict=True):
        containers = []
        for c in demand.containers:
            vram = c.reservation
            share = None if vram is None else float(vram.fraction) if vram.fraction is not None else vram.bytes
            containers.append((c.name, c.engine, c.gpus, share))
        out.append((part.name, part.pods, containers))
    return out


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISREADS[name]))
    if name in KNOWN_MISREADS else name
    for name in sorted(EXPECTED)
])
def test_corpus_manifest(name: str) -> None:
    assert read(name) == EXPECTED[name]

