"""Running the vramguard services as containers of the built image, wired as the manifests wire them.

The harness normally starts ``vramguard extender`` and ``vramguard webhook`` as local processes.
With an image (``ClusterConfig.image``, or ``VRAMGUARD_IMAGE`` for the image tests) each service
runs instead as::

    podman run --rm --network host --read-only --tmpfs /tmp --user 65532:65532 --cap-drop ALL \
        --security-opt no-new-privileges -v TLS_DIR:/etc/vramguard/tls:ro \
        -v POLICY_DIR:/etc/vramguard/policy:ro -v KUBECONFIG_DIR:/etc/vramguard/kubeconfig:ro \
        IMAGE <the args of the shipped Deployment's container>

as the chart's securityContext runs it (non-root, no capabilities, read-only root, /tmp an
emptyDir). The arguments are read from the shipped manifests (``manifests/base/scheduler.yaml``
for the extender sidecar, ``manifests/webhook/deployment.yaml`` for the webhook); only the
listen addresses move to free ports on 127.0.0.1 (host network), and ``--kubeconfig`` stands in
for the ServiceAccount token a pod would get. The TLS directory holds what the Secret holds
(``tls.crt``, ``tls.key``, ``ca.crt``), the policy directory what the ConfigMap projects
(``policy.yaml``), with the modes a kubelet gives them (0644).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from e2e import services

IMAGE_ENV = "VRAMGUARD_IMAGE"
ENGINE_ENV = "VRAMGUARD_CONTAINER_ENGINE"
TLS_MOUNT = "/etc/vramguard/tls"
POLICY_MOUNT = "/etc/vramguard/policy"
KUBECONFIG_MOUNT = "/etc/vramguard/kubeconfig"
# The shipped Deployment (file under manifests/, Deployment name) whose container runs each service.
SERVICE_DEPLOYMENTS: dict[services.ServiceName, tuple[str, str]] = {
    "extender": ("base/scheduler.yaml", "vramguard-scheduler"),
    "webhook": ("webhook/deployment.yaml", "vramguard-webhook"),
}


def engine() -> str:
    """The container engine the harness runs images with (``$VRAMGUARD_CONTAINER_ENGINE``, else podman)."""
    return os.environ.get(ENGINE_ENV) or "podman"


def image_from_environment() -> str | None:
    """The image to test (``$VRAMGUARD_IMAGE``), or None when unset."""
    return os.environ.get(IMAGE_ENV) or None


def image_present(image: str) -> bool:
    """True if the engine is installed and has ``image`` locally."""
    if shutil.which(engine()) is None:
        return False
    result = subprocess.run([engine(), "image", "inspect", image], capture_output=True, timeout=60, check=False)
    return result.returncode == 0


def help_command(image: str) -> list[str]:
    """A command that runs ``vramguard`` from ``image`` (for ``<service> --help``), without network."""
    return [engine(), "run", "--rm", "--network", "none", image]


def shipped_container(service: services.ServiceName, root: Path = services.MANIFESTS) -> dict[str, Any]:
    """The container spec of ``service`` in its shipped Deployment."""
    relative, name = SERVICE_DEPLOYMENTS[service]
    for obj in yaml.safe_load_all((root / relative).read_text()):
        if isinstance(obj, dict) and obj.get("kind") == "Deployment" and obj["metadata"]["name"] == name:
            for container in obj["spec"]["template"]["spec"]["containers"]:
                if (container.get("args") or [None])[0] == service:
                    return dict(container)
    raise ValueError(f"{root / relative}: no Deployment {name} with a container running `vramguard {service}`")


def container_name(service: services.ServiceName, directory: Path) -> str:
    """A container name unique to the cluster directory (several clusters may run side by side)."""
    return f"vramguard-e2e-{service}-{hashlib.sha256(str(directory).encode()).hexdigest()[:10]}"


def _publish(directory: Path, files: dict[str, Path]) -> Path:
    """Copy ``files`` (name in the mount -> source) into ``directory``, readable as a kubelet
    projects a Secret or ConfigMap (0644), so the non-root user of the container reads them."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    for name, source in files.items():
        target = directory / name
        shutil.copyfile(source, target)
        target.chmod(0o644)
    return directory


def run_argv(
    image: str,
    service: services.ServiceName,
    *,
    name: str,
    state_dir: Path,
    port: int,
    ops_port: int | None,
    tls: tuple[Path, Path],
    ca_cert: Path,
    kubeconfig: Path,
    policy: Path,
    root: Path = services.MANIFESTS,
) -> list[str]:
    """The ``podman run`` command line that starts ``service`` from ``image`` as shipped (see the module)."""
    container = shipped_container(service, root)
    tls_dir = _publish(state_dir / "tls", {"tls.crt": tls[0], "tls.key": tls[1], "ca.crt": ca_cert})
    policy_dir = _publish(state_dir / "policy", {"policy.yaml": policy})
    kubeconfig_dir = _publish(state_dir / "kubeconfig", {"kubeconfig": kubeconfig})
    args = list(container["args"])
    addresses = {"--listen": f"127.0.0.1:{port}"}
    if ops_port is not None:
        addresses["--ops-listen"] = f"127.0.0.1:{ops_port}"
    args = [_relisten(arg, addresses) for arg in args]
    if not any(arg.startswith("--policy") for arg in args):
        # The webhook's manifest documents mounting the policy ConfigMap and adding this flag.
        args.append(f"--policy={POLICY_MOUNT}/policy.yaml")
    args.append(f"--kubeconfig={KUBECONFIG_MOUNT}/kubeconfig")
    argv = [
        engine(),
        "run",
        "--rm",
        f"--name={name}",
        "--network=host",
        "--read-only",
        "--tmpfs=/tmp:size=64m",
        "--user=65532:65532",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        f"--volume={tls_dir}:{TLS_MOUNT}:ro",
        f"--volume={policy_dir}:{POLICY_MOUNT}:ro",
        f"--volume={kubeconfig_dir}:{KUBECONFIG_MOUNT}:ro",
    ]
    if engine() == "podman":
        # A restart after a crash reuses the name of a container that may still be going away.
        argv.append("--replace")
    return [*argv, image, *args]


def _relisten(arg: str, addresses: dict[str, str]) -> str:
    flag, _, _ = arg.partition("=")
    return f"{flag}={addresses[flag]}" if flag in addresses else arg


def remove(names: Sequence[str]) -> None:
    """Remove containers left behind (their ``podman run`` was killed before it could clean up)."""
    if names:
        subprocess.run([engine(), "rm", "--force", *names], capture_output=True, timeout=120, check=False)


def inspect(name: str) -> dict[str, Any]:
    """``podman inspect`` of a running container."""
    result = subprocess.run([engine(), "inspect", name], capture_output=True, text=True, timeout=60, check=True)
    inspected: list[dict[str, Any]] = json.loads(result.stdout)
    return inspected[0]


def main_process_status(name: str) -> dict[str, str]:
    """``/proc/1/status`` of a running container (the service itself), as field -> value."""
    result = subprocess.run(
        [engine(), "exec", name, "cat", "/proc/1/status"], capture_output=True, text=True, timeout=60, check=True
    )
    fields = (line.partition(":") for line in result.stdout.splitlines())
    return {key: value.strip() for key, _, value in fields}
