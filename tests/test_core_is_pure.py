"""The decision core imports no network, Kubernetes client or NVML library.

Checked twice: statically (no import statement in ``vramguard/`` names them, outside the CLI
handlers that start services and import them lazily), and at run time (importing every core module
loads none of them).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "vramguard"
FORBIDDEN = ("aiohttp", "kubernetes", "pynvml", "grpc", "service", "extender", "webhook", "agent")


def imported_modules(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_forbidden_imports_in_core_modules() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        # CLI handlers may import a service inside the function that runs it; nothing at module level.
        top_level_only = path.parent.name == "cli"
        for name in imported_modules(path, top_level_only):
            if name.split(".")[0] in FORBIDDEN:
                offenders.append(f"{path.relative_to(CORE.parent)} imports {name}")
    assert offenders == []


def test_importing_the_core_loads_no_forbidden_module() -> None:
    modules = sorted(
        ".".join(p.relative_to(CORE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in CORE.rglob("*.py")
        if p.name != "__main__.py"
    )
    script = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {FORBIDDEN!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
