"""Admission of pods whose GPU comes through DRA: claims, templates, the extended-resource path."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

import pytest

from tests.dra_objects import (
    allocated,
    claim,
    claim_template,
    device_class,
    gpu_device,
    resource_slice,
    result,
    vllm_claim_pod,
    vllm_extended_resource_pod,
)
from vramguard.admission import (
    AUDIT_WOULD_DENY_KEY,
    AdmissionRules,
    ClusterView,
    Code,
    Decision,
    Subject,
    quantity_text,
)
from vramguard.cluster import ClusterState
from vramguard.codecs import ENFORCE_LABEL
from vramguard.dra.fields import memory_text
from vramguard.dra.review import CLAIM_USES_REFUSAL, MAX_CLAIM_USES
from vramguard.dra.tenancy import place_claims
from vramguard.policy import default_policy
from vramguard.quantity import GiB, MiB

NS = "gpu-share-memory"
VLLM_ALLOWANCES = 512 * MiB + GiB
"""What the pods' vLLM (v0.10.1) holds on its GPU beside its share: its CUDA context, and its CUDA
graphs (outside the share before v0.20.0). A claim's memory must cover them too."""


def reserved(utilization: str) -> int:
    """What the pods' vLLM reserves on the tests' 80Gi GPU at ``utilization``."""
    return int(Fraction(utilization) * 80 * GiB) + VLLM_ALLOWANCES


RESERVED_09 = memory_text(reserved("0.9"))
RESERVED_03 = memory_text(reserved("0.3"))
PLUS = f" + {memory_text(VLLM_ALLOWANCES)}"
MESSAGE = (
    f"claim gpu requests 8Gi of memory but vLLM will reserve 0.90 x 80Gi{PLUS} = {RESERVED_09}; "
    f"set capacity.requests.memory: {RESERVED_09}"
)


def state(
    mode: str | int = "memory", *objects: dict[str, Any], nodes: list[dict[str, Any]] | None = None
) -> ClusterState:
    """A cluster model with one 80Gi GPU on node-a in the driver's ``mode``, the driver's DeviceClass,
    and ``objects`` (templates, claims)."""
    cluster = ClusterState(default_policy())
    cluster.dra.watched = True
    cluster.dra.slices.replace([resource_slice(devices=[gpu_device(memory="80Gi", mode=mode)])])
    cluster.dra.classes.replace([device_class()])
    cluster.dra.templates.replace([o for o in objects if o["kind"] == "ResourceClaimTemplate"])
    cluster.dra.claims.replace([o for o in objects if o["kind"] == "ResourceClaim"])
    cluster.nodes.replace(nodes or [{"metadata": {"name": "node-a"}, "status": {"allocatable": {"cpu": "8"}}}])
    return cluster


def review(
    cluster: ClusterState,
    obj: dict[str, Any],
    mode: str = "enforce",
    kind: str = "Pod",
    old: dict[str, Any] | None = None,
) -> Decision:
    rules = AdmissionRules(cluster.policy)
    view = ClusterView(
        {ENFORCE_LABEL: mode}, cluster.offers(), dra=cluster.dra_context() if cluster.dra.watched else None
    )
    operation = "UPDATE" if old is not None else "CREATE"
    return rules.review(Subject(kind, operation, NS, obj, old), view)


def template(memory: str | None, name: str = "gpu-4gi") -> dict[str, Any]:
    return claim_template(name=name, namespace=NS, memory=memory)


@pytest.mark.parametrize(
    ("mode", "memory", "utilization", "violation"),
    [
        pytest.param("memory", "8Gi", "0.9", MESSAGE, id="under-request-refused"),
        pytest.param("memory", RESERVED_09, "0.9", None, id="enough-memory"),
        pytest.param("memory", None, "0.9", None, id="memory-mode-default-is-whole-gpu"),
        pytest.param("memory", RESERVED_03, "0.3", None, id="thirty-percent-and-its-allowances-fit"),
        pytest.param(
            "memory",
            "24Gi",
            "0.3",
            f"claim gpu requests 24Gi of memory but vLLM will reserve 0.30 x 80Gi{PLUS} = {RESERVED_03}; "
            f"set capacity.requests.memory: {RESERVED_03}",
            id="thirty-percent-alone-is-short-of-the-allowances",
        ),
        pytest.param(
            "unlimited",
            None,
            "0.3",
            "claim gpu sets no capacity.requests.memory, so it consumes 0 of a device shared without memory accounting "
            f"(unlimited mode), but vLLM will reserve 0.30 x 80Gi{PLUS} = {RESERVED_03}; "
            f"set capacity.requests.memory: {RESERVED_03}",
            id="unlimited-consumes-zero",
        ),
        pytest.param(
            4,
            RESERVED_03,
            "0.3",
            None,
            id="share-count-with-memory-request",
        ),
        pytest.param("disabled", "8Gi", "0.9", None, id="exclusive-device-is-whole"),
    ],
)
def test_pod_with_claim_template(mode: str | int, memory: str | None, utilization: str, violation: str | None) -> None:
    decision = review(state(mode, template(memory)), vllm_claim_pod(utilization=utilization))
    assert decision.violations == ((violation,) if violation else ())
    assert decision.allowed is (violation is None)
    if violation:
        assert decision.message is not None and violation in decision.message
        assert decision.problems[0].code == Code.CLAIM_MEMORY
        assert decision.problems[0].container == "vllm"


def test_warn_mode_keeps_the_number_to_write() -> None:
    decision = review(state("memory", template("8Gi")), vllm_claim_pod(), mode="warn")
    assert decision.allowed
    assert decision.warnings[0] == (
        f"would deny: claim gpu requests 8Gi of memory but vLLM will reserve 0.90 x 80Gi{PLUS} = {RESERVED_09}; "
        f"set capacity.requests.memory: {RESERVED_09}"
    )


def test_audit_mode_records_it() -> None:
    decision = review(state("memory", template("8Gi")), vllm_claim_pod(), mode="audit")
    assert decision.allowed
    assert MESSAGE in decision.audit_annotations[AUDIT_WOULD_DENY_KEY]
    assert f"audit: would deny: {MESSAGE}" in decision.warnings


def test_named_claim() -> None:
    shared = claim("shared-gpu", NS, memory="16Gi")
    decision = review(state("memory", shared), vllm_claim_pod(claim_name="shared-gpu", utilization="0.3"))
    assert decision.violations == (
        f"claim gpu requests 16Gi of memory but vLLM will reserve 0.30 x 80Gi{PLUS} = {RESERVED_03}; "
        f"set capacity.requests.memory: {RESERVED_03}",
    )


MISSING = (
    "claim gpu: ResourceClaimTemplate gpu-4gi does not exist (or cannot be read), so the memory it gives vLLM "
    "cannot be checked; create it first (a workload's controller retries its pods)"
)


def test_a_pod_whose_template_does_not_exist_is_refused_in_enforce() -> None:
    decision = review(state("memory"), vllm_claim_pod())
    assert not decision.allowed
    assert [(f.code, f.message) for f in decision.problems] == [(Code.CLAIM_MISSING, MISSING)]


def test_a_pod_whose_template_does_not_exist_is_warned_in_warn() -> None:
    decision = review(state("memory"), vllm_claim_pod(), mode="warn")
    assert decision.allowed
    assert any("does not exist" in w for w in decision.warnings)


def test_a_workload_whose_template_does_not_exist_is_a_note() -> None:
    """Its pods are checked when its controller makes them (refused until the template exists)."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": NS},
        "spec": {"replicas": 1, "template": {k: v for k, v in vllm_claim_pod().items() if k in ("metadata", "spec")}},
    }
    decision = review(state("memory"), deployment, kind="Deployment")
    assert decision.allowed and decision.violations == ()
    assert [(f.code, f.message) for f in decision.remarks if f.code == Code.CLAIM_UNCHECKED] == [
        (Code.CLAIM_UNCHECKED, MISSING)
    ]


def test_a_missing_template_used_by_no_engine_is_a_note() -> None:
    """A container whose reservation is not known (no engine, no declaration) has nothing to check."""
    pod = vllm_claim_pod()
    pod["spec"]["containers"][0] |= {"image": "nginx", "args": []}
    decision = review(state("memory"), pod)
    assert decision.allowed
    assert any("ResourceClaimTemplate gpu-4gi is not known yet" in f.message for f in decision.remarks)


def test_request_narrowed_by_the_container() -> None:
    two = claim_template(name="gpu-4gi", namespace=NS, memory="8Gi")
    two["spec"]["spec"]["devices"]["requests"].append(
        {
            "name": "big",
            "exactly": {"deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": RESERVED_09}}},
        }
    )
    assert review(state("memory", two), vllm_claim_pod(request="big")).allowed
    assert not review(state("memory", two), vllm_claim_pod(request="gpu")).allowed
    assert not review(state("memory", two), vllm_claim_pod()).allowed  # no request named: it uses both


def test_declaration_and_parallel_errors() -> None:
    declared = vllm_claim_pod(utilization=None)
    declared["spec"]["containers"][0]["args"] = ["--model", "m", "--gpu-memory-utilization", "0.2"]
    declared["metadata"]["annotations"] = {"vramguard.io/vram.vllm": "20Gi"}
    decision = review(state("memory", template("16Gi")), declared)
    assert decision.violations == (
        "claim gpu requests 16Gi of memory but the vramguard.io/vram declaration of container vllm will reserve "
        "20Gi; set capacity.requests.memory: 20Gi",
    )
    # Without the flag vLLM claims its default 0.9 of the device (vllm/config/cache.py,
    # gpu_memory_utilization: float = 0.9, v0.21.0): a declaration of 20Gi does not make it smaller.
    declared["spec"]["containers"][0]["args"] = ["--model", "m"]
    decision = review(state("memory", template("16Gi")), declared)
    assert decision.violations == (
        "claim gpu requests 16Gi of memory but the vramguard.io/vram declaration of container vllm will reserve "
        "0.90 x 80Gi + 1536Mi = 75264Mi (the engine's own claim, above the declaration); "
        "set capacity.requests.memory: 75264Mi",
    )
    parallel = vllm_claim_pod()
    parallel["spec"]["containers"][0]["args"] += ["--tensor-parallel-size", "2"]
    decision = review(state("memory", template(None)), parallel)
    assert [f.code for f in decision.problems] == [Code.DEMAND_ERROR]
    assert "--tensor-parallel-size 2" in decision.violations[0]


def test_deployment_template_is_checked() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": NS},
        "spec": {"replicas": 2, "template": {k: v for k, v in vllm_claim_pod().items() if k in ("metadata", "spec")}},
    }
    decision = review(state("memory", template("8Gi")), deployment, kind="Deployment")
    assert decision.violations == (MESSAGE,)
    # An update that keeps the problem is not refused for it.
    updated = copy.deepcopy(deployment)
    updated["spec"]["replicas"] = 3
    decision = review(state("memory", template("8Gi")), updated, kind="Deployment", old=deployment)
    assert decision.allowed and decision.violations == ()
    assert MESSAGE in decision.notes


def test_claims_not_watched_are_not_checked() -> None:
    cluster = state("memory", template("8Gi"))
    cluster.dra.watched = False
    decision = review(cluster, vllm_claim_pod())
    assert decision.allowed and decision.warnings == () and not decision.wants_gpu


def test_pod_without_claims_or_gpus() -> None:
    plain = {"metadata": {"name": "web", "namespace": NS}, "spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    decision = review(state("unlimited"), plain)
    assert decision.allowed and decision.warnings == () and not decision.wants_gpu


EXTENDED = (
    "nvidia.com/gpu on DRA device class gpu.nvidia.com consumes 0 of memory on a device shared without memory "
    f"accounting (unlimited mode) but vLLM will reserve 0.90 x 80Gi{PLUS} = {RESERVED_09}; use a ResourceClaim with "
    f"capacity.requests.memory: {RESERVED_09}"
)
PLUGIN_NODE = {"metadata": {"name": "node-a"}, "status": {"allocatable": {"nvidia.com/gpu": "1"}}}


@pytest.mark.parametrize(
    ("mode", "nodes", "violation"),
    [
        pytest.param("unlimited", None, EXTENDED, id="unlimited-refused"),
        pytest.param(
            4,
            None,
            EXTENDED.replace("shared without memory accounting (unlimited mode)", "shared by share count"),
            id="share-count-refused",
        ),
        pytest.param("memory", None, None, id="memory-mode-whole-gpu"),
        pytest.param("unlimited", [PLUGIN_NODE], None, id="device-plugin-node-serves-it-instead"),
    ],
)
def test_extended_resource_path(mode: str | int, nodes: list[dict[str, Any]] | None, violation: str | None) -> None:
    decision = review(state(mode, nodes=nodes), vllm_extended_resource_pod(namespace=NS))
    extended = [f.message for f in decision.problems if f.code == Code.EXTENDED_RESOURCE_MEMORY]
    assert extended == ([violation] if violation else [])


def test_extended_resource_without_class() -> None:
    cluster = state("unlimited")
    cluster.dra.classes.replace([device_class(extended_resource=None)])
    decision = review(cluster, vllm_extended_resource_pod(namespace=NS))
    assert not [f for f in decision.problems if f.code == Code.EXTENDED_RESOURCE_MEMORY]


@pytest.mark.parametrize(
    ("mode", "obj", "kind", "warned"),
    [
        pytest.param("unlimited", template(None), "ResourceClaimTemplate", True, id="template-unlimited-no-memory"),
        pytest.param("unlimited", template("24Gi"), "ResourceClaimTemplate", False, id="template-with-memory"),
        pytest.param("memory", template(None), "ResourceClaimTemplate", False, id="template-memory-mode"),
        pytest.param(4, claim("c", NS), "ResourceClaim", True, id="claim-share-count-no-memory"),
    ],
)
def test_claim_objects_warn_only(mode: str | int, obj: dict[str, Any], kind: str, warned: bool) -> None:
    decision = review(state(mode), obj, kind=kind, mode="enforce")
    assert decision.allowed
    assert bool(decision.warnings) is warned
    if warned:
        assert "consumes no memory" in decision.warnings[0]
        assert decision.remarks[0].code == Code.CLAIM_UNCHECKED


async def test_webhook_checks_claims_once_its_dra_watches_run() -> None:
    from vramguard.io.dra import dra_watches  # noqa: PLC0415
    from webhook.app import PolicySource, WebhookState  # noqa: PLC0415

    webhook = WebhookState(PolicySource(default_policy()))
    subject = Subject("Pod", "CREATE", NS, vllm_claim_pod())
    assert (await webhook.view(subject, None)).dra is None
    dra_watches(webhook.cluster.dra)
    webhook.cluster.dra.templates.replace([template("8Gi")])
    view = await webhook.view(subject, None)
    assert view.dra is not None and view.dra.template(NS, "gpu-4gi") is not None


@pytest.mark.parametrize(
    ("selector", "note"),
    [
        pytest.param("device.driver == 'nic.example.com'", None, id="other-driver-not-a-gpu"),
        pytest.param("device.attributes['nic.example.com'].speed == '400G'", "cannot read whether", id="unreadable"),
    ],
)
def test_claims_of_other_devices(selector: str, note: str | None) -> None:
    nic_template = claim_template(name="nic", namespace=NS, device_class_name="nic.example.com")
    cluster = state("unlimited", template(RESERVED_09), nic_template)
    cluster.dra.classes.replace([device_class(), device_class("nic.example.com", selector, None)])
    pod = vllm_claim_pod()
    pod["spec"]["resourceClaims"].append({"name": "nic", "resourceClaimTemplateName": "nic"})
    pod["spec"]["containers"][0]["resources"]["claims"].append({"name": "nic"})
    decision = review(cluster, pod)
    assert decision.allowed and decision.violations == ()
    assert [f.message for f in decision.remarks if "cannot read" in f.message] == (
        []
        if note is None
        else [
            "claim nic: vramguard cannot read whether DeviceClass nic.example.com selects GPUs (its selectors "
            "name no driver or type it knows); not checked"
        ]
    )


@pytest.mark.parametrize(
    ("answer", "violations", "note"),
    [
        pytest.param(template("8Gi"), (MESSAGE,), None, id="read-and-checked"),
        pytest.param(None, (MISSING,), None, id="does-not-exist"),
        pytest.param(OSError("connection refused"), (MISSING,), None, id="read-fails"),
    ],
)
async def test_webhook_reads_a_template_the_watch_has_not_shown(
    answer: Any, violations: tuple[str, ...], note: str | None
) -> None:
    from vramguard.io.dra import dra_watches  # noqa: PLC0415
    from webhook.app import PolicySource, WebhookState  # noqa: PLC0415

    asked: list[tuple[str, str, str]] = []

    async def lookup(collection: str, namespace: str, name: str) -> dict[str, Any] | None:
        asked.append((collection, namespace, name))
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    webhook = WebhookState(PolicySource(default_policy()), claim_lookup=lookup)
    dra_watches(webhook.cluster.dra)
    webhook.cluster.dra.slices.replace([resource_slice(devices=[gpu_device(memory="80Gi")])])
    webhook.cluster.dra.classes.replace([device_class()])
    subject = Subject("Pod", "CREATE", NS, vllm_claim_pod())
    decision = AdmissionRules(webhook.cluster.policy).review(subject, await webhook.view(subject, None))
    assert asked == [("resourceclaimtemplates", NS, "gpu-4gi")]
    assert decision.violations == violations
    if note:
        assert any(note in n for n in decision.notes)


@pytest.mark.parametrize(("served", "missing"), [(True, False), (False, True)], ids=["dra-serves", "nothing-serves"])
def test_resource_missing_is_not_said_where_dra_serves_it(served: bool, missing: bool) -> None:
    cluster = state("memory")
    if not served:
        cluster.dra.classes.replace([device_class(extended_resource=None)])
    decision = review(cluster, vllm_extended_resource_pod(namespace=NS), mode="warn")
    assert any(f.code == Code.RESOURCE_MISSING for f in decision.remarks) is missing


@pytest.mark.parametrize(
    ("existing", "exclude_own", "violation"),
    [
        pytest.param("20Gi", False, None, id="fits"),
        pytest.param(
            "70Gi",
            False,
            f"namespace {NS} would hold {quantity_text(70 * GiB + reserved('0.9'))} of its 100Gi VRAM quota "
            f"(this pod {quantity_text(reserved('0.9'))}, 1 other pod(s) 70Gi)",
            id="claims-count-for-the-quota",
        ),
        pytest.param("70Gi", True, None, id="the-pods-own-claim-is-not-counted-twice"),
    ],
)
def test_quota_counts_dra_claims(existing: str, exclude_own: bool, violation: str | None) -> None:
    from webhook.app import PolicySource, WebhookState  # noqa: PLC0415

    policy = default_policy().model_copy(update={"quotas": {NS: "100Gi"}})
    policy = type(policy).model_validate(policy.model_dump())
    webhook = WebhookState(PolicySource(policy))
    cluster = webhook.cluster
    cluster.dra.watched = True
    cluster.dra.slices.replace([resource_slice(devices=[gpu_device(memory="80Gi", mode="memory")])])
    cluster.dra.classes.replace([device_class()])
    cluster.dra.templates.replace([template(RESERVED_09)])
    owner = "vllm-0" if exclude_own else "other"
    cluster.dra.claims.replace(
        [allocated(claim("held", NS, memory=existing), [result(memory=existing, share="s1")], pods=(owner,))]
    )
    pod = vllm_claim_pod()
    rules = AdmissionRules(policy)
    view = ClusterView(
        {ENFORCE_LABEL: "enforce"},
        dra=cluster.dra_context(),
        usage=cluster.usage_with_dra(NS, exclude="uid-vllm-0"),
    )
    decision = rules.review(Subject("Pod", "CREATE", NS, pod), view)
    assert decision.violations == ((violation,) if violation else ())


def test_context_is_cached_until_devices_classes_or_nodes_change() -> None:
    cluster = state("memory")
    first = cluster.dra_context()
    cluster.dra.templates.upsert(template("8Gi"))
    cluster.dra.claims.upsert(claim("c", NS))
    assert cluster.dra_context() is first  # claims and templates are looked up live
    assert first.template(NS, "gpu-4gi") is not None and first.claim(NS, "c") is not None
    cluster.dra.slices.upsert(resource_slice("node-b", [gpu_device(uuid="GPU-B", memory="40Gi")]))
    second = cluster.dra_context()
    assert second is not first and len(second.devices) == 2
    cluster.dra.classes.upsert(device_class("other"))
    third = cluster.dra_context()
    assert third is not second and "other" in third.classes
    cluster.nodes.upsert({"metadata": {"name": "node-b"}, "status": {"allocatable": {"nvidia.com/gpu": "1"}}})
    assert cluster.dra_context().plugin_nodes == {"nvidia.com/gpu": frozenset({"node-b"})}


@pytest.mark.parametrize(
    ("allocatable", "plugin"),
    [
        pytest.param({"nvidia.com/gpu": "2"}, True, id="advertised"),
        pytest.param({"nvidia.com/gpu": "0"}, False, id="zero-kept-by-the-kubelet"),
        pytest.param({"nvidia.com/gpu": "0k"}, False, id="zero-with-a-suffix"),
        pytest.param({"nvidia.com/gpu": "lots"}, False, id="junk"),
        pytest.param({"cpu": "8"}, False, id="not-listed"),
    ],
)
def test_where_a_device_plugin_advertises_a_resource(allocatable: dict[str, str], plugin: bool) -> None:
    cluster = state("unlimited", nodes=[{"metadata": {"name": "node-a"}, "status": {"allocatable": allocatable}}])
    assert ("nvidia.com/gpu" in cluster.dra_context().plugin_nodes) is plugin


def _with_pods(cluster: ClusterState, *pods: dict[str, Any]) -> ClusterState:
    """``cluster`` with ``pods`` live (the DRA pod watch's store)."""
    cluster.dra.pods.replace(list(pods))
    return cluster


SHARED_60 = claim("shared-gpu", NS, memory="60Gi")
"""Room for two vLLM pods at 0.30 of the 80Gi GPU (2 x 25.5Gi), not three."""


def test_a_shared_claim_covers_the_engines_of_every_pod_naming_it() -> None:
    cluster = _with_pods(
        state("memory", SHARED_60),
        vllm_claim_pod("vllm-0", "0.3", claim_name="shared-gpu"),
        vllm_claim_pod("vllm-1", "0.3", claim_name="shared-gpu"),
    )
    decision = review(cluster, vllm_claim_pod("vllm-2", "0.3", claim_name="shared-gpu"))
    one = f"0.30 x 80Gi{PLUS} = {RESERVED_03}"
    assert decision.violations == (
        f"claim gpu requests 60Gi of memory but vLLM will reserve {one} and vLLM of pod vllm-0 will reserve {one} "
        f"and vLLM of pod vllm-1 will reserve {one}; set capacity.requests.memory: {memory_text(3 * reserved('0.3'))}",
    )
    # Two pods fit: the second is admitted beside the first.
    assert review(_with_pods(state("memory", SHARED_60), vllm_claim_pod("vllm-0", "0.3", claim_name="shared-gpu")),
                  vllm_claim_pod("vllm-1", "0.3", claim_name="shared-gpu")).allowed


def test_a_workload_sharing_one_claim_counts_each_replica() -> None:
    pod = vllm_claim_pod("x", "0.3", claim_name="shared-gpu")
    template = {k: v for k, v in pod.items() if k in ("metadata", "spec")}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm", "namespace": NS},
                  "spec": {"replicas": 3, "template": template}}
    decision = review(state("memory", SHARED_60), deployment, kind="Deployment")
    assert [f.code for f in decision.problems] == [Code.CLAIM_MEMORY]
    assert (
        f"vLLM (in each of 3 pods) will reserve 3 x (0.30 x 80Gi{PLUS} = {RESERVED_03}) = "
        f"{memory_text(3 * reserved('0.3'))}" in decision.violations[0]
    )
    deployment["spec"]["replicas"] = 2
    assert review(state("memory", SHARED_60), deployment, kind="Deployment").allowed


@pytest.mark.parametrize("mode", ["enforce", "warn"])
def test_a_claim_created_after_the_pods_sharing_it_is_checked_against_them(mode: str) -> None:
    cluster = _with_pods(
        state("memory"),
        *(vllm_claim_pod(f"vllm-{i}", "0.3", claim_name="shared-gpu") for i in range(3)),
        vllm_claim_pod("other", "0.9", claim_name="another-claim"),
    )
    decision = review(cluster, SHARED_60, kind="ResourceClaim", mode=mode)
    one = f"0.30 x 80Gi{PLUS} = {RESERVED_03}"
    message = (
        "claim shared-gpu request gpu requests 60Gi of memory but "
        + " and ".join(f"vLLM of pod vllm-{i} will reserve {one}" for i in range(3))
        + f"; set capacity.requests.memory: {memory_text(3 * reserved('0.3'))}"
    )
    assert decision.violations == (message,)
    assert decision.allowed is (mode != "enforce")
    # Without pods naming it, a claim only draws warnings.
    assert review(state("memory"), SHARED_60, kind="ResourceClaim", mode=mode).allowed


def test_a_template_created_after_its_pods_is_checked_against_those_still_waiting_for_a_claim() -> None:
    waiting = vllm_claim_pod("vllm-0", "0.9")
    made = vllm_claim_pod("vllm-1", "0.9")
    made["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "vllm-1-gpu-x7k9m"}]}
    decision = review(_with_pods(state("memory"), waiting, made), template("8Gi"), kind="ResourceClaimTemplate")
    assert not decision.allowed
    assert decision.violations == (
        f"claim gpu-4gi request gpu requests 8Gi of memory but vLLM of pod vllm-0 will reserve 0.90 x 80Gi{PLUS} = "
        f"{RESERVED_09}; set capacity.requests.memory: {RESERVED_09}",
    )
    # A pod whose claim the controller has made keeps it: the template no longer concerns it.
    assert review(_with_pods(state("memory"), made), template("8Gi"), kind="ResourceClaimTemplate").allowed


def many_requests(name: str, requests: int) -> dict[str, Any]:
    """A ResourceClaimTemplate of ``requests`` requests (the API allows 32)."""
    obj = template(RESERVED_09, name)
    [request] = obj["spec"]["spec"]["devices"]["requests"]
    obj["spec"]["spec"]["devices"]["requests"] = [{**request, "name": f"r{i}"} for i in range(requests)]
    return obj


def claim_heavy_pod(claims: int) -> dict[str, Any]:
    """One vLLM container using ``claims`` claims made from 32-request templates."""
    obj = vllm_claim_pod(template="t0", namespace=NS)
    obj["spec"]["resourceClaims"] = [{"name": f"k{i}", "resourceClaimTemplateName": f"t{i}"} for i in range(claims)]
    obj["spec"]["containers"][0]["resources"] = {"claims": [{"name": f"k{i}"} for i in range(claims)]}
    return obj


def test_a_pod_using_its_claims_more_than_the_bound_is_refused_as_uncheckable() -> None:
    # 8 claims x 32 requests = 256 uses: checked. 9 x 32 = 288: a review would check every one on every
    # device, which for the pods the API server allows (32 x 32 x every container) took seconds.
    cluster = state("memory", *(many_requests(f"t{i}", 32) for i in range(9)))
    assert MAX_CLAIM_USES == 256
    assert CLAIM_USES_REFUSAL not in " ".join(review(cluster, claim_heavy_pod(8)).violations)
    decision = review(cluster, claim_heavy_pod(9))
    assert not decision.allowed and any(CLAIM_USES_REFUSAL in v for v in decision.violations)
    # The extender places it nowhere: it cannot check it either.
    pod = claim_heavy_pod(9)
    pod["status"] = {"resourceClaimStatuses": [{"name": f"k{i}", "resourceClaimName": f"p-k{i}"} for i in range(9)]}
    cluster.dra.claims.replace([{**many_requests(f"t{i}", 32), "kind": "ResourceClaim",
                                 "metadata": {"name": f"p-k{i}", "namespace": NS},
                                 "spec": many_requests(f"t{i}", 32)["spec"]["spec"]} for i in range(9)])
    placement = place_claims(cluster.dra, pod, "node-a", sizing=False)
    assert [(r.message, r.resolvable) for r in placement.refusals] == [(f"node-a: {CLAIM_USES_REFUSAL}", False)]


HAMI_CLASS = "hami-core-gpu.project-hami.io"
HAMI_SELECTOR = f'device.driver == "{HAMI_CLASS}" && device.attributes["{HAMI_CLASS}"].type == "hami-gpu"'
NIC_SELECTOR = "device.driver == 'nic.example.com'"


def claims_only_pod(template_name: str) -> dict[str, Any]:
    """A test container whose only device is a claim (Project-HAMi/k8s-dra-driver v0.1.0 demo pod-0)."""
    return {"metadata": {"name": "pod-0", "namespace": NS}, "spec": {
        "resourceClaims": [{"name": "device", "resourceClaimTemplateName": template_name}],
        "containers": [{"name": "ctr0", "image": "ubuntu:24.04", "command": ["bash", "-c", "sleep 9999"],
                        "resources": {"claims": [{"name": "device"}]}}]}}


@pytest.mark.parametrize(
    ("class_name", "selector", "memory", "gpu"),
    [
        # HAMi's DRA driver shares GPUs (its DeviceClass, demo/yaml/setup.yaml v0.1.0): a GPU pod, judged and
        # routed like any, though vramguard reads no HAMi ResourceSlice (no known device matches).
        pytest.param(HAMI_CLASS, HAMI_SELECTOR, "4Gi", True, id="hami-gpu-claim"),
        pytest.param("nic.example.com", NIC_SELECTOR, None, False, id="nic-claim-is-no-gpu"),
    ],
)
def test_a_pod_whose_gpu_is_only_a_claim_is_judged_like_any_gpu_pod(
    class_name: str, selector: str, memory: str | None, gpu: bool
) -> None:
    cluster = state("memory", claim_template(name="slice", namespace=NS, memory=memory, device_class_name=class_name))
    cluster.dra.classes.replace([device_class(), device_class(class_name, selector, None)])
    pod = claims_only_pod("slice")
    decision = review(cluster, pod, mode="warn")
    assert decision.allowed and decision.wants_gpu is gpu
    assert decision.qos_class == ("best-effort" if gpu else None)
    mutation = AdmissionRules(cluster.policy).mutation(
        NS, pod, ClusterView({ENFORCE_LABEL: "warn"}, cluster.offers(), dra=cluster.dra_context()))
    assert (mutation.routed_to == "vramguard") is gpu
