"""SGLang: ``python -m sglang.launch_server`` / ``sglang serve``.

``--mem-fraction-static`` is the share of GPU memory for weights and the KV cache pool, taken of
the memory *free* after distributed start-up (``model_runner.py`` ``profile_max_num_token`` in
v0.5.5; ``mem_cache/kv_cache_configurator.py`` in v0.5.23: ``rest = available -
pre_model_load_memory x (1 - mem_fraction_static)``). So it is at most the fraction of the device's
total, and CUDA graphs and prefill activations live outside it, in memory SGLang assumes is its own.
vramguard counts that reserve as SGLang itself estimates it (``server_args.py`` v0.5.5,
``arg_groups/memory_hook.py`` v0.5.23)::

    512 + max(tokens per rank, 2048) x 1.5 + tp x pp / 8 x 1024 + cuda_graph_max_bs x 2  MiB

where the tokens per rank are one prefill chunk, split among the data-parallel attention ranks, or on
a decode server the running requests (:func:`tokens_per_rank`). Where the data-parallel size is not
known (``--dp-size $(PARALLELISM_SIZE)``, set by an operator), neither is that split: the activations
count SGLang's floor of 2048 tokens, and a warning says so, rather than a whole chunk no rank runs. It is
an estimate: where it does not fit beside the share, the container counts the whole device
(``Vram.on_device``).

Without the flag, SGLang computes the fraction as ``(gpu_mem - reserve) / gpu_mem`` (about 0.83 on an
H100 and 0.90 on an H200 at TP 1): it sizes itself to the whole device, so it counts as one.

``--config FILE`` merges the options of a YAML file, put before the command line's own, so that the
command line wins for an option given in both (``prepare_server_args`` in ``srt/server_args.py``,
``ConfigArgumentMerger.merge_config_with_args`` in ``srt/utils/server_args_config_parser.py``, v0.5.x).
The file may set the fraction, and the sizes, batches and speculative options of the reserve, which
vramguard cannot read: the claim is then unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from vramguard.codecs import VRAM_ANNOTATION
from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim, Overheads, Vram
from vramguard.engines.base import (
    Abbreviations,
    Findings,
    Flag,
    Options,
    hidden_settings,
    parallel_layout,
    parse_positive_int,
)
from vramguard.engines.launchers import image_name, image_tag, program, python_module, version_from_tag
from vramguard.quantity import MiB

NAME = "sglang"
PROGRAM = "sglang"
"""The console script: ``sglang serve``."""
MODULES = frozenset({"sglang.launch_server"})
MEM_FRACTION = ("--mem-fraction-static",)
TENSOR = ("--tp-size", "--tensor-parallel-size")
PIPELINE = ("--pp-size", "--pipeline-parallel-size")
DATA = ("--dp-size", "--data-parallel-size")
"""``--tp`` and ``--dp`` are no options of SGLang's: prefixes of ``--tp-size`` and ``--dp-size``
(:data:`ABBREVIATIONS`), as ``--pp`` was of ``--pp-size`` until v0.5.4 made it ambiguous."""
DP_ATTENTION = ("--enable-dp-attention",)
NODES = ("--nnodes",)
"""Multi-node serving: ``--tp`` is the total over ``--nnodes`` pods (``--node-rank`` 0 to n-1)."""
CHUNKED_PREFILL = ("--chunked-prefill-size",)
DISAGGREGATION = ("--disaggregation-mode",)
"""``prefill``, ``decode`` or ``null``: a decode server runs no chunked prefill (``disaggregation/decode.py``)."""
RUNNING = ("--max-running-requests",)
CONFIG = ("--config",)
"""A YAML file of options, merged before the command line's own (see the module docstring)."""
MAX_TOTAL_TOKENS = ("--max-total-tokens",)
"""Caps the KV pool at that many tokens (``model_runner.py`` v0.5.5: ``self.max_total_num_tokens =
min(self.max_total_num_tokens, max_total_tokens)``, never above the profiled count): a pool below the
fraction, by tokens x the model's KV bytes per token, which the manifest does not give. The fraction
stays the bound counted."""
DP_CHUNK_SPLIT_SINCE: tuple[int, int, int] = (0, 4, 5)
"""From v0.4.5 each DP attention rank takes ``chunked_prefill_size // dp_size`` tokens (``server_args.py``
``_handle_data_parallelism``, v0.4.5 to v0.5.5.post3; ``arg_groups/parallel_hook.py`` v0.5.23), where
v0.4.4 and before halved it."""
ACTIVATION_FLOOR = 2048
"""The fewest tokens SGLang's reserve counts activations for (``max(chunked_prefill_size, 2048)``)."""
GRAPH_BATCH = ("--cuda-graph-max-bs",)
GRAPH_BATCH_GONE: tuple[int, int, int] = (0, 5, 20)
"""From v0.5.20 only ``--cuda-graph-max-bs-decode`` and ``-prefill`` remain: the old name is a prefix of
both, an ambiguous option SGLang exits on (its v0.5.20 and v0.5.23 parsers built)."""
GRAPH_BATCH_DECODE = ("--cuda-graph-max-bs-decode",)
"""The decode graphs' largest batch from v0.5.20 (``memory_hook.py`` v0.5.23: ``decode_cuda_graph_config.max_bs``)."""
NO_GRAPHS = ("--disable-cuda-graph",)
SPECULATIVE = ("--speculative-algorithm",)
SPECULATIVE_MIB = {"STANDALONE": 6 * 1024, "NGRAM": 0}
"""What SGLang adds to its reserve for a draft model and its graphs (``server_args.py`` v0.5.5): 6 GiB
for a standalone draft model, none for n-gram, 2 GiB for the others (EAGLE, EAGLE3, MTP)."""
SPECULATIVE_OTHER_MIB = 2 * 1024
DEEPEP = ("--moe-a2a-backend",)
DEEPEP_OLD = ("--enable-deepep-moe",)
"""DeepEP's all-to-all buffers captured in the decode graphs: 2 GiB in SGLang's reserve
(``memory_hook.py`` v0.5.23 ``reserve_for_deepep_a2a_mb``), counted for every version that has DeepEP
(``--enable-deepep-moe`` before ``--moe-a2a-backend deepep``)."""
DEEPEP_MIB = 2 * 1024
SMALL_KV_SIZE = "SGLANG_CI_SMALL_KV_SIZE"
"""Replaces the profiled KV token count, whatever the fraction (``model_runner.py`` v0.5.5: ``if
SGLANG_CI_SMALL_KV_SIZE: self.max_total_num_tokens = int(SGLANG_CI_SMALL_KV_SIZE)``); gone by
v0.5.23. SGLang reads no command-line option from the environment."""
SMALL_KV_SIZE_GONE: tuple[int, int, int] = (0, 5, 23)
VERSIONED_IMAGES = frozenset({"lmsysorg/sglang", "aibrix/sglang"})
"""Repositories (owner and name, any registry or mirror path before them) of images whose tag is SGLang's
version: the project's own (``lmsysorg/sglang:v0.5.5-cu129``) and AIBrix's build of its tags
(vllm-project/aibrix docs/source/getting_started/container-images.rst: lmsysorg/sglang:v0.5.5.post3 ->
aibrix/sglang:v0.5.5.post3-aibrix-v0.5.0-...). Another owner's ``sglang`` image is of unknown version."""
ABBREVIATIONS = Abbreviations({
    "--mem-fraction-static": (((0, 4, 0), "--m"), ((0, 5, 19), "--me")),
    "--tp-size": (((0, 4, 0), "--t"),),
    "--tensor-parallel-size": (((0, 4, 0), "--t"),),
    "--pp-size": (((0, 4, 6), "--p"), ((0, 5, 5), "--pp-")),
    "--pipeline-parallel-size": (((0, 4, 6), "--p"), ((0, 5, 5), "--pi"), ((0, 5, 19), "--pi"), ((0, 5, 20), "--p")),
    "--dp-size": (((0, 4, 0), "--d"),),
    "--data-parallel-size": (((0, 4, 0), "--d"),),
    "--chunked-prefill-size": (((0, 4, 0), "--ch"),),
    "--cuda-graph-max-bs": (((0, 4, 0), "--c"), ((0, 4, 6), "--cuda-graph-"), ((0, 5, 19), "--cuda-graph-max-bs")),
    "--disable-cuda-graph": (((0, 4, 0), "--disable-cuda-graph"),),
    "--enable-dp-attention": (((0, 4, 0), "--enable-d"), ((0, 4, 6), "--enable-dp-"),
                              ((0, 5, 19), "--enable-dp-attention")),
    "--nnodes": (((0, 4, 0), "--n"),),
    "--speculative-algorithm": (((0, 4, 6), "--speculative-a"),),
    "--moe-a2a-backend": (((0, 4, 10), "--moe-"),),
    "--enable-deepep-moe": (((0, 4, 6), "--enable-d"),),
    "--cuda-graph-max-bs-decode": (((0, 5, 19), "--cuda-graph-max-bs-"),),
    "--disaggregation-mode": (((0, 4, 6), "--disaggregation-"),),
    "--max-running-requests": (((0, 4, 0), "--max-"),),
    "--max-total-tokens": (((0, 4, 0), "--max-"),),
})
"""The server parser's options as argparse abbreviates them (``allow_abbrev`` is never set from v0.4.0
to v0.5.23; parsers of v0.4.0, 0.4.6.post5, 0.4.10.post2, 0.5.5, 0.5.19, 0.5.20 and 0.5.23 built and
listed: ``scripts/engine_options.py``). SGLang does not turn ``_`` into ``-``: ``--tp_size`` is refused."""
DEFAULT_CHUNKED_PREFILL = 8192
DEFAULT_GRAPH_BATCH = 256
"""SGLang's defaults for GPUs of 60 to 160 GiB at TP below 4 (``memory_hook.py``, v0.5.23); larger
GPUs default to 16384 and 512: set the flags to count those exactly."""
SOURCE = "sglang v0.5.x, srt/server_args.py and arg_groups/memory_hook.py"
WHOLE_DEVICE_RULE = (
    "without --mem-fraction-static SGLang computes (gpu memory - its reserve) / gpu memory of the "
    f"memory free at start, plus the reserve: the whole device ({SOURCE})"
)
STATIC_RULE = (
    "--mem-fraction-static is of the memory free after start-up, at most that fraction of the device; "
    f"CUDA graphs and activations are outside it, in SGLang's own reserve ({SOURCE})"
)


def arguments(argv: Sequence[str]) -> list[str] | None:
    """The server's arguments if ``argv`` starts SGLang, else ``None``."""
    if program(argv) == PROGRAM and len(argv) > 1 and argv[1] == "serve":
        return list(argv[2:])
    module = python_module(argv)
    if module is not None and module[0] in MODULES:
        return module[1]
    return None


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """What SGLang started with ``args`` will hold on each of its GPUs."""
    found = Findings.for_container(container)
    version = version_from_tag(image_tag(image)) if image_name(image) in VERSIONED_IMAGES else None
    options = Options(args, prefixes=ABBREVIATIONS.at(version))
    options.report_misspellings((*MEM_FRACTION, *TENSOR, *PIPELINE, *DATA, *NODES), "SGLang",
                                '"unrecognized arguments"', found)
    if version is not None and version >= GRAPH_BATCH_GONE and options.has(GRAPH_BATCH):
        found.error(
            f"{GRAPH_BATCH[0]}: SGLang v0.5.20 and later have only --cuda-graph-max-bs-decode and "
            "--cuda-graph-max-bs-prefill, and exit at start (\"ambiguous option\")"
        )
    sizes = (TENSOR, PIPELINE) + (() if options.has(DP_ATTENTION) else (DATA,))
    parallel = parallel_layout(options, sizes, found, NODES)
    if options.has(CONFIG) and parallel is not None and not parallel.flags:
        parallel = None  # the file may set the sizes: the GPUs asked for are not checked against them
    fraction_flag = options.last(MEM_FRACTION)
    config = options.last(CONFIG)
    vram: Vram | None = None
    overheads = Overheads(rules=(WHOLE_DEVICE_RULE,))
    implicit = fraction_flag is None and config is None
    if config is not None:
        overheads = Overheads()
        _warn_unread_config(config, found)
    elif fraction_flag is None:
        found.evidence.append("SGLang computed default --mem-fraction-static: the whole device")
        found.relies_on_default(
            f"container {container} relies on SGLang's computed --mem-fraction-static, which with its "
            "reserve takes the whole GPU; set it explicitly to share the GPU"
        )
        vram = Vram(fraction=Fraction(1), ceiling=True)
    elif _replaced_kv_size(env, version, found):
        vram = None
    else:
        fraction = found.fraction(fraction_flag)
        if fraction is not None and not found.overridden(fraction_flag, options, "SGLang"):
            vram = Vram(fraction=fraction)
            tp_pp = _size(options, TENSOR) * _size(options, PIPELINE)
            rules = [STATIC_RULE]
            cap = options.last(MAX_TOTAL_TOKENS)
            if cap is not None and cap.value is not None:
                rules.append(
                    f"{cap.evidence()}: the KV pool may stay below the fraction (by the model's KV bytes per "
                    "token, which the manifest does not give); the fraction is counted as its bound"
                )
            _warn_unknown_split(options, version, found)
            overheads = Overheads(
                communication=_peers(tp_pp), reserve_bytes=reserve_bytes(options, tp_pp, version),
                reserve_source=f"SGLang's own estimate of its activations and CUDA graphs ({SOURCE})",
                rules=tuple(rules),
            )
    return EngineClaim(
        NAME, vram, parallel, tuple(found.evidence), tuple(found.warnings), tuple(found.errors), implicit,
        default_warning=found.default_warning, overheads=overheads,
    )


def _warn_unread_config(config: Flag, found: Findings) -> None:
    """Say that SGLang merges the options of a file vramguard cannot read (:data:`CONFIG`)."""
    found.evidence.append(config.evidence())
    found.warn(
        f"SGLang reads options from the {config.evidence()} file, which vramguard cannot read; it may set "
        "mem-fraction-static, tp-size, cuda-graph-max-bs, chunked-prefill-size and the speculative options, "
        "which change what SGLang holds, so its VRAM is unknown; pass the options on the command line or "
        f"declare {VRAM_ANNOTATION}"
    )


def _replaced_kv_size(env: ContainerEnv, version: tuple[int, int, int] | None, found: Findings) -> bool:
    """Whether :data:`SMALL_KV_SIZE` may replace the KV pool's size (in versions that read it)."""
    if version is not None and version >= SMALL_KV_SIZE_GONE:
        return False
    value = env.literal(SMALL_KV_SIZE)
    if value is not None and value.strip():
        found.warn(
            f"env {SMALL_KV_SIZE}={value.strip()[:32]}: SGLang (before v0.5.23) sizes its KV pool to that many tokens "
            f"whatever --mem-fraction-static says, so its VRAM is unknown; declare {VRAM_ANNOTATION}"
        )
        return True
    return hidden_settings(env, (SMALL_KV_SIZE,), "SGLang (before v0.5.23)", found)


def reserve_bytes(options: Options, tp_pp: int, version: tuple[int, int, int] | None = None) -> int:
    """SGLang's reserve outside its static share, by its own formula (``server_args.py`` v0.5.5,
    ``memory_hook.py`` v0.5.23), from the flags (defaults for a GPU of 60 to 160 GiB where a flag is
    absent or unreadable): a constant, its activations for the tokens one rank runs at a time
    (:func:`tokens_per_rank`), parallel slack, its decode graphs (with DP attention, padded per DP
    rank: ``cuda_graph_max_bs x dp_size x 3``, and x 1.5 more above a batch of 300), a draft model's,
    and DeepEP's buffers."""
    mode = options.last(DISAGGREGATION)
    prefill_only = mode is not None and (mode.value or "").strip() == "prefill"
    batch = _value(options, GRAPH_BATCH_DECODE if options.has(GRAPH_BATCH_DECODE) else GRAPH_BATCH,
                   DEFAULT_GRAPH_BATCH)
    # A prefill server runs no decode graphs (memory_hook.py v0.5.23 counts none there; v0.5.5 did).
    graphs_on = not options.has(NO_GRAPHS) and not prefill_only
    graphs = Fraction(batch * 2) if graphs_on else Fraction(0)
    if graphs_on and options.has(DP_ATTENTION):
        dp = _size(options, DATA)
        graphs += batch * dp * 3 + (Fraction(batch * dp * 3, 2) if batch > 300 else 0)
    tokens = tokens_per_rank(options, version)
    mebibytes = 512 + Fraction(max(tokens or 0, ACTIVATION_FLOOR) * 3, 2) + Fraction(tp_pp * 1024, 8) + graphs
    speculative = options.last(SPECULATIVE)
    if speculative is not None and speculative.value:
        mebibytes += SPECULATIVE_MIB.get(speculative.value.strip().upper(), SPECULATIVE_OTHER_MIB)
    backend = options.last(DEEPEP)
    deepep = options.has(DEEPEP_OLD) or (backend is not None and (backend.value or "").strip() == "deepep")
    if deepep and graphs_on and not prefill_only:
        mebibytes += DEEPEP_MIB
    return int(mebibytes * MiB)


def tokens_per_rank(options: Options, version: tuple[int, int, int] | None = None) -> int | None:
    """The tokens one GPU's process runs in a forward pass, which its activations are for: a prefill
    chunk (``--chunked-prefill-size``), split among the data-parallel attention ranks with
    ``--enable-dp-attention`` (``chunked_prefill_size // dp_size`` from v0.4.5, ``// 2`` before, and for
    a version vramguard cannot tell: :data:`DP_CHUNK_SPLIT_SINCE`); on a decode server
    (``--disaggregation-mode decode``), which runs no prefill, the running requests, split likewise.
    ``None`` where the split is by a ``--dp-size`` that cannot be read (``$(PARALLELISM_SIZE)``)."""
    dp = _dp_split(options, version)
    if dp is None:
        return None
    mode = options.last(DISAGGREGATION)
    if mode is not None and (mode.value or "").strip() == "decode":
        return _value(options, RUNNING, DEFAULT_CHUNKED_PREFILL) // dp
    return _value(options, CHUNKED_PREFILL, DEFAULT_CHUNKED_PREFILL) // dp


def _dp_split(options: Options, version: tuple[int, int, int] | None) -> int | None:
    """What one rank's tokens are divided by: 1 without DP attention (or at ``--dp-size 1``, which
    turns it off), 2 before v0.4.5, the DP size after; ``None`` where that size cannot be read."""
    if not options.has(DP_ATTENTION):
        return 1
    if version is not None and version < DP_CHUNK_SPLIT_SINCE:
        return 2
    flag = options.last(DATA)
    if flag is not None and flag.value is not None and parse_positive_int(flag.value) is None:
        return None
    return _size(options, DATA) if version is not None else 2


def _warn_unknown_split(options: Options, version: tuple[int, int, int] | None, found: Findings) -> None:
    """Say that the activations are counted at SGLang's floor where the DP size is not known."""
    flag = options.last(DATA)
    if tokens_per_rank(options, version) is not None or flag is None:
        return
    mode = options.last(DISAGGREGATION)
    decode = mode is not None and (mode.value or "").strip() == "decode"
    split = options.last(RUNNING if decode else CHUNKED_PREFILL)
    what = split.evidence() if split is not None else f"{(RUNNING if decode else CHUNKED_PREFILL)[0]} (default)"
    found.warn(
        f"with --enable-dp-attention each data-parallel attention rank runs {what} divided by the DP size "
        f"(SGLang's _handle_data_parallelism, v0.4.5 and later), and {flag.evidence()} is not known "
        f"here: SGLang's reserve counts activations for its floor of {ACTIVATION_FLOOR} tokens, not for that "
        f"share of the batch; declare {VRAM_ANNOTATION} to count them"
    )


def _value(options: Options, names: Sequence[str], default: int) -> int:
    flag = options.last(names)
    value = parse_positive_int(flag.value) if flag is not None and flag.value is not None else None
    return value if value is not None else default


def _size(options: Options, names: Sequence[str]) -> int:
    return _value(options, names, 1)


def _peers(tp_pp: int) -> str | None:
    if tp_pp <= 1:
        return None
    return f"tensor x pipeline parallel size {tp_pp}: NCCL buffers beside the static share"
