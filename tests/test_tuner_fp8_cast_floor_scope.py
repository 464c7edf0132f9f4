"""Two step-time terms of published GPU runs: the FP8 casts (`tuner.costs.fp8_cast_time`,
`Assumptions.fp8_cast_bytes`) and the host floor bounding only the passes that sync the host
(`Assumptions.host_floor_scope="forward"`). Checked against hand-computed sums on the toy
platform (HBM 1 TB/s)."""

from __future__ import annotations

import pytest
from conftest import toy_head_seconds, toy_moe_config, toy_platform

from tuner import Assumptions, ParallelPlan, estimate
from tuner.cli import main
from tuner.layout import PUBLISHED_PRECISION

PF = toy_platform()
CFG = toy_moe_config()  # 4 MoE layers, D 64, 4 heads x 16 (MHA), 8 experts top-2, F 32
FP8 = dict(fp8_peak_factor=2.0)


def _cast_elements_per_token() -> float:
    """Elements one token casts in one layer, forward inputs + backward output gradients, from
    the shapes: attention QKV [D -> 3 x 4 x 16] and output [64 -> D]; each of its k = 2 expert
    rows gate + up [D -> 2F] and down [F -> D]."""
    D, H, hd, F, k = 64, 4, 16, 32, 2
    attention = D + 3 * H * hd + H * hd + D
    experts = k * (D + 2 * F + F + D)
    return attention + experts


@pytest.mark.parametrize("recompute,passes", [("none", 1.0), ("full", 1.5)])
def test_casts_by_hand(recompute, passes):
    """pp=1, ep=2 on 2 GPUs, 3 micro-batches of 16 tokens per rank: the casts add 4 B x the
    elements x tokens x layers x micro-batches / HBM bandwidth to compute, and a full
    recompute casts the forward's inputs once more (half of the elements)."""
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=3, global_batch=6, seq_len=16,
                        precision="fp8", checkpointing=recompute)
    a = estimate(CFG, plan, PF, PUBLISHED_PRECISION, Assumptions(fp8_cast_bytes=0.0, **FP8))
    b = estimate(CFG, plan, PF, PUBLISHED_PRECISION, Assumptions(**FP8))  # default 4 B
    want = 4.0 * _cast_elements_per_token() * passes * 16 * 4 * 3 / 1e12
    # rel 1e-9: the same float sums with one more term per layer
    assert b.time["compute"] - a.time["compute"] == pytest.approx(want, rel=1e-9)
    bf16 = ParallelPlan(pp=1, ep=2, dp=1, microbatches=3, global_batch=6, seq_len=16)
    assert estimate(CFG, bf16, PF).step_time == estimate(
        CFG, bf16, PF, assumptions=Assumptions(fp8_cast_bytes=8.0)).step_time  # bf16: none


def test_bad_cast_bytes_refused(capsys):
    with pytest.raises(ValueError, match="fp8_cast_bytes=-1.0 must be >= 0"):
        Assumptions(fp8_cast_bytes=-1.0)
    assert main(["estimate", "--model", "tiny", "--platform", "dgx-h100", "--gpus", "2",
                 "--global-batch", "4", "--ep", "2", "--precision", "fp8",
                 "--fp8-cast-bytes", "-1"]) == 2
    assert "fp8_cast_bytes=-1.0 must be >= 0" in capsys.readouterr().err


def test_forward_scope_floors_the_forward_only():
    """Floor 1 s far above the toy's microsecond layers, pp=1, ep=2, 2 micro-batches: with
    scope "layer" each layer takes 1 s; with "forward" 1 s + its backward's device time (2/3
    of its device time, whose forward + backward is 3 f), and with full recompute the
    recomputed forward is floored too: 2 s + the backward's share."""
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=2, global_batch=4, seq_len=16)
    e0 = estimate(CFG, plan, PF, PUBLISHED_PRECISION)
    dev = (e0.time["compute"] + e0.time["alltoall"] - 2 * 3 * toy_head_seconds(plan)) / (4 * 2)
    layer = estimate(CFG, plan, PF, PUBLISHED_PRECISION, Assumptions(host_floor=1.0))
    fwd = estimate(CFG, plan, PF, PUBLISHED_PRECISION,
                   Assumptions(host_floor=1.0, host_floor_scope="forward"))
    assert layer.time["host"] == pytest.approx(8 * (1.0 - dev), rel=1e-9)
    assert fwd.time["host"] == pytest.approx(8 * (1.0 - dev / 3), rel=1e-9)
    assert fwd.step_time - layer.step_time == pytest.approx(8 * 2 * dev / 3, rel=1e-6)
    full = ParallelPlan(pp=1, ep=2, dp=1, microbatches=2, global_batch=4, seq_len=16,
                        checkpointing="full")
    f0 = estimate(CFG, full, PF, PUBLISHED_PRECISION)
    dev_f = (f0.time["compute"] + f0.time["alltoall"] - 2 * 3 * toy_head_seconds(full)) / 8
    ff = estimate(CFG, full, PF, PUBLISHED_PRECISION,
                  Assumptions(host_floor=1.0, host_floor_scope="forward"))
    # the device time splits f : 2f : f (forward, backward, recompute) of 4 f
    assert ff.time["host"] == pytest.approx(8 * (2.0 - 2 * dev_f / 4), rel=1e-9)


def test_bad_scope_refused(capsys):
    with pytest.raises(ValueError, match="host_floor_scope='backward'; valid: layer, forward"):
        Assumptions(host_floor_scope="backward")
    with pytest.raises(SystemExit):
        main(["estimate", "--model", "tiny", "--platform", "dgx-h100", "--gpus", "2",
              "--global-batch", "4", "--ep", "2", "--host-floor-scope", "backward"])
    assert "--host-floor-scope: invalid choice: 'backward'" in capsys.readouterr().err
