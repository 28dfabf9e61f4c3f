"""``vramguard ungate``: lift the scale-up gate ``vramguard.io/vram`` from pods still waiting for it.

Only the extender's leader lifts the gate it gave (docs/autoscaling.md). When the extender is down
for good (vramguard being removed, or the extender's Deployment gone), its gated pods would wait
forever: this command releases them unchanged, as the leader does when scale-up is turned off.

Each pod is patched with the same JSON Patch the leader sends: a ``test`` that the gate is still
at the index read, its removal, and the release stamp ``vramguard.io/released``. A gate list
changed in between fails the ``test`` (422) instead of removing another controller's gate: the pod
is read again and tried once more. The caller's credentials need ``list`` and ``patch`` on pods.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from vramguard.scale_up import GATE, gate_index, release_patch

if TYPE_CHECKING:
    from vramguard.io.kube import KubeClient

__all__ = ["Outcome", "register", "run", "ungate"]

EXIT_OK, EXIT_FAILED = 0, 1
UNBOUND = "spec.nodeName="
TRIES = 3
"""Reads and patches per pod: a gate list that keeps changing under the command is reported, not
fought over."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one gated pod: ``released``, ``would release`` (dry run), ``gone`` or ``failed``."""

    namespace: str
    name: str
    result: str
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"namespace": self.namespace, "name": self.name, "result": self.result, "detail": self.detail}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``ungate`` sub-command."""
    parser = subparsers.add_parser(
        "ungate",
        help=f"lift the scale-up gate {GATE} from pods still waiting for it (extender gone or being removed)",
        description=(
            f"Remove the scheduling gate {GATE} from unbound pods, unchanged (no node affinity added), as the "
            "extender's leader does when scale-up is turned off. For removing vramguard, or a cluster whose "
            "extender is down for good; while the extender runs it lifts the gates itself."
        ),
    )
    parser.add_argument("-n", "--namespace", help="only this namespace (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="list the gated pods, change nothing")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """List the gated pods, lift each gate, print what happened; exit 1 when any pod failed."""
    # Imported here for start-up time: aiohttp and the kubeconfig loader (see vramguard.cli).
    import asyncio  # noqa: PLC0415

    from vramguard.io.kube import KubeClient, load_connection  # noqa: PLC0415

    async def ungate_with_client() -> list[Outcome]:
        async with KubeClient(load_connection(args.kubeconfig, args.context)) as client:
            return await ungate(client, args.namespace, dry_run=args.dry_run)

    try:
        outcomes = asyncio.run(ungate_with_client())
    except Exception as exc:  # the client raises many types: config, network, API
        print(f"vramguard ungate: error: cannot list the pods: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.output == "json":
        print(json.dumps({"gate": GATE, "pods": [o.to_json() for o in outcomes]}, indent=2))
    else:
        for outcome in outcomes:
            detail = f": {outcome.detail}" if outcome.detail else ""
            print(f"{outcome.namespace}/{outcome.name}: {outcome.result}{detail}")
        counted = {result: sum(o.result == result for o in outcomes) for result in ("released", "would release",
                                                                                    "gone", "failed")}
        summary = ", ".join(f"{count} {result}" for result, count in counted.items() if count)
        print(f"{len(outcomes)} pod(s) gated by {GATE}" + (f": {summary}" if summary else ""))
    return EXIT_FAILED if any(o.result == "failed" for o in outcomes) else EXIT_OK


async def ungate(client: KubeClient, namespace: str | None, *, dry_run: bool = False,
                 now: datetime | None = None) -> list[Outcome]:
    """Lift :data:`GATE` from every unbound pod of ``namespace`` (``None``: all) that has it."""
    from vramguard.io.kube import collection_path  # noqa: PLC0415

    pods, _ = await client.list_all(collection_path("/api/v1/pods", namespace), {"fieldSelector": UNBOUND})
    outcomes = []
    for pod in pods:
        if gate_index(pod) is None:
            continue
        pod_namespace, name = _names(pod)
        if dry_run:
            outcomes.append(Outcome(pod_namespace, name, "would release"))
            continue
        try:
            outcomes.append(await _release(client, pod, now or datetime.now(UTC)))
        except Exception as exc:  # the network, a timeout: this pod failed, the others are still tried
            outcomes.append(Outcome(pod_namespace, name, "failed", f"{type(exc).__name__}: {exc}"))
    return outcomes


async def _release(client: KubeClient, pod: dict[str, Any], now: datetime) -> Outcome:
    from vramguard.io.kube import ApiError, object_path  # noqa: PLC0415

    namespace, name = _names(pod)
    path = object_path("/api/v1/pods", namespace, name)
    detail = ""
    for _ in range(TRIES):
        index = gate_index(pod)
        if index is None:
            return Outcome(namespace, name, "gone", "its gate was lifted meanwhile")
        try:
            await client.patch(path, release_patch(pod, index, "", (), now), "json")
            return Outcome(namespace, name, "released")
        except ApiError as exc:
            if exc.status == 404:
                return Outcome(namespace, name, "gone", "the pod was deleted meanwhile")
            if exc.status not in (409, 422):
                return Outcome(namespace, name, "failed", str(exc))
            detail = str(exc)  # the gates changed since the pod was read: read it again
        try:
            pod = await client.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return Outcome(namespace, name, "gone", "the pod was deleted meanwhile")
            return Outcome(namespace, name, "failed", str(exc))
    return Outcome(namespace, name, "failed", f"its gates kept changing: {detail}")


def _names(pod: dict[str, Any]) -> tuple[str, str]:
    metadata = pod.get("metadata") or {}
    return str(metadata.get("namespace") or ""), str(metadata.get("name") or "")
