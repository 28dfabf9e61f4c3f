"""The Dockerfile, read as text (no container engine needed): pinned, multi-stage, non-root, read-only friendly."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def build_args() -> dict[str, str]:
    """ARG defaults."""
    return dict(arg.split("=", 1) for keyword, arg in instructions() if keyword == "ARG" and "=" in arg)


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each stage, in order."""
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def test_multi_stage_from_pinned_python_slim() -> None:
    froms = [rest.split() for keyword, rest in instructions() if keyword == "FROM"]
    names = {words[-1] for words in froms if len(words) == 3 and words[1].upper() == "AS"}
    images = [words[0] for words in froms if words[0] not in names]
    assert len(froms) >= 2 and images
    for image in images:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: build_args()[m[1]], image)
        assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?@sha256:[0-9a-f]{64}", resolved), resolved


def test_runtime_copies_only_the_built_environment() -> None:
    runtime = stages()[-1]
    copies = [rest for keyword, rest in runtime if keyword == "COPY"]
    assert copies and all(c.startswith(("--from=builder ", "--from=dependencies ")) for c in copies)
    assert not any(keyword == "RUN" and "pip install" in rest for keyword, rest in runtime)


def test_runtime_user_is_numeric_and_not_root() -> None:
    users = [rest for keyword, rest in stages()[-1] if keyword == "USER"]
    assert users, "the runtime stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0
    assert not gid or (gid.isdigit() and int(gid) != 0)


def test_read_only_root_filesystem_friendly() -> None:
    env = " ".join(rest for keyword, rest in stages()[-1] if keyword == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "HOME=/tmp" in env


def test_entrypoint_is_vramguard() -> None:
    entrypoints = [rest for keyword, rest in instructions() if keyword == "ENTRYPOINT"]
    assert entrypoints[-1] == '["vramguard"]'


def test_installs_are_pinned() -> None:
    for keyword, rest in instructions():
        if keyword == "RUN":
            for match in re.finditer(r"pip install ([^&]+)", rest):
                for requirement in match[1].split():
                    if not requirement.startswith("-") and not requirement.endswith(".whl"):
                        assert "==" in requirement, requirement


def test_every_package_is_copied() -> None:
    """The builder copies the build context; .dockerignore's allowlist lets every package through."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {rest.split()[0].rstrip("/") for stage in stages()[:-1] for keyword, rest in stage if keyword == "COPY"}
    assert "." in copied
    ignore = (ROOT / ".dockerignore").read_text()
    for package in packages:
        assert f"!{package}/" in ignore


def test_no_syntax_directive() -> None:
    """A ``# syntax=`` line makes BuildKit pull a frontend image that PYTHON_IMAGE cannot redirect."""
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE.read_text(), re.M | re.I)


def test_locked_dependencies_are_installed_in_a_layer_before_the_code() -> None:
    builder = stages()[0]
    lock_copy = builder.index(("COPY", "requirements.lock /src/requirements.lock"))
    installs = [i for i, (keyword, rest) in enumerate(builder) if keyword == "RUN" and "--require-hashes" in rest]
    assert installs and lock_copy < installs[0]
    assert "-r /src/requirements.lock" in builder[installs[0]][1]
    # The code comes in a later stage, built on this one; the runtime copies the two apart.
    assert not any(keyword == "COPY" and rest.startswith(". ") for keyword, rest in builder)
    assert stages()[1][0] == ("FROM", "dependencies AS builder")
    assert any(keyword == "COPY" and rest.startswith(". ") for keyword, rest in stages()[1])
    runtime_copies = [rest for keyword, rest in stages()[-1] if keyword == "COPY"]
    assert runtime_copies[:2] == ["--from=dependencies /opt/vramguard /opt/vramguard", "--from=builder /app/ /"]


def test_bytecode_is_hash_based() -> None:
    runs = " ".join(rest for stage in stages()[:2] for keyword, rest in stage if keyword == "RUN")
    assert "--invalidation-mode unchecked-hash" in runs
    assert "scripts/stage_app.py" in runs
    assert "PycInvalidationMode.UNCHECKED_HASH" in (ROOT / "scripts" / "stage_app.py").read_text()
    assert all("--no-compile" in match for match in re.findall(r"pip [^&]*install[^&]*", runs))


def test_runtime_has_no_pip_or_setuptools() -> None:
    builder_runs = " ".join(rest for keyword, rest in stages()[0] if keyword == "RUN")
    assert "venv --without-pip /opt/vramguard" in builder_runs
    runtime_runs = " ".join(rest for keyword, rest in stages()[-1] if keyword == "RUN")
    assert "pip uninstall --yes --quiet pip setuptools wheel" in runtime_runs


def test_oci_labels() -> None:
    labels = " ".join(rest for keyword, rest in stages()[-1] if keyword == "LABEL")
    for name, value in [("version", "${VERSION}"), ("revision", "${REVISION}"), ("source", "${SOURCE}"),
                        ("licenses", "Apache-2.0")]:
        assert f'org.opencontainers.image.{name}="{value}"' in labels


def test_license_file_is_shipped() -> None:
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "!LICENSE" in (ROOT / ".dockerignore").read_text()
    assert any(keyword == "COPY" and "LICENSE" in rest for keyword, rest in stages()[-1])


LOCK = ROOT / "requirements.lock"


def locked() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of every requirement in requirements.lock."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    found = {}
    for line in text.splitlines():
        match = re.match(r"([a-z0-9][a-z0-9._-]*)==(\S+)", line)
        if match:
            found[match[1]] = (match[2], re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    return found


def test_every_locked_requirement_has_hashes() -> None:
    entries = locked()
    assert len(entries) > 9, "transitive dependencies are locked too"
    assert {name for name, (_, hashes) in entries.items() if not hashes} == set()


def test_lock_pins_what_pyproject_pins() -> None:
    """The offline half of ``make lock-check``: each direct dependency is locked at its pinned version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entries = locked()
    for requirement in project["project"]["dependencies"]:
        name, _, version = requirement.partition("==")
        normalized = re.sub(r"[-_.]+", "-", name).lower()
        assert entries.get(normalized, ("missing",))[0] == version, requirement
