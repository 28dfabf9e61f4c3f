"""Write the node agent's node affinity into the manifests from :func:`vramguard.platforms.gpu_node_selector_terms`.

    python scripts/agent_affinity.py           # rewrite it in manifests/base/agent.yaml and the chart values
    python scripts/agent_affinity.py --check   # exit 1, naming each file that is out of date

The agent runs on every node with NVIDIA GPUs however it is labelled (GPU Feature Discovery, GKE, AKS,
Karpenter, Node Feature Discovery, or an instance type of ``vramguard/gpu_platforms.yaml``): a new
instance type in the table is a new value here. Each file holds the affinity between the lines
``# BEGIN agent affinity`` and ``# END agent affinity``; ``tests/test_manifests.py`` calls
:func:`stale_files`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vramguard.platforms import gpu_node_selector_terms  # noqa: E402

FILES = {
    Path("manifests/base/agent.yaml"): "affinity",
    Path("charts/vramguard/values.yaml"): "affinity",
}
_BLOCK = re.compile(r"(?P<indent>[ ]*)# BEGIN agent affinity[^\n]*\n.*?(?P=indent)# END agent affinity\n", re.DOTALL)


def block(indent: str, key: str) -> str:
    """The generated lines, indented as the file's markers are."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": gpu_node_selector_terms()}}}
    body = yaml.safe_dump({key: affinity}, sort_keys=False, default_flow_style=False, width=100)
    lines = [f"{indent}# BEGIN agent affinity (scripts/agent_affinity.py; do not edit)"]
    lines += [f"{indent}{line}" if line else line for line in body.splitlines()]
    lines.append(f"{indent}# END agent affinity")
    return "\n".join(lines) + "\n"


def render(text: str, key: str) -> str:
    """``text`` with its affinity block regenerated."""
    match = _BLOCK.search(text)
    if match is None:
        raise ValueError("no '# BEGIN agent affinity' ... '# END agent affinity' block")
    return text[: match.start()] + block(match["indent"], key) + text[match.end():]


def stale_files(root: Path = ROOT) -> list[Path]:
    """The files whose affinity block differs from the generator's."""
    return [path for path, key in FILES.items() if render((root / path).read_text(), key) != (root / path).read_text()]


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite (or with ``--check``, list) the files."""
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = stale_files()
    if check:
        for path in stale:
            print(f"{path} is out of date: run python scripts/agent_affinity.py", file=sys.stderr)
        return 1 if stale else 0
    for path, key in FILES.items():
        (ROOT / path).write_text(render((ROOT / path).read_text(), key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
