"""The control-plane builder's pure parts: versions, generated go.mod, ldflags, cache layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import build

PROXY_VERSIONS = ["v1.34.9", "v1.35.0-rc.1", "v1.35.3", "v1.35.4", "v1.36.0-alpha.1", "v1.36.3", "v1.37.2"]

SAMPLE_GOMOD = {
    "Module": {"Path": "k8s.io/kubernetes"},
    "Go": "1.25.0",
    "GoDebug": [{"Key": "default", "Value": "go1.25"}],
    "Require": [
        {"Path": "go.etcd.io/etcd/client/v3", "Version": "v3.6.5"},
        {"Path": "go.etcd.io/etcd/server/v3", "Version": "v3.6.5", "Indirect": True},
        {"Path": "k8s.io/api", "Version": "v0.0.0"},
    ],
    "Replace": [
        {"Old": {"Path": "k8s.io/client-go"}, "New": {"Path": "./staging/src/k8s.io/client-go"}},
        {"Old": {"Path": "k8s.io/api"}, "New": {"Path": "./staging/src/k8s.io/api"}},
        {"Old": {"Path": "github.com/example/other"}, "New": {"Path": "github.com/fork/other", "Version": "v1.0.0"}},
    ],
}


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        pytest.param("1.35", "v1.35.4", id="minor-picks-newest-release"),
        pytest.param("v1.36", "v1.36.3", id="v-prefix-and-skips-alpha"),
        pytest.param("1.37.2", "v1.37.2", id="full-version-kept"),
        pytest.param("v1.36.0-rc.1", "v1.36.0-rc.1", id="explicit-prerelease-kept"),
    ],
)
def test_pick_version(requested: str, expected: str) -> None:
    assert build.pick_version(requested, PROXY_VERSIONS) == expected


def test_pick_version_fails_for_unknown_minor() -> None:
    with pytest.raises(build.BuildError, match=r"1\.40"):
        build.pick_version("1.40", PROXY_VERSIONS)


@pytest.mark.parametrize(
    ("kube", "staging"),
    [("v1.35.4", "v0.35.4"), ("1.36.3", "v0.36.3"), ("v1.37.0-rc.1", "v0.37.0-rc.1")],
)
def test_staging_version(kube: str, staging: str) -> None:
    assert build.staging_version(kube) == staging


def test_resolve_version_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "list_module_versions", lambda module: PROXY_VERSIONS)
    monkeypatch.delenv(build.KUBE_VERSION_ENV, raising=False)
    assert build.resolve_version() == "v1.36.3"
    monkeypatch.setenv(build.KUBE_VERSION_ENV, "1.35")
    assert build.resolve_version() == "v1.35.4"
    assert build.resolve_version("1.37") == "v1.37.2"


def test_resolve_version_falls_back_to_the_cache_when_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def offline(module: str) -> list[str]:
        raise build.BuildError("no network")

    monkeypatch.setattr(build, "list_module_versions", offline)
    monkeypatch.delenv(build.KUBE_VERSION_ENV, raising=False)
    for name in build.BINARIES:
        path = tmp_path / "v1.36.2" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(0o755)
    assert build.resolve_version(root=tmp_path) == "v1.36.2"
    with pytest.raises(build.BuildError):
        build.resolve_version("1.35", root=tmp_path)


def test_kube_facts_come_from_the_release_gomod() -> None:
    facts = build.kube_facts_from_gomod("v1.35.4", SAMPLE_GOMOD)
    assert facts.staging_modules == ("k8s.io/api", "k8s.io/client-go")
    assert facts.etcd_version == "v3.6.5"
    assert facts.go_directive == "1.25.0"
    assert facts.godebug == (("default", "go1.25"),)


def test_kube_facts_require_staging_replaces() -> None:
    with pytest.raises(build.BuildError, match="staging"):
        build.kube_facts_from_gomod("v1.35.4", {"Go": "1.25.0", "Replace": []})


def test_rendered_gomod_replaces_every_staging_module_with_its_release() -> None:
    facts = build.kube_facts_from_gomod("v1.35.4", SAMPLE_GOMOD)
    text = build.render_kube_gomod(facts)
    assert "require k8s.io/kubernetes v1.35.4" in text
    lines = {" ".join(line.split()) for line in text.splitlines()}
    assert "k8s.io/api => k8s.io/api v0.35.4" in lines
    assert "k8s.io/client-go => k8s.io/client-go v0.35.4" in lines
    assert "godebug default=go1.25" in text
    assert "go 1.25.0" in text
    assert text == build.render_kube_gomod(facts), "generated files must be deterministic"


def test_etcd_gomod_requires_the_pinned_server() -> None:
    text = build.render_etcd_gomod("v3.6.5", "1.25.0")
    assert "require go.etcd.io/etcd/server/v3 v3.6.5" in text


def test_version_ldflags_set_both_version_packages() -> None:
    flags = build.version_ldflags("v1.36.3", "2026-01-01T00:00:00Z")
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {package}.gitVersion=v1.36.3" in flags
        assert f"-X {package}.gitMajor=1" in flags
        assert f"-X {package}.gitMinor=36" in flags
        assert f"-X {package}.buildDate=2026-01-01T00:00:00Z" in flags


def test_cache_root_respects_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_root() == tmp_path / "vramguard" / "k8s"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_root() == Path.home() / ".cache" / "vramguard" / "k8s"


def test_ensure_built_skips_complete_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in build.BINARIES:
        path = tmp_path / "v1.35.4" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(0o755)

    def must_not_build(*args: object) -> None:
        raise AssertionError("a complete cache must not be rebuilt")

    monkeypatch.setattr(build, "_build", must_not_build)
    binaries = build.ensure_built("v1.35.4", root=tmp_path)
    assert binaries.kube_apiserver == tmp_path / "v1.35.4" / "kube-apiserver"
    assert binaries.kube_controller_manager == tmp_path / "v1.35.4" / "kube-controller-manager"
    assert binaries.complete()


def test_a_cache_without_the_controller_manager_is_incomplete(tmp_path: Path) -> None:
    """A cache built before kube-controller-manager was added is rebuilt, not used half."""
    for name in ("etcd", "kube-apiserver", "kube-scheduler"):
        path = tmp_path / "v1.36.3" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(0o755)
    assert not build.Binaries("v1.36.3", tmp_path / "v1.36.3").complete()


def test_the_wrapper_imports_every_command_it_builds() -> None:
    tools = (build.WRAPPER_SOURCES / "kubernetes" / "tools.go").read_text()
    for command in build.KUBE_COMMANDS:
        assert f'_ "k8s.io/kubernetes/cmd/{command}"' in tools


def test_wrapper_sources_exist() -> None:
    for wrapper in ("kubernetes", "etcd"):
        tools = build.WRAPPER_SOURCES / wrapper / "tools.go"
        assert "//go:build tools" in tools.read_text()
