"""The processes' spread on identical work (`Platform.rank_skew`, measured by `tuner measure`
where each process has cores of its own): the estimate scales the compute of plans whose
stages hold several ranks (they meet in a collective every layer or step, and each meeting
waits for the slowest) and of no other plan; the probe is the slowest process's time over the
mean, per round, its median over rounds."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_moe_config, toy_platform

from tuner import ParallelPlan, Platform, estimate

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


def test_platform_field_round_trip_and_validation():
    p = dataclasses.replace(PF, rank_skew=1.045)
    assert Platform.from_dict(p.to_dict()).rank_skew == pytest.approx(1.045)
    assert Platform.from_dict(PF.to_dict()).rank_skew == 1.0  # not measured
    for bad in (0.97, float("nan")):
        with pytest.raises(ValueError, match=f"rank_skew={bad} must be a finite number >= 1"):
            dataclasses.replace(PF, rank_skew=bad)


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
