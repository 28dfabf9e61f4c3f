"""The ``kubectl vram`` plugin for krew: per-platform archives and the krew manifest that names them.

``kubectl vram`` is vramguard's Python entry point, so an archive holds the vramguard package and its
locked runtime dependencies built for one platform (aiohttp, pydantic-core and orjson are compiled),
and a launcher, ``kubectl-vram``, that runs it with the host's Python 3.11 or later::

    python scripts/kubectl_plugin.py archive --platform linux/amd64 --platform linux/arm64 --out dist/krew
    python scripts/kubectl_plugin.py manifest --uri-base https://example.com/releases/v0.2.0 \\
        dist/krew/*.tar.gz > dist/krew/vram.yaml
    kubectl krew install --manifest dist/krew/vram.yaml --archive dist/krew/kubectl-vram_0.2.0_linux_amd64.tar.gz

``archive`` installs from ``requirements.lock`` with its hashes (wheels only, for the platform asked),
so the archive holds exactly what the image holds. ``manifest`` computes each archive's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = {"linux/amd64": "manylinux2014_x86_64", "linux/arm64": "manylinux2014_aarch64"}
"""The platforms archives are built for, with the wheel tag pip installs for each."""
ARCHIVE = re.compile(r"^kubectl-vram_(?P<version>[^_]+)_(?P<os>[a-z]+)_(?P<arch>[a-z0-9]+)\.tar\.gz$")
LAUNCHER = """#!/bin/sh
# kubectl vram: vramguard's per-GPU VRAM view, run with this archive's libraries.
here=$(dirname "$(readlink -f "$0")")
for python in python3.13 python3.12 python3.11 python3; do
    if command -v "$python" >/dev/null 2>&1 && "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        PYTHONPATH="$here/lib" exec "$python" -c \
            'import sys; from vramguard.cli.kubectl_vram import main; sys.exit(main())' "$@"
    fi
done
echo "kubectl vram: needs Python 3.11 or later on PATH" >&2
exit 1
"""


def version() -> str:
    """vramguard's version, from pyproject.toml."""
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if match is None:
        raise SystemExit("no version in pyproject.toml")
    return match[1]


def build_archive(platform: str, out: Path, pip: Sequence[str] = (sys.executable, "-m", "pip")) -> Path:
    """Build the archive for ``platform`` (``linux/amd64``) into ``out``; its path."""
    tag = PLATFORMS[platform]
    os_name, arch = platform.split("/")
    name = f"kubectl-vram_{version()}_{os_name}_{arch}.tar.gz"
    with tempfile.TemporaryDirectory() as scratch:
        stage = Path(scratch) / "kubectl-vram"
        lib = stage / "lib"
        common = [*pip, "install", "--quiet", "--no-compile", "--target", str(lib)]
        subprocess.run([*common, "--require-hashes", "--only-binary=:all:", "--platform", tag,
                        "--python-version", "3.11", "--implementation", "cp", "--no-deps",
                        "-r", str(ROOT / "requirements.lock")], check=True)
        shutil.rmtree(lib / "bin", ignore_errors=True)  # console scripts for this machine, not the plugin's
        subprocess.run([*common, "--no-deps", str(ROOT)], check=True)
        shutil.rmtree(lib / "bin", ignore_errors=True)
        launcher = stage / "kubectl-vram"
        launcher.write_text(LAUNCHER)
        launcher.chmod(0o755)
        shutil.copy(ROOT / "LICENSE", stage / "LICENSE")
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / name, "w:gz") as archive:
            archive.add(stage, arcname="kubectl-vram")
    return out / name


def manifest(archives: Sequence[Path], uri_base: str) -> dict[str, object]:
    """The krew ``Plugin`` manifest for ``archives`` (named as :func:`build_archive` names them),
    each downloaded from ``uri_base``."""
    platforms = []
    versions = set()
    for path in sorted(archives):
        match = ARCHIVE.match(path.name)
        if match is None:
            raise ValueError(f"{path.name} is not named kubectl-vram_<version>_<os>_<arch>.tar.gz")
        versions.add(match["version"])
        platforms.append({
            "selector": {"matchLabels": {"os": match["os"], "arch": match["arch"]}},
            "uri": f"{uri_base.rstrip('/')}/{path.name}",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "bin": "kubectl-vram/kubectl-vram",
        })
    if len(versions) != 1:
        raise ValueError(f"the archives are of {len(versions)} versions; give one version's")
    return {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "vram"},
        "spec": {
            "version": f"v{versions.pop()}",
            "shortDescription": "Per-GPU VRAM budgets and what each GPU pod holds",
            "description": (
                "Shows each GPU's VRAM budget, what pods known to be on it hold, the worst case vramguard's\n"
                "ledger holds for pods whose GPU is not known, and what each GPU pod holds and why, computed\n"
                "the way the vramguard scheduler extender does. Read-only. Needs Python 3.11 or later.\n"
            ),
            "caveats": "Run `kubectl vram nodes` and `kubectl vram pods`; it reads the cluster's vramguard policy.\n",
            "platforms": platforms,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``archive`` or ``manifest`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="scripts/kubectl_plugin.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("archive", help="build the plugin's archive for each platform")
    build.add_argument("--platform", action="append", choices=sorted(PLATFORMS), required=True)
    build.add_argument("--out", type=Path, default=ROOT / "dist" / "krew")
    write = sub.add_parser("manifest", help="print the krew manifest of the archives")
    write.add_argument("--uri-base", required=True, help="where the archives are downloaded from")
    write.add_argument("archives", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "archive":
        for platform in args.platform:
            print(build_archive(platform, args.out))
        return 0
    try:
        sys.stdout.write(yaml.safe_dump(manifest(args.archives, args.uri_base), sort_keys=False))
    except (OSError, ValueError) as exc:
        print(f"kubectl_plugin.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
