"""Engines recognised by what runs: vendor builds of TGI, Dynamo workers, KServe's Hugging Face server."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.demand import derive_pod_demand

GCP_TGI = (
    "us-docker.pkg.dev/deeplearning-platform-release/gcr.io/"
    "huggingface-text-generation-inference-cu124.2-4.ubuntu2204.py311"
)
AWS_TGI = (
    "763104351884.dkr.ecr.us-east-1.amazonaws.com/"
    "huggingface-pytorch-tgi-inference:2.4.0-tgi2.4.0-gpu-py311-cu124-ubuntu22.04"
)
DYNAMO_VLLM = "nvcr.io/nvidia/ai-dynamo/vllm-runtime:0.6.1"
DYNAMO_SGLANG = "nvcr.io/nvidia/ai-dynamo/sglang-runtime:0.6.1"

CASES = [
    pytest.param(
        container(image=GCP_TGI, args=["--model-id", "google/gemma-2-9b-it", "--cuda-memory-fraction", "0.4"]),
        "tgi", Fraction(2, 5), id="gcp-dlc-tgi-args-only",
    ),
    pytest.param(
        container(image=AWS_TGI, env={"CUDA_MEMORY_FRACTION": "0.5", "MODEL_ID": "m"}),
        "tgi", Fraction(1, 2), id="aws-dlc-tgi-env-only",
    ),
    pytest.param(
        container(image="ghcr.io/huggingface/text-generation-inference:3.0.1",
                  command=["/tgi-entrypoint.sh"], args=["--cuda-memory-fraction", "0.25"]),
        "tgi", Fraction(1, 4), id="tgi-entrypoint-script",
    ),
    pytest.param(
        container(image=DYNAMO_VLLM, command=["/bin/sh", "-c"],
                  args=["python3 -m dynamo.vllm --model Qwen/Qwen3-0.6B --gpu-memory-utilization 0.45"]),
        "vllm", Fraction(45, 100), id="dynamo-vllm-worker",
    ),
    pytest.param(
        container(image=DYNAMO_VLLM, gpus=2, command=["python3", "-m", "dynamo.vllm"],
                  args=["--model", "m", "--tensor-parallel-size", "2", "--is-prefill-worker"]),
        # Dynamo's tag says nothing of vLLM's version: the conservative end, the whole device (v0.34.0+).
        "vllm", Fraction(1), id="dynamo-vllm-default-ignores-dynamo-tag",
    ),
    pytest.param(
        container(image=DYNAMO_SGLANG, command=["python3", "-m", "dynamo.sglang"],
                  args=["--model-path", "m", "--tp", "1", "--mem-fraction-static", "0.7"]),
        "sglang", Fraction(7, 10), id="dynamo-sglang-worker",
    ),
    pytest.param(
        container(image="kserve/huggingfaceserver:v0.15.0",
                  args=["--model_name=llama3", "--model_id=meta-llama/Llama-3.1-8B-Instruct",
                        "--gpu-memory-utilization=0.6"]),
        "vllm", Fraction(3, 5), id="kserve-huggingfaceserver-vllm-backend",
    ),
    pytest.param(
        # The server's plain argparse parser drops an underscore spelling of a vLLM option
        # (huggingfaceserver/__main__.py parse_known_args): vLLM runs at its default, not 0.4.
        container(image="kserve/huggingfaceserver:v0.15.0",
                  args=["--model_name=llama3", "--model_id=meta-llama/Llama-3.1-8B-Instruct",
                        "--gpu_memory_utilization=0.4", "--max_model_len=8192"]),
        "vllm", Fraction(1), id="kserve-huggingfaceserver-drops-underscored-vllm-options",
    ),
    pytest.param(
        container(image="kserve/huggingfaceserver:v0.15.0",
                  args=["--model_name=bert", "--model_id=bert-base", "--backend=huggingface"]),
        None, None, id="kserve-huggingfaceserver-transformers-backend-is-not-vllm",
    ),
    pytest.param(
        container(image="example/fastgiraffe:1.0", args=["--cuda-memory-fraction", "0.3"]),
        None, None, id="tgi-inside-a-word-is-not-tgi",
    ),
]


@pytest.mark.parametrize(("spec", "engine", "fraction"), CASES)
def test_engine_recognised_by_what_runs(spec: dict[str, Any], engine: str | None, fraction: Fraction | None) -> None:
    demand = derive_pod_demand(pod(spec))
    c = demand.containers[0]
    assert c.engine == engine, (demand.errors, demand.warnings)
    reservation = c.reservation
    if fraction is None:
        assert reservation is None
    else:
        assert reservation is not None and reservation.fraction == fraction
    assert not demand.errors


def test_kserve_says_which_options_its_parser_drops() -> None:
    spec = container(image="kserve/huggingfaceserver:v0.15.0", gpus=2,
                     args=["--model_id=m", "--tensor_parallel_size", "2", "--gpu-memory-utilization=0.5"])
    demand = derive_pod_demand(pod(spec))
    assert any("drops --tensor_parallel_size unread" in w for w in demand.warnings), demand.warnings
    # Dropped, the size leaves vLLM on one GPU of the two the container asks for.
    assert any("1 GPU" in e and "2" in e for e in demand.errors), demand.errors
