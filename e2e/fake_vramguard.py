"""A stand-in for ``vramguard extender`` and ``vramguard webhook`` that tests the harness wiring.

It speaks the same command line and wire formats as the real services but decides nothing:
the extender accepts every node, scores them all 5 and binds to the first; the webhook allows
everything except objects annotated ``e2e.vramguard.io/deny``. Every request is appended as a
JSON line to ``$VRAMGUARD_FAKE_RECORD`` when that is set. Standard library only, so it runs as a
plain script: ``python e2e/fake_vramguard.py extender --listen 127.0.0.1:PORT ...``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

DENY_ANNOTATION = "e2e.vramguard.io/deny"
_record_lock = threading.Lock()


def record(service: str, path: str, body: Any) -> None:
    """Append one request to the record file (if configured)."""
    target = os.environ.get("VRAMGUARD_FAKE_RECORD")
    if not target:
        return
    line = json.dumps({"service": service, "path": path, "body": body})
    with _record_lock, Path(target).open("a") as handle:
        handle.write(line + "\n")


class KubeClient:
    """Just enough of a client: a token and a CA from a kubeconfig, and POST."""

    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        self.server: str = cluster["server"]
        self.token: str = config["users"][0]["user"]["token"]
        ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
        self.context = ssl.create_default_context(cadata=ca)

    def post(self, path: str, body: Any) -> int:
        """POST JSON; returns the HTTP status."""
        request = urllib.request.Request(self.server + path, data=json.dumps(body).encode(), method="POST")
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context) as response:
                status: int = response.status
                return status
        except urllib.error.HTTPError as error:
            return error.code


def make_handler(service: str, client: KubeClient) -> type[BaseHTTPRequestHandler]:
    """The request handler for ``service``."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            sys.stderr.write(f"{service}: {format % args}\n")

        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/readyz", "/healthz", "/livez"):
                self._reply(200, {"ready": True})
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
            record(service, self.path, body)
            verb = self.path.rstrip("/").rsplit("/", 1)[-1]
            if service == "extender" and verb == "filter":
                self._reply(200, {"NodeNames": body.get("NodeNames") or [], "FailedNodes": {}, "Error": ""})
            elif service == "extender" and verb == "prioritize":
                self._reply(200, [{"Host": name, "Score": 5} for name in body.get("NodeNames") or []])
            elif service == "extender" and verb == "bind":
                binding = {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": body["PodName"], "namespace": body["PodNamespace"], "uid": body["PodUID"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": body["Node"]},
                }
                status = client.post(
                    f"/api/v1/namespaces/{body['PodNamespace']}/pods/{body['PodName']}/binding", binding
                )
                self._reply(200, {"Error": "" if status == 201 else f"binding failed: HTTP {status}"})
            elif service == "webhook":
                request = body["request"]
                annotations = ((request.get("object") or {}).get("metadata") or {}).get("annotations") or {}
                denied = DENY_ANNOTATION in annotations
                response: dict[str, Any] = {"uid": request["uid"], "allowed": not denied}
                if denied:
                    response["status"] = {"code": 403, "message": "fake vramguard: denied by annotation"}
                self._reply(200, {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
            else:
                self._reply(404, {"error": f"unknown path {self.path}"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    """``fake_vramguard.py extender|webhook --listen HOST:PORT --tls-cert F --tls-key F --kubeconfig K``."""
    parser = argparse.ArgumentParser(prog="fake_vramguard")
    parser.add_argument("service", choices=["extender", "webhook"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--tls-cert", required=True, type=Path)
    parser.add_argument("--tls-key", required=True, type=Path)
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--policy", type=Path)
    parser.add_argument("--client-ca", type=Path, help="require client certificates from this CA")
    parser.add_argument("--ops-listen", help="serve /healthz and /readyz on this plain-HTTP address too")
    args = parser.parse_args(argv)
    handler = make_handler(args.service, KubeClient(args.kubeconfig))
    if args.ops_listen:
        ops_host, ops_port = args.ops_listen.rsplit(":", 1)
        ops = ThreadingHTTPServer((ops_host, int(ops_port)), handler)
        threading.Thread(target=ops.serve_forever, daemon=True).start()
    host, port = args.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    if args.client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=args.client_ca)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
