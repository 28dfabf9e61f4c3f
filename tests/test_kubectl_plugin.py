"""The krew packaging of ``kubectl vram``: the manifest names each platform's archive with its
sha256, and the launcher runs the plugin from the archive's libraries, called through a symlink as
krew installs it."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("kubectl_plugin", ROOT / "scripts" / "kubectl_plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kubectl_plugin = _load()


def test_the_manifest_names_each_platform_with_its_archives_sha256(tmp_path: Path) -> None:
    version = kubectl_plugin.version()
    archives = []
    for arch in ("amd64", "arm64"):
        path = tmp_path / f"kubectl-vram_{version}_linux_{arch}.tar.gz"
        path.write_bytes(arch.encode())
        archives.append(path)
    plugin = kubectl_plugin.manifest(archives, "https://example.com/v1/")
    assert (plugin["apiVersion"], plugin["kind"]) == ("krew.googlecontainertools.github.com/v1alpha2", "Plugin")
    spec = plugin["spec"]
    assert isinstance(spec, dict) and spec["version"] == f"v{version}"
    assert [(p["selector"]["matchLabels"]["arch"], p["uri"], p["sha256"], p["bin"]) for p in spec["platforms"]] == [
        (arch, f"https://example.com/v1/kubectl-vram_{version}_linux_{arch}.tar.gz",
         hashlib.sha256(arch.encode()).hexdigest(), "kubectl-vram/kubectl-vram")
        for arch in ("amd64", "arm64")
    ]


@pytest.mark.parametrize("name", ["vram.tar.gz", "kubectl-vram_1.0_linux.tar.gz"])
def test_archives_named_otherwise_are_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ValueError, match="is not named"):
        kubectl_plugin.manifest([tmp_path / name], "https://example.com")


def test_the_launcher_runs_the_plugin_from_its_libraries_through_a_symlink(tmp_path: Path) -> None:
    stage = tmp_path / "kubectl-vram"
    stage.mkdir()
    (stage / "lib").symlink_to(ROOT)  # the archive's lib/: the vramguard package (and its dependencies)
    launcher = stage / "kubectl-vram"
    launcher.write_text(kubectl_plugin.LAUNCHER)
    launcher.chmod(0o755)
    link = tmp_path / "bin" / "kubectl-vram"
    link.parent.mkdir()
    link.symlink_to(launcher)  # krew links the bin into its own bin directory
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    result = subprocess.run([str(link), "--help"], capture_output=True, text=True, env=env, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: kubectl vram" in result.stdout
