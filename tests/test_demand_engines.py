"""The demand model, one named case per way people write GPU workloads."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.demand import DemandOptions, derive_pod_demand
from vramguard.quantity import GiB, MiB

VLLM = "vllm/vllm-openai:v0.21.0"


@dataclass
class Case:
    """A pod and what its first GPU container must come out as."""

    id: str
    pod: dict[str, Any]
    engine: str | None = None
    fraction: Fraction | None = None
    bytes: int | None = None
    gpus: int = 1
    sm_percent: int | None = None
    errors: list[str] = field(default_factory=list)
    """Substrings, one per expected error (no other error allowed)."""
    warnings: list[str] = field(default_factory=list)
    """Substrings that must appear among the warnings (others allowed)."""
    evidence: list[str] = field(default_factory=list)


CASES = [
    # vLLM
    Case(
        "vllm-serve",
        pod(container(command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.2"])),
        "vllm",
        Fraction(1, 5),
        evidence=["--gpu-memory-utilization 0.2"],
    ),
    Case(
        "vllm-equals-form",
        pod(container(command=["vllm", "serve", "m", "--gpu-memory-utilization=0.35"])),
        "vllm",
        Fraction(35, 100),
    ),
    Case(
        "vllm-underscore-form",
        pod(container(command=["vllm", "serve", "--gpu_memory_utilization", ".5"])),
        "vllm",
        Fraction(1, 2),
    ),
    Case(
        "vllm-last-occurrence-wins",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "0.9", "--gpu-memory-utilization=0.25"])),
        "vllm",
        Fraction(1, 4),
    ),
    Case(
        "vllm-python-module",
        pod(
            container(
                command=["python3", "-m", "vllm.entrypoints.openai.api_server"],
                args=["--model", "m", "--gpu-memory-utilization", "0.4"],
            )
        ),
        "vllm",
        Fraction(2, 5),
    ),
    Case(
        "vllm-python-unbuffered-module",
        pod(
            container(
                command=[
                    "/usr/bin/python",
                    "-u",
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--gpu-memory-utilization",
                    "0.4",
                ]
            )
        ),
        "vllm",
        Fraction(2, 5),
    ),
    Case(
        "vllm-image-args-only",
        pod(container(image=VLLM, args=["--model", "m", "--gpu-memory-utilization", "0.3"])),
        "vllm",
        Fraction(3, 10),
    ),
    Case(
        "vllm-image-other-registry",
        pod(
            container(
                image="registry.example.com/mirror/vllm/vllm-openai:v0.9.2@sha256:abc",
                args=["--gpu-memory-utilization", "0.3"],
            )
        ),
        "vllm",
        Fraction(3, 10),
    ),
    Case(
        "vllm-sh-c-with-install",
        pod(container(command=["sh", "-c", "pip install foo && exec vllm serve m --gpu-memory-utilization 0.45"])),
        "vllm",
        Fraction(45, 100),
    ),
    Case(
        "vllm-bash-lc",
        pod(
            container(
                command=["/bin/bash", "-lc"],
                args=["set -e; echo start\nvllm serve m \\\n  --gpu-memory-utilization 0.5 2>&1 | tee /log"],
            )
        ),
        "vllm",
        Fraction(1, 2),
    ),
    Case(
        "vllm-kubernetes-var-expansion",
        pod(container(command=["vllm", "serve", "m", "--gpu-memory-utilization", "$(UTIL)"], env={"UTIL": "0.3"})),
        "vllm",
        Fraction(3, 10),
    ),
    Case(
        "vllm-kubernetes-var-chained-env",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization=$(B)"], env={"A": "0.25", "B": "$(A)"})),
        "vllm",
        Fraction(1, 4),
    ),
    Case(
        "vllm-kubernetes-escaped-dollar-is-literal",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "$$(UTIL)"], env={"UTIL": "0.3"})),
        "vllm",
        None,
        warnings=["UTIL is not a literal env value"],
    ),
    Case(
        "vllm-shell-var-expansion",
        pod(
            container(command=["sh", "-c", 'exec vllm serve m --gpu-memory-utilization "${UTIL}"'], env={"UTIL": "0.6"})
        ),
        "vllm",
        Fraction(3, 5),
    ),
    Case(
        "vllm-shell-export",
        pod(container(command=["sh", "-c", "export U=0.15; vllm serve m --gpu-memory-utilization $U"])),
        "vllm",
        Fraction(15, 100),
    ),
    Case(
        "vllm-env-wrapper",
        pod(container(command=["env", "HF_HOME=/cache", "vllm", "serve", "--gpu-memory-utilization", "0.7"])),
        "vllm",
        Fraction(7, 10),
    ),
    Case(
        "vllm-secret-ref-unreadable",
        pod(
            container(
                command=["vllm", "serve", "--gpu-memory-utilization", "$(UTIL)"],
                env=[{"name": "UTIL", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            )
        ),
        "vllm",
        None,
        warnings=["UTIL is not a literal env value"],
    ),
    Case(
        "vllm-default-new-image",
        pod(container(image=VLLM, args=["--model", "m"])),
        "vllm",
        Fraction(92, 100),
        warnings=["relies on vLLM's default --gpu-memory-utilization (0.92"],
    ),
    # vllm/config/cache.py: 0.9 up to v0.19.1, 0.92 from v0.20.0 (the released wheels).
    Case(
        "vllm-default-old-image",
        pod(container(image="vllm/vllm-openai:v0.19.1", args=["--model", "m"])),
        "vllm",
        Fraction(9, 10),
        warnings=["default --gpu-memory-utilization (0.9 of"],
    ),
    Case(
        "vllm-default-0.20.0-image",
        pod(container(image="vllm/vllm-openai:v0.20.0", args=["--model", "m"])),
        "vllm",
        Fraction(92, 100),
    ),
    # v0.34.0: without the flag the extensible KV cache takes what is free (resolved utilization 1.0).
    Case(
        "vllm-default-extensible-cache",
        pod(container(image="vllm/vllm-openai:v0.34.0", args=["--model", "m"])),
        "vllm",
        Fraction(1),
        evidence=["vLLM default --gpu-memory-utilization: the whole device (image tag v0.34.0"],
    ),
    Case(
        "vllm-default-tag-with-digest",
        pod(container(image="vllm/vllm-openai:v0.19.1@sha256:" + "ab" * 32, args=["--model", "m"])),
        "vllm",
        Fraction(9, 10),
    ),
    Case(
        "vllm-default-unknown-version",
        pod(container(image="vllm/vllm-openai:latest", args=["m"])),
        "vllm",
        Fraction(1),
        evidence=["vLLM default --gpu-memory-utilization: the whole device (image version unknown"],
    ),
    Case(
        "vllm-tensor-parallel-matches",
        pod(container(command=["vllm", "serve", "-tp", "2", "--gpu-memory-utilization", "0.5"], gpus=2)),
        "vllm",
        Fraction(1, 2),
        gpus=2,
    ),
    Case(
        "vllm-tp-times-pp-matches",
        pod(
            container(
                command=[
                    "vllm",
                    "serve",
                    "--tensor-parallel-size=2",
                    "--pipeline-parallel-size",
                    "2",
                    "--gpu-memory-utilization",
                    "0.5",
                ],
                gpus=4,
            )
        ),
        "vllm",
        Fraction(1, 2),
        gpus=4,
    ),
    Case(
        "vllm-tp-mismatch",
        pod(container(command=["vllm", "serve", "-tp", "4", "--gpu-memory-utilization", "0.5"], gpus=2)),
        "vllm",
        Fraction(1, 2),
        gpus=2,
        errors=["vLLM: -tp 4 = 4 GPUs, but the container requests 2 nvidia.com/gpu"],
    ),
    Case(
        "vllm-two-gpus-without-tp",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "0.5"], gpus=2)),
        "vllm",
        Fraction(1, 2),
        gpus=2,
        errors=["vLLM: no parallel-size flag = 1 GPU, but the container requests 2"],
    ),
    Case(
        "vllm-utilization-too-high",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "1.5"])),
        "vllm",
        None,
        errors=["container main: --gpu-memory-utilization 1.5 is outside (0, 1]"],
    ),
    Case(
        "vllm-utilization-zero",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "0"])),
        "vllm",
        None,
        errors=["is outside (0, 1]"],
    ),
    Case(
        "vllm-utilization-not-numeric",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "high"])),
        "vllm",
        None,
        errors=["--gpu-memory-utilization high is not a number"],
    ),
    Case(
        "vllm-utilization-nan",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "nan"])),
        "vllm",
        None,
        errors=["is not a number"],
    ),
    Case(
        "vllm-flag-without-value",
        pod(container(command=["vllm", "serve", "m", "--gpu-memory-utilization"])),
        "vllm",
        None,
        errors=["--gpu-memory-utilization has no value"],
    ),
    Case(
        "vllm-flag-followed-by-flag",
        pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "--enforce-eager"])),
        "vllm",
        None,
        errors=["has no value"],
    ),
    Case(
        "vllm-tp-not-integer",
        pod(container(command=["vllm", "serve", "-tp", "two", "--gpu-memory-utilization", "0.5"])),
        "vllm",
        Fraction(1, 2),
        errors=["-tp two is not a positive integer"],
    ),
    # vllm/v1/worker/gpu_worker.py determine_available_memory (v0.10.2 to v0.21.0): with
    # kv_cache_memory_bytes the KV cache is that size and "This does not respect the
    # gpu_memory_utilization config": the weights and activations come on top, unseen.
    Case(
        "vllm-kv-cache-bytes-unknown",
        pod(container(command=["vllm", "serve", "--kv-cache-memory-bytes", "8G"])),
        "vllm",
        None,
        warnings=["--kv-cache-memory-bytes 8G: vLLM sizes its KV cache to that"],
    ),
    Case(
        "vllm-kv-cache-bytes-with-utilization-unknown",
        pod(container(command=["vllm", "serve", "--kv-cache-memory-bytes", "8G", "--gpu-memory-utilization", "0.2"])),
        "vllm",
        None,
        warnings=["so its VRAM is unknown"],
    ),
    # vllm/utils FlexibleArgumentParser._pull_args_from_config (v0.8 to v0.21): the file's options
    # are inserted before the command line's, so it may add kv-cache-memory-bytes.
    Case(
        "vllm-config-file-unknown",
        pod(container(command=["vllm", "serve", "--config", "/etc/vllm.yaml"])),
        "vllm",
        None,
        warnings=["--config /etc/vllm.yaml file"],
    ),
    Case(
        "vllm-config-file-with-utilization-still-unknown",
        pod(container(command=["vllm", "serve", "--config", "/etc/vllm.yaml", "--gpu-memory-utilization", "0.3"])),
        "vllm",
        None,
        warnings=["may set kv-cache-memory-bytes"],
    ),
    # vllm/v1/core/kv_cache_utils.py _get_kv_cache_config_uniform_type (v0.8.5): "Overriding
    # num_gpu_blocks=%d with num_gpu_blocks_override=%d", then the cache is that many blocks, never
    # checked against the device; v1/core/kv_cache_planning.py may_override_num_blocks (v0.34.0).
    Case(
        "vllm-num-gpu-blocks-override-unknown",
        pod(container(command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.1",
                               "--num-gpu-blocks-override", "30000"])),
        "vllm",
        None,
        warnings=["--num-gpu-blocks-override 30000: vLLM makes its KV cache that many blocks"],
    ),
    # vllm/engine/arg_utils.py (v0.34.0): "--gpu-memory-utilization", "--device-memory-utilization",
    # dest="gpu_memory_utilization".
    Case(
        "vllm-device-memory-utilization-alias",
        pod(container(command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.1",
                               "--device-memory-utilization", "0.6"])),
        "vllm",
        Fraction(3, 5),
    ),
    # An empty --kv-cache-memory-bytes= is unset for vLLM: the utilization decides.
    Case(
        "vllm-empty-kv-cache-bytes-is-unset",
        pod(container(command=["vllm", "serve", "m", "--kv-cache-memory-bytes=", "--gpu-memory-utilization", "0.3"])),
        "vllm",
        Fraction(3, 10),
    ),
    # argparse takes any unambiguous prefix of a long option (allow_abbrev, never turned off by vLLM,
    # v0.4.0-v0.34.0); the last occurrence wins whichever way it is written. Built parsers of vLLM
    # v0.5.5, v0.8.5, v0.10.2 and v0.34.0 read all of these so (vllm/utils FlexibleArgumentParser).
    Case(
        "vllm-a-prefix-is-the-option-and-the-last-wins",
        pod(container(image="vllm/vllm-openai:v0.10.2",
                      command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.10", "--gpu-memory-util", "0.95"])),
        "vllm",
        Fraction(95, 100),
        evidence=["--gpu-memory-util 0.95"],
    ),
    Case(
        "vllm-underscored-prefix-with-equals",
        pod(container(image="vllm/vllm-openai:v0.34.0",
                      command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.10", "--gpu_memory_util=0.95"])),
        "vllm",
        Fraction(95, 100),
    ),
    Case(
        "vllm-ambiguous-prefix-is-an-error",
        pod(container(image="vllm/vllm-openai:v0.34.0", command=["vllm", "serve", "m", "--g", "0.5"])),
        "vllm",
        Fraction(1),
        errors=['--g: vLLM exits at start ("ambiguous option")'],
    ),
    Case(
        "vllm-short-prefix-of-tp",
        pod(container(image="vllm/vllm-openai:v0.34.0",
                      command=["vllm", "serve", "m", "-t", "2", "--gpu-memory-utilization", "0.5"], gpus=2)),
        "vllm",
        Fraction(1, 2),
        gpus=2,
    ),
    # --data-parallel-size-local (v0.9.0) extends --data-parallel-size: "ambiguous option:
    # --data-parallel-siz could match --data-parallel-size, --data-parallel-size-local" (v0.10.2, v0.34.0).
    Case(
        "vllm-prefix-of-two-options-is-ambiguous",
        pod(container(image="vllm/vllm-openai:v0.34.0",
                      command=["vllm", "serve", "m", "--data-parallel-siz", "2", "--gpu-memory-utilization", "0.5"])),
        "vllm",
        Fraction(1, 2),
        errors=['--data-parallel-siz: vLLM exits at start ("ambiguous option")'],
    ),
    Case(
        "vllm-prefix-of-the-blocks-override-is-unknown",
        pod(container(image="vllm/vllm-openai:v0.34.0",
                      command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.1", "--num-", "100"])),
        "vllm",
        None,
        warnings=["--num- 100: vLLM makes its KV cache that many blocks"],
    ),
    # SGLang
    # srt/server_args.py: argparse.ArgumentParser() without allow_abbrev (v0.4.0-v0.5.23); --tp and --dp are
    # prefixes of --tp-size and --dp-size; --pp is ambiguous from v0.5.4 (--pp-max-micro-batch-size).
    Case(
        "sglang-a-prefix-is-the-option-and-the-last-wins",
        pod(container(image="lmsysorg/sglang:v0.5.5-cu129", command=[
            "python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.5", "--mem-frac", "0.8"])),
        "sglang",
        Fraction(4, 5),
    ),
    Case(
        "sglang-pp-is-ambiguous-from-0.5.4",
        pod(container(image="lmsysorg/sglang:v0.5.5-cu129", command=[
            "python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.5", "--tp", "1", "--pp", "1"])),
        "sglang",
        Fraction(1, 2),
        errors=['--pp: SGLang exits at start ("ambiguous option")'],
    ),
    Case(
        "sglang-cuda-graph-max-bs-is-gone-from-0.5.20",
        pod(container(image="lmsysorg/sglang:v0.5.23", command=[
            "python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.5", "--cuda-graph-max-bs", "8"])),
        "sglang",
        Fraction(1, 2),
        errors=["--cuda-graph-max-bs: SGLang v0.5.20 and later have only"],
    ),
    Case(
        "sglang-turns-no-underscore-into-a-dash",
        pod(container(image="lmsysorg/sglang:v0.5.23", command=[
            "python3", "-m", "sglang.launch_server", "--mem_fraction_static", "0.8"])),
        "sglang",
        Fraction(1),
        errors=["--mem_fraction_static: SGLang has no such option"],
    ),
    # srt/model_executor/model_runner.py (v0.5.5): "if SGLANG_CI_SMALL_KV_SIZE: self.max_total_num_tokens
    # = int(SGLANG_CI_SMALL_KV_SIZE)", whatever --mem-fraction-static says; gone in v0.5.23.
    Case(
        "sglang-small-kv-size-replaces-the-pool",
        pod(container(image="lmsysorg/sglang:v0.5.5-cu129",
                      command=["python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.3"],
                      env={"SGLANG_CI_SMALL_KV_SIZE": "9000000"})),
        "sglang",
        None,
        warnings=["env SGLANG_CI_SMALL_KV_SIZE=9000000"],
    ),
    Case(
        "sglang-env-from-may-replace-the-pool",
        pod(container(image="lmsysorg/sglang:latest",
                      command=["python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.3"],
                      envFrom=[{"secretRef": {"name": "hf"}}])),
        "sglang",
        None,
        warnings=["env SGLANG_CI_SMALL_KV_SIZE may be set from secretRef hf"],
    ),
    Case(
        "sglang-env-from-in-a-version-without-the-variable",
        pod(container(image="lmsysorg/sglang:v0.5.23-cu130",
                      command=["python3", "-m", "sglang.launch_server", "--mem-fraction-static", "0.3"],
                      envFrom=[{"secretRef": {"name": "hf"}}])),
        "sglang",
        Fraction(3, 10),
    ),
    Case(
        "sglang-module",
        pod(
            container(
                command=["python3", "-m", "sglang.launch_server", "--model-path", "m", "--mem-fraction-static", "0.7"]
            )
        ),
        "sglang",
        Fraction(7, 10),
    ),
    Case(
        "sglang-tp",
        pod(
            container(
                command=["python3", "-m", "sglang.launch_server", "--tp", "2", "--mem-fraction-static", "0.8"], gpus=2
            )
        ),
        "sglang",
        Fraction(4, 5),
        gpus=2,
    ),
    Case(
        "sglang-default-whole-device",
        pod(container(command=["python3", "-m", "sglang.launch_server", "--model-path", "m"])),
        "sglang",
        Fraction(1),
        warnings=["computed --mem-fraction-static"],
    ),
    # srt/server_args.py prepare_server_args, srt/utils/server_args_config_parser.py merge_config_with_args
    # (v0.5.x): the file's options go before the command line's, which wins only for the options it gives;
    # the file may set the fraction, --tp-size or the reserve's batches. Parallel sizes are read from the
    # command line, as for vLLM's --config.
    Case(
        "sglang-config-file-unknown",
        pod(container(command=["python3", "-m", "sglang.launch_server", "--config", "/etc/sglang.yaml"])),
        "sglang",
        None,
        warnings=["SGLang reads options from the --config /etc/sglang.yaml file", "vramguard.io/vram"],
        evidence=["--config /etc/sglang.yaml"],
    ),
    Case(
        "sglang-config-file-with-fraction-still-unknown",
        pod(container(image="lmsysorg/sglang:v0.5.5-cu129", command=[
            "python3", "-m", "sglang.launch_server", "--tp", "2", "--mem-fraction-static", "0.3",
            "--config", "/etc/sglang.yaml"], gpus=2)),
        "sglang",
        None,
        gpus=2,
        warnings=["may set mem-fraction-static, tp-size, cuda-graph-max-bs"],
    ),
    # The file may set the sizes: with none on the command line, the GPUs asked for are not checked
    # against one GPU (no "make them equal" error for a file that sets tp-size 2).
    Case(
        "sglang-config-file-sizes-from-the-file",
        pod(container(command=["python3", "-m", "sglang.launch_server", "--config", "/etc/sglang.yaml"], gpus=2)),
        "sglang",
        None,
        gpus=2,
    ),
    Case(
        "vllm-config-file-sizes-from-the-file",
        pod(container(command=["vllm", "serve", "--config", "/etc/vllm.yaml"], gpus=4)),
        "vllm",
        None,
        gpus=4,
    ),
    # TGI
    Case(
        "tgi-flag",
        pod(
            container(
                image="ghcr.io/huggingface/text-generation-inference:3.3.0",
                args=["--model-id", "m", "--cuda-memory-fraction", "0.4"],
            )
        ),
        "tgi",
        Fraction(2, 5),
    ),
    Case(
        "tgi-env",
        pod(
            container(
                image="ghcr.io/huggingface/text-generation-inference:3.3.0",
                args=["--model-id", "m"],
                env={"CUDA_MEMORY_FRACTION": "0.25"},
            )
        ),
        "tgi",
        Fraction(1, 4),
        evidence=["env CUDA_MEMORY_FRACTION=0.25"],
    ),
    Case(
        "tgi-flag-beats-env",
        pod(
            container(
                command=["text-generation-launcher", "--cuda-memory-fraction", "0.3"],
                env={"CUDA_MEMORY_FRACTION": "0.9"},
            )
        ),
        "tgi",
        Fraction(3, 10),
    ),
    Case(
        "tgi-default-whole-gpu",
        pod(container(image="ghcr.io/huggingface/text-generation-inference:latest", args=["--model-id", "m"])),
        "tgi",
        Fraction(1),
        warnings=["default --cuda-memory-fraction (1.0"],
    ),
    Case(
        "tgi-num-shard-mismatch",
        pod(container(command=["text-generation-launcher", "--num-shard", "2", "--cuda-memory-fraction", "0.5"])),
        "tgi",
        Fraction(1, 2),
        errors=["TGI: --num-shard 2 = 2 GPUs, but the container requests 1"],
    ),
    # launcher/src/main.rs: every option is `#[clap(long, env)]`, so envFrom may set CUDA_MEMORY_FRACTION.
    Case(
        "tgi-env-from-may-set-the-fraction",
        pod(container(image="ghcr.io/huggingface/text-generation-inference:3.3.0", args=["--model-id", "m"],
                      envFrom=[{"configMapRef": {"name": "tgi"}}])),
        "tgi",
        None,
        warnings=["env CUDA_MEMORY_FRACTION may be set from configMapRef tgi"],
    ),
    # clap 4 without args_override_self: "the argument '--cuda-memory-fraction <...>' cannot be used multiple times".
    Case(
        "tgi-a-flag-twice-is-refused",
        pod(container(command=["text-generation-launcher", "--cuda-memory-fraction", "0.3",
                               "--cuda-memory-fraction", "0.4"])),
        "tgi",
        Fraction(2, 5),
        errors=["--cuda-memory-fraction is given twice"],
    ),
    Case(
        "tgi-env-out-of-range",
        pod(container(command=["text-generation-launcher"], env={"CUDA_MEMORY_FRACTION": "2"})),
        "tgi",
        None,
        errors=["env CUDA_MEMORY_FRACTION=2 is outside (0, 1]"],
    ),
    # JAX
    Case(
        "jax-python-fraction",
        pod(container(command=["python", "train.py"], env={"XLA_PYTHON_CLIENT_MEM_FRACTION": ".30"})),
        "jax",
        Fraction(3, 10),
    ),
    Case(
        "jax-new-variable",
        pod(container(command=["python", "train.py"], env={"XLA_CLIENT_MEM_FRACTION": "0.2"})),
        "jax",
        Fraction(1, 5),
    ),
    Case(
        # xla/pjrt/gpu/gpu_helpers.cc: allow_growth keeps the fraction (default 0.75) as the cap.
        "jax-no-prealloc-grows-up-to-the-fraction",
        pod(container(command=["python", "train.py"], env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})),
        "jax",
        Fraction(3, 4),
        evidence=["JAX default memory fraction 0.75"],
    ),
    Case(
        "jax-platform-allocator-unknown",
        pod(container(command=["python", "train.py"], env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})),
        "jax",
        None,
        warnings=["platform allocator has no cap"],
    ),
    # A setting that can lift JAX's cap, from a source vramguard cannot read, makes its VRAM unknown:
    # the allocator from a ConfigMap may be "platform" (no cap), and envFrom may set any of them.
    Case(
        "jax-allocator-from-a-configmap-unknown",
        pod(container(command=["python", "train.py"], env=[
            {"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "value": "0.2"},
            {"name": "XLA_PYTHON_CLIENT_ALLOCATOR", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}])),
        "jax",
        None,
        warnings=["env XLA_PYTHON_CLIENT_ALLOCATOR may be set from valueFrom", "so its VRAM is unknown"],
    ),
    Case(
        "jax-env-from-may-lift-the-cap",
        pod(container(command=["python", "train.py"], env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"},
                      envFrom=[{"configMapRef": {"name": "jax-settings"}}])),
        "jax",
        None,
        warnings=["may be set by configMapRef jax-settings"],
    ),
    # xla/pjrt/gpu/gpu_helpers.cc CreateBFCAllocator: "When unified memory is enabled, allow GPU memory
    # oversubscription by setting memory_fraction > 1."
    Case(
        "jax-unified-memory-unknown",
        pod(container(command=["python", "train.py"],
                      env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2", "TF_FORCE_UNIFIED_MEMORY": "1"})),
        "jax",
        None,
        warnings=["JAX holds memory outside its fraction"],
    ),
    # se_gpu_pjrt_client.cc: a CUDA-async allocator of fraction 1.0 for temporary buffers.
    Case(
        "jax-separate-temp-buffers-unknown",
        pod(container(command=["python", "train.py"], env={
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2",
            "XLA_FLAGS": "--xla_gpu_autotune_level=2 --xla_gpu_temp_buffer_use_separate_color=true"})),
        "jax",
        None,
        warnings=["XLA_FLAGS --xla_gpu_temp_buffer_use_separate_color=true"],
    ),
    Case(
        "jax-harmless-xla-flags-keep-the-fraction",
        pod(container(command=["python", "train.py"], env={
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2", "XLA_FLAGS": "--xla_gpu_autotune_level=2"})),
        "jax",
        Fraction(1, 5),
    ),
    # jaxlib/xla_client.py: only 'false', 'False' and '0' turn preallocation off; the cap holds either way.
    Case(
        "jax-preallocate-off-spelled-otherwise-still-the-fraction",
        pod(container(command=["python", "train.py"], env={"XLA_PYTHON_CLIENT_PREALLOCATE": "FALSE"})),
        "jax",
        Fraction(3, 4),
    ),
    # jaxlib/xla_client.py generate_pjrt_gpu_plugin_options raises when both are set.
    Case(
        "jax-both-variables-refused",
        pod(container(command=["python", "train.py"],
                      env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "XLA_CLIENT_MEM_FRACTION": "0.5"})),
        "jax",
        Fraction(1, 2),
        errors=["jaxlib refuses to start"],
    ),
    # A fraction from a Secret may be anything up to 1: not jaxlib's default 0.75.
    Case(
        "jax-fraction-from-a-secret-unknown",
        pod(container(command=["python", "train.py"], env=[
            {"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])),
        "jax",
        None,
        warnings=["XLA_PYTHON_CLIENT_MEM_FRACTION comes from valueFrom"],
    ),
    # jaxlib reads the value with float(): XLA's "0.75+" form does not reach it.
    Case(
        "jax-plus-form-refused",
        pod(container(command=["python", "train.py"], env={"XLA_CLIENT_MEM_FRACTION": "0.75+"})),
        "jax",
        None,
        errors=["is not a number"],
    ),
    Case(
        "jax-shell-assignment",
        pod(container(command=["sh", "-c", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python train.py"])),
        "jax",
        Fraction(1, 2),
    ),
    # MPS
    Case(
        "mps-limit-gib",
        pod(container(command=["python", "serve.py"], env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16G"})),
        None,
        bytes=16 * GiB,
        evidence=["env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=16G"],
    ),
    Case(
        "mps-limit-mib",
        pod(container(command=["python", "serve.py"], env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12288M"})),
        None,
        bytes=12288 * MiB,
    ),
    Case(
        "mps-limit-several-devices",
        pod(container(command=["python", "serve.py"], gpus=2, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G,1=12G"})),
        None,
        bytes=12 * GiB,
        gpus=2,
    ),
    Case(
        "mps-limit-missing-device",
        pod(container(command=["python", "serve.py"], gpus=2, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"})),
        None,
        bytes=8 * GiB,
        gpus=2,
        warnings=["sets no limit for device(s) 1"],
    ),
    Case(
        "mps-limit-garbage",
        pod(container(command=["python", "serve.py"], env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "16 gigs"})),
        None,
        None,
        errors=["is not <device>=<amount>M|G"],
    ),
    Case(
        "mps-thread-percentage",
        pod(
            container(
                command=["vllm", "serve", "--gpu-memory-utilization", "0.2"],
                env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"},
            )
        ),
        "vllm",
        Fraction(1, 5),
        sm_percent=25,
    ),
    Case(
        "mps-thread-percentage-out-of-range",
        pod(
            container(
                command=["vllm", "serve", "--gpu-memory-utilization", "0.2"],
                env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "150"},
            )
        ),
        "vllm",
        Fraction(1, 5),
        errors=["not a percentage in (0, 100]"],
    ),
    Case(
        "mps-limit-beats-claim-when-within",
        pod(
            container(
                command=["vllm", "serve", "--gpu-memory-utilization", "0.2"],
                env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20G"},
            )
        ),
        "vllm",
        bytes=20 * GiB,
    ),
    # Annotations
    Case(
        "annotation-quantity",
        pod(container(command=["python", "serve.py"]), annotations={"vramguard.io/vram": "12Gi"}),
        None,
        bytes=12 * GiB,
        evidence=["annotation vramguard.io/vram=12Gi"],
    ),
    Case(
        "annotation-fraction",
        pod(container(command=["python", "serve.py"]), annotations={"vramguard.io/vram": "0.25"}),
        None,
        Fraction(1, 4),
    ),
    Case("annotation-one-is-whole-gpu", pod(container(), annotations={"vramguard.io/vram": "1"}), None, Fraction(1)),
    Case(
        "annotation-per-container-wins",
        pod(container(), annotations={"vramguard.io/vram": "0.5", "vramguard.io/vram.main": "10Gi"}),
        None,
        bytes=10 * GiB,
    ),
    Case(
        "annotation-declaration-above-claim",
        pod(
            container(command=["vllm", "serve", "--gpu-memory-utilization", "0.2"]),
            annotations={"vramguard.io/vram": "0.25"},
        ),
        "vllm",
        Fraction(1, 4),
    ),
    Case(
        "annotation-claim-exceeds-declaration",
        pod(
            container(command=["vllm", "serve", "--gpu-memory-utilization", "0.3"]),
            annotations={"vramguard.io/vram": "0.25"},
        ),
        "vllm",
        Fraction(1, 4),
        errors=["more than its vramguard.io/vram declaration"],
    ),
    Case(
        "annotation-invalid-quantity",
        pod(container(), annotations={"vramguard.io/vram": "12 GB"}),
        None,
        None,
        errors=["neither a quantity"],
    ),
    Case(
        "annotation-fraction-too-big",
        pod(container(), annotations={"vramguard.io/vram": "1.5"}),
        None,
        None,
        errors=["must be in (0, 1]"],
    ),
    Case(
        "annotation-tiny", pod(container(), annotations={"vramguard.io/vram": "12"}), None, None, errors=["under 1Mi"]
    ),
    Case(
        "mps-limit-below-declared-bytes",
        pod(container(env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"}), annotations={"vramguard.io/vram": "6Gi"}),
        None,
        bytes=6 * GiB,
    ),
    # Unknown and resources
    Case(
        "unknown-engine",
        pod(container(command=["python", "serve.py"])),
        None,
        None,
        warnings=["no known engine and no vramguard.io/vram annotation"],
    ),
    Case(
        "gpu-shared-resource",
        pod(container(resource="nvidia.com/gpu.shared", command=["vllm", "serve", "--gpu-memory-utilization", "0.2"])),
        "vllm",
        Fraction(1, 5),
    ),
    Case(
        "mig-resource",
        pod(container(resource="nvidia.com/mig-3g.40gb", command=["vllm", "serve", "--gpu-memory-utilization", "0.8"])),
        "vllm",
        Fraction(4, 5),
    ),
    Case(
        "gpu-count-as-string",
        pod(container(gpus="2", command=["vllm", "serve", "-tp", "2", "--gpu-memory-utilization", "0.5"])),
        "vllm",
        Fraction(1, 2),
        gpus=2,
    ),
    Case(
        "gpu-count-fractional",
        pod(container(gpus="0.5", command=["vllm", "serve", "--gpu-memory-utilization", "0.5"])),
        "vllm",
        Fraction(1, 2),
        errors=["not a whole number of devices"],
    ),
    Case(
        "gpu-count-absurd",
        pod(container(gpus=10**18, command=["python", "x.py"]), annotations={"vramguard.io/vram": "1Gi"}),
        None,
        bytes=1 << 30,
        gpus=1024,
        errors=["more than any node offers"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_container_demand(case: Case) -> None:
    demand = derive_pod_demand(case.pod)
    assert demand.containers, "the pod asks for a GPU"
    c = demand.containers[0]
    reservation = c.reservation
    assert c.engine == case.engine
    assert c.gpus == case.gpus
    assert c.sm_percent == case.sm_percent
    if case.bytes is not None:
        assert reservation is not None and reservation.bytes == case.bytes
    elif case.fraction is not None:
        assert reservation is not None and reservation.fraction == case.fraction
    else:
        assert reservation is None
    assert len(demand.errors) == len(case.errors), demand.errors
    for expected, actual in zip(case.errors, demand.errors, strict=True):
        assert expected in actual
    for expected in case.warnings:
        assert any(expected in w for w in demand.warnings), demand.warnings
    for expected in case.evidence:
        assert any(e.startswith(expected) for e in c.evidence), c.evidence


def test_containers_without_gpus_are_left_out() -> None:
    demand = derive_pod_demand(
        pod(
            container(name="sidecar", gpus=None),
            container(name="llm", command=["vllm", "serve", "--gpu-memory-utilization", "0.2"]),
        )
    )
    assert [c.name for c in demand.containers] == ["llm"]


def test_zero_gpus_is_no_gpu_container() -> None:
    assert not derive_pod_demand(pod(container(gpus=0))).wants_gpu


def test_init_and_sidecar_containers() -> None:
    spec = pod(
        container(name="app", command=["vllm", "serve", "--gpu-memory-utilization", "0.2"]),
        initContainers=[
            container(name="warmup", annotations=None) | {"command": ["python", "warm.py"]},
            container(name="proxy", restartPolicy="Always", gpus=None),
        ],
    )
    demand = derive_pod_demand(spec)
    assert [(c.name, c.init) for c in demand.containers] == [("warmup", True), ("app", False)]


def test_claim_above_mps_limit_needs_device_size() -> None:
    demand = derive_pod_demand(
        pod(
            container(
                command=["vllm", "serve", "--gpu-memory-utilization", "0.3"],
                env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16G"},
            )
        )
    )
    assert not demand.errors  # a fraction against bytes: unknown until the GPU is known
    assert demand.conflicts(40 * GiB) == []  # 12 GiB fits under 16 GiB
    [problem] = demand.conflicts(80 * GiB)  # 24 GiB does not
    assert "more than its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (16.0 GiB)" in problem


def test_several_engines_in_one_container_add_up() -> None:
    script = "vllm serve a --gpu-memory-utilization 0.2 & vllm serve b --gpu-memory-utilization 0.4; wait"
    demand = derive_pod_demand(pod(container(command=["bash", "-c", script])))
    reservation = demand.containers[0].reservation
    assert reservation is not None
    assert reservation.fraction == Fraction(3, 5)
    assert [a.name for a in reservation.allowances].count("CUDA context") == 2  # one per process
    assert any("2 engine processes" in w and "summed" in w for w in demand.warnings)


def test_engines_that_together_claim_more_than_the_gpu_are_an_error() -> None:
    script = "vllm serve a --gpu-memory-utilization 0.6 & vllm serve b --gpu-memory-utilization 0.6"
    demand = derive_pod_demand(pod(container(command=["bash", "-c", script])))
    assert any("together claim 1.2 of the GPU" in e for e in demand.errors)


def test_configurable_gpu_resources() -> None:
    # AMD's GPUs are read by default (vramguard.vendors); a policy naming only NVIDIA's reads none of them.
    spec = pod(container(resource="amd.com/gpu", command=["vllm", "serve", "--gpu-memory-utilization", "0.5"]))
    assert derive_pod_demand(spec).containers[0].resource == "amd.com/gpu"
    serve = ["vllm", "serve", "--gpu-memory-utilization", "0.5"]
    partition = pod(container(resource="amd.com/cpx_nps4", command=serve))
    assert derive_pod_demand(partition).containers[0].resource == "amd.com/cpx_nps4"
    nvidia = DemandOptions(gpu_resources=frozenset({"nvidia.com/gpu"}), gpu_resource_prefixes=())
    assert not derive_pod_demand(spec, nvidia).wants_gpu


@pytest.mark.parametrize(
    ("spec", "implicit"),
    [
        (pod(container(image=VLLM, args=["--model", "m"])), True),
        (pod(container(image=VLLM, args=["--gpu-memory-utilization", "0.3"])), False),
        (pod(container(command=["text-generation-launcher"])), True),
        (pod(container(command=["text-generation-launcher"], env={"CUDA_MEMORY_FRACTION": "0.5"})), False),
        (pod(container(command=["python", "t.py"], env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})), True),
        (pod(container(command=["python", "t.py"], env={"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})), False),
        (pod(container(command=["python", "serve.py"])), False),
        (pod(container(command=["python3", "-m", "sglang.launch_server", "--config", "/etc/sglang.yaml"])), False),
    ],
    ids=["vllm-default", "vllm-explicit", "tgi-default", "tgi-env", "jax-default", "jax-explicit", "unknown",
         "sglang-config"],
)
def test_implicit_default_is_flagged(spec: dict[str, Any], implicit: bool) -> None:
    assert derive_pod_demand(spec).containers[0].implicit_default is implicit


VLLM_TYPOS = {
    # vLLM's parser refuses an option it does not know (argparse "unrecognized arguments"): the pod
    # crash-loops, so a misspelled memory or parallelism option is an error, naming the option meant.
    "utilization": (["--gpu-memory-utlization", "0.3"], "--gpu-memory-utlization", "--gpu-memory-utilization"),
    "tensor": (["--tensor-paralel-size", "2"], "--tensor-paralel-size", "--tensor-parallel-size"),
    "underscored": (["--gpu_memory_utilisation", "0.3"], "--gpu_memory_utilisation", "--gpu-memory-utilization"),
}


@pytest.mark.parametrize(("flags", "written", "meant"), VLLM_TYPOS.values(), ids=VLLM_TYPOS.keys())
def test_a_misspelled_vllm_memory_or_parallel_option_is_an_error(flags: list[str], written: str, meant: str) -> None:
    spec = pod(container("vllm", image="vllm/vllm-openai:v0.21.0", args=["--model", "m", *flags]))
    [demand] = derive_pod_demand(spec).containers
    assert (
        f"container vllm: {written}: vLLM has no such option and exits at start (\"unrecognized arguments\"); "
        f"did you mean {meant}?"
    ) in demand.errors, demand.errors


@pytest.mark.parametrize(
    "flags",
    [
        ["--gpu_memory_utilization", "0.3"],  # underscores: vLLM's parser reads them as dashes
        ["--data-parallel-size-local", "1"],  # extends a known option: a real one
        ["--max-model-len", "4096", "--max-num-seqs", "8", "--enable-chunked-prefill"],
        ["--pipeline-parallel-size", "1", "--tensor-parallel-size", "1", "--data-parallel-size", "1"],
    ],
    ids=["underscores", "extension", "unrelated", "all-known"],
)
def test_real_vllm_options_are_no_misspelling(flags: list[str]) -> None:
    spec = pod(container("vllm", image="vllm/vllm-openai:v0.21.0", args=["--model", "m", *flags]))
    [demand] = derive_pod_demand(spec).containers
    assert not [e for e in demand.errors if "did you mean" in e], demand.errors


def test_names_meant_for_vramguard_that_it_does_not_read_are_warned_about() -> None:
    spec = pod(
        container("vllm", image="vllm/vllm-openai:v0.21.0", args=["--model", "m", "--gpu-memory-utilization", "0.3"]),
        container("side", gpus=None, resources={"limits": {"nvidia.com/gpus": "1"}}),
        annotations={
            "vramguard.io/vrma": "20Gi",  # misspelled
            "vramgaurd.io/vram": "20Gi",  # misspelled domain
            "vramguard.io/vram.worker": "10Gi",  # names no container
            "vramguard.io/qos-class": "guaranteed",  # a label
            "vramguard.io/vram.vllm": "30Gi",  # read
            "example.com/owner": "team-a",  # none of vramguard's business
        },
    )
    warnings = derive_pod_demand(spec).warnings
    assert "annotation 'vramguard.io/vrma' is not one vramguard reads; did you mean vramguard.io/vram?" in warnings
    assert "annotation 'vramgaurd.io/vram' is not one vramguard reads; did you mean vramguard.io/vram?" in warnings
    assert "annotation 'vramguard.io/vram.worker' names no container of the pod (side, vllm): nothing reads it" in (
        warnings
    )
    assert "vramguard.io/qos-class is a label, not an annotation: nothing reads it as an annotation" in warnings
    assert (
        "container 'side': resource 'nvidia.com/gpus' is no GPU resource (no node offers it, and the pod waits); "
        "did you mean nvidia.com/gpu?"
    ) in warnings
    assert not [w for w in warnings if "example.com" in w or "vram.vllm" in w]


def test_a_pod_with_only_names_vramguard_reads_draws_no_such_warning() -> None:
    spec = pod(
        container("vllm", image="vllm/vllm-openai:v0.21.0", args=["--model", "m", "--gpu-memory-utilization", "0.3"]),
        annotations={"vramguard.io/vram": "30Gi", "vramguard.io/placement": "{}", "prometheus.io/scrape": "true"},
    )
    assert not [w for w in derive_pod_demand(spec).warnings if "vramguard reads" in w or "did you mean" in w]


SGLANG = ["python3", "-m", "sglang.launch_server", "--model-path", "m"]
TGI = "ghcr.io/huggingface/text-generation-inference:3.3.4"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # SGLang's launch_server parses with argparse, which exits on an option it does not know.
        (container("sglang", command=[*SGLANG, "--mem-fraction-statc", "0.8"]),
         '--mem-fraction-statc: SGLang has no such option and exits at start ("unrecognized arguments"); '
         "did you mean --mem-fraction-static?"),
        # TGI's launcher parses with clap, which refuses an unexpected argument.
        (container("tgi", image=TGI, args=["--model-id", "m", "--num-shards", "2"]),
         "--num-shards: TGI's launcher has no such option and exits at start (\"unexpected argument\"); "
         "did you mean --num-shard?"),
    ],
    ids=["sglang", "tgi"],
)
def test_misspelled_sglang_and_tgi_options_are_errors(spec: dict[str, Any], expected: str) -> None:
    [demand] = derive_pod_demand(pod(spec)).containers
    assert [e for e in demand.errors if expected in e], demand.errors


def test_real_sglang_and_tgi_options_are_no_misspelling() -> None:
    sglang = container("sglang", command=[*SGLANG, "--ep-size", "2", "--tp-size", "2", "--mem-fraction-static", "0.8"],
                       gpus=2)
    tgi = container("tgi", image=TGI, args=["--model-id", "m", "--num-shard", "1", "--cuda-memory-fraction", "0.5"])
    for spec in (sglang, tgi):
        [demand] = derive_pod_demand(pod(spec)).containers
        assert not [e for e in demand.errors if "did you mean" in e], demand.errors
