"""The documentation keeps step with the code: generated pages current, links and anchors whole,
metric names real, every refusal code with its troubleshooting section, the README short.

Reads files only: no network, no cluster.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from vramguard.admission import Code
from vramguard.placement import Rule

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SOURCES = ("vramguard", "extender", "webhook", "agent")

README_MAX_LINES = 250
RUNBOOK_SECTIONS = (
    "GPU pods Pending on VRAM",
    "The extender is absent",
    "The webhook is absent",
    "An agent's report is stale",
    "Webhook failures in enforce namespaces",
)
"""Headings other files link to by anchor (the alerts' runbook_url): their text must not change."""


# --- reading Markdown -----------------------------------------------------------------------------


_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation but ``-`` and ``_`` removed, each
    space a hyphen (links and code spans read as their text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> list[tuple[int, str]]:
    """``(level, text)`` of every heading of a Markdown file, in order."""
    found = []
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor of a Markdown file, numbered as GitHub numbers repeated headings (``x``, ``x-1``)."""
    seen: dict[str, int] = {}
    found = set()
    for _, text in headings(path):
        slug = github_anchor(text)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def links(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, target)`` of every Markdown link and image outside code."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        text = _CODE_SPAN.sub("", line)
        for pattern in (_LINK, _IMAGE):
            for match in pattern.finditer(text):
                yield number, match.group(1)


def relative_links(path: Path) -> Iterator[tuple[int, str]]:
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        yield number, target


def resolve(page: Path, target: str) -> tuple[Path, str]:
    """The file a relative link points to, and its anchor (``""`` for none)."""
    file_part, _, fragment = target.partition("#")
    return ((page.parent / file_part).resolve() if file_part else page), fragment


# --- (a) the generated pages ----------------------------------------------------------------------


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_reference", module)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current() -> None:
    stale = _generator().stale_pages()
    assert not stale, f"out of date: {', '.join(map(str, stale))}; run `make docs` (python scripts/docs_reference.py)"


def test_check_mode_names_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generator = _generator()
    assert generator.stale_pages(tmp_path) == list(generator.PAGES)  # nothing written there yet
    assert generator.write(tmp_path) == list(generator.PAGES)
    assert generator.stale_pages(tmp_path) == []
    page = tmp_path / generator.POLICY_PAGE
    page.write_text(page.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")
    assert generator.stale_pages(tmp_path) == [generator.POLICY_PAGE]


def test_policy_reference_names_every_field() -> None:
    text = (DOCS / "policy-reference.md").read_text(encoding="utf-8")
    generator = _generator()
    for model in generator._model_sections(generator.Policy):
        assert f"## {model.__name__} (" in text, model.__name__
        for field in model.model_fields:
            assert f"| `{field}` |" in text, f"{model.__name__}.{field}"


def test_cli_reference_names_every_command_and_option() -> None:
    text = (DOCS / "cli-reference.md").read_text(encoding="utf-8")
    generator = _generator()
    vramguard, kubectl_vram = generator._build_parsers()
    for prog, parser in (("vramguard", vramguard), ("kubectl vram", kubectl_vram)):
        for name, _, sub in generator._subcommands(parser):
            assert f"### `{prog} {name}`" in text
            for action in generator._arguments(sub):
                for option in action.option_strings:
                    assert f"`{option}`" in text, f"{prog} {name} {option}"


# --- (b) links and anchors ------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for number, target in relative_links(page):
        file, fragment = resolve(page, target)
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not file.exists():
            broken.append(f"{where} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{where} (no heading #{fragment} in {file.relative_to(ROOT)})")
    assert not broken, "\n".join(broken)


def test_anchor_rules() -> None:
    assert github_anchor("An agent's report is stale") == "an-agents-report-is-stale"
    assert github_anchor("`vramguard explain`") == "vramguard-explain"
    assert github_anchor("QosClass (`classes.<name>`)") == "qosclass-classesname"
    assert github_anchor("DirectPlacement (`direct_placement`)") == "directplacement-direct_placement"
    assert github_anchor("Why is my pod Pending?") == "why-is-my-pod-pending"


def test_alert_runbooks_point_at_sections() -> None:
    """The alerts' runbook_url names a section of docs/troubleshooting.md that exists."""
    for rules in sorted((ROOT / "manifests" / "monitoring").glob("*.yaml")):
        for group in yaml.safe_load(rules.read_text(encoding="utf-8"))["groups"]:
            for rule in group["rules"]:
                url = rule.get("annotations", {}).get("runbook_url")
                if url is None:
                    continue
                file, _, fragment = url.partition("#")
                assert (ROOT / file).resolve() == TROUBLESHOOTING, rule["alert"]
                assert fragment in anchors(TROUBLESHOOTING), f"{rule['alert']}: {url}"


def test_runbook_headings_are_kept() -> None:
    texts = {text for level, text in headings(TROUBLESHOOTING) if level == 2}
    for heading in RUNBOOK_SECTIONS:
        assert heading in texts, heading


# --- (c) metric names -----------------------------------------------------------------------------


_METRIC = re.compile(r"\bvramguard_[a-z_]+")
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _python_files() -> Iterator[Path]:
    for package in SOURCES:
        yield from sorted((ROOT / package).rglob("*.py"))


@cache
def known_metrics() -> frozenset[str]:
    """The metric names the code and the shipped monitoring files name.

    From the Python sources: every string literal ``vramguard_...``, and every f-string
    ``f"{prefix}_suffix"`` with each value a prefix variable or parameter is given
    (``metrics_prefix="vramguard_webhook"``, ``PREFIX = "vramguard_agent"``). From
    ``manifests/monitoring`` and ``manifests/grafana``: every name their expressions use.
    """
    literals: set[str] = set()
    prefixes: set[str] = set()
    suffixes: set[str] = set()

    def prefix_value(name: str, value: ast.AST | None) -> None:
        if "prefix" in name.lower() and isinstance(value, ast.Constant) and isinstance(value.value, str):
            prefixes.add(value.value)

    for path in _python_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"vramguard_[a-z_]+", node.value):
                    literals.add(node.value)
            elif isinstance(node, ast.JoinedStr) and len(node.values) == 2:
                first, rest = node.values
                if (
                    isinstance(first, ast.FormattedValue)
                    and isinstance(rest, ast.Constant)
                    and isinstance(rest.value, str)
                    and re.fullmatch(r"_[a-z_]+", rest.value)
                ):
                    suffixes.add(rest.value)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        prefix_value(target.id, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                prefix_value(node.target.id, node.value)
            elif isinstance(node, ast.keyword) and node.arg is not None:
                prefix_value(node.arg, node.value)
            elif isinstance(node, ast.arguments):
                positional = [*node.posonlyargs, *node.args]
                for arg, default in zip(positional[len(positional) - len(node.defaults):], node.defaults, strict=True):
                    prefix_value(arg.arg, default)
                for arg, kw_default in zip(node.kwonlyargs, node.kw_defaults, strict=True):
                    prefix_value(arg.arg, kw_default)
    names = set(literals)
    names.update(prefix + suffix for prefix in prefixes if prefix.startswith("vramguard") for suffix in suffixes)
    monitoring = [
        *sorted((ROOT / "manifests" / "monitoring").glob("*.yaml")),
        *sorted((ROOT / "manifests" / "grafana").glob("*")),
    ]
    for path in monitoring:
        names.update(_METRIC.findall(path.read_text(encoding="utf-8")))
    return frozenset(names)


def metric_exists(name: str) -> bool:
    """Whether a name the docs use is a known metric, a sample of one (``_total``, ``_bucket`` ...),
    or, ending in ``_`` (``vramguard_gpu_*``), the prefix of one."""
    known = known_metrics()
    if name.endswith("_"):
        return any(metric.startswith(name) for metric in known)
    if name in known:
        return True
    return any(name.endswith(suffix) and name.removesuffix(suffix) in known for suffix in _SAMPLE_SUFFIXES)


def test_known_metrics_are_found() -> None:
    """The extraction itself: names built each way are found."""
    known = known_metrics()
    assert "vramguard_extender_leader" in known  # a literal
    assert "vramguard_webhook_http_request_duration_seconds" in known  # metrics_prefix="vramguard_webhook"
    assert "vramguard_http_request_duration_seconds" in known  # the parameter's default prefix
    assert "vramguard_agent_gpu_memory_used_bytes" in known  # PREFIX = "vramguard_agent"
    assert metric_exists("vramguard_extender_decisions_total")
    assert metric_exists("vramguard_gpu_")
    assert not metric_exists("vramguard_no_such_metric")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_metric_names_exist(page: Path) -> None:
    unknown = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for name in _METRIC.findall(line):
            if not metric_exists(name):
                unknown.append(f"{page.relative_to(ROOT)}:{number}: {name}")
    assert not unknown, "metrics named in the docs that the code does not export:\n" + "\n".join(unknown)


# --- (d) troubleshooting covers every code ---------------------------------------------------------


_CODE_HEADING = re.compile(r"^`([a-z][a-z0-9-]*)`")


def code_sections() -> dict[str, str]:
    """Each level-3 heading of docs/troubleshooting.md that starts with a code span: code -> heading."""
    found = {}
    for level, text in headings(TROUBLESHOOTING):
        match = _CODE_HEADING.match(text)
        if level == 3 and match:
            found[match.group(1)] = text
    return found


def test_every_code_has_a_troubleshooting_section() -> None:
    sections = code_sections()
    missing = sorted(({str(c) for c in Code} | {str(r) for r in Rule}) - set(sections))
    assert not missing, f"no section '### `code` ...' in docs/troubleshooting.md for: {', '.join(missing)}"


def test_every_code_in_troubleshooting_exists() -> None:
    codes = {str(c) for c in Code} | {str(r) for r in Rule}
    unknown = sorted(set(code_sections()) - codes)
    assert not unknown, f"docs/troubleshooting.md has sections for codes the code does not have: {', '.join(unknown)}"


def test_troubleshooting_starts_with_pending() -> None:
    level_two = [text for level, text in headings(TROUBLESHOOTING) if level == 2]
    assert level_two[0] == "Why is my pod Pending?"


# --- (e) the README -------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES}"


def test_readme_links_install_troubleshooting_and_policy() -> None:
    targets = {resolve(README, target)[0] for _, target in relative_links(README)}
    for page in ("install.md", "troubleshooting.md", "policy-reference.md"):
        assert (DOCS / page).resolve() in targets, f"README.md does not link docs/{page}"
    fragments = {target for _, target in relative_links(README)}
    assert "docs/troubleshooting.md#why-is-my-pod-pending" in fragments


def test_readme_links_every_docs_page() -> None:
    targets = {resolve(README, target)[0] for _, target in relative_links(README)}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in targets)
    assert not unlinked, f"README.md links no: {', '.join(unlinked)}"
