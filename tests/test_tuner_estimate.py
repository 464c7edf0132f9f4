"""The analytic model against hand-computed cases and docs/reference.md's published formulas."""

from __future__ import annotations

import pytest

from model import ModelConfig, presets
from pipeline import bubble_fraction, build, peak_inflight
from tuner import Assumptions, ParallelPlan, Platform, PrecisionPolicy, estimate, stage_memory
from tuner.comms import alltoall_time, placement
from tuner.counts import chunk_layers, layer_counts
from tuner.estimate import schedule_stats

# A platform with round numbers so expected times can be written down by hand.
PF = Platform(
    name="toy", peak_flops=100e12, hbm_bytes=80e9, gpus_per_node=4, nic_bandwidth=10e9,
    nics_per_node=2, intra_node_bandwidth=100e9, gemm_efficiency=0.5,
    grouped_gemm_efficiency=0.5, attention_efficiency=0.5, hbm_bandwidth=1e12,
    intra_node_latency=1e-6, network_latency=1e-5,
)


def _mha(L: int = 4, d: int = 64, H: int = 4, E: int = 8, k: int = 2, f: int = 32) -> ModelConfig:
    """MHA (4d^2 attention), every layer MoE, no shared experts: the published architecture."""
    return ModelConfig(vocab_size=16, d_model=d, n_layers=L, n_heads=H, n_kv_heads=H,
                       n_routed_experts=E, top_k=k, moe_ffn_dim=f)


def published_1f1b(d, f, L, E, k, H, s, b, M, PP, EP, i) -> float:
    """docs/reference.md 1.1, written out exactly as published (bytes of stage i under 1F1B)."""
    return (L / PP) * (
        64 * d**2 + 48 * (E / EP) * d * f
        + (PP - i) * (12 * (b / M) * s * d + 4 * (b / M) * H * s**2 + 2 * (b / M) * s * k * (3 * f + d) / EP)
    )


@pytest.mark.parametrize("pp,ep,M", [(2, 2, 4), (4, 1, 8), (4, 8, 4), (1, 4, 2)])
def test_reduces_to_published_1f1b_formula(pp, ep, M):
    d, f, L, E, k, H, s, b = 64, 32, 8, 8, 2, 4, 16, 16
    cfg = _mha(L, d, H, E, k, f)
    plan = ParallelPlan(pp=pp, ep=ep, dp=1, microbatches=M, global_batch=b, seq_len=s)
    asm = Assumptions(attention="replicated", flash_attention=False, grad_bucket_bytes=0)
    stages = stage_memory(cfg, plan, PF, PrecisionPolicy(), asm)
    for i, st in enumerate(stages):
        # What the published formula leaves out is reported separately: take it away.
        omitted = sum(st.state_by_part.get(p, 0) for p in ("norms", "router", "embedding", "head"))
        omitted += sum(st.act_by_part.get(p, 0) for p in ("router", "logits")) + st.buffers
        expect = published_1f1b(d, f, L, E, k, H, s, b, M, pp, ep, i)
        assert st.total - omitted == pytest.approx(expect, rel=1e-12)
    assert max(range(pp), key=lambda i: stages[i].activations) == 0  # stage 0 is the peak


def test_gpipe_keeps_all_microbatches():
    cfg = _mha()
    one = ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=8, seq_len=16)
    gp = one.replace(schedule="gpipe")
    a1 = stage_memory(cfg, one, PF)[1].act_by_part["experts"]  # 1F1B last stage: 1 in flight
    a4 = stage_memory(cfg, gp, PF)[1].act_by_part["experts"]
    assert a4 == pytest.approx(4 * a1)


def test_state_bytes_sum_to_model_parameters():
    for name in ("deepseek-v3", "mixtral-8x7b", "llama4-maverick"):
        cfg = presets.get(name)
        plan = ParallelPlan(pp=4, ep=8, dp=1, microbatches=8, global_batch=64, seq_len=128)
        stages = stage_memory(cfg, plan, PF)
        # Every stage's replicated parts once, its experts on each of the EP ranks.
        total = sum(st.params + st.state_by_part.get("experts", 0) / 16 * (plan.ep - 1) for st in stages)
        assert total == cfg.num_params()
        assert all(st.weights == 2 * st.params and st.optimizer == 12 * st.params for st in stages)


def test_stage_state_bytes_by_hand():
    cfg = _mha(L=4, d=64, H=4, E=8, k=2, f=32)
    plan = ParallelPlan(pp=2, ep=4, dp=1, microbatches=2, global_batch=8, seq_len=16)
    st = stage_memory(cfg, plan, PF)
    layer = 4 * 64 * 64 + 2 * 64 + 8 * 64 + 2 * 3 * 64 * 32  # attn + norms + router + 8/4 experts
    assert st[0].params == 2 * layer + 16 * 64  # + embedding
    assert st[1].params == 2 * layer + 64 + 16 * 64  # + final norm + lm_head
    assert st[0].weights + st[0].grads + st[0].optimizer == 16 * st[0].params


@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b", "llama4-maverick"])
def test_layer_flops_sum_to_model_flops_per_token(name):
    cfg = presets.get(name)
    s = 4096
    fwd = 0.0
    for i in range(cfg.n_layers):
        lc = layer_counts(cfg, i, 1, s, True)
        fwd += sum(lc.fwd_flops.values())
    fwd += 2 * cfg.vocab_size * cfg.d_model  # lm_head
    assert 3 * fwd == pytest.approx(cfg.flops_per_token(s), rel=1e-12)


def test_mixtral_flops_per_token_by_hand():
    cfg = presets.get("mixtral-8x7b")
    attn = 2 * 4096 * 4096 + 2 * 4096 * 1024  # q, o: 4096^2; k, v: 8 kv heads x 128
    per_layer = attn + 2 * 3 * 4096 * 14336 + 8 * 4096  # 2 of 8 experts + router
    matmul = 32 * per_layer + 32000 * 4096  # + lm_head
    core = 6 * 32 * 4096 * 32 * (128 + 128)
    assert cfg.flops_per_token(4096) == 6 * matmul + core
    plan = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=2, seq_len=4096)
    e = estimate(cfg, plan, PF)
    # Every efficiency is 0.5 here, so compute time is the model FLOPs at half the peak.
    assert e.time["compute"] == pytest.approx(e.model_flops / (0.5 * 100e12), rel=1e-12)
    assert e.mfu == pytest.approx(e.model_flops / (e.step_time * 100e12), rel=1e-12)


@pytest.mark.parametrize("name", ["deepseek-v3", "llama4-maverick", "qwen3-30b-a3b"])
def test_compute_time_is_model_flops_at_the_efficiency(name):
    # Shared experts, dense layers, MLA, interleaved MoE: every FLOP timed exactly once.
    cfg = presets.get(name)
    plan = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=1, seq_len=1024)
    e = estimate(cfg, plan, PF)
    assert e.time["compute"] == pytest.approx(e.model_flops / (0.5 * 100e12), rel=1e-9)


def test_alltoall_volume_and_time_by_hand():
    cfg = _mha(L=2, d=64, E=8, k=2)
    plan = ParallelPlan(pp=1, ep=8, dp=1, microbatches=1, global_batch=8, seq_len=16)
    st = stage_memory(cfg, plan, PF, assumptions=Assumptions(grad_bucket_bytes=0))[0]
    rows = 2 * (8 * 16 / 8)  # k x tokens per rank
    assert st.buffers == 2 * rows * 64 * 2  # send + receive, bf16
    # 8 ranks on 4-GPU nodes: 3 local peers, 4 remote; 1 MB send buffer -> 1/8 per peer.
    g = placement(8, 1, 4)
    assert (g.local_peers, g.remote_peers, g.nodes) == (3, 4, 2)
    nb = 1e6
    flat = max(3 * nb / 8 / 100e9, 4 * nb / 8 / 5e9) + 3 * 1e-6 + 4 * 1e-5
    assert alltoall_time(nb, g, "flat", PF) == pytest.approx(flat)
    # HALO (comm.cost.a2a_model): I = 3 on-node shares and messages; II = the NIC's bytes (2 ranks
    # per NIC x 4 remote shares) + 1 packed message; III = the relay forwards 3 shares to 3
    # ranks; max(I, II + III) + one network latency of fixed overhead.
    t1 = 3 * nb / 8 / 100e9 + 3 * 1e-6
    t2 = 2 * 4 * nb / 8 / 10e9 + 1e-5
    t3 = 3 * nb / 8 / 100e9 + 3 * 1e-6
    assert alltoall_time(nb, g, "halo", PF) == pytest.approx(max(t1, t2 + t3) + 1e-5)
    assert alltoall_time(nb, placement(1, 1, 4), "flat", PF) == 0.0


def test_alltoall_count_per_step():
    cfg = _mha(L=2, d=64, E=8, k=2)
    plan = ParallelPlan(pp=1, ep=4, dp=1, microbatches=2, global_batch=8, seq_len=16)
    e = estimate(cfg, plan, PF)
    nbytes = 2 * (8 / 2 * 16 / 4) * 64 * 2  # k x tokens per rank per micro-batch x d x bf16
    one = alltoall_time(nbytes, placement(4, 1, 4), "flat", PF)
    assert e.time["alltoall"] == pytest.approx(4 * 2 * 2 * one)  # 4 per MoE layer x 2 layers x M
    full = estimate(cfg, plan.replace(checkpointing="full"), PF)
    assert full.time["alltoall"] == pytest.approx(6 * 2 * 2 * one)


def test_chunks_and_bad_inputs():
    # the trainer's split (trainer.layout.stage_layers): the middle stages take the remainder
    assert [len(c) for c in chunk_layers(61, 4, 1)] == [15, 16, 15, 15]
    assert chunk_layers(61, 4, 1)[1] == list(range(15, 31))
    assert [len(c) for c in chunk_layers(10, 2, 2)] == [2, 3, 3, 2]
    cfg = _mha()
    with pytest.raises(ValueError, match="ep=3 does not divide 8 experts"):
        estimate(cfg, ParallelPlan(pp=1, ep=3, dp=1, microbatches=1, global_batch=3, seq_len=8), PF)
    with pytest.raises(ValueError, match="exceed the model's 4 layers"):
        estimate(cfg, ParallelPlan(pp=8, ep=1, dp=1, microbatches=1, global_batch=8, seq_len=8), PF)
    with pytest.raises(ValueError, match="n_virtual"):
        ParallelPlan(pp=2, ep=1, dp=1, microbatches=2, global_batch=8, seq_len=8, n_virtual=2)
    with pytest.raises(ValueError, match="schedule='pipedream'; valid"):
        ParallelPlan(pp=2, ep=1, dp=1, microbatches=2, global_batch=8, seq_len=8, schedule="pipedream")


def test_recompute_trades_memory_for_time():
    cfg = presets.get("mixtral-8x7b")
    plan = ParallelPlan(pp=4, ep=8, dp=1, microbatches=8, global_batch=64, seq_len=4096)
    base, full = (estimate(cfg, plan.replace(checkpointing=c), PF) for c in ("none", "full"))
    assert full.peak_memory < base.peak_memory
    assert full.time["compute"] == pytest.approx(base.time["compute"] * 4 / 3, rel=0.02)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 40, 1), ("gpipe", 3, 30, 1), ("zb-h1", 4, 37, 1),
                                        ("interleaved-1f1b", 2, 36, 2), ("1f1b", 1, 50, 1)])
def test_schedule_extrapolation_equals_full_simulation(name, p, m, v):
    kw = {"n_virtual": v} if v > 1 else {}
    sched = build(name, p, m, **kw)
    costs = {"F": 1.0, "B": 1.0, "W": 1.0} if name == "zb-h1" else {"F": 1.0, "B": 2.0}
    bubble, peaks = schedule_stats(name, p, m, v)
    assert bubble == pytest.approx(bubble_fraction(sched, costs) if p > 1 else 0.0, abs=1e-12)
    assert peaks == tuple(peak_inflight(sched)[r] for r in range(p))


# -- ZeRO: sharded optimizer state and gradients ------------------------------------------------

def _torch_param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of the built model, counted by torch on the meta
    device and split by the trainer's own rule for what EP shards."""
    import torch

    from model import MoETransformer
    from trainer.distributed.parallel import is_expert_param

    with torch.device("meta"):
        m = MoETransformer(cfg)
    named = list(m.named_parameters())
    exp = sum(p.numel() for n, p in named if is_expert_param(n))
    return sum(p.numel() for _, p in named) - exp, exp


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_zero_memory_by_hand_against_torch_counts(zero):
    cfg = presets.get("tiny")
    rep, exp = _torch_param_counts(cfg)
    assert rep > 0 and exp > 0
    dp, ep = 2, 2
    plan = ParallelPlan(pp=1, ep=ep, dp=dp, microbatches=1, global_batch=8, seq_len=64, zero=zero)
    st = stage_memory(cfg, plan, PF)[0]  # published precision: bf16 weight + grad, 12 B Adam
    held = rep + exp / ep  # every non-expert parameter, 1/EP of the experts
    shard = rep / (dp * ep) + exp / ep / dp  # replica groups: DP x EP and DP
    assert st.params == held
    assert st.weights == 2 * held
    assert st.grads == pytest.approx(2 * (shard if zero == 2 else held), rel=1e-12)
    assert st.optimizer == pytest.approx(12 * (shard if zero >= 1 else held), rel=1e-12)
    assert st.zero_saved == pytest.approx(14 * held - st.grads - st.optimizer, rel=1e-12)
    assert st.update_bytes == pytest.approx(16 * (shard if zero else held), rel=1e-12)


def test_zero1_optimizer_bytes_are_zero0_over_the_replica_group():
    cfg = _mha(L=4, d=64, E=8, k=2, f=32)
    for pp, ep, dp in ((2, 1, 4), (1, 4, 2), (2, 2, 2)):
        plan = ParallelPlan(pp=pp, ep=ep, dp=dp, microbatches=2, global_batch=16, seq_len=16)
        for s0, s1 in zip(stage_memory(cfg, plan, PF), stage_memory(cfg, plan.replace(zero=1), PF),
                          strict=True):
            exp0 = s0.state_by_part.get("experts", 0.0) * 12 / 16  # ZeRO-0 optimizer bytes
            rep0 = s0.optimizer - exp0
            assert s1.optimizer == pytest.approx(rep0 / (dp * ep) + exp0 / dp, rel=1e-12)
            assert (s1.weights, s1.grads) == (s0.weights, s0.grads)
            if ep == 1:
                assert s1.optimizer == pytest.approx(s0.optimizer / dp, rel=1e-12)


def test_zero2_gradients_shard_only_when_held_sharded():
    cfg = _mha(L=2, d=64, E=8, k=2, f=32)
    plan = ParallelPlan(pp=1, ep=1, dp=4, microbatches=2, global_batch=16, seq_len=16, zero=2)
    last = stage_memory(cfg, plan, PF)[0]  # accumulation keeps whole gradients until the last
    each = stage_memory(cfg, plan, PF, assumptions=Assumptions(zero2_grad_sync="each"))[0]
    one = stage_memory(cfg, plan.replace(microbatches=1), PF)[0]
    assert last.grads == 2 * last.params
    assert each.grads == one.grads == pytest.approx(2 * last.params / 4, rel=1e-12)
    assert last.optimizer == each.optimizer == pytest.approx(12 * last.params / 4, rel=1e-12)


def test_zero_sync_is_reduce_scatter_plus_all_gather_by_hand():
    cfg = _mha(L=2, d=64, E=8, k=2, f=32)
    plan = ParallelPlan(pp=1, ep=2, dp=4, microbatches=2, global_batch=16, seq_len=16)
    e0, e1 = estimate(cfg, plan, PF), estimate(cfg, plan.replace(zero=1), PF)
    st = e0.stages[0]
    exp = st.params_by_part["experts"]
    rep = st.params - exp
    # Both groups leave the 4-GPU node (DP x EP = 8 consecutive ranks; DP = 4 at stride 2):
    # every ring step crosses a NIC share of 10e9 x 2 / 4 = 5e9 B/s with 1e-5 s latency.
    rs = 7 / 8 * 2 * rep / 5e9 + 7 * 1e-5 + 3 / 4 * 2 * exp / 5e9 + 3 * 1e-5
    assert e1.dp_collectives == pytest.approx({"reduce_scatter": rs, "all_gather": rs}, rel=1e-12)
    assert e0.dp_collectives == pytest.approx({"all_reduce": 2 * rs}, rel=1e-12)
    assert e1.time["dp_sync"] == pytest.approx(e0.time["dp_sync"], rel=1e-12)  # same bytes
    # The optimizer streams only its shard: 2 x 16 B x (rep / 8 + exp / 4) at 1e12 B/s.
    assert e1.time["optimizer"] == pytest.approx(2 * 16 * (rep / 8 + exp / 4) / 1e12, rel=1e-12)
    each = estimate(cfg, plan.replace(zero=2), PF, assumptions=Assumptions(zero2_grad_sync="each"))
    assert each.dp_collectives["reduce_scatter"] == pytest.approx(2 * rs, rel=1e-12)  # M = 2
    assert e1.peak_memory_zero0 == pytest.approx(e0.peak_memory, rel=1e-12)
    assert e1.zero_saved > 0
    assert e1.zero_saved == pytest.approx(e0.peak_memory - e1.peak_memory, rel=1e-12)


@pytest.mark.parametrize("bad,message", [
    (dict(zero=4), r"zero=4: the ZeRO level must be one of 0 \(replicated state\), 1 .*, 2 .*"),
    (dict(zero=-1), "zero=-1: the ZeRO level must be"),
    (dict(zero=True), "zero=True: the ZeRO level must be"),
    (dict(zero="1"), "zero='1': the ZeRO level must be"),
])
def test_zero_out_of_range_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=2, seq_len=8, **bad)
    with pytest.raises(ValueError, match="zero2_grad_sync='never'; valid: last, each"):
        Assumptions(zero2_grad_sync="never")


def test_per_parameter_zero_keeps_whole_tensors():
    """The trainer's ZeRO owns whole parameters: DeepSeek-V3's first stage cannot shard its
    129280 x 7168 embedding, so its owner holds that tensor's whole optimizer state; flat
    shards split it over the 32 ranks of DP 2 x EP 16. For tiny at DP 2 the greedy owners
    split almost evenly, as flat shards do."""
    cfg, pf = presets.get("deepseek-v3"), PF
    plan = ParallelPlan(pp=32, ep=16, dp=2, microbatches=64, global_batch=4096, seq_len=4096,
                        zero=1, checkpointing="full")
    flat = stage_memory(cfg, plan, pf)[0]
    whole = stage_memory(cfg, plan, pf, assumptions=Assumptions(zero_sharding="per-parameter"))[0]
    emb = 129280 * 7168
    exp = flat.params_by_part["experts"]
    assert flat.optimizer == pytest.approx(12 * ((flat.params - exp) / 32 + exp / 2), rel=1e-12)
    assert whole.optimizer >= 12 * (emb + exp / 2)
    assert whole.optimizer - flat.optimizer > 10e9  # the embedding's 11 GB Adam state, less 1/32
    tiny = presets.get("tiny")
    p2 = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=8, seq_len=64, zero=2)
    a = stage_memory(tiny, p2, pf)[0]
    b = stage_memory(tiny, p2, pf, assumptions=Assumptions(zero_sharding="per-parameter"))[0]
    # whole tensors leave one rank a few norm vectors ahead (768 B of 34 MB)
    assert (b.grads, b.optimizer) == pytest.approx((a.grads, a.optimizer), rel=1e-4)
    assert b.optimizer >= a.optimizer


# -- Redundant expert slots (issue 20) ----------------------------------------------------------

def _slot_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of one expert slot, MoE layers) of the built model on the meta device: a
    GroupedExperts' w1 + w2 + w3 over its E experts."""
    import torch

    from model import MoETransformer
    from model.moe import GroupedExperts

    with torch.device("meta"):
        m = MoETransformer(cfg)
    mods = [g for g in m.modules() if isinstance(g, GroupedExperts)]
    per = {(g.w1.numel() + g.w2.numel() + g.w3.numel()) // g.num_experts for g in mods}
    assert len(per) == 1 and all(g.num_experts == cfg.n_routed_experts for g in mods)
    return per.pop(), len(mods)


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("r", [1, 3])
def test_redundant_slots_memory_and_sync_by_hand(zero, r):
    """r extra slots per MoE layer: their weights (2 B), gradients (2 B, / DP when ZeRO-2
    shards them) and fp32 master + Adam (12 B, / DP under ZeRO-1/2) per parameter, from the
    model's own parameter counts; one all-reduce over EP of r x EP slots' bf16 gradients."""
    cfg = presets.get("tiny")  # 8 experts, 4 MoE layers
    P, n_moe = _slot_params(cfg)
    dp, ep = 2, 2
    base = ParallelPlan(pp=1, ep=ep, dp=dp, microbatches=1, global_batch=8, seq_len=64, zero=zero)
    e0, er = estimate(cfg, base, PF), estimate(cfg, base.replace(redundant=r), PF)
    s0, sr = e0.stages[0], er.stages[0]
    per_param = 2 + 2 / (dp if zero == 2 else 1) + 12 / (dp if zero >= 1 else 1)
    extra = r * n_moe * P * per_param
    assert sr.redundant_bytes == pytest.approx(extra, rel=1e-12)
    assert er.redundant_memory == pytest.approx(extra, rel=1e-12)
    assert sr.total - s0.total == pytest.approx(extra, rel=1e-12)
    assert sr.params - s0.params == r * n_moe * P
    assert (sr.activations, sr.buffers) == (s0.activations, s0.buffers)
    assert s0.redundant_bytes == e0.redundant_memory == 0
    # One all-to-all per MoE layer inside one 4-GPU node of PF (100e9 B/s, 1e-6 s a message):
    # EP pairs are ranks (0, 1), (2, 3); each rank sends r x c bf16 gradient rows (c = 2
    # replicas per replicated expert) to its one peer: bytes / bandwidth + one message.
    row = P * 2
    assert er.dp_collectives["replica_sum"] == pytest.approx(
        n_moe * (r * 2 * row / 100e9 + 1e-6), rel=1e-12)
    # ... and with 3 replicas per replicated expert, 3 rows per redundant slot.
    got = estimate(cfg, base.replace(redundant=r), PF,
                   assumptions=Assumptions(replicas_per_expert=3))
    assert got.dp_collectives["replica_sum"] == pytest.approx(
        n_moe * (r * 3 * row / 100e9 + 1e-6), rel=1e-12)
    assert "replica_sum" not in e0.dp_collectives
    # The DP sync of expert gradients grows by the slots' share (same intra-node ring).
    other = {k: v for k, v in er.dp_collectives.items() if k != "replica_sum"}
    if zero == 0:
        grow = 2 * (dp - 1) / dp * r * n_moe * P * 2 / 100e9
        grew = other["all_reduce"] - e0.dp_collectives["all_reduce"]
        assert grew == pytest.approx(grow, rel=1e-9)
    # The optimizer streams the slots' updated state too (16 B, / DP with ZeRO).
    upd = r * n_moe * P * 16 / (dp if zero else 1)
    assert er.time["optimizer"] - e0.time["optimizer"] == pytest.approx(2 * upd / 1e12, rel=1e-9)
    for k in ("compute", "alltoall", "p2p"):
        assert er.time[k] == e0.time[k]
    assert er.time["dp_sync"] == pytest.approx(sum(er.dp_collectives.values()), rel=1e-12)


def test_redundant_zero_is_todays_estimate():
    """r = 0 (explicit) is the estimate without the field, whatever the layout and ZeRO, and
    adds no part, collective or note (426 estimates of three presets also equal those of the
    code before redundant slots, 913b034: checked once, see docs/planner.md)."""
    cfg = presets.get("mixtral-8x7b")
    for kw in (dict(pp=4, ep=8, dp=2, zero=1), dict(pp=2, ep=2, dp=8, zero=2),
               dict(pp=8, ep=4, dp=1, zero=0, schedule="zb-h1")):
        plan = ParallelPlan(microbatches=8, global_batch=256, seq_len=512, **kw)
        for asm in (Assumptions(), Assumptions(zero_sharding="per-parameter")):
            a, b = estimate(cfg, plan, PF, assumptions=asm), \
                estimate(cfg, plan.replace(redundant=0), PF, assumptions=asm)
            assert a == b
            assert all("redundant_experts" not in s.state_by_part for s in a.stages)
            assert not any("redundant" in n for n in a.notes)
            assert set(a.time) == {"compute", "alltoall", "p2p", "bubble", "dp_sync", "optimizer"}
            assert "replica_sum" not in a.dp_collectives and a.redundant_memory == 0


def test_redundant_per_parameter_zero_shards_the_wider_expert_tensors():
    """Per-parameter ZeRO owns whole tensors: with r slots each expert tensor has E/EP + r
    rows. DP = 2 owners of tiny's 4 layers x 3 expert tensors: 6 each, so the expert state
    still halves, slots included."""
    cfg = presets.get("tiny")
    P, n_moe = _slot_params(cfg)
    asm = Assumptions(zero_sharding="per-parameter")
    plan = ParallelPlan(pp=1, ep=2, dp=2, microbatches=1, global_batch=8, seq_len=64, zero=1)
    s0 = stage_memory(cfg, plan, PF, assumptions=asm)[0]
    s2 = stage_memory(cfg, plan.replace(redundant=2), PF, assumptions=asm)[0]
    assert s2.optimizer - s0.optimizer == pytest.approx(12 * 2 * n_moe * P / 2, rel=1e-12)


@pytest.mark.parametrize("bad,message", [
    (dict(redundant=-1), r"redundant=-1: redundant expert slots per EP rank must be an int >= 0"),
    (dict(redundant=True), r"redundant=True: .* must be an int >= 0"),
    (dict(redundant=1.0), r"redundant=1.0: .* must be an int >= 0"),
    (dict(redundant=1, ep=1), r"redundant=1 needs ep > 1: .* valid with ep=1: 0"),
])
def test_bad_redundant_is_named(bad, message):
    kw = dict(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=8) | bad
    with pytest.raises(ValueError, match=message):
        ParallelPlan(**kw)
    # More slots than experts a rank does not hold: tiny, E = 8, EP = 2 -> 0..4.
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=2, seq_len=8, redundant=5)
    with pytest.raises(ValueError, match=r"redundant=5 exceeds the 4 experts of tiny an EP rank "
                                         r"does not hold \(E=8, ep=2\).* valid: 0\.\.4"):
        estimate(presets.get("tiny"), plan, PF)


def test_replicas_per_expert_is_checked():
    with pytest.raises(ValueError, match="replicas_per_expert=1 must be >= 2"):
        Assumptions(replicas_per_expert=1)
