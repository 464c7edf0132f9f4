"""comm: topology, flat and HALO all-to-all, cost model, single-machine launch helpers.

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

from comm.a2a_model import Rates, flat_time, halo_time
from comm.alltoall import ALGORITHMS, AllToAllPlan, all_to_all, plan_all_to_all
from comm.calibrate import calibrate, time_all_to_all
from comm.cost import CostModel, choose_algorithm, predict_flat, predict_halo
from comm.discover import decode_slingshot_mac
from comm.flat import FlatAllToAll, flat_all_to_all
from comm.halo import HaloAllToAll, halo_all_to_all
from comm.halo_plan import Message, RankPlan, SplitPlans, halo_plan
from comm.spawn import run_local
from comm.topology import Topology, dump_topology

# Function spellings of Topology's constructors. Bound after every import above: importing
# the submodule comm.discover sets the package attribute `discover`, this rebinds it.
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
