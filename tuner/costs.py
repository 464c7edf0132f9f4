"""Per-layer time terms of the analytic model: compute by part, and the collectives of TP,
CP, ETP, ZeRO-3 and the MoE all-to-all with its overlap (`tuner.estimate`'s docstring says
how they add up to a step). Pure functions over the model config, the plan and the platform.

Legend: t tokens one rank holds per micro-batch (b s / (M x stage ranks)), D model width,
F expert width, E routed experts, k top-k, c all-to-all chunks.
"""

from __future__ import annotations

import functools

from model import ModelConfig
from tuner.comms import (
    GroupPlacement,
    allreduce_time,
    alltoall_time,
    auto_choices,
    auto_considers_dedup,
    netsim_alltoall_time,
    p2p_time,
    placement,
)
from tuner.counts import LayerCounts
from tuner.layout import Assumptions, ParallelPlan, PrecisionPolicy
from tuner.platform import Platform

__all__ = ["a2a_exposed", "a2a_one", "all_gather_time", "fp8_cast_time", "fp8_effs", "gemm_peak", "grad_post_time",
           "head_fwd", "place_groups", "kv_width", "layer_collectives", "layer_fwd", "layer_parts",
           "moe_module_time", "recompute_time", "recomputes_a2a", "reduce_scatter_time",
           "step_sync_groups", "zero3_time"]


def reduce_scatter_time(nbytes: float, group: GroupPlacement, platform: Platform) -> float:
    """Ring reduce-scatter of `nbytes` per rank (each ends with its reduced 1/n): the first
    half of the ring all-reduce (`tuner.comms.allreduce_time`), (n-1)/n of the data over the
    slowest link and n-1 latency steps."""
    return allreduce_time(nbytes, group, platform) / 2


def all_gather_time(nbytes: float, group: GroupPlacement, platform: Platform) -> float:
    """Ring all-gather that leaves `nbytes` on every rank from shards of 1/n: the second half
    of the ring all-reduce."""
    return allreduce_time(nbytes, group, platform) / 2


def gemm_peak(pf: Platform, plan: ParallelPlan, asm: Assumptions) -> float:
    """FLOP/s peak of the transformer-block GEMMs at the plan's GEMM precision: the bf16
    `peak_flops`, or for fp8 the platform's `fp8_peak_flops` when its file states one, else
    `Assumptions.fp8_peak_factor` x the bf16 peak; without either fp8 is refused."""
    if plan.precision == "bf16":
        return pf.peak_flops
    if pf.fp8_peak_flops > 0:
        return pf.fp8_peak_flops
    if asm.fp8_peak_factor:
        return pf.peak_flops * asm.fp8_peak_factor
    raise ValueError(
        f"precision='fp8': platform {pf.name!r} states no FP8 GEMM rate; give one "
        f"(Assumptions.fp8_peak_factor, `--fp8-peak-factor`, e.g. 2.0 for H100/H200: dense "
        f"FP8 1979 vs bf16 989 TFLOPS) or use precision='bf16'")


def layer_parts(lc: LayerCounts, t_attn: float, t_exp: float, pf: Platform, cfg: ModelConfig,
                 plan: ParallelPlan, asm: Assumptions) -> dict[str, float]:
    """Forward seconds of one layer for one micro-batch on one rank, by part: "gemm" (the
    attention projections), "attn_core" (scores and values), "router", "experts" (the grouped
    GEMMs), "dense" (shared experts and dense FFN). TP with sequence parallel runs the TP
    group's t_attn x tp tokens through 1/tp of every dense weight (width D / tp), ETP each
    expert's rows through 1/etp of its F; FP8 runs the projections and FFNs at its peak
    (scores, values and router stay bf16)."""
    D, tp = cfg.d_model, plan.tp
    peak, fast = pf.peak_flops, gemm_peak(pf, plan, asm)
    gemm_eff = pf.matmul_eff(t_attn * tp, D / tp, D)
    E = max(cfg.n_routed_experts, 1)
    rows = cfg.top_k * t_exp * plan.etp * plan.ep / E  # rows each local expert multiplies
    if plan.precision == "fp8":
        fast_eff, grouped = fp8_effs(pf, fast, t_attn * tp, D / tp, D, rows,
                                     cfg.moe_ffn_dim / plan.etp)
    else:
        fast_eff, grouped = gemm_eff, pf.grouped_eff(rows, cfg.moe_ffn_dim / plan.etp, D)
    out = {"gemm": lc.fwd_flops.get("attention", 0.0) * t_attn / (fast * fast_eff),
           "router": lc.fwd_flops.get("router", 0.0) * t_attn / (peak * gemm_eff),
           "attn_core": lc.fwd_flops["attn_core"] * t_attn / (
               peak * pf.attention_eff(plan.seq_len, int(cfg.qk_head_dim), False))}
    out["experts"] = lc.fwd_flops.get("experts", 0.0) * t_exp / (fast * grouped)
    out["dense"] = (lc.fwd_flops.get("shared_experts", 0.0)
                    + lc.fwd_flops.get("dense_ffn", 0.0)) * t_attn / (fast * fast_eff)
    return out


def fp8_effs(pf: Platform, fp8_peak: float, m: float, n: float, k: float, rows: float,
             f: float) -> tuple[float, float]:
    """(dense, grouped) efficiencies of FP8 GEMMs against `fp8_peak`: the dense projections
    at the proxy shape [m, k] x [k, n] of the bf16 path, and the routed experts' SwiGLU as
    its two GEMMs per expert, gate + up [rows, D] x [D, 2f] (2/3 of the FLOPs) and down
    [rows, f] x [f, D] (1/3), combined by time: 1 / eff = (2/3) / eff_up + (1/3) / eff_down.
    The split matters for FP8, whose efficiency falls with the reduction depth k (the down
    projection's k = f; `Platform.fp8_matmul_eff`). Without an [fp8_gemm] section the
    platform's bf16 efficiencies come back (one grouped shape, as before it)."""
    dense = pf.fp8_matmul_eff(m, n, k, fp8_peak)
    if not pf.fp8_max_efficiency:
        return dense, pf.grouped_eff(rows, f, k)
    up = pf.fp8_grouped_eff(rows, 2 * f, k, fp8_peak)
    down = pf.fp8_grouped_eff(rows, k, f, fp8_peak)
    return dense, 1.0 / ((2.0 / 3.0) / up + (1.0 / 3.0) / down)


# GEMM-holding parts of a layer, and how many rows of the layer's input each token brings
_CAST_PARTS = ("attention", "shared_experts", "dense_ffn", "experts")


def fp8_cast_time(lc: LayerCounts, t_attn: float, t_exp: float, pf: Platform,
                  cfg: ModelConfig, plan: ParallelPlan, asm: Assumptions) -> float:
    """Seconds of one layer's FP8 casts for one micro-batch on one rank, forward + backward
    (0 unless `precision="fp8"`): `Assumptions.fp8_cast_bytes` per element cast, at the
    platform's HBM bandwidth. A GEMM [m, k] x [k, n] casts its input (m x k) in the forward
    and its output gradient (m x n) in the backward. Each part's projections come in pairs
    whose outer widths are D (attention: the QKV projection's input and the output
    projection's output; a SwiGLU FFN: gate + up's input and down's output) and whose inner
    widths sum to its forward FLOPs per row / 2D, so a row casts 2D + FLOPs / 2D elements
    (exact for MHA / GQA and SwiGLU, low for MLA's low-rank projections, whose inner widths
    are not all D wide); routed experts per routed row (k per token), the rest per token.
    TP / ETP split each projection's cast work evenly over the group; full recompute casts
    the forward's inputs again (half of the elements, the pairs' inner widths taken as
    symmetric)."""
    if plan.precision != "fp8" or not asm.fp8_cast_bytes:
        return 0.0
    D = cfg.d_model
    elements = 0.0
    for part in _CAST_PARTS:
        fl = lc.fwd_flops.get(part, 0.0)
        if not fl:
            continue
        rows_per_token = cfg.top_k if part == "experts" else 1
        tokens = t_exp if part == "experts" else t_attn
        # TP's group sees tp x t_attn tokens (ETP's etp x the rows) through 1/tp (1/etp)
        # of each projection: this rank's share is its own tokens' (rows') casts
        elements += (2 * D * rows_per_token + fl / (2 * D)) * tokens
    if plan.checkpointing == "full":
        elements *= 1.5
    return asm.fp8_cast_bytes * elements / pf.hbm_bandwidth


def layer_fwd(lc: LayerCounts, t_attn: float, t_exp: float, pf: Platform, cfg: ModelConfig,
               plan: ParallelPlan, asm: Assumptions) -> tuple[float, float]:
    """(forward seconds, of which FFN seconds) of one layer for one micro-batch."""
    parts = layer_parts(lc, t_attn, t_exp, pf, cfg, plan, asm)
    return sum(parts.values()), parts["experts"] + parts["dense"]


def head_fwd(cfg: ModelConfig, plan: ParallelPlan, pf: Platform, t_attn: float) -> float:
    """Forward seconds of the lm_head for one micro-batch (vocab-parallel under TP), bf16."""
    D, V = cfg.d_model, cfg.vocab_size
    eff = pf.matmul_eff(t_attn * plan.tp, V / plan.tp, D)
    return 2.0 * V * D * t_attn / (pf.peak_flops * eff)


def recompute_time(plan: ParallelPlan, fwd: float, ffn: float, moe: float = 0.0) -> float:
    """Backward-time recompute of one layer: all of its forward ("full"), the FFN's gate
    and up projections, not the down projection ("selective"), or the MoE module ("moe",
    Megatron-Core's recompute module: router, experts and shared experts; `moe` = their
    forward seconds, 0 for a dense layer; its all-to-all runs again too: `recomputes_a2a`)."""
    if plan.checkpointing == "full":
        return fwd
    if plan.checkpointing == "moe":
        return moe
    return ffn * 2 / 3 if plan.checkpointing == "selective" else 0.0


def recomputes_a2a(plan: ParallelPlan) -> bool:
    """Whether the backward re-runs a MoE layer's dispatch and combine (a third pass)."""
    return plan.checkpointing in ("full", "moe")


def moe_module_time(parts: dict[str, float], is_moe: bool) -> float:
    """Forward seconds of a layer's MoE module (router, routed and shared experts) by part."""
    return parts["router"] + parts["experts"] + parts["dense"] if is_moe else 0.0


@functools.lru_cache(maxsize=4096)
def _stage_per_node(n: int, pp: int, dp: int, ep: int, tp: int, cp: int, etp: int,
                    gpn: int) -> int:
    """Most members of one spread stage group on one node (`Layout.node_span`)."""
    from trainer.layout import Layout

    lay = Layout(n, pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, etp=etp, placement="spread")
    return lay.node_span("stage", gpn)[0]


def place_groups(plan: ParallelPlan, gpn: int, attention: str) -> tuple[dict[str, GroupPlacement], bool]:
    """Where each group sits (`tuner.comms.placement`, by rank stride; the order of
    `trainer.layout`: the expert side (pp, edp, ep, etp) and the dense side (pp, dp, cp, tp)
    over the same consecutive ranks, the last dimension fastest): the EP group, "rep" (the
    ranks replicated non-expert gradients are reduced over), "dp" (expert gradients), "tp",
    "cp", "etp"; and whether some pipeline hop crosses nodes. With tp = cp = etp = 1 these
    are the trainer's PP x DP x EP groups."""
    pp, dp, ep, etp, tp, cp = plan.pp, plan.dp, plan.ep, plan.etp, plan.tp, plan.cp
    rep_size = plan.attn_dp * cp if attention == "sharded" else dp
    stage = plan.stage_size
    g = {"tp": placement(tp, 1, gpn), "cp": placement(cp, tp, gpn),
         "etp": placement(etp, 1, gpn)}
    if plan.ep_placement == "local":
        g |= {"ep": placement(ep, etp, gpn), "dp": placement(dp, ep * etp, gpn),
              "rep": placement(rep_size, tp if attention == "sharded" else ep, gpn)}
    else:
        # the stage group's members per node, counted on the layout itself: with spread a
        # node holds the dp x etp blocks of every EP index whose block falls on it (pp 4,
        # dp 1, ep 2 on 8 GPUs: ranks 0 and 4 of stage 0 on one node)
        per_rep = max(1, _stage_per_node(plan.n_gpus, pp, dp, ep, tp, cp, etp, gpn) // tp)
        g |= {"ep": placement(ep, pp * dp * etp, gpn), "dp": placement(dp, etp, gpn),
              "rep": GroupPlacement(rep_size, min(rep_size, per_rep))}
    # A pipeline whose stages do not all fit in one node crosses nodes somewhere.
    span = pp * (stage if plan.ep_placement == "local" else dp * etp)
    return g, span > gpn


def kv_width(cfg: ModelConfig) -> int:
    """Elements per token of the K and V that ring attention passes between CP ranks."""
    if cfg.attention == "gqa":
        return 2 * cfg.n_kv_heads * cfg.qk_head_dim
    return cfg.n_heads * (cfg.qk_head_dim + cfg.attn_v_head_dim)


def a2a_one(nbytes: float, groups: dict[str, GroupPlacement], plan: ParallelPlan,
             cfg: ModelConfig, pf: Platform, asm: Assumptions) -> float:
    """One all-to-all of `nbytes` per rank in the EP group, by the plan's algorithm."""
    g = groups["ep"]
    alg = plan.alltoall
    if asm.alltoall_model == "netsim" and alg in ("flat", "halo", "auto"):
        algs = auto_choices() if alg == "auto" else (alg,)
        t = min(netsim_alltoall_time(nbytes, g, a, pf)
                / (asm.vendor_alltoall_efficiency if a == "flat" else 1.0) for a in algs)
        if alg == "auto" and auto_considers_dedup(g.nodes, cfg.top_k, cfg.n_routed_experts):
            # auto's trial runs the faster; netsim has no dedup exchange: its closed form
            t = min(t, alltoall_time(nbytes, g, "dedup", pf, asm.vendor_alltoall_efficiency,
                                     cfg.top_k, cfg.n_routed_experts))
        return t
    return alltoall_time(nbytes, g, alg, pf, asm.vendor_alltoall_efficiency,
                         cfg.top_k, cfg.n_routed_experts)


def a2a_exposed(plan: ParallelPlan, parts: dict[str, float], rec: float, ab: tuple[float, float],
                 a2a: functools.partial, chunks: int = 0,
                 share: float = 0.0) -> tuple[float, float]:
    """(exposed, total) all-to-all seconds of one MoE layer for one micro-batch.

    ab: (dispatch, combine) bytes per rank of one pass. A pass (forward; backward: the
    gradients; the recompute of "full") moves both once: A = t(dispatch) + t(combine).
        none   every pass exposed: (2 + full) A
        layer  c chunks (issue 26: chunk i+1's dispatch, chunk i's expert GEMMs, chunk i-1's
               combine in flight together; shared experts and the dense branch run during the
               dispatch): A_c = c (t(dispatch / c) + t(combine / c)) (each chunk pays the
               latencies again) against X = dense + experts (c - 1) / c of that pass's
               compute (x2 in the backward); exposed = max(0, A_c - X) per pass; c is
               `Assumptions.a2a_chunks` or the best of 1, 2, 4, 8
        fb     across micro-batches (combined 1F1B, DualPipe): in the steady state one
               micro-batch's forward runs beside another's backward, their exchanges hidden
               behind both computes: max(0, (2 + full) A - (3 f + rec)) per layer; the
               warm-up and cool-down micro-batches (max(1, pp - 1) of M) stay exposed.
               With chunks c >= 2 given (`--comm.a2a_chunks=c` beside fb: the trainer's
               layer pipeline runs inside every micro-batch as well) each micro-batch's
               exchange is first the layer mode's exposed part at c, the unpaired ones
               keep that, the paired ones hide it further behind the other micro-batch's
               3 f + rec; chunks 0 (auto) under fb is 1, as the trainer resolves it.
    An overlapped exchange never hides fully: its kernels take `share` of the device
    (`Assumptions.overlap_compute_share`), so each max(0, A - X) above is max(A - X, share A)."""
    full = recomputes_a2a(plan)
    d, c_ = ab
    A = a2a(d) + a2a(c_)
    n_pass = 3 if full else 2
    total = n_pass * A
    if plan.a2a_overlap == "none":
        return total, total
    f = sum(parts.values())

    def layer_exposed(c: int) -> float:
        Ac = c * (a2a(d / c) + a2a(c_ / c))
        X = parts["dense"] + parts["experts"] * (c - 1) / c
        return (max(Ac - X, share * Ac) * (n_pass - 1)
                + max(Ac - 2 * X, share * Ac))

    if plan.a2a_overlap == "layer":
        return min(layer_exposed(c) for c in ((chunks,) if chunks else (1, 2, 4, 8))), total
    m = plan.microbatches
    paired = max(0, m - max(1, plan.pp - 1)) / m
    if chunks >= 2:  # layer + fb: chunked inside each micro-batch, paired across them
        own = layer_exposed(chunks)
        Ac_total = n_pass * chunks * (a2a(d / chunks) + a2a(c_ / chunks))
        return (paired * max(own - (3 * f + rec), share * Ac_total)
                + (1 - paired) * own), total
    return paired * max(total - (3 * f + rec), share * total) + (1 - paired) * total, total


def layer_collectives(lc: LayerCounts, parts: dict[str, float], rec: float, t_attn: float,
                       t_exp: float, cfg: ModelConfig, plan: ParallelPlan, pf: Platform,
                       pb: PrecisionPolicy, groups: dict[str, GroupPlacement],
                       w_bytes: tuple[float, float], gather: str = "microbatch",
                       runs: int = 1) -> dict[str, float]:
    """Exposed seconds of one layer's TP, CP, ETP and ZeRO-3 collectives for one micro-batch
    (module docstring, "Step time"); `w_bytes`: the layer's (non-expert, expert) weight
    elements one rank holds unsharded; `gather`, `runs`: `Assumptions.zero3_gather`,
    `zero3_runs` (`zero3_time`)."""
    D, ab, full = cfg.d_model, pb.activation_bytes, plan.checkpointing == "full"
    n_pass = 3 if full else 2  # forward, backward (+ the recomputed forward)
    out = {"tp": 0.0, "cp": 0.0, "etp": 0.0, "zero3": 0.0}
    if plan.tp > 1:
        regions = 1 + (1 if lc.fwd_flops.get("dense_ffn") or lc.fwd_flops.get("shared_experts")
                       else 0)
        one = all_gather_time(t_attn * plan.tp * D * ab, groups["tp"], pf)
        out["tp"] = regions * 2 * n_pass * one  # all-gather + reduce-scatter per pass
    if plan.cp > 1:
        g = groups["cp"]
        step = p2p_time(t_attn * kv_width(cfg) * ab, g.nodes > 1, pf)
        ring = (plan.cp - 1) * step
        core = parts["attn_core"]
        out["cp"] = (max(0.0, ring - core) * (n_pass - 1)  # forward (+ recompute)
                     + max(0.0, 2 * ring - 2 * core))  # backward: K/V again and their grads
    if plan.etp > 1 and lc.is_moe:
        rows = cfg.top_k * t_exp * plan.etp * D
        one = (all_gather_time(rows * pb.dispatch_bytes, groups["etp"], pf)
               + all_gather_time(rows * pb.combine_bytes, groups["etp"], pf))
        out["etp"] = (3 if recomputes_a2a(plan) else 2) * one  # "moe" re-runs the experts too
    if plan.zero == 3:
        out["zero3"] = zero3_time(parts, rec, plan, pf, pb, groups, w_bytes, gather, runs)
    return out


def zero3_time(parts: dict[str, float], rec: float, plan: ParallelPlan, pf: Platform,
               pb: PrecisionPolicy, groups: dict[str, GroupPlacement],
               w_bytes: tuple[float, float], gather: str = "microbatch",
               runs: int = 1) -> float:
    """Exposed seconds of one layer's ZeRO-3 collectives per micro-batch (`w_bytes`: its
    (non-expert, expert) weight elements held unsharded; ag / rs: the all-gather of its
    weights and the reduce-scatter of its gradients over the replica groups, f its forward).
        microbatch  every micro-batch gathers in the forward and again in the backward and
                    reduce-scatters; prefetched, each gather hides behind the previous
                    layer's compute: max(0, ag - f) + max(0, ag + rs - 2 f - rec)
        step        (`Assumptions.zero3_gather`, FSDP2 under torch.distributed.pipelining)
                    per schedule run one gather in its first forward, prefetched as above,
                    and one reduce-scatter after its last backward, exposed (the schedule's
                    REDUCE_GRAD runs after every micro-batch's backward); `runs` schedule
                    runs per step (`Assumptions.zero3_runs`): runs (max(0, ag - f) + rs) / M
                    per micro-batch
    On a CPU platform (`Platform.cores_per_node` stated) nothing hides: the gathers' copies
    and gloo's work run on the cores the compute needs (measured: docs/planner.md, "ZeRO-3
    on CPU"), so a micro-batch pays 2 ag + rs (step: runs (ag + rs) / M). FSDP2's own work
    per layer (`Platform.zero3_layer_overhead`) is compute, priced with the layer's."""
    rep, exp = w_bytes
    ag = (all_gather_time(rep * pb.param_comm_bytes, groups["rep"], pf)
          + all_gather_time(exp * pb.param_comm_bytes, groups["dp"], pf))
    rs = (reduce_scatter_time(rep * pb.grad_comm_bytes, groups["rep"], pf)
          + reduce_scatter_time(exp * pb.grad_comm_bytes, groups["dp"], pf))
    f = 0.0 if pf.cores_per_node else sum(parts.values())
    if gather == "step":
        if runs > plan.microbatches:
            raise ValueError(f"zero3_runs={runs} schedule runs exceed the step's "
                             f"{plan.microbatches} micro-batches")
        return runs * (max(0.0, ag - f) + rs) / plan.microbatches
    if pf.cores_per_node:
        return 2 * ag + rs
    return max(0.0, ag - f) + max(0.0, ag + rs - 2 * f - rec)


def grad_post_time(held: float, owned: float, plan: ParallelPlan, pf: Platform,
                   clipped: bool = True) -> float:
    """Seconds of the trainer's gradient passes after the backward besides the collectives
    (trainer/distributed/grad_sync.py), at the platform's measured rates (0 where it has
    none: the GPU platforms). `held`: fp32 gradient bytes the rank holds after its backward,
    `owned`: those it keeps after the reduction (ZeRO-2: its owned share; else `held`).
        flatten  ZeRO-0 (one flat buffer per group after the backward, `_allreduce`): cat,
                 scale (mul_), copy back (clone) over `held`: one `grad_flatten_bandwidth`
                 pass; ZeRO-1/2 (buckets from the backward's hooks, the buffer becomes the
                 gradient): the cat over `held` and the scale over `owned`, each one of
                 the flatten's three equal read + write passes
        norm     the fp64 squared norm over `owned` at `grad_norm_bandwidth`
        clip     with `clipped` (the norm above train.grad_clip) one more scale over `owned`
    ZeRO-3 (FSDP2's reduce-scatter per layer, `Zero3Sync`) is not priced here: 0.
    """
    if not pf.grad_flatten_bandwidth or not pf.grad_norm_bandwidth or plan.zero == 3:
        return 0.0
    third = 1.0 / (3.0 * pf.grad_flatten_bandwidth)
    flat = 3 * held * third if plan.zero == 0 else (held + owned) * third
    return flat + owned / pf.grad_norm_bandwidth + (owned * third if clipped else 0.0)


def step_sync_groups(plan: ParallelPlan, moe_on_rank: bool = True
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Small all-reduces of one trainer step (a few fp64 values each, priced per group by
    `Platform.sync_time`), as their group sizes, groups of one left out: (in the gradient
    sync, in the rest of the step).
        gradient sync  the clipping's squared norm: over the EP group (ZeRO-0/1; ZeRO-2 over
                       the stage group instead) and over the PP group (trainer/distributed/
                       grad_sync.py `clip`)
        rest           the loss and aux loss over every rank, the expert counts over the
                       stage group, the per-layer metrics over the PP group
                       (trainer/step.py, trainer/observe/stats.py, trainer/observe/metrics.py)
    """
    stage = plan.stage_size
    clip = ([plan.ep] if plan.zero != 2 else [stage]) + [plan.pp]
    rest = [plan.n_gpus] + ([stage] if moe_on_rank else []) + [plan.pp]
    return tuple(g for g in clip if g > 1), tuple(g for g in rest if g > 1)
