"""``vramguard explain``: what each GPU container of a manifest will reserve, and why."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vramguard.demand import ContainerDemand, DemandOptions, PodDemand, derive_pod_demand
from vramguard.demand.objects import DocumentError, load_documents, pod_template
from vramguard.placement import pod_refusals
from vramguard.policy import Policy, PolicyError, default_policy, load_policy
from vramguard.quantity import QuantityError, format_bytes, parse_bytes

EXIT_OK, EXIT_ERRORS, EXIT_UNREADABLE = 0, 1, 2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``explain`` sub-command."""
    parser = subparsers.add_parser(
        "explain",
        help="show the VRAM each GPU container of a manifest will reserve per GPU, with the evidence",
        description="Read Pods and workloads (YAML, JSON, multi-document, kind: List) and show what "
        "each GPU container will reserve on each GPU it gets, and what would refuse it on every node "
        "(the VRAM budget, a class rule, unknown VRAM). Exit 0: no errors; 1: some object has errors "
        "or a refusal its namespace enforces; 2: unreadable input.",
    )
    parser.add_argument("file", metavar="FILE|-", help="manifest file, or - for standard input")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.add_argument(
        "--gpu-memory",
        metavar="QUANTITY",
        help="memory of the GPU the pods will get (e.g. 80Gi), to turn fractions into bytes",
    )
    parser.add_argument("--policy", metavar="FILE", help="policy file (default: the shipped policy)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Explain every object of the input; print JSON or a table."""
    try:
        gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
        policy = load_policy(args.policy) if getattr(args, "policy", None) else default_policy()
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        objects = load_documents(text)
    except (OSError, UnicodeDecodeError, DocumentError, QuantityError, PolicyError) as exc:
        print(f"vramguard explain: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    namespaces = {_name(o): _labels(o) for o in objects if o.get("kind") == "Namespace"}
    reports = [explain_object(obj, gpu_memory, policy, namespaces) for obj in objects if obj.get("kind") != "Namespace"]
    if args.output == "json":
        print(json.dumps(reports, indent=2))
    else:
        print(render_text(reports, gpu_memory))
    refused = any(r["enforced"] for report in reports for r in report["refusals"])
    return EXIT_ERRORS if refused or any(report["errors"] for report in reports) else EXIT_OK


def explain_object(
    obj: Mapping[str, Any],
    gpu_memory: int | None,
    policy: Policy | None = None,
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """The JSON report of one object (see the README for the format).

    ``refusals`` lists what would refuse the pod on any node, each with its rule (``vram-budget``,
    ``class-rule``, ``vram-unknown``) and whether its namespace's mode enforces it, so a user knows
    whether to change the workload or the policy.
    """
    policy = policy if policy is not None else default_policy()
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    template = pod_template(obj)
    options = DemandOptions(frozenset(policy.gpu_resources), policy.gpu_resource_prefixes)
    demand = derive_pod_demand(template, options) if template is not None else PodDemand()
    errors = list(demand.errors)
    if gpu_memory is not None:
        errors.extend(e for e in demand.conflicts(gpu_memory) if e not in errors)
    namespace = str(metadata.get("namespace") or "default")
    template_labels = _labels(template) if template is not None else {}
    choice = policy.choose_class(template_labels, (namespaces or {}).get(namespace))
    refusals = pod_refusals(demand, choice, policy.gpu_resource_prefixes, gpu_memory) if demand.wants_gpu else []
    return {
        "kind": obj.get("kind"),
        "name": metadata.get("name") or metadata.get("generateName"),
        "namespace": namespace,
        "class": choice.name if demand.wants_gpu else None,
        "enforcement": choice.enforcement if demand.wants_gpu else None,
        "containers": [_container_report(c, gpu_memory) for c in demand.containers],
        "refusals": [r.to_json() for r in refusals],
        "errors": errors,
        "warnings": list(demand.warnings),
    }


def _name(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    return str(metadata.get("name", "")) if isinstance(metadata, Mapping) else ""


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    if not isinstance(labels, Mapping):
        return {}
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


def _container_report(container: ContainerDemand, gpu_memory: int | None) -> dict[str, Any]:
    vram = container.reservation
    fraction = float(vram.fraction) if vram is not None and vram.fraction is not None else None
    if vram is None:
        size = None
    elif vram.bytes is not None:
        size = vram.bytes
    elif gpu_memory is not None and vram.fraction is not None:
        product = vram.fraction * gpu_memory
        size = -(-product.numerator // product.denominator)  # ceil: what a person expects to see
    else:
        size = None
    return {
        "name": container.name,
        "resource": container.resource,
        "engine": container.engine,
        "gpus": container.gpus,
        "vram_fraction_per_gpu": fraction,
        "vram_bytes_per_gpu": size,
        "sm_percent": container.sm_percent,
        "evidence": list(container.evidence),
    }


def render_text(reports: list[dict[str, Any]], gpu_memory: int | None) -> str:
    """A readable table per object, followed by its errors and warnings."""
    lines: list[str] = []
    for report in reports:
        lines.append(f"{report['kind']} {report['namespace']}/{report['name']}")
        if not report["containers"]:
            lines.append("  no container asks for a GPU")
        else:
            rows = [("CONTAINER", "ENGINE", "GPUS", "VRAM PER GPU", "SM%", "EVIDENCE")]
            for c in report["containers"]:
                rows.append((
                    c["name"],
                    c["engine"] or "-",
                    f"{c['gpus']} {c['resource']}",
                    _vram_text(c),
                    str(c["sm_percent"]) if c["sm_percent"] is not None else "-",
                    "; ".join(c["evidence"]) or "-",
                ))
            widths = [max(len(row[i]) for row in rows) for i in range(5)]
            for row in rows:
                cells = [row[i].ljust(widths[i]) for i in range(5)]
                lines.append("  " + "  ".join(cells) + "  " + row[5])
        if report.get("class"):
            lines.append(f"  class {report['class']} (namespace mode {report['enforcement']})")
        for refusal in report.get("refusals", ()):
            how = "refused" if refusal["enforced"] else "not enforced in this mode"
            lines.append(f"  refusal [{refusal['rule']}, {how}]: {refusal['message']}")
        lines.extend(f"  error: {e}" for e in report["errors"])
        lines.extend(f"  warning: {w}" for w in report["warnings"])
        lines.append("")
    if gpu_memory is None and any(c["vram_fraction_per_gpu"] for r in reports for c in r["containers"]):
        lines.append("(pass --gpu-memory, e.g. 80Gi, to see fractions in bytes)")
    return "\n".join(lines).rstrip()


def _vram_text(container: Mapping[str, Any]) -> str:
    fraction, size = container["vram_fraction_per_gpu"], container["vram_bytes_per_gpu"]
    if fraction is None and size is None:
        return "unknown"
    if fraction is None:
        return format_bytes(size)
    return f"{fraction:g}" + (f" ({format_bytes(size)})" if size is not None else "")
