"""`python -m tuner reproduce-paper`: published figures (docs/reference.md 1.3, 1.4) beside ours.

Three tables, as Markdown:
1. Table IV migration cost, computed from its formula bytes = 48 E d f / 8, time = bytes /
   50 GB/s, in GB and GiB (the published table mixes them), for the models whose (E, d, f)
   this project knows (the presets).
2. One MoE layer on one node (8 GCDs) and full models at seq 4096: the planner's layout and
   predicted TFLOPS/GCD and MFU on `frontier`. GPU counts and batch sizes are not published:
   each full model runs on the smallest power-of-two GCD count (>= 8) its leanest layout fits,
   with 8 sequences per GCD per step (an assumption, stated in the output). State is
   replicated (ZeRO-0), as in the published memory model (docs/reference.md 1.1: 16 bytes per
   parameter on every replica), so the layouts compare with Piper's.
3. Weak scaling (d=5120, f=20480, L=32, k=2, two-matrix experts): approximated by SwiGLU
   experts of width 2f/3 (same parameters and FLOPs per token), 40 MHA heads and a 32000
   vocabulary (both unpublished; they change the totals by < 0.5 %).
"""

from __future__ import annotations

from model import ModelConfig, presets
from tuner.counts import layer_counts
from tuner.estimate import Estimate, estimate
from tuner.layout import ParallelPlan
from tuner.planner import leanest_memory
from tuner.platform import Platform, load_platform
from tuner.search import Evaluator, optuna_search
from tuner.space import SearchSpace

__all__ = ["reproduce_paper", "table_iv", "migration_bytes"]

# (published name, preset, published GB-or-GiB, published ms) from docs/reference.md 1.3
TABLE_IV = (
    ("Mixtral-8x7B", "mixtral-8x7b", 2.63, 52.6),
    ("Mixtral-8x22B", "mixtral-8x22b", 4.50, 90.0),
    ("Grok-1", None, 9.00, 180.0),
    ("DeepSeek-V2", "deepseek-v2", 7.04, 140.8),
    ("DeepSeek-V3", "deepseek-v3", 21.00, 420.0),
    ("Switch-Base", None, 1.21, 24.2),
    ("GLaM", None, 102.88, 2057.6),
)
ONE_LAYER = (("mixtral-8x22b", 129.4), ("mixtral-8x7b", 117.5), ("llama4-maverick", 112.4),
             ("llama4-scout", 109.6), ("deepseek-v3", 84.3), ("kimi-k2", 81.7),
             ("deepseek-v2", 78.3))  # Arctic (104.2) has no preset
FULL = (("mixtral-8x7b", 102.8, 53.8), ("mixtral-8x22b", 55.4, 29.0), ("llama4-scout", 74.2, 38.8),
        ("llama4-maverick", 37.8, 19.8), ("deepseek-v2", 46.8, 24.5))
WEAK = ((16, 64, 110, 45.15), (128, 512, 862, 39.38), (256, 1024, 1700, 33.04))
SEQ_PER_GPU = 8  # assumed global batch: 8 sequences of 4096 tokens per GCD per step
PAPER_ZERO = (0,)  # the published model replicates all training state
PAPER_OVERLAP = ("none",)  # and exposes every all-to-all (Piper's layouts are PP x EP)


def migration_bytes(E: int, d: int, f: int) -> float:
    """Published worst case per GPU: all experts' 16-byte state (3 matrices) over 8 GPUs."""
    return 48 * E * d * f / 8


def table_iv() -> str:
    rows = ["| model | E, d, f | ours GB | ours GiB | published | ours ms (GB / 50 GB/s) | "
            "ours ms (GiB / 50) | published ms |", "|---|---|---|---|---|---|---|---|"]
    for name, preset, pub_gb, pub_ms in TABLE_IV:
        if preset is None:
            rows.append(f"| {name} | not in docs/reference.md | - | - | {pub_gb:.2f} | - | - | {pub_ms:.1f} |")
            continue
        c = presets.get(preset)
        b = migration_bytes(c.n_routed_experts, c.d_model, c.moe_ffn_dim)
        rows.append(f"| {name} | {c.n_routed_experts}, {c.d_model}, {c.moe_ffn_dim} | {b / 1e9:.2f} | "
                    f"{b / 2**30:.2f} | {pub_gb:.2f} | {b / 50e9 * 1e3:.1f} | "
                    f"{b / 2**30 / 50 * 1e3:.1f} | {pub_ms:.1f} |")
    return "\n".join(rows)


def _one_layer(cfg: ModelConfig, pf: Platform) -> float:
    """TFLOPS/GCD of one MoE layer (forward + backward incl. 4 all-to-alls) with EP = 8."""
    one = cfg.replace(n_layers=1, first_k_dense=0, dense_layers=(), moe_every=1, vocab_size=1)
    plan = ParallelPlan(pp=1, ep=8, dp=1, microbatches=1, global_batch=8, seq_len=4096)
    e = estimate(one, plan, pf)
    fwd = layer_counts(one, 0, 8, 4096, True).fwd_flops
    flops = 3 * sum(v * (plan.expert_tokens if k == "experts" else plan.attention_tokens())
                    for k, v in fwd.items())
    return flops / (e.time["compute"] + e.time["alltoall"]) / 1e12


def _plan(cfg: ModelConfig, pf: Platform, n: int, trials: int, seed: int) -> Estimate | None:
    b = SEQ_PER_GPU * n
    space = SearchSpace.default(cfg, pf, n, b, 4096, zero=PAPER_ZERO, a2a_overlap=PAPER_OVERLAP)
    lean = leanest_memory(cfg, pf, n, b, 4096, zero=PAPER_ZERO, a2a_overlap=PAPER_OVERLAP)
    ev = Evaluator(space, cfg, pf)
    r = optuna_search(ev, trials, seed=seed, enqueue=[lean[1]] if lean else None)
    return r.best.estimate if r.best else None


def _smallest_fit(cfg: ModelConfig, pf: Platform) -> int | None:
    n = 8
    while n <= 4096:
        lean = leanest_memory(cfg, pf, n, SEQ_PER_GPU * n, 4096, zero=PAPER_ZERO,
                              a2a_overlap=PAPER_OVERLAP)
        if lean and lean[0] <= pf.usable_hbm:
            return n
        n *= 2
    return None


def _layout(e: Estimate) -> str:
    p = e.plan
    s = p.schedule + (f":{p.n_virtual}" if p.n_virtual > 1 else "")
    return (f"PP{p.pp} EP{p.ep} DP{p.dp} M{p.microbatches} {s} {p.alltoall} "
            f"ckpt={p.checkpointing} {p.ep_placement}")


def _weak_cfg(E: int) -> ModelConfig:
    return ModelConfig(name=f"weak-{E}e", vocab_size=32000, d_model=5120, n_layers=32, n_heads=40,
                       n_kv_heads=40, max_seq_len=4096, n_routed_experts=E, top_k=2,
                       moe_ffn_dim=round(2 * 20480 / 3))


def reproduce_paper(trials: int = 300, seed: int = 0, platform: str = "frontier") -> str:
    pf = load_platform(platform)
    peak = pf.peak_flops / 1e12
    out = ["# Published Piper results beside this project's model (`python -m tuner reproduce-paper`)",
           "", f"Platform file: `configs/platforms/{pf.name}.toml` (bf16 peak {peak} TFLOPS/GCD, "
           f"GEMM efficiency {pf.gemm_efficiency}, usable HBM {pf.usable_hbm / 1e9:.1f} GB).",
           "", "## Table IV: worst-case expert migration per GPU (8 GPUs, 50 GB/s)", "", table_iv(), "",
           "The formula reproduces every row we have dimensions for once the published numbers are "
           "read as GiB (e.g. DeepSeek-V3: 22.55 GB = 21.00 GiB); the published times divide the "
           "GiB figure by 50 (so they are 7 % short of bytes / 50 GB/s). Grok-1, Switch-Base and "
           "GLaM have no (E, d, f) in docs/reference.md and are not recomputed.", "",
           "## One MoE layer on one node (8 GCDs, EP = 8, 8 x 4096 tokens)", "",
           "| model | published TFLOPS/GCD | predicted TFLOPS/GCD | predicted / published |",
           "|---|---|---|---|"]
    for name, pub in ONE_LAYER:
        got = _one_layer(presets.get(name), pf)
        out.append(f"| {name} | {pub} | {got:.1f} | {got / pub:.2f} |")
    out += ["", "Gap: the model caps every GEMM at the platform's single GEMM efficiency (60 % of "
            "peak = 114.9 TFLOPS), so the layers the paper ran above it (Mixtral-8x22B 129.4, "
            "67.6 % of peak) are under-predicted; fine-grained experts (DeepSeek, Kimi: f = 1536-"
            "2048) run below it in practice, which one efficiency cannot express. A measured "
            "per-shape grouped-GEMM table (`tuner measure` on the target) is the missing input.",
            "", f"## Full models, seq 4096 ({SEQ_PER_GPU} sequences per GCD per step: assumed)", "",
            "| model | published TFLOPS/GCD (MFU) | GCDs (ours: smallest that fits) | planner layout | "
            "predicted TFLOPS/GCD (MFU) | peak GB |", "|---|---|---|---|---|---|"]
    for name, pub, pub_mfu in FULL:
        cfg = presets.get(name)
        n = _smallest_fit(cfg, pf)
        e = _plan(cfg, pf, n, trials, seed) if n else None
        if e is None:
            out.append(f"| {name} | {pub} ({pub_mfu} %) | - | no feasible layout | - | - |")
            continue
        out.append(f"| {name} | {pub} ({pub_mfu} %) | {n} | {_layout(e)} | "
                   f"{e.tflops_per_gpu:.1f} ({100 * e.mfu:.1f} %) | {e.peak_memory / 1e9:.1f} |")
    out += ["", "Gaps: the paper's GPU counts and batch sizes are not in docs/reference.md, so ours are "
            "chosen (smallest fitting power of two, 8 sequences per GCD); a different batch moves the "
            "bubble and the all-to-all share. No communication is overlapped in our model and the "
            "all-to-all is the closed form (no congestion), and one GEMM efficiency covers all shapes. "
            "Layers are split evenly over stages, so a large vocabulary (Llama-4: 202k) makes the "
            "last stage (lm_head, logits) the bottleneck; the paper's stage balancing is not "
            "modelled. Rows above the published value are optimistic for the same reasons.",
            "", "## vs X-MoE (10.1B-545.4B)", "",
            "Not reproduced: the X-MoE model architectures are not in docs/reference.md (only totals).",
            "", "## Weak scaling (d=5120, f=20480, L=32, k=2)", "",
            "| experts | GCDs | params (ours) | published TFLOPS/GCD | planner layout | predicted "
            "TFLOPS/GCD (MFU) |", "|---|---|---|---|---|---|"]
    got_tf = []
    for E, n, params_b, pub in WEAK:
        cfg = _weak_cfg(E)
        e = _plan(cfg, pf, n, trials, seed)
        got_tf.append(e.tflops_per_gpu if e else float("nan"))
        lay = _layout(e) if e else "no feasible layout"
        shown = f"{e.tflops_per_gpu:.1f} ({100 * e.mfu:.1f} %)" if e else "-"
        out.append(f"| {E} | {n} | {cfg.num_params() / 1e9:.0f}B (published {params_b}B) | {pub} | "
                   f"{lay} | {shown} |")
    out += ["", f"Weak-scaling efficiency 64 -> 1024 GCDs: published {WEAK[2][3] / WEAK[0][3]:.0%}, "
            f"predicted {got_tf[2] / got_tf[0]:.0%}.",
            "", "Gaps: heads, vocabulary and batch are assumptions; the published two-matrix experts "
            "are modelled as SwiGLU of width 2f/3 (equal parameters and FLOPs). Absolute "
            "predictions sit well above the published ones: the model has no congestion, no "
            "kernel launch or framework overheads and no load imbalance, so compare the scaling "
            "efficiency rather than the absolute values.", ""]
    return "\n".join(out)
