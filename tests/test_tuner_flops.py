"""tuner/flops.py: Megatron's formula by hand and against the built model's parameter shapes;
our convention against the same shapes; bad input named."""

from __future__ import annotations

import functools

import pytest
import torch

from model import ModelConfig, MoETransformer, presets
from tuner.flops import (
    attention_flops,
    flops_per_token,
    megatron_flops_per_token,
    mfu,
    ours_flops_per_token,
    padded_vocab,
)


def _gqa() -> ModelConfig:
    # layer 0 dense (F_dense 128), layer 1 MoE: 4 experts, top-2, F 32, shared width 32
    return ModelConfig(vocab_size=250, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, dense_ffn_dim=128, first_k_dense=1, n_routed_experts=4,
                       top_k=2, moe_ffn_dim=32, n_shared_experts=1, shared_ffn_dim=32)


def _mla() -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, attention="mla",
                       q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8, head_dim=12, n_kv_heads=4,
                       dense_ffn_dim=96, first_k_dense=1, n_routed_experts=4, top_k=2,
                       moe_ffn_dim=16)


def test_megatron_gqa_by_hand():
    S = 32
    # multiply-adds per token; each x 6 (3 passes x 2 FLOPs)
    attn = 64 * (64 + 2 * 32) + 64 * 32 + 64 * 64  # qkv proj, QK^T + PV at S/2, out proj
    assert attn == 14336
    dense = 3 * 64 * 128
    moe = 3 * 64 * (2 * 32 + 32)  # top-2 experts + the shared expert, SwiGLU
    logits = 64 * 256  # V = 250 padded to 256
    want = 6 * (2 * attn + dense + moe + logits)
    assert want == 6 * 88064
    assert megatron_flops_per_token(_gqa(), S) == want
    # unpadded vocabulary: 6 D (256 - 250) fewer
    assert megatron_flops_per_token(_gqa(), S, vocab_multiple=1) == want - 6 * 64 * 6
    assert flops_per_token(_gqa(), S, "megatron") == want


def test_megatron_mla_and_mtp_by_hand():
    S = 16
    q = 24 * (64 + 4 * (8 + 4) + 1)  # q down + up (+1: its norm)
    kv = 16 * (64 + 4 * (8 + 8) + 1) + 64 * 4  # kv down + up (+1 norm), rope key
    out = 4 * 8 * 64
    core = 16 * 4 * 12 / 2 + 16 * 4 * 8 / 2  # causal halves of QK^T and PV
    attn = q + kv + out + core
    assert attn == 2712 + 2064 + 256 + 2048 + 384 + 256
    dense, moe = 3 * 64 * 96, 3 * 64 * 2 * 16
    logits = 64 * 256
    assert megatron_flops_per_token(_mla(), S) == 6 * (2 * attn + dense + moe + logits)
    # one MTP module: one more layer of the last (MoE) kind, its norms + projection, a 2nd logits
    mtp = attn + moe + 3 * 64 + 2 * 64 * 64 + logits
    assert megatron_flops_per_token(_mla(), S, mtp_layers=1) == \
        6 * (2 * attn + dense + moe + logits) + 6 * mtp


@functools.cache
def _meta_counts(name: str) -> tuple[float, float]:
    """(active matmul parameters, router parameters) of preset `name` built on the meta
    device: every weight with >= 2 dims except the embedding lookup, routed experts at k/E."""
    cfg = presets.get(name)
    with torch.device("meta"):
        m = MoETransformer(cfg)
    active = router = 0.0
    for name, p in m.named_parameters():
        if p.dim() < 2 or name == "embed.weight":
            continue
        n = p.numel() * (cfg.top_k / cfg.n_routed_experts if ".experts." in name else 1.0)
        active += n
        router += n if ".router." in name else 0.0
    if cfg.tie_embeddings:
        active += cfg.vocab_size * cfg.d_model  # the tied table is the lm_head's matmul
    return active, router


def _attention_core(cfg: ModelConfig, S: int, causal: bool) -> float:
    # per token per layer: QK^T and PV, 2 FLOPs per multiply-add, S keys (S/2 if causal),
    # 3 passes
    keys = S / 2 if causal else S
    return 3 * 2 * keys * cfg.n_heads * (cfg.qk_head_dim + cfg.attn_v_head_dim) * cfg.n_layers


@pytest.mark.parametrize("name,S", [("tiny", 256), ("deepseek-v3", 4096),
                                    ("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 4096)])
def test_megatron_against_meta_model_shapes(name, S):
    cfg = presets.get(name)
    active, router = _meta_counts(name)
    independent = 6 * active + _attention_core(cfg, S, causal=True)
    got = megatron_flops_per_token(cfg, S, vocab_multiple=1)
    # Tolerance 1 %: Megatron omits the router GEMM (E x D per MoE layer) and counts MLA's
    # latent norms as one multiply-add per element; the router is the larger gap:
    assert 6 * router / independent < 0.01
    assert got == pytest.approx(independent, rel=0.01)
    assert got < independent  # the router is left out, never added


@pytest.mark.parametrize("name,S", [("tiny", 256), ("deepseek-v3", 4096), ("qwen3-30b-a3b", 4096)])
def test_ours_unchanged_against_meta_model_shapes(name, S):
    """Our convention = 6 x active matmul params (router included) + the full S x S products;
    exact up to float rounding of the k/E expert share (same sums, other order)."""
    cfg = presets.get(name)
    active, _ = _meta_counts(name)
    want = 6 * active + _attention_core(cfg, S, causal=False)
    assert ours_flops_per_token(cfg, S) == cfg.flops_per_token(S)
    assert flops_per_token(cfg, S) == pytest.approx(want, rel=1e-12)


def test_attention_flops_and_helpers_by_hand():
    # 2 products x 2 FLOPs x seq^2 x heads x head_dim: 4 x 64^2 x 2 x 16
    assert attention_flops(64, 2, 16, causal=False) == 4 * 64 * 64 * 2 * 16
    assert attention_flops(64, 2, 16, causal=True) == 2 * 64 * 64 * 2 * 16
    assert attention_flops(8, 1, 12, causal=False, v_head_dim=8) == 2 * 64 * (12 + 8)
    assert padded_vocab(129280) == 129280 and padded_vocab(250, 64) == 256
    assert mfu(6e9, 1000.0, 8, 1e12) == pytest.approx(6e12 / 8e12)


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="convention='palm'; valid: ours, megatron"):
        flops_per_token(_gqa(), 32, "palm")
    with pytest.raises(ValueError, match="seq_len=0 must be >= 1"):
        megatron_flops_per_token(_gqa(), 0)
    with pytest.raises(ValueError, match="mtp_layers=-1 must be >= 0"):
        megatron_flops_per_token(_gqa(), 8, mtp_layers=-1)
    with pytest.raises(ValueError, match="vocab_multiple=0 must be >= 1"):
        megatron_flops_per_token(_gqa(), 8, vocab_multiple=0)
    with pytest.raises(ValueError, match="attention_flops: heads=0 must be >= 1"):
        attention_flops(8, 0, 16, causal=True)
    with pytest.raises(ValueError, match="mfu: n_gpus=0 must be > 0"):
        mfu(1.0, 1.0, 0, 1.0)
