"""transformers config.json -> ModelConfig field values: the field maps of each model type.

Supported `model_type`s: mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, kimi_k2
(DeepSeek-V3 format), llama4 / llama4_text (text model only).

`ModelConfig.from_hf_config` builds the config from `hf_config_fields`; this module returns
plain values and imports nothing of `model`, so ModelConfig can call it without a circle. The
way back (`config_to_hf`) and the state dicts are in `model.hf`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HF_ALIASES", "SUPPORTED_MODEL_TYPES", "hf_config_fields", "normalize_hf_config"]

SUPPORTED_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "llama4",
    "llama4_text",
)


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    """RoPE fields from either the classic (rope_theta + rope_scaling) or the transformers 5
    (rope_parameters) layout."""
    params: dict[str, Any] = dict(d.get("rope_parameters") or {})
    scaling: dict[str, Any] = dict(d.get("rope_scaling") or {})
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in ("default", None):
        return out
    if kind not in ("yarn", "llama3"):
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: yarn, llama3")
    out.update(
        rope_scaling=kind,
        rope_factor=float(scaling["factor"]),
        rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]),
    )
    if kind == "yarn":
        out.update(
            rope_beta_fast=float(scaling.get("beta_fast") or 32),
            rope_beta_slow=float(scaling.get("beta_slow") or 1),
            rope_mscale=float(scaling.get("mscale") or 0.0),
            rope_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
        )
    else:
        out.update(
            rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        )
    return out


# Spellings transformers accepts for one field: its config classes' `attribute_map` (alias ->
# canonical) plus the names older releases wrote. Per model type, canonical name -> aliases;
# `normalize_hf_config` fills the canonical name this module reads from whichever is present.
# tests/test_hf_import_export.py checks this table against transformers' attribute maps.
HF_ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "mixtral": {"num_local_experts": ("num_experts",)},
    "qwen2_moe": {"num_experts": ("num_local_experts",)},
    "qwen3_moe": {"num_experts": ("num_local_experts",)},
    "deepseek_v2": {"n_routed_experts": ("num_experts", "num_local_experts")},
    "deepseek_v3": {
        "n_routed_experts": ("num_local_experts", "num_experts"),
        "num_nextn_predict_layers": ("num_mtp_layers",),
    },
    "kimi_k2": {
        "n_routed_experts": ("num_local_experts", "num_experts"),
        "num_nextn_predict_layers": ("num_mtp_layers",),
    },
    "llama4_text": {"num_local_experts": ("num_experts",)},
}


def normalize_hf_config(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of config dict `d` in which every aliased field of its model type is present under
    the canonical name this module reads (see HF_ALIASES); the original keys are kept."""
    out = dict(d)
    for canon, aliases in HF_ALIASES.get(str(d.get("model_type")), {}).items():
        if out.get(canon) is None:
            for a in aliases:
                if out.get(a) is not None:
                    out[canon] = out[a]
                    break
    return out


class _Fields(dict):
    """The config dict; a missing required field raises a ValueError naming it (and the
    spellings accepted for it) instead of a bare KeyError."""

    def __missing__(self, key: str) -> Any:
        mt = dict.get(self, "model_type")
        alts = HF_ALIASES.get(str(mt), {}).get(key, ())
        also = f" (also accepted: {', '.join(alts)})" if alts else ""
        raise ValueError(f"config.json of model_type={mt!r} has no field {key!r}{also}; it is "
                         f"required to build the model")


def _common(d: dict[str, Any]) -> dict[str, Any]:
    heads = int(d["num_attention_heads"])
    return dict(
        name=str(d.get("_name_or_path") or d["model_type"]),
        vocab_size=int(d["vocab_size"]),
        d_model=int(d["hidden_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(d.get("num_key_value_heads") or heads),
        max_seq_len=int(d.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
        top_k=int(d["num_experts_per_tok"]),
        **_rope(d),
    )


def hf_config_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig(...)` keyword arguments for a transformers config.json dict (see the
    module docstring for the types); `extra["model_type"]` records the type read."""
    mt = d.get("model_type")
    if mt == "llama4":
        d = {**d["text_config"], "model_type": "llama4_text"}
        mt = "llama4_text"
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    d = _Fields(normalize_hf_config(d))
    c = _common(d)
    if mt == "mixtral":
        if d.get("sliding_window") is not None:
            raise ValueError(
                f"Mixtral sliding_window={d['sliding_window']} is not supported; use null"
            )
        c.update(
            head_dim=d.get("head_dim") or c["d_model"] // c["n_heads"],
            n_routed_experts=int(d["num_local_experts"]),
            moe_ffn_dim=int(d["intermediate_size"]),
            router="softmax",
            norm_topk_prob=True,
            aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        )
    elif mt in ("qwen2_moe", "qwen3_moe"):
        if d.get("use_sliding_window"):
            raise ValueError("Qwen use_sliding_window=true is not supported; set it to false")
        qwen3 = mt == "qwen3_moe"
        c.update(
            head_dim=d.get("head_dim") or c["d_model"] // c["n_heads"],
            qk_norm=qwen3,
            attn_qkv_bias=bool(d.get("attention_bias", False))
            if qwen3
            else bool(d.get("qkv_bias", True)),
            attn_out_bias=bool(d.get("attention_bias", False)) if qwen3 else False,
            n_routed_experts=int(d["num_experts"]),
            moe_ffn_dim=int(d["moe_intermediate_size"]),
            dense_ffn_dim=int(d.get("intermediate_size", 0)),
            moe_every=int(d.get("decoder_sparse_step", 1)),
            dense_layers=tuple(d.get("mlp_only_layers") or ()),
            router="softmax",
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        )
        if not qwen3 and d.get("shared_expert_intermediate_size"):
            c.update(
                n_shared_experts=1,
                shared_ffn_dim=int(d["shared_expert_intermediate_size"]),
                shared_expert_gate=True,
            )
    elif mt in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        if int(d.get("moe_layer_freq", 1)) != 1:
            raise ValueError(
                f"DeepSeek moe_layer_freq={d['moe_layer_freq']} is not supported; only 1"
            )
        method = d.get("topk_method", "noaux_tc" if mt != "deepseek_v2" else "greedy")
        methods = {"greedy": "max", "group_limited_greedy": "max", "noaux_tc": "top2_sum"}
        if method not in methods:
            raise ValueError(
                f"topk_method={method!r} is not supported; valid: {', '.join(methods)}"
            )
        grouped = method != "greedy"
        n_shared = int(d.get("n_shared_experts") or 0)
        bias = bool(d.get("attention_bias", False))
        c.update(
            n_kv_heads=c["n_heads"],
            attention="mla",
            attn_qkv_bias=bias,
            attn_out_bias=bias,
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            rope_interleave=bool(d.get("rope_interleave", True)),
            n_routed_experts=int(d["n_routed_experts"]),
            moe_ffn_dim=int(d["moe_intermediate_size"]),
            n_shared_experts=n_shared,
            shared_ffn_dim=n_shared * int(d["moe_intermediate_size"]),
            dense_ffn_dim=int(d["intermediate_size"]),
            first_k_dense=int(d.get("first_k_dense_replace") or 0),
            router=d.get("scoring_func", "softmax" if mt == "deepseek_v2" else "sigmoid"),
            norm_topk_prob=bool(d.get("norm_topk_prob", mt != "deepseek_v2")),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            n_group=int(d.get("n_group") or 1) if grouped else 1,
            topk_group=int(d.get("topk_group") or 1) if grouped else 1,
            group_score=methods[method],
            bias_balancing=method == "noaux_tc",
            aux_loss_coef=float(d.get("aux_loss_alpha", 0.001)),
            n_mtp_layers=int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
        )
    else:  # llama4_text
        step = int(d.get("interleave_moe_layer_step", 1))
        n = c["n_layers"]
        moe_layers = d.get("moe_layers")
        if moe_layers is not None and list(moe_layers) != list(range(step - 1, n, step)):
            raise ValueError(
                f"Llama-4 moe_layers={moe_layers} is not every {step}-th layer "
                f"(layers {list(range(step - 1, n, step))}); only that pattern is supported"
            )
        c.update(
            head_dim=d.get("head_dim") or c["d_model"] // c["n_heads"],
            attn_qkv_bias=bool(d.get("attention_bias", False)),
            attn_out_bias=bool(d.get("attention_bias", False)),
            n_routed_experts=int(d["num_local_experts"]),
            moe_ffn_dim=int(d["intermediate_size"]),
            n_shared_experts=1,
            shared_ffn_dim=int(d["intermediate_size"]),
            dense_ffn_dim=int(d.get("intermediate_size_mlp", 0)) if step > 1 else 0,
            moe_every=step,
            router="sigmoid",
            norm_topk_prob=False,
            aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        )
    c["extra"] = {"model_type": mt}
    return c
