"""The shortcuts of demand derivation give exactly what the general path gives.

Each shortcut is checked against the code it skips, on named cases and on generated input: a
shortcut that differs in any case fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.podspecs import container, pod
from tests.test_demand_properties import pods
from vramguard import engines
from vramguard.demand import derive_pod_demand
from vramguard.demand.commandline import ContainerEnv, EnvValue
from vramguard.engines import tgi

ENV = ContainerEnv({"CUDA_MEMORY_FRACTION": EnvValue("0.5", "env"), "NUM_SHARD": EnvValue("2", "env")})
PROGRAMS = ["vllm", "sglang", tgi.LAUNCHER, *sorted(tgi.ENTRYPOINT_SCRIPTS), "python", "python3", "python3.11",
            "/usr/bin/python3", "/usr/local/bin/vllm", "pip", "ray", "bash", "sh", "torchrun", "", "vllm-x"]
WORDS = ["serve", "-m", "-u", "-X", "dev", "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main",
         "sglang.launch_server", "dynamo.vllm", "dynamo.sglang", "huggingfaceserver", "--backend", "vllm", "auto",
         "--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.7", "--tp", "2", "--cuda-memory-fraction",
         "-mvllm.entrypoints.api_server", "x"]


@settings(max_examples=1500)
@given(st.sampled_from(PROGRAMS), st.lists(st.sampled_from(WORDS), max_size=8))
def test_recognise_equals_asking_every_engine(executable: str, rest: list[str]) -> None:
    argv = [executable, *rest] if executable else rest
    assert engines.recognise(argv, ENV, "img:1", "c") == engines.recognise_each(argv, ENV, "img:1", "c")


def test_every_engine_program_is_known_to_the_shortcut() -> None:
    # An engine whose program is missing from ``programs`` would be skipped by recognise.
    for argv in (["vllm", "serve", "m"], ["sglang", "serve"], [tgi.LAUNCHER], ["tgi-entrypoint.sh"]):
        assert engines.recognise_each(argv, ENV, "", "c") is not None
        assert engines.recognise(argv, ENV, "", "c") == engines.recognise_each(argv, ENV, "", "c")


# Simple commands glued by operators, with and without spaces, so that a token split wrongly changes
# which engine a script starts or what its flags read.
SIMPLE_COMMANDS = st.lists(st.sampled_from([*WORDS, "pip", "install", "exec", "env", "A=1", "nohup"]), max_size=6)
SEPARATORS = st.sampled_from(["&&", " && ", ";", "|", "||", "\n", "\r\n", ">", " 2>&1 ", "&", "\t", " ", "'", "#"])
HEADS = st.sampled_from(["", "vllm serve m", "sglang serve"])
SCRIPTS = st.lists(st.tuples(HEADS, SIMPLE_COMMANDS, SEPARATORS), max_size=4).map(
    lambda parts: "".join(f"{head} {' '.join(words)}{sep}" for head, words, sep in parts)
)
SHELL_PODS = SCRIPTS.map(lambda script: pod(container(command=["sh", "-c", script], env={"UTIL": "0.4"})))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(pods(), SHELL_PODS))
def test_pods_derive_the_same_without_the_shortcuts(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]) -> None:
    fast = derive_pod_demand(spec)
    with monkeypatch.context() as patched:
        patched.setattr("vramguard.engines.recognise", engines.recognise_each)
        general = derive_pod_demand(spec)
    assert fast == general
