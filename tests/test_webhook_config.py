"""The Validating- and MutatingWebhookConfiguration generators, the shipped files, the CLI and the Helm chart."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_manifests import CHART, CLUSTER_VERSION, MANIFESTS, NAMESPACE, helm_command, render_chart
from vramguard.cli import main
from vramguard.codecs import ENFORCE_LABEL
from vramguard.policy import Policy, default_policy
from vramguard.webhook_config import (
    MUTATING_HEADER,
    ROUTING_HEADER,
    WebhookTarget,
    asks_for_gpu_expression,
    mutating_webhook_configuration,
    render,
    routing_admission_policy,
    webhook_configuration,
)

SHIPPED = MANIFESTS / "webhook" / "validating-webhook.yaml"
JSON = dict[str, Any]


def enforce_expression(webhook: JSON) -> JSON | None:
    found = [e for e in webhook["namespaceSelector"]["matchExpressions"] if e["key"] == ENFORCE_LABEL]
    assert len(found) <= 1
    return found[0] if found else None


def entries(config: JSON) -> dict[str, tuple[str, tuple[str, ...], tuple[str, tuple[str, ...]] | None]]:
    """name -> (failurePolicy, operations, (operator, values) of the enforce selector)."""
    result = {}
    for webhook in config["webhooks"]:
        expression = enforce_expression(webhook)
        operations = {op for rule in webhook["rules"] for op in rule["operations"]}
        selector = (expression["operator"], tuple(expression["values"])) if expression else None
        result[webhook["name"]] = (webhook["failurePolicy"], tuple(sorted(operations)), selector)
    return result


WARN_DEFAULT = {
    "pods.vramguard.io": ("Fail", ("CREATE",), ("In", ("enforce",))),
    "pods-unenforced.vramguard.io": ("Ignore", ("CREATE",), ("NotIn", ("enforce",))),
    # A bound pod's change that alters what it holds is judged like a creation; other updates never fail.
    "pod-changes.vramguard.io": ("Fail", ("UPDATE",), ("In", ("enforce",))),
    "pod-changes-unenforced.vramguard.io": ("Ignore", ("UPDATE",), ("NotIn", ("enforce",))),
    "pod-updates.vramguard.io": ("Ignore", ("UPDATE",), None),
    "workloads.vramguard.io": ("Fail", ("CREATE", "UPDATE"), ("In", ("enforce",))),
    "workloads-unenforced.vramguard.io": ("Ignore", ("CREATE", "UPDATE"), ("NotIn", ("enforce",))),
    "cronjobs.vramguard.io": ("Fail", ("CREATE", "UPDATE"), ("In", ("enforce",))),
    "cronjobs-unenforced.vramguard.io": ("Ignore", ("CREATE", "UPDATE"), ("NotIn", ("enforce",))),
    # DRA claims and claim templates are checked against the pods already naming them: the same pair.
    "resourceclaims.vramguard.io": ("Fail", ("CREATE",), ("In", ("enforce",))),
    "resourceclaims-unenforced.vramguard.io": ("Ignore", ("CREATE",), ("NotIn", ("enforce",))),
}
# Every namespaced workload kind of the policy gets the same pair of entries.
EXTRA_KINDS = [f"{k.resource}.{k.group}" for k in default_policy().workload_kinds if k.namespaced]
# The serving operators' kinds (vramguard.operators) share one pair.
for _name in [*EXTRA_KINDS, "serving-operators"]:
    WARN_DEFAULT[f"{_name}.vramguard.io"] = ("Fail", ("CREATE", "UPDATE"), ("In", ("enforce",)))
    WARN_DEFAULT[f"{_name}-unenforced.vramguard.io"] = ("Ignore", ("CREATE", "UPDATE"), ("NotIn", ("enforce",)))
ENFORCE_DEFAULT = {
    name: (failure, operations, None if selector is None else
           (("NotIn", ("warn", "audit")) if failure == "Fail" else ("In", ("warn", "audit"))))
    for name, (failure, operations, selector) in WARN_DEFAULT.items()
}
MODES = {"warn": WARN_DEFAULT, "audit": WARN_DEFAULT, "enforce": ENFORCE_DEFAULT}


@pytest.mark.parametrize("mode", MODES)
def test_failure_policy_follows_the_default_enforcement(mode: str) -> None:
    policy = default_policy().model_copy(update={"enforcement": mode})
    assert entries(webhook_configuration(policy)) == MODES[mode]


@pytest.mark.parametrize(
    ("label", "mode"),
    [("enforce", "enforce"), ("warn", "warn"), ("audit", "audit"), (None, "warn"), (None, "enforce"),
     ("bogus", "warn"), ("bogus", "enforce")],
)
def test_every_namespace_meets_exactly_one_create_entry_and_fails_closed_only_where_enforced(
    label: str | None, mode: str
) -> None:
    # Evaluate the selectors as the API server does, and compare with the webhook's own mode.
    policy = default_policy().model_copy(update={"enforcement": mode})
    labels = {ENFORCE_LABEL: label} if label is not None else {}
    effective, _ = policy.enforcement_for(labels)
    for kind in ("pods", "pod-changes", "workloads", "cronjobs", *EXTRA_KINDS):
        chosen = [w for w in webhook_configuration(policy)["webhooks"]
                  if w["name"].startswith(f"{kind}.") or w["name"].startswith(f"{kind}-unenforced.")]
        matching = [w for w in chosen if selects(enforce_expression(w), labels)]
        assert len(matching) == 1, kind
        assert matching[0]["failurePolicy"] == ("Fail" if effective == "enforce" else "Ignore")


def selects(expression: JSON | None, labels: dict[str, str]) -> bool:
    if expression is None:
        return True
    present = expression["key"] in labels and labels[expression["key"]] in expression["values"]
    return present if expression["operator"] == "In" else not present


def test_webhook_names_are_unique_and_namespaces_excluded() -> None:
    config = webhook_configuration(default_policy(), WebhookTarget(excluded_namespaces=("kube-system", "x")))
    names = [w["name"] for w in config["webhooks"]]
    assert len(names) == len(set(names))
    for webhook in config["webhooks"]:
        first = webhook["namespaceSelector"]["matchExpressions"][0]
        assert first == {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "x"]}


def test_match_conditions_follow_the_policy_gpu_resources() -> None:
    policy = Policy.from_yaml(
        "default_class: a\nclasses: {a: {sharing: [none]}}\ngpu_resources: [amd.com/gpu]\ngpu_resource_prefixes: []"
    )
    expression = webhook_configuration(policy)["webhooks"][0]["matchConditions"][0]["expression"]
    assert "r == 'amd.com/gpu'" in expression and "nvidia.com" not in expression


def test_shipped_file_is_the_generator_output_for_the_default_policy() -> None:
    fix = "vramguard webhook-config > manifests/webhook/validating-webhook.yaml (and copy it to the chart)"
    assert SHIPPED.read_text() == render(webhook_configuration(default_policy())), fix


def test_cli_prints_the_configuration_for_a_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["webhook-config"]) == 0
    assert capsys.readouterr().out == SHIPPED.read_text()
    text = re.sub(r"(?m)^enforcement: \w+$", "enforcement: enforce", (MANIFESTS / "base" / "policy.yaml").read_text())
    (tmp_path / "policy.yaml").write_text(text)
    assert main(["webhook-config", "--policy", str(tmp_path / "policy.yaml"), "--namespace", "gpu"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert entries(config) == ENFORCE_DEFAULT
    assert {w["clientConfig"]["service"]["namespace"] for w in config["webhooks"]} == {"gpu"}


def test_cli_reports_a_bad_policy_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "policy.yaml").write_text("classes: 3\n")
    assert main(["webhook-config", "--policy", str(tmp_path / "policy.yaml")]) == 1
    assert "invalid policy" in capsys.readouterr().err


def helm_webhook_configuration(policy: Path | None) -> JSON:
    helm = helm_command()
    if helm is None:
        pytest.skip("helm is not installed")
    args = [helm, "template", "vramguard", str(CHART), "--namespace", NAMESPACE, "--kube-version", CLUSTER_VERSION]
    if policy is not None:
        args += ["--set-file", f"policy={policy}"]
    output = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    found: JSON = next(d for d in yaml.safe_load_all(output) if d and d["kind"] == "ValidatingWebhookConfiguration")
    return found


@pytest.mark.parametrize("mode", ["warn", "enforce"])
def test_chart_splits_the_failure_policy_by_the_policy_in_its_values(mode: str, tmp_path: Path) -> None:
    policy = None
    if mode == "enforce":
        policy = tmp_path / "policy.yaml"
        policy.write_text(re.sub(r"(?m)^enforcement: \w+$", "enforcement: enforce",
                                 (MANIFESTS / "base" / "policy.yaml").read_text()))
    config = helm_webhook_configuration(policy)
    assert entries(config) == MODES[mode]


def test_chart_ships_the_admission_policies_with_the_admin_groups_of_its_values() -> None:
    helm = helm_command()
    if helm is None:
        pytest.skip("helm is not installed")

    def policies(*values: str) -> dict[str, JSON]:
        args = [helm, "template", "vramguard", str(CHART), "--namespace", NAMESPACE, "--kube-version", CLUSTER_VERSION]
        for value in values:
            args += ["--set", value]
        output = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        return {f"{d['metadata']['name']}/{d['kind']}": d for d in yaml.safe_load_all(output)
                if d and d["kind"].startswith("ValidatingAdmissionPolicy") and "agent" not in d["metadata"]["name"]}

    shipped = {f"{d['metadata']['name']}/{d['kind']}": d
               for file in (MANIFESTS / "webhook" / "admission-policies.yaml", ROUTING)
               for d in yaml.safe_load_all(file.read_text()) if d}
    rendered = policies()
    assert set(rendered) == set(shipped)
    # The routing policy only where pods are routed (the second-scheduler layout, the default).
    assert not any(key.startswith("vramguard-gpu-pods-routed") for key in policies("mode=default-scheduler"))
    for key, obj in rendered.items():
        assert obj["spec"].get("validations") == shipped[key]["spec"].get("validations"), key
    custom = policies("webhook.admissionPolicies.namespaceAdminGroups={platform,system:masters}")
    condition = custom["vramguard-namespace-labels/ValidatingAdmissionPolicy"]["spec"]["matchConditions"][0][
        "expression"]
    assert "g in ['platform', 'system:masters']" in condition
    assert policies("webhook.admissionPolicies.enabled=false") == {}


def condition_of(name: str) -> str:
    config = webhook_configuration(default_policy())
    webhook = next(w for w in config["webhooks"] if w["name"] == f"{name}.vramguard.io")
    expression: str = webhook["matchConditions"][0]["expression"]
    return expression


def test_custom_kinds_are_registered_with_a_gpu_condition_per_template() -> None:
    lws = condition_of("leaderworkersets.leaderworkerset.x-k8s.io")
    assert "has(object.spec.leaderWorkerTemplate.leaderTemplate.spec.containers)" in lws
    assert "has(object.spec.leaderWorkerTemplate.workerTemplate.spec.containers)" in lws
    # A path through `*` is sent whenever its list exists; the webhook reads the templates.
    assert "has(object.spec.workerGroupSpecs)" in condition_of("rayclusters.ray.io")
    isvc = condition_of("inferenceservices.serving.kserve.io")
    assert "object.spec.predictor.model.resources.limits.exists(r, r == 'nvidia.com/gpu'" in isvc
    names = [w["name"] for w in webhook_configuration(default_policy())["webhooks"]]
    assert not any("clusterservingruntimes" in n for n in names)  # cluster-scoped: not sent


def test_pods_using_dra_claims_are_sent() -> None:
    for name, path in (("pods", "object.spec"), ("workloads", "object.spec.template.spec"),
                       ("cronjobs", "object.spec.jobTemplate.spec.template.spec")):
        assert f"(has({path}.resourceClaims) && size({path}.resourceClaims) > 0)" in condition_of(name)


def test_claims_entry() -> None:
    config = webhook_configuration(default_policy())
    webhook = next(w for w in config["webhooks"] if w["name"] == "resourceclaims.vramguard.io")
    assert webhook["rules"] == [{
        "apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"],
        "resources": ["resourceclaims", "resourceclaimtemplates"], "operations": ["CREATE"], "scope": "Namespaced",
    }]
    assert webhook["failurePolicy"] == "Fail"
    # The scheduler's own claims (the DRA extended-resource path) and those the resourceclaim
    # controller makes from a template (k8s.io/api resource/v1 PodResourceClaimAnnotation) are not sent.
    condition = webhook["matchConditions"][0]["expression"]
    assert "'resource.kubernetes.io/extended-resource-claim' in object.metadata.annotations" in condition
    assert "'resource.kubernetes.io/pod-claim-name' in object.metadata.annotations" in condition
    assert condition.startswith("object != null && !(")


MUTATING = MANIFESTS / "webhook" / "mutating-webhook.yaml"


def test_the_mutating_configuration_sends_gpu_pod_creates_and_never_blocks_them() -> None:
    config = mutating_webhook_configuration(default_policy(), WebhookTarget(excluded_namespaces=("kube-system",)))
    assert config["kind"] == "MutatingWebhookConfiguration"
    [webhook] = config["webhooks"]
    assert webhook["failurePolicy"] == "Ignore" and webhook["reinvocationPolicy"] == "Never"
    assert webhook["clientConfig"]["service"]["path"] == "/mutate"
    assert webhook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                                 "operations": ["CREATE"], "scope": "Namespaced"}]
    assert webhook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]},
        {"key": "vramguard.io/routing", "operator": "NotIn", "values": ["disabled"]},
    ]
    [validating] = webhook_configuration(default_policy())["webhooks"][0]["matchConditions"]
    [condition] = webhook["matchConditions"]
    # The same pods, those asking for a GPU, except those that only set NVIDIA_VISIBLE_DEVICES:
    # the validating webhook judges them, and there is nothing to route.
    assert "NVIDIA_VISIBLE_DEVICES" in validating["expression"]
    policy = default_policy()
    assert condition["expression"] == asks_for_gpu_expression(
        "object.spec", policy.gpu_resources, policy.gpu_resource_prefixes, reaches=False)
    assert validating["expression"] == asks_for_gpu_expression(
        "object.spec", policy.gpu_resources, policy.gpu_resource_prefixes)


def test_shipped_mutating_file_is_the_generator_output() -> None:
    fix = "vramguard webhook-config --mutating > manifests/webhook/mutating-webhook.yaml (and copy it to the chart)"
    assert MUTATING.read_text() == render(mutating_webhook_configuration(default_policy()), MUTATING_HEADER), fix
    assert main(["webhook-config", "--mutating"]) == 0


def test_chart_registers_the_mutating_webhook_unless_routing_is_off() -> None:
    [config] = [d for d in render_chart("webhook.caBundle=Q0E=") if d["kind"] == "MutatingWebhookConfiguration"]
    [webhook] = config["webhooks"]
    assert webhook["clientConfig"] == {
        "caBundle": "Q0E=",
        "service": {"name": "vramguard-webhook", "namespace": NAMESPACE, "path": "/mutate", "port": 443},
    }
    assert webhook["namespaceSelector"]["matchExpressions"][1] == {
        "key": "vramguard.io/routing", "operator": "NotIn", "values": ["disabled"]
    }
    off = render_chart("webhook.mutating.enabled=false")
    assert not [d for d in off if d["kind"] == "MutatingWebhookConfiguration"]


def test_in_default_scheduler_mode_the_mutating_webhook_is_there_only_for_memory_limits(tmp_path: Path) -> None:
    objects = render_chart("mode=default-scheduler")
    # Nothing is routed there: every pod's scheduler calls the extender.
    assert [d for d in objects if d["kind"] == "MutatingWebhookConfiguration"] == []
    helm = helm_command()
    assert helm is not None
    policy = tmp_path / "policy.yaml"
    policy.write_text((MANIFESTS / "base" / "policy.yaml").read_text().replace(
        "enforce_memory_limits: false", "enforce_memory_limits: true"))
    args = [helm, "template", "vramguard", str(CHART), "--namespace", NAMESPACE, "--kube-version", CLUSTER_VERSION,
            "--set", "mode=default-scheduler", "--set-file", f"policy={policy}"]
    output = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert [d for d in yaml.safe_load_all(output) if d and d["kind"] == "MutatingWebhookConfiguration"]


def test_the_serving_operators_kinds_are_sent_whole_unless_the_policy_describes_one() -> None:
    config = webhook_configuration(default_policy())
    [entry] = [w for w in config["webhooks"] if w["name"] == "serving-operators.vramguard.io"]
    assert {(r["apiGroups"][0], r["resources"][0]) for r in entry["rules"]} == {
        ("kubeai.org", "models"), ("kaito.sh", "workspaces"), ("apps.nvidia.com", "nimservices"),
        ("nvidia.com", "dynamographdeployments"), ("production-stack.vllm.ai", "vllmruntimes"),
        ("trainer.kubeflow.org", "trainjobs")}
    assert entry["matchConditions"] == [{"name": "asks-for-a-gpu", "expression": "object != null"}]
    own = yaml.safe_load(Path("vramguard/default_policy.yaml").read_text())
    own["workload_kinds"] = [*own.get("workload_kinds", []), {
        "group": "kubeai.org", "kind": "Model", "resource": "models", "versions": ["v1"],
        "templates": [{"name": "own", "path": "spec.podTemplate"}]}]
    policy = Policy.from_yaml(yaml.safe_dump(own))
    [entry] = [w for w in webhook_configuration(policy)["webhooks"] if w["name"] == "serving-operators.vramguard.io"]
    assert ("kubeai.org", "models") not in {(r["apiGroups"][0], r["resources"][0]) for r in entry["rules"]}


ROUTING = MANIFESTS / "base" / "routing-policy.yaml"


def test_shipped_routing_policy_is_the_generator_output() -> None:
    fix = "vramguard webhook-config --routing-policy > manifests/base/routing-policy.yaml (and copy it to the chart)"
    assert ROUTING.read_text() == render(routing_admission_policy(default_policy()), ROUTING_HEADER), fix
    assert main(["webhook-config", "--routing-policy"]) == 0


def test_the_routing_policy_is_only_where_pods_are_routed() -> None:
    policy, binding = routing_admission_policy(default_policy())
    assert policy["spec"]["failurePolicy"] == "Fail" and binding["spec"]["validationActions"] == ["Deny"]
    [validation] = policy["spec"]["validations"]
    assert validation["expression"] == (
        "has(object.spec.schedulerName) && object.spec.schedulerName != 'default-scheduler'")
    # Where default-scheduler calls the extender, or routing is off, nothing is routed: no policy.
    assert routing_admission_policy(default_policy().model_copy(update={"schedulers": ("default-scheduler",)})) == []
