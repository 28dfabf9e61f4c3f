"""Policy: the shipped default, validation messages, class choice, and reloading a file safely."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import pytest

from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL
from vramguard.demand.model import Vram
from vramguard.inventory import Gpu
from vramguard.policy import Policy, PolicyError, PolicyFile, default_policy, load_policy, parse_vram_limit
from vramguard.quantity import GiB

MINIMAL = """
default_class: shared
classes:
  shared: {sharing: [time-slicing]}
"""


def test_default_policy_follows_the_decision_tree() -> None:
    policy = default_policy()
    assert policy.default_class == "best-effort"
    assert {name: c.sharing for name, c in policy.classes.items()} == {
        "guaranteed": ("none", "mig"),
        "burstable": ("mps",),
        "best-effort": ("time-slicing", "mps", "none", "mig"),
        "shared": ("time-slicing", "mps"),
    }
    assert policy.enforcement == "audit"  # installing vramguard refuses nothing for a class rule
    assert all(c.headroom is None for c in policy.classes.values())  # margins are the budget's now
    rule = policy.budget_rule()
    assert rule.exclusive == 0  # a pod alone on a GPU is never refused for its own share
    assert set(rule.margins.values()) == {Fraction(3, 100)}
    assert policy.classes["burstable"].require_mps_limit
    assert policy.gpu_resources == ("nvidia.com/gpu", "nvidia.com/gpu.shared", "amd.com/gpu")
    assert policy.gpu_resource_prefixes == (
        "nvidia.com/mig-", "amd.com/spx_", "amd.com/dpx_", "amd.com/tpx_", "amd.com/qpx_", "amd.com/cpx_"
    )
    # The shipped file names what a policy that names none reads: every vendor's (vramguard.vendors).
    assert Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none]}}").gpu_resources == policy.gpu_resources
    assert policy.schedulers == ("vramguard",)


def test_defaults_of_a_minimal_policy() -> None:
    policy = Policy.from_yaml(MINIMAL)
    shared = policy.classes["shared"]
    assert (shared.headroom, shared.scoring, shared.unknown_vram) == (None, "binpack", "whole-gpu")
    assert policy.margin_for("time-slicing") == Fraction(3, 100)
    assert policy.demand_options().allowances.amount("cuda_context", "vllm") == 512 * 2**20
    assert (shared.max_vram, shared.require_mps_limit, shared.allow_implicit_defaults) == (None, False, True)
    assert policy.enforcement == "warn"
    assert policy.quotas == {}


INVALID = [
    pytest.param("classes: {a: {sharing: [none]}}\nbogus: 1", ["unknown key 'bogus' (allowed: default_class"],
                 id="unknown-top-level-key"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none], headrom: 0.2}}",
                 ["unknown key 'headrom' in classes.a (allowed: description, sharing, headroom"],
                 id="typo-in-class"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none], headroom: 1.5}}",
                 ["classes.a.headroom: Input should be less than 1"], id="headroom-too-big"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none], headroom: -0.1}}",
                 ["classes.a.headroom: Input should be greater than or equal to 0"], id="negative-headroom"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [shared]}}",
                 ["classes.a.sharing.0: Input should be 'none', 'time-slicing', 'mps' or 'mig'"],
                 id="unknown-strategy"),
    pytest.param("default_class: a\nclasses: {a: {sharing: []}}",
                 ["classes.a.sharing: Tuple should have at least 1 item"], id="no-strategy"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [mps, mps]}}",
                 ["classes.a.sharing: lists a strategy twice"], id="strategy-twice"),
    pytest.param("default_class: a\nclasses: {a: {}}", ["classes.a.sharing: required"], id="sharing-missing"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none], scoring: pack}}",
                 ["classes.a.scoring: Input should be 'binpack' or 'spread'"], id="unknown-scoring"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none], max_vram_per_gpu: 1.5}}",
                 ["classes.a.max_vram_per_gpu: 1.5: a fraction of the GPU must be in (0, 1]"],
                 id="max-vram-fraction-above-one"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none], max_vram_per_gpu: lots}}",
                 ["neither a quantity (like 40Gi) nor a fraction"], id="max-vram-junk"),
    pytest.param("default_class: gold\nclasses: {a: {sharing: [none]}}",
                 ["default_class 'gold' is not a class (classes: a)"], id="default-class-missing"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none]}}\nquotas: {team-a: 10 gigs}",
                 ["quotas: namespace team-a: '10 gigs' is not a Kubernetes quantity"], id="bad-quota"),
    pytest.param("default_class: a\nclasses: {a: {sharing: [none]}}\nenforcement: deny",
                 ["enforcement: Input should be 'enforce', 'warn' or 'audit'"], id="bad-enforcement"),
    pytest.param("default_class: 'a b'\nclasses: {'a b': {sharing: [none]}}",
                 ["class names must be valid label values: 'a b'"], id="class-name-not-a-label-value"),
    pytest.param("classes: {}", ["classes: Dictionary should have at least 1 item"], id="no-classes"),
    pytest.param("- a\n- b", ["policy must be a YAML mapping"], id="not-a-mapping"),
    pytest.param("classes: [", ["policy is not valid YAML at line"], id="broken-yaml"),
]


@pytest.mark.parametrize(("text", "messages"), INVALID)
def test_invalid_policies_are_explained(text: str, messages: list[str]) -> None:
    with pytest.raises(PolicyError) as caught:
        Policy.from_yaml(text)
    for message in messages:
        assert message in str(caught.value)


def test_every_problem_is_reported_at_once() -> None:
    text = "default_class: a\nclasses: {a: {sharing: [none], headroom: 2, scoring: x}}\nextra: 1"
    with pytest.raises(PolicyError) as caught:
        Policy.from_yaml(text)
    assert str(caught.value).count("\n") == 3


@pytest.mark.parametrize(
    ("text", "vram"),
    [
        ("0.5", Vram(fraction=Fraction(1, 2))),
        ("1", Vram(fraction=Fraction(1))),
        ("40Gi", Vram(bytes=40 * GiB)),
        ("48G", Vram(bytes=48 * 10**9)),
    ],
)
def test_max_vram_is_a_quantity_or_a_fraction(text: str, vram: Vram) -> None:
    assert parse_vram_limit(text) == vram
    policy = Policy.from_yaml(f"default_class: a\nclasses: {{a: {{sharing: [none], max_vram_per_gpu: {text}}}}}")
    assert policy.classes["a"].max_vram == vram


QOS = {"guaranteed", "burstable", "best-effort", "shared"}
CHOICES = [
    pytest.param({}, {}, ("best-effort", "default", None), id="default"),
    pytest.param({QOS_CLASS_LABEL: "guaranteed"}, {}, ("guaranteed", "pod", None), id="pod-label"),
    pytest.param({}, {QOS_CLASS_LABEL: "burstable"}, ("burstable", "namespace", None), id="namespace-label"),
    pytest.param({QOS_CLASS_LABEL: "guaranteed"}, {QOS_CLASS_LABEL: "burstable"},
                 ("burstable", "namespace",
                  "pod label vramguard.io/qos-class=guaranteed is not allowed in a namespace of class burstable "
                  "(allowed: burstable)"),
                 id="pod-cannot-leave-its-namespace-class"),
    pytest.param({QOS_CLASS_LABEL: "best-effort"}, {QOS_CLASS_LABEL: "guaranteed"},
                 ("guaranteed", "namespace", "pod label vramguard.io/qos-class=best-effort is not allowed"),
                 id="pod-cannot-escape-guaranteed-rules"),
    pytest.param({QOS_CLASS_LABEL: "guaranteed"}, {QOS_CLASS_LABEL: "guaranteed"}, ("guaranteed", "pod", None),
                 id="pod-may-name-its-namespace-class"),
    pytest.param({QOS_CLASS_LABEL: "burstable"}, {}, ("burstable", "pod", None),
                 id="default-class-allows-the-shipped-classes"),
    pytest.param({QOS_CLASS_LABEL: "gold"}, {QOS_CLASS_LABEL: "burstable"},
                 ("burstable", "namespace", "pod label vramguard.io/qos-class=gold names no class"),
                 id="unknown-pod-class-falls-back"),
    pytest.param({QOS_CLASS_LABEL: "gold"}, {QOS_CLASS_LABEL: "silver"},
                 ("best-effort", "default", "namespace label vramguard.io/qos-class=silver names no class"),
                 id="both-unknown"),
]


@pytest.mark.parametrize(("pod", "namespace", "expected"), CHOICES)
def test_choose_class(pod: dict[str, str], namespace: dict[str, str], expected: tuple[str, str, str | None]) -> None:
    choice = default_policy().choose_class(pod, namespace)
    assert (choice.name, choice.source) == expected[:2]
    if expected[2] is None:
        assert choice.problem is None
    else:
        assert choice.problem is not None and expected[2] in choice.problem
    assert choice.qos == default_policy().classes[choice.name]


def test_a_namespace_class_lists_the_pod_classes_allowed_under_it() -> None:
    policy = Policy.from_yaml("""
default_class: open
classes:
  open: {sharing: [time-slicing]}
  team: {sharing: [time-slicing], allows_pod_classes: [big]}
  big: {sharing: [none]}
""")
    team = {QOS_CLASS_LABEL: "team"}
    assert policy.pod_classes_under("team") == ("team", "big")
    assert policy.choose_class({QOS_CLASS_LABEL: "big"}, team).name == "big"
    refused = policy.choose_class({QOS_CLASS_LABEL: "open"}, team)
    assert (refused.name, refused.source) == ("team", "namespace")
    assert refused.problem == (
        "pod label vramguard.io/qos-class=open is not allowed in a namespace of class team (allowed: team, big)"
    )
    # The field defaults to "only itself", for the default class too.
    assert policy.choose_class({QOS_CLASS_LABEL: "big"}, {}).name == "open"


def test_allows_pod_classes_must_name_classes() -> None:
    with pytest.raises(PolicyError, match=r"classes\.a\.allows_pod_classes: 'gold' is not a class"):
        Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none], allows_pod_classes: [gold]}}")


@pytest.mark.parametrize(
    ("user", "groups", "allowed"),
    [
        pytest.param("alice", (), True, id="listed-user"),
        pytest.param("bob", ("system:nodes",), True, id="listed-group"),
        pytest.param("bob", ("tenants",), False, id="neither"),
        pytest.param("", (), False, id="anonymous"),
    ],
)
def test_direct_placement_allow_list(user: str, groups: tuple[str, ...], allowed: bool) -> None:
    policy = Policy.from_yaml(
        "default_class: a\nclasses: {a: {sharing: [none]}}\n"
        "direct_placement: {allowed_users: [alice], allowed_groups: [system:nodes]}"
    )
    assert policy.direct_placement.allows(user, groups) is allowed


def test_direct_placement_keys_are_checked() -> None:
    with pytest.raises(PolicyError, match="unknown key 'users' in direct_placement"):
        Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none]}}\ndirect_placement: {users: [x]}")


def test_shipped_policy_distrusts_env_only_engines_for_guaranteed_only() -> None:
    classes = default_policy().classes
    assert {name for name, qos in classes.items() if not qos.trust_env_only_engines} == {"guaranteed"}


def test_choose_class_accepts_missing_labels() -> None:
    assert default_policy().choose_class(None, None).name == "best-effort"


def test_an_old_policys_headroom_is_the_margin_of_shared_devices() -> None:
    policy = Policy.from_yaml("""
default_class: relaxed
classes:
  relaxed: {sharing: [time-slicing], headroom: 0.05}
  careful: {sharing: [time-slicing, mps], headroom: 0.2}
""")
    assert policy.margin_for("time-slicing") == Fraction(1, 5)  # the most careful class allowed there
    assert policy.margin_for("mps") == Fraction(1, 5)
    assert policy.margin_for("none") == Fraction(3, 100)  # no class sets one: the default margin
    rule = policy.budget_rule()
    assert set(rule.margins) == {"none", "time-slicing", "mps", "mig"}
    exclusive = Gpu("0", 0, "H100", 80 * 2**30, "none", 1, "nvidia.com/gpu")
    shared = Gpu("0", 0, "H100", 80 * 2**30, "time-slicing", 4, "nvidia.com/gpu")
    assert rule.margin(exclusive) == 0  # an exclusive device keeps no margin, old file or new
    assert rule.margin(shared) == Fraction(1, 5)


def test_budget_margins_win_over_an_old_headroom() -> None:
    policy = Policy.from_yaml("""
default_class: a
classes: {a: {sharing: [time-slicing], headroom: 0.2}}
budget: {margins: {time-slicing: 0.05}, exclusive_margin: 0.01}
""")
    assert policy.margin_for("time-slicing") == Fraction(1, 20)
    assert policy.budget_rule().exclusive == Fraction(1, 100)


def test_allowances_per_engine_and_product() -> None:
    policy = Policy.from_yaml("""
default_class: a
classes: {a: {sharing: [time-slicing]}}
allowances:
  cuda_context: 600Mi
  engines: {vllm: {cuda_graphs: 2Gi}}
  products: {"NVIDIA H200": {cuda_context: 1Gi}}
""")
    table = policy.demand_options().allowances
    assert table.amount("cuda_context", "sglang") == 600 * 2**20
    assert table.amount("cuda_graphs", "vllm") == 2 * 2**30
    assert table.amount("cuda_graphs", "sglang") == 2**30  # the shipped default
    assert table.by_product("cuda_context") == (("NVIDIA H200", 2**30),)


def test_a_bad_allowance_names_its_key() -> None:
    with pytest.raises(PolicyError, match=r"allowances.engines.vllm.cuda_graphs"):
        Policy.from_yaml(
            "default_class: a\nclasses: {a: {sharing: [none]}}\nallowances: {engines: {vllm: {cuda_graphs: lots}}}"
        )
    with pytest.raises(PolicyError, match=r"unknown key 'cuda_graph' in allowances \(allowed: cuda_context"):
        Policy.from_yaml("default_class: a\nclasses: {a: {sharing: [none]}}\nallowances: {cuda_graph: 1Gi}")


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({}, ("audit", None)),
        ({ENFORCE_LABEL: "enforce"}, ("enforce", None)),
        ({ENFORCE_LABEL: "audit"}, ("audit", None)),
        ({ENFORCE_LABEL: "deny"}, ("audit", "vramguard.io/enforce=deny is not enforce, warn or audit; using audit")),
    ],
    ids=["default", "enforce", "audit", "invalid"],
)
def test_enforcement_for(labels: dict[str, str], expected: tuple[str, str | None]) -> None:
    mode, problem = default_policy().enforcement_for(labels)
    assert mode == expected[0]
    if expected[1] is None:
        assert problem is None
    else:
        assert problem is not None and expected[1] in problem


def test_quota_bytes() -> None:
    policy = Policy.from_yaml(MINIMAL + "quotas: {team-a: 160Gi}")
    assert policy.quota_bytes("team-a") == 160 * GiB
    assert policy.quota_bytes("team-b") is None


def test_load_policy_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("classes: {}")
    with pytest.raises(PolicyError, match=r"policy.yaml: invalid policy"):
        load_policy(path)
    with pytest.raises(PolicyError, match="cannot read policy"):
        load_policy(tmp_path / "missing.yaml")
    path.write_text(MINIMAL)
    assert load_policy(path).default_class == "shared"


def _rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    # Some filesystems keep a coarse mtime; move it on so the change is seen by stat.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_policy_file_reloads_only_changes_and_keeps_the_last_good_policy(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(MINIMAL)
    source = PolicyFile(path)
    first = source.policy

    assert source.reload() == (first, None)  # unchanged: same object, nothing parsed

    _rewrite(path, MINIMAL)  # touched, same content
    assert source.reload() == (first, None)
    assert source.reload()[0] is first

    _rewrite(path, MINIMAL.replace("[time-slicing]", "[mps]"))
    changed, error = source.reload()
    assert error is None and changed.classes["shared"].sharing == ("mps",)

    _rewrite(path, MINIMAL + "typo: 1")
    kept, error = source.reload()
    assert kept is changed
    assert error is not None and "unknown key 'typo'" in error and "keeping the previous policy" in error

    path.unlink()
    kept, error = source.reload()
    assert kept is changed and error is not None and "cannot read policy" in error

    _rewrite(path, MINIMAL)
    back, error = source.reload()
    assert error is None and back.classes["shared"].sharing == ("time-slicing",)


def test_policy_file_refuses_an_invalid_start(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("default_class: nope\nclasses: {a: {sharing: [none]}}")
    with pytest.raises(PolicyError, match="default_class 'nope'"):
        PolicyFile(path)


def test_policy_is_frozen() -> None:
    policy = default_policy()
    with pytest.raises(ValueError, match="frozen"):
        policy.default_class = "guaranteed"


def test_set_of_classes_is_what_the_issue_asks() -> None:
    assert set(default_policy().classes) == QOS
