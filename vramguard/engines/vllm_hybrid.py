"""Hybrid models in vLLM: prefill scratch outside the share.

vLLM sizes its KV cache after a profiling run, which is meant to hold every activation inside the
share. For models with linear-attention or state-space layers (Gated DeltaNet, KDA, Mamba-2) the
profiling run skips those layers' prefill: ``_forward_core`` returns early when ``attn_metadata`` is
``None`` ("V1 profile run", ``model_executor/layers/mamba/gdn_linear_attn.py`` and
``mamba_mixer2.py`` in v0.20.2; the GDN warm-up since vllm-project/vllm#36599 runs 64 tokens only).
Their chunked-scan temporaries (``h``, ``v_new``, ``w``, ``u``, ``A`` in ``fla/ops/chunk.py``) then
come on top of the share at the first long prompt, and the process outgrows it
(vllm-project/vllm#52872: a 48-layer GDN hybrid at 0.93 dies on a 6k-token prompt with
``--max-num-batched-tokens 8192`` and serves with 2048; #54775: the same at 81,920 batched tokens).
No release has a fix (#52935 is open, #55149 closed unmerged).

The scratch grows with the tokens of one forward step (at most ``--max-num-batched-tokens``) and the
linear-attention heads on each rank: with 128-wide heads about 1.5 KiB per token per head
(72 KiB per token for 48 heads, measured in #54775; #55149 reserved 0.57 GiB for 24 heads per rank at
16,384 tokens). The heads are in the model's ``config.json``, not in the manifest: vramguard takes
:data:`HEADS`, the most of the families below, divided by the tensor-parallel size.

A model is known to be hybrid by its name (:data:`FAMILIES`, the hybrid architectures of vLLM's model
registry) or by a flag only hybrid models take (``--mamba-ssm-cache-dtype``, ...). A model whose name
says nothing (a local path) is not recognised: declare its VRAM, or let the fleet's measurements teach
it (docs/vram-model.md, "Learned from the fleet").
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vramguard.engines.base import Options, parse_positive_int

FAMILIES: tuple[tuple[str, str], ...] = (
    (r"qwen3[-_.]?next", "Qwen3-Next (Gated DeltaNet)"),
    (r"qwen3\.[5-9]", "Qwen3.5 and later (Gated DeltaNet)"),
    (r"kimi[-_]linear", "Kimi-Linear (KDA)"),
    (r"glm-5\.3-flash", "GLM-5.3-Flash (KDA)"),
    (r"nemotron[-_]h\b|nemotron-nano-(?:9b|12b)-v2", "Nemotron-H (Mamba-2)"),
    (r"granite-4\.0-h", "Granite 4.0 H (Mamba-2)"),
    (r"falcon[-_]h1", "Falcon-H1 (Mamba-2)"),
    (r"jamba", "Jamba (Mamba)"),
    (r"bamba", "Bamba (Mamba-2)"),
    (r"zamba2", "Zamba2 (Mamba-2)"),
    (r"minimax[-_](?:text-01|m1)", "MiniMax-Text-01 / M1 (lightning attention)"),
    (r"mamba", "Mamba"),
)
"""Model-name patterns of the hybrid and state-space families in vLLM's model registry
(``model_executor/models/registry.py``: ``Qwen3NextForCausalLM``, ``Qwen3_5ForConditionalGeneration``,
``KimiLinearForCausalLM``, ``NemotronHForCausalLM``, ``GraniteMoeHybridForCausalLM``,
``FalconH1ForCausalLM``, ``JambaForCausalLM``, ``BambaForCausalLM``, ``Zamba2ForCausalLM``,
``MiniMaxText01ForCausalLM``, ``MambaForCausalLM``, ...), matched case-insensitively."""
_PATTERN = re.compile("|".join(f"(?P<f{i}>{p})" for i, (p, _) in enumerate(FAMILIES)), re.IGNORECASE)
HYBRID_FLAGS = ("--mamba-ssm-cache-dtype", "--mamba-cache-dtype", "--mamba-cache-mode")
"""Options of the hybrid models' state cache (``engine/arg_utils.py`` from v0.11.0)."""
MODEL = ("--model",)
BATCHED_TOKENS = ("--max-num-batched-tokens",)
DEFAULT_BATCHED_TOKENS = 8192
"""The OpenAI server's default on GPUs of 70 GiB and more (``engine/arg_utils.py`` v0.20.2; 2048 on
smaller ones): the larger, counted where the flag is absent."""
HEADS = 64
"""Linear-attention value heads assumed (Qwen3.5's largest models have 64, Qwen3-Next 32)."""
BYTES_PER_TOKEN_HEAD = 1536
"""Scratch per token per head on a rank, 128-wide heads: ``v_new``, ``u``, ``w`` in bf16 and ``A`` in fp32."""
MAX_MODEL_NAME = 512


def hybrid_family(args: Sequence[str], options: Options) -> str | None:
    """The hybrid family the command's model belongs to, with what says so, or ``None``."""
    flag = options.last(HYBRID_FLAGS)
    if flag is not None:
        return f"{flag.name}: a hybrid model's state cache"
    model = options.last(MODEL)
    name = model.value if model is not None else (args[0] if args and not args[0].startswith("-") else None)
    if not name:
        return None
    found = _PATTERN.search(name[:MAX_MODEL_NAME])
    if found is None or found.lastgroup is None:
        return None
    return f"model {name[:MAX_MODEL_NAME]}: {FAMILIES[int(found.lastgroup[1:])][1]}"


def scratch_bytes(options: Options, tensor: int) -> tuple[int, str]:
    """The prefill scratch one rank holds beyond the share, and how it was sized."""
    flag = options.last(BATCHED_TOKENS)
    tokens = parse_positive_int(flag.value) if flag is not None and flag.value is not None else None
    written = flag.evidence() if tokens is not None and flag is not None else (
        f"--max-num-batched-tokens {DEFAULT_BATCHED_TOKENS} (the default on large GPUs)"
    )
    tokens = tokens or DEFAULT_BATCHED_TOKENS
    heads = -(-HEADS // max(tensor, 1))
    return tokens * heads * BYTES_PER_TOKEN_HEAD, f"{written} x {heads} heads per rank x 1.5 KiB"
