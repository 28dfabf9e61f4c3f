"""The engines' memory rules by version: which allowances each claim carries, and ceiling engines.

Each expectation cites the engine's source at the versions where the rule was read (the released
wheels for vLLM and SGLang, the tags for TGI); docs/vram-model.md has the same table for people.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from vramguard import admission, cluster
from vramguard.demand.allowances import COMMUNICATION, CUDA_CONTEXT, CUDA_GRAPHS, RESERVE, SCRATCH
from vramguard.demand.derive import derive_pod_demand
from vramguard.demand.model import Vram
from vramguard.policy import Policy, default_policy

MiB = 1 << 20
GiB = 1 << 30


def reservation(image: str, args: list[str], *, env: dict[str, str] | None = None, gpus: int = 1,
                command: list[str] | None = None, policy: Policy | None = None) -> Vram:
    container: dict[str, Any] = {
        "name": "server", "image": image, "args": args, "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    if command is not None:
        container["command"] = command
    options = (policy or default_policy()).demand_options()
    demand = derive_pod_demand({"metadata": {"name": "p"}, "spec": {"containers": [container]}}, options)
    found = demand.containers[0].reservation
    assert found is not None, demand.warnings
    return found


def names(vram: Vram) -> list[str]:
    return [a.name for a in vram.allowances]


VLLM_ARGS = ["--model", "m", "--gpu-memory-utilization", "0.3"]


@pytest.mark.parametrize(
    ("tag", "extra", "env", "expected"),
    [
        # v1/executor/abstract.py: the KV cache is allocated, then graphs are captured (v0.9.1..v0.19.1).
        ("v0.9.1", [], {}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        ("v0.10.0", [], {}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        ("v0.19.1", [], {}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        # envs.py: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS exists from v0.18.0 (default 0), 1 from v0.20.0.
        ("v0.18.0", [], {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"}, [CUDA_CONTEXT]),
        ("v0.17.1", [], {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        ("v0.20.0", [], {}, [CUDA_CONTEXT]),
        ("v0.21.0", [], {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        # Model Runner V2 (v1/worker/gpu/model_runner.py profile_cudagraph_memory: "return 0" from v0.20.0 to
        # v0.28.0), the default for some dense models from v0.22.0 and for all from v0.25.0: outside again,
        # whatever the variable says; measured from v0.29.0 (vllm-project/vllm#53306).
        ("v0.22.0", [], {}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        ("v0.25.1", [], {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        ("v0.28.0", [], {}, [CUDA_CONTEXT, CUDA_GRAPHS]),
        ("v0.29.0", [], {}, [CUDA_CONTEXT]),
        ("v0.33.0", [], {}, [CUDA_CONTEXT]),
        # --enforce-eager: compile_or_warm_up_model skips capture_model.
        ("v0.10.0", ["--enforce-eager"], {}, [CUDA_CONTEXT]),
        # An unknown version: the conservative end (graphs outside).
        ("latest", [], {}, [CUDA_CONTEXT, CUDA_GRAPHS]),
    ],
)
def test_vllm_graphs_by_version(tag: str, extra: list[str], env: dict[str, str], expected: list[str]) -> None:
    vram = reservation(f"vllm/vllm-openai:{tag}", [*VLLM_ARGS, *extra], env=env)
    assert vram.fraction == Fraction(3, 10)
    assert names(vram) == expected


@pytest.mark.parametrize(
    ("tag", "communication"),
    [
        # gpu_worker.py: up to v0.10.2 the snapshot precedes distributed start-up (buffers inside the
        # share); from v0.11.0 "NCCL buffers are allocated before we measure" (outside).
        ("v0.10.2", False),
        ("v0.11.0", True),
        ("v0.21.0", True),
        ("latest", True),
    ],
)
def test_vllm_communication_buffers_by_version(tag: str, communication: bool) -> None:
    vram = reservation(f"vllm/vllm-openai:{tag}", [*VLLM_ARGS, "--tensor-parallel-size", "2"], gpus=2)
    assert (COMMUNICATION in names(vram)) is communication
    single = reservation(f"vllm/vllm-openai:{tag}", VLLM_ARGS)
    assert COMMUNICATION not in names(single)  # no peers, no buffers


@pytest.mark.parametrize(
    ("tag", "env", "ceiling"),
    [
        # The old engine, the default before v0.8.0 (envs.py: VLLM_USE_V1 defaults to "0" until v0.7.3, "1"
        # from v0.8.0): per instance (worker/worker.py determine_num_available_blocks, from a snapshot
        # taken after the CUDA context exists), but in v0.6.4 (total - free counted: device-wide).
        ("v0.5.5", {}, False),
        ("v0.6.3", {}, False),
        ("v0.6.4", {}, True),
        ("v0.6.5", {}, False),
        ("v0.7.3", {}, False),
        # V1 (v1/worker/gpu_worker.py determine_available_memory): device-wide from v0.6.5 to v0.9.0
        # (peak_memory += non_torch_allocations, every process's), per instance from v0.9.1.
        ("v0.7.3", {"VLLM_USE_V1": "1"}, True),
        ("v0.8.0", {}, True),
        ("v0.9.0", {}, True),
        ("v0.9.0", {"VLLM_USE_V1": "0"}, False),
        ("v0.9.1", {}, False),
        ("v0.10.2", {"VLLM_USE_V1": "0"}, False),
    ],
)
def test_vllm_budget_by_version_and_engine(tag: str, env: dict[str, str], ceiling: bool) -> None:
    vram = reservation(f"vllm/vllm-openai:{tag}", VLLM_ARGS, env=env)
    assert vram.ceiling is ceiling and vram.fraction == Fraction(3, 10)
    # Before v0.20.0 the graphs are captured after the KV cache is allocated: outside the share, and
    # beyond a device-wide ceiling (the context is inside a ceiling: the budget counts it).
    assert names(vram) == ([CUDA_GRAPHS] if ceiling else [CUDA_CONTEXT, CUDA_GRAPHS])
    # Each engine's graphs rule cites where that engine captures them.
    [graphs] = [a for a in vram.allowances if a.name == CUDA_GRAPHS]
    version = tuple(int(part) for part in tag.removeprefix("v").split("."))
    old_engine = env.get("VLLM_USE_V1") == "0" or (version < (0, 8, 0) and env.get("VLLM_USE_V1") != "1")
    assert ("worker/worker.py initialize_cache" in graphs.source) is old_engine, graphs.source


def test_vllm_device_wide_budget_is_a_ceiling_with_its_graphs_beyond() -> None:
    vram = reservation("vllm/vllm-openai:v0.9.0", VLLM_ARGS)
    assert vram.on_device(80 * GiB) == int(Fraction(3, 10) * 80 * GiB) + GiB
    budget = 80 * GiB
    assert vram.on_device(80 * GiB, whole=budget) == budget // 2 + 1 + GiB  # never two on one device


@pytest.mark.parametrize(
    ("tensor", "graphs"),
    [(1, GiB), (2, GiB * 5 // 3), (4, 3 * GiB), (8, 3 * GiB)],
)
def test_vllm_graphs_grow_with_tensor_parallelism(tensor: int, graphs: int) -> None:
    # vllm-project/vllm#7553 (v0.5.4, TP 4, RTX 4090): 23859 MiB per GPU with CUDA graphs, 21395 MiB with
    # --enforce-eager: 2464 MiB of graphs per GPU; the allowance grows to 3 times its amount at TP 4.
    vram = reservation("vllm/vllm-openai:v0.10.0", [*VLLM_ARGS, "--tensor-parallel-size", str(tensor)], gpus=tensor)
    [allowance] = [a for a in vram.allowances if a.name == CUDA_GRAPHS]
    assert abs(allowance.bytes - graphs) <= 1
    assert allowance.bytes >= 2464 * MiB or tensor < 4


@pytest.mark.parametrize(
    ("tag", "extra", "env", "graphs"),
    [
        # The default's largest capture is 512 at most in every version: the allowance as set.
        ("v0.15.1", [], {}, GiB),
        ("v0.15.1", ["--max-num-seqs", "1024"], {}, GiB),  # V1: min(max_num_seqs x 2, 512) (config/vllm.py)
        ("v0.15.1", ["--max-cudagraph-capture-size", "128"], {}, GiB),  # smaller: not shrunk (an estimate)
        # from v0.12: --max-cudagraph-capture-size and --cudagraph-capture-sizes (config/vllm.py v0.20.2)
        ("v0.15.1", ["--max-cudagraph-capture-size", "1024"], {}, 2 * GiB),
        ("v0.15.1", ["--max_cudagraph_capture_size=1024"], {}, 2 * GiB),
        ("v0.15.1", ["--cudagraph-capture-sizes", "1", "2", "4", "2048", "--enforce-eager"], {}, 0),
        ("v0.15.1", ["--cudagraph-capture-sizes", "1", "2", "4", "2048"], {}, 4 * GiB),
        # v0.9.x-v0.11: --cuda-graph-sizes, one value the largest, several the list (config.py v0.9.2)
        ("v0.10.0", ["--cuda-graph-sizes", "1536"], {}, 3 * GiB),
        ("v0.10.0", ["--cuda-graph-sizes=8", "16", "1024", "--trust-remote-code"], {}, 2 * GiB),
        # a compilation config, as JSON or dotted (utils/argparse_utils.py)
        ("v0.10.0", ["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 1024]}'], {}, 2 * GiB),
        ("v0.10.0", ["-O", '{"max_capture_size": 2048}'], {}, 4 * GiB),
        ("v0.20.0", ["-O.max_cudagraph_capture_size=1024"], {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"},
         2 * GiB),
        ("v0.20.0", ["--compilation-config.cudagraph_capture_sizes", "[8, 1024]"],
         {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}, 2 * GiB),
        # Junk is no size: the default's allowance.
        ("v0.10.0", ["--compilation-config", "[" * 100_000], {}, GiB),
        ("v0.10.0", ["-O", '{"cudagraph_capture_sizes": [true, "x", -5, 1e9]}'], {}, GiB),
        # The old engine captures up to the smallest 8k at or above --max-num-seqs (config.py v0.6.6).
        ("v0.6.6", ["--max-num-seqs", "1001"], {"VLLM_USE_V1": "0"}, GiB * 1008 // 512),
        ("v0.8.5", ["--max-num-seqs", "1000"], {}, GiB),  # V1, the default engine from v0.8.0: 512
    ],
)
def test_vllm_graphs_grow_with_the_largest_capture(
    tag: str, extra: list[str], env: dict[str, str], graphs: int
) -> None:
    vram = reservation(f"vllm/vllm-openai:{tag}", [*VLLM_ARGS, *extra], env=env)
    found = [a for a in vram.allowances if a.name == CUDA_GRAPHS]
    assert abs((found[0].bytes if found else 0) - graphs) <= 1, found


@pytest.mark.parametrize(
    ("args", "tensor", "scratch"),
    [
        # The profiling run skips linear-attention and Mamba layers' prefill (gdn_linear_attn.py,
        # mamba_mixer2.py "profile run", v0.20.2): tokens per step x heads per rank x 1.5 KiB, 64 heads.
        (["Qwen/Qwen3-Next-80B-A3B-Instruct"], 1, 8192 * 64 * 1536),
        (["--model", "Qwen/Qwen3.5-35B-A3B", "--max-num-batched-tokens", "2048"], 1, 2048 * 64 * 1536),
        (["--model", "nvidia/NVIDIA-Nemotron-Nano-9B-v2", "--max-num-batched-tokens", "2048"], 2, 2048 * 32 * 1536),
        (["--model", "ibm-granite/granite-4.0-h-small"], 4, 8192 * 16 * 1536),
        (["--model", "/models/local", "--mamba-ssm-cache-dtype", "float32"], 1, 8192 * 64 * 1536),
        (["--model", "moonshotai/Kimi-Linear-48B-A3B-Instruct"], 1, 8192 * 64 * 1536),
        # Not hybrid: no scratch beyond the share.
        (["--model", "meta-llama/Llama-3.1-8B-Instruct"], 1, 0),
        (["--model", "ibm-granite/granite-4.0-micro"], 1, 0),
        (["--model", "/models/local"], 1, 0),
    ],
)
def test_vllm_hybrid_models_hold_prefill_scratch_beyond_the_share(args: list[str], tensor: int, scratch: int) -> None:
    vram = reservation("vllm/vllm-openai:v0.27.1", [*args, "--gpu-memory-utilization", "0.9", "-tp", str(tensor)],
                       gpus=tensor)
    found = [a for a in vram.allowances if a.name == SCRATCH]
    assert (found[0].bytes if found else 0) == scratch
    assert all(a.estimate for a in found)


def test_vllm_hybrid_scratch_covers_the_published_reservation() -> None:
    # vllm-project/vllm#55149: Qwen3.8-27B (48 value heads) at TP 2 with 16,384 batched tokens needs an
    # "Additional reservation: 0.57 GiB" per rank for the chunked scan, which the profiling run missed.
    vram = reservation("vllm/vllm-openai:v0.29.0", ["--model", "Qwen/Qwen3.8-27B-FP8", "-tp", "2",
                                                    "--gpu-memory-utilization", "0.90",
                                                    "--max-num-batched-tokens", "16384"], gpus=2)
    [scratch] = [a for a in vram.allowances if a.name == SCRATCH]
    assert scratch.bytes >= 0.57 * GiB


def test_vllm_hybrid_scratch_is_held_beyond_a_device_wide_budget() -> None:
    vram = reservation("vllm/vllm-openai:v0.8.5", ["--model", "ai21labs/AI21-Jamba-Mini-1.6",
                                                   "--gpu-memory-utilization", "0.5"])
    assert vram.ceiling and names(vram) == [CUDA_GRAPHS, SCRATCH]


def test_vllm_share_and_allowances_add_up_on_a_device() -> None:
    vram = reservation("vllm/vllm-openai:v0.10.0", VLLM_ARGS)
    assert vram.on_device(80 * GiB) == int(Fraction(3, 10) * 80 * GiB) + 512 * MiB + GiB


def test_tgi_fraction_is_a_ceiling_on_the_device() -> None:
    # server/text_generation_server/utils/import_utils.py get_cuda_free_memory (v3.3.7):
    # free = max(0, mem_get_info free - (1 - fraction) x total), every process counted.
    vram = reservation("ghcr.io/huggingface/text-generation-inference:3.3.4", ["--cuda-memory-fraction", "0.45"])
    assert vram.ceiling and vram.allowances == ()
    budget = 77 * GiB
    assert vram.on_device(80 * GiB, whole=budget) == budget // 2 + 1
    assert 2 * vram.on_device(80 * GiB, whole=budget) > budget  # two never fit one device
    whole = reservation("ghcr.io/huggingface/text-generation-inference:3.3.4", [])
    assert whole.on_device(80 * GiB, whole=budget) == budget  # the default 1.0 takes what the budget allows


def test_sglang_reserve_follows_its_formula() -> None:
    # server_args.py (v0.5.5): 512 + max(chunked_prefill_size, 2048) x 1.5 + tp x pp / 8 x 1024
    # + cuda_graph_max_bs x 2 MiB.
    launch = ["python3", "-m", "sglang.launch_server", "--model-path", "m", "--mem-fraction-static", "0.5"]
    default = reservation("lmsysorg/sglang:v0.5.5", [], command=launch)
    assert names(default) == [CUDA_CONTEXT, RESERVE]
    assert default.allowances[1].bytes == (512 + 8192 * 3 // 2 + 128 + 256 * 2) * MiB
    tuned = reservation("lmsysorg/sglang:v0.5.5", [], gpus=2, command=[
        *launch, "--tp", "2", "--chunked-prefill-size", "1024", "--disable-cuda-graph"])
    assert names(tuned) == [CUDA_CONTEXT, COMMUNICATION, RESERVE]
    assert tuned.allowances[2].bytes == (512 + 2048 * 3 // 2 + 256) * MiB


def test_sglang_without_the_flag_takes_the_whole_device() -> None:
    # server_args.py: mem_fraction_static = (gpu_mem - reserved) / gpu_mem of the free memory, plus the
    # reserve SGLang keeps for itself: everything.
    vram = reservation("lmsysorg/sglang:v0.5.5", [], command=["python3", "-m", "sglang.launch_server"])
    assert vram.ceiling and vram.fraction == 1


def test_allowances_follow_the_policy_per_engine_and_product() -> None:
    policy = Policy.from_yaml("""
default_class: a
classes: {a: {sharing: [time-slicing]}}
allowances:
  cuda_context: 256Mi
  engines: {vllm: {cuda_graphs: 3Gi}}
  products: {"NVIDIA H200": {cuda_context: 1Gi}}
""")
    vram = reservation("vllm/vllm-openai:v0.10.0", VLLM_ARGS, policy=policy)
    share = int(Fraction(3, 10) * 80 * GiB)
    assert vram.on_device(80 * GiB) == share + 256 * MiB + 3 * GiB
    assert vram.on_device(80 * GiB, "NVIDIA H200") == share + GiB + 3 * GiB


def test_a_declaration_and_an_mps_limit_carry_no_allowance() -> None:
    spec = {"metadata": {"name": "p", "annotations": {"vramguard.io/vram": "20Gi"}}, "spec": {"containers": [{
        "name": "c", "image": "app:1", "command": ["python", "x.py"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    declared = derive_pod_demand(spec, default_policy().demand_options()).containers[0].reservation
    assert declared == Vram(bytes=20 * GiB)
    mps = reservation("vllm/vllm-openai:v0.21.0", ["--gpu-memory-utilization", "0.1"],
                      env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16G"})
    assert mps == Vram(bytes=16 * GiB)  # the pinned limit counts CUDA's own allocations (NVIDIA's MPS guide)


def test_every_service_reads_the_policys_allowances() -> None:
    """The extender's cluster model, the webhook and the CLI derive demand with the policy's amounts."""
    policy = Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none]}}\nallowances: {cuda_context: 3Gi}")
    for options in (cluster.ClusterState(policy).options, admission.AdmissionRules(policy).options):
        assert options.allowances.amount("cuda_context", "vllm") == 3 * GiB


def test_estimates_never_count_past_the_device() -> None:
    # SGLang's reserve (an estimate) beside 0.85 of an H100: the share and the context fit, the reserve
    # does not; the container counts the whole GPU and says so. A share or context past it still counts.
    launch = ["python3", "-m", "sglang.launch_server", "--model-path", "m", "--mem-fraction-static", "0.85"]
    vram = reservation("lmsysorg/sglang:v0.5.5", [], command=launch)
    device = 81559 * MiB
    share = int(Fraction(85, 100) * device)
    assert share + 512 * MiB + vram.allowances[-1].bytes > device
    assert vram.capped_on(device) and vram.on_device(device) == device
    assert not vram.capped_on(160 * GiB) and vram.on_device(160 * GiB) > int(Fraction(85, 100) * 160 * GiB)
    # vLLM at 1.0: the share and the context do not fit (its start-up check fails): never capped.
    whole = reservation("vllm/vllm-openai:v0.21.0", ["--model", "m", "--gpu-memory-utilization", "1.0"])
    assert not whole.capped_on(device) and whole.on_device(device) == device + 512 * MiB


SGLANG_RECIPES = {
    # github.com/sgl-project/sglang/issues/9787 (from the 96 x H100 deployment of issue #6017): prefill.
    "deepseek-r1-prefill-h100": ["--disaggregation-mode", "prefill", "--nnodes", "4", "--tp-size", "32",
                                 "--dp-size", "32", "--enable-dp-attention", "--mem-fraction-static", "0.835",
                                 "--chunked-prefill-size", "524288", "--max-running-requests", "8192"],
    # ai-dynamo/dynamo docs/backends/sglang/dsr1-wideep-h100.md: decode.
    "deepseek-r1-decode-h100": ["--disaggregation-mode", "decode", "--nnodes", "4", "--tp-size", "32",
                                "--dp-size", "32", "--enable-dp-attention", "--mem-fraction-static", "0.835"],
    # ai-dynamo/dynamo examples/backends/sglang/slurm_jobs/scripts/gb200-fp4/disagg/default.sh: decode
    # (its --mem-fraction-static given twice: argparse keeps the last, 0.82).
    "deepseek-r1-decode-gb200": ["--disaggregation-mode", "decode", "--nnodes", "12", "--tp-size", "48",
                                 "--dp-size", "48", "--enable-dp-attention", "--max-running-requests", "67584",
                                 "--chunked-prefill-size", "786432", "--mem-fraction-static", "0.83",
                                 "--mem-fraction-static", "0.82"],
}


@pytest.mark.parametrize("flags", SGLANG_RECIPES.values(), ids=SGLANG_RECIPES.keys())
def test_published_sglang_recipes_fit_the_gpus_they_run_on(flags: list[str]) -> None:
    # Each rank runs its chunk split among the DP attention ranks, a decode server no prefill at all
    # (server_args.py: chunked_prefill_size // dp_size, v0.4.5 and later): the reserve is for those
    # tokens, not the whole batch's (which made these 130 to 1159 GiB per GPU).
    # A decode server's graphs are padded per DP attention rank (cuda_graph_max_bs x dp x 3 MiB: 36 GiB at
    # DP 48), as SGLang's own reserve has it; a prefill server runs no decode graphs.
    launch = ["python3", "-m", "sglang.launch_server", "--model-path", "deepseek-ai/DeepSeek-R1", *flags]
    vram = reservation("lmsysorg/sglang:v0.5.5", [], command=launch, gpus=8)
    [reserve] = [a for a in vram.allowances if a.name == RESERVE]
    assert reserve.bytes <= 48 * GiB
    for device in (81559 * MiB, 189471 * MiB):  # H100 80GB, GB200 (NVML)
        assert vram.on_device(device) <= device  # placed on a GPU it owns (estimates capped)


OME_PREFILL = [
    # sgl-project/ome v0.1.5 config/runtimes/srt/deepseek-rdma-pd-rt.yaml, the prefill leader's memory flags.
    "--chunked-prefill-size", "524288", "--disable-cuda-graph", "--enable-dp-attention", "--disaggregation-mode",
    "prefill", "--mem-fraction-static", "0.849", "--tp-size", "16",
]


@pytest.mark.parametrize(
    ("dp", "tokens"),
    [
        # server_args.py (sglang 0.5.5.post3) _handle_data_parallelism runs after the memory settings:
        # chunked_prefill_size = chunked_prefill_size // dp_size with DP attention, so a rank prefills
        # 524288 // 16 = 32768 tokens; --dp-size 1 turns DP attention off (the whole chunk per rank).
        pytest.param("16", 524288 // 16, id="dp-16-splits-the-chunk"),
        pytest.param("1", 524288, id="dp-1-turns-dp-attention-off"),
        # OME sets PARALLELISM_SIZE in the pod (engine.go setParallelismEnvVarForEngine): not known here, so
        # SGLang's floor, max(chunked_prefill_size, 2048), not a chunk no rank runs (768 GiB of activations).
        pytest.param("$(PARALLELISM_SIZE)", 2048, id="dp-unknown-counts-the-floor"),
    ],
)
def test_sglang_dp_attention_splits_the_prefill_chunk(dp: str, tokens: int) -> None:
    launch = ["python3", "-m", "sglang.launch_server", "--model-path", "deepseek-ai/DeepSeek-V3", *OME_PREFILL]
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{
        "name": "s", "image": "docker.io/lmsysorg/sglang:v0.5.5.post3-cu129-amd64", "command": launch,
        "args": ["--dp-size", dp], "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}
    [container] = derive_pod_demand(pod, default_policy().demand_options()).containers
    assert container.reservation is not None
    [reserve] = [a for a in container.reservation.allowances if a.name == RESERVE]
    # server_args.py v0.5.5: 512 + max(tokens, 2048) x 1.5 + tp x pp / 8 x 1024 MiB; no decode graphs on a
    # prefill server with --disable-cuda-graph, no DeepEP term.
    assert reserve.bytes == int((512 + max(tokens, 2048) * 1.5 + 16 * 1024 / 8) * MiB)
    unknown = [w for w in container.warnings if "--dp-size $(PARALLELISM_SIZE) is not known" in w]
    assert bool(unknown) is (dp == "$(PARALLELISM_SIZE)")


def test_sglang_max_total_tokens_keeps_the_fraction_as_its_bound() -> None:
    # model_runner.py v0.5.5: the pool is min(profiled, --max-total-tokens) tokens, so never above the
    # fraction; tokens are not bytes without the model's KV size, so the fraction is counted, and said.
    capped = reservation("lmsysorg/sglang:v0.5.5", ["--model-path", "m", "--mem-fraction-static", "0.5",
                                                    "--max-total-tokens", "65536"],
                         command=["python3", "-m", "sglang.launch_server"])
    plain = reservation("lmsysorg/sglang:v0.5.5", ["--model-path", "m", "--mem-fraction-static", "0.5"],
                        command=["python3", "-m", "sglang.launch_server"])
    assert capped == plain
    demand = derive_pod_demand({"metadata": {"name": "p"}, "spec": {"containers": [{
        "name": "s", "image": "lmsysorg/sglang:v0.5.5", "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--mem-fraction-static", "0.5", "--max-total-tokens", "65536"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}, default_policy().demand_options())
    assert any("--max-total-tokens 65536" in rule for rule in demand.containers[0].rules)


def test_vllm_grpc_server_is_vllm() -> None:
    # entrypoints/grpc_server.py (v0.20.2): FlexibleArgumentParser with AsyncEngineArgs.add_cli_args, the
    # engine's memory options as `vllm serve` takes them (the Gateway API inference extension's sample).
    vram = reservation("vllm/vllm-openai:v0.20.2",
                       ["--model", "m", "--gpu-memory-utilization", "0.9", "--port", "9000"],
                       command=["python3", "-m", "vllm.entrypoints.grpc_server"])
    assert vram.fraction == Fraction(9, 10)


def test_sglang_reserve_has_its_dp_attention_speculative_and_deepep_terms() -> None:
    # server_args.py v0.5.5 / memory_hook.py v0.5.23: cuda_graph_max_bs x dp_size x 3 MiB more with DP
    # attention (x 1.5 more above a batch of 300), 2 GiB for an EAGLE draft (6 GiB standalone, none for
    # n-gram), 2 GiB for DeepEP's buffers in the decode graphs. sgl-project/sglang#24453 measured about
    # 20 GB of CUDA graphs per rank for Kimi-K2 with DeepEP at DP 32: the reserve covers it.
    launch = ["python3", "-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2-Instruct"]
    base = ["--mem-fraction-static", "0.7", "--tp-size", "32", "--nnodes", "4", "--disaggregation-mode", "decode",
            "--max-running-requests", "2048"]  # 2048 tokens a rank, with or without DP attention

    def reserve(*extra: str) -> int:
        vram = reservation("lmsysorg/sglang:v0.5.5", [*base, *extra], command=launch, gpus=8)
        return next(a.bytes for a in vram.allowances if a.name == RESERVE)

    plain = reserve()
    dp = reserve("--dp-size", "32", "--enable-dp-attention")
    assert dp - plain == 256 * 32 * 3 * MiB
    assert reserve("--dp-size", "32", "--enable-dp-attention", "--cuda-graph-max-bs", "512") - dp == (
        (512 - 256) * 2 + (512 - 256) * 32 * 3 + 512 * 32 * 3 // 2) * MiB
    assert reserve("--speculative-algorithm", "EAGLE") - plain == 2 * GiB
    assert reserve("--speculative-algorithm", "STANDALONE") - plain == 6 * GiB
    assert reserve("--speculative-algorithm", "NGRAM") == plain
    deepep = reserve("--dp-size", "32", "--enable-dp-attention", "--moe-a2a-backend", "deepep")
    assert deepep - dp == 2 * GiB and deepep - plain >= 20 * 10**9
    assert reserve("--moe-a2a-backend", "deepep", "--disable-cuda-graph") < plain  # no graphs at all


@pytest.mark.parametrize(
    ("image", "version", "graphs"),
    [
        # AMD's images carry vLLM's version after "vllm" (rocm.docs.amd.com, vLLM inference history).
        ("rocm/vllm:rocm6.2_mi300_ubuntu20.04_py3.9_vllm_0.6.4", "0.6.4", True),
        ("rocm/vllm:rocm6.3.1_vllm0.8.5_20250521", "0.8.5", True),
        ("rocm/vllm:rocm7.14.0_cdna_ubuntu24.04_py3.14_pytorch_2.11.0_vllm_0.23.0", "0.23.0", True),
        # v1/worker/gpu_worker.py v0.20.0: no graph estimate on ROCm, so graphs stay outside the share,
        # where on CUDA v0.21.0 estimates them inside it.
        ("vllm/vllm-openai-rocm:v0.21.0", "0.21.0", True),
        ("vllm/vllm-openai:v0.21.0", "0.21.0", False),
        ("rocm/vllm-dev:nightly", None, True),
    ],
)
def test_vllm_on_rocm(image: str, version: str | None, graphs: bool) -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{
        "name": "s", "image": image, "command": ["vllm", "serve", "m", "--gpu-memory-utilization", "0.9"],
        "resources": {"limits": {"amd.com/gpu": "1"}}}]}}
    [container] = derive_pod_demand(pod, default_policy().demand_options()).containers
    assert container.resource == "amd.com/gpu" and container.engine_version == version
    assert container.reservation is not None
    assert (CUDA_GRAPHS in names(container.reservation)) is graphs


@pytest.mark.parametrize(
    ("image", "version"),
    [
        # vLLM's own images, under any registry or mirror path (docs/deployment/docker.md: vllm/vllm-openai).
        ("vllm/vllm-openai:v0.11.0", "0.11.0"),
        ("docker.io/vllm/vllm-openai:v0.8.5", "0.8.5"),
        ("registry.example.com/mirror/vllm/vllm-openai:v0.9.2", "0.9.2"),
        ("vllm/vllm-openai-rocm:v0.21.0", "0.21.0"),
        # Rebuilds that keep vLLM's tag, each with its origin: KubeAI's (charts/kubeai/values.yaml v0.21.0),
        # AIBrix's (aibrix docs/source/getting_started/container-images.rst) and Kthena's copy of it.
        ("substratusai/vllm-gh200:v0.8.3", "0.8.3"),
        ("kvcache-container-image-hb2-cn-beijing.cr.volces.com/aibrix/vllm-openai:v0.10.0-cu128-nixl-v0.4.1", "0.10.0"),
        ("ghcr.io/volcano-sh/vllm-openai:v0.10.0-cu128-nixl-v0.4.1-lmcache-0.3.2", "0.10.0"),
        # Anyone else's vllm repository says nothing of vLLM's version (coreweave/kubernetes-cloud's
        # online-inference/vllm sample runs rtalaricw/vllm:0.1).
        ("rtalaricw/vllm:0.1", None),
        ("example/vllm-openai:v0.5.0", None),
        ("vllm-openai:v0.10.0", None),
    ],
)
def test_only_vllms_images_and_documented_rebuilds_give_its_version(image: str, version: str | None) -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{
        "name": "s", "image": image, "command": ["vllm", "serve", "m"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    [container] = derive_pod_demand(pod, default_policy().demand_options()).containers
    assert container.engine == "vllm" and container.engine_version == version


@pytest.mark.parametrize(
    ("image", "known"),
    [("lmsysorg/sglang:v0.5.23-cu130", True), ("aibrix/sglang:v0.5.23-aibrix", True),
     ("example/sglang:v0.5.23", False)],
)
def test_only_sglangs_images_and_documented_rebuilds_give_its_version(image: str, known: bool) -> None:
    # --cuda-graph-max-bs is ambiguous from v0.5.20 (SGLang exits): said only where the tag is SGLang's
    # version (lmsysorg/sglang, and AIBrix's build of its tags: container-images.rst).
    reservation_args = ["--mem-fraction-static", "0.5", "--cuda-graph-max-bs", "8"]
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{
        "name": "s", "image": image, "command": ["python3", "-m", "sglang.launch_server", *reservation_args],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    [container] = derive_pod_demand(pod, default_policy().demand_options()).containers
    assert any("v0.5.20 and later" in e for e in container.errors) is known
