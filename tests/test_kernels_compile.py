"""Ahead-of-time compile of every Triton kernel for NVIDIA A100/H100 and AMD MI250X/MI300X, on
CPU, and the shared-memory (LDS) model of ``piper_kernels.tuning`` checked against the compiler.

No GPU needed: ``triton.compile`` lowers the kernels through TTIR/TTGIR/LLVM to PTX/cubin
(sm_80, sm_90) and AMDGCN (gfx90a, gfx942) with the toolchains bundled in the triton wheel.
This catches compile-mode errors (types of loop-carried values, dynamic loop steps, dot
precisions) that the interpreter does not, before the scarce GPU run, and it reads the shared
memory each compiled kernel needs (``metadata.shared``, what Triton's launcher compares with
the device's limit). Signatures mimic what the JIT specialises at a real launch: unit strides
become constants, pointers and 16-divisible sizes and strides carry the divisibility hint.

The GEMM test compiles every config that ``pick()`` or the autotune candidates
(``gemm_configs``) can return for the presets' expert shapes on each target (a few hundred
kernels, 1-5 s each on a 2-core machine): marked ``slow``. ``PIPER_SMEM_REPORT=path`` appends
one JSON line per compiled kernel (the table in docs/kernels.md).
"""

from __future__ import annotations

import json
import os

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from model import presets  # noqa: E402
from piper_kernels import grouped_gemm_triton as G  # noqa: E402
from piper_kernels import permute_triton as P  # noqa: E402
from piper_kernels.autotune import problems  # noqa: E402
from piper_kernels.tuning import GROUP_M, OPS, TARGETS, GemmConfig, gemm_configs  # noqa: E402

pytestmark = pytest.mark.slow

GPU_TARGETS = {name: GPUTarget(t.backend, t.arch, t.warp_size) for name, t in TARGETS.items()}
DTYPES = {"bf16": 2, "fp32": 4}
# The model must land within this fraction of the compiled kernel's bytes ("a few per cent";
# every config measured so far matches exactly).
REL_TOL = 0.03


def _compile(fn, sig: dict[str, str], const: dict, target: GPUTarget, warps: int, stages: int):
    names = list(sig)
    div16 = [["tt.divisibility", 16]]
    attrs = {(names.index(n),): div16 for n, t in sig.items()
             if t.startswith("*") or (t == "i32" and n.startswith(("N", "K", "D", "stride")))}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=target,
                          options={"num_warps": warps, "num_stages": stages})


def _gemm_sig(dt: str, op: str) -> tuple[dict[str, str], dict[str, object]]:
    """Forward kernel signature; dx launches it on w^T, so w's unit stride moves from n to k."""
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "y_ptr": f"*{dt}", "offs_ptr": "*i32",
           "N": "i32", "K": "i32", "E": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
           "stride_we": "i32", "stride_wk": "i32", "stride_wn": "constexpr", "stride_ym": "i32",
           "stride_yn": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "INPUT_PRECISION": "constexpr"}
    const: dict[str, object] = {"stride_xk": 1, "stride_wn": 1, "stride_yn": 1, "GROUP_M": GROUP_M}
    if op == "dx":
        sig["stride_wk"], sig["stride_wn"] = "constexpr", "i32"
        del const["stride_wn"]
        const["stride_wk"] = 1
    return sig, const


def _dw_sig(dt: str) -> tuple[dict[str, str], dict[str, object]]:
    return ({"x_ptr": f"*{dt}", "dy_ptr": f"*{dt}", "dw_ptr": f"*{dt}", "offs_ptr": "*i32",
             "N": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "constexpr",
             "stride_dym": "i32", "stride_dyn": "constexpr", "stride_we": "i32",
             "stride_wk": "i32", "stride_wn": "constexpr", "BLOCK_M": "constexpr",
             "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "INPUT_PRECISION": "constexpr"},
            {"stride_xk": 1, "stride_dyn": 1, "stride_wn": 1})


def compile_gemm(op: str, dt: str, cfg: GemmConfig, target: str, precision: str = "ieee"):
    """The compiled grouped-GEMM kernel ``op`` runs with ``cfg`` on ``target``."""
    fn = G.gmm_dw_kernel if op == "dw" else G.gmm_kernel
    sig, const = _dw_sig(dt) if op == "dw" else _gemm_sig(dt, op)
    const = dict(const, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 INPUT_PRECISION=precision)
    return _compile(fn, sig, const, GPU_TARGETS[target], cfg.num_warps, cfg.num_stages)


def reachable_configs(op: str, elem_bytes: int, target: str) -> list[GemmConfig]:
    """Every config pick() (the default) or the autotune list can return for ``op`` on
    ``target``, over the presets' distinct expert shapes."""
    seen: dict[GemmConfig, None] = {}
    for name in presets.names():
        m = presets.get(name)
        for o, N, K in problems(m.d_model, m.moe_ffn_dim):
            if o == op:
                for c in gemm_configs(op, N, K, m.n_routed_experts, elem_bytes, target):
                    seen[c] = None
    return list(seen)


def _precisions(dt: str, target: str) -> tuple[str, ...]:
    # fp32 launches follow torch's tf32 switch; tf32 changes the sm_90 lowering (wgmma).
    return ("ieee", "tf32") if dt == "fp32" and TARGETS[target].backend == "cuda" else ("ieee",)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_gemm_smem_model_matches_compiled(op: str, dt: str, target: str) -> None:
    tgt = TARGETS[target]
    report = os.environ.get("PIPER_SMEM_REPORT")
    bad = []
    cfgs = reachable_configs(op, DTYPES[dt], target)
    assert cfgs, (op, dt, target)
    for cfg in cfgs:
        for prec in _precisions(dt, target):
            got = compile_gemm(op, dt, cfg, target, prec).metadata.shared
            model = cfg.smem_bytes(op, DTYPES[dt], tgt, prec)
            if abs(model - got) > REL_TOL * got or got > tgt.smem_limit:
                bad.append(f"{cfg} {prec}: compiled {got} B, model {model} B, limit {tgt.smem_limit}")
            if report:
                with open(report, "a") as f:
                    f.write(json.dumps({"op": op, "dtype": dt, "target": target, "precision": prec,
                                        "config": [cfg.block_m, cfg.block_n, cfg.block_k,
                                                   cfg.num_warps, cfg.num_stages],
                                        "compiled": got, "model": model,
                                        "limit": tgt.smem_limit}) + "\n")
    assert not bad, f"{op} {dt} on {target}:\n" + "\n".join(bad)


@pytest.mark.parametrize("target", list(TARGETS))
def test_permute_kernels_compile(target: str) -> None:
    dt, tgt, limit = "bf16", GPU_TARGETS[target], TARGETS[target].smem_limit
    kernels = [
        _compile(P.gather_rows_kernel,
                 {"x_ptr": f"*{dt}", "idx_ptr": "*i64", "out_ptr": f"*{dt}", "D": "i32",
                  "stride_xt": "i32", "stride_os": "i32", "TOPK": "constexpr", "BLOCK_D": "constexpr"},
                 {"TOPK": 8, "BLOCK_D": 1024}, tgt, warps=4, stages=1),
        _compile(P.combine_rows_kernel,
                 {"y_ptr": f"*{dt}", "w_ptr": "*fp32", "inv_ptr": "*i64", "out_ptr": f"*{dt}",
                  "D": "i32", "stride_ys": "i32", "stride_ot": "i32", "TOPK": "constexpr",
                  "HAS_W": "constexpr", "BLOCK_D": "constexpr"},
                 {"TOPK": 8, "HAS_W": True, "BLOCK_D": 1024}, tgt, warps=4, stages=1),
        _compile(P.combine_rows_bwd_kernel,
                 {"dout_ptr": f"*{dt}", "y_ptr": f"*{dt}", "w_ptr": "*fp32", "inv_ptr": "*i64",
                  "dy_ptr": f"*{dt}", "dw_ptr": "*fp32", "D": "i32", "stride_dot": "i32",
                  "stride_ys": "i32", "stride_dys": "i32", "TOPK": "constexpr",
                  "NEED_DW": "constexpr", "BLOCK_D": "constexpr"},
                 {"TOPK": 6, "NEED_DW": True, "BLOCK_D": 1024}, tgt, warps=4, stages=1),
    ]
    for k in kernels:
        assert k.metadata.shared <= limit
