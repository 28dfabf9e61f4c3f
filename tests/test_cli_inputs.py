"""What explain and plan read: several files and directories as kubectl takes them, and YAML or JSON
with a key given twice refused with its line (two files concatenated without '---' would otherwise
read as one object, the second's fields silently replacing the first's)."""

from __future__ import annotations

import io
import json
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
    comment = sum(1 for line in SEED.read_text().splitlines() if line.startswith("#"))
    line = len(NODES.read_text().splitlines()) + comment + 1  # the seed's first key, after its comment
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


def _laughs(levels: int = 9) -> str:
    """Nested YAML aliases, ten copies a level: a few hundred characters, 10**levels strings."""
    text = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"
    for level in range(1, levels):
        text += f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 10) + "]\n"
    return text


@pytest.mark.timeout(60)
def test_yaml_aliases_that_expand_past_the_bound_are_an_error_not_a_memory_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The engine's arguments are 10**8 strings once expanded: reading them must not be tried.
    pod = tmp_path / "pod.yaml"
    pod.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n" + "x-anchors:\n"
        + "".join(f"  {line}\n" for line in _laughs().splitlines())
        + "spec:\n  containers: [{name: c, image: vllm/vllm-openai:v0.11.0, args: *l8,"
          " resources: {limits: {nvidia.com/gpu: 1}}}]\n"
    )
    assert len(pod.read_text()) < 1000
    for command in ("explain", "plan"):
        code, _, err = run(capsys, command, str(pod), str(NODES))
        assert code == 2 and "its aliases expand to more than 1,000,000 nodes" in err, err


@pytest.mark.parametrize(("text", "said"), [
    ("a: &a [*a]\n", "an alias refers to a node that contains it"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
])
def test_recursive_aliases_and_deep_nesting_are_said_in_words(text: str, said: str) -> None:
    [document] = load_each_document(text)
    assert document.error is not None and said in document.error


@pytest.mark.timeout(60)
def test_a_ray_serve_setting_behind_nested_aliases_is_not_expanded(tmp_path: Path) -> None:
    # 707 characters of serveConfigV2 made `explain` expand 10**8 items: the webhook reads it too.
    config = _laughs() + (
        "applications: [{import_path: 'ray.serve.llm:build_openai_app', "
        "args: {llm_configs: [{engine_kwargs: {gpu_memory_utilization: *l8}}]}}]\n"
    )
    service = {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "llm"}, "spec": {
        "serveConfigV2": config,
        "rayClusterConfig": {"headGroupSpec": {"template": {"spec": {"containers": [{"name": "h", "image": "r"}]}}},
                             "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1, "template": {"spec": {
                                 "containers": [{"name": "w", "image": "rayproject/ray-llm:2.52.0",
                                                 "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}]}}}
    path = tmp_path / "service.json"
    path.write_text(json.dumps(service))
    assert main(["explain", "-o", "json", str(path)]) == 0
