"""ModelConfig: presets against the published sizes, exact counting by hand, the MoE layer
rule, FLOPs, HF config round trips and bad-input errors."""

from __future__ import annotations

import json

import pytest

from model import ModelConfig, presets
from model.hf import SUPPORTED_MODEL_TYPES, config_to_hf

# docs/reference.md section 2: (total, active) in billions, as published (rounded).
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),
    "mixtral-8x22b": (140.6, 39.2),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235.0, 22.0),
    "deepseek-v2": (236.0, 21.0),
    "deepseek-v3": (671.0, 37.0),
    "kimi-k2": (1040.0, 32.0),
    "llama4-scout": (109.0, 17.0),
    "llama4-maverick": (400.0, 17.0),
}

PRESET_TYPES = presets.HF_MODEL_TYPE


def test_preset_names() -> None:
    assert set(presets.names()) == set(PUBLISHED) | {"tiny"}
    with pytest.raises(KeyError, match="mixtral-8x7b"):
        presets.get("mixtral-8x8b")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_totals_near_published(name: str) -> None:
    cfg = presets.get(name)
    total, active = PUBLISHED[name]
    # Published sizes are rounded marketing figures (Kimi-K2's "1.04T" and Llama-4-Scout's
    # "~109B" are the loosest, 1.3 % and 1.1 % above the exact counts), hence 2 % / 5 %.
    assert cfg.num_params() / 1e9 == pytest.approx(total, rel=0.02)
    assert cfg.num_active_params() / 1e9 == pytest.approx(active, rel=0.05)


def test_mixtral_counts_by_hand() -> None:
    cfg = presets.get("mixtral-8x7b")
    d, f, V, L, E, k = 4096, 14336, 32000, 32, 8, 2
    attn = d * 4096 + 2 * d * 1024 + 4096 * d  # q, k, v (8 kv heads x 128), o
    per_layer_common = attn + 2 * d + E * d  # 2 norms + router
    expected_total = 2 * V * d + d + L * (per_layer_common + E * 3 * d * f)
    expected_active = 2 * V * d + d + L * (per_layer_common + k * 3 * d * f)
    assert cfg.num_params() == expected_total == 46_702_792_704
    assert cfg.num_active_params() == expected_active


def test_deepseek_v3_active_by_hand() -> None:
    cfg = presets.get("deepseek-v3")
    d, H, V = 7168, 128, 129280
    mla = (
        d * 1536
        + 1536
        + 1536 * H * 192  # q down, q norm, q up (nope 128 + rope 64)
        + d * (512 + 64)
        + 512
        + 512 * H * (128 + 128)  # kv down, kv norm, kv up
        + H * 128 * d
    )  # o
    dense = 3 * d * 18432
    moe_active = 256 * d + (8 + 1) * 3 * d * 2048  # router + 8 routed + 1 shared
    expected = 2 * V * d + d + 61 * (2 * d + mla) + 3 * dense + 58 * moe_active
    assert cfg.num_active_params() == expected


def test_is_moe_layer_rules() -> None:
    mav = presets.get("llama4-maverick")
    assert mav.moe_layer_ids == list(range(1, 48, 2))  # interleave step 2: layers 1, 3, ...
    v3 = presets.get("deepseek-v3")
    assert v3.moe_layer_ids == list(range(3, 61))
    q = ModelConfig(n_layers=6, moe_every=2, dense_layers=(3,), first_k_dense=1, dense_ffn_dim=64)
    assert q.moe_layer_ids == [1, 5]
    with pytest.raises(ValueError, match="out of range"):
        q.is_moe_layer(6)


def test_flops_per_token_by_hand() -> None:
    cfg = presets.get("tiny")
    d, V, L, E, k, f, S = 128, 256, 4, 8, 2, 256, 256
    attn = d * 128 + 2 * d * 64 + 128 * d
    matmul = V * d + L * (attn + E * d + k * 3 * d * f)  # lm_head + projections + routers
    expected = 6 * matmul + 6 * L * S * 4 * (32 + 32)
    assert cfg.flops_per_token(S) == expected


@pytest.mark.parametrize("name", sorted(PRESET_TYPES))
def test_hf_config_round_trip(name: str, tmp_path) -> None:
    cfg = presets.get(name)
    d = config_to_hf(cfg, PRESET_TYPES[name])
    back = ModelConfig.from_hf_config(d)
    assert back == cfg.replace(name=back.name)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_hf_config(tmp_path) == back  # folder or file path


def test_from_hf_config_real_layouts() -> None:
    # The Llama-4 multimodal wrapper and the transformers-5 rope_parameters layout.
    text = config_to_hf(presets.get("llama4-maverick"), "llama4_text")
    wrapped = {"model_type": "llama4", "text_config": text, "vision_config": {}}
    assert ModelConfig.from_hf_config(wrapped).moe_layer_ids == list(range(1, 48, 2))
    d = config_to_hf(presets.get("deepseek-v3"), "deepseek_v3")
    scaling = d.pop("rope_scaling")
    d["rope_parameters"] = {**scaling, "rope_theta": d.pop("rope_theta")}
    assert ModelConfig.from_hf_config(d) == ModelConfig.from_hf_config(
        config_to_hf(presets.get("deepseek-v3"), "deepseek_v3")
    )


def test_from_hf_config_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported.*mixtral"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_hf_config(tmp_path / "nope.json")
    d = config_to_hf(presets.get("deepseek-v2"), "deepseek_v2")
    d["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        ModelConfig.from_hf_config(d)
    assert set(SUPPORTED_MODEL_TYPES) >= {"mixtral", "qwen3_moe", "deepseek_v3", "kimi_k2"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(top_k=9), "top_k=9 must be in 1..n_routed_experts=8"),
        (
            dict(n_kv_heads=3),
            "n_heads=4 is not divisible by n_kv_heads=3; valid n_kv_heads: 1, 2, 4",
        ),
        (dict(attention="sparse"), "attention='sparse' is not supported; valid: gqa, mla"),
        (dict(router="relu"), "router='relu' is not supported"),
        (dict(n_group=3), "n_group=3 does not divide n_routed_experts=8"),
        (dict(n_group=4, topk_group=1, top_k=3), "top_k=3 exceeds the 1 groups x 2 experts"),
        (dict(attention="mla"), "attention='mla' needs kv_lora_rank >= 1"),
        (dict(first_k_dense=1), r"layers \[0\] are dense but dense_ffn_dim=0"),
        (dict(rope_scaling="yarn"), "needs rope_original_max_seq_len >= 1"),
        (dict(d_model=0), "d_model=0 must be >= 1"),
    ],
)
def test_bad_config_errors(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        presets.get("tiny").replace(**changes)


def test_dict_round_trip_and_unknown_field() -> None:
    cfg = presets.get("deepseek-v3")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['n_expert'\]"):
        ModelConfig.from_dict({"n_expert": 4})
