"""The measured elementwise rate (`Platform.elementwise_bandwidth`): its fit in `tuner measure`,
the platform file entry, and the estimate's activation traffic term that uses it."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import toy_moe_config, toy_platform

from tuner import Assumptions, ParallelPlan, estimate, load_platform
from tuner.estimate import layer_device_time
from tuner.layout import CPU_TRAFFIC_PASSES, FP32_TRAINER_PRECISION
from tuner.measure import elementwise_bandwidth_fit, write_platform_toml


def test_fit_recovers_the_rate_by_hand():
    act = [1e6, 2e6, 4e6]
    modelled = [0.010, 0.018, 0.034]
    # the rest: 4 passes over each layer's bytes at 5 GB/s, exactly
    measured = [m + 4 * a / 5e9 for m, a in zip(modelled, act, strict=True)]
    assert elementwise_bandwidth_fit(act, measured, modelled, passes=4.0) == pytest.approx(5e9)
    # one layer, by hand: 2 ms more than modelled over 4 x 1 MB -> 2 GB/s
    assert elementwise_bandwidth_fit([1e6], [0.012], [0.010], passes=4.0) == pytest.approx(2e9)
    # the other terms already cover the layer: no rate (the file falls back to hbm_bandwidth)
    assert elementwise_bandwidth_fit([1e6, 2e6], [0.009, 0.017], [0.010, 0.018]) == 0.0
    with pytest.raises(ValueError, match="need equal, non-empty lists"):
        elementwise_bandwidth_fit([1e6], [0.01, 0.02], [0.01])


def test_platform_entry_round_trips_and_falls_back(tmp_path):
    p = load_platform("frontier")
    assert p.elementwise_bandwidth == 0.0 and p.traffic_bandwidth == p.hbm_bandwidth
    q = dataclasses.replace(p, elementwise_bandwidth=7.5e9)
    assert q.traffic_bandwidth == 7.5e9
    back = load_platform(write_platform_toml(q, tmp_path / "q.toml", {}))
    assert back.elementwise_bandwidth == pytest.approx(7.5e9)
    with pytest.raises(ValueError, match="elementwise_bandwidth=-1.0 must be >= 0"):
        dataclasses.replace(p, elementwise_bandwidth=-1.0)


def _compute(cfg, pf, passes: float) -> float:
    plan = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=4, seq_len=32)
    asm = Assumptions(activation_set="trainer", activation_traffic_passes=passes)
    return estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm).time["compute"]


def test_traffic_term_takes_the_measured_rate():
    cfg, pf = toy_moe_config(), toy_platform()
    slow = dataclasses.replace(pf, elementwise_bandwidth=pf.hbm_bandwidth / 3)
    base = _compute(cfg, pf, 0.0)
    traffic = _compute(cfg, pf, CPU_TRAFFIC_PASSES) - base
    assert traffic > 0
    assert _compute(cfg, slow, 0.0) == base  # no passes: the rate does not matter
    assert _compute(cfg, slow, CPU_TRAFFIC_PASSES) - base == pytest.approx(3 * traffic)


def test_layer_device_time_is_one_layer_of_the_estimate():
    """Independent of its own arithmetic: the estimate's compute of the 4-layer toy model minus
    that of the same model with 3 layers is one layer's forward + backward (the head alike),
    and the traffic difference is 4 passes over the layer's saved bytes at the rate."""
    cfg, pf = toy_moe_config(), dataclasses.replace(toy_platform(), layer_overhead=1e-4)
    cfg3 = dataclasses.replace(cfg, n_layers=3)
    seconds, act_bytes = layer_device_time(cfg, 0, 128, 32, pf)
    assert _compute(cfg, pf, 0.0) - _compute(cfg3, pf, 0.0) == pytest.approx(seconds, rel=1e-9)
    t4 = _compute(cfg, pf, CPU_TRAFFIC_PASSES) - _compute(cfg, pf, 0.0)
    t3 = _compute(cfg3, pf, CPU_TRAFFIC_PASSES) - _compute(cfg3, pf, 0.0)
    assert t4 - t3 == pytest.approx(CPU_TRAFFIC_PASSES * act_bytes / pf.hbm_bandwidth, rel=1e-9)
    with pytest.raises(ValueError, match="tokens=48 must be a positive multiple of seq=32"):
        layer_device_time(cfg, 0, 48, 32, pf)
