"""The services' process memory and time to ready on the real control plane, fed by their informers.

    python -m bench.restart [--nodes 5000] [--pods 50000] [--work-dir DIR] [--python PY ...]
                            [--service extender|webhook ...]

Starts the e2e control plane (``e2e.cluster``, without vramguard's own services), creates the
nodes and bound pods of ``bench.cluster_model`` (1,009 templates), then, for each interpreter in
``--python`` (each with its own ``vramguard`` installed: compare two checkouts on one cluster, the
runs alternated), starts ``vramguard extender``, then ``vramguard webhook`` (which watches every live
pod: the same 50,000), and reads the resident memory of each (``VmRSS`` from ``/proc``, no profiler):

- ``first_list``: after it is first ready (and the seconds to ``/readyz``);
- ``relist``: after a re-list of the pods, forced by an oversized watch event (the services run
  with ``--max-watch-event-bytes 65536`` and one pod gets a 100 KB annotation);
- ``scrapes``: the most seen while ``/metrics`` is scraped five times;
- ``restart``: after a SIGKILL and a new start (and the seconds to ``/readyz``).

``peak`` is the process's ``VmHWM`` at each point. Prints one JSON line per service and run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cluster_model import ClusterModel

JSON = dict[str, Any]
MIB = 1 << 20
MAX_EVENT_BYTES = 65536
READY_TIMEOUT_S = 600.0
RUN_CLI = "import sys; from vramguard.cli import main; sys.exit(main(sys.argv[1:]))"


def creatable(obj: JSON) -> JSON:
    """What may be sent to create a copy of a listed object: no server-set fields, no owners (the
    garbage collector would delete pods whose ReplicaSet does not exist), no service account."""
    metadata = obj["metadata"]
    kept: JSON = {k: metadata[k] for k in ("name", "namespace", "labels", "annotations") if k in metadata}
    spec = {k: v for k, v in (obj.get("spec") or {}).items() if k not in ("serviceAccountName", "serviceAccount")}
    spec["automountServiceAccountToken"] = False
    # The service account token's projected volume needs a service account: left out, with its mounts.
    projected = {v.get("name") for v in spec.get("volumes") or () if "projected" in v}
    if projected:
        spec["volumes"] = [v for v in spec["volumes"] if v.get("name") not in projected]
        spec["containers"] = [
            {**c, "volumeMounts": [m for m in c.get("volumeMounts") or () if m.get("name") not in projected]}
            for c in spec.get("containers") or ()
        ]
    return {"apiVersion": "v1", "kind": obj.get("kind", ""), "metadata": kept, "spec": spec}


async def populate(kubeconfig: Path, model: ClusterModel) -> None:
    """Create the model's namespaces, nodes (with their status) and bound pods."""
    from vramguard.io.kube import KubeClient, load_connection  # noqa: PLC0415

    client = KubeClient(load_connection(str(kubeconfig)))
    limit = asyncio.Semaphore(48)

    async def bounded(call: Any) -> Any:
        async with limit:
            return await call

    async def create_node(node: JSON) -> None:
        body = creatable(node)
        body["spec"] = {}
        await client.create("/api/v1/nodes", body)
        name = node["metadata"]["name"]
        await client.request("PUT", f"/api/v1/nodes/{name}/status", {**body, "status": node["status"]})

    try:
        for namespace in model.namespaces():
            await client.create("/api/v1/namespaces", {"metadata": namespace["metadata"]})
        await asyncio.gather(*(bounded(create_node(node)) for node in model.node_objects()))
        print("nodes created", file=sys.stderr, flush=True)
        batch: list[Any] = []
        created = 0
        for pod in model.pod_objects():
            body = creatable({**pod, "kind": "Pod"})
            batch.append(bounded(client.create(f"/api/v1/namespaces/{body['metadata']['namespace']}/pods", body)))
            if len(batch) == 2000:
                await asyncio.gather(*batch)
                created += len(batch)
                batch = []
                print(f"{created} pods created", file=sys.stderr, flush=True)
        await asyncio.gather(*batch)
    finally:
        await client.close()


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


# The webhook serves HTTPS only; its certificate is the bench's own, on loopback.
UNVERIFIED = ssl.create_default_context()
UNVERIFIED.check_hostname = False
UNVERIFIED.verify_mode = ssl.CERT_NONE


def fetch(url: str) -> tuple[int, bytes]:
    """Status and body of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=60, context=UNVERIFIED) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except OSError:
        return 0, b""


class Service:
    """One ``vramguard extender`` (plain HTTP on loopback, no leader election) or ``vramguard
    webhook`` (HTTPS with ``tls``, a certificate and key) process."""

    def __init__(self, python: str, kind: str, kubeconfig: Path, log: Path, tls: tuple[Path, Path]) -> None:
        self.kind = kind
        common = ["--kubeconfig", str(kubeconfig), "--max-watch-event-bytes", str(MAX_EVENT_BYTES)]
        if kind == "extender":
            self.ops = f"http://127.0.0.1:{free_port()}"
            argv = [python, "-c", RUN_CLI, "extender", "--insecure-http",
                    "--listen", f"127.0.0.1:{free_port()}", "--ops-listen", self.ops.removeprefix("http://"),
                    "--leader-elect", "false", *common]
        else:
            self.ops = f"https://127.0.0.1:{free_port()}"
            argv = [python, "-c", RUN_CLI, "webhook", "--listen", self.ops.removeprefix("https://"),
                    "--tls-cert", str(tls[0]), "--tls-key", str(tls[1]), *common]
        self.started = time.monotonic()
        # Run from the log's folder: ``-c`` puts the working directory first on the import path, and
        # a checkout there would shadow the interpreter's own vramguard.
        self.process = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=log.parent)

    def wait_ready(self) -> float:
        """Seconds from the start to the first 200 of ``/readyz``."""
        while fetch(f"{self.ops}/readyz")[0] != 200:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.kind} exited with {self.process.returncode}")
            if time.monotonic() - self.started > READY_TIMEOUT_S:
                raise RuntimeError(f"the {self.kind} did not become ready")
            time.sleep(0.1)
        return time.monotonic() - self.started

    def memory(self) -> JSON:
        status = proc_status(self.process.pid)
        return {"rss_mib": round(status["VmRSS"] / MIB, 1), "peak_mib": round(status["VmHWM"] / MIB, 1)}

    def metric(self, name: str) -> float | None:
        """The sum of the series whose line starts with ``name``; None when there is none."""
        _, body = fetch(f"{self.ops}/metrics")
        total = None
        for line in body.decode().splitlines():
            if line.startswith(name):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


def wait_for(probe: Callable[[], bool], what: str) -> None:
    """Poll ``probe`` until it is true; fail after :data:`READY_TIMEOUT_S`."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen in {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


def settle() -> None:
    """Let the event loop finish what the list started (the first filters' caches are not warmed)."""
    time.sleep(3.0)


LISTS = 'vramguard_watch_lists_total{resource="pods"}'
OVERSIZED = 'vramguard_watch_restarts_total{reason="oversized",resource="pods"}'
OLD_RELIST_WAIT_S = 30.0
"""A webhook that counts no lists (releases before ``vramguard_watch_lists_total``) is given this
long to re-list."""


def measure(python: str, kind: str, kubeconfig: Path, pod_path: str, work_dir: Path, pods: int) -> JSON:
    """The four states of one service build (see the module docstring)."""
    log = work_dir / f"{kind}-{abs(hash(python))}.log"
    where = subprocess.run([python, "-c", "import vramguard; print(vramguard.__file__)"], cwd=work_dir,
                           capture_output=True, text=True, check=True).stdout.strip()
    result: JSON = {"service": kind, "python": python, "vramguard": where, "pods": pods}
    tls = serving_files(work_dir)
    service = Service(python, kind, kubeconfig, log, tls)
    try:
        result["first_ready_s"] = round(service.wait_ready(), 1)
        settle()
        result["first_list"] = service.memory()
        # An oversized watch event forces a re-list of the pods.
        before = service.metric(OVERSIZED) or 0.0
        lists = service.metric(LISTS)
        # A new value each time: an unchanged annotation makes no watch event.
        asyncio.run(annotate(kubeconfig, pod_path, f"{time.time()}" + "x" * (2 * MAX_EVENT_BYTES)))
        started = time.monotonic()
        wait_for(lambda: (service.metric(OVERSIZED) or 0.0) > before, "the oversized event")
        if lists is not None:
            wait_for(lambda: (service.metric(LISTS) or 0.0) > lists, "the re-list")
        elif kind == "extender":
            wait_for(lambda: service.metric("vramguard_nodes_held_back") == 0, "the re-list")
        else:
            time.sleep(OLD_RELIST_WAIT_S)
        result["relist_s"] = round(time.monotonic() - started, 1)
        settle()
        result["relist"] = service.memory()
        most = 0.0
        for _ in range(5):
            fetch(f"{service.ops}/metrics")
            most = max(most, service.memory()["rss_mib"])
        result["scrapes"] = {"rss_mib_max": most, "peak_mib": service.memory()["peak_mib"]}
        service.kill()
        service = Service(python, kind, kubeconfig, log, tls)
        result["restart_ready_s"] = round(service.wait_ready(), 1)
        settle()
        result["restart"] = service.memory()
    finally:
        if service.process.poll() is None:
            service.kill()
    return result


def serving_files(work_dir: Path) -> tuple[Path, Path]:
    """A certificate and key for the webhook on loopback (made once per work folder)."""
    from vramguard.io import certs  # noqa: PLC0415

    cert, key = work_dir / "webhook.crt", work_dir / "webhook.key"
    if not cert.exists():
        leaf = certs.issue_serving_certificate(certs.create_ca("bench CA"), dns_names=["localhost"],
                                               ip_addresses=["127.0.0.1"])
        key.write_bytes(leaf.key_pem())
        cert.write_bytes(leaf.cert_pem())
    return cert, key


async def annotate(kubeconfig: Path, pod_path: str, value: str) -> None:
    """Set one annotation of a pod (a large one makes its watch event oversized)."""
    from vramguard.io.kube import KubeClient, load_connection  # noqa: PLC0415

    async with KubeClient(load_connection(str(kubeconfig))) as client:
        await client.patch(pod_path, {"metadata": {"annotations": {"bench.vramguard.io/blob": value}}})


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=50000)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--python", action="append", default=None,
                        help="interpreter whose vramguard to measure (repeatable; default: this one)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each interpreter, alternated")
    parser.add_argument("--service", action="append", choices=("extender", "webhook"), default=None,
                        help="service to measure (repeatable; default: both)")
    args = parser.parse_args(argv)
    from e2e.cluster import Cluster  # noqa: PLC0415

    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="vramguard-restart-"))
    model = ClusterModel(args.nodes, args.pods)
    first = next(iter(model.pod_objects()))["metadata"]
    with Cluster.up(work_dir / "cluster", vramguard="off") as cluster:
        started = time.monotonic()
        asyncio.run(populate(cluster.kubeconfig, model))
        print(json.dumps({"bench": "restart", "phase": "populate", "nodes": args.nodes, "pods": args.pods,
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)
        pod_path = f"/api/v1/namespaces/{first['namespace']}/pods/{first['name']}"
        for _ in range(args.repeats):
            for python in args.python or [sys.executable]:
                for kind in args.service or ["extender", "webhook"]:
                    record = measure(python, kind, cluster.kubeconfig, pod_path, work_dir, args.pods)
                    print(json.dumps({"bench": "restart", "nodes": args.nodes, **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
