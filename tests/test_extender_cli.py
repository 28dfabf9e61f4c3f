"""``vramguard extender`` start-up: the verbs are served to authenticated clients only, unless told."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramguard.cli import main
from vramguard.cli.extender import transport_problem

CERT, KEY, CA = Path("tls.crt"), Path("tls.key"), Path("ca.crt")


@pytest.mark.parametrize(
    ("tls_cert", "tls_key", "client_ca", "skip_client_auth", "insecure_http", "host", "problem"),
    [
        pytest.param(CERT, KEY, CA, False, False, "0.0.0.0", None, id="mutual-tls"),
        pytest.param(CERT, KEY, None, False, False, "127.0.0.1", "need --client-ca", id="tls-without-client-ca"),
        pytest.param(CERT, KEY, None, True, False, "0.0.0.0", None, id="explicitly-insecure-tls"),
        pytest.param(CERT, KEY, CA, True, False, "0.0.0.0", "contradicts --client-ca", id="both-ca-and-skip"),
        pytest.param(CERT, None, CA, False, False, "0.0.0.0", "go together", id="cert-without-key"),
        pytest.param(None, None, None, False, False, "127.0.0.1", "serving needs", id="nothing"),
        pytest.param(None, None, None, False, True, "127.0.0.1", None, id="plain-http-on-loopback"),
        pytest.param(None, None, None, False, True, "0.0.0.0", "loopback", id="plain-http-elsewhere"),
        pytest.param(None, None, CA, False, True, "127.0.0.1", "--client-ca needs --tls-cert", id="ca-without-tls"),
        pytest.param(CERT, KEY, CA, False, True, "127.0.0.1", "contradicts --tls-cert", id="http-and-tls"),
    ],
)
def test_transport_problem(
    tls_cert: Path | None,
    tls_key: Path | None,
    client_ca: Path | None,
    skip_client_auth: bool,
    insecure_http: bool,
    host: str,
    problem: str | None,
) -> None:
    found = transport_problem(tls_cert, tls_key, client_ca, skip_client_auth, insecure_http, host)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--tls-cert", "c", "--tls-key", "k"], "need --client-ca", id="no-client-ca"),
        pytest.param(["--ops-listen", "nope"], "--ops-listen 'nope'", id="bad-ops-listen"),
        pytest.param(["--listen", "0.0.0.0:8443", "--insecure-http"], "loopback", id="insecure-http-off-loopback"),
        pytest.param(["--leader-elect-renew-deadline", "15"], "renew deadline < lease duration",
                     id="renew-deadline-not-below-lease-duration"),
        pytest.param(["--leader-elect-retry-period", "0"], "0 < retry period", id="zero-retry-period"),
        pytest.param(["--leader-elect-lease-duration", "15.5"], "whole seconds", id="fractional-lease-duration"),
        pytest.param(["--scheduler-lease", "vramguard-scheduler", "--leader-elect=false"], "NAMESPACE/NAME",
                     id="scheduler-lease-without-namespace"),
        pytest.param(["--scheduler-lease", "ns/a/b", "--leader-elect=false"], "NAMESPACE/NAME",
                     id="scheduler-lease-with-two-slashes"),
        pytest.param(["--scheduler-lease", "ns/vramguard-scheduler"], "--leader-elect=false",
                     id="scheduler-lease-beside-an-election"),
    ],
)
def test_refuses_to_start(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["extender", *argv]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr
    assert stderr.startswith("vramguard extender: error:")


def test_unusable_client_ca_fails_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vramguard.io import certs  # noqa: PLC0415 - a service dependency, as in the command itself

    files = certs.write_serving_files(tmp_path, certs.issue_serving_certificate(certs.create_ca(), dns_names=["x"]))
    (tmp_path / "junk.crt").write_text("junk")
    code = main(["extender", "--tls-cert", str(files.tls_cert), "--tls-key", str(files.tls_key),
                 "--client-ca", str(tmp_path / "junk.crt")])
    assert code == 1
    assert "client CA" in capsys.readouterr().err


def test_leader_elect_takes_true_or_false_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["extender", "--leader-elect=yes"])
    assert exited.value.code == 2
    assert "expected true or false" in capsys.readouterr().err
