"""``vramguard scheduler-config``: the extender's ``managedResources`` for a policy.

kube-scheduler sends the extender only pods that ask for a resource of that list, by exact name:
regenerate it whenever the policy's GPU resources change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramguard.policy import PolicyError, default_policy, load_policy
from vramguard.scheduler_config import managed_resources, render_managed_resources, with_managed_resources

__all__ = ["register", "run"]

EXIT_OK, EXIT_FAILED = 0, 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``scheduler-config`` sub-command."""
    parser = subparsers.add_parser(
        "scheduler-config",
        help="print the extender's managedResources for a policy, or a scheduler configuration with them",
        description=(
            "Print the managedResources of the vramguard extender in kube-scheduler's configuration: every "
            "GPU resource the policy makes vramguard account (whole GPUs, time-slicing and MPS replicas, every "
            "MIG profile and variant the device plugin may advertise, renamed .shared ones). With FILE, print "
            "that KubeSchedulerConfiguration with its managedResources replaced and the rest kept as written."
        ),
    )
    parser.add_argument("file", nargs="?", type=Path, metavar="FILE", help="a KubeSchedulerConfiguration (YAML)")
    parser.add_argument("--policy", type=Path, metavar="FILE", help="policy file (default: the built-in policy)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the list or the configuration; a policy or file that cannot be used is one line on stderr, exit 1."""
    try:
        policy = load_policy(args.policy) if args.policy is not None else default_policy()
        names = managed_resources(policy)
        if args.file is None:
            sys.stdout.write(render_managed_resources(names))
        else:
            sys.stdout.write(with_managed_resources(args.file.read_text(encoding="utf-8"), names))
    except (PolicyError, OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"vramguard scheduler-config: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
