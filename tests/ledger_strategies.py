"""What the ledger property tests share: the slack per sharing mechanism, the resource names, and
the amounts a claim may ask for (bytes, a fraction of the device, or none stated)."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import strategies as st

from vramguard.demand.model import Vram
from vramguard.inventory import Sharing

TENTH: dict[Sharing, Fraction] = dict.fromkeys(("none", "time-slicing", "mps", "mig"), Fraction(1, 10))
GPU = "nvidia.com/gpu"
OTHER = "nvidia.com/gpu.shared"

AMOUNTS = st.one_of(
    st.integers(0, 18).map(lambda n: Vram(bytes=n * 50)),
    st.integers(1, 9).map(lambda n: Vram(fraction=Fraction(n, 10))),
    st.none(),
)
