"""The pipeline runtime's work per action (`Platform.pipeline_action_overhead`, measured by
`tuner measure` where each process has cores of its own): the estimate adds it to every
action of a pipelined plan (F and B of each stage and micro-batch, and W under zb-h1) and
nowhere else; the measurement inverts the replay of its probe's 1F1B schedule."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_moe_config, toy_platform

from tuner import ParallelPlan, Platform, estimate
from tuner.estimate import schedule_stats, zb_split

PF = toy_platform()
CFG = toy_moe_config()


@pytest.mark.parametrize("schedule,v,actions", [("1f1b", 1, 2), ("gpipe", 1, 2),
                                                ("interleaved-1f1b", 2, 2), ("zb-h1", 1, 3)])
def test_added_per_action_and_scaled_by_the_bubble(schedule, v, actions):
    x = 0.05  # seconds, far above the toy's microsecond layers: the term stands out exactly
    with_x = dataclasses.replace(PF, pipeline_action_overhead=x)
    m, pp = 4, 2
    plan = ParallelPlan(pp=pp, ep=1, dp=1, microbatches=m, global_batch=2 * m, seq_len=16,
                        schedule=schedule, n_virtual=v)
    a, b = estimate(CFG, plan, PF), estimate(CFG, plan, with_x)
    # each rank runs m x v (stage, micro-batch) pairs of `actions` actions each
    added = m * v * actions * x
    assert b.time["p2p"] - a.time["p2p"] == pytest.approx(added, rel=1e-9)
    bubble = schedule_stats(schedule, pp, m, v, zb_split(PF))[0]
    assert b.step_time - a.step_time == pytest.approx(added / (1 - bubble), rel=1e-9)


def test_not_added_without_a_pipeline():
    with_x = dataclasses.replace(PF, pipeline_action_overhead=0.05)
    plan = ParallelPlan(pp=1, ep=2, dp=2, microbatches=4, global_batch=16, seq_len=16)
    assert estimate(CFG, plan, with_x).step_time == estimate(CFG, plan, PF).step_time


def test_platform_field_round_trip_and_validation():
    p = dataclasses.replace(PF, pipeline_action_overhead=0.0015)
    assert Platform.from_dict(p.to_dict()).pipeline_action_overhead == pytest.approx(0.0015)
    assert Platform.from_dict(PF.to_dict()).pipeline_action_overhead == 0.0  # not measured
    with pytest.raises(ValueError, match="pipeline_action_overhead_us=-1000.0 must be >= 0"):
        dataclasses.replace(PF, pipeline_action_overhead=-1e-3)


def _dedicated(**kw):
    # 2 processes with a core each, P2P free: the replay is the plain schedule's
    base = dict(gpus_per_node=2, cores_per_node=2, threads_per_process=1,
                intra_node_latency=0.0, intra_node_bandwidth=1e30)
    return dataclasses.replace(PF, **{**base, **kw})


def test_measured_overhead_by_hand():
    # 1F1B, 2 stages x 4 micro-batches, F = 1 s and B = 2 s on both: the replay takes
    # (m + p - 1)(F + B) = 15 s, and with d added to every action (m + p - 1)(F + B + 2 d)
    # = 15 + 10 d: a measured step of 17 s is d = 0.2 s
    from tuner.measure import pipeline_action_overhead, residual_fields

    summary = {"procs": 2.0, "F0": 1.0, "B0": 2.0, "F1": 1.0, "B1": 2.0, "step": 17.0}
    pf = _dedicated()
    assert not pf.shares_cores(2)
    assert pipeline_action_overhead(summary, pf) == pytest.approx(0.2, rel=1e-9)
    # a step the replay already reaches: nothing per action
    assert pipeline_action_overhead({**summary, "step": 14.0}, pf) == 0.0
    # priced hand-overs lengthen the replay, so the same step leaves less per action
    assert pipeline_action_overhead(summary, _dedicated(intra_node_latency=0.01)) < 0.2
    # the fitted fields: this one on dedicated cores, the shared-core factor left at 1
    raw = {"n_procs": 2, "quick": False, "block_s": [0.05, 0.09, 0.2], "ep_extra_s": 0.0,
           "zero3_extra_s": 0.0, "zero3_opt_extra_s": 0.0, "pipeline": summary}
    got = residual_fields(raw, pf)
    assert got["pipeline_action_overhead"] == pytest.approx(0.2, rel=1e-9)
    assert got["shared_pipeline_factor"] == 1.0


@pytest.mark.multiproc
def test_probe_on_two_processes():
    # the probe on 2 gloo processes (one per stage, each with cores of its own where the
    # machine has 2): a real 1F1B pipeline; what each action adds is >= 0 and, the runtime's
    # bookkeeping being small against a stage's work, below one action's own time
    from comm import run_local
    from tuner.measure import (
        pipeline_action_overhead,
        pipeline_probe_summary,
        pipeline_probe_worker,
    )

    summary = pipeline_probe_summary(run_local(pipeline_probe_worker, 2, 2, threads=1,
                                               timeout_s=300.0, cpu_affinity="auto"))
    assert summary["procs"] == 2.0 and summary["step"] > 0
    d = pipeline_action_overhead(summary, _dedicated())
    assert 0.0 <= d < summary["F0"] + summary["B0"]
