"""Per-layer counts: parameters, activation elements and FLOPs, and the layer-to-stage split.

Everything is per rank. A layer's parameters split into parts that are *replicated* on every
EP rank of its stage (attention, norms, router, shared experts, dense FFN) and *sharded*
(routed experts: E / EP per rank). The embedding lives on the first stage, the final norm
and lm_head on the last.

Activation elements kept per token for the backward (bf16 by default), per layer:
    attention   2D (input, normed input) + q + k + v + attention output widths
                (MHA with H*hd = D: 6D, the published 12sd bytes) [+ 2*H*s scores]
    router      E probabilities
    experts     k * (3F + D) per token (input row, gate, up, activation: published 2sk(3f+d))
    shared/dense  3F + D
With checkpointing "full" a layer keeps only its D-wide input; "selective" drops the FFN
intermediates (3F per copy) and the attention scores and recomputes them in the backward.

The "trainer" activation set (`act_trainer`) is what our eager fp32 model (model/, run by
train.py on CPU) really hands autograd, read off `torch.autograd.graph.saved_tensors_hooks`
for the tiny preset (int64 index tensors count as 2 fp32 elements); per token of a layer:
    attention   RMSNorm: its input and normalised copy (2D) + the rsqrt (1); wq/wk/wv input (D);
                sdpa: q (H hd), k and v (2 G hd), its output (H hd), log-sum-exp (H)
    router      RMSNorm (2D + 1), router input (D), softmax scores (E), top-k index (2k),
                top-k weights (k) and their sum (1, with norm_topk_prob)
    dispatch    permute index (2k), unpermute: combined rows (k D), weights (k), index (2k)
    experts     per routed copy: the grouped GEMM input row (D) and four F-wide tensors
                (gate output, its SiLU, up output, their product: the down GEMM's input)
    shared/dense  the same SwiGLU set per token: D + 4F
With the trainer's selective checkpointing (model/checkpointing.py) the four F-wide tensors
go (experts keep k D per token, shared/dense D); with full a layer keeps its input (D).
Besides, per layer and micro-batch (not per token): the rotary cos/sin tables, 2 s hd
(counted by `tuner.estimate.stage_memory`). Not counted: the per-sequence aux-loss
statistics (E per sequence, < 0.01 %).

Legend: D model width, F expert FFN width, E routed experts, k top-k, H heads, s sequence,
V vocab, L layers, S = PP * v pipeline stages (chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model import ModelConfig
from trainer.layout import stage_layers

__all__ = [
    "LayerCounts",
    "trainer_act_supported",
    "layer_counts",
    "chunk_layers",
    "attention_matmul_params",
    "head_params",
]

PARTS = ("attention", "norms", "router", "shared_experts", "dense_ffn", "experts")


def _head_dim(cfg: ModelConfig) -> int:
    """GQA head width (ModelConfig.__post_init__ fills it in from d_model // n_heads)."""
    assert cfg.head_dim is not None, cfg
    return int(cfg.head_dim)


def attention_matmul_params(cfg: ModelConfig) -> int:
    """Weights of the attention projections (no biases, no latent/qk norms): what multiplies
    activations, hence what costs 2 FLOPs per token in the forward."""
    D, H = cfg.d_model, cfg.n_heads
    if cfg.attention == "gqa":
        hd, G = _head_dim(cfg), cfg.n_kv_heads
        return D * H * hd + 2 * D * G * hd + H * hd * D
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = D * H * qk if cfg.q_lora_rank is None else D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk
    kv = D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv += cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + H * cfg.v_head_dim * D


def _attention_act_elems(cfg: ModelConfig, seq_len: int, store_scores: bool) -> float:
    D, H = cfg.d_model, cfg.n_heads
    if cfg.attention == "gqa":
        hd, G = _head_dim(cfg), cfg.n_kv_heads
        widths = H * hd + 2 * G * hd + H * hd
    else:
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        latent = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        widths = latent + 2 * H * qk + 2 * H * v
    return 2 * D + widths + (2 * H * seq_len if store_scores else 0)


@dataclass(frozen=True)
class LayerCounts:
    """One layer as seen by one rank of an EP group of size `ep`.

    params: per part, parameters held by this rank.
    act: per part, activation elements kept per token (routed experts: per routed token,
        i.e. already x k) without checkpointing; `act_selective` with selective recompute.
    fwd_flops: per part, forward FLOPs per token ("experts" per routed token x k, "attn_core"
        the score and value products)."""

    index: int
    is_moe: bool
    params: dict[str, int] = field(default_factory=dict)
    act: dict[str, float] = field(default_factory=dict)
    act_selective: dict[str, float] = field(default_factory=dict)
    fwd_flops: dict[str, float] = field(default_factory=dict)
    act_trainer: dict[str, float] = field(default_factory=dict)
    act_trainer_selective: dict[str, float] = field(default_factory=dict)


def _trainer_selective(cfg: ModelConfig, act: dict[str, float]) -> dict[str, float]:
    """The trainer set under selective recompute: SwiGLU intermediates dropped."""
    D, k = cfg.d_model, cfg.top_k
    out = dict(act)
    if "experts" in out:
        out["experts"] = float(k * D)
    if "shared_experts" in out:
        out["shared_experts"] = float(D)
    if "dense_ffn" in out:
        out["dense_ffn"] = float(3 * D + 1)
    return out


def trainer_act_supported(cfg: ModelConfig) -> bool:
    """Whether the trainer activation set is derived for `cfg`: GQA attention without q/k
    norms (the CPU presets); MLA saves other tensors."""
    return cfg.attention == "gqa" and not cfg.qk_norm


def _trainer_act(cfg: ModelConfig, moe: bool) -> dict[str, float]:
    """Elements per token of one layer that the eager fp32 trainer saves (module docstring);
    only for `trainer_act_supported` configs."""
    D, H, G, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, _head_dim(cfg)
    out = {"attention": float(3 * D + 1 + 2 * H * hd + 2 * G * hd + H)}
    if moe:
        E, k, F = cfg.n_routed_experts, cfg.top_k, cfg.moe_ffn_dim
        out["router"] = float(3 * D + 1 + E + 3 * k + (1 if cfg.norm_topk_prob else 0))
        out["dispatch"] = float(k * D + 5 * k)
        out["experts"] = float(k * (D + 4 * F))
        if cfg.shared_ffn_dim:
            out["shared_experts"] = float(D + 4 * cfg.shared_ffn_dim)
    else:
        out["dense_ffn"] = float(2 * D + 1 + D + 4 * cfg.dense_ffn_dim)  # ffn_norm + SwiGLU
    return out


def layer_counts(cfg: ModelConfig, i: int, ep: int, seq_len: int, flash_attention: bool) -> LayerCounts:
    """Parameters, activation elements and forward FLOPs of layer `i` on one EP rank."""
    D = cfg.d_model
    moe = cfg.is_moe_layer(i)
    attn_mm = attention_matmul_params(cfg)
    params = {p: 0 for p in PARTS}
    params["attention"] = cfg.attention_params()
    params["norms"] = 2 * D
    act = {"attention": _attention_act_elems(cfg, seq_len, not flash_attention)}
    sel = {"attention": _attention_act_elems(cfg, seq_len, False)}
    core = 2.0 * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.attn_v_head_dim)
    flops = {"attention": 2.0 * attn_mm, "attn_core": core}
    if moe:
        E, k, F = cfg.n_routed_experts, cfg.top_k, cfg.moe_ffn_dim
        if E % ep:
            raise ValueError(f"ep={ep} does not divide {E} experts; valid: "
                             f"{[d for d in range(1, E + 1) if E % d == 0]}")
        params["router"] = E * D
        params["experts"] = (E // ep) * cfg.expert_params()
        params["shared_experts"] = 3 * D * cfg.shared_ffn_dim + (D if cfg.shared_expert_gate else 0)
        act["router"] = sel["router"] = float(E)
        act["experts"] = float(k * (3 * F + D))
        sel["experts"] = float(k * D)
        flops["router"] = 2.0 * E * D
        flops["experts"] = 2.0 * k * 3 * D * F
        if cfg.shared_ffn_dim:
            act["shared_experts"] = float(3 * cfg.shared_ffn_dim + D)
            sel["shared_experts"] = float(D)
            flops["shared_experts"] = 2.0 * 3 * D * cfg.shared_ffn_dim
    else:
        Fd = cfg.dense_ffn_dim
        params["dense_ffn"] = 3 * D * Fd
        act["dense_ffn"] = float(3 * Fd + D)
        sel["dense_ffn"] = float(D)
        flops["dense_ffn"] = 2.0 * 3 * D * Fd
    trainer = _trainer_act(cfg, moe) if trainer_act_supported(cfg) else {}
    return LayerCounts(i, moe, params, act, sel, flops, trainer, _trainer_selective(cfg, trainer))


def head_params(cfg: ModelConfig) -> tuple[int, int]:
    """(embedding params on the first stage, final norm + lm_head params on the last).
    Tied embeddings still need the table on the last stage for the lm_head matmul (and its
    gradient is all-reduced with the first stage's copy)."""
    V, D = cfg.vocab_size, cfg.d_model
    return V * D, D + V * D


def chunk_layers(n_layers: int, pp: int, n_virtual: int, spec: str = "") -> list[list[int]]:
    """Layers of each stage (chunk) s = 0..PP*v-1: the trainer's split,
    `trainer.layout.stage_layers` (contiguous, as even as possible, the middle stages taking the
    remainder; `spec` = `parallel.layer_split`). Chunk s runs on rank s % PP."""
    return stage_layers(n_layers, pp, n_virtual, spec)
