"""Build etcd, kube-apiserver, kube-scheduler, kube-controller-manager, the kubelet and kube-proxy from
Go source, cached by Kubernetes version.

``go install k8s.io/kubernetes/cmd/...@vX`` does not work: k8s.io/kubernetes points its staging
modules (k8s.io/api, k8s.io/client-go, ...) at ``./staging/src/...`` through replace directives,
and replace directives of a dependency are ignored. So the builder generates a small wrapper
module per version that requires ``k8s.io/kubernetes vX.Y.Z`` and replaces every staging module
with its published ``v0.Y.Z`` release; the list is read from that version's own go.mod. etcd is
built the same way from ``go.etcd.io/etcd/server/v3`` at the version Kubernetes pins.

Binaries land in ``$XDG_CACHE_HOME/vramguard/k8s/<version>/`` (``~/.cache`` by default); a
second run finds them there and builds nothing.

Usage::

    python -m e2e.build                 # newest 1.35.x the module proxy serves
    python -m e2e.build --version 1.36  # newest 1.36.x
    KUBE_VERSION=v1.37.2 python -m e2e.build
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_KUBE_MINOR = "1.36"
"""Kubernetes minor version used when neither ``--version`` nor ``KUBE_VERSION`` is given."""

KUBE_VERSION_ENV = "KUBE_VERSION"
KUBE_MODULE = "k8s.io/kubernetes"
ETCD_SERVER_MODULE = "go.etcd.io/etcd/server/v3"
FALLBACK_ETCD_VERSION = "v3.6.5"
"""Used only when a Kubernetes go.mod does not mention the etcd server module."""

KUBE_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet", "kube-proxy")
ETCD_COMMAND = "etcd"
BINARIES = (ETCD_COMMAND, *KUBE_COMMANDS)

WRAPPER_SOURCES = Path(__file__).resolve().parent / "k8s"
BUILD_INFO = "build.json"

_SEMVER = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(-[0-9A-Za-z.-]+)?$")
_STAGING_PREFIX = "./staging/src/"

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """Raised when a version cannot be resolved or a Go command fails."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- versions


@dataclass(frozen=True, order=True)
class Semver:
    """A ``vMAJOR.MINOR.PATCH[-pre]`` version as the Go module proxy lists it."""

    major: int
    minor: int
    patch: int
    prerelease: str = ""

    @classmethod
    def parse(cls, text: str) -> Semver:
        """Parse ``v1.35.4``, ``1.35.4`` or ``v1.36.0-rc.1``; a missing patch means 0."""
        match = _SEMVER.match(text.strip())
        if not match:
            raise BuildError(f"not a version: {text!r}")
        major, minor, patch, pre = match.groups()
        return cls(int(major), int(minor), int(patch or 0), (pre or "").lstrip("-"))

    @property
    def is_release(self) -> bool:
        """True for final releases (no ``-alpha``/``-beta``/``-rc`` suffix)."""
        return not self.prerelease

    def __str__(self) -> str:
        suffix = f"-{self.prerelease}" if self.prerelease else ""
        return f"v{self.major}.{self.minor}.{self.patch}{suffix}"


def _is_minor_only(text: str) -> bool:
    match = _SEMVER.match(text.strip())
    return match is not None and match.group(3) is None and match.group(4) is None


def pick_version(requested: str, available: Sequence[str]) -> str:
    """Choose the version to build.

    ``requested`` is either a full version (returned normalised, e.g. ``v1.36.3``) or a minor
    (``1.35``/``v1.35``): then the newest final release of that minor in ``available`` wins.
    """
    if not _is_minor_only(requested):
        return str(Semver.parse(requested))
    wanted = Semver.parse(requested)
    candidates = []
    for item in available:
        try:
            version = Semver.parse(item)
        except BuildError:
            continue
        if (version.major, version.minor) == (wanted.major, wanted.minor) and version.is_release:
            candidates.append(version)
    if not candidates:
        raise BuildError(f"no release of Kubernetes {requested} among {len(available)} known versions")
    return str(max(candidates))


def staging_version(kube_version: str) -> str:
    """The published version of the staging modules: ``v1.35.4`` -> ``v0.35.4``."""
    version = Semver.parse(kube_version)
    suffix = f"-{version.prerelease}" if version.prerelease else ""
    return f"v0.{version.minor}.{version.patch}{suffix}"


# --------------------------------------------------------------------------- go commands


def go_binary() -> str:
    """The ``go`` command to use (``$GO`` overrides ``go`` on PATH)."""
    found = os.environ.get("GO") or shutil.which("go")
    if not found:
        raise BuildError("the go command was not found on PATH (install Go 1.25 or newer)")
    return found


def _go_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["GO111MODULE"] = "on"
    # A go.work further up would pull unrelated modules into the wrapper.
    env["GOWORK"] = "off"
    if extra:
        env.update(extra)
    return env


def run_go(args: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None) -> str:
    """Run ``go ARGS`` in ``cwd`` and return stdout; raise BuildError with stderr on failure."""
    command = [go_binary(), *args]
    result = subprocess.run(command, cwd=cwd, env=_go_env(env), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed in {cwd}:\n{result.stderr.strip()}")
    return result.stdout


def list_module_versions(module: str) -> list[str]:
    """Versions of ``module`` the module proxy serves (``go list -m -versions``)."""
    with tempfile.TemporaryDirectory(prefix="vramguard-golist-") as scratch:
        out = run_go(["list", "-m", "-versions", module], cwd=Path(scratch))
    fields = out.split()
    return fields[1:] if fields and fields[0] == module else []


def download_module(module: str, version: str) -> dict[str, Any]:
    """``go mod download -json module@version``: paths of its go.mod, .info and source dir."""
    with tempfile.TemporaryDirectory(prefix="vramguard-gomod-") as scratch:
        out = run_go(["mod", "download", "-json", f"{module}@{version}"], cwd=Path(scratch))
    info: dict[str, Any] = json.loads(out)
    if info.get("Error"):
        raise BuildError(f"cannot download {module}@{version}: {info['Error']}")
    return info


def read_gomod_json(gomod: Path) -> dict[str, Any]:
    """Parse a go.mod file with ``go mod edit -json`` (Go's own parser)."""
    out = run_go(["mod", "edit", "-json", str(gomod)], cwd=gomod.parent)
    parsed: dict[str, Any] = json.loads(out)
    return parsed


# --------------------------------------------------------------------------- go.mod contents


@dataclass(frozen=True)
class KubeModuleFacts:
    """What the wrapper needs from a Kubernetes release's go.mod."""

    version: str
    go_directive: str
    godebug: tuple[tuple[str, str], ...]
    staging_modules: tuple[str, ...]
    etcd_version: str


def kube_facts_from_gomod(version: str, gomod: Mapping[str, Any]) -> KubeModuleFacts:
    """Extract staging modules, go/godebug directives and the pinned etcd from ``go mod edit -json``."""
    staging = sorted(
        replace["Old"]["Path"]
        for replace in gomod.get("Replace") or []
        if str(replace.get("New", {}).get("Path", "")).startswith(_STAGING_PREFIX)
    )
    if not staging:
        raise BuildError(f"k8s.io/kubernetes {version}: go.mod has no staging replace directives")
    etcd = next(
        (req["Version"] for req in gomod.get("Require") or [] if req.get("Path") == ETCD_SERVER_MODULE),
        FALLBACK_ETCD_VERSION,
    )
    godebug = tuple((item["Key"], item["Value"]) for item in gomod.get("GoDebug") or [])
    return KubeModuleFacts(
        version=version,
        go_directive=str(gomod.get("Go") or "1.25.0"),
        godebug=godebug,
        staging_modules=tuple(staging),
        etcd_version=etcd,
    )


def render_kube_gomod(facts: KubeModuleFacts) -> str:
    """The wrapper go.mod for Kubernetes (before ``go mod tidy`` adds the indirect requirements)."""
    staged = staging_version(facts.version)
    width = max(len(module) for module in facts.staging_modules)
    lines = [
        "// Generated by python -m e2e.build; do not edit.",
        "module vramguard/e2e/k8s/kubernetes",
        "",
        f"go {facts.go_directive}",
        "",
    ]
    for key, value in facts.godebug:
        lines += [f"godebug {key}={value}", ""]
    lines += [f"require {KUBE_MODULE} {facts.version}", "", "replace ("]
    lines += [f"\t{module:<{width}} => {module} {staged}" for module in facts.staging_modules]
    lines += [")", ""]
    return "\n".join(lines)


def render_etcd_gomod(etcd_version: str, go_directive: str) -> str:
    """The wrapper go.mod for etcd (its own replace directives point at sibling directories)."""
    return "\n".join(
        [
            "// Generated by python -m e2e.build; do not edit.",
            "module vramguard/e2e/k8s/etcd",
            "",
            f"go {go_directive}",
            "",
            f"require {ETCD_SERVER_MODULE} {etcd_version}",
            "",
        ]
    )


def version_ldflags(version: str, build_date: str) -> list[str]:
    """``-X`` flags that make ``/version`` and ``kubectl version`` report the real release.

    Mirrors hack/lib/version.sh: the same variables are set in k8s.io/client-go/pkg/version and
    k8s.io/component-base/version. The git commit is not known from the module proxy, so it is
    left at its upstream default, as in builds from a source archive.
    """
    parsed = Semver.parse(version)
    values = {
        "gitVersion": version,
        "gitMajor": str(parsed.major),
        "gitMinor": str(parsed.minor),
        "buildDate": build_date,
    }
    flags = []
    for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in values.items()]
    return flags


# --------------------------------------------------------------------------- cache layout


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/vramguard/k8s`` (``~/.cache/vramguard/k8s`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vramguard" / "k8s"


@dataclass(frozen=True)
class Binaries:
    """Paths of one built control plane."""

    version: str
    directory: Path

    @property
    def etcd(self) -> Path:
        """The etcd server binary."""
        return self.directory / ETCD_COMMAND

    @property
    def kube_apiserver(self) -> Path:
        """The kube-apiserver binary."""
        return self.directory / "kube-apiserver"

    @property
    def kube_scheduler(self) -> Path:
        """The kube-scheduler binary."""
        return self.directory / "kube-scheduler"

    @property
    def kube_controller_manager(self) -> Path:
        """The kube-controller-manager binary (resource-claim controller and garbage collector)."""
        return self.directory / "kube-controller-manager"

    def complete(self) -> bool:
        """True when every binary exists and is executable."""
        return all(path.is_file() and os.access(path, os.X_OK) for path in (self.directory / name for name in BINARIES))

    def info(self) -> dict[str, Any]:
        """The build record written next to the binaries (empty if absent)."""
        path = self.directory / BUILD_INFO
        if not path.is_file():
            return {}
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded


def cached_versions(root: Path | None = None) -> list[str]:
    """Versions with a complete set of binaries in the cache, oldest first."""
    root = root or cache_root()
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            try:
                version = Semver.parse(entry.name)
            except BuildError:
                continue
            if Binaries(str(version), entry).complete():
                found.append(version)
    return [str(version) for version in sorted(found)]


def resolve_version(requested: str | None = None, *, root: Path | None = None) -> str:
    """Resolve the Kubernetes version to use.

    Precedence: ``requested`` (``--version``), then ``$KUBE_VERSION``, then 1.35. A minor such as
    ``1.36`` means its newest release on the module proxy; when the proxy cannot be reached the
    newest cached build of that minor is used instead.
    """
    wanted = requested or os.environ.get(KUBE_VERSION_ENV) or DEFAULT_KUBE_MINOR
    if not _is_minor_only(wanted):
        return pick_version(wanted, [])
    try:
        available = list_module_versions(KUBE_MODULE)
    except BuildError as error:
        cached = cached_versions(root)
        try:
            return pick_version(wanted, cached)
        except BuildError:
            raise BuildError(f"cannot list Kubernetes versions and none cached: {error}") from error
    return pick_version(wanted, available)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- build


def _write_module(directory: Path, gomod: str, tools_source: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "go.mod").write_text(gomod)
    shutil.copyfile(tools_source, directory / "tools.go")
    stale_sum = directory / "go.sum"
    if stale_sum.exists():
        stale_sum.unlink()


def _go_build(module_dir: Path, output: str, packages: Sequence[str], ldflags: Sequence[str]) -> None:
    """``go build``; ``output`` is a file, or a directory when it ends with a path separator."""
    flags = " ".join(["-s", "-w", *ldflags])
    run_go(
        ["build", "-trimpath", "-ldflags", flags, "-o", output, *packages],
        cwd=module_dir,
        # The upstream release builds link these commands statically (hack/lib/golang.sh).
        env={"CGO_ENABLED": "0"},
    )


def ensure_built(
    version: str | None = None,
    *,
    root: Path | None = None,
    force: bool = False,
    log: Log = _stderr,
) -> Binaries:
    """Return the binaries for ``version``, building whatever is missing.

    ``version`` follows :func:`resolve_version`. Concurrent callers serialise on a lock file, so
    two test sessions starting together build once.
    """
    root = root or cache_root()
    resolved = resolve_version(version, root=root)
    binaries = Binaries(resolved, root / resolved)
    if binaries.complete() and not force:
        return binaries
    with _locked(root / f"{resolved}.lock"):
        if binaries.complete() and not force:
            return binaries
        _build(binaries, log)
    return binaries


def _build(binaries: Binaries, log: Log) -> None:
    version = binaries.version
    started = time.monotonic()
    log(f"e2e.build: building the Kubernetes {version} control plane into {binaries.directory}")
    kube = download_module(KUBE_MODULE, version)
    facts = kube_facts_from_gomod(version, read_gomod_json(Path(kube["GoMod"])))
    # The release's publication time: a real date that stays the same on every rebuild.
    build_date = str(json.loads(Path(kube["Info"]).read_text()).get("Time", "1970-01-01T00:00:00Z"))

    source = binaries.directory / "src"
    kube_dir, etcd_dir = source / "kubernetes", source / "etcd"
    _write_module(kube_dir, render_kube_gomod(facts), WRAPPER_SOURCES / "kubernetes" / "tools.go")
    _write_module(
        etcd_dir,
        render_etcd_gomod(facts.etcd_version, facts.go_directive),
        WRAPPER_SOURCES / "etcd" / "tools.go",
    )

    staging = binaries.directory / ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    timings: dict[str, float] = {}

    step = time.monotonic()
    log(f"e2e.build: resolving modules (go mod tidy) for k8s.io/kubernetes {version}")
    run_go(["mod", "tidy"], cwd=kube_dir)
    log(f"e2e.build: resolving modules (go mod tidy) for etcd {facts.etcd_version}")
    run_go(["mod", "tidy"], cwd=etcd_dir)
    timings["resolve_s"] = round(time.monotonic() - step, 1)

    step = time.monotonic()
    log(f"e2e.build: go build {', '.join(KUBE_COMMANDS)} (the slow part: many minutes on a cold cache)")
    _go_build(
        kube_dir,
        f"{staging}{os.sep}",
        [f"{KUBE_MODULE}/cmd/{command}" for command in KUBE_COMMANDS],
        version_ldflags(version, build_date),
    )
    timings["kube_s"] = round(time.monotonic() - step, 1)

    step = time.monotonic()
    log(f"e2e.build: go build etcd {facts.etcd_version}")
    _go_build(etcd_dir, str(staging / ETCD_COMMAND), [ETCD_SERVER_MODULE], [])
    timings["etcd_s"] = round(time.monotonic() - step, 1)

    for name in BINARIES:
        (staging / name).replace(binaries.directory / name)
    shutil.rmtree(staging, ignore_errors=True)
    timings["total_s"] = round(time.monotonic() - started, 1)
    record = {
        "kubernetes": version,
        "etcd": facts.etcd_version,
        "staging": staging_version(version),
        "go": run_go(["env", "GOVERSION"], cwd=binaries.directory).strip(),
        "build_date": build_date,
        "timings": timings,
    }
    (binaries.directory / BUILD_INFO).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    log(f"e2e.build: done in {timings['total_s']:.0f}s ({json.dumps(timings)})")


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: build (or find) the binaries and print their directory."""
    parser = argparse.ArgumentParser(prog="python -m e2e.build", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version",
        help=f"Kubernetes version or minor (default ${KUBE_VERSION_ENV} or {DEFAULT_KUBE_MINOR})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the binaries exist")
    parser.add_argument("--print-version", action="store_true", help="only resolve and print the version")
    args = parser.parse_args(argv)
    try:
        if args.print_version:
            print(resolve_version(args.version))
            return 0
        started = time.monotonic()
        binaries = ensure_built(args.version, force=args.force)
    except BuildError as error:
        _stderr(f"e2e.build: error: {error}")
        return 1
    elapsed = time.monotonic() - started
    _stderr(f"e2e.build: Kubernetes {binaries.version} ready in {elapsed:.1f}s")
    print(binaries.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
