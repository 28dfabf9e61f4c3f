"""The README's first command, ``make demo`` (``python -m e2e.demo``), as a user runs it: it exits 0,
and where real nodes can run (always in CI) the pods that fit really run and the agent is fresh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import build, real_nodes

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_runs_seven_pods_and_keeps_one_pending(local_control_plane: build.Binaries, tmp_path: Path) -> None:
    env = {**os.environ, "KUBE_VERSION": local_control_plane.version, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "e2e.demo", "--dir", str(tmp_path / "demo")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=400, check=False)
    output = result.stdout
    assert result.returncode == 0, output + result.stderr[-4000:]
    assert "vramguard bound the pods that fit and kept the one that would crash-loop Pending." in output
    assert output.count("-> Pending:") == 1
    real = not real_nodes.missing()
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        assert real, f"real nodes cannot run in CI: {real_nodes.missing()}"
    if real:
        assert output.count("-> gpu-node-1 (Running)") == 7, output
        assert "time-slicing x4   fresh" in output, output
    else:
        assert "the node is an API object only" in output
