"""What a container's shell script runs, and which of its processes hold the GPU at the same time.

Expected values follow the shell's own rules (POSIX.1-2024 "Shell Command Language": lists,
asynchronous lists, ``exec``, ``wait``, parameter expansion, field splitting, exported variables)
and the engines' sources cited beside each case, never vramguard's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.demand import derive_pod_demand
from vramguard.quantity import GiB

VLLM = "vllm/vllm-openai:v0.21.0"
ENGINE = "vllm serve m --gpu-memory-utilization 0.3"


@dataclass
class Case:
    """A container and what its demand must come out as (``fraction`` ``None``: unknown VRAM)."""

    id: str
    spec: dict[str, Any]
    engine: str | None
    fraction: Fraction | None
    warnings: list[str] = field(default_factory=list)
    """Substrings that must appear among the warnings."""


def bash(script: str, **extra: Any) -> dict[str, Any]:
    return container(image=VLLM, command=["bash", "-c", script], **extra)


CASES = [
    # -- what runs at once: an engine beside a program that may use the GPU --------------------
    Case("unknown-program-in-the-background-before", bash(f"python train.py & {ENGINE}"), "vllm", None,
         ["'python train.py' may use the GPU while vLLM runs", "vramguard.io/vram.main"]),
    Case("unknown-program-in-the-foreground-after", bash(f"{ENGINE} & python other.py; wait"), "vllm", None,
         ["'python other.py' may use the GPU while vLLM runs"]),
    Case("unknown-program-in-a-pipeline", bash(f"{ENGINE} | python filter.py"), "vllm", None,
         ["'python filter.py' may use the GPU"]),
    Case("unknown-program-in-a-background-group", bash(f"( cd /x && ./worker ) & exec {ENGINE}"), "vllm", None,
         ["'./worker' may use the GPU"]),
    Case("command-substitution-runs-beside", bash(f"{ENGINE} & echo $(python probe.py); wait"), "vllm", None,
         ["'python probe.py' may use the GPU"]),
    # A command substitution finishes before the command that uses its output starts.
    Case("command-substitution-runs-before", bash(f"{ENGINE} --served-model-name $(python name.py)"), "vllm",
         Fraction(3, 10)),
    # Waiting, logging, health checks and proxies hold no GPU memory.
    Case("sleep-beside", bash(f"{ENGINE} & sleep infinity"), "vllm", Fraction(3, 10)),
    Case("tee-in-the-pipeline", bash(f"{ENGINE} 2>&1 | tee /var/log/vllm.log"), "vllm", Fraction(3, 10)),
    Case("proxy-and-health-loop", bash(f"nginx & {ENGINE} & while true; do curl -s localhost:8000/health; "
                                       "sleep 10; done"), "vllm", Fraction(3, 10)),
    Case("builtins-beside", bash(f"{ENGINE} & echo started; trap 'kill 0' TERM; wait"), "vllm", Fraction(3, 10)),
    # An arithmetic expansion is one number ("Arithmetic Expansion": its result replaces it), never
    # several words, even through an unquoted variable: it cannot hide options (llm-d's wide-EP
    # recipe computes vLLM's --data-parallel-start-rank so). Its value stays unknown.
    Case("arithmetic-through-a-variable", bash("RANK=$(( ${LWS_WORKER_INDEX:-0} * 8 )); "
                                               f"{ENGINE} --data-parallel-start-rank $RANK"), "vllm", Fraction(3, 10)),
    Case("arithmetic-in-place", bash(f"{ENGINE} --data-parallel-start-rank $(( ${{RANK:-0}} * 8 ))"), "vllm",
         Fraction(3, 10)),
    # An unknown variable may still split into options.
    Case("plain-variable-may-hide-options", bash(f"{ENGINE} $EXTRA"), "vllm", None, ["may set"]),
    # -- Ray's command line: its daemons hold nothing, what it runs for the script may -------------
    # ray/dashboard/modules/job/cli.py submit: the entrypoint after "--" is shlex.join-ed and run by a
    # shell as the job's driver (job_supervisor.py _exec_entrypoint); the command waits for the job
    # unless --no-wait. ray/scripts/scripts.py: start, stop, status and health-check run Ray's daemons.
    Case("ray-job-entrypoint-beside-the-engine",
         bash(f"{ENGINE} & ray job submit --address http://127.0.0.1:8265 -- python train.py; wait"), "vllm", None,
         ["'python train.py' may use the GPU while vLLM runs"]),
    Case("ray-job-entrypoint-is-the-engine",
         bash("ray start --head && ray job submit --address http://127.0.0.1:8265 --runtime-env-json '{}' -v "
              f"-- {ENGINE}"), "vllm", Fraction(3, 10)),
    Case("ray-job-submit-is-the-command",
         container(image=VLLM, command=["ray", "job", "submit", "--", *ENGINE.split()]), "vllm", Fraction(3, 10)),
    Case("ray-job-not-waited-for-runs-beside",
         bash(f"ray job submit --no-wait --submission-id=t -- python train.py && exec {ENGINE}"), "vllm", None,
         ["'python train.py' may use the GPU while vLLM runs"]),
    Case("ray-job-entrypoint-without-separator", bash(f"{ENGINE} & ray job submit python train.py; wait"), "vllm",
         None, ["'ray job submit python train.py' may use the GPU"]),
    Case("ray-exec-may-use-the-gpu", bash(f"{ENGINE} & ray exec cluster.yaml 'python x.py'; wait"), "vllm", None,
         ["'ray exec cluster.yaml", "may use the GPU while vLLM runs"]),
    Case("ray-symmetric-run-may-use-the-gpu",
         bash(f"{ENGINE} & ray symmetric-run --address 127.0.0.1:6379 -- python x.py; wait"), "vllm", None,
         ["may use the GPU while vLLM runs"]),
    # vLLM's multi-node recipe (docs/serving/parallelism_scaling.md): every pod runs the same command; Ray
    # starts, the entrypoint runs on the head and its Ray workers on the others hold what it says.
    Case("ray-symmetric-run-entrypoint-is-the-engine",
         container(image=VLLM, command=["ray", "symmetric-run", "--address", "leader:6379", "--min-nodes", "2",
                                        "--num-gpus", "1", "--", *ENGINE.split()]), "vllm", Fraction(3, 10)),
    Case("ray-symmetric-run-without-entrypoint", bash(f"{ENGINE} & ray symmetric-run --address x; wait"), "vllm",
         None, ["may use the GPU while vLLM runs"]),
    Case("ray-daemons-beside", bash(f"ray start --head --port=6379; {ENGINE} & ray status; "
                                    "ray --logging-level info job list --address x; ray health-check; "
                                    "ray job logs -f abc; ray --version; wait"), "vllm", Fraction(3, 10)),
    # -- one after the other: set-up steps are not counted -----------------------------------
    Case("install-then-serve", bash(f"pip install -q x && {ENGINE}"), "vllm", Fraction(3, 10)),
    Case("download-then-exec", bash(f"python download.py; exec {ENGINE}"), "vllm", Fraction(3, 10)),
    Case("background-job-waited-for", bash(f"python warmup.py & wait; {ENGINE}"), "vllm", Fraction(3, 10)),
    Case("setup-then-background-engine", bash(f"python prepare.py; {ENGINE} & sleep infinity"), "vllm",
         Fraction(3, 10)),
    # exec replaces the shell: what follows never runs.
    Case("nothing-runs-after-exec", bash(f"exec {ENGINE}; python other.py"), "vllm", Fraction(3, 10)),
    # -- several engines: those running at once add up, alternatives count the largest ------------
    Case("two-engines-at-once", bash("vllm serve a --gpu-memory-utilization 0.2 & "
                                     "vllm serve b --gpu-memory-utilization 0.4; wait"), "vllm", Fraction(3, 5),
         ["2 engine processes"]),
    Case("if-else-engines", bash("if [ -f /big ]; then exec vllm serve m --gpu-memory-utilization 0.8; "
                                 "else exec vllm serve m --gpu-memory-utilization 0.2; fi"), "vllm", Fraction(4, 5)),
    Case("engine-started-in-a-loop", bash("for i in 1 2; do vllm serve m --port 800$i "
                                          "--gpu-memory-utilization 0.3 & done; wait"), "vllm", None,
         ["in the background inside a loop"]),
    # -- values the script chooses: the largest it can take --------------------------------------
    Case("if-else-fraction", bash("if [ -f /big ]; then U=0.9; else U=0.3; fi\n"
                                  "vllm serve m --gpu-memory-utilization $U"), "vllm", Fraction(9, 10)),
    Case("case-fraction", bash("case $MODE in big) U=0.8;; *) U=0.2;; esac; "
                               "vllm serve m --gpu-memory-utilization \"$U\""), "vllm", Fraction(4, 5)),
    Case("or-fraction", bash("[ -n \"$BIG\" ] && U=0.7 || U=0.4; vllm serve m --gpu-memory-utilization $U"),
         "vllm", Fraction(7, 10)),
    Case("conditional-default", bash("[ -f /big ] && U=0.9; vllm serve m --gpu-memory-utilization ${U:-0.3}"),
         "vllm", Fraction(9, 10)),
    Case("non-numeric-choice-is-unknown", bash("if [ -f /x ]; then U=0.9; else U=high; fi; "
                                               "vllm serve m --gpu-memory-utilization $U"), "vllm", None),
    # A script's own values, the last assignment and the positional parameters (the last flag wins).
    Case("export-then-serve", bash("export U=0.15; vllm serve m --gpu-memory-utilization $U"), "vllm",
         Fraction(15, 100)),
    Case("function-argument", bash("start() { exec vllm serve m --gpu-memory-utilization $1; }\nstart 0.6"),
         "vllm", Fraction(3, 5)),
    Case("positional-parameters", container(command=["sh", "-c", f'exec {ENGINE} "$@"', "sh",
                                                     "--gpu-memory-utilization", "0.9"]), "vllm", Fraction(9, 10)),
    Case("field-splitting", bash("ARGS='--gpu-memory-utilization 0.9'; " + ENGINE + " $ARGS"), "vllm",
         Fraction(9, 10)),
    Case("here-document-is-not-run", bash("cat <<EOF > /etc/note\nvllm serve m --gpu-memory-utilization 0.9 &\n"
                                          f"EOF\n{ENGINE}"), "vllm", Fraction(3, 10)),
    # -- what the shell or a file may change: unknown ------------------------------------------
    Case("sourced-file-may-set-the-value", bash(". /etc/cfg.sh; vllm serve m --gpu-memory-utilization $U",
                                                env={"U": "0.3"}), "vllm", None),
    Case("unreadable-argument-after-the-flag", bash(f"{ENGINE} $EXTRA_ARGS"), "vllm", None,
         ["argument '$EXTRA_ARGS' may set its memory flags"]),
    Case("secret-argument-may-add-flags", container(image=VLLM, args=["--model", "m", "--gpu-memory-utilization",
                                                                      "0.3", "$(EXTRA)"],
                                                    env=[{"name": "EXTRA", "valueFrom": {"secretKeyRef": {
                                                        "name": "s", "key": "k"}}}]), "vllm", None),
    # sglang/srt/server_args.py and TGI's clap parser: the last occurrence of a flag wins.
    Case("sglang-argument-after-the-fraction",
         bash("exec python3 -m sglang.launch_server --mem-fraction-static 0.3 $EXTRA"), "sglang", None,
         ["may set --mem-fraction-static again"]),
    Case("tgi-argument-after-the-fraction", bash("exec text-generation-launcher --cuda-memory-fraction 0.3 $EXTRA"),
         "tgi", None, ["may set --cuda-memory-fraction again"]),
    Case("tgi-argument-before-the-fraction", bash("exec text-generation-launcher $EXTRA --cuda-memory-fraction 0.3"),
         "tgi", Fraction(3, 10)),
    Case("unknown-value-of-a-flag-is-harmless", bash("vllm serve --model $MODEL --gpu-memory-utilization 0.3"),
         "vllm", Fraction(3, 10)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_shell_script(case: Case) -> None:
    demand = derive_pod_demand(pod(case.spec))
    c = demand.containers[0]
    assert c.engine == case.engine, demand.warnings
    reservation = c.reservation
    if case.fraction is None:
        assert reservation is None, reservation
    else:
        assert reservation is not None and reservation.fraction == case.fraction, demand.warnings
    for expected in case.warnings:
        assert any(expected in w for w in demand.warnings), demand.warnings


ENV_FROM = [{"configMapRef": {"name": "vllm-config"}}]
HELM = "exec vllm serve m --gpu-memory-utilization ${GPU_MEMORY_UTILIZATION:-0.30}"


@pytest.mark.parametrize(
    ("extra", "fraction"),
    [
        ({}, Fraction(3, 10)),  # nothing may set it: the default is the value
        ({"envFrom": ENV_FROM}, None),  # the ConfigMap may set it (to 0.90): unknown
        ({"env": [{"name": "GPU_MEMORY_UTILIZATION", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
         None),
        # Kubernetes: a variable in env takes precedence over the same one from envFrom.
        ({"envFrom": ENV_FROM, "env": [{"name": "GPU_MEMORY_UTILIZATION", "value": "0.5"}]}, Fraction(1, 2)),
    ],
    ids=["no-source", "env-from-config-map", "value-from", "literal-env-beats-env-from"],
)
def test_a_shell_default_is_not_trusted_where_a_hidden_source_may_set_the_variable(
    extra: dict[str, Any], fraction: Fraction | None
) -> None:
    spec = container(image=VLLM, command=["sh", "-c", HELM])
    if "env" in extra:
        spec["env"] = extra["env"]
    if "envFrom" in extra:
        spec["envFrom"] = extra["envFrom"]
    reservation = derive_pod_demand(pod(spec)).containers[0].reservation
    assert (reservation.fraction if reservation is not None else None) == fraction


@pytest.mark.parametrize(
    ("script", "fraction"),
    [
        # A command's own assignment, and an export, reach the process; the container said 0.10.
        ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 python train.py", Fraction(9, 10)),
        ("export XLA_PYTHON_CLIENT_MEM_FRACTION=0.90; python train.py", Fraction(9, 10)),
        # A variable inherited from the environment stays exported when the shell assigns it.
        ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.90; python train.py", Fraction(9, 10)),
        # A command's assignment lasts for that command only.
        ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 true; python train.py", Fraction(1, 10)),
    ],
    ids=["per-command", "export", "inherited-assigned", "per-command-is-temporary"],
)
def test_the_script_overrides_the_container_env(script: str, fraction: Fraction) -> None:
    spec = container(command=["bash", "-c", script], env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.10"})
    c = derive_pod_demand(pod(spec)).containers[0]
    assert c.engine == "jax"
    assert c.reservation is not None and c.reservation.fraction == fraction


def test_a_variable_not_exported_does_not_reach_the_process() -> None:
    # jaxlib's default, 0.75 (jax v0.4.1+, jaxlib/xla_client.py), since python never sees 0.1.
    script = "XLA_PYTHON_CLIENT_MEM_FRACTION=0.1; python train.py"
    spec = container(command=["bash", "-c", script], env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    reservation = derive_pod_demand(pod(spec)).containers[0].reservation
    assert reservation is not None and reservation.fraction == Fraction(3, 4)


def test_env_dash_i_starts_the_engine_without_the_container_env() -> None:
    # text-generation-launcher defaults --cuda-memory-fraction to 1.0 (TGI v3, launcher/src/main.rs).
    spec = container(command=["sh", "-c", "exec env -i text-generation-launcher"], env={"CUDA_MEMORY_FRACTION": "0.3"})
    reservation = derive_pod_demand(pod(spec)).containers[0].reservation
    assert reservation is not None and reservation.fraction == 1


def test_mps_limits_bind_each_process() -> None:
    # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT caps each client process (CUDA MPS documentation, 4.2.6).
    limit = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"}
    spec = container(command=["sh", "-c", "python a.py & python b.py"], env=limit)
    assert derive_pod_demand(pod(spec)).containers[0].mps_limit == 16 * GiB
    exported = container(command=["sh", "-c", "export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G; exec python a.py"],
                         env=limit)
    assert derive_pod_demand(pod(exported)).containers[0].mps_limit == 40 * GiB


def test_graphs_variable_from_a_hidden_source_counts_at_its_worst() -> None:
    # vllm v0.20.0+: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 puts CUDA graphs outside the share
    # (vllm/envs.py, v1/worker/gpu_worker.py); a ConfigMap may set it.
    plain = container(image=VLLM, command=["vllm", "serve", "m", "--gpu-memory-utilization", "0.3"])
    hidden = plain | {"envFrom": ENV_FROM}
    names = {a.name for a in derive_pod_demand(pod(hidden)).containers[0].claim.allowances}  # type: ignore[union-attr]
    assert "CUDA graphs" in names
    assert "CUDA graphs" not in {a.name for a in derive_pod_demand(pod(plain)).containers[0].claim.allowances}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ("vllm serve m --gpu-memory-utilization 0.3 & python 'x", "an unclosed ' quote"),
        ("vllm serve m " + "$(" * 40, "nests more than 32 levels"),
        ("f() { f; f; }; f", "functions call each other more than 32 levels"),
        ("a; " * 1200, "run more than 1000 commands"),
        ("a " * 40_000, "longer than the 64 KiB"),
        ("A=xxxxxxxx; " + "A=$A$A; " * 30, "expand to more than 1 MiB"),
    ],
    ids=["unclosed-quote", "too-deep", "function-bomb", "too-many-commands", "too-long", "expansion-bomb"],
)
def test_a_script_vramguard_does_not_read_is_refused_clearly(script: str, reason: str) -> None:
    demand = derive_pod_demand(pod(bash(script)))
    c = demand.containers[0]
    assert c.reservation is None
    assert any(reason in w and "so its VRAM is unknown; declare it" in w for w in demand.warnings), demand.warnings
    declared = derive_pod_demand(pod(bash(script), annotations={"vramguard.io/vram": "20Gi"})).containers[0]
    assert declared.reservation is not None and declared.reservation.bytes == 20 * GiB


def test_a_command_line_too_long_to_read_is_refused() -> None:
    spec = container(image=VLLM, args=["--gpu-memory-utilization", "0.3", *["--x"] * 5000])
    demand = derive_pod_demand(pod(spec))
    assert demand.containers[0].reservation is None
    assert any("more than the 4096 vramguard reads" in w for w in demand.warnings)


def test_env_entries_past_the_limit_are_a_hidden_source() -> None:
    env = {f"V{i}": "x" for i in range(5000)} | {"UTIL": "0.3"}
    spec = container(image=VLLM, command=["sh", "-c", "exec vllm serve m --gpu-memory-utilization ${UTIL:-0.2}"],
                     env=env)
    assert derive_pod_demand(pod(spec)).containers[0].reservation is None
