"""The processes' spread on identical work (`Platform.rank_skew`, measured by `tuner measure`
where each process has cores of its own): the estimate scales the compute of plans whose
stages hold several ranks (they meet in a collective every layer or step, and each meeting
waits for the slowest) and of no other plan; the probe is the slowest process's time over the
mean, per round, its median over rounds. Where the processes share the cores the same probe
gives `Platform.shared_rank_skew`, which scales only plans with neither a pipeline nor EP
(the shared-core pipeline factor and the EP constants hold that wait for the others)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import CPU_W4, toy_moe_config, toy_platform

from model import presets
from tuner import Assumptions, ParallelPlan, Platform, estimate, load_platform

PF = toy_platform()
CFG = toy_moe_config()


@pytest.mark.parametrize("ep,dp", [(2, 1), (1, 2), (2, 2)])
def test_compute_of_several_rank_stages_scales(ep, dp):
    skewed = dataclasses.replace(PF, rank_skew=1.1)
    plan = ParallelPlan(pp=1, ep=ep, dp=dp, microbatches=2, global_batch=8, seq_len=16)
    a, b = estimate(CFG, plan, PF), estimate(CFG, plan, skewed)
    assert b.time["compute"] == pytest.approx(1.1 * a.time["compute"], rel=1e-12)
    # nothing but the compute moves
    assert b.step_time - a.step_time == pytest.approx(0.1 * a.time["compute"], rel=1e-9)
    assert any("rank_skew" in n for n in b.notes) and not any("rank_skew" in n for n in a.notes)


def test_single_rank_stages_and_one_rank_unchanged():
    skewed = dataclasses.replace(PF, rank_skew=1.1)
    for plan in (ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=8, seq_len=16),
                 ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=2, seq_len=16)):
        assert estimate(CFG, plan, skewed).step_time == estimate(CFG, plan, PF).step_time


@pytest.mark.parametrize("field,value,bads", [("rank_skew", 1.045, (0.97, float("nan"))),
                                              ("shared_rank_skew", 1.09, (0.9, float("inf")))])
def test_platform_field_round_trip_and_validation(field, value, bads):
    p = dataclasses.replace(PF, **{field: value})
    assert getattr(Platform.from_dict(p.to_dict()), field) == pytest.approx(value)
    assert getattr(Platform.from_dict(PF.to_dict()), field) == 1.0  # not measured
    for bad in bads:
        with pytest.raises(ValueError, match=f"{field}={bad} must be a finite number >= 1"):
            dataclasses.replace(PF, **{field: bad})


def test_one_process_has_no_spread():
    from tuner.measure import rank_skew

    assert rank_skew(None, 1, 5) == 1.0  # no collectives: callable without a process group


def _probe(rank, world, group):
    import torch

    from tuner.measure import rank_skew

    torch.set_num_threads(1)
    return rank_skew(group, world, 4)


@pytest.mark.multiproc
def test_probe_on_real_processes():
    # every rank gets the same all-reduced ratio; the slowest over the mean of 2 lies in
    # [1, 2) whatever the machine (2 only if the other took no time)
    from comm import run_local

    got = run_local(_probe, 2, threads=1, timeout_s=300.0)
    assert got[0] == got[1] and 1.0 <= got[0] < 2.0


def test_shared_skew_scales_only_plans_with_neither_pipeline_nor_ep():
    """On the measured 4-process platform (4 processes on 2 cores): PP 1 x EP 1 x DP 4 takes
    the shared skew on its compute; PP 1 x EP 2, PP 2 x DP 2 and one process do not, nor
    does any plan with Assumptions.shared_cores off or on dedicated cores."""
    pf = load_platform(CPU_W4)
    assert pf.shares_cores(4) and pf.shared_rank_skew == 1.0  # frozen before the field
    skewed = dataclasses.replace(pf, shared_rank_skew=1.12)
    cfg = presets.get("tiny")
    dp4 = ParallelPlan(pp=1, ep=1, dp=4, microbatches=1, global_batch=16, seq_len=256, zero=2)
    a, b = estimate(cfg, dp4, pf), estimate(cfg, dp4, skewed)
    assert b.time["compute"] == pytest.approx(1.12 * a.time["compute"], rel=1e-12)
    assert b.step_time - a.step_time == pytest.approx(0.12 * a.time["compute"], rel=1e-9)
    assert any("shared_rank_skew" in n for n in b.notes)
    assert not any("rank_skew" in n for n in a.notes)
    off = Assumptions(shared_cores=False)
    assert estimate(cfg, dp4, skewed, assumptions=off).step_time == \
        estimate(cfg, dp4, pf, assumptions=off).step_time
    for plan in (ParallelPlan(pp=1, ep=2, dp=2, microbatches=1, global_batch=16, seq_len=256),
                 ParallelPlan(pp=2, ep=1, dp=2, microbatches=2, global_batch=16, seq_len=256),
                 ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=4, seq_len=256)):
        assert estimate(cfg, plan, skewed).step_time == estimate(cfg, plan, pf).step_time, plan
    # two processes on two cores have cores of their own: rank_skew's, not this field's
    two = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=16, seq_len=256)
    assert not pf.shares_cores(2)
    assert estimate(cfg, two, skewed).step_time == estimate(cfg, two, pf).step_time

