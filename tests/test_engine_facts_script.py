"""scripts/engine_facts.py reads a release's facts right: its classifiers on lines quoted from the
released wheels (the script itself downloads releases and is not run in CI)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def script() -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))  # it imports its sibling, engine_options
    try:
        spec = importlib.util.spec_from_file_location("engine_facts", ROOT / "scripts" / "engine_facts.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["engine_facts"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


# vllm 0.6.4 worker/worker.py determine_num_available_blocks (every process's use counted).
DEVICE_WIDE = """
peak_memory = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
torch_allocated_bytes = torch.cuda.memory_stats()["allocated_bytes.all.current"]
total_allocated_bytes = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
non_torch_allocations = total_allocated_bytes - torch_allocated_bytes
available_kv_cache_memory = (total_gpu_memory * self.cache_config.gpu_memory_utilization - peak_memory)
"""
# vllm 0.6.5 worker/worker.py (what this process added since its snapshot).
PER_INSTANCE = """
with memory_profiling(baseline_memory_in_bytes=total_gpu_memory - self.init_gpu_memory,
                      weights_memory_in_bytes=self.model_runner.model_memory_usage) as result:
    self.model_runner.profile_run()
memory_for_current_instance = total_gpu_memory * self.cache_config.gpu_memory_utilization
"""
# vllm 0.7.3 worker/worker.py initialize_cache.
INITIALIZE_CACHE = """
with context:
    self._init_cache_engine()
self._warm_up_model()
"""


def test_budget_kind_reads_device_wide_and_per_instance() -> None:
    facts = script()
    assert facts.budget_kind(DEVICE_WIDE) == "device-wide"
    assert facts.budget_kind(PER_INSTANCE) == "per-instance"
    assert facts.budget_kind("available = 1") == "unclassified"


def test_graphs_are_read_as_captured_after_the_kv_cache() -> None:
    facts = script()
    assert facts.graphs_after_allocation(INITIALIZE_CACHE, "_init_cache_engine", "_warm_up_model") == "after"
    reversed_order = "self._warm_up_model()\nself._init_cache_engine()"
    assert facts.graphs_after_allocation(reversed_order, "_init_cache_engine", "_warm_up_model") == "before"


def test_a_fact_differs_only_where_a_rule_says_otherwise() -> None:
    facts = script()
    assert facts.Fact("x", "0.9", "f", rule="0.92").disagrees
    assert not facts.Fact("x", "0.9", "f", rule="0.9").disagrees
    assert not facts.Fact("x", "0.9", "f").disagrees
