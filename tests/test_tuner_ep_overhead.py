"""The EP path's fixed cost per MoE layer (`Platform.ep_layer_overhead`, measured by `tuner
measure`): the estimate adds it once per MoE layer and micro-batch where the EP group has more
than one rank, and nowhere else; the platform file carries it; the measurement runs on every
rank alike."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_platform

from model import ModelConfig
from tuner import ParallelPlan, Platform, estimate

PF = toy_platform()
# layers 0 and 2 dense, 1 and 3 MoE: two MoE layers
CFG = ModelConfig(vocab_size=16, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4,
                  n_routed_experts=8, top_k=2, moe_ffn_dim=32, dense_ffn_dim=64, moe_every=2)


def test_added_per_moe_layer_and_microbatch_with_ep():
    x = 0.25  # seconds, far above the toy's microsecond layers: the term stands out exactly
    with_x = dataclasses.replace(PF, ep_layer_overhead=x)
    n_moe = sum(CFG.is_moe_layer(i) for i in range(CFG.n_layers))
    assert n_moe == 2
    for m in (1, 3):
        plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=m, global_batch=2 * m, seq_len=16)
        a, b = estimate(CFG, plan, PF), estimate(CFG, plan, with_x)
        # one sum of the same parts plus m x 2 x x: equal up to float addition order
        assert b.time["alltoall"] - a.time["alltoall"] == pytest.approx(m * n_moe * x, rel=1e-9)
        assert b.step_time - a.step_time == pytest.approx(m * n_moe * x, rel=1e-9)
    plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=2, global_batch=4, seq_len=16)
    assert estimate(CFG, plan, with_x).step_time == estimate(CFG, plan, PF).step_time


def test_platform_file_carries_it():
    p = dataclasses.replace(PF, ep_layer_overhead=0.0125)
    assert Platform.from_dict(p.to_dict()).ep_layer_overhead == pytest.approx(0.0125, rel=1e-9)
    assert Platform.from_dict(PF.to_dict()).ep_layer_overhead == 0.0  # absent: not measured
    with pytest.raises(ValueError, match="ep_layer_overhead=-1.0 must be >= 0"):
        dataclasses.replace(PF, ep_layer_overhead=-1.0)


def _probe(rank: int, world: int, group) -> float:
    from tuner.measure import ep_layer_extra

    return ep_layer_extra(group, world, 2)


def test_the_measurement_is_one_value_on_every_rank():
    """Each round's time is the slowest rank's (an all-reduce MAX), so every rank computes the
    same medians: the value must agree bit for bit across ranks, and be finite."""
    from comm import run_local

    vals = run_local(_probe, 2)
    assert len(vals) == 2 and vals[0] == vals[1] and abs(vals[0]) < 10.0
