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
from vramguard.demand.commandline import ContainerEnv, EnvValue, shell_tokens, shlex_tokens, split_script
from vramguard.engines import tgi

# Scripts the regular expression splits (no quotes, escapes or comments): operators, odd whitespace.
PLAIN_CASES = {
    "simple": "pip install -q x && exec vllm serve m --gpu-memory-utilization 0.3",
    "operators-glued": "a&&b||c;d|e",
    "redirections": "vllm serve m >/tmp/log 2>&1 </dev/null",
    "operator-runs": "a ;; b |& c >| d",
    "newlines-and-cr": "export A=1\nvllm serve m\r\n--x 1",
    "tabs": "\tvllm\tserve\t m",
    "line-continuation": "vllm serve m \\\n  --gpu-memory-utilization 0.5",
    "subshell-and-group": "( cd /x; vllm serve m ) { a; }",
    "non-breaking-and-vertical-space": "a\u00a0b\x0bc\x0cd",
    "variables": "vllm serve $MODEL --gpu-memory-utilization ${UTIL:-0.9}",
    "empty": "",
    "only-spaces": " \t \r ",
}
# Scripts only shlex reads right: the shortcut must not take them.
SHLEX_CASES = {
    "single-quotes": "vllm serve 'my model' --x 1",
    "double-quotes": 'sh -c "vllm serve m"',
    "escape": "vllm serve m\\ n",
    "comment": "vllm serve m # --gpu-memory-utilization 0.1",
    "comment-mid-word": "a#b c",
    "unbalanced-quote": "vllm serve 'm",
    "empty-quotes": "a '' b",
}


@pytest.mark.parametrize("script", list(PLAIN_CASES.values()) + list(SHLEX_CASES.values()),
                         ids=list(PLAIN_CASES) + list(SHLEX_CASES))
def test_shell_tokens_equal_shlex(script: str) -> None:
    assert shell_tokens(script) == shlex_tokens(script)


def test_the_shortcut_is_taken_for_plain_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the shortcut every script would go through shlex; with it a plain one never does.
    def refuse(script: str) -> list[str]:
        raise AssertionError(f"shlex used for {script!r}")

    monkeypatch.setattr("vramguard.demand.commandline.shlex_tokens", refuse)
    assert split_script(PLAIN_CASES["simple"]) == [
        ["pip", "install", "-q", "x"], ["exec", "vllm", "serve", "m", "--gpu-memory-utilization", "0.3"]
    ]
    with pytest.raises(AssertionError):
        split_script(SHLEX_CASES["single-quotes"])


SHELL_ALPHABET = st.sampled_from(
    [*" \t\r\n();<>|&{}!=$-./:_~*?\u00a0\x0b\x0c\x00aé0", "&&", "||", ">>", "2>&1", "exec", "vllm", "serve", "\\\n",
     "'", '"', "\\", "#"]
)


@settings(max_examples=2000)
@given(st.lists(SHELL_ALPHABET, max_size=30).map("".join))
def test_shell_tokens_equal_shlex_on_generated_scripts(script: str) -> None:
    assert shell_tokens(script) == shlex_tokens(script)


@settings(max_examples=500)
@given(st.text(max_size=40))
def test_shell_tokens_equal_shlex_on_any_text(script: str) -> None:
    assert shell_tokens(script) == shlex_tokens(script)


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
        patched.setattr("vramguard.demand.commandline.shell_tokens", shlex_tokens)
        patched.setattr("vramguard.engines.recognise", engines.recognise_each)
        general = derive_pod_demand(spec)
    assert fast == general
