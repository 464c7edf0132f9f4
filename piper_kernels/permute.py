"""Token permutation for top-k routing: gather rows into expert order, scatter back weighted.

Math, with flat copy index p = t*k + j (token t, routing slot j) and a stable sort of the
T*k expert ids (ties kept in (token, slot) order):

    sorted2flat[s] = p    such that topk_idx.flat[sorted2flat] is non-decreasing
    x_sorted[s]    = x[sorted2flat[s] // k]                           (permute)
    y[t]           = sum_j topk_w[t, j] * y_sorted[flat2sorted[t*k+j]]   (unpermute)

Gradients are gathers too (sorted2flat is a bijection), so no atomics are needed anywhere:

    dx[t]          = sum_j dx_sorted[flat2sorted[t*k+j]]
    dy_sorted[s]   = topk_w.flat[p] * dy[p // k],  p = sorted2flat[s]
    dtopk_w[t, j]  = <dy[t], y_sorted[flat2sorted[t*k+j]]>

Shape legend: T tokens, D model width, K top-k (called k in formulas), E experts,
S = T*k token copies in expert order.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from piper_kernels.backend import resolve_backend

__all__ = ["PermuteMeta", "permute", "unpermute", "reference_permute", "reference_unpermute"]


@dataclass(frozen=True)
class PermuteMeta:
    """What ``unpermute`` needs to undo ``permute``; all tensors on the input's device."""

    topk_idx_TK: torch.Tensor  # [T, k] int64 expert of each copy (kept for the reference path)
    sorted2flat_S: torch.Tensor  # [T*k] int64, expert-order position -> t*k + j
    flat2sorted_S: torch.Tensor  # [T*k] int64, inverse permutation
    counts_E: torch.Tensor  # [E] int64 rows per expert
    offs_E: torch.Tensor  # [E] int32 cumulative row ends, the grouped_gemm ``offs``
    num_experts: int

    @property
    def num_tokens(self) -> int:
        return self.topk_idx_TK.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_idx_TK.shape[1]


def reference_permute(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, PermuteMeta]:
    """Plain-torch permute: for each expert, its (token, slot) copies in row-major order."""
    T, k = topk_idx_TK.shape
    rows, flat, counts = [], [], []
    for e in range(num_experts):
        t, j = (topk_idx_TK == e).nonzero(as_tuple=True)  # row-major: sorted by (t, j)
        rows.append(x_TD[t])
        flat.append(t * k + j)
        counts.append(t.numel())
    sorted2flat = torch.cat(flat) if flat else topk_idx_TK.new_zeros(0)
    flat2sorted = torch.empty_like(sorted2flat)
    flat2sorted[sorted2flat] = torch.arange(sorted2flat.numel(), device=sorted2flat.device)
    counts_E = torch.tensor(counts, dtype=torch.int64, device=x_TD.device)
    meta = PermuteMeta(
        topk_idx_TK.long(), sorted2flat, flat2sorted, counts_E,
        torch.cumsum(counts_E, 0, dtype=torch.int32), num_experts,
    )
    x_sorted = torch.cat(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])
    return x_sorted, counts_E, meta


def reference_unpermute(y_SD: torch.Tensor, topk_w_TK: torch.Tensor, meta: PermuteMeta) -> torch.Tensor:
    """Plain-torch unpermute: per expert, add each copy times its routing weight to its token."""
    T, k = meta.topk_idx_TK.shape
    acc = torch.promote_types(y_SD.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)
    out = torch.zeros(T, y_SD.shape[1], dtype=acc, device=y_SD.device)
    start = 0
    for e in range(meta.num_experts):
        t, j = (meta.topk_idx_TK == e).nonzero(as_tuple=True)
        n = t.numel()
        out = out.index_add(0, t, y_SD[start:start + n].to(acc) * topk_w_TK[t, j, None].to(acc))
        start += n
    return out.to(y_SD.dtype)


def _check_permute(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int) -> None:
    if x_TD.dim() != 2 or topk_idx_TK.dim() != 2 or x_TD.shape[0] != topk_idx_TK.shape[0]:
        raise ValueError(
            f"permute expects x [T, D] and topk_idx [T, k] with the same T; got x "
            f"{tuple(x_TD.shape)}, topk_idx {tuple(topk_idx_TK.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    if topk_idx_TK.dtype.is_floating_point or topk_idx_TK.dtype == torch.bool:
        raise ValueError(f"topk_idx must be an integer tensor, got {topk_idx_TK.dtype}")
    if topk_idx_TK.device.type == "cpu" and topk_idx_TK.numel() > 0:
        lo, hi = int(topk_idx_TK.min()), int(topk_idx_TK.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"topk_idx values must lie in [0, {num_experts - 1}] for num_experts={num_experts}; "
                f"got min {lo}, max {hi}"
            )


def _make_meta(topk_idx_TK: torch.Tensor, num_experts: int) -> PermuteMeta:
    flat = topk_idx_TK.reshape(-1).long()
    sorted2flat = torch.sort(flat, stable=True).indices
    flat2sorted = torch.empty_like(sorted2flat)
    flat2sorted[sorted2flat] = torch.arange(flat.numel(), device=flat.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return PermuteMeta(
        topk_idx_TK.long(), sorted2flat, flat2sorted, counts,
        torch.cumsum(counts, 0, dtype=torch.int32), num_experts,
    )


def _impl(backend: str) -> ModuleType:
    """The module with gather_rows / combine_rows / combine_rows_bwd (imported on use: the
    Triton one needs triton)."""
    if backend == "triton":
        from piper_kernels import permute_triton
        return permute_triton
    from piper_kernels import cpu
    return cpu


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, sorted2flat_S: torch.Tensor,
                flat2sorted_S: torch.Tensor, k: int, backend: str) -> torch.Tensor:
        ctx.save_for_backward(flat2sorted_S)
        ctx.k, ctx.backend = k, backend
        return _impl(backend).gather_rows(x_TD, sorted2flat_S, k)

    @staticmethod
    def backward(ctx: Any, dxs_SD: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (flat2sorted_S,) = ctx.saved_tensors
        dx = _impl(ctx.backend).combine_rows(dxs_SD.contiguous(), None, flat2sorted_S, ctx.k)
        return dx, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_SD: torch.Tensor, topk_w_TK: torch.Tensor,
                sorted2flat_S: torch.Tensor, flat2sorted_S: torch.Tensor,
                backend: str) -> torch.Tensor:
        ctx.save_for_backward(y_SD, topk_w_TK, sorted2flat_S, flat2sorted_S)
        ctx.backend = backend
        return _impl(backend).combine_rows(y_SD, topk_w_TK, flat2sorted_S, topk_w_TK.shape[1])

    @staticmethod
    def backward(ctx: Any, dy_TD: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:
        y_SD, topk_w_TK, sorted2flat_S, flat2sorted_S = ctx.saved_tensors
        dys, dw = _impl(ctx.backend).combine_rows_bwd(
            dy_TD.contiguous(), y_SD, topk_w_TK, sorted2flat_S, flat2sorted_S,
            need_dw=ctx.needs_input_grad[1],
        )
        return dys, dw, None, None, None


def permute(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, PermuteMeta]:
    """Group token copies by expert: (x_sorted [T*k, D], counts [E] int64, meta).

    Rows of one expert keep (token, slot) order. Differentiable in x.
    """
    _check_permute(x_TD, topk_idx_TK, num_experts)
    name = resolve_backend(x_TD.device, backend)
    if name == "reference":
        return reference_permute(x_TD, topk_idx_TK, num_experts)
    meta = _make_meta(topk_idx_TK, num_experts)
    x_sorted = _Permute.apply(x_TD, meta.sorted2flat_S, meta.flat2sorted_S, meta.top_k, name)
    return x_sorted, meta.counts_E, meta


def unpermute(
    y_SD: torch.Tensor, topk_w_TK: torch.Tensor, meta: PermuteMeta, *, backend: str | None = None
) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs back in token order: [T, D], y's dtype.

    Differentiable in y_sorted and topk_w.
    """
    T, k = meta.topk_idx_TK.shape
    if y_SD.dim() != 2 or y_SD.shape[0] != T * k:
        raise ValueError(f"y_sorted must be [T*k={T * k}, D], got {tuple(y_SD.shape)}")
    if tuple(topk_w_TK.shape) != (T, k):
        raise ValueError(f"topk_w must be [T={T}, k={k}], got {tuple(topk_w_TK.shape)}")
    name = resolve_backend(y_SD.device, backend)
    if name == "reference":
        return reference_unpermute(y_SD, topk_w_TK, meta)
    return _Unpermute.apply(y_SD, topk_w_TK, meta.sorted2flat_S, meta.flat2sorted_S, name)
