"""vramguard's own formats: each encodes to the bytes clusters already carry and decodes back;
junk written by others decodes to "nothing recorded", never an exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramguard.codecs import (
    AGENT_LEASE_PREFIX,
    MAX_LEASE_NAME,
    AgentReport,
    ClassFindingRecord,
    Placement,
    ReportedGpu,
    agent_lease_name,
    agent_lease_nodes,
    decode_class_findings,
    encode_class_findings,
    is_vramguard_key,
    vram_annotation,
)


def test_names_are_the_wire_names() -> None:
    assert vram_annotation() == "vramguard.io/vram"
    assert vram_annotation("vllm") == "vramguard.io/vram.vllm"
    assert agent_lease_name("gpu-1") == "vramguard-agent-gpu-1"


@pytest.mark.parametrize(("key", "owned"), [
    pytest.param("vramguard.io/placement", True, id="ours"),
    pytest.param("vramguard.iox/placement", False, id="lookalike-domain"),
    pytest.param("example.com/vramguard.io/x", False, id="not-a-prefix"),
    pytest.param(7, False, id="not-text"),
])
def test_is_vramguard_key(key: object, owned: bool) -> None:
    assert is_vramguard_key(key) is owned


def test_placement_encodes_as_clusters_carry_it_and_decodes_back() -> None:
    placement = Placement(node="n1", containers={"vllm": ("0", "1"), "init": ("0",)})
    text = placement.encode()
    assert text == '{"node":"n1","containers":{"vllm":["0","1"],"init":["0"]}}'
    assert Placement.decode(text) == placement


@pytest.mark.parametrize(("value", "containers"), [
    pytest.param(None, {}, id="absent"),
    pytest.param(42, {}, id="not-text"),
    pytest.param("{not json", {}, id="not-json"),
    pytest.param('["a"]', {}, id="not-an-object"),
    pytest.param('{"containers": "x"}', {}, id="containers-not-an-object"),
    pytest.param('{"containers": {"a": "0", "b": [0, "1"]}}', {"b": ("0", "1")}, id="bad-entry-skipped-ids-as-text"),
    pytest.param('{"containers": {"a": ["0"]}}', {"a": ("0",)}, id="no-node"),
])
def test_placement_decode_tolerates_junk(value: Any, containers: dict[str, tuple[str, ...]]) -> None:
    assert Placement.decode(value).containers == containers


def test_class_findings_round_trip_with_the_wire_key_class() -> None:
    record = ClassFindingRecord(rule="class-rule", class_name="shared", resource="nvidia.com/gpu",
                                sharing=("none",), message="class shared does not allow unshared GPUs")
    text = encode_class_findings([record])
    assert text == ('[{"rule":"class-rule","class":"shared","resource":"nvidia.com/gpu","sharing":["none"],'
                    '"message":"class shared does not allow unshared GPUs"}]')
    assert decode_class_findings(text) == (record,)


@pytest.mark.parametrize("value", [None, "", "{", '{"rule": 1}', '[{"rule": "x"}]'])
def test_class_findings_decode_junk_is_empty(value: Any) -> None:
    assert decode_class_findings(value) == ()


def test_agent_report_encodes_compact_sorted_and_decodes_back() -> None:
    report = AgentReport(
        gpus=(ReportedGpu(id="1", memory_bytes=80, foreign_bytes=3), ReportedGpu(id="0")),
        placements={"uid-b": {"c": ("1",)}, "uid-a": {"z": ("0",), "a": ("1", "0")}},
        used={"uid-b": {"1": 5}},
    )
    text = report.encode()
    assert text == (
        '{"gpus":[{"foreign_bytes":3,"id":"1","memory_bytes":80},{"foreign_bytes":0,"id":"0"}],'
        '"pods":{"uid-a":{"a":["1","0"],"z":["0"]},"uid-b":{"c":["1"]}},"used":{"uid-b":{"1":5}},"version":1}'
    )
    decoded, problems = AgentReport.decode(text)
    assert problems == []
    assert decoded == report


def test_agent_report_without_use_leaves_the_section_out() -> None:
    assert AgentReport().to_json() == {"version": 1, "gpus": [], "pods": {}}


@pytest.mark.parametrize(("text", "problem"), [
    pytest.param('{"version": 1, "gpus": [{"id": "0", "foreign_bytes": true}]}',
                 "agent report: gpus[0].foreign_bytes=True is not a byte count; ignored", id="bool-is-not-a-count"),
    pytest.param('{"version": 1, "gpus": [{"id": "0", "memory_bytes": 1.5}]}',
                 "agent report: gpus[0].memory_bytes=1.5 is not a byte count; ignored", id="float-is-not-a-count"),
    pytest.param('{"version": 1, "used": {"u": {"0": -1}}}',
                 "agent report: used[u][0]=-1 is not a byte count; ignored", id="negative-use"),
    pytest.param('{"version": 1, "pods": {"u": {"c": [0]}}}',
                 "agent report: pod u container c: not a list of ids; ignored", id="ids-not-text"),
])
def test_agent_report_junk_is_skipped_with_a_note(text: str, problem: str) -> None:
    report, problems = AgentReport.decode(text)
    assert report is not None
    assert problems == [problem]


@pytest.mark.parametrize("text", ["[]", "nope", '{"version": true}', '{"version": 2}'])
def test_agent_report_unusable_is_ignored(text: str) -> None:
    report, problems = AgentReport.decode(text)
    assert report is None
    assert problems and problems[0].startswith("agent report ignored: ")


def test_agent_lease_nodes() -> None:
    reported = {"gpu-1": object(), "gpu-2": object()}
    assert agent_lease_nodes("vramguard-agent-gpu-1", reported) == ["gpu-1"]
    assert agent_lease_nodes("vramguard-agent-gone", reported) == []
    assert agent_lease_nodes("kube-node-lease", reported) == []
    hashed = agent_lease_name("n" * MAX_LEASE_NAME)
    assert hashed.startswith(AGENT_LEASE_PREFIX) and len(hashed) == MAX_LEASE_NAME
    assert agent_lease_nodes(hashed, reported) == ["gpu-1", "gpu-2"]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
REPORT_LIKE = st.fixed_dictionaries(
    {"version": st.sampled_from([1, 1, True, "1", 2])},
    optional={"gpus": JSON_VALUES, "pods": JSON_VALUES, "used": JSON_VALUES},
)


@given(st.one_of(JSON_VALUES, REPORT_LIKE))
@settings(max_examples=300, deadline=None)
def test_decoders_never_raise_and_what_they_keep_round_trips(value: Any) -> None:
    text = json.dumps(value)
    report, problems = AgentReport.decode(text)
    assert report is not None or problems
    if report is not None:
        again, more = AgentReport.decode(report.encode())
        assert (again, more) == (report, [])
    placement = Placement.decode(text)
    assert Placement.decode(placement.encode()).containers == placement.containers
    decode_class_findings(text)
