"""Triton kernels of piper_kernels/ against the plain-torch references, every output and gradient.

Runs where Triton can run: compiled on a CUDA/ROCm GPU (marker ``gpu``; fp16 and bf16, larger
shapes) or on CPU tensors under ``TRITON_INTERPRET=1`` (marker ``interpreter``; fp32 and fp16,
tiny shapes, pinned config). Otherwise the module skips: the default CPU run reaches it through
``test_kernels_interpreter.py``, which starts a subprocess with the interpreter switched on so
the setting never leaks into other test modules.
"""

from __future__ import annotations

import os

import pytest
import torch

from piper_kernels import (
    grouped_gemm,
    offsets_from_counts,
    permute,
    reference_grouped_gemm,
    reference_permute,
    reference_unpermute,
    unpermute,
)

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not (ON_GPU or INTERPRET):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1 (see test_kernels_interpreter.py)",
                allow_module_level=True)
pytestmark = [pytest.mark.gpu] if ON_GPU else [pytest.mark.interpreter]
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter runs fp32/fp16 only; bf16 is what training uses on GPUs.
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]

# Tolerance on max|a - b| / max|b| (error relative to the tensor's scale, robust to
# cancellation near zero). Both sides accumulate in fp32 from the same rounded inputs, so
# they differ by summation order (~1e-7 * sqrt(K) in fp32) plus the final rounding to the
# output dtype: 2^-11 (fp16) and 2^-8 (bf16) relative, with headroom for one extra ulp.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    scale = b.float().abs().max().clamp_min(1e-6)
    err = ((a.float() - b.float()).abs().max() / scale).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]} for {dtype}"


# (M, K, N, E, counts rule). Odd sizes, K below one tile, a single expert with everything,
# experts with zero rows, trailing rows owned by no expert, E = 256 with most experts empty.
GEMM_SHAPES = [
    (1, 16, 16, 1, "all"),
    (37, 19, 23, 5, "zeros"),
    (64, 40, 48, 4, "one"),
    (30, 8, 9, 3, "tail"),
    (90, 24, 20, 256, "random"),
]
if ON_GPU:
    GEMM_SHAPES += [(4096, 1024, 512, 8, "random"), (3000, 512, 768, 64, "zeros")]


def _gemm_counts(M: int, E: int, rule: str, gen: torch.Generator) -> torch.Tensor:
    if rule == "all":
        return torch.full((E,), M // E, dtype=torch.long)
    if rule == "one":
        c = torch.zeros(E, dtype=torch.long)
        c[E // 2] = M
        return c
    if rule == "tail":  # leave 5 rows past offs[-1]
        return torch.bincount(torch.randint(0, E, (M - 5,), generator=gen), minlength=E)
    c = torch.bincount(torch.randint(0, E, (M,), generator=gen), minlength=E)
    if rule == "zeros":
        c[1::2] = 0
    return c


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,E,rule", GEMM_SHAPES)
def test_grouped_gemm_triton(M: int, K: int, N: int, E: int, rule: str, dtype: torch.dtype) -> None:
    if E == 256 and dtype != DTYPES[0] and not ON_GPU:
        pytest.skip("E=256 under the interpreter: one dtype keeps the run short")
    gen = torch.Generator().manual_seed(M + 7 * E)
    offs = offsets_from_counts(_gemm_counts(M, E, rule, gen)).to(DEVICE)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(E, K, N, generator=gen) / K**0.5).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(M, N, generator=gen).to(DEVICE, dtype)
    y = grouped_gemm(x, w, offs, backend="triton")
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    y_ref = reference_grouped_gemm(x, w, offs)
    rx, rw = torch.autograd.grad(y_ref, (x, w), dy)
    _close(y, y_ref, dtype)
    _close(gx, rx, dtype)
    _close(gw, rw, dtype)
    end = int(offs[-1])
    assert torch.all(y[end:] == 0) and torch.all(gx[end:] == 0)


# (T, D, k, E): single token, odd widths, k = 8 over E = 256, more slots than experts.
PERMUTE_SHAPES = [(1, 1, 1, 1), (13, 7, 3, 5), (12, 33, 8, 256), (10, 20, 4, 2)]
if ON_GPU:
    PERMUTE_SHAPES += [(4096, 7168, 8, 256), (2048, 1024, 2, 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,D,k,E", PERMUTE_SHAPES)
def test_permute_unpermute_triton(T: int, D: int, k: int, E: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(T * 3 + E)
    idx = torch.randint(0, E, (T, k), generator=gen).to(DEVICE)
    x = torch.randn(T, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    # Routing weights stay fp32 (as routers produce them) while activations are low precision.
    tw = torch.rand(T, k, generator=gen).to(DEVICE).requires_grad_()
    xs, counts, meta = permute(x, idx, E, backend="triton")
    xs_ref, counts_ref, meta_ref = reference_permute(x, idx, E)
    assert torch.equal(xs, xs_ref) and torch.equal(counts, counts_ref)  # data movement: exact
    ys = xs * 2.0 + 1.0  # any function of x_sorted, so the x gradient flows through both ops
    out = unpermute(ys, tw, meta, backend="triton")
    ref = reference_unpermute(xs_ref * 2.0 + 1.0, tw, meta_ref)
    _close(out, ref, dtype)
    dy = torch.randn(T, D, generator=gen).to(DEVICE, dtype)
    gx, gw = torch.autograd.grad(out, (x, tw), dy)
    rx, rw = torch.autograd.grad(ref, (x, tw), dy)
    _close(gx, rx, dtype)
    assert gw.dtype == torch.float32
    # d topk_w is a length-D dot product of low-precision rows accumulated in fp32 on both
    # sides; the reference rounds y to `dtype` first, exactly as the kernel reads it.
    _close(gw, rw, dtype)
