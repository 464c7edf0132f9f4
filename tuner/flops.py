"""Model FLOPs of one training token in two conventions, and the attention FLOP formula.

MFU depends on which FLOPs are counted as "model FLOPs"; published MoE tables mostly use one
convention and this project another, so both are here and every report says which it shows.

"ours" (`ours_flops_per_token`, what `tuner.estimate`, the trainer and `tuner plan` report):
    `ModelConfig.flops_per_token(S)` (model/config.py, reused, not re-derived):
    6 x (active parameters that multiply activations: every projection, the active experts,
    the router, the lm_head; no embedding lookup, norms or biases)
    + 6 L S H (d_qk + d_v) for the score and value products, counted in full (the PaLM
    convention: no causal discount).

"megatron" (`megatron_flops_per_token`): the structure of Megatron-LM's
    `num_floating_point_operations` (megatron/training/training.py, its transformer branch),
    re-stated here for this project's `ModelConfig`. Megatron-Bridge / NeMo performance tables
    and most published MoE throughput figures (TFLOP/s per GPU, MFU) are computed with it.
    Every GEMM counts 3 x (forward, weight gradient, input gradient) x 2 (multiply-add) x its
    multiply-adds per token:
      attention, GQA/MHA   D (q + 2 kv) + q D              q = H hd, kv = G hd
                           + q S                           QK^T and PV at S/2 each: causal
      attention, MLA       q path: D H (d_nope + d_rope), or with a q low rank r_q:
                           r_q (D + H (d_nope + d_rope) + 1)
                           + r_kv (D + H (d_nope + d_v) + 1) + D d_rope + H d_v D
                           + S H (d_nope + d_rope) / 2 + S H d_v / 2      causal
                           (the "+ 1" terms are Megatron's count for the two latent norms)
      FFN (SwiGLU: 3 GEMMs of D x F)
                           dense layers 3 D F_dense; MoE layers 3 D (k F_expert + F_shared)
                           (top-k routed experts and the shared expert(s); no router GEMM)
      MTP (mtp_layers)     each MTP module adds one decoder layer of the last layer's kind
                           (its attention and FFN as above) and 3 D + 2 D^2 (its norms and
                           the projection of [hidden; embedding] back to D)
      logits               D V_pad (1 + mtp_layers); V_pad = V rounded up to
                           `vocab_multiple` (Megatron's make-vocab-size-divisible-by x TP; 128
                           by default)
    Not counted: embedding lookups, the router, norms (but the terms above), softmax,
    activations, the loss.

The two differ mostly in the attention core (ours counts the full S x S products, Megatron the
causal half: for long sequences ours is larger) and in the router (ours counts it). Neither
counts recomputation: MFU is model FLOPs over time, whatever the layout recomputes.

Shape legend: V vocab, D d_model, H heads, G kv heads, hd head dim, S sequence length,
L layers, k top-k, F expert ffn width.
"""

from __future__ import annotations

from model import ModelConfig

__all__ = ["CONVENTIONS", "attention_flops", "flops_per_token", "megatron_flops_per_token",
           "mfu", "ours_flops_per_token", "padded_vocab"]

CONVENTIONS = ("ours", "megatron")


def attention_flops(seq: int, heads: int, head_dim: int, causal: bool,
                    v_head_dim: int | None = None) -> float:
    """Forward FLOPs of the score (Q K^T) and value (P V) products of one sequence of `seq`
    tokens: 2 seq^2 heads (head_dim + v_head_dim), halved when `causal` counts only the
    unmasked half. `v_head_dim` defaults to `head_dim` (MLA has its own). A backward pass is
    2x this under the model conventions (FlashAttention's recompute makes it 2.5x of work)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    for name, v in (("seq", seq), ("heads", heads), ("head_dim", head_dim), ("v_head_dim", dv)):
        if v < 1:
            raise ValueError(f"attention_flops: {name}={v} must be >= 1")
    full = 2.0 * seq * seq * heads * (head_dim + dv)
    return full / 2 if causal else full


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """`vocab_size` rounded up to a multiple of `multiple`, as Megatron pads its embedding."""
    if multiple < 1:
        raise ValueError(f"vocab_multiple={multiple} must be >= 1")
    return -(-vocab_size // multiple) * multiple


def ours_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """This project's convention: `ModelConfig.flops_per_token` (module docstring)."""
    return cfg.flops_per_token(seq_len)


def _megatron_attention(cfg: ModelConfig, S: int) -> float:
    """Multiply-adds per token of one attention layer, Megatron's count (module docstring)."""
    D, H = cfg.d_model, cfg.n_heads
    if cfg.attention == "mla":
        nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            q = D * H * (nope + rope)
        else:
            q = cfg.q_lora_rank * (D + H * (nope + rope) + 1)
        kv = cfg.kv_lora_rank * (D + H * (nope + dv) + 1) + D * rope
        return q + kv + H * dv * D + S * H * (nope + rope) / 2 + S * H * dv / 2
    hd = cfg.head_dim
    assert hd is not None  # ModelConfig.__post_init__ sets it
    q, kv = H * hd, cfg.n_kv_heads * hd
    return D * (q + 2 * kv) + q * S + q * D


def _megatron_ffn(cfg: ModelConfig, moe: bool) -> float:
    D = cfg.d_model
    if moe:
        return 3.0 * D * (cfg.top_k * cfg.moe_ffn_dim + cfg.shared_ffn_dim)
    return 3.0 * D * cfg.dense_ffn_dim


def megatron_flops_per_token(cfg: ModelConfig, seq_len: int, mtp_layers: int = 0,
                             vocab_multiple: int = 128) -> float:
    """Megatron-Core's model FLOPs per token (module docstring) for `cfg` at `seq_len`.

    `mtp_layers`: multi-token-prediction modules to count (DeepSeek-V3 runs use 1; this
    trainer builds none, so 0 by default; `cfg.n_mtp_layers` says what the checkpoint has).
    `vocab_multiple`: the padding of the logits' vocabulary (128 x TP in Megatron)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers={mtp_layers} must be >= 0")
    if cfg.attention == "mla" and cfg.kv_lora_rank < 1:
        raise ValueError(f"MLA config {cfg.name!r} has kv_lora_rank={cfg.kv_lora_rank}; "
                         f"Megatron's MLA count needs the latent rank >= 1")
    D, L = cfg.d_model, cfg.n_layers
    n_moe = len(cfg.moe_layer_ids)
    last_moe = cfg.is_moe_layer(L - 1)
    attn = _megatron_attention(cfg, seq_len) * (L + mtp_layers)
    ffn = (n_moe + (mtp_layers if last_moe else 0)) * _megatron_ffn(cfg, True) \
        + (L - n_moe + (0 if last_moe else mtp_layers)) * _megatron_ffn(cfg, False)
    mtp = mtp_layers * (3.0 * D + 2.0 * D * D)
    logits = float(D * padded_vocab(cfg.vocab_size, vocab_multiple) * (1 + mtp_layers))
    return 6.0 * (attn + ffn + mtp + logits)


def flops_per_token(cfg: ModelConfig, seq_len: int, convention: str = "ours", *,
                    mtp_layers: int = 0, vocab_multiple: int = 128) -> float:
    """Model FLOPs per training token in `convention` ("ours" or "megatron")."""
    if convention == "ours":
        return ours_flops_per_token(cfg, seq_len)
    if convention == "megatron":
        return megatron_flops_per_token(cfg, seq_len, mtp_layers, vocab_multiple)
    raise ValueError(f"convention={convention!r}; valid: {', '.join(CONVENTIONS)}")


def mfu(flops_per_token_: float, tokens_per_s: float, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: FLOPs per token x tokens/s over the GPUs' total peak."""
    for name, v in (("tokens_per_s", tokens_per_s), ("n_gpus", n_gpus),
                    ("peak_flops", peak_flops), ("flops_per_token", flops_per_token_)):
        if not v > 0:
            raise ValueError(f"mfu: {name}={v} must be > 0")
    return flops_per_token_ * tokens_per_s / (n_gpus * peak_flops)
