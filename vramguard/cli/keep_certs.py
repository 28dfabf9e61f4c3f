"""``vramguard keep-certs``: keep the CA, the serving certificates, kube-scheduler's client
certificate and the webhooks' ``caBundle`` current in the cluster (:mod:`vramguard.io.cert_keeper`).

The Deployment ``vramguard-certificates`` runs it, a pass every ``--every`` seconds: the first
creates what the services' pods wait for, the next ones renew, and repair a ``caBundle`` applied
again without it. The Kubernetes client is imported inside the handler, for start-up time (see
:mod:`vramguard.cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

from vramguard.cli.webhook import parse_listen

__all__ = ["register", "run"]

_PROG = "vramguard keep-certs"
EXIT_OK, EXIT_FAILED = 0, 1
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``keep-certs`` sub-command."""
    parser = subparsers.add_parser(
        "keep-certs",
        help="create and renew vramguard's certificates in the cluster, and keep the webhooks' caBundle current",
        description=(
            "Keep a private CA and the certificates vramguard needs as Secrets of the namespace (the webhook's "
            "and the extender's serving certificates, kube-scheduler's client certificate), renewing each a third "
            "of its life before it expires; set the CA bundle as caBundle of the Validating- and "
            "MutatingWebhookConfiguration; restart kube-scheduler when what it reads at start changed. Runs as "
            "the Deployment vramguard-certificates; no certificate step is left to the installer."
        ),
    )
    parser.add_argument("--namespace", default=None,
                        help="namespace of the Secrets and Services (default $POD_NAMESPACE, else the service "
                             "account's)")
    parser.add_argument("--once", action="store_true", help="one pass, then exit (0: done, 1: failed)")
    parser.add_argument("--every", type=float, default=3600.0, metavar="SECONDS",
                        help="seconds between passes without --once (default 3600)")
    parser.add_argument("--ca-secret", default="vramguard-ca", metavar="NAME", help="the CA's Secret")
    parser.add_argument("--webhook-secret", default="vramguard-webhook-tls", metavar="NAME",
                        help="the webhook's serving certificate")
    parser.add_argument("--extender-secret", default="vramguard-extender-tls", metavar="NAME",
                        help="the extender's serving certificate")
    parser.add_argument("--client-secret", default="vramguard-scheduler-client-tls", metavar="NAME",
                        help="kube-scheduler's client certificate for the extender")
    parser.add_argument("--webhook-configuration", default="vramguard", metavar="NAME",
                        help="the Validating- and MutatingWebhookConfiguration whose caBundle is kept")
    parser.add_argument("--scheduler-deployment", default="vramguard-scheduler", metavar="NAME",
                        help="the Deployment of the vramguard scheduler, restarted when its client certificate "
                             "changes ('' when kube-scheduler is the control plane's)")
    parser.add_argument("--listen", default="0.0.0.0:8081", metavar="HOST:PORT",
                        help="probes (/healthz; /readyz: the last pass succeeded) and /metrics, plain HTTP "
                             "(default 0.0.0.0:8081; not with --once)")
    parser.add_argument("--cluster-domain", default="cluster.local")
    parser.add_argument("--kubeconfig", type=Path, metavar="FILE",
                        help="kubeconfig (default: the in-cluster service account, then ~/.kube/config)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """One pass with ``--once``; otherwise passes until SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from vramguard.io import certs  # noqa: PLC0415
    from vramguard.io.cert_keeper import (  # noqa: PLC0415
        KeeperError,
        KeeperNames,
        KeeperStatus,
        keep_certificates,
        keep_forever,
    )
    from vramguard.io.http import Readiness, create_app  # noqa: PLC0415
    from vramguard.io.kube import ApiError, KubeClient, load_connection  # noqa: PLC0415
    from vramguard.io.server import run_https  # noqa: PLC0415

    namespace = args.namespace or os.environ.get("POD_NAMESPACE") or _service_account_namespace()
    if not namespace:
        print(f"{_PROG}: error: no --namespace, $POD_NAMESPACE or service account namespace", file=sys.stderr)
        return EXIT_FAILED
    names = KeeperNames(
        namespace=namespace,
        ca_secret=args.ca_secret,
        webhook_secret=args.webhook_secret,
        extender_secret=args.extender_secret,
        client_secret=args.client_secret,
        webhook_configuration=args.webhook_configuration,
        scheduler_deployment=args.scheduler_deployment or None,
        cluster_domain=args.cluster_domain,
    )
    try:
        connection = load_connection(str(args.kubeconfig) if args.kubeconfig else None)
    except Exception as exc:  # any loading problem is one line, not a traceback
        print(f"{_PROG}: error: cannot load the cluster's credentials: {exc}", file=sys.stderr)
        return EXIT_FAILED

    async def main() -> int:
        async with KubeClient(connection) as client:
            if not args.once:
                await serve(client)
                return EXIT_OK
            try:
                result = await keep_certificates(client, names)
            except (KeeperError, ApiError, certs.CertificateError) as exc:
                print(f"{_PROG}: error: {exc}", file=sys.stderr)
                return EXIT_FAILED
            issued = ", ".join(result.issued) or "none"
            print(f"certificates issued: {issued}; caBundle set in: {', '.join(result.patched) or 'none'}")
            return EXIT_OK

    async def serve(client: KubeClient) -> None:
        """Passes in the background; probes and metrics until SIGTERM."""
        status = KeeperStatus(registry := CollectorRegistry())
        app = create_app(
            registry=registry, readiness=Readiness({"last-pass": lambda: status.last_ok}),
            metrics_prefix="vramguard_certificates",
        )
        passes = asyncio.create_task(keep_forever(client, names, every=args.every, status=status))
        try:
            await run_https(app, host, port, None)
        finally:
            passes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await passes

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return EXIT_OK


def _service_account_namespace() -> str | None:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None
