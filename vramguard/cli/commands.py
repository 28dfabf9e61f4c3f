"""The sub-command registrars, in the order ``vramguard --help`` lists them.

Each module exposes ``register(subparsers)``, which adds one sub-parser whose ``handler`` default
runs the command and returns its exit code.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from vramguard.cli import (
    agent,
    audit,
    certs,
    explain,
    extender,
    keep_certs,
    plan,
    scheduler_config,
    ungate,
    webhook,
    webhook_config,
)

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

REGISTRY: tuple[Registrar, ...] = (
    explain.register, plan.register, audit.register, extender.register, webhook.register, webhook_config.register,
    scheduler_config.register, certs.register, keep_certs.register, agent.register,
    ungate.register,
)
