"""``vramguard webhook-config``: print the ValidatingWebhookConfiguration for a policy (with
``--mutating``, the MutatingWebhookConfiguration that routes GPU pods to the vramguard scheduler;
with ``--routing-policy``, the ValidatingAdmissionPolicy that refuses GPU pods left unrouted).

The entries' failure policies are split on the namespaces' enforcement mode, and a namespace
without the ``vramguard.io/enforce`` label follows the policy's default: regenerate the
configuration whenever the default mode or the GPU resources of the policy change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramguard.policy import PolicyError, default_policy, load_policy
from vramguard.webhook_config import (
    MUTATING_HEADER,
    ROUTING_HEADER,
    WebhookTarget,
    mutating_webhook_configuration,
    render,
    routing_admission_policy,
    webhook_configuration,
)

__all__ = ["register", "run"]

EXIT_OK, EXIT_FAILED = 0, 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``webhook-config`` sub-command."""
    defaults = WebhookTarget()
    parser = subparsers.add_parser(
        "webhook-config",
        help="print the Validating (or, with --mutating, the Mutating) WebhookConfiguration for a policy",
        description=(
            "Print the ValidatingWebhookConfiguration of the vramguard webhook as YAML: failurePolicy Fail "
            "for namespaces that enforce the policy, Ignore for those that warn or audit, following the "
            "policy's default enforcement for unlabelled namespaces."
        ),
    )
    parser.add_argument("--policy", type=Path, metavar="FILE", help="policy file (default: the built-in policy)")
    parser.add_argument("--namespace", default=defaults.namespace, help="namespace of the webhook's Service")
    parser.add_argument("--service", default=defaults.service, help="name of the webhook's Service")
    parser.add_argument(
        "--exclude",
        action="append",
        metavar="NAMESPACE",
        help=f"namespace never sent to the webhook (repeatable; default: {', '.join(defaults.excluded_namespaces)})",
    )
    parser.add_argument(
        "--mutating",
        action="store_true",
        help="print the MutatingWebhookConfiguration instead (routing to the vramguard scheduler, memory limits)",
    )
    parser.add_argument(
        "--routing-policy",
        action="store_true",
        help="print the ValidatingAdmissionPolicy that refuses GPU pods left unrouted (empty when nothing is routed)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the configuration; a policy that cannot be loaded is one line on stderr and exit 1."""
    try:
        policy = load_policy(args.policy) if args.policy is not None else default_policy()
    except PolicyError as exc:
        print(f"vramguard webhook-config: {exc}", file=sys.stderr)
        return EXIT_FAILED
    excluded = tuple(args.exclude) if args.exclude else WebhookTarget().excluded_namespaces
    target = WebhookTarget(namespace=args.namespace, service=args.service, excluded_namespaces=excluded)
    if args.mutating:
        sys.stdout.write(render(mutating_webhook_configuration(policy, target), MUTATING_HEADER))
    elif args.routing_policy:
        sys.stdout.write(render(routing_admission_policy(policy, target), ROUTING_HEADER))
    else:
        sys.stdout.write(render(webhook_configuration(policy, target)))
    return EXIT_OK
