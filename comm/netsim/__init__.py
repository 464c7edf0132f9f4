"""comm.netsim: flow-level simulator of cluster networks for all-to-all algorithms.

Build a `Network` (`frontier`, `frontier_node`, `dgx_fat_tree`, `emulator`, `generic`),
make `Traffic` (`flat_all_to_all`, `halo_all_to_all` from comm's HALO plan), choose nodes
(`place`) and `simulate`: max-min fair sharing by progressive filling, event-driven, with
per-message overhead and gap, link latencies and phase dependencies. `lumped_all_to_all`
merges interchangeable nodes (exact for uniform splits) for 512+ node runs.
`python -m comm.netsim --help`.
"""

from __future__ import annotations

from comm.netsim.engine import SimResult, Traffic, simulate
from comm.netsim.fairshare import max_min_rates
from comm.netsim.lumped import lumped_all_to_all
from comm.netsim.network import Network, NetworkBuilder, Routes
from comm.netsim.topologies import (
    dgx_fat_tree,
    emulator,
    from_platform,
    frontier,
    frontier_node,
    generic,
)
from comm.netsim.traffic import (
    HALO_PHASES,
    flat_all_to_all,
    halo_all_to_all,
    halo_traffic_from_plan,
    place,
    uniform_splits,
)

__all__ = [
    "HALO_PHASES",
    "Network",
    "NetworkBuilder",
    "Routes",
    "SimResult",
    "Traffic",
    "dgx_fat_tree",
    "emulator",
    "flat_all_to_all",
    "from_platform",
    "frontier",
    "frontier_node",
    "generic",
    "halo_all_to_all",
    "halo_traffic_from_plan",
    "lumped_all_to_all",
    "max_min_rates",
    "place",
    "simulate",
    "uniform_splits",
]
