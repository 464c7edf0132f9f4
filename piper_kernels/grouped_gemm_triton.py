"""Triton kernels behind ``piper_kernels.grouped_gemm`` (math and contract in ``grouped_gemm.py``).

Legend: M token-sorted rows, K in features, N out features, E experts.

Forward and dx share one persistent kernel: a grid of at most ``2 * num_SMs`` programs walks
the experts in order, reading the row offsets on the device (no host sync, so it runs inside
CUDA graphs and with token counts that change every step), and program ``pid`` takes every
``nprog``-th output tile. Only tiles that exist are visited, so skewed and zero counts cost
nothing extra. dx = dy @ w^T is the same kernel on a transposed view of w (strides swapped).

dw is a grouped reduction: one program per (expert, K-tile, N-tile) sums x^T dy over the
expert's rows in BLOCK_M chunks. Every output tile has exactly one owner, so no atomics and no
zero-initialisation are needed; experts without rows write zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from piper_kernels.tuning import GROUP_M, pick


@triton.jit
def gmm_kernel(
    x_ptr,  # [M, K] token-sorted rows
    w_ptr,  # [E, K, N] (any strides: dx passes w^T as a view)
    y_ptr,  # [M, N] output
    offs_ptr,  # [E] int32 cumulative row ends
    N, K, E,
    stride_xm, stride_xk,
    stride_we, stride_wk, stride_wn,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_base = 0  # global index of expert e's first tile
    start = 0  # first row of expert e
    w_base = w_ptr  # expert e's weights; advanced as a 64-bit pointer (E*K*N can pass 2**31)
    for e in range(E):
        end = tl.load(offs_ptr + e)
        tiles_m = tl.cdiv(end - start, BLOCK_M)
        n_tiles = tiles_m * tiles_n
        # Smallest t >= tile_base with t % nprog == pid (all operands non-negative).
        first = tile_base + (pid - tile_base % nprog + nprog) % nprog
        for t in range(first, tile_base + n_tiles, nprog):
            # Grouped order inside the expert: GROUP_M row-tiles sweep the N-tiles together,
            # so one wave of programs shares a few x row-blocks and a slice of w[e] in L2
            # instead of streaming all of w[e] (117 MB for Mixtral's w1) once per wave.
            local = t - tile_base
            first_m = (local // (GROUP_M * tiles_n)) * GROUP_M
            group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
            in_group = local % (GROUP_M * tiles_n)
            tm = first_m + in_group % group_rows
            tn = in_group // group_rows
            rows = start + tm * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < end
            col_ok = cols < N
            rows64 = rows.to(tl.int64)
            cols64 = cols.to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_base + ks[:, None] * stride_wk + cols64[None, :] * stride_wn,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            tl.store(y_ptr + rows64[:, None] * stride_ym + cols64[None, :] * stride_yn,
                     acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        tile_base += n_tiles
        start = end
        w_base += stride_we


@triton.jit
def gmm_dw_kernel(
    x_ptr,  # [M, K] token-sorted rows
    dy_ptr,  # [M, N] output gradient
    dw_ptr,  # [E, K, N] weight gradient
    offs_ptr,  # [E] int32 cumulative row ends
    N, K,
    stride_xm, stride_xk,
    stride_dym, stride_dyn,
    stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(N, BLOCK_N)
    e = pid // (tiles_k * tiles_n)
    rest = pid % (tiles_k * tiles_n)
    ks = (rest // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (rest % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    col_ok = cols < N
    end = tl.load(offs_ptr + e)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        rows64 = rows.to(tl.int64)
        # x^T tile [BLOCK_K, BLOCK_M] read straight from row-major x (no transposed copy).
        a = tl.load(x_ptr + rows64[None, :] * stride_xm + ks[:, None] * stride_xk,
                    mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        b = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :] * stride_dyn,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    tl.store(dw_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
             acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


@functools.cache
def _num_programs_cap(device: torch.device) -> int:
    # Two resident programs per SM hide the per-expert scalar walk. The interpreter runs
    # programs one after another and pays ~2 ms per interpreted expert step, so it gets 2: the
    # fewest that still exercise the tile striding between programs.
    if device.type != "cuda":
        return 2
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 follows torch's own switch, so fp32 grouped GEMMs round like fp32 torch.matmul
    # (exact fp32 by default; MI250X has no tf32 at all). 16-bit inputs are exact either way.
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def gmm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, *, op: str = "fwd",
        config=None) -> torch.Tensor:
    """y [M, N] = grouped x @ w; rows past offs[-1] zero (torch.zeros: one memset)."""
    M, K = x_MK.shape
    E, _, N = w_EKN.shape
    y = torch.zeros(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0 or E == 0:
        return y
    if K == 0:
        return y
    cfg = config or pick(op, x_MK.dtype, N, K, E, x_MK.device)
    # Upper bound on tiles without reading offs: each expert adds at most one partial M-tile.
    tiles = (triton.cdiv(M, cfg.block_m) + E) * triton.cdiv(N, cfg.block_n)
    grid = (min(tiles, _num_programs_cap(x_MK.device)),)
    gmm_kernel[grid](
        x_MK, w_EKN, y, offs_E, N, K, E,
        x_MK.stride(0), x_MK.stride(1),
        w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M,
        INPUT_PRECISION=_input_precision(x_MK.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def gmm_dx(dy_MN: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, *, config=None) -> torch.Tensor:
    """dx [M, K] = grouped dy @ w^T (the forward kernel on a transposed view)."""
    return gmm(dy_MN, w_EKN.transpose(1, 2), offs_E, op="dx", config=config)


def gmm_dw(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_E: torch.Tensor, *, config=None) -> torch.Tensor:
    """dw [E, K, N] = per-expert x^T dy; zero for experts without rows."""
    M, K = x_MK.shape
    N = dy_MN.shape[1]
    E = offs_E.shape[0]
    dw = torch.empty(E, K, N, dtype=x_MK.dtype, device=x_MK.device)
    if E == 0 or K == 0 or N == 0:
        return dw
    cfg = config or pick("dw", x_MK.dtype, N, K, E, x_MK.device)
    grid = (E * triton.cdiv(K, cfg.block_k) * triton.cdiv(N, cfg.block_n),)
    gmm_dw_kernel[grid](
        x_MK, dy_MN, dw, offs_E, N, K,
        x_MK.stride(0), x_MK.stride(1),
        dy_MN.stride(0), dy_MN.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        INPUT_PRECISION=_input_precision(x_MK.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dw
