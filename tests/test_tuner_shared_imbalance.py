"""Routing imbalance on shared cores (`tuner.sharing.shared_imbalance`, used by
`tuner.estimate.compute_imbalance`): ranks done with their fewer expert rows give their core
share to the busiest one. Hand-worked cases, and the estimate using it for compute only."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_moe_config, toy_platform

from tuner import Assumptions, ParallelPlan, estimate
from tuner.estimate import compute_imbalance
from tuner.sharing import shared_imbalance


def test_by_hand():
    # 4 ranks of one EP group on 2 cores: loads 1.7 and 3 x 0.7667 of the mean; all four run
    # at the all-busy rate until the light ones end (0.7667), then the busy one alone at 2x:
    # 0.7667 + (1.7 - 0.7667) / 2 = 1.2333
    assert shared_imbalance(1.7, 4, 4, 2, 1) == pytest.approx((4 - 1.7) / 3 + (1.7 - (4 - 1.7) / 3) / 2,
                                                              rel=1e-12)
    # two EP pairs on 2 cores, loads 1.41 / 0.59 each: the work is 4 units at half a core
    # each = 2 core-units over 2 cores, which the sharing reaches exactly: 1.0
    assert shared_imbalance(1.41, 2, 4, 2, 1) == pytest.approx(1.0, rel=1e-12)
    # dedicated cores: unchanged
    assert shared_imbalance(1.7, 4, 2, 2, 1) == 1.7
    assert shared_imbalance(1.41, 2, 2, 2, 1) == 1.41


def test_refuses_bad_input():
    with pytest.raises(ValueError, match="imbalance=5.0 must be in"):
        shared_imbalance(5.0, 4, 4, 2, 1)
    with pytest.raises(ValueError, match="cores=0"):
        shared_imbalance(1.5, 4, 4, 0, 1)


def test_estimate_uses_it_for_compute_only():
    """A CPU-like toy (4 processes on 2 cores, 1 thread): the expert compute takes the shared
    imbalance, the exchange keeps the routing imbalance; a GPU platform keeps both."""
    cfg = toy_moe_config()
    cpu = dataclasses.replace(toy_platform(), cores_per_node=2, threads_per_process=1)
    plan = ParallelPlan(pp=1, ep=4, dp=1, microbatches=1, global_batch=4, seq_len=16)
    asm = Assumptions(routing_imbalance=1.7)
    assert compute_imbalance(plan, cpu, asm) == pytest.approx(shared_imbalance(1.7, 4, 4, 2, 1))
    assert compute_imbalance(plan, toy_platform(), asm) == 1.7
    assert compute_imbalance(plan, cpu, dataclasses.replace(asm, shared_cores=False)) == 1.7
    a = estimate(cfg, plan, cpu, assumptions=asm)
    b = estimate(cfg, plan, cpu, assumptions=dataclasses.replace(asm, shared_cores=False))
    assert a.time["alltoall"] == pytest.approx(b.time["alltoall"], rel=1e-12)
    assert a.time["compute"] < b.time["compute"]


def test_emulated_nodes_share_the_host():
    """An emulated 2 x 2 cluster runs its 4 processes on this machine's cores: the emulator
    platform says so (`host_nodes`), and its file keeps it; 0 nodes is refused."""
    from tuner import Platform
    from tuner.measure import emulator_platform

    base = dataclasses.replace(toy_platform(), gpus_per_node=4, cores_per_node=2,
                               threads_per_process=1)
    emu = emulator_platform(base, 2, 2, 200.0)
    assert emu.host_nodes == 2 and emu.host_procs(4) == 4 and emu.host_procs(8) == 4
    assert Platform.from_dict(emu.to_dict()).host_nodes == 2
    assert toy_platform().host_procs(16) == 4  # one node per host: its 4 GPUs
    with pytest.raises(ValueError, match="host_nodes=0 must be >= 1"):
        dataclasses.replace(base, host_nodes=0)


def test_node_exchange_imbalance_by_hand():
    """The trainer's `ep_node_imbalance` (trainer.observe.stats): per exchange the busiest
    node's rows over the mean node's, weighted by the exchanges' sizes."""
    from trainer.observe.stats import node_exchange_imbalance

    # layer 0: nodes send 30 and 10 rows (max 30, mean 20); layer 1: 20 and 20 (20, 20)
    assert node_exchange_imbalance([[30.0, 10.0], [20.0, 20.0]]) == pytest.approx(50 / 40)
    assert node_exchange_imbalance([[5.0, 5.0, 5.0]]) == 1.0
    assert node_exchange_imbalance([[0.0, 0.0]]) is None


def test_exchange_imbalance_prices_the_exchange_only():
    """Assumptions.exchange_imbalance scales the exchanged rows (None: the routing
    imbalance), not the expert compute."""
    cfg = toy_moe_config()
    pf = toy_platform()
    plan = ParallelPlan(pp=1, ep=8, dp=1, microbatches=1, global_batch=8, seq_len=16)
    a = estimate(cfg, plan, pf, assumptions=Assumptions(routing_imbalance=1.6))
    b = estimate(cfg, plan, pf, assumptions=Assumptions(routing_imbalance=1.6,
                                                         exchange_imbalance=1.6))
    c = estimate(cfg, plan, pf, assumptions=Assumptions(routing_imbalance=1.6,
                                                         exchange_imbalance=1.2))
    assert a.step_time == b.step_time
    assert c.time["compute"] == a.time["compute"] and c.time["alltoall"] < a.time["alltoall"]
    with pytest.raises(ValueError, match="exchange_imbalance=0.5 must be >= 1"):
        Assumptions(exchange_imbalance=0.5)
