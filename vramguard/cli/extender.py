"""``vramguard extender``: the kube-scheduler extender (filter / prioritize / bind) over HTTPS.

The service and its dependencies are imported inside the handler, so ``vramguard`` stays
importable without aiohttp or the Kubernetes client.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from vramguard.cli.watch_limit import add_max_watch_event_bytes
from vramguard.cli.webhook import parse_listen

_PROG = "vramguard extender"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_LISTEN = "127.0.0.1:8888"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``extender`` sub-command."""
    parser = subparsers.add_parser(
        "extender",
        help="serve the kube-scheduler extender (POST /filter, /prioritize, /bind)",
        description=(
            "Keep a VRAM ledger per physical GPU from the API server (Nodes, Namespaces, bound Pods) and "
            "answer kube-scheduler's filter, prioritize and bind calls, with /healthz, /readyz and /metrics. "
            "/readyz answers 200 once the caches are synced and TLS is loaded."
        ),
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to listen on (default {DEFAULT_LISTEN}: the scheduler runs beside it)")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="serving certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key (PEM)")
    parser.add_argument("--insecure-http", action="store_true",
                        help="serve plain HTTP without --tls-cert/--tls-key (only on a loopback address)")
    parser.add_argument("--kubeconfig", type=Path, metavar="FILE",
                        help="kubeconfig (default: the in-cluster service account, then ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--policy", type=Path, metavar="FILE",
                        help="policy file, re-read when it changes (default: the built-in policy)")
    parser.add_argument("--drain-delay", type=float, default=0.0, metavar="SECONDS",
                        help="on SIGTERM, report not ready for this long before closing the listener")
    add_max_watch_event_bytes(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Start the extender; return when it has shut down (0) or failed to start (1, 2)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from extender.main import ExtenderSettings  # noqa: PLC0415
    from extender.main import run as run_extender  # noqa: PLC0415
    from service.kube import MAX_EVENT_BYTES, load_connection  # noqa: PLC0415
    from service.server import ServerSettings  # noqa: PLC0415
    from service.supervise import TaskDied  # noqa: PLC0415
    from service.tls import TLSLoadError, load_server_tls  # noqa: PLC0415
    from vramguard.policy import PolicyError, PolicyFile  # noqa: PLC0415

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.drain_delay < 0:
        return _fail("--drain-delay must not be negative", EXIT_USAGE)
    if (args.tls_cert is None) != (args.tls_key is None):
        return _fail("--tls-cert and --tls-key go together", EXIT_USAGE)
    if args.tls_cert is None and not (args.insecure_http and host in ("127.0.0.1", "::1", "localhost")):
        return _fail("serving needs --tls-cert and --tls-key (or --insecure-http on a loopback address)", EXIT_USAGE)
    try:
        policy_file = PolicyFile(args.policy) if args.policy else None
        tls = load_server_tls(args.tls_cert, args.tls_key) if args.tls_cert else None
        connection = load_connection(str(args.kubeconfig) if args.kubeconfig else None, args.context)
    except (PolicyError, TLSLoadError) as exc:
        return _fail(str(exc), EXIT_FAILED)
    except Exception as exc:
        return _fail(f"cannot load the Kubernetes configuration: {exc}", EXIT_FAILED)
    settings = ExtenderSettings(host, port, tls, connection, policy_file, ServerSettings(drain_delay=args.drain_delay),
                                max_event_bytes=args.max_watch_event_bytes or MAX_EVENT_BYTES)
    logging.getLogger("vramguard.extender").info(
        "serving on %s://%s:%d, policy %s", "https" if tls else "http", host, port, args.policy or "(built-in)"
    )
    try:
        asyncio.run(run_extender(settings))
    except OSError as exc:
        return _fail(f"cannot serve on {args.listen}: {exc}", EXIT_FAILED)
    except TaskDied as exc:
        return _fail(str(exc), EXIT_FAILED)
    return EXIT_OK


def _fail(message: str, code: int) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return code
