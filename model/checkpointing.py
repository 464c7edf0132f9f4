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

Recomputation uses torch's non-reentrant checkpoint, which works with `torch.autograd.grad`
(the pipeline's split backward for zero-bubble schedules) and with tensors that leave the
region by a side path (the MoE layer's auxiliary loss). A recomputed MoE forward repeats its
all-to-all; every EP rank recomputes the same layers in the same order, so the collectives
still match across ranks.

Side effects of a forward that must not happen twice (counting routed tokens for the balance
monitor) check `is_recomputing()`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CHECKPOINTING", "set_checkpointing", "is_recomputing", "recompute"]

CHECKPOINTING = ("none", "selective", "full")

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed in the backward."""
    return getattr(_state, "depth", 0) > 0


class _Recomputing:
    """Marks a recompute. Reusable: a split backward (zero-bubble B then W) recomputes the
    same region twice with the same context object."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1


def _contexts() -> tuple[contextlib.AbstractContextManager, _Recomputing]:
    return contextlib.nullcontext(), _Recomputing()


class _KeepInput(torch.autograd.Function):
    """Identity that saves its input for the backward. The checkpoint holds the region's input
    anyway (to recompute from it); saving it through autograd as well costs no memory (same
    storage) and makes it visible to saved-tensor observers such as the trainer's memory meter,
    which would otherwise see nothing of a checkpointed block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def recompute(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
    """`fn(x, *args)`, keeping only `x` (and `args`) for the backward when autograd records;
    a plain call otherwise (evaluation, no_grad)."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return fn(x, *args)
    x = _KeepInput.apply(x)
    return checkpoint(fn, x, *args, use_reentrant=False, context_fn=_contexts)


def set_checkpointing(model: nn.Module, mode: str) -> None:
    """Switch every decoder block and FFN of `model` (a MoETransformer or any module holding
    its blocks) to checkpointing `mode`. Parameters and their names do not change, so
    checkpoints and optimizer state are unaffected."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"checkpointing={mode!r}; valid: {', '.join(CHECKPOINTING)}")
    from .moe import GroupedExperts, SwiGLU
    from .transformer import Block

    for m in model.modules():
        if isinstance(m, Block):
            m.recompute_block = mode == "full"
        elif isinstance(m, (SwiGLU, GroupedExperts)):
            m.recompute_inner = mode == "selective"
