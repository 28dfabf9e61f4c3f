"""``vramguard agent``: the node agent (a DaemonSet on GPU nodes), or one reading with ``--once``.

The agent and its dependencies (pynvml, grpc, aiohttp, the Kubernetes client) are imported inside
the handler, for start-up time (see :mod:`vramguard.cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

from vramguard.cli.webhook import parse_listen
from vramguard.codecs import AGENT_REPORT_ANNOTATION
from vramguard.lease import DEFAULT_AGENT_NAMESPACE

_PROG = "vramguard agent"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_LISTEN = "0.0.0.0:9402"
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``agent`` sub-command."""
    parser = subparsers.add_parser(
        "agent",
        help=f"run the node agent: NVML + kubelet PodResources -> node annotation {AGENT_REPORT_ANNOTATION}",
        description=(
            "Every --interval seconds: read the GPUs through NVML, ask the kubelet's PodResources API which "
            f"container holds which device, and write the report to this Node's {AGENT_REPORT_ANNOTATION} annotation "
            "when it changed (at most every --min-write-interval seconds). Serves /healthz, /readyz and "
            "/metrics. A failing source (no NVML, no kubelet socket, a lost GPU) leaves the agent running; "
            "the report then says only what is known. With --once: take one reading, print it as JSON, exit."
        ),
    )
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                        help="this Node's name (default $NODE_NAME, set from spec.nodeName in the DaemonSet)")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"metrics and probes, plain HTTP (default {DEFAULT_LISTEN})")
    parser.add_argument("--podresources-socket", type=Path, default=Path(DEFAULT_SOCKET), metavar="PATH",
                        help=f"the kubelet's PodResources socket (default {DEFAULT_SOCKET})")
    parser.add_argument("--kubeconfig", type=Path, metavar="FILE",
                        help="kubeconfig (default: the in-cluster service account, then ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--interval", type=float, default=5.0, metavar="SECONDS",
                        help="seconds between readings (default 5)")
    parser.add_argument("--min-write-interval", type=float, default=10.0, metavar="SECONDS",
                        help="least seconds between two writes of the annotation (default 10)")
    parser.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE") or DEFAULT_AGENT_NAMESPACE,
                        help="namespace of the node's liveness Lease (default $POD_NAMESPACE, else "
                             f"{DEFAULT_AGENT_NAMESPACE}); the extender reads Leases there")
    parser.add_argument("--lease-duration", type=int, default=40, metavar="SECONDS",
                        help="leaseDurationSeconds: how long the report is trusted without a renewal (default 40; "
                             "at least twice --interval)")
    parser.add_argument("--host-pid", action="store_true",
                        help="the agent runs in the host's PID namespace (hostPID: true): attribute GPU processes "
                             "to pods through /proc/<pid>/cgroup, which measures foreign usage on shared GPUs")
    parser.add_argument("--proc-root", type=Path, default=Path("/proc"), metavar="PATH",
                        help="the host's /proc, read with --host-pid (default /proc)")
    parser.add_argument("--nvml-recording", type=Path, metavar="FILE",
                        help="replay a recorded NVML snapshot (JSON) instead of the real library; the file is "
                        "read again whenever it changes")
    parser.add_argument("--once", action="store_true",
                        help="take one reading (NVML, PodResources), print it as JSON and exit; writes nothing")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM (0), or print one reading with ``--once``; 1, 2 on failure to start."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agent.nvml import Nvml, PynvmlBackend  # noqa: PLC0415
    from agent.podresources import GrpcPodResources  # noqa: PLC0415
    from agent.recorded import RecordedNvml  # noqa: PLC0415

    if args.interval <= 0 or args.min_write_interval < 0:
        return _fail("--interval must be positive and --min-write-interval not negative", EXIT_USAGE)
    if args.lease_duration < 2 * args.interval:
        # One missed renewal must not make the report look stale.
        return _fail("--lease-duration must be at least twice --interval", EXIT_USAGE)
    if args.nvml_recording is not None and not args.nvml_recording.is_file():
        return _fail(f"--nvml-recording {args.nvml_recording}: no such file", EXIT_USAGE)
    nvml: Nvml = RecordedNvml(args.nvml_recording) if args.nvml_recording else PynvmlBackend()
    podresources = GrpcPodResources(args.podresources_socket)
    proc_root = args.proc_root if args.host_pid else None
    if args.once:
        print(json.dumps(_one_reading(nvml, podresources, proc_root), indent=2, sort_keys=True))
        return EXIT_OK

    from agent.main import AgentSettings  # noqa: PLC0415
    from agent.main import run as run_agent  # noqa: PLC0415
    from vramguard.io.kube import load_connection  # noqa: PLC0415

    if not args.node_name:
        return _fail("--node-name (or $NODE_NAME) is required", EXIT_USAGE)
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        connection = load_connection(str(args.kubeconfig) if args.kubeconfig else None, args.context)
    except Exception as exc:
        return _fail(f"cannot load the Kubernetes configuration: {exc}", EXIT_FAILED)
    settings = AgentSettings(
        args.node_name, host, port, nvml, podresources, connection, proc_root, args.interval, args.min_write_interval,
        lease_namespace=args.lease_namespace, holder=os.environ.get("POD_NAME", ""),
        lease_duration=args.lease_duration,
    )
    logging.getLogger("vramguard.agent").info(
        "node %s: reading every %gs, metrics on http://%s:%d, process attribution %s",
        args.node_name, args.interval, host, port, "on" if proc_root else "off (no --host-pid)",
    )
    try:
        asyncio.run(run_agent(settings))
    except OSError as exc:
        return _fail(f"cannot serve on {args.listen}: {exc}", EXIT_FAILED)
    return EXIT_OK


def _one_reading(nvml: Any, podresources: Any, proc_root: Path | None) -> dict[str, Any]:
    """One cycle without the API server: the snapshot, the kubelet's answer and the report."""
    from agent.nvml import NvmlUnavailable, take_snapshot  # noqa: PLC0415
    from agent.podresources import PodResourcesUnavailable  # noqa: PLC0415
    from agent.processes import owner_of  # noqa: PLC0415
    from agent.recorded import snapshot_to_json  # noqa: PLC0415
    from agent.report import build_view, owners_for, snapshot_pids  # noqa: PLC0415

    errors: dict[str, str] = {}
    snapshot = None
    try:
        nvml.init()
        try:
            snapshot = take_snapshot(nvml)
        finally:
            nvml.shutdown()
    except NvmlUnavailable as exc:
        errors["nvml"] = str(exc)
    try:
        pod_devices = podresources.list()
    except PodResourcesUnavailable as exc:
        errors["podresources"] = str(exc)
        pod_devices = None
    owners = owners_for(snapshot_pids(snapshot), partial(owner_of, proc_root=proc_root)) if proc_root else None
    # Without the API server pod UIDs are unknown: the report has devices but no placements.
    view = build_view(snapshot, pod_devices, None, owners)
    return {
        "snapshot": snapshot_to_json(snapshot) if snapshot is not None else None,
        "podresources": [
            {"namespace": p.namespace, "name": p.name,
             "containers": {c.name: {r: list(ids) for r, ids in c.devices} for c in p.containers}}
            for p in pod_devices or ()
        ] if pod_devices is not None else None,
        "report": view.report.to_json(),
        "foreign_bytes": dict(view.foreign),
        "notes": list(view.notes),
        "errors": errors,
    }


def _fail(message: str, code: int) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return code
