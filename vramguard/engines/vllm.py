"""vLLM: ``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``, the ``vllm-openai`` image.

vLLM pre-allocates ``--gpu-memory-utilization`` x the device's *total* memory on every GPU it uses
(``torch.cuda.mem_get_info`` total, ``vllm/v1/worker/gpu_worker.py``). It uses tensor x pipeline x
prefill-context parallel x local data parallel GPUs, in total over the ``--nnodes`` pods (or the Ray
cluster) it spans. Its argument parser accepts ``_`` for ``-`` in option names, and the last
occurrence wins. What else it holds depends on the version and the engine generation (``VLLM_USE_V1``
picks it from v0.6.4 to v0.10.2; V1 is the default from v0.8.0, the only one from v0.11.0), read in
the released wheels:

================  =============================================================================
budget            *per instance*: ``total x utilization`` less what the process added since a
                  snapshot taken after its CUDA context exists (the context outside the share):
                  the old engine (``worker/worker.py``) except v0.6.4, V1 from v0.9.1. *Device-wide*:
                  less every process's use (``determine_available_memory``), a ceiling on the
                  device, co-tenants and the context inside: the old engine in v0.6.4, V1 from
                  v0.6.5 to v0.9.0 (the default engine from v0.8.0)
CUDA graphs       captured after the KV cache is allocated, outside the share (and beyond a
                  device-wide ceiling), in every version before v0.20.0 (``worker/worker.py``
                  ``_warm_up_model``; ``v1/executor/abstract.py``) unless
                  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`` (from v0.18.0, default 0);
                  estimated inside it from v0.20.0 (the variable defaults to 1; ``=0`` puts them
                  outside again); outside again from v0.22.0 to v0.28.0, where Model Runner V2,
                  the default for dense models from v0.25.0 and for some from v0.22.0, estimates
                  them as 0 (``v1/worker/gpu/model_runner.py`` ``profile_cudagraph_memory``,
                  vllm-project/vllm#49224, measured from v0.29.0); measured before the KV cache is
                  sized from v0.34.0. They grow with tensor parallelism (vllm-project/vllm#7553:
                  2.4 GiB per GPU at TP 4) and with the largest batch captured
                  (:mod:`vramguard.engines.vllm_graphs`)
communication     NCCL and custom all-reduce buffers are allocated before the snapshot from
                  v0.11.0: outside the share when tensor x pipeline parallel > 1 (inside it before)
default           0.9; 0.92 from v0.20.0 (``config/cache.py``); from v0.34.0 without
                  ``--gpu-memory-utilization`` the extensible KV cache sizes itself from the memory
                  free after graph capture (``resolved_gpu_memory_utilization`` = 1.0): the whole
                  device
hybrid models     linear-attention and state-space layers' prefill scratch, which the profiling
                  run misses, outside the share (:mod:`vramguard.engines.vllm_hybrid`)
================  =============================================================================

``--enforce-eager`` captures no graphs. Only the tags of vLLM's own images and of the rebuilds listed
with their origin name vLLM's version (:data:`VERSIONED_IMAGES`: ``vllm/vllm-openai:v0.11.0``, under any
registry or mirror path); another owner's ``vllm`` repository (``someone/vllm:0.1``) is of unknown
version, and the tag of an image that bundles vLLM with something else is that product's version
(``rayproject/ray-llm:2.52.0``, Dynamo's ``vllm-runtime:0.4.0``). An image whose tag names no vLLM
version takes the conservative end of every rule, and says so.

**Settings vramguard cannot see make the VRAM unknown.** ``--kv-cache-memory-bytes`` sizes the KV
cache to that many bytes and skips the profiling that applies the utilization ("This does not
respect the gpu_memory_utilization config", ``determine_available_memory`` in
``v1/worker/gpu_worker.py``): the engine then holds its weights and activations beside those bytes,
which the manifest does not say. ``--num-gpu-blocks-override`` likewise replaces the profiled
block count (:data:`BLOCKS_OVERRIDE`). ``--config FILE`` reads options from a YAML file, inserted before
the command line's own (``FlexibleArgumentParser._pull_args_from_config`` in ``vllm/utils``): the
file may set ``kv-cache-memory-bytes``, which no utilization on the command line bounds. An argument
the spec does not show (``$(EXTRA_ARGS)`` from a Secret) may add any of these flags. In all these
cases the claim is unknown, and the container must declare its VRAM. (vLLM reads no option from
the environment.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Overheads, Parallel, Vram
from vramguard.engines.base import Abbreviations, Findings, Options, parallel_layout, parse_positive_int
from vramguard.engines.launchers import image_name, image_tag, program, python_module, version_from_tag
from vramguard.engines.vllm_graphs import REFERENCE, largest_capture
from vramguard.engines.vllm_hybrid import hybrid_family, scratch_bytes

NAME = "vllm"
VERSIONED_IMAGES = frozenset({
    # vLLM's own (Docker Hub vllm/vllm-openai, docs/deployment/docker.md; vllm-openai-rocm, its ROCm build).
    "vllm/vllm-openai", "vllm/vllm-openai-rocm",
    # KubeAI's builds of vLLM's releases, tagged with them (charts/kubeai/values.yaml v0.21.0:
    # substratusai/vllm-gh200:v0.8.3, substratusai/vllm:v0.6.3.post1-cpu).
    "substratusai/vllm-gh200", "substratusai/vllm",
    # AIBrix's vLLM with its KV cache: the upstream tag, then its own (vllm-project/aibrix
    # docs/source/getting_started/container-images.rst: vllm/vllm-openai:v0.10.2 ->
    # aibrix/vllm-openai:v0.10.2-aibrix-v0.5.0-...); Kthena serves the same build of the same tag from its
    # own registry (volcano-sh/kthena v1.0.0 docs/kthena/docs/user-guide/model-deployment.md and
    # prefill-decode-disaggregation/vllm-pd-disaggregation.md: v0.10.0-cu128-nixl-v0.4.1-lmcache-0.3.2).
    "aibrix/vllm-openai", "volcano-sh/vllm-openai",
})
"""Repositories (owner and name, any registry or mirror path before them: :func:`image_name`) of images
whose tag is vLLM's own version. Any other image of vLLM (``someone/vllm:0.1``) is of unknown version,
whatever its tag says."""
ROCM_IMAGES = frozenset({"rocm/vllm", "rocm/vllm-dev"})
"""AMD's ROCm builds, whose tags carry vLLM's version after ``vllm``: ``rocm6.4.1_vllm_0.10.1_20250909``,
``rocm6.3.1_vllm0.8.5_20250521``, ``rocm6.2_mi300_ubuntu20.04_py3.9_vllm_0.6.4`` (rocm.docs.amd.com,
vLLM inference history)."""
_ROCM_TAG = re.compile(r"(?:^|_)vllm_?(\d{1,3})\.(\d{1,3})(?:\.(\d{1,3}))?(?:$|[_.-])")
PROGRAM = "vllm"
"""The console script: ``vllm serve``."""
MODULES = frozenset({"vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server",
                     "vllm.entrypoints.grpc_server"})
"""Servers started as modules; the gRPC one (the Gateway API inference extension's gRPC sample) takes
the same engine options (``entrypoints/grpc_server.py`` ``AsyncEngineArgs.add_cli_args``, v0.20.2)."""
Version = tuple[int, int, int]
V0_DEVICE_WIDE: tuple[Version, Version] = ((0, 6, 4), (0, 6, 5))
"""The old engine's budget was device-wide in v0.6.4 alone (``worker/worker.py``
``determine_num_available_blocks``: ``total_allocated_bytes = mem_get_info()[1] - mem_get_info()[0]``)."""
V1_DEVICE_WIDE: tuple[Version, Version] = ((0, 6, 5), (0, 9, 1))
"""V1's budget was device-wide from v0.6.5 to v0.9.0 (``v1/worker/gpu_worker.py``
``determine_available_memory``: ``peak_memory += non_torch_allocations``, every process's)."""
V1_SINCE: Version = (0, 6, 4)
V1_DEFAULT_SINCE: Version = (0, 8, 0)
V0_GONE_SINCE: Version = (0, 11, 0)
ENGINE_VARIABLE = "VLLM_USE_V1"
COMMUNICATION_OUTSIDE_SINCE: Version = (0, 11, 0)
GRAPHS_ESTIMATE_SINCE: Version = (0, 18, 0)
GRAPHS_INSIDE_SINCE: Version = (0, 20, 0)
GRAPHS_UNESTIMATED: tuple[Version, Version] = ((0, 22, 0), (0, 29, 0))
"""Model Runner V2 (the default for some dense models from v0.22.0, for every dense one from
v0.25.0) estimates CUDA graphs as 0 until v0.29.0 measures them."""
GRAPHS_TENSOR_GROWTH = Fraction(2, 3)
"""CUDA graphs per GPU grow with tensor parallelism (a custom all-reduce buffer per captured size):
each extra rank up to 4 adds two thirds of the single-GPU allowance, so TP 4 holds 3 times it
(vllm-project/vllm#7553, v0.5.4, TP 4: 2464 MiB per GPU more than with ``--enforce-eager``)."""
DEFAULT_092_SINCE: Version = (0, 20, 0)
EXTENSIBLE_CACHE_SINCE: Version = (0, 34, 0)
DEFAULT_BEFORE_0_20 = Fraction(9, 10)
DEFAULT_SINCE_0_20 = Fraction(92, 100)
GRAPHS_VARIABLE = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
EAGER = ("--enforce-eager",)
SOURCE = "vllm/v1/worker/gpu_worker.py"
UTILIZATION = ("--gpu-memory-utilization", "--device-memory-utilization")
"""The second is an alias of the first (the same ``dest``, ``engine/arg_utils.py`` v0.34.0)."""
KV_CACHE_BYTES = ("--kv-cache-memory-bytes",)
BLOCKS_OVERRIDE = ("--num-gpu-blocks-override",)
"""Replaces the profiled number of KV cache blocks: the cache is that many blocks whatever the
utilization says, never checked against the device (``v1/core/kv_cache_utils.py``
``_get_kv_cache_config_uniform_type`` v0.8.5: "Overriding num_gpu_blocks=%d with
num_gpu_blocks_override=%d"; ``engine/llm_engine.py`` in the old engine; ``v1/core/kv_cache_planning.py``
``may_override_num_blocks`` v0.34.0)."""
PARALLEL_SIZES = (
    ("tensor", ("--tensor-parallel-size", "-tp")),
    ("pipeline", ("--pipeline-parallel-size", "-pp")),
    ("prefill-context", ("--prefill-context-parallel-size", "-pcp")),
)
DATA_PARALLEL = ("--data-parallel-size", "-dp")
DATA_PARALLEL_LOCAL = ("--data-parallel-size-local", "-dpl")
DATA_PARALLEL_RANK = ("--data-parallel-rank", "-dpn", "--data-parallel-external-lb")
"""One data-parallel rank per process, the others elsewhere (external load balancing): this pod runs
``data_parallel_size_local = 1`` (``engine/arg_utils.py`` v0.20.2: "Local DP rank = 1, use pure-external LB")."""
HEADLESS = ("--headless",)
CONFIG = ("--config",)
OMNI = ("--omni",)
"""vLLM-Omni (vllm-project/vllm-omni): one engine per stage of the model's pipeline, each on the GPUs and
with the ``gpu_memory_utilization`` of its deploy config (``vllm_omni/deploy/<model_type>.yaml``,
``--deploy-config``, ``--stage-overrides``; ``--stage-configs-path`` before 2026). A GPU holds the sum of
its stages' fractions, which the manifest does not give."""
_SIZES = tuple(names for _, names in PARALLEL_SIZES)
_SIZES_WITH_DATA = (*_SIZES, DATA_PARALLEL)
_SIZES_WITH_LOCAL_DATA = (*_SIZES, DATA_PARALLEL_LOCAL)
NODES = ("--nnodes",)
"""Multi-node serving without Ray: the parallel sizes are totals over ``--nnodes`` pods."""
MISSPELLABLE = (
    *UTILIZATION, *KV_CACHE_BYTES, *BLOCKS_OVERRIDE, *(name for names in _SIZES for name in names), *DATA_PARALLEL,
    *DATA_PARALLEL_LOCAL, *CONFIG, *NODES, *EAGER,
)
"""The options that decide what vLLM holds: a misspelling of one is an error, since vLLM's argument
parser refuses any option it does not know, and the pod would crash-loop."""
EXECUTOR = ("--distributed-executor-backend",)
ABBREVIATIONS = Abbreviations(
    {
        "--gpu-memory-utilization": (((0, 5, 5), "--g"),),
        "--device-memory-utilization": (((0, 34, 0), "--device-"),),
        "--kv-cache-memory-bytes": (((0, 10, 2), "--kv-cache-"), ((0, 15, 1), "--kv-cache-me")),
        "--num-gpu-blocks-override": (((0, 11, 0), "--num-"), ((0, 15, 1), "--n"), ((0, 20, 2), "--num")),
        "--tensor-parallel-size": (((0, 5, 5), "--t"),),
        "--pipeline-parallel-size": (((0, 5, 5), "--p"),),
        "--prefill-context-parallel-size": (((0, 15, 1), "--prefi"), ((0, 27, 1), "--prefill-")),
        "--data-parallel-size": (((0, 8, 5), "--d"), ((0, 9, 2), "--data-parallel-size")),
        "--data-parallel-size-local": (((0, 9, 2), "--data-parallel-size"),),
        "--enforce-eager": (((0, 5, 5), "--en"),),
        "--config": (((0, 6, 6), "--config"),),
        "--nnodes": (((0, 15, 1), "--n"),),
        "--distributed-executor-backend": (((0, 15, 1), "--dis"), ((0, 20, 2), "--distributed-")),
        "-tp": (((0, 5, 5), "-"),),
        "-pp": (((0, 11, 0), "-"), ((0, 15, 1), "-p")),
        "-pcp": (((0, 15, 1), "-p"),),
        "-dp": (((0, 8, 5), "-"), ((0, 9, 2), "-dp")),
        "-dpl": (((0, 9, 2), "-dp"),),
    },
    others=frozenset({"--device"}),
)
"""The serve parser's options as argparse abbreviates them (``allow_abbrev`` is never set, in any release
from v0.4.0 to v0.34.0; parsers of v0.5.5, 0.6.6, 0.8.5, 0.9.2, 0.10.2, 0.11.0, 0.15.1, 0.20.2, 0.27.1
and 0.34.0 built and listed: ``scripts/engine_options.py``). vLLM turns ``_`` into ``-`` in each
``--`` token before argparse sees it, so ``--gpu_memory_util`` is a prefix too."""


def arguments(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments if ``argv`` starts vLLM's OpenAI server, else ``None``."""
    if program(argv) == PROGRAM and len(argv) > 1 and argv[1] == "serve":
        return list(argv[2:])
    module = python_module(argv)
    if module is None:
        return None
    name, rest = module
    if name in MODULES:
        return rest
    if name == "vllm.entrypoints.cli.main" and rest[:1] == ["serve"]:
        return rest[1:]
    return None


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """What vLLM started with ``args`` in an image ``image`` will hold on each of its GPUs."""
    found = Findings.for_container(container)
    tag = image_tag(image)
    repository = image_name(image)
    version = version_from_tag(tag) if repository in VERSIONED_IMAGES else None
    if version is None and repository in ROCM_IMAGES and tag is not None:
        version = _rocm_version(tag)
    options = Options(args, underscores=True, prefixes=ABBREVIATIONS.at(version), exact=ABBREVIATIONS.others)
    options.report_misspellings(MISSPELLABLE, "vLLM", '"unrecognized arguments"', found)
    local = options.last(DATA_PARALLEL_LOCAL)
    if local is not None and local.value is not None and local.value.strip() == "0":
        return _api_server_only(options, local.evidence(), found, version)
    parallel = _parallel(options, found)
    if options.has(CONFIG) and parallel is not None and not parallel.flags:
        parallel = None  # the file may set the sizes: the GPUs asked for are not checked against them
    vram: Vram | None = None
    implicit = False
    kv_bytes = options.last(KV_CACHE_BYTES)
    if kv_bytes is not None and kv_bytes.value is not None and not kv_bytes.value.strip():
        kv_bytes = None  # ``--kv-cache-memory-bytes=``: vLLM reads an empty value as unset
    blocks = options.last(BLOCKS_OVERRIDE)
    utilization = options.last(UTILIZATION)
    config = options.last(CONFIG)
    rules: list[str] = []
    fraction = found.fraction(utilization) if utilization is not None else None
    if options.has(OMNI):
        found.evidence.append("--omni")
        found.warn(
            "vLLM-Omni (--omni) runs one engine per stage on the GPUs its deploy config names, each with its own "
            "--gpu-memory-utilization (vllm_omni/deploy/<model_type>.yaml, --deploy-config, --stage-overrides); "
            f"a GPU holds the sum of its stages' fractions, which the manifest does not give: declare "
            f"{VRAM_ANNOTATION} (per GPU, the largest sum)"
        )
        return EngineClaim(NAME, None, None, tuple(found.evidence), tuple(found.warnings), tuple(found.errors),
                           version=".".join(map(str, version)) if version is not None else None)
    if config is not None:
        found.evidence.append(config.evidence())
        found.warn(
            f"vLLM reads options from the {config.evidence()} file, which vramguard cannot read; it may set "
            "kv-cache-memory-bytes, which no --gpu-memory-utilization bounds, so its VRAM is unknown; "
            f"pass the options on the command line or declare {VRAM_ANNOTATION}"
        )
    elif kv_bytes is not None:
        found.evidence.append(kv_bytes.evidence())
        found.warn(
            f"{kv_bytes.evidence()}: vLLM sizes its KV cache to that and holds its weights and activations "
            f"beside it, whatever --gpu-memory-utilization says ({SOURCE}), so its VRAM is unknown; "
            f"declare {VRAM_ANNOTATION}"
        )
    elif blocks is not None:
        found.evidence.append(blocks.evidence())
        found.warn(
            f"{blocks.evidence()}: vLLM makes its KV cache that many blocks, whatever --gpu-memory-utilization "
            f"says and without checking the device (v1/core/kv_cache_utils.py), so its VRAM is unknown; "
            f"declare {VRAM_ANNOTATION}"
        )
    elif found.overridden(None, options, "vLLM"):
        vram = None  # an argument vramguard cannot see may set either memory flag
    elif utilization is not None:
        vram = Vram(fraction=fraction) if fraction is not None else None
    else:
        vram = _implicit_default(tag, version, found)
        implicit = True
    engine = engine_generation(version, env)
    if vram is not None and not vram.ceiling and device_wide_budget(version, engine):
        rules.append(
            f"image tag {tag}, engine {engine}: the budget is device-wide (total x utilization less every "
            f"process's use, {SOURCE if engine == 'V1' else 'worker/worker.py determine_num_available_blocks'}): "
            "a ceiling on the device, co-tenants included"
        )
        vram = Vram(fraction=vram.fraction, ceiling=True)
    elif version is not None and version < (0, 9, 1):
        rules.append(
            f"image tag {tag}, engine {engine}: the budget is per instance (total x utilization less what the "
            "process added after its CUDA context exists, worker/worker.py)"
        )
    overheads = _overheads(args, options, env, tag, version, rules, rocm="rocm" in image.split("@", 1)[0].lower())
    if vram is not None and vram.ceiling and not device_wide_budget(version, engine):
        # The extensible KV cache's whole device (v0.34.0, or a version vramguard cannot tell) is sized
        # after the graphs are captured: nothing is held beyond it.
        overheads = replace(overheads, graphs=None, scratch_bytes=0, scratch_source="")
    return EngineClaim(
        NAME, vram, parallel, tuple(found.evidence), tuple(found.warnings), tuple(found.errors), implicit,
        default_warning=found.default_warning, overheads=overheads,
        version=".".join(map(str, version)) if version is not None else None,
    )


def _api_server_only(options: Options, flag: str, found: Findings, version: Version | None) -> EngineClaim:
    """``--data-parallel-size-local 0``: vLLM's documented form for a pod that runs only the API
    server, every data-parallel engine running elsewhere (docs/serving/data_parallel_deployment.md,
    "only the API server on the first node"); with ``--headless`` vLLM refuses to start
    (``run_headless``, vllm/entrypoints/cli/serve.py: "data_parallel_size_local must be > 0 in
    headless mode"). Its share is nothing; a CUDA context stays counted, for the process that may
    touch a GPU it was given."""
    found.evidence.append(flag)
    vram: Vram | None = Vram(bytes=0)
    if options.has(HEADLESS):
        found.error(f"vLLM refuses {flag} with --headless (\"data_parallel_size_local must be > 0 in headless mode\", "
                    "vllm/entrypoints/cli/serve.py): this container would not start")
        vram = None
    else:
        found.warn(f"{flag}: this vLLM runs only its API server, its engines run in other pods, so it holds no "
                   "GPU memory of its own; it needs no GPU")
    return EngineClaim(NAME, vram, None, tuple(found.evidence), tuple(found.warnings), tuple(found.errors),
                       version=".".join(map(str, version)) if version is not None else None)


def _rocm_version(tag: str) -> Version | None:
    """vLLM's version in the tag of one of AMD's ROCm images (:data:`ROCM_IMAGES`), or ``None``."""
    found = _ROCM_TAG.search(tag)
    return (int(found[1]), int(found[2]), int(found[3] or 0)) if found else None


def engine_generation(version: Version | None, env: ContainerEnv) -> str:
    """Which engine generation runs: ``V1`` (the default from v0.8.0, the only one from v0.11.0) or the
    old one, ``V0``, as ``VLLM_USE_V1`` picks between v0.6.4 and v0.10.2 (``envs.py``)."""
    if version is None or version >= V0_GONE_SINCE:
        return "V1"
    variable = (env.literal(ENGINE_VARIABLE) or "").strip()
    if variable == "0":
        return "V0"
    if variable == "1" and version >= V1_SINCE:
        return "V1"
    return "V1" if version >= V1_DEFAULT_SINCE else "V0"


def device_wide_budget(version: Version | None, engine: str) -> bool:
    if version is None:
        return False
    low, high = V1_DEVICE_WIDE if engine == "V1" else V0_DEVICE_WIDE
    return low <= version < high


def _overheads(
    args: Sequence[str], options: Options, env: ContainerEnv, tag: str | None, version: Version | None,
    rules: list[str], *, rocm: bool = False,
) -> Overheads:
    """The version's rules for what vLLM holds outside its share (see the module's table)."""
    known = f"image tag {tag}" if version is not None else "image version unknown, the conservative rule"
    tensor, pipeline = (_size(options, names) for names in (_SIZES[0], _SIZES[1]))
    graphs: str | None = None
    if options.has(EAGER):
        rules.append("--enforce-eager: no CUDA graphs")
    elif rocm:
        # v1/worker/gpu_worker.py v0.20.0: "Skip on ROCm/HIP/XPU": the graph estimate is 0 on ROCm, so
        # the graphs are captured after the KV cache is sized, outside the share, in every version.
        graphs = f"{known}, a ROCm image: vLLM estimates no CUDA graph memory on ROCm ({SOURCE}): outside the share"
    else:
        graphs = graphs_outside(env, known, version, rules)
    scale = Fraction(1)
    if graphs is not None and tensor > 1:
        scale = 1 + GRAPHS_TENSOR_GROWTH * (min(tensor, 4) - 1)
        graphs += f"; tensor parallel {tensor}: {float(scale):.3g} x the allowance (vllm-project/vllm#7553)"
    capture = largest_capture(args, options, engine_generation(version, env) == "V0") if graphs else None
    if graphs is not None and capture is not None:
        size, flag = capture
        scale *= Fraction(size, REFERENCE)
        graphs += f"; {flag}: graphs up to batch {size}, {size / REFERENCE:.3g} x those of the default's {REFERENCE}"
    size = tensor * pipeline
    communication: str | None = None
    if size > 1 and (version is None or version >= COMMUNICATION_OUTSIDE_SINCE):
        communication = (
            f"{known}: tensor x pipeline parallel {size}, NCCL and all-reduce buffers are allocated before the "
            f"memory snapshot, outside the share (v0.11.0 and later, {SOURCE})"
        )
    scratch, scratch_source = 0, ""
    family = hybrid_family(args, options)
    if family is not None:
        scratch, sized = scratch_bytes(options, tensor)
        scratch_source = (
            f"{family}: vLLM's profiling run skips these layers' prefill, whose chunked-scan temporaries come "
            f"on top of the share (model_executor/layers/mamba/gdn_linear_attn.py, vllm-project/vllm#52872, "
            f"#54775): {sized}"
        )
    return Overheads(graphs=graphs, graphs_scale=scale, communication=communication, rules=tuple(rules),
                     scratch_bytes=scratch, scratch_source=scratch_source)


def graphs_outside(env: ContainerEnv, known: str, version: Version | None, rules: list[str]) -> str | None:
    """Why the CUDA graphs are held outside the share, or ``None`` (inside it: a rule says so)."""
    # A value vramguard cannot see counts as 0, the one that puts the graphs outside the share.
    variable = "0" if env.is_opaque(GRAPHS_VARIABLE) else (env.literal(GRAPHS_VARIABLE) or "").strip()
    # The old engine sizes its cache in worker/worker.py (initialize_cache) and captures afterwards
    # (_warm_up_model); V1 in v1/worker/gpu_worker.py after v1/executor/abstract.py sizes it.
    where = "worker/worker.py initialize_cache, then _warm_up_model" if engine_generation(version, env) == "V0" \
        else SOURCE
    after = f"{known}: CUDA graphs captured after the KV cache is sized, outside the share ({where})"
    if version is None or version < GRAPHS_ESTIMATE_SINCE:
        return after
    if version < GRAPHS_INSIDE_SINCE:
        if variable == "1":
            rules.append(f"{GRAPHS_VARIABLE}=1: CUDA graphs estimated inside the share")
            return None
        return after
    if GRAPHS_UNESTIMATED[0] <= version < GRAPHS_UNESTIMATED[1]:
        return (
            f"{known}: Model Runner V2, the default for dense models, estimates CUDA graphs as 0 before v0.29.0 "
            "(v1/worker/gpu/model_runner.py profile_cudagraph_memory, vllm-project/vllm#49224): outside the share"
        )
    if variable == "0":
        return f"{GRAPHS_VARIABLE}=0: CUDA graphs outside the share ({SOURCE})"
    rules.append(f"{known}: CUDA graphs estimated inside the share (v0.20.0 and later)")
    return None


def _size(options: Options, names: Sequence[str]) -> int:
    flag = options.last(names)
    value = parse_positive_int(flag.value) if flag is not None and flag.value is not None else None
    return value or 1


def _parallel(options: Options, found: Findings) -> Parallel | None:
    # --data-parallel-size-local is the data-parallel ranks on this pod (vllm/config/parallel.py
    # data_parallel_size_local): with it the sizes are this pod's GPUs, whatever the group.
    local = options.has(DATA_PARALLEL_LOCAL)
    external = options.has(DATA_PARALLEL_RANK)
    sizes = _SIZES if external else _SIZES_WITH_LOCAL_DATA if local else _SIZES_WITH_DATA
    executor = options.last(EXECUTOR)
    ray = executor is not None and executor.value == "ray"
    return parallel_layout(options, sizes, found, NODES, ray, per_pod=local or external)


def _implicit_default(tag: str | None, version: Version | None, found: Findings) -> Vram:
    """vLLM's default utilization for the image's version: 0.9, 0.92, or from v0.34.0 the whole
    device (the extensible KV cache)."""
    if version is not None and version < DEFAULT_092_SINCE:
        vram, why = Vram(fraction=DEFAULT_BEFORE_0_20), f"image tag {tag} is before v0.20.0"
    elif version is not None and version < EXTENSIBLE_CACHE_SINCE:
        vram, why = Vram(fraction=DEFAULT_SINCE_0_20), f"image tag {tag}"
    else:
        why = f"image tag {tag}, the extensible KV cache" if version is not None else (
            "image version unknown, assuming v0.34.0 or later: the extensible KV cache takes what is free"
        )
        vram = Vram(fraction=Fraction(1), ceiling=True)
    share = "the whole device" if vram.ceiling else f"{float(vram.fraction or 0):g} of the GPU"
    found.evidence.append(f"vLLM default --gpu-memory-utilization: {share} ({why})")
    found.relies_on_default(
        f"container {found.container} relies on vLLM's default --gpu-memory-utilization "
        f"({share}); set it explicitly"
    )
    return vram
