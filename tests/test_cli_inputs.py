"""What explain and plan read: several files and directories as kubectl takes them, and YAML or JSON
with a key given twice refused with its line (two files concatenated without '---' would otherwise
read as one object, the second's fields silently replacing the first's)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from vramguard.cli import main
from vramguard.demand.objects import load_each_document

ROOT = Path(__file__).parent.parent
NODES = ROOT / "examples" / "nodes.yaml"
SEED = ROOT / "examples" / "seed.yaml"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_concatenated_files_without_a_separator_are_an_error_naming_the_line() -> None:
    text = NODES.read_text() + SEED.read_text()  # `cat nodes.yaml seed.yaml`: no '---' between them
    documents = load_each_document(text)
    [broken] = [d for d in documents if d.error is not None]
    line = len(NODES.read_text().splitlines()) + 2  # the seed's first key, after its comment line
    assert broken.error == (
        f"not valid YAML or JSON at line {line}: duplicate key 'apiVersion' (two objects without '---' between them?)"
    )


def test_a_key_twice_in_json_is_an_error_too() -> None:
    [document] = load_each_document('{"kind": "Pod", "metadata": {"name": "a"}, "kind": "Node"}')
    assert document.error is not None and "duplicate key 'kind'" in document.error


def test_yaml_merge_keys_still_override() -> None:
    text = "base: &b {kind: Pod}\nobj:\n  <<: *b\n  kind: Node\n"
    [document] = load_each_document("kind: List\nitems: []\n" + "---\n" + text)
    assert document.error is None


def test_several_files_with_f_as_kubectl_takes_them(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "-f", str(NODES), "-f", str(SEED))
    assert code == 0, err
    assert out.count("placed   team-a/chat-") == 4


def test_a_directory_and_its_subdirectories_with_r(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "nodes.yaml").write_text(NODES.read_text())
    (tmp_path / "seed.yml").write_text(SEED.read_text())
    (tmp_path / "README.md").write_text("not a manifest")
    code, out, _ = run(capsys, "plan", str(tmp_path))
    assert code == 1 and "pending  team-a/chat-0" in out  # the nodes are one level down: not read
    code, out, err = run(capsys, "plan", "-R", str(tmp_path))
    assert code == 0, err
    code, _, err = run(capsys, "explain", str(tmp_path / "nodes" / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err


def test_no_input_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "explain")
    assert code == 2 and "no input" in err
    code, _, err = run(capsys, "plan", str(tmp_path))
    assert code == 2 and "no .yaml, .yml or .json file (-R reads subdirectories)" in err


def test_standard_input_still_works(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(SEED.read_text()))
    code, out, _ = run(capsys, "explain", "-")
    assert code == 0 and "Deployment team-a/chat" in out


@pytest.mark.parametrize("command", ["explain", "plan"])
def test_unreadable_files_are_said_in_words_not_as_python_errors(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    for args, said in (
        (["--policy", str(tmp_path), str(SEED)], f"cannot read policy {tmp_path}: is a directory"),
        ([str(tmp_path / "absent.yaml")], f"{tmp_path / 'absent.yaml'}: no such file or directory"),
        ([str(binary)], f"{binary}: not UTF-8 text"),
    ):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        assert said in err and "Errno" not in err and "Traceback" not in err
