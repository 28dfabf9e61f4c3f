"""bench.restart's services: how the extender and the webhook are started, and the webhook's TLS files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import restart


class Started:
    def __init__(self, argv: list[str], **_: Any) -> None:
        self.argv = argv


@pytest.mark.parametrize(("kind", "scheme", "flags"), [
    ("extender", "http", ["--insecure-http", "--ops-listen", "--leader-elect"]),
    ("webhook", "https", ["--tls-cert", "--tls-key"]),
])
def test_each_service_is_started_with_its_own_listener_and_the_event_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, scheme: str, flags: list[str]
) -> None:
    monkeypatch.setattr(restart.subprocess, "Popen", Started)
    tls = restart.serving_files(tmp_path)
    service = restart.Service("python", kind, tmp_path / "kubeconfig", tmp_path / "log", tls)
    argv = service.process.argv  # type: ignore[attr-defined]
    assert argv[3] == kind
    assert service.ops.startswith(f"{scheme}://127.0.0.1:")
    assert all(flag in argv for flag in flags)
    assert argv[argv.index("--max-watch-event-bytes") + 1] == str(restart.MAX_EVENT_BYTES)


def test_the_webhook_certificate_is_made_once_per_work_folder(tmp_path: Path) -> None:
    cert, key = restart.serving_files(tmp_path)
    first = cert.read_bytes()
    assert b"BEGIN CERTIFICATE" in first and b"PRIVATE KEY" in key.read_bytes()
    assert restart.serving_files(tmp_path) == (cert, key) and cert.read_bytes() == first
