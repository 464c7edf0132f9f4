"""CPU path of piper_kernels/: grouped_gemm, permute, unpermute against the plain-torch references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piper_kernels
from piper_kernels import (
    grouped_gemm,
    permute,
    reference_grouped_gemm,
    reference_permute,
    reference_unpermute,
    unpermute,
)


def _counts(E: int, M: int, zero_every: int, gen: torch.Generator) -> torch.Tensor:
    """Random per-expert row counts summing to <= M, with every zero_every-th expert empty."""
    w = torch.rand(E, generator=gen)
    w[::zero_every] = 0.0
    if w.sum() == 0:
        w[-1] = 1.0
    c = torch.floor(w / w.sum() * M).long()
    return c


@pytest.mark.parametrize(
    "M,K,N,E",
    [(1, 1, 1, 1), (37, 19, 23, 5), (64, 32, 16, 4), (200, 24, 40, 256), (7, 8, 8, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_gemm_matches_reference(M: int, K: int, N: int, E: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(M * 1000 + E)
    counts = _counts(E, M, 3, gen)
    offs = piper_kernels.offsets_from_counts(counts)
    x = torch.randn(M, K, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(E, K, N, generator=gen, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, generator=gen, dtype=dtype)
    y = grouped_gemm(x, w, offs, backend="torch")
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = reference_grouped_gemm(x2, w2, offs)
    rx, rw = torch.autograd.grad(y2, (x2, w2), dy)
    # fp32: same MKL GEMM blocks but different call shapes -> reassociation only, ~1e-6 * sqrt(K).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gw, rw, **tol)
    # Rows past offs[-1] belong to no expert: zero output, zero gradient.
    end = int(offs[-1])
    assert torch.all(y[end:] == 0) and torch.all(gx[end:] == 0)


def test_grouped_gemm_gradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([2, 2, 9, 10], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b: grouped_gemm(a, b, offs, backend="torch"), (x, w))


def test_grouped_gemm_bad_input() -> None:
    x, w = torch.randn(8, 4), torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="int32"):
        grouped_gemm(x, w, torch.tensor([4, 8]))
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_gemm(x, w, torch.tensor([5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="K=5"):
        grouped_gemm(torch.randn(8, 5), w, torch.tensor([4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        grouped_gemm(x, w, torch.tensor([4, 8], dtype=torch.int32), backend="cuda")


@pytest.mark.parametrize("T,D,k,E", [(1, 1, 1, 1), (13, 7, 3, 5), (50, 16, 8, 256), (9, 4, 2, 64)])
def test_permute_unpermute_exact_and_grads(T: int, D: int, k: int, E: int) -> None:
    gen = torch.Generator().manual_seed(T + E)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] if k <= E else
                       torch.randint(0, E, (k,), generator=gen) for _ in range(T)])
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    tw = torch.rand(T, k, generator=gen, dtype=torch.float64, requires_grad=True)
    xs, counts, meta = permute(x, idx, E, backend="torch")
    rxs, rcounts, rmeta = reference_permute(x, idx, E)
    assert torch.equal(xs, rxs) and torch.equal(counts, rcounts)  # pure data movement: exact
    assert torch.equal(meta.sorted2flat_S, rmeta.sorted2flat_S)
    ys = xs * 3.0 + 1.0  # a stand-in "expert" so y_sorted depends on x
    out = unpermute(ys, tw, meta, backend="torch")
    ref = reference_unpermute(rxs * 3.0 + 1.0, tw, rmeta)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn(T, D, generator=gen, dtype=torch.float64)
    g = torch.autograd.grad(out, (x, tw), dy)
    r = torch.autograd.grad(ref, (x, tw), dy)
    for a, b in zip(g, r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_unpermute_gradcheck() -> None:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 4, (6, 3), generator=gen)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    tw = torch.rand(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        xs, _, meta = permute(a, idx, 4, backend="torch")
        return unpermute(xs.sin(), b, meta, backend="torch")

    assert torch.autograd.gradcheck(f, (x, tw))


def test_permute_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        permute(torch.randn(3, 2), torch.tensor([[0], [4], [1]]), 4)
    with pytest.raises(ValueError, match="same T"):
        permute(torch.randn(3, 2), torch.zeros(2, 1, dtype=torch.long), 4)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(0, 40), k=st.integers(1, 8), E=st.integers(1, 40), D=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_permute_properties(T: int, k: int, E: int, D: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (T, k), generator=gen)
    x = torch.randn(T, D, generator=gen)
    xs, counts, meta = permute(x, idx, E, backend="torch")
    # counts are the histogram; offsets are their running sum and end at T*k.
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))
    assert torch.equal(meta.offs_E.long(), torch.cumsum(counts, 0))
    assert int(counts.sum()) == T * k
    # Each expert's rows are exactly the copies routed to it, in (token, slot) order.
    start = 0
    for e in range(E):
        end = int(meta.offs_E[e])
        flat = meta.sorted2flat_S[start:end]
        assert torch.all(idx.reshape(-1)[flat] == e) and torch.all(flat.diff() > 0)
        start = end
    # Every copy delivered once; with unit weights / k the round trip returns x exactly
    # (k equal copies summed then scaled by 1/k is exact for k a power of two; compare allclose).
    assert torch.equal(torch.sort(meta.sorted2flat_S).values, torch.arange(T * k))
    back = unpermute(xs, torch.full((T, k), 1.0 / k), meta, backend="torch")
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)
    one_hot = unpermute(xs, (torch.arange(k) == 0).float().expand(T, k), meta, backend="torch")
    assert torch.equal(one_hot, x)  # weight 1 on slot 0, 0 elsewhere: exact copy


def test_grouped_gemm_backward_computes_only_what_the_pass_needs(monkeypatch) -> None:
    # A split backward (pipeline zero-bubble: input gradient first, weight gradient later)
    # must run the dx GEMMs in the first pass and the dw GEMMs in the second, not both twice;
    # a plain backward runs each once. Gradients equal the plain backward's.
    from piper_kernels import cpu as cpu_kernels

    calls = {"dx": 0, "dw": 0}
    real_dx, real_dw = cpu_kernels.gmm_dx, cpu_kernels.gmm_dw

    def count_dx(*a):
        calls["dx"] += 1
        return real_dx(*a)

    def count_dw(*a):
        calls["dw"] += 1
        return real_dw(*a)

    monkeypatch.setattr(cpu_kernels, "gmm_dx", count_dx)
    monkeypatch.setattr(cpu_kernels, "gmm_dw", count_dw)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(10, 6, generator=g)
    w = torch.randn(3, 6, 5, generator=g, requires_grad=True)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)

    x = (x0 * 1.0).requires_grad_()
    grouped_gemm(torch.tanh(x), w, offs, backend="torch").square().sum().backward()
    ref_dx, ref_dw = x.grad.clone(), w.grad.clone()
    assert calls == {"dx": 1, "dw": 1}

    calls.update(dx=0, dw=0)
    w.grad = None
    x = (x0 * 1.0).requires_grad_()
    loss = grouped_gemm(torch.tanh(x), w, offs, backend="torch").square().sum()
    (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    assert calls == {"dx": 1, "dw": 0}
    (dw,) = torch.autograd.grad(loss, [w])
    assert calls == {"dx": 1, "dw": 1}
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)
