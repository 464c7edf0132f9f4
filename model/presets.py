"""Named model configurations: the public checkpoints' config.json values, and `tiny`.

Totals (num_params / num_active_params, embeddings included) match the published sizes in
docs/reference.md section 2; tests check them. DeepSeek-V3's MTP module is not counted (it is not
part of the transformers model either).
"""

from __future__ import annotations

from collections.abc import Callable

from .config import ModelConfig

__all__ = ["HF_MODEL_TYPE", "get", "names"]


def _tiny() -> ModelConfig:
    # The CPU default: byte-level vocab, every layer MoE (4 MoE layers) so routing, the aux
    # loss and expert parallelism are exercised in every block.
    return ModelConfig(
        name="tiny",
        vocab_size=256,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=256,
        rms_norm_eps=1e-6,
        n_routed_experts=8,
        top_k=2,
        moe_ffn_dim=256,
        router="softmax",
        norm_topk_prob=True,
        aux_loss_coef=0.01,
        tie_embeddings=False,
    )


def _mixtral(
    name: str, d: int, L: int, H: int, f: int, vocab: int, max_seq: int, aux: float
) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        d_model=d,
        n_layers=L,
        n_heads=H,
        n_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_seq_len=max_seq,
        rms_norm_eps=1e-5,
        n_routed_experts=8,
        top_k=2,
        moe_ffn_dim=f,
        router="softmax",
        norm_topk_prob=True,
        aux_loss_coef=aux,
    )


def _qwen3(name: str, d: int, L: int, H: int, f_moe: int, f_dense: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=151936,
        d_model=d,
        n_layers=L,
        n_heads=H,
        n_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        rope_theta=1e6,
        max_seq_len=40960,
        rms_norm_eps=1e-6,
        dense_ffn_dim=f_dense,
        n_routed_experts=128,
        top_k=8,
        moe_ffn_dim=f_moe,
        router="softmax",
        norm_topk_prob=True,
        aux_loss_coef=0.001,
    )


def _deepseek_v2() -> ModelConfig:
    return ModelConfig(
        name="deepseek-v2",
        vocab_size=102400,
        d_model=5120,
        n_layers=60,
        n_heads=128,
        n_kv_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        rope_theta=10000.0,
        rope_scaling="yarn",
        rope_factor=40.0,
        rope_original_max_seq_len=4096,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=0.707,
        rope_mscale_all_dim=0.707,
        max_seq_len=163840,
        dense_ffn_dim=12288,
        first_k_dense=1,
        n_routed_experts=160,
        top_k=6,
        moe_ffn_dim=1536,
        n_shared_experts=2,
        shared_ffn_dim=2 * 1536,
        router="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        n_group=8,
        topk_group=3,
        group_score="max",
        aux_loss_coef=0.003,
    )


def _deepseek_v3_like(
    name: str,
    vocab: int,
    H: int,
    E: int,
    first_dense: int,
    scale: float,
    n_group: int,
    topk_group: int,
    theta: float,
    factor: float,
    beta_fast: float,
    max_seq: int,
    mtp: int,
) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        d_model=7168,
        n_layers=61,
        n_heads=H,
        n_kv_heads=H,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        rope_theta=theta,
        rope_scaling="yarn",
        rope_factor=factor,
        rope_original_max_seq_len=4096,
        rope_beta_fast=beta_fast,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        max_seq_len=max_seq,
        dense_ffn_dim=18432,
        first_k_dense=first_dense,
        n_routed_experts=E,
        top_k=8,
        moe_ffn_dim=2048,
        n_shared_experts=1,
        shared_ffn_dim=2048,
        router="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=scale,
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2_sum",
        aux_loss_coef=0.001,
        bias_balancing=True,
        n_mtp_layers=mtp,
    )


def _llama4(name: str, E: int, step: int, dense_f: int, scaling: dict, max_seq: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=202048,
        d_model=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_seq_len=max_seq,
        rms_norm_eps=1e-5,
        dense_ffn_dim=dense_f,
        moe_every=step,
        n_routed_experts=E,
        top_k=1,
        moe_ffn_dim=8192,
        n_shared_experts=1,
        shared_ffn_dim=8192,
        router="sigmoid",
        norm_topk_prob=False,
        aux_loss_coef=0.001,
        **scaling,
    )


_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": _tiny,
    "mixtral-8x7b": lambda: _mixtral("mixtral-8x7b", 4096, 32, 32, 14336, 32000, 32768, 0.02),
    "mixtral-8x22b": lambda: _mixtral("mixtral-8x22b", 6144, 56, 48, 16384, 32768, 65536, 0.001),
    "qwen3-30b-a3b": lambda: _qwen3("qwen3-30b-a3b", 2048, 48, 32, 768, 6144),
    "qwen3-235b-a22b": lambda: _qwen3("qwen3-235b-a22b", 4096, 94, 64, 1536, 12288),
    "deepseek-v2": _deepseek_v2,
    "deepseek-v3": lambda: _deepseek_v3_like(
        "deepseek-v3", 129280, 128, 256, 3, 2.5, 8, 4, 10000.0, 40.0, 32.0, 163840, 1
    ),
    "kimi-k2": lambda: _deepseek_v3_like(
        "kimi-k2", 163840, 64, 384, 1, 2.827, 1, 1, 50000.0, 32.0, 1.0, 131072, 0
    ),
    "llama4-scout": lambda: _llama4(
        "llama4-scout",
        16,
        1,
        0,
        dict(
            rope_scaling="llama3",
            rope_factor=16.0,
            rope_original_max_seq_len=8192,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=1.0,
        ),
        10485760,
    ),
    "llama4-maverick": lambda: _llama4("llama4-maverick", 128, 2, 16384, {}, 1048576),
}


# The config.json `model_type` each real preset is published in (for round trips through
# ModelConfig.from_hf_config / model.hf.config_to_hf and comparisons with transformers).
HF_MODEL_TYPE = {
    "mixtral-8x7b": "mixtral",
    "mixtral-8x22b": "mixtral",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-235b-a22b": "qwen3_moe",
    "deepseek-v2": "deepseek_v2",
    "deepseek-v3": "deepseek_v3",
    "kimi-k2": "deepseek_v3",
    "llama4-scout": "llama4_text",
    "llama4-maverick": "llama4_text",
}


def names() -> list[str]:
    """All preset names, sorted."""
    return sorted(_PRESETS)


def get(name: str) -> ModelConfig:
    """A fresh ModelConfig for preset `name`; KeyError listing the valid names otherwise."""
    try:
        factory = _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; valid: {', '.join(names())}") from None
    return factory()
