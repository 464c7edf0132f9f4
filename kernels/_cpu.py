"""CPU (plain torch) implementations behind grouped_gemm / permute / unpermute.

Legend: M token-sorted rows, K in features, N out features, E experts, T tokens, D width,
k top-k, S = T*k.
"""

from __future__ import annotations

import torch


def gmm_loop(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y = x @ w[e] per expert row range; rows past offs[-1] zero."""
    M, N = x_MK.shape[0], w_EKN.shape[2]
    y = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            torch.mm(x_MK[start:end], w_EKN[e], out=y[start:end])
        start = end
    y[start:].zero_()
    return y


def gmm_dx(dy_MN: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """dx = dy @ w[e]^T per expert row range."""
    return gmm(dy_MN, w_EKN.transpose(1, 2), offs_E)



def gmm_dw_loop(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """dw[e] = x[rows e]^T @ dy[rows e]; zero for experts without rows."""
    E, K, N = offs_E.shape[0], x_MK.shape[1], dy_MN.shape[1]
    dw = torch.empty(E, K, N, dtype=x_MK.dtype, device=x_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            torch.mm(x_MK[start:end].t(), dy_MN[start:end], out=dw[e])
        else:
            dw[e].zero_()
        start = end
    return dw


gmm = gmm_loop
gmm_dw = gmm_dw_loop


def gather_rows(x_TD: torch.Tensor, sorted2flat_S: torch.Tensor, k: int) -> torch.Tensor:
    """x_sorted[s] = x[sorted2flat[s] // k]."""
    return x_TD.index_select(0, torch.div(sorted2flat_S, k, rounding_mode="floor"))


def combine_rows(
    y_SD: torch.Tensor, w_TK: torch.Tensor | None, flat2sorted_S: torch.Tensor, k: int
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[flat2sorted[t*k + j]] (w = 1 when None)."""
    S, D = y_SD.shape
    copies = y_SD.index_select(0, flat2sorted_S).view(S // k, k, D)
    if w_TK is None:
        return copies.sum(1)
    # [T, 1, k] @ [T, k, D]: one batched GEMV, accumulates in fp32 inside MKL for fp32 inputs.
    return torch.bmm(w_TK.to(y_SD.dtype).unsqueeze(1), copies).squeeze(1)


def combine_rows_bwd(
    dy_TD: torch.Tensor,
    y_SD: torch.Tensor,
    w_TK: torch.Tensor,
    sorted2flat_S: torch.Tensor,
    flat2sorted_S: torch.Tensor,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dy_sorted [S, D], dw [T, k]) for out = combine_rows(y, w)."""
    T, k = w_TK.shape
    tok = torch.div(sorted2flat_S, k, rounding_mode="floor")
    w_s = w_TK.reshape(-1).index_select(0, sorted2flat_S).to(dy_TD.dtype)
    dys = dy_TD.index_select(0, tok) * w_s.unsqueeze(1)
    dw = None
    if need_dw:
        copies = y_SD.index_select(0, flat2sorted_S).view(T, k, -1)
        dw = torch.bmm(copies, dy_TD.unsqueeze(2)).squeeze(2).to(w_TK.dtype)
    return dys, dw
