"""``vramguard explain``: what each GPU container of a manifest will reserve, and why."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from vramguard.admission import workload_pods
from vramguard.cli.inputs import InputError, add_input_arguments, read_sources
from vramguard.cli.judge import (
    Judge,
    LiveError,
    add_cluster_arguments,
    admission_json,
    admission_lines,
    is_subject,
    read_live,
    snapshot_of,
)
from vramguard.demand import ContainerDemand, PodDemand
from vramguard.demand.allowances import LEARNED
from vramguard.dra.fields import memory_text
from vramguard.dra.review import ClaimReview, DraContext, review_pod_claims
from vramguard.inventory import human_product
from vramguard.learning import LearnedAllowance, LearnKey, apply_learned
from vramguard.ledger import ResourceOffer
from vramguard.mutation import plan_limits
from vramguard.placement import pod_refusals
from vramguard.policy import ClassChoice, Policy, PolicyError, default_policy, load_policy
from vramguard.quantity import QuantityError, format_bytes, parse_bytes
from vramguard.workloads import NO_INPUTS, Inputs, object_parts, parts_demand, read_inputs, unread_warning

EXIT_OK, EXIT_ERRORS, EXIT_UNREADABLE, EXIT_SKIPPED = 0, 1, 2, 3


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``explain`` sub-command."""
    parser = subparsers.add_parser(
        "explain",
        help="show the VRAM each GPU container of a manifest will reserve per GPU, with the evidence",
        description="Read Pods and workloads (YAML, JSON, multi-document, kind: List) and show what "
        "each GPU container will reserve on each GPU it gets, and what would refuse it on every node "
        "(the VRAM budget, a class rule, unknown VRAM), and what the admission webhook answers under "
        "the namespace's class and mode. Exit 0: no errors; 1: some object has errors or is refused "
        "(by admission, or a refusal its namespace enforces); 2: unreadable input, document, policy or "
        "cluster; 3: no errors, but an object of a kind vramguard does not read asks for a GPU (skipped).",
    )
    add_input_arguments(parser)
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.add_argument(
        "--gpu-memory",
        metavar="QUANTITY",
        help="memory of the GPU the pods will get (e.g. 80Gi), to turn fractions into bytes",
    )
    parser.add_argument(
        "--policy", metavar="FILE",
        help="policy file (default: with --cluster its ConfigMap vramguard-system/vramguard-policy, else the shipped "
        "policy)",
    )
    add_cluster_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Explain every object of the input; print JSON or a table."""
    try:
        gpu_memory = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
        policy = load_policy(args.policy) if getattr(args, "policy", None) else default_policy()
        sources = read_sources(args)
        live = read_live(args)
    except (InputError, QuantityError, PolicyError, LiveError) as exc:
        print(f"vramguard explain: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if live is not None:
        policy = live.policy
    documents = [document for source in sources for document in source.documents]
    for source in sources:
        for document in source.documents:
            if document.error is not None:
                print(f"vramguard explain: {source.name}: document {document.index}: {document.error}",
                      file=sys.stderr)
    objects = [obj for document in documents for obj in document.objects]
    judge = Judge(
        policy, snapshot_of(objects, live.snapshot if live is not None else None), stand_in_memory=gpu_memory
    )
    inputs = read_inputs(objects)
    reports = []
    for obj in filter(is_subject, objects):
        report = explain_object(
            obj, gpu_memory, policy, judge.state.namespace_labels, inputs, judge.state.dra_context(),
            judge.state.learned,
        )
        decision = judge.review(obj)
        report["admission"] = admission_json(decision) if decision.wants_gpu else None
        reports.append(report)
    if args.output == "json":
        print(json.dumps(reports, indent=2))
    else:
        print(render_text(reports, gpu_memory))
    if any(document.error is not None for document in documents):
        return EXIT_UNREADABLE
    refused = any(r["enforced"] for report in reports for r in report["refusals"]) or any(
        report["admission"] is not None and not report["admission"]["allowed"] for report in reports
    )
    if refused or any(report["errors"] for report in reports):
        return EXIT_ERRORS
    return EXIT_SKIPPED if any(report["skipped"] for report in reports) else EXIT_OK


def explain_object(
    obj: Mapping[str, Any],
    gpu_memory: int | None,
    policy: Policy | None = None,
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
    inputs: Inputs = NO_INPUTS,
    dra: DraContext | None = None,
    learned: Mapping[LearnKey, LearnedAllowance] | None = None,
) -> dict[str, Any]:
    """The JSON report of one object (see docs/explain-and-plan.md for the format).

    ``refusals`` lists what would refuse the pod on any node, each with its rule (``vram-budget``,
    ``class-rule``, ``vram-unknown``) and whether its namespace's mode enforces it, so a user knows
    whether to change the workload or the policy. An object with several pod templates (a
    LeaderWorkerSet's leader and workers) lists every template's containers, each naming its
    template; ``skipped`` is true for an object of a kind vramguard does not read that asks for a GPU.
    With ``dra`` (the DRA objects of the input), ``claims`` lists each claim request a container uses,
    its memory next to what the containers reserve, and a claim short of memory is a refusal
    (``claim-memory``, ``extended-resource-memory``). ``learned``: the allowances the extender learned
    (read with ``--cluster``), listed per GPU product beside the static estimates.
    """
    policy = policy if policy is not None else default_policy()
    metadata = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    options = policy.demand_options()
    notes: list[str] = []
    parts = object_parts(obj, policy.workload_kinds, workload_pods, inputs, notes=notes)
    namespace = str(metadata.get("namespace") or "default")
    report: dict[str, Any] = {
        "kind": obj.get("kind"),
        "name": metadata.get("name") or metadata.get("generateName"),
        "namespace": namespace,
        "class": None,
        "enforcement": None,
        "templates": [],
        "containers": [],
        "refusals": [],
        "errors": [],
        "warnings": [],
        "skipped": False,
        "claims": [],
        "injected": [],
    }
    if parts is None:
        warning = unread_warning(obj, options.is_gpu)
        if warning is not None:
            report["warnings"].append(warning)
            report["skipped"] = True
        return report
    report["warnings"].extend(notes)
    demands = [apply_learned(demand, learned or {}) for demand in parts_demand(parts, options)]
    several = len(parts) > 1
    # The smallest margin any device keeps (a device one pod owns included), so that a refusal for
    # the VRAM budget holds on every node.
    rule = policy.budget_rule()
    least_margin = min([*rule.margins.values(), *([] if rule.exclusive is None else [rule.exclusive])])
    for part, demand in zip(parts, demands, strict=True):
        prefix = f"{part.name}: " if several else ""
        named = {"template": part.name} if several else {}
        errors = list(demand.errors)
        if gpu_memory is not None:
            errors.extend(e for e in demand.conflicts(gpu_memory) if e not in errors)
        choice = policy.choose_class(_labels(part.template), (namespaces or {}).get(namespace))
        if demand.wants_gpu:
            report["class"] = report["class"] or choice.name
            report["enforcement"] = report["enforcement"] or choice.enforcement
            refusals = pod_refusals(demand, choice, policy.gpu_resource_prefixes, gpu_memory, least_margin)
            report["refusals"].extend({**r.to_json(), **named} for r in refusals)
        review = review_pod_claims(part.template, namespace, demand, dra) if dra is not None else None
        if review is not None:
            if review.uses_claims or review.extended:
                report["class"] = report["class"] or choice.name
                report["enforcement"] = report["enforcement"] or choice.enforcement
            _claims_report(report, review, choice.enforcement == "enforce", prefix, named)
        if demand.wants_gpu and choice.qos.enforce_memory_limits:
            injected, notes = _limits(demand, choice, gpu_memory)
            report["injected"].extend({**i, **named} for i in injected)
            report["warnings"].extend(prefix + n for n in notes)
        claimed = _claim_users(review) if review is not None else []
        gpu = demand.wants_gpu or bool(claimed) or (review is not None and bool(review.extended))
        report["templates"].append({"name": part.name, "pods": part.pods, "gpu": gpu})
        report["containers"].extend({**_container_report(c, gpu_memory), **named} for c in demand.containers)
        report["containers"].extend(
            {**_container_report(c, gpu_memory), "resource": f"claim {', '.join(uses)}", "claims": uses, **named}
            for c, uses in claimed
        )
        report["errors"].extend(prefix + e for e in errors)
        report["warnings"].extend(prefix + w for w in demand.warnings)
    return report


def _limits(
    demand: PodDemand, choice: ClassChoice, gpu_memory: int | None
) -> tuple[list[dict[str, str]], list[str]]:
    """The memory limits the mutating webhook writes for a class with ``enforce_memory_limits``,
    on GPUs of ``gpu_memory``."""
    if gpu_memory is None:
        return [], [f"class {choice.name} writes GPU memory limits at admission: pass --gpu-memory to see them"]
    offer = ResourceOffer(gpu_memory, gpu_memory, gpu_memory, frozenset(choice.qos.sharing))
    injections, notes = plan_limits(
        demand, {c.resource: offer for c in demand.containers}, mps=tuple(choice.qos.sharing) == ("mps",)
    )
    return [{"container": i.container, "name": i.name, "value": i.value} for i in injections], notes


def _claim_users(review: ClaimReview) -> list[tuple[ContainerDemand, list[str]]]:
    """Each container using a claim request, with the ``claim/request`` names it uses."""
    users: dict[str, tuple[ContainerDemand, list[str]]] = {}
    for request in review.requests:
        for demand in request.users:
            entry = users.setdefault(demand.name, (demand, []))
            entry[1].append(f"{request.claim}/{request.request}")
    return list(users.values())


def _claims_report(
    report: dict[str, Any], review: ClaimReview, enforced: bool, prefix: str, named: Mapping[str, str]
) -> None:
    """The claims' memory next to the engines' reservations, and what refuses the pod for it."""
    for request in review.requests:
        report["claims"].append({
            "claim": request.claim,
            "request": request.request,
            "memory_request_bytes": request.memory,
            "device": request.device.label if request.device is not None else None,
            "device_memory_bytes": request.device.memory_bytes if request.device is not None else None,
            "consumed_bytes": request.consumed,
            "reserved_bytes": request.reserved,
            "containers": [demand.name for demand in request.users],
            **named,
        })
    for rule, shortfalls in (("claim-memory", review.shortfalls), ("extended-resource-memory", review.extended)):
        report["refusals"].extend(
            {"rule": rule, "message": prefix + s.message(), "enforced": enforced, **named} for s in shortfalls
        )
    report["errors"].extend(prefix + e for e in review.errors)
    report["warnings"].extend(prefix + n for n in review.notes)


def _claim_line(claim: Mapping[str, Any]) -> str:
    """``claim gpu: requests 8Gi, consumes 8Gi of 80Gi on gpu-0 (NVIDIA H100 80GB HBM3); vllm reserves 72Gi``."""
    asked = memory_text(claim["memory_request_bytes"]) if claim["memory_request_bytes"] is not None else "no memory"
    name = claim["claim"] if claim["request"] == claim["claim"] else f"{claim['claim']} request {claim['request']}"
    if claim["device"] is None:
        return f"claim {name}: requests {asked}; no known device matches its class"
    consumed = memory_text(claim["consumed_bytes"]) if claim["consumed_bytes"] is not None else "?"
    reserved = memory_text(claim["reserved_bytes"]) if claim["reserved_bytes"] is not None else "unknown"
    return (
        f"claim {name}: requests {asked}, consumes {consumed} of {memory_text(claim['device_memory_bytes'])} "
        f"on {claim['device']}; {', '.join(claim['containers']) or 'no container'} "
        f"reserve{'s' if len(claim['containers']) == 1 else ''} {reserved}"
    )


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
    rules = list(container.rules)
    if len(container.reservations) > 1 and container.claim is not None:
        if gpu_memory is not None:
            vram = max(container.reservations, key=lambda v: v.on_device(gpu_memory))
        which = "" if gpu_memory is None else (
            ": here the engine's" if vram is container.claim else ": here the declaration"
        )
        rules.append(
            f"a declaration counts no less than {container.engine}'s own claim "
            f"({container.claim.describe()}) on the GPU it lands on{which}"
        )
    fraction = float(vram.fraction) if vram is not None and vram.fraction is not None else None
    share: int | None
    if vram is None:
        share = None
    elif vram.bytes is not None:
        share = vram.bytes
    elif gpu_memory is not None and vram.fraction is not None:
        product = vram.fraction * gpu_memory
        share = -(-product.numerator // product.denominator)  # ceil: what a person expects to see
    else:
        share = None
    held = () if vram is None else vram.allowances  # a ceiling's: what it holds beyond it
    allowances: list[dict[str, Any]] = [
        {"name": a.name, "bytes": a.bytes_for(""), "processes": a.count, "estimate": a.estimate, "source": a.source,
         "bytes_by_product": {product: a.bytes_for(product) for product, _ in a.by_product}}
        for a in held
    ]
    total = share + sum(a.bytes_for("") for a in held) if share is not None else None
    capped = vram is not None and gpu_memory is not None and vram.capped_on(gpu_memory)
    if capped:
        total = gpu_memory
    return {
        "name": container.name,
        "resource": container.resource,
        "engine": container.engine,
        "engine_version": container.engine_version,
        "gpus": container.gpus,
        "vram_fraction_per_gpu": fraction,
        "share_bytes_per_gpu": share,
        "ceiling": vram.ceiling if vram is not None else False,
        "allowances": allowances,
        "vram_bytes_per_gpu": total,
        "capped": capped,
        "sm_percent": container.sm_percent,
        "evidence": list(container.evidence),
        "rules": rules,
    }


def render_text(reports: list[dict[str, Any]], gpu_memory: int | None) -> str:
    """A readable table per object, followed by its errors and warnings."""
    lines: list[str] = []
    for report in reports:
        lines.append(f"{report['kind']} {report['namespace']}/{report['name']}")
        if report.get("skipped"):
            lines.append("  skipped: vramguard does not read this kind")
        elif not report["containers"] and not report.get("claims"):
            lines.append("  no container asks for a GPU")
        elif report["containers"]:  # (a pod whose GPUs all come from DRA claims has its claims listed below)
            rows = [("CONTAINER", "ENGINE", "GPUS", "VRAM PER GPU", "SM%", "EVIDENCE")]
            for c in report["containers"]:
                several = len(report.get("templates", ())) > 1
                rows.append((
                    f"{c['template']}/{c['name']}" if several else c["name"],
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
            for c in report["containers"]:
                lines.extend(f"    {c['name']}: {line}" for line in _breakdown(c))
        lines.extend(f"  {_claim_line(claim)}" for claim in report.get("claims", ()))
        if len(report.get("templates", ())) > 1:
            lines.append("  pods at full scale: " + ", ".join(
                f"{t['name']} {t['pods']}" for t in report["templates"]))
        if report.get("class"):
            lines.append(f"  class {report['class']} (namespace mode {report['enforcement']})")
        if report.get("injected"):
            lines.append("  written at admission (enforce_memory_limits): " + ", ".join(
                f"{i['container']} {i['name']}={i['value']}" for i in report["injected"]))
        for refusal in report.get("refusals", ()):
            how = "refused" if refusal["enforced"] else "not enforced in this mode"
            lines.append(f"  refusal [{refusal['rule']}, {how}]: {refusal['message']}")
        if report.get("admission"):
            lines.extend(admission_lines(report["admission"]))
        lines.extend(f"  error: {e}" for e in report["errors"])
        lines.extend(f"  warning: {w}" for w in report["warnings"])
        lines.append("")
    if gpu_memory is None and any(c["vram_fraction_per_gpu"] for r in reports for c in r["containers"]):
        lines.append("(pass --gpu-memory, e.g. 80Gi, to see fractions in bytes)")
    return "\n".join(lines).rstrip()


def _vram_text(container: Mapping[str, Any]) -> str:
    fraction, share, total = (
        container["vram_fraction_per_gpu"], container["share_bytes_per_gpu"], container["vram_bytes_per_gpu"]
    )
    if fraction is None and share is None:
        return "unknown: a whole GPU"
    extra = sum(a["bytes"] for a in container["allowances"])
    if total is not None:
        return format_bytes(total)
    return f"{fraction:g}" + (f" + {format_bytes(extra)}" if extra else "")


def _signed(count: int) -> str:
    return f"-{format_bytes(-count)}" if count < 0 else f"+{format_bytes(count)}"


def _breakdown(container: Mapping[str, Any]) -> list[str]:
    """What the container's VRAM per GPU is made of: the share, each allowance, the sum, with sources."""
    fraction, share = container["vram_fraction_per_gpu"], container["share_bytes_per_gpu"]
    if fraction is None and share is None:
        return []
    text = f"{fraction:g} of the GPU" if fraction is not None else ""
    if share is not None:
        text = f"{text} = {format_bytes(share)}" if text else format_bytes(share)
    version = f" {container['engine_version']}" if container.get("engine_version") else ""
    if container["ceiling"]:
        text += ", a ceiling on the whole device's use (at least half its budget)"
        if container["allowances"]:
            text += "; beyond it"
    lines = [f"share {text}" + (f" ({container['engine']}{version})" if container["engine"] else "")]
    for allowance in container["allowances"]:
        times = f"{allowance['processes']} x " if allowance["processes"] != 1 else ""
        each = allowance["bytes"] // max(allowance["processes"], 1)
        kind = "estimate" if allowance.get("estimate", True) else "certain"
        amount = format_bytes(each)
        if allowance["name"] == LEARNED:  # its amount depends on the product: learned per product
            amount = ", ".join(f"{_signed(b)} on {human_product(p)}" for p, b in allowance["bytes_by_product"].items())
        lines.append(f"+ {allowance['name']} {times}{amount} ({kind}): {allowance['source']}")
    if container["allowances"]:
        total = container["vram_bytes_per_gpu"]
        extra = sum(a["bytes"] for a in container["allowances"])
        if container.get("capped"):
            lines.append(
                f"= {format_bytes(total)} per GPU, the whole GPU: the estimates do not fit beside the share, so it "
                "is placed only where it is alone, and fails at start if they are as large"
            )
        else:
            lines.append(
                f"= {format_bytes(total)} per GPU" if total is not None
                else f"= {fraction:g} of the GPU + {format_bytes(extra)} per GPU"
            )
    lines.extend(f"rule: {rule}" for rule in container.get("rules", ()))
    return lines
