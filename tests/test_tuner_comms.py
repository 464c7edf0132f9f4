"""The closed-form all-to-all against comm.netsim's flow-level simulation of the same exchange."""

from __future__ import annotations

import pytest

from model import presets
from tuner import Assumptions, ParallelPlan, estimate, load_platform
from tuner.comms import alltoall_time, netsim_alltoall_time, placement

NBYTES = 2 * 8 * 4096 * 7168 * 2  # DeepSeek-V3 dispatch: k=8 x 8192 tokens x d x bf16


@pytest.mark.parametrize("name", ["frontier", "dgx-h100"])
@pytest.mark.parametrize("ep,stride", [(8, 1), (16, 1), (32, 1), (4, 16), (2, 8)])
@pytest.mark.parametrize("algorithm", ["flat", "halo"])
def test_closed_form_matches_netsim_inside_a_domain(name, ep, stride, algorithm):
    pf = load_platform(name)
    g = placement(ep, stride, pf.gpus_per_node)
    sim = netsim_alltoall_time(NBYTES, g, algorithm, pf)
    # Inside one switch nothing but the NICs and intra-node links limit the exchange; the
    # closed form neglects only the overlap of latency with transfer (< 3 %).
    assert alltoall_time(NBYTES, g, algorithm, pf) == pytest.approx(sim, rel=0.03)


def test_closed_form_is_conservative_for_small_frontier_groups():
    # GCD pairs in one MI250X package share 4 Infinity Fabric links (150 GB/s at 75 %); the
    # platform file's single value is the 8-GCD uniform exchange (65.6 GB/s).
    pf = load_platform("frontier")
    g = placement(2, 1, 8)
    sim = netsim_alltoall_time(NBYTES, g, "flat", pf)
    assert sim == pytest.approx(NBYTES / 2 / (4 * 50e9 * 0.75), rel=0.02)
    assert alltoall_time(NBYTES, g, "flat", pf) > 2 * sim


def test_spread_across_switches_is_congested():
    # Why the planner keeps EP groups inside one locality domain: 8 nodes on 2 switches
    # share one 25 GB/s switch-to-switch link.
    pf = load_platform("frontier")
    g = placement(8, 64, 8)
    assert netsim_alltoall_time(NBYTES, g, "flat", pf) > 5 * alltoall_time(NBYTES, g, "flat", pf)


def test_estimate_with_netsim_model():
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    plan = ParallelPlan(pp=4, ep=8, dp=2, microbatches=8, global_batch=128, seq_len=4096)
    a = estimate(cfg, plan, pf)
    b = estimate(cfg, plan, pf, assumptions=Assumptions(alltoall_model="netsim"))
    assert b.time["alltoall"] == pytest.approx(a.time["alltoall"], rel=0.03)
    assert b.time["compute"] == a.time["compute"]


@pytest.mark.parametrize("name", ["frontier", "dgx-h100"])
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_planner_and_auto_are_one_model(name, nodes):
    """The planner (rates from tuner.platform) and `auto` (CostModel.from_platform on the same
    file, loads read off the split matrix) give the same flat and HALO times for the same
    exchange: a group filling `nodes` nodes, every pair exchanging the same rows."""
    import numpy as np

    from comm import CostModel, Topology
    from comm.cost import predict, predict_flat, predict_halo
    from tuner.comms import rates

    pf = load_platform(name)
    auto = CostModel.from_platform(name)
    assert rates(pf) == auto.rates()  # one set of parameters, read twice from one file
    G = pf.gpus_per_node
    topo = Topology.uniform(nodes, G, nics_per_node=pf.nics_per_node)
    R, rows, row_bytes = nodes * G, 3000, 14336  # 3000 tokens of d=7168 in bf16 per pair
    S = [[rows] * R for _ in range(R)]
    g = placement(R, 1, G)
    nbytes = R * rows * row_bytes  # each rank's send buffer, its own share included
    flat, halo = alltoall_time(nbytes, g, "flat", pf), alltoall_time(nbytes, g, "halo", pf)
    assert predict_flat(S, row_bytes, topo, auto) == pytest.approx(flat, rel=1e-12)
    assert predict_halo(S, row_bytes, topo, auto) == pytest.approx(halo, rel=1e-12)
    if nodes > 1:  # the blocked passes `auto` runs beyond 32 ranks read the same loads
        got = predict(np.asarray(S), row_bytes, topo, auto, method="blocked")
        assert got[:2] == pytest.approx((flat, halo), rel=1e-12)


@pytest.mark.parametrize("nodes,top_k,experts", [(2, 4, 16), (2, 1, 16), (4, 8, 64), (2, 2, 16),
                                                 (1, 4, 16)])
def test_planner_auto_prices_what_the_trainer_auto_weighs(nodes, top_k, experts):
    """`alltoall=auto` is priced as the cheapest of the algorithms the trainer's auto times
    (`trainer.build.trial_candidates`: dedup beside comm's per-call flat / HALO where the EP
    group spans nodes at top-k > 1) and runs the fastest of."""
    from trainer.build import trial_candidates
    from tuner.comms import auto_considers_dedup

    gpus = 2
    cands = {a for a, _, _ in trial_candidates("auto", "none", "auto", "none", 2, nodes, top_k)}
    assert auto_considers_dedup(nodes, top_k, experts) == ("dedup" in cands)
    pf = load_platform("dgx-h100")
    g = placement(nodes * gpus, 1, gpus)
    got = alltoall_time(NBYTES, g, "auto", pf, 1.0, top_k, experts)
    want = min(alltoall_time(NBYTES, g, a, pf, 1.0, top_k, experts)
               for a in ("flat", "halo", *(("dedup",) if "dedup" in cands else ())))
    assert got == want
