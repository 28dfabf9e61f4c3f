"""Allowances: what a container's processes hold on each GPU outside the engine's share, in bytes.

An engine's share (vLLM's ``--gpu-memory-utilization`` x the device's memory) is not all a process
holds. Each engine module says which overheads its version keeps outside that share
(:class:`vramguard.demand.model.Overheads`); this module turns them into bytes with the policy's
amounts (``allowances`` in the policy file), which may differ per engine and per GPU product:

- **CUDA context**, one per process per GPU: created before any engine measures its memory, so it
  is outside every share;
- **CUDA graphs**, where the engine version captures them after sizing its KV cache;
- **communication buffers** (NCCL, custom all-reduce) of a process that talks to peers (tensor or
  pipeline parallel size above 1), allocated beside the share;
- the **reserve** an engine keeps for itself by its own estimate (SGLang's activations and graphs),
  computed by the engine module from the flags;
- **prefill scratch** an engine's memory profiling misses (vLLM's hybrid models), computed likewise.

The ledger sums claims and allowances; a ceiling share (TGI, vLLM's device-wide budgets) has them
inside it, but for CUDA graphs an engine captures after sizing its ceiling and scratch it allocates
after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from vramguard.demand.model import Allowance, Overheads, Vram
from vramguard.quantity import GiB, MiB

CUDA_CONTEXT = "CUDA context"
CUDA_GRAPHS = "CUDA graphs"
COMMUNICATION = "communication buffers"
RESERVE = "engine reserve"
SCRATCH = "prefill scratch"
"""Activations an engine's memory profiling misses (vLLM's hybrid models): an estimate."""
BEYOND_A_CEILING = frozenset({CUDA_GRAPHS, SCRATCH})
"""What an engine holds beyond a ceiling share: allocated after the ceiling is sized."""
LEARNED = "learned beyond the estimates"
"""What pods of the same engine, version, product and layout were measured holding beyond the static
estimates (:mod:`vramguard.learning`): an estimate too."""

KINDS = {"cuda_context": CUDA_CONTEXT, "cuda_graphs": CUDA_GRAPHS, "communication": COMMUNICATION}
"""Policy keys and the allowances they size."""

DEFAULT_BYTES = {"cuda_context": 512 * MiB, "cuda_graphs": GiB, "communication": GiB}
"""The shipped amounts, each the upper end of what the engines' own logs and NVIDIA's figures show
(see docs/vram-model.md): a context is 0.25-0.45 GiB on recent CUDA with lazy module loading, vLLM
logs 0.36-1.28 GiB of CUDA graphs, NCCL's buffers grow with peers and channels."""

_CONTEXT_SOURCE = "one CUDA context per process per GPU, created before the engine measures memory"


Amounts = tuple[tuple[str, int], ...]
"""Allowance key -> bytes, as sorted pairs (hashable: a table is part of the demand's options)."""


def amounts(mapping: Mapping[str, int]) -> Amounts:
    """``mapping`` as :data:`Amounts`."""
    return tuple(sorted(mapping.items()))


DEFAULT_AMOUNTS = amounts(DEFAULT_BYTES)


@dataclass(frozen=True, slots=True)
class AllowanceTable:
    """The policy's amounts: defaults, per engine, per GPU product (product wins over engine)."""

    defaults: Amounts = DEFAULT_AMOUNTS
    engines: tuple[tuple[str, Amounts], ...] = ()
    products: tuple[tuple[str, Amounts], ...] = ()

    @classmethod
    def of(
        cls, defaults: Mapping[str, int], engines: Mapping[str, Mapping[str, int]],
        products: Mapping[str, Mapping[str, int]],
    ) -> AllowanceTable:
        """A table from plain mappings (defaults fill what ``defaults`` lacks)."""
        return cls(
            amounts({**DEFAULT_BYTES, **defaults}),
            tuple((name, amounts(values)) for name, values in sorted(engines.items())),
            tuple((name, amounts(values)) for name, values in sorted(products.items())),
        )

    def amount(self, key: str, engine: str) -> int:
        """The bytes of allowance ``key`` for ``engine`` on a device of no listed product."""
        for name, values in self.engines:
            if name == engine:
                found = dict(values).get(key)
                if found is not None:
                    return found
        return dict(self.defaults).get(key, DEFAULT_BYTES[key])

    def by_product(self, key: str) -> tuple[tuple[str, int], ...]:
        """The product overrides of allowance ``key``."""
        return tuple((product, dict(values)[key]) for product, values in self.products if key in dict(values))

    def allowances(self, engine: str, overheads: Overheads) -> tuple[Allowance, ...]:
        """The allowances an engine's overheads hold, sized by this table."""
        items = [replace(self._item("cuda_context", engine, _CONTEXT_SOURCE, overheads.processes), estimate=False)]
        if overheads.graphs is not None:
            items.append(self._item("cuda_graphs", engine, overheads.graphs, overheads.processes,
                                    overheads.graphs_scale))
        if overheads.communication is not None:
            items.append(self._item("communication", engine, overheads.communication, overheads.processes))
        if overheads.reserve_bytes:
            items.append(Allowance(RESERVE, overheads.reserve_bytes, overheads.reserve_source))
        if overheads.scratch_bytes:
            items.append(Allowance(SCRATCH, overheads.scratch_bytes, overheads.scratch_source, overheads.processes))
        return tuple(item for item in items if item.bytes or item.by_product)

    def _item(self, key: str, engine: str, source: str, count: int, scale: Fraction = Fraction(1)) -> Allowance:
        return Allowance(
            KINDS[key], int(self.amount(key, engine) * scale), f"{source} (policy allowances.{key})", count,
            tuple((product, int(amount * scale)) for product, amount in self.by_product(key)),
        )


DEFAULT_TABLE = AllowanceTable()


def with_allowances(vram: Vram | None, engine: str, overheads: Overheads, table: AllowanceTable) -> Vram | None:
    """The engine's claim with its allowances; a ceiling share keeps them inside but for the graphs
    held beyond it (``overheads.graphs``), unknown stays unknown."""
    if vram is None:
        return vram
    allowances = table.allowances(engine, overheads)
    if vram.ceiling:
        allowances = tuple(a for a in allowances if a.name in BEYOND_A_CEILING)
    return replace(vram, allowances=allowances) if allowances else vram
