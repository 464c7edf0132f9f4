"""Multi-token-prediction modules priced on the last stage (`Assumptions.mtp_layers`,
`tuner estimate --mtp-layers`): each is one more decoder layer of the last layer's kind plus
one more pass of the output layer. Checked against the same model with one more layer."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_head_seconds, toy_moe_config, toy_platform

from tuner import Assumptions, ParallelPlan, estimate
from tuner.layout import PUBLISHED_PRECISION

PF = toy_platform()
CFG = toy_moe_config()
_head = toy_head_seconds


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_one_mtp_module_is_one_more_layer_and_one_more_head(floor: float) -> None:
    """pp=1: compute + all-to-all + host with one MTP module = those of the 5-layer model
    (its layers all alike) + M x 3 x one head forward (the extra logits pass). The 5-layer
    model is an independent construction; rel 1e-12: sums of a few dozen float terms."""
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=3, global_batch=6, seq_len=16)
    asm = Assumptions(host_floor=floor)
    mtp = estimate(CFG, plan, PF, PUBLISHED_PRECISION, dataclasses.replace(asm, mtp_layers=1))
    five = estimate(dataclasses.replace(CFG, n_layers=5), plan, PF, PUBLISHED_PRECISION, asm)
    keys = ("compute", "alltoall", "host")
    got = sum(mtp.time.get(k, 0.0) for k in keys)
    want = sum(five.time.get(k, 0.0) for k in keys) + 3 * 3 * _head(plan)
    assert got == pytest.approx(want, rel=1e-12)


def test_mtp_lands_on_the_last_pipeline_stage() -> None:
    """pp=2, 1F1B: the MTP module adds work (to the last stage, the busiest), so the step and
    its compute grow; and mtp_layers=0 is the default model, bit for bit."""
    plan = ParallelPlan(pp=2, ep=1, dp=1, microbatches=8, global_batch=8, seq_len=16)
    base = estimate(CFG, plan, PF)
    assert estimate(CFG, plan, PF, assumptions=Assumptions(mtp_layers=0)).step_time \
        == base.step_time
    mtp = estimate(CFG, plan, PF, assumptions=Assumptions(mtp_layers=1))
    assert mtp.step_time > base.step_time
    assert mtp.time["compute"] > base.time["compute"]


def test_bad_mtp_rejected() -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="mtp_layers"):
            Assumptions(mtp_layers=bad)  # type: ignore[arg-type]
