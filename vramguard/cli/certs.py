"""``vramguard certs``: a CA and a serving certificate for the webhook or the extender Service,
or (``--client NAME``) the client certificate kube-scheduler presents to the extender.

Writes ``ca.crt``, ``tls.crt`` and ``tls.key`` (the key names of a ``kubernetes.io/tls`` Secret),
and with ``--patch-webhook`` puts the CA into the ``caBundle`` of every webhook of a
ValidatingWebhookConfiguration. The certificate code lives in ``vramguard.io.certs``; it (with
cryptography) and the Kubernetes client are imported inside the handler, for start-up time.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any, Protocol

__all__ = ["WebhookPatchError", "patch_webhook_ca_bundle", "register", "run"]

_PROG = "vramguard certs"
# Exit codes: 0 done, 1 the Kubernetes configuration or API call failed, 2 bad input.
_EXIT_OK, _EXIT_PATCH_FAILED, _EXIT_USAGE = 0, 1, 2
# An unreachable API server must not hang the command (the client has no timeout by default).
_API_TIMEOUT_S = 30


class WebhookPatchError(Exception):
    """The webhook configuration could not be read or patched; the message says why."""


class AdmissionApi(Protocol):
    """The calls of ``kubernetes.client.AdmissionregistrationV1Api`` used here."""

    def read_validating_webhook_configuration(self, name: str, *, _request_timeout: float | None = ...) -> Any:
        """Return the named ValidatingWebhookConfiguration."""

    def patch_validating_webhook_configuration(
        self,
        name: str,
        body: list[dict[str, Any]],
        *,
        _content_type: str | None = ...,
        _request_timeout: float | None = ...,
    ) -> Any:
        """Apply a patch to the named ValidatingWebhookConfiguration."""

    def read_mutating_webhook_configuration(self, name: str, *, _request_timeout: float | None = ...) -> Any:
        """Return the named MutatingWebhookConfiguration."""

    def patch_mutating_webhook_configuration(
        self,
        name: str,
        body: list[dict[str, Any]],
        *,
        _content_type: str | None = ...,
        _request_timeout: float | None = ...,
    ) -> Any:
        """Apply a patch to the named MutatingWebhookConfiguration."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``certs`` sub-command to the ``vramguard`` parser."""
    parser = subparsers.add_parser(
        "certs",
        help="create a CA and a serving certificate for the webhook or extender Service, or a client certificate",
        description=(
            "Create a CA (or reuse one) and a serving certificate for a Service's DNS names "
            "(<service>, <service>.<namespace>, <service>.<namespace>.svc[.<cluster-domain>]); "
            "write ca.crt, tls.crt and tls.key into --out. With --client NAME, issue a client "
            "certificate instead: the one kube-scheduler presents to the extender (its tlsConfig "
            "certFile/keyFile), signed by the CA the extender trusts with --client-ca."
        ),
    )
    parser.add_argument("--service", help="Service name, e.g. vramguard-webhook")
    parser.add_argument("--namespace", help="namespace of the Service")
    parser.add_argument(
        "--client",
        metavar="NAME",
        help=(
            "issue a client certificate (clientAuth) with this common name, e.g. kube-scheduler, "
            "instead of a serving certificate; kube-scheduler reads it only at start, so renewing it "
            "needs a scheduler restart"
        ),
    )
    parser.add_argument("--out", required=True, type=Path, help="directory to write the files into")
    parser.add_argument(
        "--ip",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="add an IP address SAN, e.g. 127.0.0.1 (repeatable)",
    )
    parser.add_argument("--dns", action="append", default=[], metavar="NAME", help="add a DNS name SAN (repeatable)")
    parser.add_argument("--ca-cert", type=Path, metavar="FILE", help="sign with this existing CA certificate")
    parser.add_argument("--ca-key", type=Path, metavar="FILE", help="private key of --ca-cert")
    parser.add_argument(
        "--ca-key-out",
        type=Path,
        metavar="FILE",
        help=(
            "save the key of a newly created CA here (0600), to issue later certificates with "
            "--ca-cert/--ca-key; kept out of --out so the Secret never holds the signing key"
        ),
    )
    parser.add_argument(
        "--days",
        type=int,
        help="validity of the certificate in days (default 365 for a serving certificate, 1825 with --client)",
    )
    parser.add_argument(
        "--ca-days",
        type=int,
        default=3650,
        help="validity of a newly created CA in days (default 3650; ignored with --ca-cert)",
    )
    parser.add_argument("--cluster-domain", default="cluster.local", help="cluster DNS domain (default cluster.local)")
    parser.add_argument(
        "--key-type",
        default="ecdsa-p256",
        choices=("ecdsa-p256", "ecdsa-p384", "rsa-2048", "rsa-3072", "rsa-4096"),
        help="key algorithm (default ecdsa-p256)",
    )
    parser.add_argument(
        "--patch-webhook",
        metavar="NAME",
        help="set caBundle in every webhook of this ValidatingWebhookConfiguration, and of the "
        "MutatingWebhookConfiguration of the same name where there is one",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="kubeconfig for --patch-webhook (default: in-cluster, then $KUBECONFIG or ~/.kube/config)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``vramguard certs``; return the exit code (2 for bad input, with a one-line error)."""
    # Imported here for start-up time (see vramguard.cli), not for layering.
    from cryptography import x509  # noqa: PLC0415

    from vramguard.io import certs  # noqa: PLC0415

    if args.client is not None:
        serving_only = [flag for flag, value in (("--service", args.service), ("--namespace", args.namespace),
                                                 ("--ip", args.ip), ("--dns", args.dns),
                                                 ("--patch-webhook", args.patch_webhook)) if value]
        if serving_only:
            return _usage_error(f"--client issues a client certificate; {', '.join(serving_only)} are for serving ones")
        if not args.client.strip():
            return _usage_error("--client needs a name, e.g. kube-scheduler")
    elif args.service is None or args.namespace is None:
        return _usage_error("--service and --namespace are required (or --client NAME for a client certificate)")
    if (args.ca_cert is None) != (args.ca_key is None):
        return _usage_error("--ca-cert and --ca-key go together")
    if args.ca_key_out is not None and args.ca_cert is not None:
        return _usage_error("--ca-key-out saves a new CA's key; it cannot be used with --ca-cert")
    if args.kubeconfig is not None and args.patch_webhook is None:
        return _usage_error("--kubeconfig is only used with --patch-webhook")

    api: AdmissionApi | None = None
    if args.patch_webhook is not None:
        # Configuration problems surface before any file is written.
        try:
            api = _admission_api(args.kubeconfig)
        except WebhookPatchError as exc:
            print(f"{_PROG}: error: {exc}", file=sys.stderr)
            return _EXIT_PATCH_FAILED

    try:
        if args.ca_cert is not None:
            ca = certs.load_ca(args.ca_cert, args.ca_key)
            created_ca = False
        else:
            subject = f"clients {args.client}" if args.client is not None else f"{args.service}.{args.namespace}"
            ca = certs.create_ca(f"vramguard CA for {subject}", days=args.ca_days, key_type=args.key_type)
            created_ca = True
        if args.client is not None:
            days = certs.CLIENT_VALIDITY_DAYS if args.days is None else args.days
            leaf = certs.issue_client_certificate(ca, args.client.strip(), days=days, key_type=args.key_type)
        else:
            leaf = certs.issue_service_certificate(
                ca,
                args.service,
                args.namespace,
                extra_dns_names=args.dns,
                ip_addresses=args.ip,
                cluster_domain=args.cluster_domain,
                days=certs.LEAF_VALIDITY_DAYS if args.days is None else args.days,
                key_type=args.key_type,
            )
        # The CA key first: if it cannot be saved, no certificate signed by a lost key is written.
        if created_ca and args.ca_key_out is not None:
            certs.write_ca_key(args.ca_key_out, ca)
        files = certs.write_serving_files(args.out, leaf)
    except certs.CertificateError as exc:
        return _usage_error(str(exc))

    print(f"wrote {files.ca_cert}, {files.tls_cert}, {files.tls_key}")
    expires = f"{leaf.certificate.not_valid_after_utc:%Y-%m-%d}"
    if args.client is not None:
        print(f"client certificate for {args.client.strip()}; expires {expires}")
        print("kube-scheduler reads it only at start: restart the scheduler after installing a renewed one;")
        print(f"the extender must trust {files.ca_cert} (--client-ca)")
    else:
        sans = leaf.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(name.value) for name in sans]
        print(f"serving certificate for {', '.join(names)}; expires {expires}")
    if created_ca and args.ca_key_out is None:
        print("the new CA's key was not saved (use --ca-key-out to keep it); renewing will need a new CA")

    if api is not None:
        for kind, required in (("validating", True), ("mutating", False)):
            try:
                count = patch_webhook_ca_bundle(api, args.patch_webhook, leaf.ca_pem(), kind=kind, required=required)
            except WebhookPatchError as exc:
                print(f"{_PROG}: error: {exc}", file=sys.stderr)
                return _EXIT_PATCH_FAILED
            if count:
                print(f"set caBundle in {count} webhook(s) of {_KINDS[kind]} {args.patch_webhook}")
    return _EXIT_OK


_KINDS = {"validating": "ValidatingWebhookConfiguration", "mutating": "MutatingWebhookConfiguration"}


def patch_webhook_ca_bundle(
    api: AdmissionApi, name: str, ca_pem: bytes, *, kind: str = "validating", required: bool = True
) -> int:
    """Set ``clientConfig.caBundle`` of every webhook in the ``kind`` (``validating`` or
    ``mutating``) webhook configuration ``name``; one that does not exist is an error only when
    ``required`` (else 0 are patched).

    Uses a JSON patch guarded by ``test`` operations on each webhook's name, so a concurrent
    reordering of the list fails instead of patching the wrong entry, and no other field of the
    object is rewritten (a read-modify-replace through client models could drop fields the client
    does not know). Returns the number of webhooks patched.
    """
    try:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - kubernetes is a declared dependency
        raise WebhookPatchError(f"the kubernetes client is not installed: {exc}") from None

    title = _KINDS[kind]
    read = getattr(api, f"read_{kind}_webhook_configuration")
    try:
        configuration = read(name, _request_timeout=_API_TIMEOUT_S)
    except ApiException as exc:
        if exc.status == 404 and not required:
            return 0
        raise WebhookPatchError(f"cannot read {title} {name}: {_api_reason(exc)}") from None
    except Exception as exc:
        raise WebhookPatchError(f"request to the API server failed: {_one_line(exc)}") from None
    webhooks = list(getattr(configuration, "webhooks", None) or [])
    if not webhooks:
        raise WebhookPatchError(f"{title} {name} has no webhooks to patch")

    bundle = base64.b64encode(ca_pem).decode("ascii")
    patch: list[dict[str, Any]] = []
    for index, webhook in enumerate(webhooks):
        patch.append({"op": "test", "path": f"/webhooks/{index}/name", "value": webhook.name})
        # "add" creates caBundle or replaces it: JSON patch "replace" fails when it is absent.
        patch.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": bundle})
    try:
        getattr(api, f"patch_{kind}_webhook_configuration")(
            name, patch, _content_type="application/json-patch+json", _request_timeout=_API_TIMEOUT_S
        )
    except ApiException as exc:
        raise WebhookPatchError(f"cannot patch {title} {name}: {_api_reason(exc)}") from None
    except Exception as exc:
        raise WebhookPatchError(f"request to the API server failed: {_one_line(exc)}") from None
    return len(webhooks)


def _admission_api(kubeconfig: Path | None) -> AdmissionApi:
    try:
        from kubernetes import client, config  # noqa: PLC0415
        from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - kubernetes is a declared dependency
        raise WebhookPatchError(f"the kubernetes client is not installed: {exc}") from None
    try:
        if kubeconfig is not None:
            config.load_kube_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        else:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]
    except Exception as exc:
        # Kubeconfig loading fails in many ways (YAML syntax, missing keys, unreadable files);
        # whichever it is, the user needs one line naming it, not a traceback.
        raise WebhookPatchError(f"cannot load Kubernetes configuration: {_one_line(exc)}") from None
    api: AdmissionApi = client.AdmissionregistrationV1Api()
    return api


def _api_reason(exc: Any) -> str:
    status = getattr(exc, "status", None)
    if not status:
        return _one_line(exc)
    reason = f"HTTP {status} {getattr(exc, 'reason', None) or 'error'}"
    # The API server explains itself in a Status object ("... not found", "test operation failed").
    try:
        message = json.loads(getattr(exc, "body", None) or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{reason}: {_one_line(message)}" if isinstance(message, str) and message else reason


def _one_line(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text[:300] if text else type(exc).__name__


def _usage_error(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return _EXIT_USAGE
