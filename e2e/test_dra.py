"""DRA on the real control plane (Kubernetes 1.36: kube-apiserver, kube-scheduler, the
resource-claim controller and garbage collector of kube-controller-manager), with ResourceSlices
published as the NVIDIA DRA driver publishes them (``e2e.dra_objects``) and vramguard wired in.

Every check reads the API server's objects: the claims' ``status.allocation`` and the pods'
``spec.nodeName`` or ``PodScheduled`` condition. Each test has its own namespace and its own nodes
(labelled and tainted with the test's id, as ``e2e.scenario`` does), and removes them afterwards;
the driver's DeviceClass ``gpu.nvidia.com`` (with ``extendedResourceName: nvidia.com/gpu``) is
shared.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import dra_objects as dra
from e2e import gpu_nodes
from e2e.cluster import Cluster, ClusterConfig
from e2e.scenario import TEST_LABEL, ledger_from_api, pin_to_test, private_node, require_extender
from e2e.test_bind_guard import wired_scheduler
from vramguard.codecs import ENFORCE_LABEL

pytestmark = pytest.mark.timeout(240)

RESOURCE = dra.RESOURCE_API
SETTLE_SECONDS = 90.0
REQUIRED = re.compile(r"set capacity\.requests\.memory: (\S+)")


class DraTest:
    """One test's namespace, nodes and calls to the API server (the admin's JSON requests)."""

    def __init__(self, cluster: Any, unique: str) -> None:
        self.cluster = cluster
        self.unique = unique
        self.namespace = f"e2e-dra-{unique}"
        self.nodes: list[str] = []

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """A JSON request to the API server as the admin."""
        return self.cluster.request(method, path, body)

    def create_namespace(self, mode: str) -> None:
        """The test's namespace, in vramguard's ``mode`` (enforce, warn, audit)."""
        self.request("POST", "/api/v1/namespaces",
                     {"metadata": {"name": self.namespace, "labels": {ENFORCE_LABEL: mode}}})

    def dra_node(self, name: str, model: str, shares: dra.ConsumableShares) -> str:
        """A DRA node (and its ResourceSlice) only this test's pods can use."""
        spec = dra.dra_node(
            f"{name}-{self.unique}", model, shares=shares,
            extra_labels={TEST_LABEL: self.unique},
            taints=({"key": TEST_LABEL, "value": self.unique, "effect": "NoSchedule"},),
        )
        dra.create_dra_node(self.request, spec)
        self.nodes.append(spec.name)
        return spec.name

    def gfd_node(self, spec: gpu_nodes.GPUNodeSpec) -> str:
        """A device-plugin node (GPU Feature Discovery labels) only this test's pods can use."""
        spec = private_node(spec, self.unique)
        gpu_nodes.create_gpu_node(self.cluster.core_v1(), spec)
        self.nodes.append(spec.name)
        return spec.name

    def set_mode(self, mode: str) -> None:
        """Relabel the test's namespace to vramguard's ``mode``."""
        namespace = self.request("GET", f"/api/v1/namespaces/{self.namespace}")
        namespace["metadata"].setdefault("labels", {})[ENFORCE_LABEL] = mode
        self.request("PUT", f"/api/v1/namespaces/{self.namespace}", namespace)

    def template(self, name: str, memory: str | None) -> None:
        """A ResourceClaimTemplate as the driver's demos write them."""
        self.request("POST", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaimtemplates",
                     dra.claim_template(name, self.namespace, memory))

    def claim(self, name: str, memory: str | None) -> None:
        """A ResourceClaim for one GPU, shared by every pod naming it."""
        self.request("POST", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims",
                     dra.claim(name, self.namespace, memory))

    def refused(self, path: str, body: dict[str, Any]) -> str:
        """POST ``body`` the webhook must refuse; returns the API server's message."""
        with pytest.raises(urllib.error.HTTPError) as refused:
            self.request("POST", path, body)
        assert refused.value.code == 403
        return str(json.loads(refused.value.read())["message"])

    def pod(self, name: str, utilization: str, *, dry_run: bool = False, **source: Any) -> dict[str, Any]:
        """Create a vLLM pod pinned to this test's nodes (``source``: template=, claim_name= or extended=)."""
        pod = dra.vllm_pod(name, utilization, **source)
        pod["spec"] = pin_to_test(pod["spec"], self.unique)
        pod["spec"]["schedulerName"] = wired_scheduler(self.cluster)  # the profile that calls the extender
        query = "?dryRun=All" if dry_run else ""
        return dict(self.request("POST", f"/api/v1/namespaces/{self.namespace}/pods{query}", pod))

    def refusal(self, name: str, utilization: str, **source: Any) -> str:
        """Create a pod the webhook must refuse; returns the API server's message."""
        with pytest.raises(urllib.error.HTTPError) as refused:
            self.pod(name, utilization, **source)
        assert refused.value.code == 403
        return str(json.loads(refused.value.read())["message"])

    def settle(self, names: list[str], bound: int) -> dict[str, tuple[str | None, str]]:
        """Wait until ``bound`` of the pods are bound and the rest are Unschedulable; per pod its node
        and PodScheduled message."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            verdicts = {name: self._verdict(name) for name in names}
            placed = [n for n, (node, _) in verdicts.items() if node]
            judged = [n for n, (node, reason) in verdicts.items() if not node and reason]
            if len(placed) >= bound and len(placed) + len(judged) == len(names):
                return verdicts
            if time.monotonic() > deadline:
                conditions = {name: self._scheduled_condition(name) for name in names}
                raise AssertionError(f"pods did not settle: {json.dumps(conditions, indent=1)}")
            time.sleep(0.3)

    def _scheduled_condition(self, name: str) -> dict[str, Any]:
        """The pod's node and PodScheduled condition, whatever its reason (for a failure's message)."""
        pod = self.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        condition: dict[str, Any] = next(
            (c for c in pod["status"].get("conditions") or () if c["type"] == "PodScheduled"), {}
        )
        return {"node": pod["spec"].get("nodeName"), **{k: condition.get(k) for k in ("status", "reason", "message")}}

    def _verdict(self, name: str) -> tuple[str | None, str]:
        pod = self.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        reason = next(
            (c.get("message", "") or c.get("reason", "") for c in pod["status"].get("conditions") or ()
             if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"),
            "",
        )
        return pod["spec"].get("nodeName"), reason

    def claims(self) -> list[dict[str, Any]]:
        """The namespace's ResourceClaims, as the API server has them."""
        return list(self.request("GET", f"{RESOURCE}/namespaces/{self.namespace}/resourceclaims")["items"])

    def cleanup(self) -> None:
        """Delete the pods at once, then the namespace and the nodes (their slices go with them)."""
        try:
            for pod in self.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")["items"]:
                self.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{pod['metadata']['name']}",
                             {"gracePeriodSeconds": 0})
            self.request("DELETE", f"/api/v1/namespaces/{self.namespace}")
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
        for node in self.nodes:
            self.request("DELETE", f"/api/v1/nodes/{node}")


@pytest.fixture
def dra_test(cluster: Any, unique: str) -> Iterator[DraTest]:
    """A test's DRA namespace and nodes; the driver's DeviceClass exists."""
    if not getattr(cluster, "state", None):
        pytest.skip("needs the local control plane (kube-controller-manager, the webhook)")
    dra.ensure_device_class(cluster.request)
    test = DraTest(cluster, unique)
    yield test
    test.cleanup()


def memory_results(claim: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(pool, device, consumedCapacity.memory) of each allocation result of a claim."""
    return [(r["pool"], r["device"], (r.get("consumedCapacity") or {}).get("memory"))
            for r in dra.allocation_results(claim)]


def test_under_requesting_claim_is_refused_in_enforce_with_the_number_to_write(dra_test: DraTest) -> None:
    """A vLLM pod at 0.90 whose claim asks 8Gi of an 80Gi GPU: refused, with the amount to request."""
    dra_test.create_namespace("enforce")
    dra_test.dra_node("a100", "A100-80GB", "memory")
    dra_test.template("gpu-8gi", "8Gi")
    message = dra_test.refusal("vllm-short", "0.90", template="gpu-8gi")
    # vLLM v0.21.0: 0.90 of the device (73728Mi) and its CUDA context (512Mi, the shipped allowance;
    # graphs are inside its share from v0.20.0).
    assert (
        "claim gpu requests 8Gi of memory but vLLM will reserve 0.90 x 80Gi + 512Mi = 74240Mi; "
        "set capacity.requests.memory: 74240Mi" in message
    ), message
    dra_test.template("gpu-enough", "74240Mi")
    dra_test.pod("vllm-enough", "0.90", template="gpu-enough")
    verdicts = dra_test.settle(["vllm-enough"], bound=1)
    assert verdicts["vllm-enough"][0] == dra_test.nodes[0]


def test_four_pods_at_030_with_claims_as_admission_requires_three_allocated_the_fourth_pending(
    dra_test: DraTest,
) -> None:
    """One H100-sized shared GPU (``memory`` mode): each claim asks what admission requires for a
    vLLM pod at 0.30; the scheduler allocates three and keeps the fourth Pending."""
    dra_test.create_namespace("enforce")
    node = dra_test.dra_node("h100", "H100-80GB", "memory")
    dra_test.template("gpu-1gi", "1Gi")
    required = REQUIRED.search(dra_test.refusal("probe", "0.30", template="gpu-1gi"))
    assert required, "the refusal names the memory to request"
    dra_test.template("gpu-vllm", required[1])
    names = [f"vllm-{i}" for i in range(4)]
    for name in names:
        dra_test.pod(name, "0.30", template="gpu-vllm")
    verdicts = dra_test.settle(names, bound=3)
    placed = sorted(name for name, (where, _) in verdicts.items() if where)
    assert len(placed) == 3 and all(verdicts[n][0] == node for n in placed), verdicts
    claims = dra_test.claims()
    allocated = [c for c in claims if dra.allocation_results(c)]
    assert sorted(r for c in allocated for r in memory_results(c)) == [(node, "gpu-0", required[1])] * 3
    reserved = sorted(ref["name"] for c in allocated for ref in c["status"].get("reservedFor") or ())
    assert reserved == placed
    # The fourth pod's claim exists (made from the template) and stays unallocated.
    assert len(claims) == 4, [c["metadata"]["name"] for c in claims]
    # A bound pod goes: the resource-claim controller deallocates its claim, and the fourth gets its share.
    pending = next(name for name in names if name not in placed)
    dra_test.request("DELETE", f"/api/v1/namespaces/{dra_test.namespace}/pods/{placed[0]}", {"gracePeriodSeconds": 0})
    after = dra_test.settle([n for n in names if n != placed[0]], bound=3)
    assert after[pending][0] == node, after


def test_extended_resource_path_in_unlimited_mode_does_not_overcommit_with_the_extender(
    cluster: Any, dra_test: DraTest
) -> None:
    """``nvidia.com/gpu: 1`` served by DRA in ``unlimited`` mode: every claim consumes 0, so the
    scheduler alone would place all four 0.30 pods on one GPU (1.20 of it). The extender holds
    what vLLM reserves: three bound, the fourth Pending with the bytes."""
    require_extender(cluster)
    dra_test.create_namespace("warn")  # enforce refuses nvidia.com/gpu on unlimited devices outright
    node = dra_test.dra_node("h100", "H100-80GB", "unlimited")
    names = [f"vllm-{i}" for i in range(4)]
    for name in names:
        dra_test.pod(name, "0.30", extended=True)
    verdicts = dra_test.settle(names, bound=3)
    placed = [name for name, (where, _) in verdicts.items() if where]
    assert len(placed) == 3 and {verdicts[n][0] for n in placed} == {node}, verdicts
    pending = next(name for name in names if name not in placed)
    assert "VRAM budget" in verdicts[pending][1], verdicts[pending]
    extended = [c for c in dra_test.claims() if dra.allocation_results(c)]
    assert sorted(r for c in extended for r in memory_results(c)) == [(node, "gpu-0", "0")] * 3
    # The ledger rebuilt from the API server alone holds the three on the device DRA chose.
    state = ledger_from_api(cluster)
    state.dra.watched = True
    state.dra.slices.replace(dra_test.request("GET", f"{RESOURCE}/resourceslices")["items"])
    state.dra.classes.replace(dra_test.request("GET", f"{RESOURCE}/deviceclasses")["items"])
    state.dra.claims.replace(dra_test.request("GET", f"{RESOURCE}/resourceclaims")["items"])
    state.sync_dra()
    (row,) = state.ledger.usage(node)
    assert len(row.pods) == 3 and row.known_bytes <= row.budget, row
    # One goes: the extender releases its VRAM and the fourth is bound.
    dra_test.request("DELETE", f"/api/v1/namespaces/{dra_test.namespace}/pods/{placed[0]}", {"gracePeriodSeconds": 0})
    after = dra_test.settle([n for n in names if n != placed[0]], bound=3)
    assert after[pending][0] == node, after


def test_mixed_cluster_schedules_device_plugin_and_dra_pods(cluster: Any, dra_test: DraTest) -> None:
    """A GPU Feature Discovery node next to a DRA node: a claim pod lands on the DRA node, an
    ``nvidia.com/gpu`` pod on the device-plugin node (the DRA GPU, taken in ``memory`` mode by the
    claim, cannot serve the extended resource)."""
    require_extender(cluster)
    dra_test.create_namespace("warn")
    dra_node = dra_test.dra_node("dra", "H100-80GB", "memory")
    gfd_node = dra_test.gfd_node(gpu_nodes.time_sliced("gfd", "H100-80GB", gpus=1, replicas=4))
    dra_test.template("gpu-32gi", "32Gi")
    dra_test.pod("with-claim", "0.30", template="gpu-32gi")
    assert dra_test.settle(["with-claim"], bound=1)["with-claim"][0] == dra_node
    dra_test.pod("with-plugin", "0.30", extended=True)
    assert dra_test.settle(["with-plugin"], bound=1)["with-plugin"][0] == gfd_node
    (claim,) = dra_test.claims()
    assert memory_results(claim) == [(dra_node, "gpu-0", "32Gi")]


def test_dra_node_fixture_shape_is_what_the_scheduler_accepts(dra_test: DraTest) -> None:
    """The published slice is accepted as written: the API server keeps every field the driver sets
    (a disabled feature gate would strip allowMultipleAllocations or requestPolicy silently)."""
    node = dra_test.dra_node("shape", "H100-80GB", 4)
    slices = dra_test.request("GET", f"{RESOURCE}/resourceslices")["items"]
    (stored,) = [s for s in slices if s["spec"].get("nodeName") == node]
    expected = dra.resource_slice(dra.dra_node(node, "H100-80GB", shares=4))
    assert stored["spec"]["devices"] == expected["spec"]["devices"]


# -- claims checked whenever their pods, templates or devices change --------------------------

WATCH_SECONDS = 1.0
"""Time for the webhook's pod watch to show a pod just created (a pod's review reads the pods
already naming its claim from that watch)."""


def test_a_pod_whose_template_does_not_exist_is_refused_in_enforce(dra_test: DraTest) -> None:
    """``kubectl apply -f dir/`` with the pod's file first: refused (its memory cannot be checked);
    once the template exists the same pod is checked against it."""
    dra_test.create_namespace("enforce")
    dra_test.dra_node("h100", "H100-80GB", "memory")
    message = dra_test.refusal("vllm-early", "0.90", template="gpu-8gi")
    assert "claim gpu: ResourceClaimTemplate gpu-8gi does not exist" in message, message
    dra_test.template("gpu-8gi", "8Gi")
    assert "set capacity.requests.memory" in dra_test.refusal("vllm-early", "0.90", template="gpu-8gi")


def test_a_template_created_after_its_pods_is_checked_against_them(dra_test: DraTest) -> None:
    """A pod admitted while its namespace warned (or before vramguard ran) names a template that does
    not exist; once the namespace enforces, creating that template at 8Gi is refused for the pod."""
    dra_test.create_namespace("warn")
    dra_test.dra_node("h100", "H100-80GB", "memory")
    dra_test.pod("vllm-early", "0.90", template="gpu-8gi")
    dra_test.set_mode("enforce")
    time.sleep(WATCH_SECONDS)
    path = f"{RESOURCE}/namespaces/{dra_test.namespace}/resourceclaimtemplates"
    message = dra_test.refused(path, dra.claim_template("gpu-8gi", dra_test.namespace, "8Gi"))
    assert "claim gpu-8gi request gpu requests 8Gi of memory but vLLM of pod vllm-early will reserve" in message
    dra_test.template("gpu-8gi", REQUIRED.search(message)[1])  # type: ignore[index]


def test_pods_sharing_one_claim_are_checked_together(dra_test: DraTest) -> None:
    """Three vLLM pods at 0.30 naming one 60Gi claim: each alone fits, the third does not beside the two."""
    dra_test.create_namespace("enforce")
    dra_test.dra_node("h100", "H100-80GB", "memory")
    dra_test.claim("shared-gpu", "60Gi")
    for name in ("vllm-0", "vllm-1"):
        dra_test.pod(name, "0.30", claim_name="shared-gpu")
        time.sleep(WATCH_SECONDS)
    message = dra_test.refusal("vllm-2", "0.30", claim_name="shared-gpu")
    assert "vLLM of pod vllm-0 will reserve" in message and "vLLM of pod vllm-1 will reserve" in message, message


@pytest.fixture(scope="module")
def claims_cluster(local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster with the shipped second scheduler, which calls the extender for every pod: its
    configuration lists no ``managedResources`` (kube-scheduler v1.36.3 ``HTTPExtender.IsInterested``:
    an extender listing some is called only for pods asking for one, and a claim is no resource)."""
    cluster = Cluster(ClusterConfig(
        directory=tmp_path_factory.mktemp("claims-cluster"), kube_version=local_control_plane.version,
        second_scheduler=True, vramguard="on",
    ))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def claims_test(claims_cluster: Cluster, unique: str) -> Iterator[DraTest]:
    """A test's DRA namespace and nodes on :func:`claims_cluster`."""
    dra.ensure_device_class(claims_cluster.request)
    test = DraTest(claims_cluster, unique)
    yield test
    test.cleanup()


def test_three_vllm_pods_at_090_claiming_8gi_get_one_gpu_between_them_not_three(claims_test: DraTest) -> None:
    """The allocator counts 3 x 8Gi of an 80 GB GPU and would give it to all three; each vLLM takes
    0.90 of it. In ``warn`` admission only warns: the extender places one, the others stay Pending."""
    claims_test.create_namespace("warn")
    node = claims_test.dra_node("h100", "H100-80GB", "memory")
    claims_test.template("gpu-8gi", "8Gi")
    names = [f"vllm-{i}" for i in range(3)]
    for name in names:
        claims_test.pod(name, "0.90", template="gpu-8gi")
    verdicts = claims_test.settle(names, bound=1)
    placed = [name for name, (where, _) in verdicts.items() if where]
    assert len(placed) == 1 and verdicts[placed[0]][0] == node, verdicts
    for name in set(names) - set(placed):
        assert "gpu-0 (NVIDIA H100 80GB HBM3) has" in verdicts[name][1], verdicts[name]
    # The bound pod's claim is the only one reserved for a pod.
    reserved = [c for c in claims_test.claims() if (c.get("status") or {}).get("reservedFor")]
    assert [ref["name"] for c in reserved for ref in c["status"]["reservedFor"]] == placed
    # It goes: another is placed.
    claims_test.request("DELETE", f"/api/v1/namespaces/{claims_test.namespace}/pods/{placed[0]}",
                        {"gracePeriodSeconds": 0})
    after = claims_test.settle([n for n in names if n != placed[0]], bound=1)
    assert sum(1 for where, _ in after.values() if where) == 1, after
