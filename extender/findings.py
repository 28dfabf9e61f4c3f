"""Class rules broken where the namespace does not enforce them: recorded at bind, never refused.

In ``warn`` and ``audit`` namespaces a node whose sharing strategy the pod's class does not allow
stays in the filter's answer (the VRAM budget still holds). At bind vramguard records what it let
through: an annotation on the Binding (the API server copies it onto the pod, so no extra patch),
a counter per rule and mode, and in ``warn`` namespaces one Warning Event on the pod.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from extender.events import post_pod_event
from vramguard.cluster import PodKey
from vramguard.codecs import CLASS_FINDINGS_ANNOTATION, encode_class_findings
from vramguard.io.kube import KubeClient
from vramguard.placement import ClassFinding

logger = logging.getLogger(__name__)

EVENT_REASON = "ClassRuleNotEnforced"


def findings_annotations(findings: Sequence[ClassFinding]) -> dict[str, str]:
    """The Binding's annotation listing the findings as JSON data; empty when there are none."""
    if not findings:
        return {}
    return {CLASS_FINDINGS_ANNOTATION: encode_class_findings([f.record() for f in findings])}


class FindingsReporter:
    """Counts the findings let through at bind and, in ``warn`` namespaces, tells the pod's owner."""

    def __init__(self, client: KubeClient | None, registry: CollectorRegistry) -> None:
        self.client = client
        self.counter = Counter(
            "vramguard_extender_class_findings",
            "Pods bound on a node their class does not allow, where the namespace does not enforce it.",
            labelnames=("rule", "mode"),
            registry=registry,
        )

    async def report(self, pod: PodKey, node: str, mode: str, findings: Sequence[ClassFinding]) -> None:
        """Count and, in ``warn`` mode, post one Warning Event; an API failure is logged, not raised."""
        for finding in findings:
            self.counter.labels(str(finding.rule), mode).inc()
        if mode != "warn" or not findings or self.client is None:
            return
        message = "; ".join(f.message for f in findings)
        text = f"bound to {node}: {message}; namespace mode warn, enforce would refuse the node"
        await post_pod_event(self.client, pod, EVENT_REASON, text, "Warning")
