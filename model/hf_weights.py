"""transformers-format state dicts -> MoETransformer's layout.

Both the per-expert checkpoint layout (`...experts.3.w1.weight` for Mixtral,
`...experts.3.gate_proj.weight` for Qwen/DeepSeek) and transformers >= 5's fused tensors
(`experts.gate_up_proj` [E, 2F, D] with gate rows first, `experts.down_proj` [E, D, F]) load.
HF Linear weights are [out, in]; our grouped expert weights are [E, in, out], hence the
transposes. Dense layers, attention and shared experts keep nn.Linear's [out, in] layout.

Shape legend: E experts, D model, F expert ffn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .config import ModelConfig

_ATTN = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "q_a_proj": "wq_a",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "wkv_b",
}
_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")


def convert_hf_state_dict(
    sd: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Rename / stack / transpose a transformers state dict into MoETransformer's layout.

    Rotary tables are dropped; layers >= cfg.n_layers (DeepSeek-V3's MTP module in the
    original checkpoint) are dropped; any other unknown key raises ValueError."""
    if any(".feed_forward." in k for k in sd):
        raise ValueError(
            "Llama-4 state dicts are not supported: MoETransformer matches Llama-4's shapes, "
            "not its numerics (see the model.hf docstring)"
        )
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, t in sd.items():
        if "rotary_emb" in key:
            continue
        if key in ("model.embed_tokens.weight", "embed_tokens.weight"):
            out["embed.weight"] = t
        elif key in ("model.norm.weight", "norm.weight"):
            out["norm.weight"] = t
        elif key == "lm_head.weight":
            out["lm_head.weight"] = t
        elif (m := _LAYER.match(key)) is not None:
            i, rest = int(m.group(1)), m.group(2)
            if i >= cfg.n_layers:
                continue
            if not _convert_layer(i, rest, t, out, per_expert):
                unknown.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"unrecognised state-dict keys (first 10 of {len(unknown)}): {unknown[:10]}"
        )
    for (i, proj), by_e in per_expert.items():
        E = cfg.n_routed_experts
        if sorted(by_e) != list(range(E)):
            raise ValueError(f"layer {i} {proj}: expected experts 0..{E - 1}, got {sorted(by_e)}")
        # HF [F, D] (gate/up) or [D, F] (down) per expert -> ours [E, in, out]
        out[f"layers.{i}.ffn.experts.{_MLP[proj]}"] = torch.stack([by_e[e].t() for e in range(E)])
    for ffn in (f"layers.{j}.ffn" for j in cfg.moe_layer_ids):
        if f"{ffn}.expert2slot" not in out:
            out[f"{ffn}.expert2slot"] = torch.arange(cfg.n_routed_experts)
        if f"{ffn}.router.e_score_correction_bias" not in out:
            out[f"{ffn}.router.e_score_correction_bias"] = torch.zeros(cfg.n_routed_experts)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def _convert_layer(
    i: int,
    rest: str,
    t: torch.Tensor,
    out: dict[str, torch.Tensor],
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]],
) -> bool:
    """Store the per-layer HF tensor `rest` of layer i under our name; False if unknown."""
    p = f"layers.{i}."
    if rest == "input_layernorm.weight":
        out[p + "attn_norm.weight"] = t
        return True
    if rest == "post_attention_layernorm.weight":
        out[p + "ffn_norm.weight"] = t
        return True
    if rest.startswith("self_attn."):
        mod, _, leaf = rest[len("self_attn.") :].partition(".")
        if mod not in _ATTN:
            return False
        out[p + f"attn.{_ATTN[mod]}.{leaf}"] = t
        return True
    for prefix in ("mlp.", "block_sparse_moe."):
        if rest.startswith(prefix):
            rest = rest[len(prefix) :]
            break
    else:
        return False
    mod, _, leaf = rest.partition(".")
    f = p + "ffn."
    if mod in ("gate_proj", "up_proj", "down_proj"):  # dense layer, same [out, in] Linear
        out[f + f"{_MLP[mod]}.{leaf}"] = t
    elif rest == "gate.weight":
        out[f + "router.weight"] = t
    elif rest == "gate.e_score_correction_bias":
        out[f + "router.e_score_correction_bias"] = t
    elif mod in ("shared_experts", "shared_expert"):
        sub, _, leaf = leaf.partition(".")
        if sub not in _MLP:
            return False
        out[f + f"shared_experts.{_MLP[sub]}.{leaf}"] = t
    elif rest == "shared_expert_gate.weight":
        out[f + "shared_gate.weight"] = t
    elif rest == "experts.gate_up_proj":  # transformers >= 5 fused [E, 2F, D], gate rows first
        gate, up = t.chunk(2, dim=1)
        out[f + "experts.w1"] = gate.transpose(1, 2).contiguous()
        out[f + "experts.w3"] = up.transpose(1, 2).contiguous()
    elif rest == "experts.down_proj":  # [E, D, F]
        out[f + "experts.w2"] = t.transpose(1, 2).contiguous()
    elif (m := _EXPERT.match(rest)) is not None and m.group(2) in _MLP:
        per_expert.setdefault((i, m.group(2)), {})[int(m.group(1))] = t
    else:
        return False
    return True
