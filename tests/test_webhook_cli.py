"""``vramguard webhook``: the command line, and start-up failures that say what is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vramguard.cli import main
from vramguard.cli.webhook import parse_listen
from vramguard.io import certs


def test_help_lists_the_options() -> None:
    result = subprocess.run([sys.executable, "-m", "vramguard", "webhook", "--help"], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0
    for option in ("--listen", "--tls-cert", "--tls-key", "--kubeconfig", "--policy", "--drain-delay"):
        assert option in result.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("127.0.0.1:8443", ("127.0.0.1", 8443), id="ipv4"),
        pytest.param("0.0.0.0:0", ("0.0.0.0", 0), id="any-port"),
        pytest.param("[::1]:9443", ("::1", 9443), id="ipv6"),
        pytest.param("localhost:443", ("localhost", 443), id="name"),
    ],
)
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("8443", "expected HOST:PORT", id="no-host"),
        pytest.param(":8443", "the host is missing", id="empty-host"),
        pytest.param("0.0.0.0:http", "expected HOST:PORT", id="named-port"),
        pytest.param("0.0.0.0:70000", "outside 0..65535", id="port-range"),
        pytest.param("[nope]:1", "is not an IPv6 address", id="bad-ipv6"),
    ],
)
def test_parse_listen_refuses(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_listen(text)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    leaf = certs.issue_serving_certificate(certs.create_ca(), dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    files = certs.write_serving_files(tmp_path / "tls", leaf)
    return files.tls_cert, files.tls_key


def run(*args: str) -> int:
    return main(["webhook", *args])


def test_bad_listen_is_a_usage_error(tls_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = tls_files
    assert run("--listen", "nowhere", "--tls-cert", str(cert), "--tls-key", str(key)) == 2
    assert "vramguard webhook: error: --listen 'nowhere': expected HOST:PORT" in capsys.readouterr().err


def test_negative_drain_delay_is_a_usage_error(
    tls_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = tls_files
    assert run("--drain-delay", "-1", "--tls-cert", str(cert), "--tls-key", str(key)) == 2
    assert "--drain-delay must not be negative" in capsys.readouterr().err


def test_invalid_policy_fails_start_up(tls_files: tuple[Path, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = tls_files
    policy = tmp_path / "policy.yaml"
    policy.write_text("classes: {a: {sharing: [none]}}\nenforcement: strict\n")
    assert run("--policy", str(policy), "--tls-cert", str(cert), "--tls-key", str(key)) == 1
    err = capsys.readouterr().err
    assert "vramguard webhook: error:" in err and "enforcement" in err


def test_missing_tls_files_fail_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--tls-cert", str(tmp_path / "tls.crt"), "--tls-key", str(tmp_path / "tls.key")) == 1
    assert "cannot read" in capsys.readouterr().err


def test_missing_kubeconfig_fails_start_up(tls_files: tuple[Path, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = tls_files
    assert run("--kubeconfig", str(tmp_path / "nope"), "--tls-cert", str(cert), "--tls-key", str(key)) == 1
    assert "cannot load the Kubernetes configuration" in capsys.readouterr().err
