"""Ahead-of-time compile of every Triton kernel for NVIDIA Hopper and AMD MI250X, on CPU.

No GPU needed: ``triton.compile`` lowers the kernels through TTIR/TTGIR/LLVM to PTX/cubin
(sm_90) and AMDGCN (gfx90a) with the toolchains bundled in the triton wheel. This catches
compile-mode errors (types of loop-carried values, dynamic loop steps, dot precisions) that the
interpreter does not, before the scarce GPU run. Signatures mimic what the JIT specialises at a
real launch: unit strides become constants, pointers and large sizes are 16-divisible.
Slow (tens of seconds per GEMM kernel on a 2-core machine): marked ``slow``.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import _grouped_gemm_triton as G  # noqa: E402
from kernels import _permute_triton as P  # noqa: E402

pytestmark = pytest.mark.slow

TARGETS = {"sm90": GPUTarget("cuda", 90, 32), "gfx90a": GPUTarget("hip", "gfx90a", 64)}


def _compile(fn, sig: dict[str, str], const: dict, target: GPUTarget, warps: int, stages: int):
    names = list(sig)
    div16 = [["tt.divisibility", 16]]
    attrs = {(names.index(n),): div16 for n, t in sig.items()
             if t.startswith("*") or (t == "i32" and n.startswith(("N", "K", "D", "stride")))}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=target,
                          options={"num_warps": warps, "num_stages": stages})


def _gemm_sig(dt: str) -> dict[str, str]:
    return {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "y_ptr": f"*{dt}", "offs_ptr": "*i32",
            "N": "i32", "K": "i32", "E": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
            "stride_we": "i32", "stride_wk": "i32", "stride_wn": "constexpr", "stride_ym": "i32",
            "stride_yn": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "INPUT_PRECISION": "constexpr"}


def _dw_sig(dt: str) -> dict[str, str]:
    return {"x_ptr": f"*{dt}", "dy_ptr": f"*{dt}", "dw_ptr": f"*{dt}", "offs_ptr": "*i32",
            "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
            "stride_dym": "i32", "stride_dyn": "constexpr", "stride_we": "i32",
            "stride_wk": "i32", "stride_wn": "constexpr", "BLOCK_M": "constexpr",
            "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "INPUT_PRECISION": "constexpr"}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_grouped_gemm_kernels_compile(target: str, dt: str) -> None:
    bk = 64 if dt == "bf16" else 32
    k = _compile(G._gmm_kernel, _gemm_sig(dt),
                 {"stride_xk": 1, "stride_wn": 1, "stride_yn": 1, "BLOCK_M": 128, "BLOCK_N": 128,
                  "BLOCK_K": bk, "GROUP_M": 8, "INPUT_PRECISION": "ieee"},
                 TARGETS[target], warps=8, stages=3)
    if target == "sm90":
        # Software pipelining engaged: shared memory holds more than one stage of A and B.
        one_stage = (128 * bk + bk * 128) * (2 if dt == "bf16" else 4)
        assert k.metadata.shared > one_stage
    _compile(G._gmm_dw_kernel, _dw_sig(dt),
             {"stride_xk": 1, "stride_dyn": 1, "stride_wn": 1, "BLOCK_M": 64, "BLOCK_N": 128,
              "BLOCK_K": 128 if dt == "bf16" else 64, "INPUT_PRECISION": "ieee"},
             TARGETS[target], warps=8, stages=3)


@pytest.mark.parametrize("target", list(TARGETS))
def test_permute_kernels_compile(target: str) -> None:
    dt, tgt = "bf16", TARGETS[target]
    _compile(P._gather_rows_kernel,
             {"x_ptr": f"*{dt}", "idx_ptr": "*i64", "out_ptr": f"*{dt}", "D": "i32",
              "stride_xt": "i32", "stride_os": "i32", "TOPK": "constexpr", "BLOCK_D": "constexpr"},
             {"TOPK": 8, "BLOCK_D": 1024}, tgt, warps=4, stages=1)
    _compile(P._combine_rows_kernel,
             {"y_ptr": f"*{dt}", "w_ptr": "*fp32", "inv_ptr": "*i64", "out_ptr": f"*{dt}",
              "D": "i32", "stride_ys": "i32", "stride_ot": "i32", "TOPK": "constexpr",
              "HAS_W": "constexpr", "BLOCK_D": "constexpr"},
             {"TOPK": 8, "HAS_W": True, "BLOCK_D": 1024}, tgt, warps=4, stages=1)
    _compile(P._combine_rows_bwd_kernel,
             {"dout_ptr": f"*{dt}", "y_ptr": f"*{dt}", "w_ptr": "*fp32", "inv_ptr": "*i64",
              "dy_ptr": f"*{dt}", "dw_ptr": "*fp32", "D": "i32", "stride_dot": "i32",
              "stride_ys": "i32", "stride_dys": "i32", "TOPK": "constexpr",
              "NEED_DW": "constexpr", "BLOCK_D": "constexpr"},
             {"TOPK": 6, "NEED_DW": True, "BLOCK_D": 1024}, tgt, warps=4, stages=1)
