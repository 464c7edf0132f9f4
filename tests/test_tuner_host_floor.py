"""The host floor of a MoE layer (`Assumptions.host_floor`, `tuner estimate --host-floor-ms`):
a layer whose device time is below it takes the floor; and the pipeline bubble of a step of
several schedule runs (`run_bubble`). Checked against hand-computed steps."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_head_seconds, toy_moe_config, toy_platform

from tuner import Assumptions, ParallelPlan, estimate
from tuner.cli import main
from tuner.layout import PUBLISHED_PRECISION

PF = toy_platform()
CFG = toy_moe_config()
_head = toy_head_seconds


def test_zero_floor_changes_nothing():
    """host_floor 0 (the default) is the model as before: the same step bit for bit, and no
    "host" part in the breakdown."""
    for plan in (ParallelPlan(pp=1, ep=2, dp=1, microbatches=2, global_batch=4, seq_len=16),
                 ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=8, seq_len=16,
                              checkpointing="full")):
        a, b = estimate(CFG, plan, PF), estimate(CFG, plan, PF, assumptions=Assumptions(
            host_floor=0.0))
        assert a.step_time == b.step_time  # same ops on the same numbers
        assert "host" not in a.time and "host" not in b.time


def test_floor_far_above_the_device_time_is_the_layer_time():
    """4 MoE layers, pp=1, ep=2 on 2 GPUs, 3 micro-batches, floor 1 s (the toy's layers take
    microseconds): every layer of every micro-batch takes exactly the floor, so compute +
    all-to-all + host = M x (L x 1 s + 3 x the lm_head's forward), the head not floored."""
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=3, global_batch=6, seq_len=16)
    e = estimate(CFG, plan, PF, PUBLISHED_PRECISION, Assumptions(host_floor=1.0))
    layers = e.time["compute"] + e.time["alltoall"] + e.time["host"]
    # rel 1e-12: sums of a few dozen float terms of ~1 s
    assert layers == pytest.approx(3 * (4 * 1.0 + 3 * _head(plan)), rel=1e-12)
    assert e.time["host"] > 0.99 * 12  # nearly all of it is waiting on the host


def test_floor_under_a_pipeline_and_dense_layers_are_not_floored():
    """pp=2 over 2 GPUs, layer 0 dense (first_k_dense=1), 1F1B over 8 micro-batches, floor
    1 s: the first stage's busy time is M x (dense device time + 1 s), the last one's M x
    (2 s + 3 x head); the last is the busiest and 1F1B's bubble with uniform micro-batches
    is (p - 1) / (M + p - 1), so the pipeline part of the step is M x (2 + 3 head + 2 hops)
    x 9 / 8, a hop being one P2P of the stage's 16 x 64 bf16 activations on the node's link
    (2048 B at 100 GB/s + 1 us)."""
    cfg = dataclasses.replace(CFG, first_k_dense=1, dense_ffn_dim=48)
    plan = ParallelPlan(pp=2, ep=1, dp=1, microbatches=8, global_batch=8, seq_len=16)
    e = estimate(cfg, plan, PF, PUBLISHED_PRECISION, Assumptions(host_floor=1.0))
    hop = 16 * 64 * 2 / 100e9 + 1e-6
    busy = 8 * (2.0 + 3 * _head(plan) + 2 * hop)
    pipe = sum(v for k, v in e.time.items() if k not in ("dp_sync", "optimizer"))
    # rel 1e-12: float sums of ~100 terms; the dense layer sits on the other, idler stage
    assert pipe == pytest.approx(busy * 9 / 8, rel=1e-12)
    assert e.time["host"] == pytest.approx(8 * 2.0, rel=1e-6)  # the two MoE layers' wait
    e0 = estimate(cfg, plan, PF, PUBLISHED_PRECISION)
    assert e.step_time > e0.step_time


def test_floor_below_the_device_time_changes_nothing():
    """A floor below every MoE layer's device time (a tenth of the smallest, from the
    unfloored breakdown of a 1-micro-batch run) leaves the step as it is."""
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=16)
    e0 = estimate(CFG, plan, PF, PUBLISHED_PRECISION)
    per_layer = (e0.time["compute"] - 3 * _head(plan)) / 4
    e = estimate(CFG, plan, PF, PUBLISHED_PRECISION, Assumptions(host_floor=per_layer / 10))
    assert e.step_time == e0.step_time and e.time["host"] == 0.0


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf"), True, "1"])
def test_bad_floor_is_refused(bad):
    with pytest.raises(ValueError, match="host_floor=.* must be a number of seconds >= 0"):
        Assumptions(host_floor=bad)


def test_cli_flag_named_and_priced(capsys):
    assert main(["estimate", "--model", "tiny", "--platform", "dgx-h100", "--gpus", "2",
                 "--global-batch", "4", "--ep", "2", "--host-floor-ms", "-2"]) == 2
    assert "--host-floor-ms -2.0 must be a number of milliseconds >= 0" in capsys.readouterr().err
    assert main(["estimate", "--model", "tiny", "--platform", "dgx-h100", "--gpus", "2",
                 "--global-batch", "4", "--ep", "2", "--host-floor-ms", "5", "--json"]) == 0
    import json
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # tiny: 4 MoE layers x 2 micro-batches at >= 5 ms each (its device time is microseconds)
    assert s["step_time_s"] >= 4 * 2 * 5e-3 and s["time_s"]["host"] > 0.9 * 4 * 2 * 5e-3


# -- several schedule runs per step (FSDP2 under torch.distributed.pipelining with GA) ----------

def test_each_schedule_run_fills_and_drains_the_pipeline():
    """1F1B with unit costs F=1, B=2 spans 3 (m + p - 1) for m micro-batches on p stages. A
    step of r runs of m: bubble 1 - 3 r m / (r x 3 (m + p - 1)) = (p - 1) / (m + p - 1), the
    bubble of one run of m, not of r m; uneven runs (7 over 2: 4 and 3 on p = 2) give
    1 - 21 / (15 + 12) = 6 / 27. Only ZeRO-3 gathered per step counts runs."""
    from tuner.estimate import run_bubble

    kw = dict(pp=2, ep=1, dp=1, global_batch=8, seq_len=16, zero=3)
    step4 = Assumptions(zero3_gather="step", zero3_runs=4)
    plan = ParallelPlan(microbatches=8, **kw)
    assert run_bubble(plan, step4) == pytest.approx(1 / 3, rel=1e-12)
    assert run_bubble(plan, Assumptions(zero3_gather="step")) == pytest.approx(1 / 9, rel=1e-12)
    assert run_bubble(plan, Assumptions(zero3_runs=4)) == pytest.approx(1 / 9, rel=1e-12)
    odd = ParallelPlan(microbatches=7, **{**kw, "global_batch": 7})
    assert run_bubble(odd, Assumptions(zero3_gather="step", zero3_runs=2)) == \
        pytest.approx(6 / 27, rel=1e-12)
    # the step prices it: bubble = busy x (1 / (1 - 1/3) - 1) = busy / 2
    e = estimate(CFG, plan, PF, PUBLISHED_PRECISION, step4)
    busy = sum(v for k, v in e.time.items() if k not in ("bubble", "dp_sync", "optimizer"))
    assert e.time["bubble"] == pytest.approx(busy / 2, rel=1e-12)
