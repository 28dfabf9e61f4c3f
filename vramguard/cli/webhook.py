"""``vramguard webhook``: the validating admission webhook, served over HTTPS.

The service (``webhook``, ``vramguard.io``) and its dependencies (aiohttp, the Kubernetes client)
are imported inside the handler, for start-up time (see :mod:`vramguard.cli`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from vramguard.cli.watch_limit import add_max_watch_event_bytes
from vramguard.policy import PolicyError, PolicyFile, default_policy

__all__ = ["parse_listen", "register", "run"]

_PROG = "vramguard webhook"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_LISTEN = "0.0.0.0:8443"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``webhook`` sub-command."""
    parser = subparsers.add_parser(
        "webhook",
        help="serve the admission webhooks (POST /validate, /mutate) over HTTPS",
        description=(
            "Serve the validating webhook (/validate) for Pods, the pod templates of Deployments, StatefulSets, "
            "DaemonSets, ReplicaSets, Jobs, CronJobs and the policy's workload kinds, and DRA claims, and the "
            "mutating webhook (/mutate: routing, memory limits) for Pods, over HTTPS, with /healthz, /readyz "
            "and /metrics. "
            "It watches namespaces, nodes and pods; /readyz answers 200 once they are listed and TLS is loaded."
        ),
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_LISTEN}; [::]:8443 for IPv6)",
    )
    parser.add_argument("--tls-cert", required=True, type=Path, metavar="FILE", help="serving certificate (PEM)")
    parser.add_argument("--tls-key", required=True, type=Path, metavar="FILE", help="its private key (PEM)")
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="kubeconfig (default: the in-cluster service account, then $KUBECONFIG or ~/.kube/config)",
    )
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument(
        "--policy",
        type=Path,
        metavar="FILE",
        help="policy file, re-read when it changes (default: the built-in policy)",
    )
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, report not ready for this long before closing the listener (e.g. 5 in a cluster)",
    )
    parser.add_argument(
        "--quota-namespace",
        default=os.environ.get("POD_NAMESPACE") or "vramguard-system",
        metavar="NAMESPACE",
        help="namespace of the ConfigMaps vramguard-quota-<namespace> in which the replicas share the quotas' "
             "pending admissions (default $POD_NAMESPACE, else vramguard-system)",
    )
    add_max_watch_event_bytes(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(handler=run)


def parse_listen(text: str, option: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8443`` for IPv6) -> ``(host, port)``; raise ``ValueError`` saying why."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{option} {text!r}: expected HOST:PORT, e.g. 0.0.0.0:8443")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"{option} {text!r}: port {port} is outside 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{option} {text!r}: {host!r} is not an IPv6 address") from None
    if not host:
        raise ValueError(f"{option} {text!r}: the host is missing, e.g. 0.0.0.0:{port}")
    return host, port


def run(args: argparse.Namespace) -> int:
    """Start the webhook; return when it has shut down (0) or failed to start (1, 2)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # Imported here for start-up time (see vramguard.cli), not for layering.
    from vramguard.io import runtime  # noqa: PLC0415
    from vramguard.io.kube import MAX_EVENT_BYTES, load_connection  # noqa: PLC0415
    from vramguard.io.server import ServerSettings  # noqa: PLC0415
    from vramguard.io.supervise import TaskDied  # noqa: PLC0415
    from vramguard.io.tls import TLSLoadError, load_server_tls  # noqa: PLC0415
    from webhook.app import PolicySource  # noqa: PLC0415
    from webhook.main import WebhookSettings, describe_start, run_webhook  # noqa: PLC0415

    if args.drain_delay < 0:
        return _usage_error("--drain-delay must not be negative")
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        return _usage_error(str(exc))
    try:
        policy = PolicySource.from_file(PolicyFile(args.policy)) if args.policy else PolicySource(default_policy())
    except PolicyError as exc:
        return _failed(str(exc))
    try:
        tls = load_server_tls(args.tls_cert, args.tls_key)
    except TLSLoadError as exc:
        return _failed(str(exc))
    try:
        connection = load_connection(str(args.kubeconfig) if args.kubeconfig else None, args.context)
    except Exception as exc:  # the client's loaders raise many types; one line is enough
        return _failed(f"cannot load the Kubernetes configuration: {exc}")
    settings = WebhookSettings(
        host=host,
        port=port,
        tls=tls,
        connection=connection,
        policy=policy,
        server=ServerSettings(drain_delay=args.drain_delay),
        max_event_bytes=args.max_watch_event_bytes or MAX_EVENT_BYTES,
        quota_namespace=args.quota_namespace,
    )
    logging.getLogger("vramguard.webhook").info("%s", describe_start(settings, args.policy))
    try:
        runtime.run(run_webhook(settings))
    except OSError as exc:
        return _failed(f"cannot serve on {args.listen}: {exc}")
    except TaskDied as exc:
        return _failed(str(exc))
    return EXIT_OK


def _usage_error(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _failed(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return EXIT_FAILED
