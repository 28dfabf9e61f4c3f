"""Property: whatever the ledger admits on a GPU, the engines' real holdings fit the device.

The oracle here is written from the engines' own source, independently of vramguard's code (the
rules and their files are in docs/vram-model.md), with the shipped policy's amounts: a CUDA context
of 512 MiB per process per GPU, CUDA graphs of 1 GiB where vLLM captures them after sizing its
share (v0.9.1 to v0.19.1), communication buffers of 1 GiB with tensor parallel peers (v0.11.0 on),
SGLang's reserve by its formula. Pods are admitted one by one on one GPU as long as the ledger says
they fit; the sum of the oracle's holdings must stay within the device, and vLLM's start-up check
(free memory >= utilization x total) must hold for every pod in the order it started. The one
exception is a pod alone on a GPU it owns whose share fits and whose estimated overheads do not: it
is placed counting the whole GPU (estimates never refuse a pod alone), and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from vramguard.demand.derive import derive_pod_demand
from vramguard.inventory import read_inventory
from vramguard.ledger import Ledger, PodRef
from vramguard.placement import pod_claims
from vramguard.policy import default_policy

MiB = 1 << 20
GiB = 1 << 30
POLICY = default_policy()
CHOICE = POLICY.choose_class({}, {})
CONTEXT = 512 * MiB
GRAPHS = GiB
COMMUNICATION = GiB
DEVICES = {  # GFD product label -> NVML total (MiB)
    "NVIDIA-H100-80GB-HBM3": 81559,
    "NVIDIA-A100-SXM4-80GB": 81920,
    "NVIDIA-H200": 143771,
    "NVIDIA-L4": 23034,
}


@dataclass(frozen=True)
class Server:
    """One inference server, as its manifest says."""

    engine: str
    version: tuple[int, int, int]
    fraction: Fraction
    eager: bool = False

    def pod(self, name: str) -> dict[str, Any]:
        tag = "v" + ".".join(map(str, self.version))
        if self.engine == "vllm":
            args = ["--model", "m", "--gpu-memory-utilization", str(float(self.fraction))]
            if self.eager:
                args.append("--enforce-eager")
            container = {"image": f"vllm/vllm-openai:{tag}", "args": args}
        else:
            container = {"image": f"lmsysorg/sglang:{tag}", "command": [
                "python3", "-m", "sglang.launch_server", "--model-path", "m",
                "--mem-fraction-static", str(float(self.fraction))]}
        container |= {"name": "server", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        return {"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": [container]}}

    def holds(self, total: int) -> int:
        """What the server really holds on a GPU of ``total`` bytes (the oracle)."""
        share = int(Fraction(str(float(self.fraction))) * total)
        if self.engine == "sglang":
            # server_args.py: 512 + max(chunked_prefill_size 8192, 2048) x 1.5 + tp x pp / 8 x 1024
            # + cuda_graph_max_bs 256 x 2 MiB, outside the static share.
            return share + CONTEXT + int((512 + 8192 * 3 // 2 + Fraction(1024, 8) + 256 * 2) * MiB)
        graphs = 0 if self.eager or self.version >= (0, 20, 0) else GRAPHS
        return share + CONTEXT + graphs

    def needs_free_at_start(self, total: int) -> int:
        """vLLM's start-up check: free >= utilization x total (v1/worker/utils.py request_memory);
        its own context is taken before the check."""
        if self.engine != "vllm":
            return 0
        return int(Fraction(str(float(self.fraction))) * total) + CONTEXT


servers = st.builds(
    Server,
    engine=st.sampled_from(["vllm", "sglang"]),
    version=st.sampled_from([(0, 10, 0), (0, 15, 1), (0, 20, 0), (0, 21, 0), (0, 5, 5)]),
    fraction=st.sampled_from([Fraction(n, 100) for n in (3, 5, 10, 15, 20, 25, 30, 44, 50, 70, 90)]),
    eager=st.booleans(),
).filter(lambda s: (s.engine == "vllm") == (s.version != (0, 5, 5)))  # vLLM from v0.9.1; SGLang v0.5.5


@settings(max_examples=300, deadline=None)
@given(
    product=st.sampled_from(sorted(DEVICES)),
    replicas=st.sampled_from([1, 2, 4, 8, 20]),
    arrivals=st.lists(servers, min_size=1, max_size=25),
)
def test_what_the_ledger_admits_really_fits(product: str, replicas: int, arrivals: list[Server]) -> None:
    mib = DEVICES[product]
    total = mib * MiB
    labels = {
        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(mib),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": "time-slicing" if replicas > 1 else "none",
    }
    node = {"metadata": {"name": "n", "labels": labels}, "status": {"allocatable": {"nvidia.com/gpu": str(replicas)}}}
    ledger = Ledger(POLICY.budget_rule())
    ledger.upsert_node(read_inventory(node))
    running: list[Server] = []
    for index, server in enumerate(arrivals):
        demand = derive_pod_demand(server.pod(f"p{index}"), POLICY.demand_options())
        claims = pod_claims(demand, CHOICE, f"uid-{index}").claims
        if not ledger.fits("n", claims).ok:
            continue
        held = sum(s.holds(total) for s in running)
        assert total - held >= server.needs_free_at_start(total), "vLLM's start-up check would fail"
        ledger.hold("n", PodRef(f"uid-{index}"), claims)
        running.append(server)
        if sum(s.holds(total) for s in running) > total:
            # Only estimates (context, graphs, SGLang's reserve) past the device, never a share, and only
            # for a pod alone on a GPU it owns, which counts the whole GPU (an admission note says so).
            assert running == [server] and replicas == 1
            assert int(server.fraction * total) <= total
            assert demand.containers[0].reservations[0].capped_on(total)


def test_a_server_alone_on_a_gpu_it_owns_is_admitted_up_to_what_really_fits() -> None:
    """The margin is not taken from a pod alone on an exclusive GPU: 0.95 on an H100 fits."""
    labels = {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
              "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.replicas": "1"}
    ledger = Ledger(POLICY.budget_rule())
    ledger.upsert_node(read_inventory({"metadata": {"name": "n", "labels": labels},
                                       "status": {"allocatable": {"nvidia.com/gpu": "1"}}}))
    server = Server("vllm", (0, 21, 0), Fraction(95, 100))
    assert server.holds(81559 * MiB) <= 81559 * MiB
    demand = derive_pod_demand(server.pod("alone"), POLICY.demand_options())
    assert ledger.fits("n", pod_claims(demand, CHOICE, "u").claims).ok
