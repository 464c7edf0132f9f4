"""Recomputation: run a region again in the backward instead of keeping its activations.

`recompute(fn, x, *args)` is the one mechanism behind activation checkpointing
(`model.checkpointing` chooses where it applies). It uses torch's non-reentrant checkpoint,
which works with `torch.autograd.grad` (the pipeline's split backward for zero-bubble
schedules) and with tensors that leave the region by a side path (the MoE layer's auxiliary
loss). A recomputed MoE forward repeats its all-to-all; every EP rank recomputes the same
layers in the same order, so the collectives still match across ranks.

Side effects of a forward that must not happen twice (counting routed tokens for the balance
monitor) check `is_recomputing()`.

This module imports no other module of `model`: the layers that recompute (`model.moe`,
`model.transformer`) import it, and `model.checkpointing` imports them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["is_recomputing", "recompute"]

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
