"""Activation checkpointing: keep fewer activations for the backward, recompute the rest.

Modes (the same names and meaning as `tuner.layout.CHECKPOINTING`, whose memory model they
implement):

    none       every op keeps what its backward needs.
    selective  the FFN intermediates (SwiGLU gate, up and activation of routed experts, shared
               experts and dense layers: 3F per routed copy) are dropped and recomputed from the
               FFN input in the backward. The attention core keeps nothing quadratic either way
               (scaled_dot_product_attention's fused kernels save q, k, v, output and the
               row log-sum-exp), so "selective" touches only the FFN here.
    full       a decoder block keeps only its input; the whole block (attention, routing, the
               MoE all-to-all, experts) runs again in the backward.

The recomputation itself (`recompute`, `is_recomputing`) lives in `model.recompute`, below the
layers that use it; this module only sets which layers use it.
"""

from __future__ import annotations

from torch import nn

from .moe import GroupedExperts, SwiGLU
from .transformer import Block

__all__ = ["CHECKPOINTING", "set_checkpointing"]

CHECKPOINTING = ("none", "selective", "full")


def set_checkpointing(model: nn.Module, mode: str) -> None:
    """Switch every decoder block and FFN of `model` (a MoETransformer or any module holding
    its blocks) to checkpointing `mode`. Parameters and their names do not change, so
    checkpoints and optimizer state are unaffected."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"checkpointing={mode!r}; valid: {', '.join(CHECKPOINTING)}")
    for m in model.modules():
        if isinstance(m, Block):
            m.recompute_block = mode == "full"
        elif isinstance(m, (SwiGLU, GroupedExperts)):
            m.recompute_inner = mode == "selective"
