"""One :class:`ResourceOffer` for a node (the ledger's) and for the cluster (admission's)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vramguard.admission import offers_from_inventories
from vramguard.inventory import Gpu, NodeInventory
from vramguard.ledger import Ledger, ResourceOffer
from vramguard.quantity import GiB

GPU = "nvidia.com/gpu"


@pytest.mark.parametrize(
    "devices",
    [
        pytest.param((Gpu("0", 0, "H100", 80 * GiB, "time-slicing", 4, GPU),), id="one-gpu"),
        pytest.param(
            (Gpu("0", 0, "H100", 80 * GiB, "mps", 4, GPU), Gpu("1", 1, "A100", 40 * GiB, "mps", 2, GPU)), id="mps-mixed"
        ),
        pytest.param((Gpu("0", 0, "?", 0, "none", 1, GPU),), id="size-unknown"),
    ],
)
def test_a_nodes_offer_is_the_clusters_offer_of_that_node_alone(devices: tuple[Gpu, ...]) -> None:
    inventory = NodeInventory("n", devices)
    ledger = Ledger({"time-slicing": Fraction(1, 10)})
    ledger.upsert_node(inventory)
    node = ledger.offers("n")
    assert node == {GPU: ResourceOffer.of(devices)}
    cluster = offers_from_inventories([inventory])
    assert cluster == {GPU: ResourceOffer.of(devices, ({},))}
    assert node[GPU].sizeless == next((g for g in devices if g.memory_bytes == 0), None)
    whole = max((g.memory_bytes // g.replicas if g.sharing == "mps" else g.memory_bytes) for g in devices)
    assert cluster[GPU].largest_whole_bytes == whole
