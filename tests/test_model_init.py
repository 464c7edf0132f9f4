"""Initialisation that does not need the whole model on every rank.

Reference: a model built the ordinary way on CPU. A model built on the meta device, with its
experts sliced the way expert parallelism slices them (and layers stripped the way a pipeline
stage strips them), then materialised with `to_empty` + `reset_parameters(seed)`, must hold
exactly the reference's values for what it keeps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from model import ModelConfig, MoETransformer, presets

CONFIGS = {
    "gqa-tied": dataclasses.replace(presets.get("tiny"), tie_embeddings=True),
    "gqa-qknorm-shared-gate": dataclasses.replace(
        presets.get("tiny"), qk_norm=True, attn_out_bias=True, shared_ffn_dim=40,
        n_shared_experts=1, shared_expert_gate=True, first_k_dense=1, dense_ffn_dim=48),
    "mla-qlora-sigmoid": dataclasses.replace(
        presets.get("tiny"), attention="mla", q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, router="sigmoid",
        rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64),
}


def _reference(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    m = MoETransformer(cfg)
    m.reset_parameters(seed)
    return {k: v.clone() for k, v in m.state_dict().items()} | {
        f"{n}:inv_freq": b.clone() for n, b in m.named_buffers() if n.endswith("inv_freq")}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_tensor_is_initialised(name):
    cfg = CONFIGS[name]
    m = MoETransformer(cfg)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
    m.reset_parameters(3)
    ref = _reference(cfg, 3)
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref[k]), k
    for n, b in m.named_buffers():
        assert not (b.is_floating_point() and b.isnan().any()), n


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_build_sliced_equals_full(name):
    cfg = CONFIGS[name]
    ref = _reference(cfg, 7)
    ep, rank = 4, 2
    local = cfg.n_routed_experts // ep
    with torch.device("meta"):
        m = MoETransformer(cfg)
    assert m.embed.weight.is_meta
    for layer in m.moe_layers():  # what trainer.distributed.parallel does under EP
        ex = layer.experts
        for w in ("w1", "w2", "w3"):
            setattr(ex, w, nn.Parameter(getattr(ex, w).detach()[rank * local:(rank + 1) * local]))
        ex.first_slot = rank * local
    m.materialize("cpu", seed=7)
    got = m.state_dict()
    assert set(got) == {k for k in ref if ":" not in k}
    for k, v in got.items():
        want = ref[k]
        if ".experts.w" in k:
            want = want[rank * local:(rank + 1) * local]
        assert torch.equal(v, want), k
    for n, b in m.named_buffers():
        if n.endswith("inv_freq"):
            assert torch.equal(b, ref[f"{n}:inv_freq"]), n
    if cfg.tie_embeddings:
        assert m.lm_head.weight is m.embed.weight


def test_seed_changes_values_and_global_rng_default():
    cfg = presets.get("tiny")
    a, b = _reference(cfg, 1), _reference(cfg, 2)
    assert not torch.equal(a["embed.weight"], b["embed.weight"])
    torch.manual_seed(5)
    x = MoETransformer(cfg).state_dict()
    torch.manual_seed(5)
    y = MoETransformer(cfg).state_dict()
    assert all(torch.equal(x[k], y[k]) for k in x)
    # experts of one layer are not copies of each other, nor of another layer's
    w = a["layers.0.ffn.experts.w1"]
    assert not torch.equal(w[0], w[1])
    assert not torch.equal(w[0], a["layers.1.ffn.experts.w1"][0])
    assert w.std().item() == pytest.approx(cfg.init_std, rel=0.05)
