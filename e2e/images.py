"""Container images for real nodes, made here without a registry: OCI image archives that
``ctr images import`` loads into a node's containerd.

- **pause**, the sandbox image: ``build/pause/linux/pause.c`` of the Kubernetes release the
  harness builds (from the Go module cache), compiled ``gcc -Os -static``.
- **serving stand-ins**: Debian's ``busybox-static`` plus a ``vllm`` script that prints its
  arguments and the GPU variables it was given, then sleeps. Tagged as the published image
  (``vllm/vllm-openai:<tag>``, entrypoint ``vllm serve`` as there), so pods written as the serving
  project publishes them run unedited: the image is present, so the kubelet pulls nothing.

Archives are cached next to the control-plane binaries, keyed by the digest of what goes in.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e import build

BUSYBOX = Path("/bin/busybox")
PAUSE_IMAGE = "registry.k8s.io/pause:e2e"
VLLM_IMAGE = "docker.io/vllm/vllm-openai:v0.21.0"
"""The tag ``e2e.scenario.pinned_vllm_pod`` uses (written there as ``vllm/vllm-openai:v0.21.0``)."""
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
APPLETS = ("sh", "sleep", "env", "cat", "echo", "grep", "sort", "ls", "ps", "head", "true")

STAND_IN = """#!/bin/sh
# A stand-in for the serving engine: what it was asked to run and the GPU settings it was given.
echo "stand-in for: $(basename "$0") $*"
env | grep -E '^(NVIDIA_|CUDA_MPS_)' | sort
echo "ready"
exec sleep 2147483647
"""


class ImageError(RuntimeError):
    """An image could not be made (a missing compiler or busybox)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a layer: its content (or a symlink target) and mode."""

    content: bytes = b""
    mode: int = 0o644
    link: str | None = None


def layer(files: Mapping[str, FileEntry]) -> bytes:
    """An uncompressed layer tar of ``files`` (paths without a leading slash), reproducible."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directories = sorted({str(Path(path).parents[i]) for path in files for i in range(len(Path(path).parents) - 1)})
        for directory in directories:
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for path in sorted(files):
            entry = files[path]
            info = tarfile.TarInfo(path)
            info.mtime, info.mode = 0, entry.mode
            if entry.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, entry.link
                tar.addfile(info)
            else:
                info.size = len(entry.content)
                tar.addfile(info, io.BytesIO(entry.content))
    return buffer.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest, len(data)


def oci_archive(name: str, files: Mapping[str, FileEntry], entrypoint: Sequence[str], cmd: Sequence[str] = ()) -> bytes:
    """A one-layer OCI image archive named ``name`` (``io.containerd.image.name``), linux/amd64."""
    blobs: dict[str, bytes] = {}
    tar_bytes = layer(files)
    diff_id = "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
    layer_digest, layer_size = _blob(blobs, gzip.compress(tar_bytes, mtime=0))
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Cmd": list(cmd), "Env": [PATH_ENV]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    config_digest, config_size = _blob(blobs, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                   "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest,
                    "size": layer_size}],
    }
    manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
            "size": manifest_size, "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rpartition(":")[2]},
        }],
    }
    members = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
               "index.json": json.dumps(index, sort_keys=True).encode()}
    members.update({f"blobs/sha256/{digest.partition(':')[2]}": data for digest, data in blobs.items()})
    return layer({path: FileEntry(data) for path, data in members.items()})


def busybox_files() -> dict[str, FileEntry]:
    """busybox and the applets the stand-ins use."""
    if not BUSYBOX.is_file():
        raise ImageError(f"{BUSYBOX} is missing (Debian: apt-get install busybox-static)")
    files = {"bin/busybox": FileEntry(BUSYBOX.read_bytes(), 0o755)}
    files.update({f"bin/{applet}": FileEntry(link="busybox") for applet in APPLETS})
    files["tmp/.keep"] = FileEntry(b"")
    return files


@functools.cache
def vllm_stand_in(name: str = VLLM_IMAGE) -> bytes:
    """The vLLM stand-in image archive (made once per process: every node imports it)."""
    files = busybox_files()
    files["usr/local/bin/vllm"] = FileEntry(STAND_IN.encode(), 0o755)
    return oci_archive(name, files, ["vllm", "serve"])


def pause_binary(binaries: build.Binaries, work: Path) -> bytes:
    """pause, compiled from the Kubernetes release's own source."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ImageError("gcc is needed to build the pause image")
    module = build.download_module(build.KUBE_MODULE, binaries.version)
    source = Path(module["Dir"]) / "build" / "pause" / "linux" / "pause.c"
    work.mkdir(parents=True, exist_ok=True)
    output = work / "pause"
    subprocess.run([gcc, "-Os", "-static", "-o", str(output), str(source)], check=True, capture_output=True)
    subprocess.run(["strip", str(output)], check=False, capture_output=True)
    return output.read_bytes()


def pause_image(binaries: build.Binaries, work: Path) -> bytes:
    """The sandbox image archive."""
    return oci_archive(PAUSE_IMAGE, {"pause": FileEntry(pause_binary(binaries, work), 0o755)}, ["/pause"])


def kube_scheduler_image(binaries: build.Binaries) -> tuple[str, Path]:
    """``registry.k8s.io/kube-scheduler:<version>`` made from the binary the harness built (the image
    the chart's second scheduler runs), cached: its name and archive."""
    name = f"registry.k8s.io/kube-scheduler:{binaries.version}"
    path = binaries.directory / "images" / "kube-scheduler.tar"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        files = {"usr/local/bin/kube-scheduler": FileEntry(binaries.kube_scheduler.read_bytes(), 0o755),
                 "tmp/.keep": FileEntry(b"")}
        partial = path.with_suffix(".partial")
        partial.write_bytes(oci_archive(name, files, ["/usr/local/bin/kube-scheduler"]))
        partial.replace(path)
    return name, path


def archives(binaries: build.Binaries) -> dict[str, Path]:
    """Image name -> archive file, made once per Kubernetes version and busybox."""
    directory = binaries.directory / "images"
    directory.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    pause = directory / "pause.tar"
    if not pause.is_file():
        partial = directory / "pause.tar.partial"
        partial.write_bytes(pause_image(binaries, directory / "work"))
        partial.replace(pause)
    made[PAUSE_IMAGE] = pause
    stand_in = vllm_stand_in()
    path = directory / f"vllm-{hashlib.sha256(stand_in).hexdigest()[:12]}.tar"
    if not path.is_file():
        path.write_bytes(stand_in)
    made[VLLM_IMAGE] = path
    return made
