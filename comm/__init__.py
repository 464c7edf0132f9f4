"""comm: topology, flat and HALO all-to-all, cost model, single-machine launch helpers.

Sub-packages, bottom first (each imports only those before it; tests/test_import_graph.py):
    comm.topology     where ranks sit: Topology, topology files, discovery, platform files,
                      HALO's relay choice
    comm.cost         the all-to-all cost model `auto` decides with (one predict())
    comm.collectives  flat / HALO / auto all-to-all, async exchanges, dedup plans
    comm.ep           a MoE layer's exchanges under EP: the Dispatcher Protocol, EPDispatcher
    comm.tools        run_local, calibrate, the namespace emulator, the self-check
    comm.netsim       the flow-level network simulator
`python -m comm.emulate` and `python -m comm.selfcheck` are thin entries into comm.tools.

Public API:
    all_to_all(x, in_splits, group, algorithm="flat"|"halo"|"auto", topology=None, plan=None)
    plan_all_to_all (settle sizes and algorithm ahead, carrying the caller's ints) -> AllToAllPlan
    Topology (uniform / from_file / discover / from_records / restrict / summary),
        dump_topology; load_topology, discover and topology_from_records are the same
        constructors under their function names
    halo_plan, RankPlan, Message (the pure plan), SplitPlans (a split matrix and the rank
        plans built from it, once each)
    CostModel (from calibrate, CostModel.from_platform or CostModel.emulator: auto across
        nodes needs one), choose_algorithm, calibrate
    run_local (N local gloo processes), python -m comm.emulate (emulated cluster)
"""

from __future__ import annotations

from comm.collectives.alltoall import ALGORITHMS, AllToAllPlan, all_to_all, plan_all_to_all
from comm.collectives.flat import FlatAllToAll, flat_all_to_all
from comm.collectives.halo import HaloAllToAll, halo_all_to_all
from comm.collectives.halo_plan import Message, RankPlan, SplitPlans, halo_plan
from comm.cost import CostModel, choose_algorithm, predict_flat, predict_halo
from comm.cost.a2a_model import Rates, flat_time, halo_time
from comm.tools.calibrate import calibrate, time_all_to_all
from comm.tools.spawn import run_local
from comm.topology import Topology, dump_topology
from comm.topology.discover import decode_slingshot_mac

# Function spellings of Topology's constructors.
discover = Topology.discover
load_topology = Topology.from_file
topology_from_records = Topology.from_records

__all__ = [
    "ALGORITHMS",
    "AllToAllPlan",
    "CostModel",
    "FlatAllToAll",
    "HaloAllToAll",
    "Message",
    "Rates",
    "RankPlan",
    "SplitPlans",
    "Topology",
    "all_to_all",
    "flat_time",
    "halo_time",
    "calibrate",
    "choose_algorithm",
    "decode_slingshot_mac",
    "discover",
    "dump_topology",
    "flat_all_to_all",
    "halo_all_to_all",
    "halo_plan",
    "load_topology",
    "plan_all_to_all",
    "predict_flat",
    "predict_halo",
    "run_local",
    "time_all_to_all",
    "topology_from_records",
]
