"""MoETransformer against the transformers reference implementations.

1. num_params() == the parameter count of the transformers model of the same configuration,
   instantiated on the meta device, for every preset (transformers registers DeepSeek-V3's
   e_score_correction_bias as a buffer, as we do; it has no MTP module, neither do we).
2. With identical weights, fp32 logits agree for tiny Mixtral, Qwen3-MoE, DeepSeek-V3 (MLA with
   q low-rank, yarn RoPE, sigmoid group-limited routing with the correction bias,
   norm_topk_prob, routed_scaling_factor, shared expert, first_k_dense), DeepSeek-V2 and
   Qwen2-MoE configs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model import ModelConfig, MoETransformer, presets
from model.hf import config_to_hf

transformers = pytest.importorskip("transformers")

# Logit tolerance: both sides compute the same fp32 math in a different order (grouped GEMM
# vs a per-expert loop, another summation order over the k experts, SDPA vs eager attention),
# so results differ by a few ulps per op (measured max 1.4e-6 on logits of magnitude ~2).
# 2e-5 leaves 10x headroom yet is 4 orders of magnitude below the effect of any semantic
# mismatch (see test_logit_check_detects_semantic_changes: >= 0.1).
ATOL, RTOL = 2e-5, 1e-5

PRESET_TYPES = presets.HF_MODEL_TYPE


def hf_model(cfg: ModelConfig, model_type: str, device: str = "cpu") -> nn.Module:
    d = config_to_hf(cfg, model_type)
    hc = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hc._attn_implementation = "eager"
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(hc)


@pytest.mark.parametrize("name", sorted(PRESET_TYPES))
def test_num_params_matches_transformers(name: str) -> None:
    cfg = presets.get(name)
    ref = sum(p.numel() for p in hf_model(cfg, PRESET_TYPES[name], "meta").parameters())
    with torch.device("meta"):
        ours = sum(p.numel() for p in MoETransformer(cfg).parameters())
    assert cfg.num_params() == ref == ours


TINY_MIXTRAL = ModelConfig(
    name="tiny-mixtral",
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=64,
    rms_norm_eps=1e-5,
    n_routed_experts=4,
    top_k=2,
    moe_ffn_dim=48,
)
TINY_QWEN3 = ModelConfig(
    name="tiny-qwen3",
    vocab_size=64,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    max_seq_len=64,
    n_routed_experts=8,
    top_k=2,
    moe_ffn_dim=24,
    dense_ffn_dim=40,
    dense_layers=(1,),
    norm_topk_prob=True,
    rope_theta=1e6,
)
TINY_DSV3 = ModelConfig(
    name="tiny-dsv3",
    vocab_size=64,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=4,
    attention="mla",
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    rope_interleave=True,
    rope_scaling="yarn",
    rope_factor=4.0,
    rope_original_max_seq_len=16,
    rope_mscale=1.0,
    rope_mscale_all_dim=1.0,
    max_seq_len=64,
    dense_ffn_dim=40,
    first_k_dense=1,
    n_routed_experts=8,
    top_k=2,
    moe_ffn_dim=16,
    n_shared_experts=1,
    shared_ffn_dim=16,
    router="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_group=4,
    topk_group=2,
    group_score="top2_sum",
    bias_balancing=True,
)
TINY_DSV2 = TINY_DSV3.replace(
    name="tiny-dsv2",
    router="softmax",
    group_score="max",
    norm_topk_prob=False,
    bias_balancing=False,
    rope_mscale=0.707,
    rope_mscale_all_dim=0.707,
    q_lora_rank=None,
    n_shared_experts=2,
    shared_ffn_dim=32,
)
TINY_QWEN2 = TINY_QWEN3.replace(
    name="tiny-qwen2",
    qk_norm=False,
    attn_qkv_bias=True,
    n_shared_experts=1,
    shared_ffn_dim=20,
    shared_expert_gate=True,
    norm_topk_prob=False,
)
CASES = [
    (TINY_MIXTRAL, "mixtral"),
    (TINY_QWEN3, "qwen3_moe"),
    (TINY_DSV3, "deepseek_v3"),
    (TINY_DSV2, "deepseek_v2"),
    (TINY_QWEN2, "qwen2_moe"),
]


def randomize(m: nn.Module) -> nn.Module:
    """O(0.1) random weights (the default 0.02 init makes router scores nearly tied, so routing
    would hinge on last-ulp differences) and a non-zero DeepSeek-V3 router bias, in place."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(0.05 * torch.randn_like(b))
    return m


def random_hf(cfg: ModelConfig, model_type: str) -> nn.Module:
    """Reference model with random weights (`randomize`)."""
    return randomize(hf_model(cfg, model_type).float().eval())


def compare(cfg: ModelConfig, ref: nn.Module, sd: dict[str, torch.Tensor]) -> float:
    ours = MoETransformer(cfg).eval()
    ours.load_hf_state_dict(sd)
    tokens = torch.randint(0, cfg.vocab_size, (3, 20))
    with torch.no_grad():
        want, got = ref(tokens).logits, ours(tokens)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    return (got - want).abs().max().item()


@pytest.mark.parametrize(("cfg", "model_type"), CASES, ids=[c[1] for c in CASES])
def test_logits_match_transformers(cfg: ModelConfig, model_type: str) -> None:
    ref = random_hf(cfg, model_type)
    compare(cfg, ref, ref.state_dict())


def unfuse(sd: dict[str, torch.Tensor], names: tuple[str, str, str], moe_prefix: str) -> dict:
    """transformers-5 fused expert tensors -> the per-expert layout of the original checkpoints
    (gate [F, D], up [F, D], down [D, F] per expert)."""
    out = {}
    for k, t in sd.items():
        if k.endswith("experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")].replace("mlp.", moe_prefix)
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.{names[0]}.weight"] = gate[e]
                out[f"{base}{e}.{names[1]}.weight"] = up[e]
        elif k.endswith("experts.down_proj"):
            base = k[: -len("down_proj")].replace("mlp.", moe_prefix)
            for e in range(t.shape[0]):
                out[f"{base}{e}.{names[2]}.weight"] = t[e]
        else:
            out[k.replace("mlp.gate.", moe_prefix + "gate.")] = t
    return out


def test_per_expert_checkpoint_layouts() -> None:
    ref = random_hf(TINY_MIXTRAL, "mixtral")
    sd = unfuse(ref.state_dict(), ("w1", "w3", "w2"), "block_sparse_moe.")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in sd
    compare(TINY_MIXTRAL, ref, sd)
    ref = random_hf(TINY_DSV3, "deepseek_v3")
    sd = unfuse(ref.state_dict(), ("gate_proj", "up_proj", "down_proj"), "mlp.")
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(1)  # an MTP layer (index >= n_layers)
    compare(TINY_DSV3, ref, sd)


def test_logit_check_detects_semantic_changes() -> None:
    # The tolerance above is meaningful only if real mismatches exceed it by far.
    ref = random_hf(TINY_DSV3, "deepseek_v3")
    tokens = torch.randint(0, 64, (3, 20))
    with torch.no_grad():
        want = ref(tokens).logits
    for change in (
        dict(rope_interleave=False),
        dict(n_group=1, topk_group=1),
        dict(rope_scaling="none"),
        dict(routed_scaling_factor=1.0),
    ):
        ours = MoETransformer(TINY_DSV3.replace(**change)).eval()
        ours.load_hf_state_dict(ref.state_dict())
        with torch.no_grad():
            assert (ours(tokens) - want).abs().max() > 0.05, change


def test_tied_embeddings_and_bad_keys() -> None:
    cfg = TINY_MIXTRAL.replace(tie_embeddings=True)
    ref = random_hf(cfg, "mixtral")
    sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    compare(cfg, ref, sd)
    with pytest.raises(ValueError, match="unrecognised state-dict keys.*model.layers.0.foo"):
        MoETransformer(TINY_MIXTRAL).load_hf_state_dict(
            {**sd, "model.layers.0.foo.weight": sd["model.norm.weight"]}
        )
    with pytest.raises(ValueError, match="Llama-4 state dicts are not supported"):
        MoETransformer(TINY_MIXTRAL).load_hf_state_dict(
            {"model.layers.0.feed_forward.router.weight": torch.zeros(4, 32)}
        )
