"""Properties of the demand parser: it never raises, and it is deterministic."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.podspecs import container, pod
from vramguard.demand import derive_pod_demand
from vramguard.demand.commandline import Budget, ContainerEnv, EnvValue, expand_kubernetes
from vramguard.demand.shell import launch

FLAGS = [
    "--gpu-memory-utilization",
    "--gpu_memory_utilization",
    "-tp",
    "--tensor-parallel-size",
    "-pp",
    "--kv-cache-memory-bytes",
    "--mem-fraction-static",
    "--cuda-memory-fraction",
    "--num-shard",
    "--config",
    "--tp",
    "--dp",
    "serve",
    "vllm",
    "-m",
    "sglang.launch_server",
    "&&",
    ";",
    "|",
]
words = st.one_of(
    st.sampled_from(FLAGS),
    st.text(max_size=12),
    st.from_regex(r"-?[0-9]{0,3}\.?[0-9]{0,3}(e-?[0-9])?", fullmatch=True),
    st.sampled_from(["$(A)", "$$(A)", "$(", "${A}", "$A", "'", '"', "\\", "nan", "inf", "1e400"]),
)
argv = st.lists(words, max_size=12)
commands = st.one_of(
    argv,
    argv.map(lambda a: ["vllm", "serve", *a]),
    argv.map(lambda a: ["python3", "-m", "vllm.entrypoints.openai.api_server", *a]),
    argv.map(lambda a: ["text-generation-launcher", *a]),
    argv.map(lambda a: ["sh", "-c", " ".join(a)]),
    st.text(max_size=80).map(lambda s: ["bash", "-lc", s]),
)
env_values = st.dictionaries(
    st.sampled_from(
        [
            "A",
            "UTIL",
            "CUDA_MEMORY_FRACTION",
            "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "XLA_PYTHON_CLIENT_PREALLOCATE",
            "NUM_SHARD",
        ]
    ),
    st.one_of(words, st.text(max_size=20)),
    max_size=4,
)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8))
junk = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=10,
)


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    spec = container(
        image=draw(
            st.sampled_from(
                [
                    "vllm/vllm-openai:v0.20.0",
                    "vllm/vllm-openai",
                    "ghcr.io/huggingface/text-generation-inference:2",
                    "x",
                    "",
                ]
            )
        ),
        command=draw(st.one_of(st.none(), commands)),
        args=draw(st.one_of(st.none(), argv)),
        env=draw(env_values),
        gpus=draw(st.one_of(st.integers(-2, 8), st.sampled_from(["1", "2", "0.5", "x", "1e3", ""]))),
        resource=draw(st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"])),
    )
    annotations = draw(
        st.dictionaries(
            st.sampled_from(["vramguard.io/vram", "vramguard.io/vram.main"]),
            st.one_of(words, st.sampled_from(["12Gi", "0.25", "1", "0", "-1Gi"])),
            max_size=2,
        )
    )
    return pod(spec, annotations=annotations)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(pods())
def test_never_raises_and_is_deterministic(spec: dict[str, Any]) -> None:
    first = derive_pod_demand(spec)
    assert first == derive_pod_demand(spec)
    for c in first.containers:
        assert c.gpus >= 1
        vram = c.reservation
        if vram is not None and vram.fraction is not None:
            assert 0 < vram.fraction <= 1
        c.conflicts(80 << 30)


@settings(max_examples=300)
@given(junk)
def test_arbitrary_json_never_raises(value: Any) -> None:
    derive_pod_demand({"spec": value, "metadata": value})
    derive_pod_demand({"spec": {"containers": [value], "initContainers": value}})
    derive_pod_demand(
        {
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "resources": {"limits": {"nvidia.com/gpu": value}},
                        "command": value,
                        "args": value,
                        "env": value,
                    }
                ]
            }
        }
    )


@given(st.text(max_size=60))
def test_shell_scripts_never_raise(script: str) -> None:
    walked = launch(["sh", "-c", script], ContainerEnv(), lambda invocation: invocation.argv, Budget())
    for argv in [*walked.started, *(argv for phase in walked.phases for argv in phase.foreground)]:
        assert argv


SHELL_PIECES = st.sampled_from([
    *" \t\n;&|()<>{}!$`'\"\\#=-*:?@0aU", "${", "$(", "$((", "))", "&&", "||", ";;", "<<E", "\nE\n", "if ", "then ",
    "else ", "fi", "for ", "in ", "do ", "done", "case ", "esac", "while ", "function ", "f()", "[[ ", " ]]", "export ",
    "source ", "eval ", "exec ", "wait", "set -- ", "shift", "env -i ", "U=0.3 ",
    "vllm serve m --gpu-memory-utilization ", "$U", "${U:-0.9}", '"$@"', "python x.py", "sleep 1", "$'a\\n'",
    "read U", "trap 'x' EXIT", "unset U",
])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SHELL_PIECES, max_size=30).map("".join), st.booleans())
def test_shell_like_scripts_never_raise(script: str, env_from: bool) -> None:
    extra = {"envFrom": [{"configMapRef": {"name": "c"}}]} if env_from else {}
    demand = derive_pod_demand(pod(container(command=["bash", "-c", script], env={"U": "0.5"}, **extra)))
    for c in demand.containers:
        vram = c.reservation
        assert vram is None or vram.fraction is None or 0 < vram.fraction <= 1


@given(st.text(alphabet="$()AB ", max_size=30))
def test_kubernetes_expansion_matches_reference(text: str) -> None:
    env = ContainerEnv({"A": EnvValue("x", "env")})
    assert expand_kubernetes(text, env) == reference_expand(text, {"A": "x"})


def reference_expand(text: str, mapping: dict[str, str]) -> str:
    """A direct transcription of the kubelet's expansion algorithm, for comparison."""
    out, checkpoint, cursor = [], 0, 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1 :]
            if rest[0] == "$":
                read, is_var, advance = "$", False, 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close == -1:
                    read, is_var, advance = "$(", False, 1
                else:
                    read, is_var, advance = rest[1:close], True, close + 1
            else:
                read, is_var, advance = "$" + rest[0], False, 1
            out.append(mapping.get(read, f"$({read})") if is_var else read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]
