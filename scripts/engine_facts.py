"""Read an engine release's memory facts from its wheel, next to the rule vramguard applies to it.

    python scripts/engine_facts.py vllm 0.9.0
    python scripts/engine_facts.py sglang 0.5.23
    python scripts/engine_facts.py vllm 0.25.1 --source DIR    # an unpacked release already at hand

Not run in CI (it downloads the release's ``.py`` files from PyPI, as ``scripts/engine_options.py``
does). The rules of :mod:`vramguard.engines.vllm` and :mod:`vramguard.engines.sglang` depend on a few
facts of each release; this prints each fact as the release's source has it, with the file, line and
the lines themselves, so that a person can check the reading, and the rule vramguard applies to that
version beside it. A new release is then a table row, not an investigation.

vLLM: the default ``--gpu-memory-utilization``; the default engine generation (``VLLM_USE_V1``); for
each engine present, whether its KV budget is per instance (from a snapshot taken after the CUDA
context exists) or device-wide (every process's use counted); whether CUDA graphs are captured after
the KV cache is allocated; the default of ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``; whether Model
Runner V2 estimates graphs as 0. SGLang: what ``--mem-fraction-static`` is a fraction of, how the
chunk is split among data-parallel attention ranks, and where the default fraction's reserve is
computed. Exit 1 when a fact the script can classify disagrees with vramguard's rule.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_options import fetch, version_tuple  # noqa: E402 - the sibling script: the same download


@dataclass(frozen=True)
class Fact:
    """One fact of a release: what it is, the value read, where, and the lines it was read from."""

    name: str
    value: str
    where: str
    lines: tuple[str, ...] = ()
    rule: str | None = None
    """What vramguard's rule says for this version, where it says something comparable."""

    @property
    def disagrees(self) -> bool:
        return self.rule is not None and self.rule != self.value


def functions(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """Each definition of function ``name`` in ``path``: its first line number and its source."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            yield node.lineno, ast.get_source_segment(text, node) or ""


def matching(source: str, pattern: str, first: int = 1) -> tuple[str, ...]:
    """The lines of ``source`` matching ``pattern``, each with its line number."""
    return tuple(
        f"{first + i}: {line.strip()}" for i, line in enumerate(source.splitlines()) if re.search(pattern, line)
    )


def first_match(root: Path, files: Sequence[str], pattern: str) -> tuple[str, str] | None:
    """The first group of ``pattern`` in the first of ``files`` that has it, and where."""
    for name in files:
        path = root / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            found = re.search(pattern, line)
            if found:
                return found.group(1), f"{name}:{number}"
    return None


# -- vLLM ----------------------------------------------------------------------------------------------

DEVICE_WIDE = r"non_torch_allocations|mem_get_info\(\)\[1\] - torch\.cuda\.mem_get_info\(\)\[0\]"
PER_INSTANCE = r"init_snapshot|baseline|requested_memory|memory_for_current_instance|init_gpu_memory"


def budget_kind(source: str) -> str:
    """``device-wide`` where the function counts every process's use, ``per-instance`` where it counts
    from the process's own snapshot, else ``unclassified``."""
    if re.search(DEVICE_WIDE, source):
        return "device-wide"
    if re.search(PER_INSTANCE, source):
        return "per-instance"
    return "unclassified"


def graphs_after_allocation(source: str, allocate: str, capture: str) -> str:
    """``after`` where ``capture`` is called after ``allocate`` in ``source``, ``before`` or ``unclassified``."""
    allocated, captured = source.find(allocate), source.find(capture)
    if allocated < 0 or captured < 0:
        return "unclassified"
    return "after" if captured > allocated else "before"


def vllm_facts(root: Path, version: tuple[int, int, int]) -> list[Fact]:
    from vramguard.demand.commandline import ContainerEnv  # noqa: PLC0415
    from vramguard.engines import vllm  # noqa: PLC0415

    facts: list[Fact] = []
    default = first_match(
        root, ("vllm/config/cache.py", "vllm/config.py", "vllm/engine/arg_utils.py"),
        r"gpu_memory_utilization: float(?: \| None)? = (?:Field\(\s*default=)?([0-9.]+|None)",
    )
    expected = "None" if version >= vllm.EXTENSIBLE_CACHE_SINCE else (
        "0.92" if version >= vllm.DEFAULT_092_SINCE else "0.9")
    if default is not None:
        value = "0.9" if default[0] in ("0.9", "0.90") else default[0]
        facts.append(Fact("default --gpu-memory-utilization", value, default[1], rule=expected))
    engine = first_match(root, ("vllm/envs.py",), r'os\.getenv\("VLLM_USE_V1", "(\d)"\)')
    rule_engine = vllm.engine_generation(version, ContainerEnv({}))
    if engine is not None:
        facts.append(Fact("default engine (VLLM_USE_V1)", "V1" if engine[0] == "1" else "V0", engine[1],
                          rule=rule_engine))
    elif version < vllm.V0_GONE_SINCE:
        facts.append(Fact("default engine (VLLM_USE_V1)", "V0", "vllm/envs.py (no VLLM_USE_V1: the old engine only)",
                          rule=rule_engine))
    for generation, path, names in (
        ("V0", "vllm/worker/worker.py", ("determine_num_available_blocks", "determine_available_kv_cache_memory")),
        ("V1", "vllm/v1/worker/gpu_worker.py", ("determine_available_memory",)),
    ):
        found = [(line, name, source) for name in names for line, source in functions(root / path, name)]
        if not found:
            continue
        wide = vllm.device_wide_budget(version, generation)
        facts.append(Fact(
            f"{generation} budget", budget_kind("\n".join(source for _, _, source in found)),
            ", ".join(f"{path}:{line} {name}" for line, name, _ in found),
            tuple(text for line, _, source in found
                  for text in matching(source, f"{DEVICE_WIDE}|{PER_INSTANCE}|gpu_memory_utilization", line)),
            rule="device-wide" if wide else "per-instance",
        ))
    for line, source in functions(root / "vllm/worker/worker.py", "initialize_cache"):
        facts.append(Fact(
            "V0 CUDA graphs vs the KV cache", graphs_after_allocation(source, "_init_cache_engine", "_warm_up_model"),
            f"vllm/worker/worker.py:{line} initialize_cache",
            matching(source, r"_init_cache_engine|_warm_up_model", line), rule="after",
        ))
    for line, source in functions(root / "vllm/v1/executor/abstract.py", "initialize_from_config"):
        facts.append(Fact(
            "V1 CUDA graphs vs the KV cache",
            graphs_after_allocation(source, "initialize_from_config", "compile_or_warm_up_model"),
            f"vllm/v1/executor/abstract.py:{line} initialize_from_config",
            matching(source, r"initialize_from_config|compile_or_warm_up_model", line),
        ))
    estimate = first_match(
        root, ("vllm/envs.py",), r'"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",\s*"(\d)"'
    ) or first_match(root, ("vllm/envs.py",), r'VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "(\d)"')
    if estimate is not None:
        facts.append(Fact("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default", estimate[0], estimate[1]))
    for line, source in functions(root / "vllm/v1/worker/gpu/model_runner.py", "profile_cudagraph_memory"):
        zero = re.search(r"^\s*return 0\s*$", source, re.M) is not None and source.count("return") == 1
        # vramguard counts graphs outside where Model Runner V2 is the default and estimates 0 (the
        # first bound: when it became the default is read from its selection code, not classified here).
        facts.append(Fact(
            "Model Runner V2 graph estimate", "0" if zero else "measured",
            f"vllm/v1/worker/gpu/model_runner.py:{line} profile_cudagraph_memory", matching(source, r"return", line),
            rule="0" if version < vllm.GRAPHS_UNESTIMATED[1] else "measured",
        ))
    outside = vllm.graphs_outside(ContainerEnv({}), "", version, [])
    facts.append(Fact("vramguard: CUDA graphs outside the share (defaults)", "yes" if outside else "no",
                      "vramguard/engines/vllm.py graphs_outside"))
    return facts


# -- SGLang --------------------------------------------------------------------------------------------

SGLANG_FILES = (
    "sglang/srt/mem_cache/kv_cache_configurator.py",
    "sglang/srt/model_executor/model_runner_kv_cache_mixin.py",
    "sglang/srt/model_executor/model_runner.py",
)


def sglang_facts(root: Path) -> list[Fact]:
    facts: list[Fact] = []
    for name in SGLANG_FILES:
        path = root / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = matching(text, r"mem_fraction_static|pre_model_load_memory|total_gpu_memory \*")
        if lines:
            of = "free at start" if re.search(r"pre_model_load_memory|total_gpu_memory \* \(\s*1", text) else (
                "unclassified")
            facts.append(Fact("--mem-fraction-static is a fraction of", of, name, lines[:12], rule="free at start"))
            break
    arguments = [root / "sglang/srt/server_args.py", *sorted((root / "sglang/srt/arg_groups").glob("*.py"))]
    for path in (p for p in arguments if p.is_file()):
        name = str(path.relative_to(root))
        text = path.read_text(encoding="utf-8", errors="replace")
        split = matching(text, r"chunked_prefill_size\s*//")
        if split:
            facts.append(Fact("chunk split among DP attention ranks", "yes", name, split, rule="yes"))
        reserve = matching(text, r"reserved_mem|reserve_mem|mem_fraction_static = ")
        if reserve:
            facts.append(Fact("default fraction's reserve", "see lines", name, reserve[:20]))
    return facts


def report(facts: Sequence[Fact]) -> int:
    for fact in facts:
        verdict = "" if fact.rule is None else ("  (vramguard: same)" if not fact.disagrees else
                                               f"  (vramguard's rule: {fact.rule}: DIFFERS)")
        print(f"{fact.name}: {fact.value}{verdict}\n    {fact.where}")
        for line in fact.lines:
            print(f"      {line}")
    return sum(fact.disagrees for fact in facts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("vllm", "sglang"))
    parser.add_argument("version")
    parser.add_argument("--source", type=Path, help="the release's unpacked sources (default: download them)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engine-facts-") as temporary:
        root = args.source
        if root is None:

            root = Path(temporary) / "src"
            fetch(args.engine, args.version, root)
        facts = vllm_facts(root, version_tuple(args.version)) if args.engine == "vllm" else sglang_facts(root)
    if not facts:
        print(f"{args.engine} {args.version}: none of the files the facts are read from is in this release")
        return 1
    return 1 if report(facts) else 0


if __name__ == "__main__":
    sys.exit(main())
