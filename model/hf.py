"""Interop with Hugging Face `transformers`: config.json <-> ModelConfig, and state dicts.

Supported `model_type`s: mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, kimi_k2
(DeepSeek-V3 format), llama4 / llama4_text (text model only).

config.json -> ModelConfig: the field maps are in `model.hf_config` (SUPPORTED_MODEL_TYPES,
HF_ALIASES, normalize_hf_config re-exported here), below ModelConfig, which builds itself with
them (`ModelConfig.from_hf_config`; `config_from_hf` here is the same for a dict).
ModelConfig -> config.json: `config_to_hf`.
State dicts: `convert_hf_state_dict` (in `model.hf_weights`, re-exported here).

Llama-4 note: MoETransformer reproduces Llama-4's parameter shapes and counts, not its exact
numerics (it lacks NoPE layers, chunked attention, attention temperature tuning, the weightless
L2 q/k norm and the router weight applied to the expert input); its state dicts are rejected.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .hf_config import HF_ALIASES, SUPPORTED_MODEL_TYPES, normalize_hf_config
from .hf_weights import convert_hf_state_dict


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (field maps in `model.hf_config`)."""
    return ModelConfig.from_hf_config(d)


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """A transformers config dict for `cfg` (to build the reference model in tests)."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    d: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        num_experts_per_tok=cfg.top_k,
        rope_theta=cfg.rope_theta,
    )
    if cfg.rope_scaling != "none":
        s: dict[str, Any] = dict(
            rope_type=cfg.rope_scaling,
            factor=cfg.rope_factor,
            original_max_position_embeddings=cfg.rope_original_max_seq_len,
        )
        if cfg.rope_scaling == "yarn":
            s.update(
                beta_fast=cfg.rope_beta_fast,
                beta_slow=cfg.rope_beta_slow,
                mscale=cfg.rope_mscale,
                mscale_all_dim=cfg.rope_mscale_all_dim,
            )
        else:
            s.update(
                low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor
            )
        d["rope_scaling"] = s
    if model_type == "mixtral":
        d.update(
            head_dim=cfg.head_dim,
            num_local_experts=cfg.n_routed_experts,
            intermediate_size=cfg.moe_ffn_dim,
            router_aux_loss_coef=cfg.aux_loss_coef,
            sliding_window=None,
        )
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        d.update(
            head_dim=cfg.head_dim,
            num_experts=cfg.n_routed_experts,
            moe_intermediate_size=cfg.moe_ffn_dim,
            intermediate_size=cfg.dense_ffn_dim,
            decoder_sparse_step=cfg.moe_every,
            mlp_only_layers=list(cfg.dense_layers),
            norm_topk_prob=cfg.norm_topk_prob,
            router_aux_loss_coef=cfg.aux_loss_coef,
            use_sliding_window=False,
        )
        if model_type == "qwen3_moe":
            d["attention_bias"] = cfg.attn_qkv_bias
        else:
            d.update(qkv_bias=cfg.attn_qkv_bias, shared_expert_intermediate_size=cfg.shared_ffn_dim)
    elif model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        method = (
            "greedy"
            if cfg.n_group == 1 and cfg.router == "softmax"
            else ("group_limited_greedy" if cfg.group_score == "max" else "noaux_tc")
        )
        d.update(
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_interleave=cfg.rope_interleave,
            n_routed_experts=cfg.n_routed_experts,
            moe_intermediate_size=cfg.moe_ffn_dim,
            n_shared_experts=cfg.n_shared_experts,
            intermediate_size=cfg.dense_ffn_dim,
            first_k_dense_replace=cfg.first_k_dense,
            scoring_func=cfg.router,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            topk_method=method,
            aux_loss_alpha=cfg.aux_loss_coef,
            attention_bias=cfg.attn_qkv_bias,
            num_nextn_predict_layers=cfg.n_mtp_layers,
            moe_layer_freq=1,
        )
    else:
        d.update(
            model_type="llama4_text",
            head_dim=cfg.head_dim,
            num_local_experts=cfg.n_routed_experts,
            intermediate_size=cfg.moe_ffn_dim,
            intermediate_size_mlp=cfg.dense_ffn_dim,
            interleave_moe_layer_step=cfg.moe_every,
            router_aux_loss_coef=cfg.aux_loss_coef,
            attention_bias=cfg.attn_qkv_bias,
        )
    return d


__all__ = [
    "HF_ALIASES",
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "convert_hf_state_dict",
    "normalize_hf_config",
]
