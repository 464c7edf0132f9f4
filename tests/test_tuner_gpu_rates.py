"""GPU-side model terms from public measurements (issue 33 items 4 and 7) against hand
computations: the [fp8_gemm] shape model and its dgx-h100 parameters (DeepGEMM's published
H800 rates), FP8 expert GEMMs split into gate + up and down, and ZeRO-3 gathered once per
step (FSDP2 under torch.distributed.pipelining)."""

from __future__ import annotations

import dataclasses

import pytest

from model import ModelConfig
from tuner import Assumptions, ParallelPlan, Platform, estimate, stage_memory
from tuner.costs import fp8_effs, layer_parts
from tuner.counts import layer_counts
from tuner.layout import PUBLISHED_PRECISION
from tuner.platform import load_platform

PF = Platform(
    name="toy", peak_flops=100e12, hbm_bytes=80e9, gpus_per_node=4, nic_bandwidth=10e9,
    nics_per_node=2, intra_node_bandwidth=100e9, gemm_efficiency=0.5,
    grouped_gemm_efficiency=0.5, attention_efficiency=0.5, hbm_bandwidth=1e12,
    intra_node_latency=1e-6, network_latency=1e-5, fp8_peak_flops=200e12,
)
PF8 = dataclasses.replace(PF, fp8_max_efficiency=0.8, fp8_k_half=100.0, fp8_hbm_fraction=0.5)


def _mha(L: int = 2, d: int = 64, H: int = 4, E: int = 8, k: int = 2, f: int = 32) -> ModelConfig:
    return ModelConfig(vocab_size=16, d_model=d, n_layers=L, n_heads=H, n_kv_heads=H,
                       n_routed_experts=E, top_k=k, moe_ffn_dim=f)


def test_fp8_gemm_model_by_hand() -> None:
    # compute bound, 8192^3: AI8 = 2 m n k / (m k + k n + 2 m n) = 4096 FLOP/B, far above
    # 200e12 / (0.5 x 1e12) = 400: the k-limited cap 0.8 x 8192 / (8192 + 100)
    assert PF8.fp8_matmul_eff(8192, 8192, 8192, 200e12) == pytest.approx(0.8 * 8192 / 8292)
    # memory bound, 4 rows: AI8 = 2*4*4096*4096 / (4*4096 + 4096*4096 + 2*4*4096)
    ai = 134217728 / (16384 + 16777216 + 32768)
    assert PF8.fp8_matmul_eff(4, 4096, 4096, 200e12) == pytest.approx(ai * 0.5e12 / 200e12)
    assert PF8.fp8_grouped_eff(4, 4096, 4096, 200e12) == PF8.fp8_matmul_eff(4, 4096, 4096, 200e12)
    # without [fp8_gemm]: exactly the bf16 efficiencies (the behaviour before it)
    assert PF.fp8_matmul_eff(64, 32, 16, 200e12) == PF.matmul_eff(64, 32, 16) == 0.5
    assert PF.fp8_grouped_eff(8, 32, 64, 200e12) == PF.grouped_eff(8, 32, 64) == 0.5
    with pytest.raises(ValueError, match="fp8_matmul_eff: k=0 must be > 0"):
        PF8.fp8_matmul_eff(4, 4, 0, 200e12)


def test_dgx_h100_fp8_parameters_reproduce_deepgemm() -> None:
    """dgx-h100's [fp8_gemm] against the DeepGEMM README rates it cites (H800 SXM5, TFLOPS):
    the two k extremes at m = 4096 and the best memory-bound row set its three parameters
    (within their 3-digit rounding, 0.5 %); the contiguous grouped rows are checks (3 %)."""
    h = load_platform("dgx-h100")
    pk = h.fp8_peak_flops
    assert pk == 1979e12

    def tflops(m: float, n: float, k: float) -> float:
        return h.fp8_matmul_eff(m, n, k, pk) * pk / 1e12

    assert tflops(4096, 32768, 512) == pytest.approx(751, rel=5e-3)
    assert tflops(4096, 7168, 16384) == pytest.approx(1426, rel=5e-3)
    assert tflops(64, 7168, 16384) == pytest.approx(336, rel=5e-3)
    assert h.fp8_grouped_eff(8192, 4096, 7168, pk) * 1979 == pytest.approx(1346, rel=0.03)
    assert h.fp8_grouped_eff(4096, 7168, 2048, pk) * 1979 == pytest.approx(1214, rel=0.03)
    assert Platform.from_dict(h.to_dict()) == h


def test_fp8_experts_are_gate_up_and_down_gemms() -> None:
    """The routed experts' FP8 time is their FLOPs at the fp8 peak over the time-weighted
    efficiency of [rows, D] x [D, 2F] (2/3 of the FLOPs) and [rows, F] x [F, D] (1/3)."""
    cfg = _mha(d=64, f=32, E=8, k=2)
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=16,
                        precision="fp8")
    lc = layer_counts(cfg, 0, 2, 16, True)
    parts = layer_parts(lc, 16.0, 16.0, PF8, cfg, plan, Assumptions())
    rows = 2 * 16 * 2 / 8  # top_k x tokens x ep / E
    cap = 0.8  # both GEMMs are memory bound here; the k factor below the cap does not bind

    def eff(m: float, n: float, k: float) -> float:
        ai = 2 * m * n * k / (m * k + k * n + 2 * m * n)
        return min(cap * k / (k + 100), ai * 0.5e12 / 200e12)

    mixed = 1 / ((2 / 3) / eff(rows, 64, 64) + (1 / 3) / eff(rows, 64, 32))
    assert parts["experts"] == pytest.approx(lc.fwd_flops["experts"] * 16 / (200e12 * mixed))
    dense, grouped = fp8_effs(PF8, 200e12, 16.0, 64.0, 64.0, rows, 32.0)
    assert grouped == pytest.approx(mixed) and dense == pytest.approx(eff(16, 64, 64))
    assert parts["gemm"] == pytest.approx(lc.fwd_flops["attention"] * 16 / (200e12 * dense))


@pytest.mark.parametrize("body,match", [
    ({"max_efficiency": 0.7, "k_hlf": 3}, r"unknown keys \['k_hlf'\] in \[fp8_gemm\]"),
    ({"k_half": 400}, r"\[fp8_gemm\] needs max_efficiency in \(0, 1\], got None"),
    ({"max_efficiency": 1.5}, r"fp8_gemm max_efficiency=1.5 must be in \(0, 1\]"),
    ({"max_efficiency": 0.7, "k_half": -1}, r"fp8_gemm k_half=-1.0 must be >= 0"),
    ({"max_efficiency": 0.7, "hbm_fraction": 0}, r"fp8_gemm hbm_fraction=0.0 must be in"),
    ({"max_efficiency": "high"}, r"\[fp8_gemm\] max_efficiency='high' must be a number"),
])
def test_bad_fp8_gemm_section(body: dict, match: str) -> None:
    d = load_platform("dgx-h100").to_dict()
    d["fp8_gemm"] = body
    with pytest.raises(ValueError, match=match):
        Platform.from_dict(d, source="x.toml")


def test_zero3_gathered_once_per_step() -> None:
    """zero3_gather="step": per layer one all-gather (prefetched behind its forward) and one
    reduce-scatter per step, not per micro-batch; the stage's 4 layers held gathered with
    their whole gradient (microbatch: 1 + 1 prefetched layer and one layer's gradient)."""
    cfg = _mha(L=4)
    plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=4, global_batch=8, seq_len=16, zero=3)
    pb = PUBLISHED_PRECISION
    step = Assumptions(zero3_gather="step")
    layer = cfg.attention_params() + 2 * 64 + 8 * 64 + 8 * cfg.expert_params()
    n = stage_memory(cfg, plan, PF, pb)[0].params
    st = stage_memory(cfg, plan, PF, pb, step)[0]
    assert st.weights == pytest.approx((n / 2 + 4 * layer) * 2, rel=1e-12)
    assert st.grads == pytest.approx((n / 2 + 4 * layer) * 2, rel=1e-12)
    per_mb = stage_memory(cfg, plan, PF, pb)[0]
    assert per_mb.weights == pytest.approx((n / 2 + 2 * layer) * 2, rel=1e-12)
    # time by hand: groups of 2 on one node, ring all-gather / reduce-scatter of b bytes:
    # (n - 1) / n x b / 100e9 + (n - 1) x 1 us; non-expert and expert parts each over 2
    rep = cfg.attention_params() + 2 * 64 + 8 * 64
    exp = 8 * cfg.expert_params()

    def ring(b: float) -> float:
        return 0.5 * b / 100e9 + 1e-6

    ag = ring(rep * 2) + ring(exp * 2)
    rs = ag  # published precision: gradients on the wire in 2 B, as the weights
    lc = layer_counts(cfg, 0, 1, 16, True)
    t = plan.attention_tokens("sharded")
    f = sum(layer_parts(lc, t, plan.expert_tokens, PF, cfg, plan, step).values())
    e = estimate(cfg, plan, PF, pb, step)
    assert e.time["zero3"] == pytest.approx(4 * (max(0.0, ag - f) + rs), rel=1e-9)
    e_mb = estimate(cfg, plan, PF, pb)
    assert e_mb.time["zero3"] == pytest.approx(
        4 * 4 * (max(0.0, ag - f) + max(0.0, ag + rs - 2 * f)), rel=1e-9)
    # two schedule runs per step (gradient accumulation over runs): each gathers and
    # reduce-scatters once
    e2 = estimate(cfg, plan, PF, pb, Assumptions(zero3_gather="step", zero3_runs=2))
    assert e2.time["zero3"] == pytest.approx(2 * e.time["zero3"], rel=1e-12)
    with pytest.raises(ValueError, match="zero3_runs=0 must be an int >= 1"):
        Assumptions(zero3_runs=0)
    with pytest.raises(ValueError, match="zero3_gather='layer'; valid: microbatch, step"):
        Assumptions(zero3_gather="layer")


def test_zero3_on_cpu_hides_nothing_and_adds_the_measured_overhead() -> None:
    """On a CPU platform (cores stated) every micro-batch pays its two gathers and its
    reduce-scatter whole (the copies and gloo's work use the cores the compute needs); the
    platform's measured per-layer ZeRO-3 overhead is compute (per layer and micro-batch) and
    its optimizer overhead is per layer and step; a GPU file without them keeps the prefetch
    rule (the test above). `zero3_layer_overhead` subtracts the same modelled collectives
    from a measured extra."""
    import torch

    from model import MoETransformer, presets
    from trainer.distributed.parallel import is_expert_param
    from tuner.costs import all_gather_time, place_groups, reduce_scatter_time
    from tuner.measure import zero3_layer_overhead

    cfg = _mha(L=4)
    plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=4, global_batch=8, seq_len=16, zero=3)
    pb = PUBLISHED_PRECISION
    bare = dataclasses.replace(PF, cores_per_node=2, threads_per_process=1)
    cpu = dataclasses.replace(bare, zero3_layer_overhead=0.02, zero3_optimizer_overhead=0.005)
    rep = cfg.attention_params() + 2 * 64 + 8 * 64
    exp = 8 * cfg.expert_params()
    g = place_groups(plan, cpu.gpus_per_node, "sharded")[0]
    ag = all_gather_time(rep * 2, g["rep"], cpu) + all_gather_time(exp * 2, g["dp"], cpu)
    rs = reduce_scatter_time(rep * 2, g["rep"], cpu) + reduce_scatter_time(exp * 2, g["dp"], cpu)
    e = estimate(cfg, plan, cpu, pb)
    assert e.time["zero3"] == pytest.approx(4 * 4 * (2 * ag + rs), rel=1e-9)
    e0 = estimate(cfg, plan, bare, pb)
    assert e.time["compute"] - e0.time["compute"] == pytest.approx(4 * 4 * 0.02, rel=1e-9)
    assert e.time["optimizer"] - e0.time["optimizer"] == pytest.approx(4 * 0.005, rel=1e-9)
    z1 = plan.replace(zero=1)  # other levels: neither overhead
    assert estimate(cfg, z1, cpu, pb).step_time == estimate(cfg, z1, bare, pb).step_time
    # the measurement's side: the tiny preset's first layer at fp32 over 2 processes
    tiny = presets.get("tiny")
    with torch.device("meta"):
        block = MoETransformer(tiny).layers[0]
    t_exp = sum(q.numel() for n, q in block.named_parameters() if is_expert_param(n))
    t_rep = sum(q.numel() for q in block.parameters()) - t_exp
    g2 = place_groups(ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=2,
                                   seq_len=64, zero=3), cpu.gpus_per_node, "replicated")[0]
    coll = (2 * (all_gather_time(4 * t_rep, g2["rep"], cpu) + all_gather_time(4 * t_exp, g2["dp"], cpu))
            + reduce_scatter_time(4 * t_rep, g2["rep"], cpu)
            + reduce_scatter_time(4 * t_exp, g2["dp"], cpu))
    extra = tiny.n_layers * (0.03 + coll)
    assert zero3_layer_overhead(extra, 2, cpu) == pytest.approx(0.03, rel=1e-9)
    assert zero3_layer_overhead(0.0, 2, cpu) == 0.0
    with pytest.raises(ValueError, match="zero3_layer_overhead_us"):
        dataclasses.replace(PF, zero3_layer_overhead=-1e-3)


def test_zero3_constant_of_the_fsdp_group_size() -> None:
    """`zero3_pair_overhead`: the constant measured over concurrent pairs prices layouts whose
    FSDP groups (a stage's ranks) are pairs; any other group size takes the one measured over
    all processes, as does every layout where no pair value was measured."""
    cfg = _mha(L=4)
    pb = PUBLISHED_PRECISION
    base = dataclasses.replace(PF, gpus_per_node=4, cores_per_node=4, threads_per_process=1)
    both = dataclasses.replace(base, zero3_layer_overhead=0.08, zero3_pair_overhead=0.03)
    pairs = ParallelPlan(pp=2, ep=1, dp=2, microbatches=2, global_batch=8, seq_len=16, zero=3)
    fours = ParallelPlan(pp=1, ep=1, dp=4, microbatches=2, global_batch=8, seq_len=16, zero=3)
    assert both.zero3_overhead(2) == 0.03 and both.zero3_overhead(4) == 0.08
    assert base.zero3_overhead(2) == 0.0
    only = {v: dataclasses.replace(base, zero3_layer_overhead=v) for v in (0.03, 0.08)}
    # the reference: a platform whose one constant is the value the group size should take
    assert estimate(cfg, pairs, both, pb).step_time == estimate(cfg, pairs, only[0.03], pb).step_time
    assert estimate(cfg, fours, both, pb).step_time == estimate(cfg, fours, only[0.08], pb).step_time
    with pytest.raises(ValueError, match="zero3_pair_overhead_us"):
        dataclasses.replace(PF, zero3_pair_overhead=-1e-3)
