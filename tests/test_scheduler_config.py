"""The extender's managedResources: generated from the ledger's GPU resources, and shipped as generated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.test_manifests import CHART, MANIFESTS
from vramguard.cli import main
from vramguard.inventory import MIG_INSTANCE_MIB, MIG_PROFILES, mig_profile_bytes, read_inventory
from vramguard.policy import default_policy
from vramguard.scheduler_config import managed_resources, render_managed_resources, with_managed_resources

# The default scheduler's profile calls the extender only for the GPU resources it lists: every pod of
# the cluster goes through that scheduler, and the extender must not see (nor hold up) the others.
SHIPPED = [MANIFESTS / "scheduler" / "extender-default.yaml"]
# The second scheduler schedules only the pods routed to it: it lists none, so its extender sees every
# one of them, DRA claim pods (no extended resource) included.
SECOND_SCHEDULER = [
    MANIFESTS / "scheduler" / "second-scheduler.yaml",
    MANIFESTS / "base" / "scheduler-config.yaml",
    CHART / "files" / "scheduler-config.yaml",
]
# k8s.io/apimachinery v0.36.3 pkg/util/validation IsQualifiedName: optional DNS-subdomain prefix, then a
# name of at most 63 characters.
QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
# What the device plugin advertises (NVIDIA/k8s-device-plugin v0.20.0 internal/rm/rm.go: "mig-" and the
# profile with "+" written "."; api/config/v1/consts.go: ".shared" under renameByDefault) for profiles
# NVIDIA names: B200 / GB200 and GH200 96GB (mig-parted v0.15.0 deployments/systemd/config-default.yaml),
# media extensions, and the RTX PRO 6000's "-me", "+me.all", "+gfx" (same file; the device plugin's
# CHANGELOG, #1807, serves each as its own resource).
ADVERTISED = [
    "nvidia.com/gpu", "nvidia.com/gpu.shared",
    *(f"nvidia.com/mig-{p}" for p in ("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb")),
    *(f"nvidia.com/mig-{p}" for p in ("1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb")),
    *(f"nvidia.com/mig-{p}" for p in ("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb")),
    "nvidia.com/mig-1g.10gb.me", "nvidia.com/mig-1g.23gb.me", "nvidia.com/mig-2g.12gb.me",
    "nvidia.com/mig-1g.24gb-me", "nvidia.com/mig-1g.24gb.me.all", "nvidia.com/mig-1g.24gb.gfx",
    "nvidia.com/mig-4g.96gb.gfx",
    "nvidia.com/mig-1g.10gb.shared", "nvidia.com/mig-7g.180gb.shared", "nvidia.com/mig-1g.10gb.me.shared",
]


@pytest.mark.parametrize("path", SECOND_SCHEDULER, ids=lambda path: str(path.relative_to(MANIFESTS.parent)))
def test_the_second_scheduler_calls_its_extender_for_every_pod(path: Path) -> None:
    # kube-scheduler v1.36.3 pkg/scheduler/extender.go IsInterested: an extender with no managedResources
    # is interested in every pod; one that lists some only in pods asking for one of them.
    extenders = yaml.safe_load(path.read_text())["extenders"]
    assert extenders and all("managedResources" not in extender for extender in extenders)


def shipped_names(path: Path) -> list[list[str]]:
    """The managedResources names of each extender of the configuration at ``path``."""
    extenders = yaml.safe_load(path.read_text())["extenders"]
    for extender in extenders:
        assert all(entry["ignoredByScheduler"] is False for entry in extender["managedResources"])
    return [[entry["name"] for entry in extender["managedResources"]] for extender in extenders]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: str(path.relative_to(MANIFESTS.parent)))
def test_every_shipped_scheduler_configuration_manages_the_generated_resources(path: Path) -> None:
    generated = managed_resources(default_policy())
    assert shipped_names(path) == [list(generated)]
    fix = f"python -m vramguard scheduler-config {path.relative_to(MANIFESTS.parent)}"
    assert with_managed_resources(path.read_text(), generated) == path.read_text(), f"regenerate it: {fix}"


@pytest.mark.parametrize("name", ADVERTISED)
def test_every_resource_the_device_plugin_advertises_is_managed_and_read_as_a_gpu(name: str) -> None:
    policy = default_policy()
    assert name in managed_resources(policy)
    assert policy.demand_options().is_gpu(name)


def test_every_managed_resource_is_a_valid_name_once_and_its_mig_devices_have_a_size() -> None:
    names = managed_resources(default_policy())
    assert len(names) == len(set(names)), "kube-scheduler refuses a configuration naming a resource twice"
    assert all(QUALIFIED_NAME.match(name) for name in names)
    mig = [name for name in names if name.startswith("nvidia.com/mig-")]
    labels = {"nvidia.com/mig.strategy": "mixed"} | {f"{name}.count": "1" for name in mig}
    inventory = read_inventory({"metadata": {"name": "n", "labels": labels}})
    assert sorted(d.resource for d in inventory.devices) == sorted(mig)
    assert all(d.memory_bytes > 0 for d in inventory.devices)


@pytest.mark.parametrize("variant", ["-me", ".me", ".me.all", ".gfx", ".shared", ".me.shared"])
def test_a_profile_variant_has_its_profiles_size(variant: str) -> None:
    assert mig_profile_bytes(f"1g.24gb{variant}") == mig_profile_bytes("1g.24gb") == MIG_INSTANCE_MIB["1g.24gb"] << 20


def test_every_profile_with_a_known_size_is_listed() -> None:
    listed = {profile for _, profiles in MIG_PROFILES for profile in profiles}
    assert set(MIG_INSTANCE_MIB) <= listed


def test_a_policys_own_resources_and_prefixes_are_managed() -> None:
    policy = default_policy().model_copy(update={
        "gpu_resources": ("example.com/gpu", "nvidia.com/gpu"), "gpu_resource_prefixes": ("example.com/mig-",)})
    names = managed_resources(policy)
    assert names[:2] == ("example.com/gpu", "nvidia.com/gpu")
    assert "example.com/mig-7g.180gb" in names and not any(n.startswith("nvidia.com/mig-") for n in names)


CONFIG = """\
extenders:
- urlPrefix: https://x
  managedResources:
  - name: nvidia.com/gpu
    ignoredByScheduler: false

  # the next key's comment
  nodeCacheCapable: true
- urlPrefix: https://y
  managedResources:
      - name: a.example/b
profiles: []
"""


def test_each_block_is_replaced_whatever_its_indent_and_the_rest_is_kept() -> None:
    text = with_managed_resources(CONFIG, ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"])
    parsed = yaml.safe_load(text)
    assert [e["managedResources"] for e in parsed["extenders"]] == [
        [{"name": "nvidia.com/gpu", "ignoredByScheduler": False},
         {"name": "nvidia.com/mig-1g.10gb", "ignoredByScheduler": False}]] * 2
    assert parsed["extenders"][0]["nodeCacheCapable"] is True and parsed["profiles"] == []
    assert "\n\n  # the next key's comment\n" in text
    assert with_managed_resources(text, ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]) == text


def test_a_configuration_without_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="managedResources"):
        with_managed_resources("extenders: []\n", ["nvidia.com/gpu"])


def test_the_cli_regenerates_a_shipped_file_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    path = SHIPPED[0]
    assert main(["scheduler-config", str(path)]) == 0
    assert capsys.readouterr().out == path.read_text()
    assert main(["scheduler-config"]) == 0
    assert capsys.readouterr().out == render_managed_resources(managed_resources(default_policy()))


@pytest.mark.parametrize(("content", "message"), [(None, "No such file"), ("kind: X\n", "no `managedResources:`")])
def test_the_cli_names_what_it_cannot_use_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["scheduler-config", str(path)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and message in out.err and len(out.err.strip().splitlines()) == 1


def test_a_renamed_time_sliced_mig_instance_is_one_shared_device() -> None:
    # GPU Feature Discovery keys the labels of a renamed resource by its plain name
    # (k8s-device-plugin v0.20.0 internal/lm/resource_test.go, "mig mixed rename does not append").
    labels = {"nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.23gb.count": "1",
              "nvidia.com/mig-1g.23gb.replicas": "4", "nvidia.com/mig-1g.23gb.sharing-strategy": "time-slicing",
              "nvidia.com/mig-1g.23gb.memory": "20992"}
    node = {"metadata": {"name": "b200", "labels": labels},
            "status": {"allocatable": {"nvidia.com/mig-1g.23gb.shared": "4"}}}
    (device,) = read_inventory(node).devices
    assert (device.resource, device.replicas, device.sharing, device.memory_bytes) == (
        "nvidia.com/mig-1g.23gb.shared", 4, "time-slicing", 20992 << 20)
