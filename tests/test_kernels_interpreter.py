"""Runs the Triton kernels on CPU through the Triton interpreter, in subprocesses.

Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET=1 has
to be set before ``piper_kernels`` launches anything; a separate process keeps that setting out of
every other test module. Two children:

- test_kernels_triton.py with one pinned launch config (PIPER_KERNELS_PIN_CONFIG=1): every op,
  odd shapes, fast.
- this module again, running its ``child`` tests: the configs ``pick()`` returns for the GPU
  targets (sm80, sm90, gfx90a, gfx942; passed to the kernels explicitly through
  ``grouped_gemm(configs=...)``) on shapes with more than GROUP_M M-tiles in one expert, so the
  forward kernel's grouped tile order runs full and partial groups, with skewed counts,
  zero-row experts and rows owned by no expert; forward, dX and dW against per-expert torch
  matmuls. The slow tier adds every autotune candidate of every target.

Legend: M token-sorted rows, K in features, N out features, E experts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.interpreter

ROOT = Path(__file__).resolve().parents[1]
IN_CHILD = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _child(target: str, marker: str, pin: bool, extra: list[str] = ()) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PIPER_KERNELS_PIN_CONFIG="1" if pin else "0",
               CUDA_VISIBLE_DEVICES="")  # CPU tensors even on a GPU machine
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *extra,
         str(ROOT / "tests" / target)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"


@pytest.mark.skipif(IN_CHILD, reason="launcher; runs in the parent process")
def test_triton_kernels_under_interpreter() -> None:
    _child("test_kernels_triton.py", "interpreter", pin=True)


@pytest.mark.skipif(IN_CHILD, reason="launcher; runs in the parent process")
def test_picked_configs_under_interpreter() -> None:
    _child("test_kernels_interpreter.py", "interpreter and not slow", pin=False, extra=["-k", "child"])


@pytest.mark.slow
@pytest.mark.skipif(IN_CHILD, reason="launcher; runs in the parent process")
def test_autotune_candidates_under_interpreter() -> None:
    _child("test_kernels_interpreter.py", "interpreter and slow", pin=False, extra=["-k", "child"])


# ---- child tests: run only inside the interpreter subprocess --------------------------------

needs_child = pytest.mark.skipif(not IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child")

# Relative error max|a - b| / max|b|: both sides accumulate in fp32 from the same rounded
# inputs, so they differ by summation order (~1e-7 * sqrt(K) for fp32) plus the final rounding
# to the output dtype (2^-11 for fp16), with headroom for one extra ulp.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# The interpreter runs fp32 and fp16; fp16 has bf16's element size, so it takes the configs a
# bf16 launch gets on a GPU.
DTYPES = [torch.float32, torch.float16]

# (name, counts_E, tail rows owned by no expert, K, N). The big expert has 1300 rows: 11
# M-tiles at BLOCK_M=128 (one full GROUP_M=8 group and a partial group of 3) and 21 at 64;
# N and K leave partial N- and K-tiles; zeros sit between and at the ends.
CASES = [
    ("skewed", [1300, 0, 37, 0, 200], 5, 80, 200),
    ("narrow-n", [0, 1300, 3, 0], 0, 40, 48),  # N <= 64: the 64-wide N tiles
]
# E >= 64 switches to 64/32-row tiles (few rows per expert): 700 rows give 11 tiles of 64.
CASES_MANY = [("many-experts", [0] * 60 + [700, 0, 9, 1], 2, 40, 136)]
# Slow tier only: more rows, deeper K and wider N (several K- and N-tiles for every candidate).
CASES_SLOW = [("large", [3000, 0, 517, 64, 0, 0, 1, 900], 3, 160, 384)]


def _counts(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.long)


def _configs_for(case, dtype: torch.dtype, every_candidate: bool) -> list[dict]:
    """Distinct {op: config} sets the GPU targets would launch for this problem: pick()'s, or
    (``every_candidate``) every autotune candidate of every target, each at least once. The
    interpreter ignores num_warps and num_stages, so candidates that differ only there run once.
    """
    from piper_kernels.tuning import TARGETS, gemm_configs, pick

    _, counts, _, K, N = case
    E = len(counts)
    elem = torch.empty((), dtype=dtype).element_size()
    # (op, N, K) as each kernel sees them: dx runs on w^T (N and K swap).
    shapes = {"fwd": (N, K), "dx": (K, N), "dw": (N, K)}
    out = [{op: pick(op, dtype, n, k, E, torch.device("cpu"), target=t)
            for op, (n, k) in shapes.items()} for t in TARGETS]
    if every_candidate:
        tiles: dict[str, dict[tuple[int, int, int], object]] = {op: {} for op in shapes}
        for t in TARGETS:
            for op, (n, k) in shapes.items():
                for c in gemm_configs(op, n, k, E, elem, t):
                    tiles[op].setdefault((c.block_m, c.block_n, c.block_k), c)
        lists = {op: list(v.values()) for op, v in tiles.items()}
        out += [{op: lst[i % len(lst)] for op, lst in lists.items()}
                for i in range(max(len(v) for v in lists.values()))]
    distinct: list[dict] = []
    for s in out:
        if s not in distinct:
            distinct.append(s)
    return distinct


def _check_case(case, dtype: torch.dtype, configs: dict, full_groups: bool = True) -> None:
    from piper_kernels import grouped_gemm, offsets_from_counts, reference_grouped_gemm
    from piper_kernels.tuning import GROUP_M

    _, counts, tail, K, N = case
    counts_E = _counts(counts)
    E, M = len(counts), int(counts_E.sum()) + tail
    # The premise of the test: some expert spans more than GROUP_M row tiles of the fwd config.
    assert not full_groups or max(counts) > GROUP_M * configs["fwd"].block_m, (counts, configs)
    offs = offsets_from_counts(counts_E)
    g = torch.Generator().manual_seed(len(counts) * 1000 + K)
    x = torch.randn(M, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(E, K, N, generator=g) / K**0.5).to(dtype).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(dtype)
    y = grouped_gemm(x, w, offs, backend="triton", configs=configs)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    yr = reference_grouped_gemm(xr, wr, offs)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy)
    for name, a, b in (("y", y, yr), ("dx", dx, dxr), ("dw", dw, dwr)):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = b.float().abs().max().clamp_min(1e-6)
        err = ((a.float() - b.float()).abs().max() / scale).item()
        assert err <= TOL[dtype], f"{name}: relative error {err:.3g} > {TOL[dtype]} with {configs}"
    assert not y[M - tail:].any()  # rows owned by no expert stay zero
    for e in (i for i, c in enumerate(counts) if c == 0):
        assert not dw[e].any()  # experts without rows get a zero gradient


@needs_child
def test_child_pick_is_pinned_without_target() -> None:
    # Without target= the interpreter process gets the pinned 32x32 config: the tests below
    # must pass the GPU targets' configs explicitly, or they would test nothing new.
    from piper_kernels.tuning import PINNED, pick

    assert pick("fwd", torch.float32, 200, 80, 5, torch.device("cpu")) == PINNED
    assert all(c != PINNED for c in _configs_for(CASES[0], torch.float32, False)[0].values())


@needs_child
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES + CASES_MANY, ids=lambda c: c[0])
def test_child_picked_configs(case, dtype: torch.dtype) -> None:
    for configs in _configs_for(case, dtype, every_candidate=False):
        _check_case(case, dtype, configs)


@needs_child
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES + CASES_MANY + CASES_SLOW, ids=lambda c: c[0])
def test_child_autotune_candidates(case, dtype: torch.dtype) -> None:
    # Candidates with taller tiles than pick()'s may see fewer than GROUP_M tiles per expert.
    for configs in _configs_for(case, dtype, every_candidate=True):
        _check_case(case, dtype, configs, full_groups=False)
