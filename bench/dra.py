"""Micro-benchmark: pods with DRA claims in the webhook's review and the extender's filter.

    python -m bench.dra [--reviews 200] [--filters 200] [--against OTHER_CHECKOUT [--rounds 5]]

A claim is checked on every device its request may get, for every container that uses it; the API
server lets one pod name 32 claims of 32 requests each, used by every one of its containers, and a
review of such a pod must answer within the API server's timeout (the webhook's event loop serves
every other review meanwhile), and the extender filters a claim pod on every DRA node at each
scheduling attempt. Cases:

- ``review/typical``: a vLLM pod using one claim of one request (the NVIDIA DRA driver's demo);
- ``review/bounded``: the most claim checks a review makes (:data:`vramguard.dra.review.MAX_CLAIM_USES`:
  8 claims x 32 requests, one container);
- ``review/over-bound``: 32 claims x 32 requests used by each of 100 containers (a 70 KB pod): refused
  as uncheckable;
- ``review/size-limit``: a pod at etcd's 1.5 MiB limit (padded environment) with 4 claims and 16
  containers using them all;
- ``filter/typical``, ``filter/bounded``: the typical and the bounded pod filtered over 4 DRA nodes of
  8 shared GPUs, 64 pods already holding claims there (every eighth a pod of 32 containers sharing its
  claim), attempt after attempt as the scheduler retries a pod.

Figures are milliseconds of wall time per review or filter (p50 / p99 / max), measured on fresh copies
of the pods as a JSON decoder gives them. ``--against`` runs this benchmark in another checkout as
well, in fresh interpreters, alternated round by round, and prints each side's medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import refuse_if_traced, untraced_environment
from tests.dra_objects import allocated, device_class, gpu_device, resource_slice, result
from vramguard.admission import AdmissionRules, ClusterView, Subject
from vramguard.cluster import ClusterState
from vramguard.codecs import ENFORCE_LABEL
from vramguard.policy import default_policy

NAMESPACE = "team-a"
IMAGE = "vllm/vllm-openai:v0.10.1"
JSON = dict[str, Any]


def template(name: str, requests: int) -> JSON:
    """A ResourceClaimTemplate of ``requests`` requests of 4 GiB each."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"spec": {"devices": {"requests": [
                {"name": f"r{j}", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                              "capacity": {"requests": {"memory": "4Gi"}}}}
                for j in range(requests)]}}}}


def claim_pod(name: str, claims: int, containers: int, padding: int = 0) -> JSON:
    """A pod naming ``claims`` templates (``t0``...), each container a vLLM server using them all."""
    env = [{"name": "PADDING", "value": "x" * padding}] if padding else []
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}"},
            "spec": {"resourceClaims": [{"name": f"k{i}", "resourceClaimTemplateName": f"t{i}"} for i in range(claims)],
                     "containers": [{"name": f"c{c}", "image": IMAGE, "env": env,
                                     "args": ["--model", "m", "--gpu-memory-utilization", "0.1"],
                                     "resources": {"claims": [{"name": f"k{i}"} for i in range(claims)]}}
                                    for c in range(containers)]}}


def dra_state(nodes: int = 4, gpus: int = 8, tenants: int = 0) -> ClusterState:
    """Nodes of shared H100s (the driver's ``memory`` mode), the templates, and ``tenants`` pods bound
    there, each holding a claim of 20 GiB on one GPU."""
    state = ClusterState(default_policy())
    state.dra.watched = True
    state.namespaces.replace([{"metadata": {"name": NAMESPACE, "labels": {ENFORCE_LABEL: "enforce"}}}])
    state.dra.slices.replace([
        resource_slice(node=f"dra-{n}", devices=[
            gpu_device(name=f"gpu-{g}", uuid=f"GPU-{n:04d}{g:04d}-0000-0000-0000-000000000000", memory="80Gi")
            for g in range(gpus)])
        for n in range(nodes)])
    state.dra.classes.replace([device_class()])
    state.dra.templates.replace([template(f"t{i}", 32) for i in range(32)] + [template("one", 1)])
    claims, pods = [], []
    for i in range(tenants):
        node, gpu = f"dra-{i % nodes}", (i // nodes) % gpus
        # Most tenants are one vLLM server; every eighth is a pod of 32 containers sharing its claim.
        pod = claim_pod(f"tenant-{i}", 0, 32 if i % 8 == 0 else 1)
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one"}]
        for container in pod["spec"]["containers"]:
            container["resources"] = {"claims": [{"name": "gpu"}]}
        pod["spec"]["nodeName"] = node
        pod["metadata"]["resourceVersion"] = "1"
        pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"tenant-{i}-gpu"}]}
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": f"tenant-{i}-gpu", "namespace": NAMESPACE, "uid": f"uid-claim-{i}",
                              "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}},
                 "spec": template("x", 1)["spec"]["spec"]}
        claims.append(allocated(claim, [result(device=f"gpu-{gpu}", request="r0", pool=node,
                                               share=f"6f1c0000-0000-4000-8000-{i:012d}", memory="4Gi")],
                                pods=(f"tenant-{i}",), node=node))
        pods.append(pod)
    state.dra.claims.replace(claims)
    state.pods.replace(pods)
    state.sync_dra()
    return state


def review_case(pod: JSON) -> Callable[[], float]:
    """One review of a fresh copy of ``pod``, in ms."""
    state = dra_state()
    rules = AdmissionRules(default_policy(), cache_size=0)
    text = json.dumps(pod)

    def run() -> float:
        obj = json.loads(text)
        view = ClusterView({ENFORCE_LABEL: "enforce"}, state.offers(), dra=state.dra_context())
        started = time.perf_counter()
        rules.review(Subject("Pod", "CREATE", NAMESPACE, obj), view)
        return (time.perf_counter() - started) * 1000
    return run


def filter_case(claims: int, requests: int) -> Callable[[], float]:
    """One filter over 4 DRA nodes with 64 tenants of the same pod (new attempts of one pod, as the
    scheduler retries it) naming ``claims`` claims of ``requests`` requests, in ms."""
    from extender.claims import refused_nodes  # noqa: PLC0415 - the extender's own path
    state = dra_state(tenants=64)
    nodes = [f"dra-{n}" for n in range(4)]
    # The scheduler filters once the resourceclaim controller has made the pod's claims from their
    # templates (not allocated yet: the scheduler allocates them after filtering).
    pod = claim_pod("new", claims, 1)
    pod["metadata"]["resourceVersion"] = "1"
    pod["status"] = {"resourceClaimStatuses": [{"name": f"k{i}", "resourceClaimName": f"new-k{i}"}
                                               for i in range(claims)]}
    for i in range(claims):
        state.dra.claims.upsert({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"new-k{i}", "namespace": NAMESPACE, "uid": f"uid-claim-new-{i}",
                         "annotations": {"resource.kubernetes.io/pod-claim-name": f"k{i}"}},
            "spec": template("x", requests)["spec"]["spec"]})
    text = json.dumps(pod)

    def run() -> float:
        obj = json.loads(text)
        started = time.perf_counter()
        refused_nodes(state, obj, nodes)
        return (time.perf_counter() - started) * 1000
    return run


CASES: dict[str, Callable[[], Callable[[], float]]] = {
    "review/typical": lambda: review_case(claim_pod("typical", 1, 1)),
    "review/bounded": lambda: review_case(claim_pod("bounded", 8, 1)),
    "review/over-bound": lambda: review_case(claim_pod("over", 32, 100)),
    "review/size-limit": lambda: review_case(claim_pod("big", 4, 16, padding=1_572_864 // 16 - 2_000)),
    "filter/typical": lambda: filter_case(1, 1),
    "filter/bounded": lambda: filter_case(8, 32),
}


def measure(samples: int) -> list[JSON]:
    """Every case, ``samples`` times each after one warm-up."""
    records = []
    for name, make in CASES.items():
        run = make()
        run()
        times = sorted(run() for _ in range(samples))
        records.append({"benchmark": "dra", "case": name, "n": len(times),
                        "p50_ms": round(statistics.median(times), 3),
                        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 3),
                        "max_ms": round(times[-1], 3)})
    return records


def against(other: Path, rounds: int, samples: int) -> None:
    """This checkout and ``other`` alternated round by round (which goes first alternating)."""
    sides = {"this": Path(__file__).resolve().parent.parent, "other": other.resolve()}
    results: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for round_number in range(rounds):
        order = list(sides.items()) if round_number % 2 == 0 else list(reversed(sides.items()))
        for side, root in order:
            output = subprocess.run(
                [sys.executable, "-m", "bench.dra", "--samples", str(samples)], cwd=root, capture_output=True,
                text=True, check=True, env=untraced_environment(),
            ).stdout
            for line in output.splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    results[side].setdefault(record["case"], []).append(record["p50_ms"])
    for case in CASES:
        here, there = results["this"].get(case), results["other"].get(case)
        if here and there:
            print(f"{case:22} this {statistics.median(here):9.3f} ms  other {statistics.median(there):9.3f} ms  "
                  f"ratio {statistics.median(here) / statistics.median(there):.3f}")


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per case."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200, help="reviews or filters per case (default 200)")
    parser.add_argument("--against", type=Path, help="another checkout to alternate with")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    refuse_if_traced()
    if args.against is not None:
        against(args.against, args.rounds, args.samples)
        return 0
    for record in measure(args.samples):
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
