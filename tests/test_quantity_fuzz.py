"""Quantities and annotation values of every size the API server accepts: a clear refusal, never a
crash, a traceback or a 500.

The API server caps an object's annotations at 256 KiB, keys and values together
(``TotalAnnotationSizeLimitB``, k8s.io/apimachinery v0.36.3 pkg/api/validation/objectmeta.go), and
keeps a decimal quantity of any length (pkg/api/resource/quantity.go ``ParseQuantity`` caps only the
binary-suffixed ones, at 2^63-1). Python turns no integer of more than 4300 digits into text, and no
integer above about 1.8e308 into a float, so a reader that does either on such a value fails. Each
entry point is driven here: the parsers, the webhook's ``/validate``, the extender's ``/filter`` and
``vramguard explain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extender.app import build_app
from tests.builders import gpu_node, vllm_pod
from tests.sync_app import SyncApp
from tests.test_extender import make
from tests.test_webhook_fuzz import Webhook, check_review_answer
from vramguard.cli import main
from vramguard.codecs import AgentReport
from vramguard.demand.model import VramError, parse_vram
from vramguard.io.http import Readiness
from vramguard.policy import parse_vram_limit
from vramguard.quantity import GiB, QuantityError, format_bytes, parse_bytes, parse_quantity, quantity_text

KEY = "vramguard.io/vram"
ANNOTATIONS_LIMIT = 256 * (1 << 10)
"""k8s.io/apimachinery v0.36.3 pkg/api/validation/objectmeta.go ``TotalAnnotationSizeLimitB``."""
LONGEST_VALUE = ANNOTATIONS_LIMIT - len(KEY)
INT64_MAX = (1 << 63) - 1
"""The largest quantity of a binary suffix the API server keeps (apimachinery v0.36.3
pkg/api/resource/math.go ``maxAllowed``)."""
LONGEST_MESSAGE = 400
"""A message quotes a refused value cut short: it never grows with the value."""
HUGE = "more than any GPU holds"

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])



@st.composite
def annotation_values(draw: st.DrawFn) -> str:
    """Text of any length up to the API server's limit, shaped like a quantity or a fraction or not."""
    size = draw(st.integers(0, 80) | st.integers(0, LONGEST_VALUE) | st.sampled_from([64, 65, 4300, 4301, 5000]))
    head = draw(st.sampled_from(["", "+", "-", "0.", ".", " "]))
    unit = draw(st.sampled_from(["1", "9", "0", "12", "1.5", "e", " ", "x"])
                | st.text(st.characters(codec="ascii"), min_size=1, max_size=3))
    tail = draw(st.sampled_from(["", "Gi", "Ei", "E", "e9", "e30", "e31", "m", "Mi", "k", " "]))
    body = (head + unit * (size // len(unit) + 1))[: max(size - len(tail), 0)]
    return body + tail if size >= len(tail) else draw(st.text(max_size=20))


HUGE_EXAMPLES = {
    "5000-digits": "1" * 5000,
    "5000-digits-gi": "1" * 5000 + "Gi",
    "300-digits-ei": "9" * 300 + "Ei",
    "5000-decimals": "0." + "1" * 5000,
    "the-api-servers-limit": "1" * LONGEST_VALUE,
    "spaces-around-digits": " " * 1000 + "1" * 100 + " " * 1000,
    "exponent-31": "1e31",
    "8ei": "8Ei",
    "2-to-the-63": str(INT64_MAX + 1),
}


# --------------------------------------------------------------------------- the parsers


@pytest.mark.parametrize("text", HUGE_EXAMPLES.values(), ids=HUGE_EXAMPLES.keys())
def test_a_huge_quantity_is_refused_as_huge_with_a_short_message(text: str) -> None:
    with pytest.raises(QuantityError) as caught:
        parse_bytes(text.strip())
    assert caught.value.reason == "huge"
    assert len(str(caught.value)) < LONGEST_MESSAGE
    with pytest.raises(VramError) as vram:
        parse_vram(text)
    assert vram.value.reason == "huge"
    assert len(str(vram.value)) < LONGEST_MESSAGE
    with pytest.raises(ValueError, match=HUGE) as limit:
        parse_vram_limit(text)
    assert len(str(limit.value)) < LONGEST_MESSAGE


@pytest.mark.parametrize(
    ("text", "expected"),
    [(str(INT64_MAX), INT64_MAX), ("8191Pi", 8191 << 50), ("9" * 18 + "." + "9" * 9, 10**18)],
    ids=["int64-max", "just-under-8ei", "long-but-not-huge"],
)
def test_the_largest_quantities_the_api_server_keeps_are_read(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@FUZZ
@given(annotation_values())
@example("1" * 5000).via("the 5000 digits that made the webhook answer 500")
def test_parsers_raise_only_their_own_error_with_a_short_message(text: str) -> None:
    for parse, error in ((parse_quantity, QuantityError), (parse_bytes, QuantityError), (parse_vram, VramError),
                         (parse_vram_limit, ValueError)):
        try:
            parse(text)
        except error as exc:
            assert len(str(exc)) < LONGEST_MESSAGE
    if len(text.strip()) > 64:
        with pytest.raises(VramError) as caught:
            parse_vram(text)
        assert caught.value.reason == "huge"


# --------------------------------------------------------------------------- the formatters


@settings(max_examples=200)
@given(st.integers() | st.sampled_from([10**5000, -(10**5000), 1 << 1100, INT64_MAX + 1, -INT64_MAX - 1]))
def test_byte_formatters_take_any_integer(count: int) -> None:
    for text in (format_bytes(count), quantity_text(count)):
        assert 0 < len(text) < 40


@pytest.mark.parametrize(
    ("count", "bytes_text", "quota_text"),
    [(INT64_MAX, "8589934592.0 GiB", "8589934592Gi"), (INT64_MAX + 1, "at least 8 EiB", "at least 8Ei"),
     (10**5000, "at least 8 EiB", "at least 8Ei"), (-(10**5000), "at most -8 EiB", "at most -8Ei"),
     (3 * GiB // 2, "1.5 GiB", "1.5Gi")],
    ids=["int64-max", "2-to-the-63", "5001-digits", "negative-5001-digits", "ordinary"],
)
def test_byte_formatters_name_counts_past_any_quantity_as_such(count: int, bytes_text: str, quota_text: str) -> None:
    assert (format_bytes(count), quantity_text(count)) == (bytes_text, quota_text)


# --------------------------------------------------------------------------- the webhook


@pytest.fixture(scope="module")
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


def gpu_pod(annotations: dict[str, str], gpus: Any = 1, env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A vLLM pod asking for ``gpus`` nvidia.com/gpu, with the given annotations."""
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
                                 "args": ["--model", "m", "--gpu-memory-utilization", "0.2"],
                                 "resources": {"limits": {"nvidia.com/gpu": gpus}}}
    if env:
        container["env"] = env
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "uid": "u1", "annotations": annotations},
            "spec": {"containers": [container]}}


def review(pod: dict[str, Any], namespace: str) -> dict[str, Any]:
    """A pod CREATE review as the API server sends it."""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                        "namespace": namespace, "object": pod}}


def findings(body: dict[str, Any]) -> list[str]:
    """Every problem the answer reports: the denial, the warnings and the audit annotation."""
    response = body["response"]
    audited = json.loads(response.get("auditAnnotations", {}).get("would-deny", "[]"))
    return [response.get("status", {}).get("message", ""), *response.get("warnings", []), *audited]


@pytest.mark.parametrize("namespace", ["enforced", "warned", "audited"])
@pytest.mark.parametrize("value", HUGE_EXAMPLES.values(), ids=HUGE_EXAMPLES.keys())
def test_the_webhook_refuses_a_huge_declaration_clearly_in_every_mode(
    webhook: Webhook, value: str, namespace: str
) -> None:
    status, body = webhook.validate(json.dumps(review(gpu_pod({KEY: value}), namespace)).encode())
    check_review_answer(status, body, "r1")
    named = [f for f in findings(body) if KEY in f]
    assert named and all(len(f) < 2 * LONGEST_MESSAGE for f in named), findings(body)
    if namespace == "enforced":
        assert body["response"]["allowed"] is False
        assert HUGE in body["response"]["status"]["message"]


QUANTITY_FIELDS = {
    "gpu-count": lambda v: gpu_pod({}, gpus=v),
    "mps-limit": lambda v: gpu_pod({}, env=[{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": f"0={v}G"}]),
    "pod-annotation": lambda v: gpu_pod({KEY: v}),
    "container-annotation": lambda v: gpu_pod({f"{KEY}.vllm": v}),
}


@FUZZ
@given(st.sampled_from(sorted(QUANTITY_FIELDS)), annotation_values(),
       st.sampled_from(["enforced", "warned", "audited"]))
@example("gpu-count", "1" * 5000, "warned").via("a device count past Python's digit limit")
@example("mps-limit", "1" * 5000, "warned").via("an MPS limit past Python's digit limit")
def test_any_quantity_a_pod_may_carry_gets_a_well_formed_answer(
    webhook: Webhook, field: str, value: str, namespace: str
) -> None:
    status, body = webhook.validate(json.dumps(review(QUANTITY_FIELDS[field](value), namespace)).encode())
    check_review_answer(status, body, "r1")
    if field != "mps-limit":  # its messages quote the variable as written
        assert all(len(f) < 4 * LONGEST_MESSAGE for f in findings(body)), "a message grew with the value"


# --------------------------------------------------------------------------- the extender


class Extender(SyncApp):
    """The extender's app on its own event loop, so that synchronous hypothesis tests can call it."""

    def __init__(self) -> None:
        _, verbs, _ = make([gpu_node("h100")])
        synced = asyncio.Event()
        synced.set()
        super().__init__(build_app(verbs, synced, Readiness(), CollectorRegistry()))

    def filter(self, pod: dict[str, Any]) -> tuple[int, Any]:
        return self.post("/filter", json={"Pod": pod, "Nodes": None, "NodeNames": ["h100"]})


@pytest.fixture(scope="module")
def extender() -> Iterator[Extender]:
    service = Extender()
    yield service
    service.close()


@FUZZ
@given(annotation_values(), st.sampled_from([KEY, f"{KEY}.vllm"]))
@example("1" * 5000, KEY).via("the 5000 digits that made /filter answer 500")
@example("9" * 300 + "Ei", KEY).via("a byte count past a float")
def test_filter_answers_any_declaration(extender: Extender, value: str, key: str) -> None:
    pod = vllm_pod("p", "0.2")
    pod["metadata"]["annotations"] = {key: value}
    status, body = extender.filter(pod)
    if status == 413:  # JSON writes a control character in 6 bytes: past the extender's body limit
        assert body["error"]
        return
    assert status == 200, body
    assert body["Error"] == "" and isinstance(body["NodeNames"], list)
    assert set(body["NodeNames"]) | set(body["FailedNodes"]) | set(body["FailedAndUnresolvableNodes"]) == {"h100"}


# --------------------------------------------------------------------------- vramguard explain


def explain(manifest: dict[str, Any], *args: str) -> tuple[int, str, str]:
    """``vramguard explain ARGS -`` on the manifest (JSON), in this process."""
    out, err = io.StringIO(), io.StringIO()
    with (mock.patch("sys.stdin", io.StringIO(json.dumps(manifest))), contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):
        code = main(["explain", *args, "-"])
    return code, out.getvalue(), err.getvalue()


@FUZZ
@given(annotation_values(), st.sampled_from([(), ("-o", "json"), ("--gpu-memory", "80Gi")]))
@example("1" * 5000, ()).via("the 5000 digits that made explain print a traceback")
@example("1" * 5000 + "Gi", ("-o", "json")).via("a byte count past the digit limit in JSON")
def test_explain_reports_any_declaration(value: str, args: tuple[str, ...]) -> None:
    code, out, _ = explain(gpu_pod({KEY: value}), *args)
    assert code in (0, 1)
    if len(value.strip()) > 64:
        assert code == 1 and HUGE in out


@pytest.mark.parametrize("gpu_memory", ["1" * 5000, "9" * 30 + "Ei"], ids=["5000-digits", "past-8ei"])
def test_explain_refuses_a_huge_gpu_memory_in_one_line(gpu_memory: str) -> None:
    code, out, err = explain(gpu_pod({}), "--gpu-memory", gpu_memory)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and len(err) < LONGEST_MESSAGE


# --------------------------------------------------------------------------- the agent's report


@pytest.mark.parametrize("count", [INT64_MAX + 1, 10**4000], ids=["2-to-the-63", "4001-digits"])
def test_an_agent_report_byte_count_past_any_quantity_is_ignored_with_a_reason(count: int) -> None:
    text = json.dumps({"version": 1, "gpus": [{"id": "0", "memory_bytes": count, "foreign_bytes": count}],
                       "used": {"u": {"0": count}}})
    report, problems = AgentReport.decode(text)
    assert report is not None
    assert report.gpus[0].memory_bytes is None and report.gpus[0].foreign_bytes == 0 and not report.used
    assert len(problems) == 3 and all("is not a byte count" in p for p in problems)
