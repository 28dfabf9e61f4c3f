"""Which pod and container a GPU process belongs to, from its cgroup.

NVML reports PIDs of the host's PID namespace. They mean something to the agent only when it
runs in that namespace (``hostPID: true``) and reads the host's ``/proc``; otherwise
``/proc/<pid>`` is absent or, worse, another process of the agent's own namespace. So attribution
is opt-in (``vramguard agent --host-pid``), never guessed.

The kubelet puts every container in a cgroup whose path names the pod UID and the container ID:

- cgroupfs driver: ``/kubepods/burstable/pod<uid>/<container id>``
- systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/
  cri-containerd-<container id>.scope`` (``crio-``, ``docker-`` for other runtimes)

cgroup v1 lists one line per hierarchy, v2 a single ``0::`` line; any line naming a pod will do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcessOwner", "container_id_of_status", "owner_of", "parse_cgroup"]

_POD = re.compile(r"pod(?P<uid>[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER = re.compile(r"^(?:[a-z-]+-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True, slots=True)
class ProcessOwner:
    """The pod (and, when the path shows it, the container) a process runs in."""

    pod_uid: str
    container_id: str | None


def parse_cgroup(text: str) -> ProcessOwner | None:
    """The owner named by a ``/proc/<pid>/cgroup`` file; ``None`` for a process outside any pod."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _POD.search(path)
        if match is None:
            continue
        container = None
        last = path.rstrip("/").rsplit("/", 1)[-1]
        found = _CONTAINER.match(last)
        if found is not None:
            container = found["id"]
        return ProcessOwner(match["uid"].replace("_", "-"), container)
    return None


def owner_of(pid: int, proc_root: Path) -> ProcessOwner | None:
    """The pod of host process ``pid``, read under ``proc_root``; ``None`` when none or it is gone."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        # Exited between NVML's answer and this read, or not visible from here.
        return None
    return parse_cgroup(text)


def container_id_of_status(container_id: str) -> str:
    """``containerd://<id>`` (a pod status's ``containerID``) -> ``<id>``."""
    return container_id.rpartition("://")[2]
