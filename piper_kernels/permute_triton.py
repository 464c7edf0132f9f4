"""Triton kernels behind ``piper_kernels.permute`` / ``piper_kernels.unpermute`` (math in ``permute.py``).

Legend: T tokens, D model width, k top-k, S = T*k token copies in expert order.

All three kernels are gathers: one program per output row reads its source rows by index
and writes its own row, so results are deterministic and no atomics are needed. The index
arithmetic (a stable sort of expert ids) stays in torch; only row traffic runs here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from piper_kernels.backend import settings


@triton.jit
def gather_rows_kernel(
    x_ptr,  # [T, D] tokens
    idx_ptr,  # [S] int64 sorted2flat
    out_ptr,  # [S, D] expert-ordered copies
    D,
    stride_xt, stride_os,
    TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    src = tl.load(idx_ptr + s) // TOPK
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = cols < D
        row = tl.load(x_ptr + src * stride_xt + cols, mask=ok)
        tl.store(out_ptr + s * stride_os + cols, row, mask=ok)


@triton.jit
def combine_rows_kernel(
    y_ptr,  # [S, D] expert outputs in expert order
    w_ptr,  # [T, k] routing weights (ignored unless HAS_W)
    inv_ptr,  # [S] int64 flat2sorted
    out_ptr,  # [T, D]
    D,
    stride_ys, stride_ot,
    TOPK: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = cols < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            s = tl.load(inv_ptr + t * TOPK + j)
            row = tl.load(y_ptr + s * stride_ys + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_W:
                row = row * tl.load(w_ptr + t * TOPK + j).to(tl.float32)
            acc += row
        tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_rows_bwd_kernel(
    dout_ptr,  # [T, D] gradient of unpermute's output
    y_ptr,  # [S, D] expert outputs (for d topk_w)
    w_ptr,  # [T, k] routing weights
    inv_ptr,  # [S] int64 flat2sorted
    dy_ptr,  # [S, D] gradient wrt y_sorted
    dw_ptr,  # [T, k] gradient wrt topk_w
    D,
    stride_dot, stride_ys, stride_dys,
    TOPK: tl.constexpr, NEED_DW: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(TOPK):
        s = tl.load(inv_ptr + t * TOPK + j)
        wj = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = cols < D
            g = tl.load(dout_ptr + t * stride_dot + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dy_ptr + s * stride_dys + cols, (g * wj).to(dy_ptr.dtype.element_ty), mask=ok)
            if NEED_DW:
                yv = tl.load(y_ptr + s * stride_ys + cols, mask=ok, other=0.0).to(tl.float32)
                dot += g * yv
        if NEED_DW:
            tl.store(dw_ptr + t * TOPK + j, tl.sum(dot, axis=0).to(dw_ptr.dtype.element_ty))


def _block_d(D: int) -> int:
    # One program streams a whole row; 1024 elements per step keeps 4 warps busy with 16-byte
    # vector loads (bf16) without spilling. The interpreter pays per step, so it takes the row
    # in one go up to 4096.
    cap = 4096 if settings().interpret else 1024
    return max(16, min(triton.next_power_of_2(max(D, 1)), cap))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_rows(x_TD: torch.Tensor, sorted2flat_S: torch.Tensor, k: int) -> torch.Tensor:
    """x_sorted[s] = x[sorted2flat[s] // k]."""
    x_TD = _rows(x_TD)
    S, D = sorted2flat_S.shape[0], x_TD.shape[1]
    out = torch.empty(S, D, dtype=x_TD.dtype, device=x_TD.device)
    if S and D:
        gather_rows_kernel[(S,)](x_TD, sorted2flat_S, out, D, x_TD.stride(0), out.stride(0),
                                  TOPK=k, BLOCK_D=_block_d(D))
    return out


def combine_rows(
    y_SD: torch.Tensor, w_TK: torch.Tensor | None, flat2sorted_S: torch.Tensor, k: int
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[flat2sorted[t*k + j]] (w = 1 when None), fp32 accumulation."""
    y_SD = _rows(y_SD)
    S, D = y_SD.shape
    T = S // k
    out = torch.empty(T, D, dtype=y_SD.dtype, device=y_SD.device)
    if T and D:
        w = w_TK.contiguous() if w_TK is not None else y_SD  # dummy pointer when HAS_W=False
        combine_rows_kernel[(T,)](y_SD, w, flat2sorted_S, out, D, y_SD.stride(0), out.stride(0),
                                   TOPK=k, HAS_W=w_TK is not None, BLOCK_D=_block_d(D))
    return out


def combine_rows_bwd(
    dy_TD: torch.Tensor,
    y_SD: torch.Tensor,
    w_TK: torch.Tensor,
    sorted2flat_S: torch.Tensor,
    flat2sorted_S: torch.Tensor,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dy_sorted [S, D], dw [T, k]) for out = combine_rows(y, w)."""
    dy_TD, y_SD, w_TK = _rows(dy_TD), _rows(y_SD), w_TK.contiguous()
    T, k = w_TK.shape
    D = dy_TD.shape[1]
    dys = torch.empty(T * k, D, dtype=y_SD.dtype, device=y_SD.device)
    dw = torch.zeros(T, k, dtype=w_TK.dtype, device=w_TK.device) if need_dw else None
    if T and D:
        combine_rows_bwd_kernel[(T,)](
            dy_TD, y_SD, w_TK, flat2sorted_S, dys, dw if dw is not None else w_TK, D,
            dy_TD.stride(0), y_SD.stride(0), dys.stride(0),
            TOPK=k, NEED_DW=need_dw, BLOCK_D=_block_d(D),
        )
    return dys, dw
