"""Start HAMi's scheduler extender with the command line the e2e harness gives vramguard's.

    python bench/hami/launch.py --binary HAMI --device-config FILE [--hami-arg=ARG ...] \\
        extender --listen 127.0.0.1:PORT --tls-cert F --tls-key F --kubeconfig K \\
        [--policy P] [--client-ca CA] [--ops-listen 127.0.0.1:OPS_PORT]

HAMi (``cmd/scheduler``) is started as a child: ``--http_bind`` and ``--cert_file``/``--key_file``
from ``--listen`` and the serving certificate (HAMi serves HTTPS with it and does not ask for a
client certificate, so ``--client-ca`` is unused: kube-scheduler still presents its own), the
kubeconfig through ``$KUBECONFIG``, and its metrics on a loopback port of its own. ``--policy`` is
vramguard's and is ignored. The ops listener answers what the harness and the benchmark ask:
``/healthz`` (the child runs), ``/readyz`` (HAMi's own ``/readyz`` answers: it listens only once
its pod, node and ResourceQuota caches are synced), ``/metrics`` (HAMi's) and ``/pid`` (the
child's process id, whose CPU and memory the benchmark reads).

``extender --help`` succeeds; the ``webhook`` service is refused (HAMi's webhook is not measured).
Only the standard library is used: the harness starts this script from its own directory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.server
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def hami_argv(binary: str, *, listen: str, tls_cert: str, tls_key: str, device_config: str, metrics: str,
              extra: list[str]) -> list[str]:
    """HAMi's command line (``cmd/scheduler/main.go`` flags)."""
    return [binary, f"--http_bind={listen}", f"--cert_file={tls_cert}", f"--key_file={tls_key}",
            f"--device-config-file={device_config}", f"--metrics-bind-address={metrics}",
            "--scheduler-name=hami-scheduler", *extra]


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # HAMi's own port on loopback, probed for readiness only
    try:
        with urllib.request.urlopen(url, context=context, timeout=timeout) as response:
            return int(response.status), response.read()
    except (OSError, ValueError):
        return 503, b""


def ops_handler(child: subprocess.Popen[bytes], listen: str, metrics: str) -> type[http.server.BaseHTTPRequestHandler]:
    """The ops listener's handler, answering for ``child``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            alive = child.poll() is None
            if self.path == "/healthz":
                status, body = (200, b"ok") if alive else (503, b"HAMi exited")
            elif self.path == "/readyz":
                status, body = _get(f"https://{listen}/readyz", 2.0) if alive else (503, b"HAMi exited")
            elif self.path == "/metrics":
                status, body = _get(f"http://{metrics}/metrics", 120.0)
            elif self.path == "/pid":
                status, body = 200, str(child.pid).encode()
            else:
                status, body = 404, b"not found"
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((word for word in argv if word in ("extender", "webhook")), None) == "webhook":
        print("HAMi's webhook is left out of this benchmark", file=sys.stderr)  # even for --help
        return 2
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__.split("\n")[0])
    parser.add_argument("--binary", required=True, help="HAMi's scheduler executable")
    parser.add_argument("--device-config", required=True, help="HAMi's --device-config-file")
    parser.add_argument("--hami-arg", action="append", default=[], help="one more flag for HAMi (repeatable)")
    parser.add_argument("service", choices=["extender"])
    parser.add_argument("--listen", help="HOST:PORT of the extender's HTTPS")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--kubeconfig")
    parser.add_argument("--policy", help="vramguard's policy file (ignored)")
    parser.add_argument("--client-ca", help="the CA of client certificates (ignored: HAMi asks for none)")
    parser.add_argument("--ops-listen", help="HOST:PORT of /healthz, /readyz, /metrics and /pid")
    args = parser.parse_args(argv)
    missing = [flag for flag in ("listen", "tls_cert", "tls_key", "kubeconfig") if not getattr(args, flag)]
    if missing:
        parser.error("extender needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    metrics = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "KUBECONFIG": str(Path(args.kubeconfig).resolve())}
    child = subprocess.Popen(
        hami_argv(args.binary, listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key,
                  device_config=args.device_config, metrics=metrics, extra=args.hami_arg),
        env=env, preexec_fn=_die_with_parent,  # noqa: PLW1509
    )

    def stop(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    server = None
    if args.ops_listen:
        host, _, port = args.ops_listen.rpartition(":")
        server = http.server.ThreadingHTTPServer((host, int(port)), ops_handler(child, args.listen, metrics))
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if server is not None:
            server.shutdown()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
