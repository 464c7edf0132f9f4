"""The layout dimensions beyond PP x DP x EP (issue 33 item 3) against hand-computed cases:
TP + SP, CP, ETP, ZeRO-3, dedup dispatch, all-to-all overlap, FP8, precision policies."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from model import ModelConfig, presets
from tuner import Assumptions, ParallelPlan, Platform, estimate, stage_memory
from tuner.comms import alltoall_time, dedup_factor, expected_distinct_nodes, placement
from tuner.costs import layer_parts as _layer_parts
from tuner.counts import layer_counts
from tuner.estimate import step_time_lower_bound
from tuner.layout import MEGATRON_PRECISION, PUBLISHED_PRECISION, fold_degrees
from tuner.platform import load_platform

PF = Platform(
    name="toy", peak_flops=100e12, hbm_bytes=80e9, gpus_per_node=4, nic_bandwidth=10e9,
    nics_per_node=2, intra_node_bandwidth=100e9, gemm_efficiency=0.5,
    grouped_gemm_efficiency=0.5, attention_efficiency=0.5, hbm_bandwidth=1e12,
    intra_node_latency=1e-6, network_latency=1e-5,
)


def _mha(L: int = 2, d: int = 64, H: int = 4, E: int = 8, k: int = 2, f: int = 32) -> ModelConfig:
    return ModelConfig(vocab_size=16, d_model=d, n_layers=L, n_heads=H, n_kv_heads=H,
                       n_routed_experts=E, top_k=k, moe_ffn_dim=f)


# -- dedup: distinct (token, node) pairs --------------------------------------------------------

@pytest.mark.parametrize("n,k,E", [(2, 4, 16), (4, 8, 256), (8, 8, 64), (3, 2, 6), (2, 1, 8)])
def test_expected_distinct_nodes_against_monte_carlo(n, k, E):
    """Tokens pick k distinct experts of E uniformly (E/n per node); the mean count of distinct
    nodes per token equals the hypergeometric form within 4 standard errors, and picks with
    replacement (the E >> k limit) equal n (1 - (1 - 1/n)^k) within 4 standard errors."""
    rng = np.random.default_rng(0)
    T = 20000
    experts = np.argsort(rng.random((T, E)), axis=1)[:, :k]  # k distinct experts per token
    nodes = experts // (E // n)
    counts = np.array([len(set(r)) for r in nodes.tolist()])
    se = counts.std() / math.sqrt(T) + 1e-12
    assert abs(counts.mean() - expected_distinct_nodes(n, k, E)) < 4 * se + 1e-9
    picks = rng.integers(0, n, size=(T, k))  # independent picks
    counts = np.array([len(set(r)) for r in picks.tolist()])
    se = counts.std() / math.sqrt(T) + 1e-12
    assert abs(counts.mean() - n * (1 - (1 - 1 / n) ** k)) < 4 * se + 1e-9
    assert abs(expected_distinct_nodes(n, k) - n * (1 - (1 - 1 / n) ** k)) < 1e-12


def test_dedup_is_halo_with_the_distinct_pairs_off_node():
    """8 ranks on 2 nodes, top-2 of 8 experts: P(a node gets neither) = C(4,2)/C(8,2) = 6/28,
    distinct remote nodes per token 1 - 6/28 = 22/28 against k (n-1)/n = 1 copy sent off-node
    by flat: HALO's phase II bytes x 11/14, phases I and III unchanged."""
    g, nb = placement(8, 1, 4), 1e6
    f = 11 / 14
    assert dedup_factor(2, 2, 8) == pytest.approx(f, rel=1e-12)
    t1 = 3 * nb / 8 / 100e9 + 3 * 1e-6
    t2 = 2 * 4 * nb / 8 / 10e9 * f + 1e-5
    t3 = 3 * nb / 8 / 100e9 + 3 * 1e-6
    got = alltoall_time(nb, g, "dedup", PF, top_k=2, n_experts=8)
    assert got == pytest.approx(max(t1, t2 + t3) + 1e-5, rel=1e-12)
    # top-1: nothing to deduplicate; auto: the cheaper of comm's auto choices
    assert alltoall_time(nb, g, "dedup", PF, top_k=1, n_experts=8) == alltoall_time(nb, g, "halo", PF)
    assert alltoall_time(nb, g, "auto", PF) == min(alltoall_time(nb, g, a, PF)
                                                   for a in ("flat", "halo"))


# -- TP with sequence parallel ------------------------------------------------------------------

def test_tp_collectives_and_memory_by_hand():
    """tp=2 x ep=2 on 2 GPUs (folded: dp = 1, edp = 1): per micro-batch a rank holds
    b s / (M x 2) = 8 tokens; each layer (attention only: no dense branch) all-gathers and
    reduce-scatters the TP group's 16 x 64 bf16 rows once in the forward and once in the
    backward: 4 collectives of (n-1)/n x 2048 B at 100 GB/s + 1 us each."""
    cfg = _mha()
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=2, global_batch=2, seq_len=16, tp=2)
    assert (plan.attn_dp, plan.n_gpus) == (1, 2)
    e = estimate(cfg, plan, PF, PUBLISHED_PRECISION)
    one = 0.5 * 16 * 64 * 2 / 100e9 + 1e-6
    assert e.time["tp"] == pytest.approx(2 * 4 * one * 2, rel=1e-12)  # L x 4 x M
    st = stage_memory(cfg, plan, PF, PUBLISHED_PRECISION)[0]
    assert st.params_by_part["attention"] == 2 * cfg.attention_params() / 2
    assert st.params_by_part["experts"] == 2 * 4 * cfg.expert_params()  # E/ep, not split by TP
    assert st.params_by_part["norms"] == 2 * 2 * 64  # replicated over TP
    # activations per rank equal those of 8 tokens per rank without TP (SP shards them all)
    dp2 = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=8)
    assert st.activations == stage_memory(cfg, dp2, PF, PUBLISHED_PRECISION)[0].activations


def test_cp_ring_exposed_beyond_the_attention_core():
    """cp=2: each rank passes its 8 tokens' K and V (2 x 4 heads x 16) once per pass, one ring
    step; it hides behind the attention core of the same pass."""
    cfg = _mha()
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=2, global_batch=2, seq_len=16, cp=2)
    e = estimate(cfg, plan, PF, PUBLISHED_PRECISION)
    step = 8 * 2 * 64 * 2 / 100e9 + 1e-6
    lc = layer_counts(cfg, 0, 2, 16, True)
    core = _layer_parts(lc, 8.0, 8.0, PF, cfg, plan, Assumptions())["attn_core"]
    want = max(0.0, step - core) + max(0.0, 2 * step - 2 * core)
    assert e.time["cp"] == pytest.approx(2 * 2 * want, rel=1e-12)  # L x M
    assert e.time["cp"] > 0


def test_etp_splits_experts_and_gathers_rows():
    cfg = _mha()
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=2, global_batch=4, seq_len=16, etp=2,
                        tp=2)  # 4 GPUs: dense tp 2 x dp 2, experts etp 2 x ep 2
    st = stage_memory(cfg, plan, PF, PUBLISHED_PRECISION)[0]
    assert st.params_by_part["experts"] == 2 * 4 * cfg.expert_params() / 2
    e = estimate(cfg, plan, PF, PUBLISHED_PRECISION)
    rows = 2 * 8 * 2 * 64  # k x tokens per rank x etp x D
    one = 2 * (0.5 * rows * 2 / 100e9 + 1e-6)  # an all-gather and a reduce-scatter
    assert e.time["etp"] == pytest.approx(2 * 2 * one * 2, rel=1e-12)  # passes x L x M


# -- ZeRO-3 ---------------------------------------------------------------------------------------

def test_zero3_memory_and_gathers():
    """dp=2 (edp 2, ep 1): every part flat-sharded over 2 ranks, plus one gathered layer and
    one prefetched (weights) and one layer's whole gradient; no step-end collective."""
    cfg = _mha(L=2)
    plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=2, seq_len=16, zero=3)
    pb = PUBLISHED_PRECISION
    st = stage_memory(cfg, plan, PF, pb)[0]
    n = st.params
    layer = cfg.attention_params() + 2 * 64 + 8 * 64 + 8 * cfg.expert_params()
    assert st.weights == pytest.approx((n / 2 + 2 * layer) * 2, rel=1e-12)
    assert st.grads == pytest.approx((n / 2 + layer) * 2, rel=1e-12)
    assert st.optimizer == pytest.approx(n / 2 * 12, rel=1e-12)
    e = estimate(cfg, plan, PF, pb)
    assert e.dp_collectives == {} and e.time["dp_sync"] == 0.0
    assert e.time["zero3"] > 0


# -- overlap --------------------------------------------------------------------------------------

def test_overlap_modes():
    cfg = _mha(L=2)
    base = ParallelPlan(pp=1, ep=8, dp=1, microbatches=4, global_batch=32, seq_len=64)
    none = estimate(cfg, base, PF, PUBLISHED_PRECISION)
    # one chunk and nothing beside the routed experts to run during the dispatch: nothing hides
    one = estimate(cfg, base.replace(a2a_overlap="layer"), PF, PUBLISHED_PRECISION,
                   Assumptions(a2a_chunks=1))
    assert one.time["alltoall"] == pytest.approx(none.time["alltoall"], rel=1e-12)
    auto = estimate(cfg, base.replace(a2a_overlap="layer"), PF, PUBLISHED_PRECISION)
    assert 0 <= auto.time["alltoall"] <= none.time["alltoall"]
    assert auto.alltoall_hidden == pytest.approx(none.time["alltoall"] - auto.time["alltoall"])
    # fb, pp = 1: M - 1 of M micro-batches paired; the exchange is far above the compute here,
    # so a pair exposes 2A - 3f and an unpaired micro-batch 2A
    fb = estimate(cfg, base.replace(a2a_overlap="fb"), PF, PUBLISHED_PRECISION)
    assert fb.time["alltoall"] < none.time["alltoall"]
    m1 = base.replace(microbatches=1)
    assert estimate(cfg, m1.replace(a2a_overlap="fb"), PF, PUBLISHED_PRECISION).time["alltoall"] \
        == estimate(cfg, m1, PF, PUBLISHED_PRECISION).time["alltoall"]
    # a fast network: every paired exchange hides, 1/M of it stays exposed, and of the
    # paired ones the share of the device their kernels take (overlap_compute_share)
    fast = dataclasses.replace(PF, nic_bandwidth=1e15, intra_node_bandwidth=1e15,
                               network_latency=0.0, intra_node_latency=0.0)
    n_f = estimate(cfg, base, fast, PUBLISHED_PRECISION).time["alltoall"]
    free = Assumptions(overlap_compute_share=0.0)
    fb_f = estimate(cfg, base.replace(a2a_overlap="fb"), fast, PUBLISHED_PRECISION, free)
    assert fb_f.time["alltoall"] == pytest.approx(n_f / 4, rel=1e-9)
    s = Assumptions().overlap_compute_share
    assert s == pytest.approx(20 / 132)  # DeepSeek-V3 report: 20 of 132 SMs
    fb_s = estimate(cfg, base.replace(a2a_overlap="fb"), fast, PUBLISHED_PRECISION)
    assert fb_s.time["alltoall"] == pytest.approx(n_f * (1 / 4 + 3 / 4 * s), rel=1e-9)
    with pytest.raises(ValueError, match="overlap_compute_share=1.0 must be in"):
        Assumptions(overlap_compute_share=1.0)


# -- FP8, precision policies ------------------------------------------------------------------------

def test_fp8_is_a_platform_rate():
    cfg = _mha()
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=16,
                        precision="fp8")
    with pytest.raises(ValueError, match="precision='fp8': platform 'toy' states no FP8 GEMM rate"):
        estimate(cfg, plan, PF)
    lc = layer_counts(cfg, 0, 2, 16, True)
    b16 = _layer_parts(lc, 16.0, 16.0, PF, cfg, plan.replace(precision="bf16"), Assumptions())
    f8 = _layer_parts(lc, 16.0, 16.0, PF, cfg, plan, Assumptions(fp8_peak_factor=2.0))
    for k in ("gemm", "experts", "dense"):
        assert f8[k] == pytest.approx(b16[k] / 2, rel=1e-12)
    assert f8["attn_core"] == b16["attn_core"] and f8["router"] == b16["router"]


def test_fp8_rate_from_the_platform_file():
    """A platform's stated FP8 peak is the fp8 GEMM rate (dgx-h100: 1979 TFLOPS, the H100 SXM
    datasheet); at a rate of 2 x the bf16 peak the GEMMs take half the time, as with
    fp8_peak_factor = 2, and a negative rate is refused."""
    h100 = load_platform("dgx-h100")
    assert h100.fp8_peak_flops == 1979e12
    pf8 = dataclasses.replace(PF, fp8_peak_flops=2 * PF.peak_flops)
    cfg = _mha()
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=16,
                        precision="fp8")
    lc = layer_counts(cfg, 0, 2, 16, True)
    by_rate = _layer_parts(lc, 16.0, 16.0, pf8, cfg, plan, Assumptions())
    by_factor = _layer_parts(lc, 16.0, 16.0, PF, cfg, plan, Assumptions(fp8_peak_factor=2.0))
    assert by_rate == by_factor  # same ops on the same numbers
    with pytest.raises(ValueError, match="fp8_peak_flops=-1.0 must be >= 0"):
        dataclasses.replace(PF, fp8_peak_flops=-1.0)


def test_cp_whole_sequences_use_the_dense_side_dp():
    """Qwen3-235B at seq 64K on 256 GPUs, pp 8, tp 4, cp 4, ep 8 (the ModelZoo long-context
    row): a stage's 32 ranks hold edp 4 x ep 8 experts and dp 2 x cp 4 x tp 4 dense, so 256
    sequences make 128 micro-batches of one sequence per dense-side rank; the check once used
    edp 4 (4 x 128 = 512 > 256) and refused it. 3 micro-batches would not divide."""
    plan = ParallelPlan(pp=8, ep=8, dp=4, tp=4, cp=4, microbatches=128, global_batch=256,
                        seq_len=65536, schedule="interleaved-1f1b", n_virtual=4)
    assert plan.attn_dp == 2 and plan.attn_dp * plan.microbatches == plan.global_batch
    with pytest.raises(ValueError, match=r"global_batch=256 is not divisible by dp=2 x "
                                         r"microbatches=384"):
        plan.replace(microbatches=384)


def test_megatron_policy_is_the_distributed_optimizer_table():
    """Megatron-Core's docs: bf16 parameters with fp32 gradients take 6 + 12/d bytes per
    parameter with the distributed optimizer (18 without); flat shards over d = 4 (dense
    only, so every part shards over the same group)."""
    cfg = ModelConfig(vocab_size=16, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                      n_routed_experts=0, dense_ffn_dim=128)
    plan = ParallelPlan(pp=1, ep=1, dp=4, microbatches=1, global_batch=4, seq_len=16, zero=1)
    st = stage_memory(cfg, plan, PF, MEGATRON_PRECISION, Assumptions(zero_sharding="flat"))[0]
    assert st.state / st.params == pytest.approx(6 + 12 / 4, rel=1e-12)
    z0 = stage_memory(cfg, plan.replace(zero=0), PF, MEGATRON_PRECISION)[0]
    assert z0.state / z0.params == 18


def test_moe_recompute_reruns_the_moe_module_and_its_all_to_all():
    """Megatron's `moe` recompute module on a 2-layer model whose first layer is dense and
    whose second has routed + shared experts, ep=2 on 2 GPUs of one node: the backward re-runs
    the MoE layer's router, experts and shared experts (not its attention, not the dense
    layer), its dispatch + combine a third time, and the MoE layer keeps only its D-wide
    input of what `none` keeps for those parts. Not runnable in the trainer, named."""
    cfg = dataclasses.replace(_mha(), first_k_dense=1, dense_ffn_dim=48, n_shared_experts=1,
                              shared_ffn_dim=32)
    kw = dict(pp=1, ep=2, dp=1, microbatches=2, global_batch=4, seq_len=16)
    none_, moe = (ParallelPlan(**kw, checkpointing=c) for c in ("none", "moe"))
    e0, e1 = estimate(cfg, none_, PF), estimate(cfg, moe, PF)
    lc = layer_counts(cfg, 1, ep=2, seq_len=16, flash_attention=True)
    t = none_.attention_tokens("sharded")
    parts = _layer_parts(lc, t, none_.expert_tokens, PF, cfg, none_, Assumptions())
    moe_fwd = parts["router"] + parts["experts"] + parts["dense"]
    assert e1.time["compute"] - e0.time["compute"] == pytest.approx(2 * moe_fwd, rel=1e-9)  # x M
    assert e1.time["alltoall"] == pytest.approx(1.5 * e0.time["alltoall"], rel=1e-12)
    m0, m1 = (stage_memory(cfg, p, PF, PUBLISHED_PRECISION)[0] for p in (none_, moe))
    b, T = PUBLISHED_PRECISION.activation_bytes, none_.expert_tokens  # 1 micro-batch alive
    module = (lc.act["router"] + lc.act["shared_experts"]) * t + lc.act["experts"] * T
    for part in ("router", "experts", "shared_experts"):
        assert part in m0.act_by_part and part not in m1.act_by_part
    assert m1.act_by_part["moe_input"] == pytest.approx(cfg.d_model * t * b, rel=1e-12)
    assert m1.act_by_part["recompute"] == pytest.approx(module * b, rel=1e-12)
    assert m1.act_by_part["attention"] == m0.act_by_part["attention"]
    from tuner.layout import not_runnable
    assert any("recompute 'moe'" in w for w in not_runnable(moe))
    assert not not_runnable(none_)


def test_lower_bound_holds_over_the_whole_space():
    """300 random layouts of Mixtral-8x7B on 64 toy GPUs over every dimension."""
    cfg, rng = presets.get("mixtral-8x7b"), random.Random(0)
    done = 0
    while done < 300:
        pp, tp, cp = rng.choice((1, 2, 4)), rng.choice((1, 2, 4)), rng.choice((1, 2))
        ep, etp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2))
        try:
            dp, edp = fold_degrees(64, pp, tp, cp, ep, etp)
            plan = ParallelPlan(
                pp=pp, ep=ep, dp=edp, tp=tp, cp=cp, etp=etp, microbatches=rng.choice((4, 8)),
                global_batch=256, seq_len=1024, zero=rng.choice((0, 1, 2, 3)),
                alltoall=rng.choice(("flat", "halo", "dedup", "auto")),
                a2a_overlap=rng.choice(("none", "layer", "fb")),
                checkpointing=rng.choice(("none", "selective", "full", "moe")))
            e = estimate(cfg, plan, PF)
        except ValueError:
            continue
        assert step_time_lower_bound(cfg, plan, PF) <= e.step_time * (1 + 1e-12)
        done += 1
