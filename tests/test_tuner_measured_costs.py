"""Measured collectives and optimizer rate on a platform (`[collectives]`,
`optimizer_bandwidth_gbs`): the file round trip, the named errors, and the model pricing with
them, each against the fit's own formula worked by hand (latency + bytes / bandwidth) or, where
the platform has no fit, against the ring formulas it had before."""

from __future__ import annotations

import dataclasses

import pytest

from model import presets
from tuner import Assumptions, ParallelPlan, estimate, load_platform
from tuner.comms import allreduce_time, broadcast_time, placement, reduce_time
from tuner.estimate import schedule_stats
from tuner.layout import FP32_TRAINER_PRECISION
from tuner.measure import write_platform_toml
from tuner.platform import Platform

FITS = (("all_reduce", 2, 400e-6, 0.8e9), ("reduce", 2, 300e-6, 0.5e9),
        ("broadcast", 2, 200e-6, 1.5e9), ("all_reduce", 4, 900e-6, 0.6e9))


def _local(**kw) -> Platform:
    kw = {"gpus_per_node": 4, "nics_per_node": 4, **kw}
    return dataclasses.replace(load_platform("frontier"), name="local", backend="gloo", **kw)


def test_collectives_and_optimizer_rate_round_trip(tmp_path) -> None:
    p = _local(collectives=FITS, optimizer_bandwidth=2.5e9)
    back = load_platform(write_platform_toml(p, tmp_path / "m.toml", {"collectives": "test"}))
    assert back.optimizer_bandwidth == pytest.approx(2.5e9)
    for (k, n, lat, bw), (k2, n2, lat2, bw2) in zip(p.collectives, sorted(
            back.collectives, key=lambda c: [f[:2] for f in FITS].index(c[:2])), strict=True):
        # the file keeps microseconds to 3 decimals and GB/s to 6 digits
        assert (k, n) == (k2, n2) and lat2 == pytest.approx(lat, rel=1e-6)
        assert bw2 == pytest.approx(bw, rel=1e-6)
    assert Platform.from_dict(load_platform("frontier").to_dict()).collectives == ()


def test_bad_collectives_are_named() -> None:
    d = _local().to_dict()
    with pytest.raises(ValueError, match=r"\[collectives\] keys"):
        Platform.from_dict({**d, "collectives": {"allgather": [[2, 1.0, 1.0]]}})
    with pytest.raises(ValueError, match="group size, latency_us, bandwidth_gbs"):
        Platform.from_dict({**d, "collectives": {"reduce": [[2, 1.0]]}})
    with pytest.raises(ValueError, match="group size >= 2"):
        _local(collectives=(("reduce", 1, 1e-4, 1e9),))
    with pytest.raises(ValueError, match="optimizer_bandwidth"):
        _local(optimizer_bandwidth=-1.0)


def test_collective_times_use_the_fit_else_the_ring() -> None:
    p, nb = _local(collectives=FITS), 13.7e6
    g2, g4 = placement(2, 1, 4), placement(4, 1, 4)
    assert allreduce_time(nb, g2, p) == pytest.approx(400e-6 + nb / 0.8e9, rel=1e-12)
    assert reduce_time(nb, g2, p) == pytest.approx(300e-6 + nb / 0.5e9, rel=1e-12)
    assert broadcast_time(nb, g2, p) == pytest.approx(200e-6 + nb / 1.5e9, rel=1e-12)
    assert allreduce_time(nb, g4, p) == pytest.approx(900e-6 + nb / 0.6e9, rel=1e-12)
    # no reduce / broadcast fit at 4: half the all-reduce (here its fit)
    assert reduce_time(nb, g4, p) == pytest.approx((900e-6 + nb / 0.6e9) / 2, rel=1e-12)
    assert broadcast_time(nb, g4, p) == pytest.approx((900e-6 + nb / 0.6e9) / 2, rel=1e-12)
    # no fits at all: the ring over the link rates, as before
    bare = _local()
    ring4 = 2 * 3 / 4 * nb / bare.intra_node_bandwidth + 2 * 3 * bare.intra_node_latency
    assert allreduce_time(nb, g4, bare) == pytest.approx(ring4, rel=1e-12)
    assert reduce_time(nb, g4, bare) == pytest.approx(ring4 / 2, rel=1e-12)
    assert broadcast_time(nb, g4, bare) == pytest.approx(ring4 / 2, rel=1e-12)


def test_optimizer_time_measured_else_memory_bound() -> None:
    assert _local(optimizer_bandwidth=2e9).optimizer_time(54.6e6) == pytest.approx(54.6e6 / 2e9)
    bare = _local()
    assert bare.optimizer_time(54.6e6) == pytest.approx(2 * 54.6e6 / bare.hbm_bandwidth)


def test_estimate_prices_zero2_with_the_fits() -> None:
    """ZeRO-2 at DP = 2 with the trainer's per-parameter owners: the gradients reduced to
    owners and the weights broadcast from them, over the non-expert (DP x EP = 2) and expert
    (DP = 2) groups, each one fit of the platform; the optimizer at the measured rate."""
    cfg = presets.get("tiny")
    p = _local(collectives=FITS, optimizer_bandwidth=2e9, gpus_per_node=2, nics_per_node=2)
    plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=8, seq_len=128, zero=2)
    asm = Assumptions(activation_set="trainer", zero_sharding="per-parameter")
    e = estimate(cfg, plan, p, FP32_TRAINER_PRECISION, asm)
    st = e.stages[0]
    exp = sum(v for k, v in st.params_by_part.items() if k in ("experts", "redundant_experts"))
    rep = sum(st.params_by_part.values()) - exp
    by_hand_reduce = sum(300e-6 + 4 * n / 0.5e9 for n in (rep, exp))
    by_hand_bcast = sum(200e-6 + 4 * n / 1.5e9 for n in (rep, exp))
    assert e.dp_collectives["reduce"] == pytest.approx(by_hand_reduce, rel=1e-9)
    assert e.dp_collectives["broadcast"] == pytest.approx(by_hand_bcast, rel=1e-9)
    assert e.time["optimizer"] == pytest.approx(st.update_bytes / 2e9, rel=1e-12)


def test_zero_bubble_split_backward_extra() -> None:
    """zb-h1's stages after the first pay the measured split-backward fraction on their whole
    per-chunk compute; the first stage (token ids, no input gradient) and 1F1B do not."""
    cfg = presets.get("tiny")
    plan = ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=16, seq_len=256,
                        schedule="zb-h1")
    base, slow = _local(gpus_per_node=2, nics_per_node=2), _local(
        gpus_per_node=2, nics_per_node=2, split_backward_extra=0.5)
    e0, e1 = (estimate(cfg, plan, p, FP32_TRAINER_PRECISION) for p in (base, slow))
    assert e1.time["compute"] == pytest.approx(1.5 * e0.time["compute"], rel=1e-12)
    f0, f1 = (estimate(cfg, plan.replace(schedule="1f1b"), p, FP32_TRAINER_PRECISION)
              for p in (base, slow))
    assert f1.step_time == f0.step_time  # same ops in the same order: exact
    with pytest.raises(ValueError, match="split_backward_extra"):
        _local(split_backward_extra=-0.1)


def test_zero_bubble_input_share_sets_the_bubble(tmp_path) -> None:
    """B's measured share of the split backward shapes zb-h1's bubble: with no W left
    (share 1) the schedule is 1F1B's, bubble for bubble, also where the statistics are
    extrapolated (m > 4p); at the unmeasured default (equal halves) it is the ZB-H1 optimum
    (p - 1) / (3m + p - 1); in between it grows with the share. The estimate's pipeline
    part follows the bubble: busy / (1 - bubble)."""
    for p_, m in ((2, 4), (2, 8), (4, 8), (4, 64), (8, 200)):
        assert schedule_stats("zb-h1", p_, m, 1, (1.0, 0.0))[0] == pytest.approx(
            schedule_stats("1f1b", p_, m, 1)[0], abs=1e-12)
        assert schedule_stats("zb-h1", p_, m, 1)[0] == pytest.approx(
            (p_ - 1) / (3 * m + p_ - 1), abs=1e-12)
        bubbles = [schedule_stats("zb-h1", p_, m, 1, (s, 0.1))[0] for s in (0.5, 0.6, 0.7, 0.9)]
        assert bubbles == sorted(bubbles) and bubbles[0] < bubbles[-1]
    cfg = presets.get("tiny")
    plan = ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=16, seq_len=256,
                        schedule="zb-h1")
    half, two_thirds = (_local(gpus_per_node=2, nics_per_node=2,
                               split_backward_input_share=s) for s in (0.5, 2 / 3))
    e0, e1 = (estimate(cfg, plan, p, FP32_TRAINER_PRECISION) for p in (half, two_thirds))
    busy = e0.step_time - e0.time["bubble"] - e0.time["dp_sync"] - e0.time["optimizer"]
    b0 = schedule_stats("zb-h1", 2, 4, 1, (0.5, 0.0))[0]
    b1 = schedule_stats("zb-h1", 2, 4, 1, (round(2 / 3, 3), 0.0))[0]
    assert e0.time["bubble"] == pytest.approx(busy * b0 / (1 - b0), rel=1e-9)
    assert e1.time["bubble"] == pytest.approx(busy * b1 / (1 - b1), rel=1e-9)
    back = load_platform(write_platform_toml(two_thirds, tmp_path / "m.toml", {}))
    assert back.split_backward_input_share == pytest.approx(2 / 3, rel=1e-6)  # 6 digits kept
    with pytest.raises(ValueError, match="split_backward_input_share"):
        _local(split_backward_input_share=1.5)


def _rank_grad_bytes(ep: int) -> float:
    """fp32 gradient bytes one rank of the tiny preset holds at PP = 1 and EP = `ep`, counted
    on the torch module itself: every non-expert parameter, 1/ep of the routed experts'."""
    from model import MoETransformer
    from trainer.distributed.parallel import is_expert_param

    named = list(MoETransformer(presets.get("tiny")).named_parameters())
    dense = sum(p.numel() for n, p in named if not is_expert_param(n))
    expert = sum(p.numel() for n, p in named if is_expert_param(n))
    return 4.0 * (dense + expert / ep)


def test_grad_passes_and_small_all_reduces() -> None:
    """The measured gradient passes and small all-reduces (`tuner.costs.grad_post_time`,
    `step_sync_groups`) against the trainer's passes counted by hand: ZeRO-0 at PP 1 x EP 2 runs
    the whole flatten (cat, mul_, clone) over its gradients, the fp64 norm, the clip's scale,
    one norm all-reduce over EP; the rest of the step all-reduces the loss over every rank
    and the expert counts over the stage; a platform without the rates prices none of it."""
    cfg = presets.get("tiny")
    fl, nm, lat = 2e9, 1e9, 300e-6
    p = _local(gpus_per_node=2, nics_per_node=2, grad_flatten_bandwidth=fl,
               grad_norm_bandwidth=nm, sync_latency=lat)
    bare = _local(gpus_per_node=2, nics_per_node=2)
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=16, seq_len=256)
    g = _rank_grad_bytes(2)
    e, e0 = (estimate(cfg, plan, q, FP32_TRAINER_PRECISION) for q in (p, bare))
    assert e.time["grad_post"] == pytest.approx(g / fl + g / nm + g / (3 * fl) + lat, rel=1e-9)
    assert e.time["step_syncs"] == pytest.approx(2 * lat, rel=1e-12)
    assert "grad_post" not in e0.time and "step_syncs" not in e0.time
    assert e.step_time - e0.step_time == pytest.approx(
        e.time["grad_post"] + e.time["step_syncs"], rel=1e-9)
    # ZeRO-2 at DP 2: the cat over every gradient in the backward's buckets, the scale, norm
    # and clip over the owned ones; the norm all-reduced over the stage group
    z2 = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=8, seq_len=128, zero=2)
    ez = estimate(cfg, z2, p, FP32_TRAINER_PRECISION,
                  Assumptions(activation_set="trainer", zero_sharding="per-parameter"))
    held, owned = _rank_grad_bytes(1), ez.stages[0].grads
    assert owned < 0.6 * held  # the owner's share, about half
    assert ez.time["grad_post"] == pytest.approx(
        (held + 2 * owned) / (3 * fl) + owned / nm + lat, rel=1e-9)
    for key in ("grad_flatten_bandwidth", "grad_norm_bandwidth", "sync_latency",
                "collective_tail", "pair_sync_latency"):
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=key):
                _local(**{key: bad})


def test_small_all_reduces_priced_by_their_group() -> None:
    """`step_sync_groups` by hand (trainer/step.py, trainer/observe/stats.py and metrics.py,
    trainer/distributed/grad_sync.py `clip`), and `Platform.sync_time`: a pair in a larger job
    at `pair_sync_latency` where measured, every other group at `sync_latency`, none over one
    rank; the estimate sums the syncs at their groups' prices."""
    from tuner.costs import step_sync_groups

    def plan(**kw) -> ParallelPlan:
        return ParallelPlan(**{"pp": 1, "ep": 1, "dp": 1, "microbatches": 4,
                               "global_batch": 16, "seq_len": 128, **kw})

    # PP 2 x EP 2: the norm over EP and PP; the loss over all 4, the counts over the stage
    # (the EP pair), the metrics over PP
    assert step_sync_groups(plan(pp=2, ep=2)) == ((2, 2), (4, 2, 2))
    assert step_sync_groups(plan(pp=2, ep=2), moe_on_rank=False) == ((2, 2), (4, 2))
    # DP 4, ZeRO-2: the norm over the stage (4); ZeRO-0: no EP, no PP, no norm all-reduce
    assert step_sync_groups(plan(dp=4, zero=2)) == ((4,), (4, 4))
    assert step_sync_groups(plan(dp=4)) == ((), (4, 4))
    assert step_sync_groups(plan()) == ((), ())
    lat, pair = 6e-3, 2e-3
    p = _local(sync_latency=lat, pair_sync_latency=pair)
    assert p.sync_time(2, 4) == pair and p.sync_time(4, 4) == lat and p.sync_time(2, 2) == lat
    assert p.sync_time(1, 4) == 0.0 and p.sync_time(4, 8) == lat
    assert _local(sync_latency=lat).sync_time(2, 4) == lat  # no pair measured
    cfg = presets.get("tiny")
    e = estimate(cfg, plan(pp=2, ep=2), p, FP32_TRAINER_PRECISION)
    e0 = estimate(cfg, plan(pp=2, ep=2), _local(sync_latency=lat), FP32_TRAINER_PRECISION)
    assert e.time["step_syncs"] == pytest.approx(lat + 2 * pair, rel=1e-12)
    assert e0.time["step_syncs"] == pytest.approx(3 * lat, rel=1e-12)
    assert e0.time["grad_post"] - e.time["grad_post"] == pytest.approx(2 * (lat - pair),
                                                                        rel=1e-9)


def test_collective_tail_once_per_call_after_the_backward(tmp_path) -> None:
    """`Platform.collective_tail`: ZeRO-0's all-reduce pays it once per group it reduces
    over (2 at EP 1 x DP 2: the non-expert and the expert gradients; 1 at EP 2 x DP 1, where
    the experts have no replica), ZeRO-1/2's weight broadcast once per bucket
    (`StageMemory.bcast_calls`, pinned to the trainer's buckets in
    tests/test_tuner_trainer_model.py), ZeRO-1's all-reduce and ZeRO-2's reduce (launched
    from the backward's hooks) not at all; and the file round-trips it."""
    cfg, tail = presets.get("tiny"), 1.5e-3
    p0 = _local(gpus_per_node=2, nics_per_node=2)
    p1 = dataclasses.replace(p0, collective_tail=tail)
    asm = Assumptions(activation_set="trainer", zero_sharding="per-parameter")
    for (ep, dp, zero), calls in {(1, 2, 0): {"all_reduce": 2}, (2, 1, 0): {"all_reduce": 1},
                                  (1, 2, 1): {"all_reduce": 0, "broadcast": None},
                                  (1, 2, 2): {"reduce": 0, "broadcast": None}}.items():
        plan = ParallelPlan(pp=1, ep=ep, dp=dp, microbatches=1, global_batch=8, seq_len=128,
                            zero=zero)
        e0, e1 = (estimate(cfg, plan, q, FP32_TRAINER_PRECISION, asm) for q in (p0, p1))
        for key, n in calls.items():
            n = e1.stages[0].bcast_calls if n is None else n
            assert n > 0 or key != "broadcast"
            assert e1.dp_collectives[key] - e0.dp_collectives[key] == pytest.approx(
                n * tail, abs=1e-12), (ep, dp, zero, key)
        assert e1.step_time - e0.step_time == pytest.approx(
            sum(e1.stages[0].bcast_calls if n is None else n for n in calls.values()) * tail,
            abs=1e-12)
    back = load_platform(write_platform_toml(
        dataclasses.replace(p1, pair_sync_latency=2.5e-3), tmp_path / "p.toml", {}))
    assert back.collective_tail == pytest.approx(tail, rel=1e-6)
    assert back.pair_sync_latency == pytest.approx(2.5e-3, rel=1e-6)


def test_zero_copy_rate_measured_else_half_the_copy_bandwidth(tmp_path) -> None:
    """`zero_copy_bandwidth_gbs`: the file round trip, the named error, and the rate a pass
    takes: the measured one, else a copy at hbm_bandwidth (which counts read and write)."""
    p = _local(zero_copy_bandwidth=7.5e9)
    back = load_platform(write_platform_toml(p, tmp_path / "m.toml", {}))
    assert back.zero_copy_bandwidth == pytest.approx(7.5e9) and back.zero_copy_rate == 7.5e9
    bare = _local()
    assert bare.zero_copy_bandwidth == 0.0
    assert bare.zero_copy_rate == pytest.approx(bare.hbm_bandwidth / 2, rel=1e-12)
    assert load_platform("dgx-h100").zero_copy_rate == load_platform("dgx-h100").hbm_bandwidth / 2
    with pytest.raises(ValueError, match="zero_copy_bandwidth"):
        _local(zero_copy_bandwidth=-1.0)


def test_loss_time_measured_else_not_priced(tmp_path) -> None:
    """`loss_bandwidth_gbs`: the file round trip, the named error, the time by hand (fp32
    logits: tokens x vocab x 4 B at the rate), 0 where not measured (every GPU file)."""
    p = _local(loss_bandwidth=2.0e9)
    back = load_platform(write_platform_toml(p, tmp_path / "m.toml", {}))
    assert back.loss_bandwidth == pytest.approx(2.0e9)
    assert back.loss_time(512, 2048) == pytest.approx(512 * 2048 * 4 / 2.0e9, rel=1e-9)
    assert _local().loss_time(512, 2048) == 0.0
    assert load_platform("dgx-h100").loss_time(4096, 129280) == 0.0
    with pytest.raises(ValueError, match="loss_bandwidth=-1.0 must be >= 0"):
        _local(loss_bandwidth=-1.0)


@pytest.mark.parametrize("pp, m", [(1, 1), (1, 4), (2, 4)])
def test_estimate_prices_the_loss_once_per_micro_batch_on_the_last_stage(pp: int, m: int) -> None:
    """The loss term: each micro-batch's logits (its tokens x vocab, fp32) once, on the last
    stage only. With PP 1 the step grows by exactly m x that time; with PP 2 (one device per
    rank) the busiest stage's compute does: the last one, which holds the head."""
    cfg = presets.get("tiny")
    plan = ParallelPlan(pp=pp, ep=1, dp=1, microbatches=m, global_batch=8, seq_len=128)
    asm = Assumptions(activation_set="trainer", shared_cores=False)
    rate = 1.5e9
    runs = {r: estimate(cfg, plan, _local(gpus_per_node=pp, nics_per_node=pp, loss_bandwidth=r),
                        FP32_TRAINER_PRECISION, asm) for r in (0.0, rate)}
    one = (8 // m) * 128 * cfg.vocab_size * 4 / rate  # a micro-batch's logits at the rate
    if pp == 1:
        assert runs[rate].step_time - runs[0.0].step_time == pytest.approx(m * one, rel=1e-9)
    else:  # the busiest rank's parts: the last stage (2 of the 4 layers and the head)
        assert runs[rate].time["compute"] - runs[0.0].time["compute"] == pytest.approx(
            m * one, rel=1e-9)


def _tiny_numel(expert: bool | None = None) -> int:
    """Elements of the tiny preset's parameters, counted on the torch module (all, or only
    the routed experts' / only the others')."""
    from model import MoETransformer
    from trainer.distributed.parallel import is_expert_param

    return sum(p.numel() for n, p in MoETransformer(presets.get("tiny")).named_parameters()
               if expert is None or is_expert_param(n) == expert)


def test_estimate_prices_zero_broadcast_copies() -> None:
    """Per-parameter ZeRO-1/2 at DP = 2, tiny, the trainer's 25 MiB buckets: each owner's
    bucket holds several parameters (tiny's 13.7 MB of fp32 weights split over 2 owners x 2
    kinds), so every rank packs or unpacks every weight once: 4 B x all parameters at the
    platform's rate, beside the broadcast, in the ZeRO rows' dp_collectives. ZeRO-0, flat
    sharding and a group of one rank (DP = EP = 1) copy nothing."""
    cfg = presets.get("tiny")
    rate = 6e9
    p = _local(collectives=FITS, gpus_per_node=2, nics_per_node=2, zero_copy_bandwidth=rate)
    asm = Assumptions(activation_set="trainer", zero_sharding="per-parameter")
    n = _tiny_numel()
    for z in (1, 2):
        plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=8, seq_len=128,
                            zero=z)
        e = estimate(cfg, plan, p, FP32_TRAINER_PRECISION, asm)
        assert e.stages[0].bcast_copy_params == n
        assert e.dp_collectives["broadcast_copy"] == pytest.approx(4 * n / rate, rel=1e-12)
        assert e.time["dp_sync"] == pytest.approx(sum(e.dp_collectives.values()), rel=1e-12)
        unmeasured = estimate(cfg, plan, dataclasses.replace(p, zero_copy_bandwidth=0.0),
                              FP32_TRAINER_PRECISION, asm)
        assert unmeasured.dp_collectives["broadcast_copy"] == pytest.approx(
            4 * n / (p.hbm_bandwidth / 2), rel=1e-12)
    z0 = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=8, seq_len=128)
    flat = z0.replace(zero=1)
    one = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=8, seq_len=128, zero=1)
    for plan, a in ((z0, asm), (flat, Assumptions(activation_set="trainer")), (one, asm)):
        e = estimate(cfg, plan, p, FP32_TRAINER_PRECISION, a)
        assert "broadcast_copy" not in e.dp_collectives and e.stages[0].bcast_copy_params == 0
    # EP = 2 x DP = 2: the non-experts over the 4 stage ranks, each rank's 4 of the 8
    # experts per layer over the 2 DP ranks: every weight the rank holds is copied
    ep = ParallelPlan(pp=1, ep=2, dp=2, microbatches=1, global_batch=8, seq_len=128, zero=1)
    e = estimate(cfg, ep, _local(zero_copy_bandwidth=rate), FP32_TRAINER_PRECISION, asm)
    assert e.stages[0].bcast_copy_params == _tiny_numel(False) + _tiny_numel(True) // 2
