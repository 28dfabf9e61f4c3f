"""``vramguard extender``: the kube-scheduler extender (filter / prioritize / bind) over HTTPS.

Secure by default: the verbs are served only with mutual TLS (``--client-ca``: kube-scheduler
presents a client certificate from that CA), unless an ``--insecure-*`` flag says otherwise, for
local debugging. Probes and metrics are served on ``--ops-listen`` over plain HTTP.

The service and its dependencies (aiohttp, the Kubernetes client) are imported inside the handler,
for start-up time (see :mod:`vramguard.cli`).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from vramguard.cli.watch_limit import add_max_watch_event_bytes
from vramguard.cli.webhook import parse_listen
from vramguard.lease import DEFAULT_AGENT_NAMESPACE
from vramguard.policy import PolicyError, PolicyFile

_PROG = "vramguard extender"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_LISTEN = "127.0.0.1:8888"
DEFAULT_OPS_LISTEN = "0.0.0.0:8080"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``extender`` sub-command."""
    parser = subparsers.add_parser(
        "extender",
        help="serve the kube-scheduler extender (POST /filter, /prioritize, /bind, /preempt)",
        description=(
            "Keep a VRAM ledger per physical GPU from the API server (Nodes, Namespaces, bound Pods) and "
            "answer kube-scheduler's filter, prioritize, bind and preempt calls, with /healthz, /readyz and /metrics. "
            "/readyz answers 200 once the caches are synced and TLS is loaded. The verbs need a client "
            "certificate signed by --client-ca (mutual TLS); probes and metrics are served on --ops-listen."
        ),
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to listen on (default {DEFAULT_LISTEN}: the scheduler runs beside it)")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="serving certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key (PEM)")
    parser.add_argument("--client-ca", type=Path, metavar="FILE",
                        help="CA certificate(s) (PEM) that sign the client certificate kube-scheduler presents; "
                             "reloaded when it changes. Required with --tls-cert unless --insecure-skip-client-auth")
    parser.add_argument("--ops-listen", default=DEFAULT_OPS_LISTEN, metavar="HOST:PORT",
                        help=f"plain-HTTP address of /healthz, /readyz and /metrics (default {DEFAULT_OPS_LISTEN})")
    parser.add_argument("--insecure-skip-client-auth", action="store_true",
                        help="INSECURE: serve the verbs over TLS to any client, without --client-ca: whoever "
                             "reaches the port can bind pods (local debugging only)")
    parser.add_argument("--insecure-http", action="store_true",
                        help="INSECURE: serve the verbs over plain HTTP to any client, without --tls-cert/--tls-key "
                             "(only on a loopback address; local debugging only)")
    parser.add_argument("--kubeconfig", type=Path, metavar="FILE",
                        help="kubeconfig (default: the in-cluster service account, then ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--policy", type=Path, metavar="FILE",
                        help="policy file, re-read when it changes (default: the built-in policy)")
    parser.add_argument("--agent-namespace", default=DEFAULT_AGENT_NAMESPACE, metavar="NAMESPACE",
                        help="where the node agents' Leases are: a report is trusted only while its Lease is fresh "
                             f"(default {DEFAULT_AGENT_NAMESPACE})")
    parser.add_argument("--leader-elect", type=_boolean, default=True, metavar="true|false",
                        help="elect one serving replica through a Lease (default true); only the leader answers "
                             "filter and bind and reports ready. false only for a sidecar whose kube-scheduler elects "
                             "its own leader, or a single replica")
    parser.add_argument("--scheduler-lease", metavar="NAMESPACE/NAME",
                        help="with --leader-elect=false, a sidecar's kube-scheduler leader Lease: the background work "
                             "only one replica may do (preemption, learning, Events) runs only while this pod's "
                             "scheduler holds it")
    parser.add_argument("--leader-elect-resource-namespace", metavar="NAMESPACE",
                        help="namespace of the leader Lease (default: --agent-namespace)")
    parser.add_argument("--leader-elect-resource-name", default="vramguard-extender", metavar="NAME",
                        help="name of the leader Lease (default vramguard-extender)")
    parser.add_argument("--leader-elect-identity", metavar="ID",
                        help="this replica's identity in the Lease (default: <hostname>_<random>)")
    parser.add_argument("--leader-elect-lease-duration", type=float, default=15.0, metavar="SECONDS",
                        help="how long a candidate waits on an unrenewed Lease before taking it (default 15)")
    parser.add_argument("--leader-elect-renew-deadline", type=float, default=10.0, metavar="SECONDS",
                        help="a leader that has not renewed for this long stops serving (default 10)")
    parser.add_argument("--leader-elect-retry-period", type=float, default=2.0, metavar="SECONDS",
                        help="how often the Lease is tried or renewed (default 2)")
    parser.add_argument("--drain-delay", type=float, default=0.0, metavar="SECONDS",
                        help="on SIGTERM, report not ready for this long before closing the listener")
    parser.add_argument("--metrics-per-gpu", action="store_true",
                        help="also export the ledger's series per GPU (labels node, gpu, product, sharing), not only "
                             "per node and product: four series a GPU, megabytes a scrape at thousands of nodes")
    parser.add_argument("--namespace", metavar="NAMESPACE",
                        help="the extender's own namespace, where the leader keeps the allowances learned from the "
                             "agents' measurements (ConfigMap vramguard-learned-allowances; default: $POD_NAMESPACE, "
                             "else --leader-elect-resource-namespace, else --agent-namespace)")
    parser.add_argument("--learn-interval", type=float, default=60.0, metavar="SECONDS",
                        help="seconds between learning rounds (default 60; the policy's learning section says what "
                             "is learned)")
    add_max_watch_event_bytes(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(handler=run)


def _boolean(value: str) -> bool:
    """``true`` / ``false`` (as kube-scheduler's ``--leader-elect=false``)."""
    lowered = value.lower()
    if lowered not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return lowered == "true"


def run(args: argparse.Namespace) -> int:
    """Start the extender; return when it has shut down (0) or failed to start (1, 2)."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here for start-up time (see vramguard.cli), not for layering.
    from extender.main import ExtenderSettings, LeaderElection  # noqa: PLC0415
    from extender.main import run as run_extender  # noqa: PLC0415
    from vramguard.election import ElectionTimings  # noqa: PLC0415
    from vramguard.io import runtime  # noqa: PLC0415
    from vramguard.io.kube import MAX_EVENT_BYTES, load_connection  # noqa: PLC0415
    from vramguard.io.leader import default_identity  # noqa: PLC0415
    from vramguard.io.server import ServerSettings  # noqa: PLC0415
    from vramguard.io.supervise import TaskDied  # noqa: PLC0415
    from vramguard.io.tls import TLSLoadError, load_server_tls  # noqa: PLC0415

    try:
        host, port = parse_listen(args.listen)
        ops_host, ops_port = parse_listen(args.ops_listen, option="--ops-listen")
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.drain_delay < 0:
        return _fail("--drain-delay must not be negative", EXIT_USAGE)
    if not 0.1 <= args.learn_interval <= 86400:
        return _fail("--learn-interval must be between 0.1 and 86400 seconds", EXIT_USAGE)
    election = None
    if args.leader_elect:
        try:
            timings = ElectionTimings(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                                      args.leader_elect_retry_period)
        except ValueError as exc:
            return _fail(f"--leader-elect-*: {exc}", EXIT_USAGE)
        if timings.lease_duration != int(timings.lease_duration):
            return _fail("--leader-elect-lease-duration must be whole seconds (a Lease counts in seconds)", EXIT_USAGE)
        election = LeaderElection(args.leader_elect_resource_namespace or args.agent_namespace,
                                  args.leader_elect_resource_name,
                                  args.leader_elect_identity or default_identity(socket.gethostname()), timings)
    scheduler_lease = None
    if args.scheduler_lease is not None:
        namespace, _, name = args.scheduler_lease.partition("/")
        if not namespace or not name or "/" in name:
            return _fail("--scheduler-lease must be NAMESPACE/NAME", EXIT_USAGE)
        if args.leader_elect:
            return _fail("--scheduler-lease is for a sidecar that elects no leader: add --leader-elect=false",
                         EXIT_USAGE)
        scheduler_lease = (namespace, name)
    problem = transport_problem(args.tls_cert, args.tls_key, args.client_ca, args.insecure_skip_client_auth,
                                args.insecure_http, host)
    if problem:
        return _fail(problem, EXIT_USAGE)
    try:
        policy_file = PolicyFile(args.policy) if args.policy else None
        tls = load_server_tls(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
        connection = load_connection(str(args.kubeconfig) if args.kubeconfig else None, args.context)
    except (PolicyError, TLSLoadError) as exc:
        return _fail(str(exc), EXIT_FAILED)
    except Exception as exc:
        return _fail(f"cannot load the Kubernetes configuration: {exc}", EXIT_FAILED)
    settings = ExtenderSettings(host, port, tls, (ops_host, ops_port), connection, policy_file,
                                ServerSettings(drain_delay=args.drain_delay), agent_namespace=args.agent_namespace,
                                max_event_bytes=args.max_watch_event_bytes or MAX_EVENT_BYTES, election=election,
                                scheduler_lease=scheduler_lease,
                                per_gpu_metrics=args.metrics_per_gpu, learn_interval=args.learn_interval,
                                namespace=args.namespace or os.environ.get("POD_NAMESPACE")
                                or args.leader_elect_resource_namespace or args.agent_namespace)
    log = logging.getLogger("vramguard.extender")
    log.info("serving on %s://%s:%d (%s), probes and metrics on http://%s:%d, policy %s",
             "https" if tls else "http", host, port,
             "client certificates required" if tls is not None and tls.requires_client_certificate else "ANY client",
             ops_host, ops_port, args.policy or "(built-in)")
    if tls is None or not tls.requires_client_certificate:
        log.warning("INSECURE: the verbs accept any client that reaches %s:%d; whoever does can bind pods", host, port)
    try:
        runtime.run(run_extender(settings))
    except OSError as exc:
        return _fail(f"cannot serve on {args.listen}: {exc}", EXIT_FAILED)
    except TaskDied as exc:
        return _fail(str(exc), EXIT_FAILED)
    return EXIT_OK


def transport_problem(
    tls_cert: Path | None,
    tls_key: Path | None,
    client_ca: Path | None,
    insecure_skip_client_auth: bool,
    insecure_http: bool,
    host: str,
) -> str | None:
    """Say what is wrong with the verbs listener's options, or None when they are consistent.

    Serving the verbs to unauthenticated clients takes an explicit ``--insecure-*`` flag; the
    flags that contradict each other are refused rather than one silently winning.
    """
    if (tls_cert is None) != (tls_key is None):
        return "--tls-cert and --tls-key go together"
    if tls_cert is None:
        if client_ca is not None:
            return "--client-ca needs --tls-cert and --tls-key (client certificates are checked by TLS)"
        if not insecure_http:
            return "serving needs --tls-cert, --tls-key and --client-ca (or --insecure-http on a loopback address)"
        if host not in _LOOPBACK:
            return f"--insecure-http serves only on a loopback address, not {host}"
        return None
    if insecure_http:
        return "--insecure-http contradicts --tls-cert/--tls-key"
    if client_ca is not None and insecure_skip_client_auth:
        return "--insecure-skip-client-auth contradicts --client-ca"
    if client_ca is None and not insecure_skip_client_auth:
        return (
            "the verbs need --client-ca (the CA of kube-scheduler's client certificate); "
            "--insecure-skip-client-auth serves them to any client"
        )
    return None


def _fail(message: str, code: int) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return code
