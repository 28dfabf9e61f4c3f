"""KServe's Hugging Face server (``python -m huggingfaceserver``) with its vLLM backend.

The server takes vLLM's engine flags, but not as ``vllm serve`` does: it parses its command line
with a plain ``argparse.ArgumentParser`` and ``parse_known_args()``
(kserve/kserve ``python/huggingfaceserver/huggingfaceserver/__main__.py``), to which vLLM's
``make_arg_parser`` only adds the dashed names. vLLM's own parser reads ``_`` as ``-``
(``FlexibleArgumentParser.parse_args``); this one does not, and drops an option it does not know
without a word. So ``--gpu_memory_utilization 0.4`` leaves vLLM at its default, and
``--tensor_parallel_size 2`` at one GPU. The server's own options are spelt with underscores
(``--model_id``, ``--max_model_len``; kserve ``model_server.py``): those it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from vramguard.demand.commandline import ContainerEnv
from vramguard.demand.model import EngineClaim
from vramguard.engines import vllm

__all__ = ["KSERVE_OPTIONS", "claim", "dropped_options"]

KSERVE_OPTIONS = frozenset({
    # python/huggingfaceserver/huggingfaceserver/__main__.py
    "model_dir", "model_id", "model_revision", "tokenizer_revision", "max_length", "max_model_len",
    "disable_lower_case", "disable_special_tokens", "trust_remote_code", "tensor_input_names", "task", "backend",
    "return_token_type_ids", "return_probabilities", "disable_log_requests", "max_log_len", "dtype",
    # python/kserve/kserve/model_server.py
    "http_port", "grpc_port", "workers", "max_threads", "max_asyncio_workers", "enable_grpc", "enable_docs_url",
    "enable_latency_logging", "configure_logging", "log_config_file", "access_log_format", "model_name",
    "predictor_host", "protocol", "predictor_protocol", "predictor_use_ssl", "predictor_request_timeout_seconds",
})
"""The server's own options, spelt as it defines them."""


def dropped_options(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` without the options the server's parser drops (an underscore spelling of a vLLM
    option), and those options as written."""
    kept: list[str] = []
    dropped: list[str] = []
    for arg in args:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "_" in name and name not in KSERVE_OPTIONS:
            dropped.append(arg.split("=", 1)[0])
            continue  # a value written apart stays behind as a stray word, as it does for argparse
        kept.append(arg)
    return kept, dropped


def claim(args: Sequence[str], env: ContainerEnv, image: str, container: str) -> EngineClaim:
    """What the server's vLLM backend holds on each GPU: vLLM's reading of the flags the server's
    parser keeps. The server's image tag says nothing of vLLM's version."""
    del image
    kept, dropped = dropped_options(args)
    result = vllm.claim(kept, env, "", container)
    if not dropped:
        return result
    warning = (
        f"container {container}: KServe's huggingfaceserver drops {', '.join(dropped)} unread (a plain argparse "
        "parser with parse_known_args, huggingfaceserver/__main__.py): vLLM's options take dashes there "
        "(--gpu-memory-utilization), so vLLM runs without them"
    )
    return replace(result, warnings=(*result.warnings, warning))
