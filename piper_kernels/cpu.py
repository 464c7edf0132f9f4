"""CPU (plain torch) implementations behind grouped_gemm / permute / unpermute.

Legend: M token-sorted rows, K in features, N out features, E experts, T tokens, D width,
k top-k, S = T*k.

Which grouped GEMM, by measurement: the candidates of ``benchmarks/bench_grouped_gemm.py
--allow-cpu`` (which reruns them on preset shapes), timed round-robin, median of 3-5, fp32,
torch 2.13 CPU, 1 thread, on a shared 2-core machine whose load average was 10-20, so
differences under ~30 % are noise (milliseconds):

    problem (M, K, N, E, routing)      loop   _grouped_mm   padded bmm   dense [M,K]@[K,N]
    12288, 1024,  512,  64, balanced   578      735            971          654   ms (fwd)
    12288, 1024,  512,  64, zipf 1.2   685      621          13809          578
     8192,  256,  128, 256, balanced    36       37             39           28
     8192,  256,  128, 256, zipf 1.2    71       74           6607           65
     4096, 1024, 3584,   8, balanced  2913     4302           5141         3839
    dw (x^T dy) 12288/1024/512/64 bal 1121     1055              -            -
    dw          8192/256/128/256 zipf   99      174              -            -

- padded bmm (scatter rows into [E, max_count, K], one bmm) loses everywhere and collapses
  under skew: padding multiplies the work by E * max_count / M (20-90x slower above).
- torch._grouped_mm (a C++ loop over groups) ties with the Python loop within noise: at
  E=256 the per-expert Python overhead (~10 us) is small next to even 32-row GEMMs. It also
  needs 16-byte-aligned strides (K, N multiples of 4 in fp32) and leaves rows past offs[-1]
  undefined, so it would need a fallback and a fix-up anyway.
- So the CPU path is the per-expert loop of ``torch.mm(..., out=slice)``: no padding, no
  copies (the output slices are written in place; dx reads w^T as a view), empty experts cost
  nothing, any alignment. Under heavy oversubscription multi-threaded MKL calls get slow per
  call (OpenMP barriers meet preempted threads), worst for many small calls (E=64, 256).
- What remains above a dense GEMM of equal FLOPs is mostly dw's size: E times a dense
  weight's gradient, freshly allocated each step. At E=64, K=1024, N=512 the loop's dw takes
  0.21 s (1 thread, CPU time) of which ~0.06 s is first-touch page faults of the new 134 MB
  tensor; written into a reused buffer it takes 0.15 s, the dense x^T dy's 0.14 s.
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
