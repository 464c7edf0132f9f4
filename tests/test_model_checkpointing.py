"""Activation checkpointing: same math as no checkpointing, and exactly the promised savings.

Reference: the same model without checkpointing (losses and every gradient bit for bit: the
recompute runs the same ops on the same inputs). Saved bytes are counted with the trainer's
saved-tensor meter and compared with hand-computed sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import CHECKPOINTING, GroupedExperts, MoETransformer, presets, set_checkpointing
from trainer.observe.memory import SavedTensorMeter

B, S = 2, 24


def _model() -> MoETransformer:
    # One dense first layer and a shared expert, so every FFN kind is checkpointed.
    cfg = dataclasses.replace(presets.get("tiny"), first_k_dense=1, dense_ffn_dim=48,
                              shared_ffn_dim=40, n_shared_experts=1)
    torch.manual_seed(0)
    return MoETransformer(cfg)


def _step(m: MoETransformer, mode: str) -> tuple[float, list[torch.Tensor], int]:
    set_checkpointing(m, mode)
    m.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(1)
    tok = torch.randint(0, m.cfg.vocab_size, (B, S), generator=gen)
    tgt = torch.randint(0, m.cfg.vocab_size, (B, S), generator=gen)
    meter = SavedTensorMeter(m)
    with meter:
        ce, aux = m.loss(tok, tgt)
        held = meter.live
        (ce + aux).backward()
    assert meter.live == 0  # everything saved was released by the backward
    return float((ce + aux).detach()), [p.grad.clone() for p in m.parameters()], held


@pytest.mark.integration
def test_modes_same_loss_and_gradients_less_memory():
    m = _model()
    loss0, grads0, held0 = _step(m, "none")
    held = {"none": held0}
    for mode in ("selective", "full"):
        loss, grads, held[mode] = _step(m, mode)
        assert loss == loss0, mode
        for g0, g in zip(grads0, grads, strict=True):
            assert torch.equal(g0, g), mode
    # Hand-computed lower bound on what "selective" drops: the tuner's 3F per routed copy
    # (gate, up, activation) over B*S*k routed rows per MoE layer, and 3F per token of the
    # shared expert and the dense layer.
    cfg = m.cfg
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    ffn_elems = n_moe * B * S * (cfg.top_k * 3 * cfg.moe_ffn_dim + 3 * cfg.shared_ffn_dim)
    ffn_elems += (cfg.n_layers - n_moe) * B * S * 3 * cfg.dense_ffn_dim
    assert held["none"] - held["selective"] >= 4 * ffn_elems
    assert held["full"] < held["selective"] < held["none"]


@pytest.mark.integration
def test_full_keeps_only_block_inputs():
    m = _model()
    set_checkpointing(m, "full")
    h = torch.randn(B, S, m.cfg.d_model, requires_grad=True)
    meter = SavedTensorMeter(m)
    with meter:
        x = h * 1.0  # a non-leaf input, as the embedding output is in training
        for block in m.layers:
            x = block(x)
        # one [B, S, D] fp32 input per block, nothing else
        assert meter.live == m.cfg.n_layers * B * S * m.cfg.d_model * 4
        x.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_selective_experts_keep_only_their_input():
    E, D, F, M = 4, 16, 24, 19
    ex = GroupedExperts(E, D, F)
    torch.nn.init.normal_(ex.w1)
    torch.nn.init.normal_(ex.w2)
    torch.nn.init.normal_(ex.w3)
    ex.recompute_inner = True
    x = torch.randn(M, D, requires_grad=True)
    counts = torch.tensor([5, 0, 9, 5])
    meter = SavedTensorMeter(ex)
    with meter:
        y = ex(x * 1.0, counts)
        assert meter.live == M * D * 4 + E * 4  # the input rows and the int32 expert offsets
        y.square().sum().backward()
    g_ck = x.grad.clone()
    x.grad = None
    ex.recompute_inner = False
    ex(x * 1.0, counts).square().sum().backward()
    assert torch.equal(g_ck, x.grad)


def test_eval_does_not_checkpoint_and_bad_mode():
    m = _model()
    set_checkpointing(m, "full")
    tok = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        a = m(tok)
    set_checkpointing(m, "none")
    with torch.no_grad():
        b = m(tok)
    assert torch.equal(a, b)
    assert CHECKPOINTING == ("none", "selective", "full")
    with pytest.raises(ValueError, match=r"checkpointing='some'; valid: none, selective, full"):
        set_checkpointing(m, "some")
