"""Deriving a pod's demand costs work bounded by its size, whatever the pod says.

The inputs are the largest the control plane accepts: etcd stores objects up to 1.5 MiB
(``--max-request-bytes``, ``DefaultMaxRequestBytes`` in etcd ``server/embed/config.go``) and the API
server reads request bodies up to 3 MiB (``MaxRequestBodyBytes``, ``k8s.io/apiserver/pkg/server/config.go``).
Each is shaped to defeat a parser: unclosed ``${A:-`` and ``$(`` (which made an earlier parser
quadratic: 100 KB took 12.7 s), nested quotes, a hundred thousand ``&``, env lists that double at
every entry. The bound is CPU time of this thread, generous enough for a loaded machine; the
measured worst case is a fraction of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.demand import derive_pod_demand
from vramguard.demand.commandline import ContainerEnv, EnvValue, expand_kubernetes

ETCD_LIMIT = 3 * 1024 * 1024 // 2
API_SERVER_LIMIT = 3 * 1024 * 1024
CPU_SECONDS = 0.25
"""The bound for one derivation at the largest size, generous for a loaded machine: the slowest case
measured takes about 15 ms (many containers of 64 KiB scripts, before the pod's budget is spent)."""


def sh(script: str) -> dict[str, Any]:
    return pod(container(command=["sh", "-c", script]))


def filled(unit: str, prefix: str = "vllm serve ") -> str:
    """``prefix`` and ``unit`` repeated up to the size etcd stores (less the pod around it)."""
    return prefix + unit * ((ETCD_LIMIT - 400 - len(prefix)) // len(unit))


def chained_env() -> dict[str, Any]:
    # Each variable refers twice to the one before: 30 entries would expand to 2^30 characters.
    env = {"A0": "x" * 1000} | {f"A{i}": f"$(A{i - 1})$(A{i - 1})" for i in range(1, 31)}
    return pod(container(command=["vllm", "serve", "--gpu-memory-utilization", "$(A30)"], env=env))


def many_containers(script: str) -> dict[str, Any]:
    """Containers of a 64 KiB script each, as many as fit in 1.5 MiB."""
    body = (script * (64 * 1024 // len(script)))[: 64 * 1024 - 100]
    count = ETCD_LIMIT // (len(body) + 200)
    return pod(*(container(name=f"c{i}", command=["bash", "-c", body]) for i in range(count)))


ADVERSARIAL: dict[str, Callable[[], dict[str, Any]]] = {
    "unclosed-default": lambda: sh(filled("${A:-")),
    "unclosed-substitution": lambda: sh(filled("$(")),
    "unclosed-kubernetes-reference": lambda: pod(container(command=["vllm", "serve"], args=[filled("$(", "")])),
    "unclosed-kubernetes-references-in-env": lambda: pod(container(command=["vllm"], env={"A": filled("$(", "")})),
    "nested-quotes": lambda: sh(filled('"$(\'"')),
    "ampersands": lambda: sh(filled("& ", "")),
    "background-jobs": lambda: sh(filled("a & ", "")),
    "dollars": lambda: sh(filled("$", "")),
    "backslashes": lambda: sh(filled("\\", "")),
    "parentheses": lambda: sh(filled("(", "")),
    "here-documents": lambda: sh(filled("cat <<E\n", "")),
    "huge-env-list": lambda: pod(container(command=["vllm", "serve"], env={f"V{i}": "x" for i in range(60_000)})),
    "huge-argument-list": lambda: pod(container(command=["vllm", "serve"], args=["--x"] * 250_000)),
    "chained-env-expansion": chained_env,
    "many-containers-of-commands": lambda: many_containers("a & "),
    "many-containers-of-substitutions": lambda: many_containers("$(a)"),
    "many-containers-of-expansions": lambda: many_containers("${A:-x}"),
    "many-containers-of-quotes": lambda: many_containers("x'y'"),
    "many-containers-of-words": lambda: many_containers('"$@" '),
}


@pytest.mark.parametrize("build", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_adversarial_pods_at_the_etcd_limit_derive_in_bounded_time(build: Callable[[], dict[str, Any]]) -> None:
    spec = build()
    assert len(json.dumps(spec)) <= API_SERVER_LIMIT  # a body the API server reads (escapes included)
    started = time.thread_time()
    demand = derive_pod_demand(spec)
    elapsed = time.thread_time() - started
    assert elapsed < CPU_SECONDS, f"{elapsed:.2f} s of CPU"
    for c in demand.containers:
        if c.reservation is None:  # unknown VRAM always comes with a finding that says why
            assert any(c.name in w and ("unknown" in w or "cannot read" in w) for w in c.warnings), c.warnings
    assert all(len(w) < 1000 for w in demand.warnings)  # no finding quotes the input whole


def test_the_containers_of_a_pod_share_one_budget() -> None:
    # 23 containers of 16,000 "$(a)" each: one budget per container read them all (0.37 s); the pod's
    # budget is spent in the second and the rest are unknown, each saying why.
    demand = derive_pod_demand(many_containers("$(a)"))
    unknown = [c for c in demand.containers if c.reservation is None]
    assert len(unknown) == len(demand.containers) > 20
    assert sum("its pod's command lines hold more than 5000" in w for w in demand.warnings) >= len(unknown) - 1


def test_a_refused_script_says_so() -> None:
    demand = derive_pod_demand(sh(filled("${A:-")))
    assert demand.containers[0].reservation is None
    assert any("longer than the 64 KiB vramguard reads" in w for w in demand.warnings)


def test_kubernetes_expansion_is_linear_at_the_api_server_limit() -> None:
    # The kubelet scans for ")" afresh at each "$(" (third_party/forked/golang/expansion/expand.go):
    # 3 MiB of "$(" is 10^12 steps that way.
    env = ContainerEnv({"A": EnvValue("x", "env")})
    text = "$(" * (API_SERVER_LIMIT // 2)
    started = time.thread_time()
    assert expand_kubernetes(text, env) == text
    # The first "$(" reads up to the only ")": a name that is not a variable, left as it is.
    assert expand_kubernetes(text + "$(A)", env) == text + "$(A)"
    assert expand_kubernetes("$(A)" + text, env) == "x" + text
    assert time.thread_time() - started < CPU_SECONDS
