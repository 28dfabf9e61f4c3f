"""``vramguard agent``: one reading with ``--once``, and the start-up checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent_support import H100_TIME_SLICED, H100_USABLE, H100_UUIDS, kubelet_server, list_response
from vramguard.cli import main


def test_once_prints_the_snapshot_and_report_without_a_kubelet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["agent", "--once", "--nvml-recording", str(H100_TIME_SLICED),
                 "--podresources-socket", str(tmp_path / "absent.sock")])
    assert code == 0
    reading = json.loads(capsys.readouterr().out)
    assert reading["snapshot"]["gpus"][0]["uuid"] == H100_UUIDS[0]
    assert reading["report"]["gpus"][0] == {"id": "0", "memory_bytes": H100_USABLE, "foreign_bytes": 0}
    assert reading["podresources"] is None and "no kubelet PodResources socket" in reading["errors"]["podresources"]


def test_once_shows_the_kubelets_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    socket = tmp_path / "kubelet.sock"
    with kubelet_server(socket) as kubelet:
        kubelet.response = list_response({("ml", "vllm"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::0"]}}})
        assert main(["agent", "--once", "--nvml-recording", str(H100_TIME_SLICED),
                     "--podresources-socket", str(socket)]) == 0
    reading = json.loads(capsys.readouterr().out)
    assert reading["podresources"] == [
        {"namespace": "ml", "name": "vllm", "containers": {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::0"]}}}
    ]
    # GPU 0 is held by nobody: what is used there is foreign. Pods need their UIDs: none without the API.
    assert reading["report"]["gpus"][0]["foreign_bytes"] == 2 * 24470 * 2**20
    assert reading["report"]["pods"] == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--interval", "0"], "--interval must be positive"),
        (["--nvml-recording", "missing.json"], "no such file"),
        (["--listen", "nowhere"], "expected HOST:PORT"),
        (["--interval", "10", "--lease-duration", "19"], "--lease-duration must be at least twice --interval"),
    ],
)
def test_usage_errors(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-1")
    assert main(["agent", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_node_name_is_required(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["agent", "--nvml-recording", str(H100_TIME_SLICED)]) == 2
    assert "--node-name" in capsys.readouterr().err
