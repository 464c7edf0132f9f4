"""Grouped GEMM over token-sorted rows: the ``torch._grouped_mm`` contract, differentiable.

Math, for experts e = 0..E-1 with row ranges [offs[e-1], offs[e]) (offs[-1] := 0):

    y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]
    dx[offs[e-1]:offs[e]] = dy[offs[e-1]:offs[e]] @ w[e]^T        (the same grouped GEMM)
    dw[e] = x[offs[e-1]:offs[e]]^T @ dy[offs[e-1]:offs[e]]        (a grouped reduction)

Shape legend: M token-sorted rows (T*k after permute), K input features, N output features,
E experts. ``offs`` is int32 [E], cumulative row ends (``torch.cumsum(counts, 0)``); any expert
may own zero rows. Rows at or past ``offs[-1]`` belong to no expert: their output rows are ZERO
(torch._grouped_mm leaves them undefined; zero costs one memset and keeps padding harmless) and
they contribute nothing to dw. Accumulation is fp32 for every input dtype.

Backends (``piper_kernels/backend.py``): Triton kernels (``grouped_gemm_triton.py``) on CUDA/ROCm
and under ``TRITON_INTERPRET=1``; the measured-fastest torch path on CPU (``cpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from piper_kernels.backend import resolve_backend

__all__ = ["grouped_gemm", "reference_grouped_gemm", "offsets_from_counts"]


def reference_grouped_gemm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Plain-torch grouped GEMM, one matmul per expert; the yardstick for every backend.

    Computes in fp32 (fp64 for fp64 inputs) and returns x's dtype; rows past offs[-1] are zero. Differentiable through
    ordinary autograd.
    """
    M, N = x_MK.shape[0], w_EKN.shape[2]
    acc = torch.promote_types(x_MK.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)
    rows = []
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        rows.append(x_MK[start:end].to(acc) @ w_EKN[e].to(acc))
        start = end
    rows.append(x_MK.new_zeros(M - start, N, dtype=acc))
    return torch.cat(rows).to(x_MK.dtype)


def offsets_from_counts(counts_E: torch.Tensor) -> torch.Tensor:
    """int32 cumulative row ends [E] from per-expert row counts [E] (the ``offs`` argument)."""
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


def _check(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> None:
    if x_MK.dim() != 2 or w_EKN.dim() != 3 or offs_E.dim() != 1:
        raise ValueError(
            f"grouped_gemm expects x [M, K], w [E, K, N], offs [E]; got x {tuple(x_MK.shape)}, "
            f"w {tuple(w_EKN.shape)}, offs {tuple(offs_E.shape)}"
        )
    if x_MK.shape[1] != w_EKN.shape[1]:
        raise ValueError(f"x has K={x_MK.shape[1]} columns but w has K={w_EKN.shape[1]} rows per expert")
    if offs_E.shape[0] != w_EKN.shape[0]:
        raise ValueError(f"offs has {offs_E.shape[0]} entries but w has E={w_EKN.shape[0]} experts")
    if offs_E.dtype != torch.int32:
        raise ValueError(f"offs must be int32 cumulative row ends, got dtype {offs_E.dtype}")
    if x_MK.dtype != w_EKN.dtype:
        raise ValueError(f"x dtype {x_MK.dtype} differs from w dtype {w_EKN.dtype}")
    if x_MK.device != w_EKN.device or x_MK.device != offs_E.device:
        raise ValueError(
            f"x, w, offs must share a device; got {x_MK.device}, {w_EKN.device}, {offs_E.device}"
        )
    if offs_E.device.type == "cpu" and offs_E.numel() > 0:
        # Value checks only where they are free (no device sync on GPU).
        o = offs_E.tolist()
        if any(b < a for a, b in zip(o, o[1:], strict=False)) or o[0] < 0 or o[-1] > x_MK.shape[0]:
            raise ValueError(
                f"offs must be non-decreasing in [0, M={x_MK.shape[0]}]; got {o[:8]}"
                f"{' ...' if len(o) > 8 else ''} (last {o[-1]})"
            )


def _impl(backend: str) -> ModuleType:
    """The module with gmm, gmm_dx, gmm_dw (imported on use: the Triton one needs triton)."""
    if backend == "triton":
        from piper_kernels import grouped_gemm_triton
        return grouped_gemm_triton
    from piper_kernels import cpu
    return cpu


def _engine_needs(ctx: Any, i: int) -> bool:
    """Whether the running backward pass needs the gradient of input `i`.

    `ctx.needs_input_grad` only says whether input `i` requires grad. A pass that asks for
    some gradients only (a pipeline's split backward: the input gradient first, the weight
    gradients later, each a separate `torch.autograd.grad`) reaches this node in both passes;
    asking the engine whether it will run the node that consumes gradient `i` lets each pass
    compute only its half instead of both halves twice."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):  # not inside an engine pass / API not available
        return True


def _with_config(fn: Callable[..., torch.Tensor], configs: dict | None, op: str
                 ) -> Callable[..., torch.Tensor]:
    """``fn`` with ``config=`` bound when an explicit launch config was asked for ``op``."""
    cfg = (configs or {}).get(op)
    return fn if cfg is None else (lambda *a: fn(*a, config=cfg))


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor,
                backend: str, configs: dict | None) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        ctx.backend = backend
        ctx.configs = configs
        return _with_config(_impl(backend).gmm, configs, "fwd")(x_MK, w_EKN, offs_E)

    @staticmethod
    def backward(ctx: Any, dy_MN: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x_MK, w_EKN, offs_E = ctx.saved_tensors
        impl = _impl(ctx.backend)
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if _engine_needs(ctx, 0):
            # dx = dy @ w^T per expert: the forward GEMM on a transposed view (no copy).
            dx = _with_config(impl.gmm_dx, ctx.configs, "dx")(dy_MN, w_EKN, offs_E)
        if _engine_needs(ctx, 1):
            dw = _with_config(impl.gmm_dw, ctx.configs, "dw")(x_MK, dy_MN, offs_E)
        return dx, dw, None, None, None


def grouped_gemm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, *, backend: str | None = None,
    configs: dict | None = None,
) -> torch.Tensor:
    """y [M, N]: rows offs[e-1]:offs[e] of x times w[e]; rows past offs[-1] are zero.

    Differentiable in x and w. ``backend`` ("triton", "torch", "reference") overrides the
    per-device choice, for benchmarks and tests. ``configs`` ({"fwd"|"dx"|"dw":
    ``piper_kernels.tuning.GemmConfig``}, Triton backend only) launches those ops with the given
    configs instead of ``pick()``'s: how tests run a GPU target's configs under the interpreter.
    """
    _check(x_MK, w_EKN, offs_E)
    name = resolve_backend(x_MK.device, backend)
    if configs:
        from piper_kernels.tuning import OPS, GemmConfig

        bad = [k for k, v in configs.items() if k not in OPS or not isinstance(v, GemmConfig)]
        if bad:
            raise ValueError(f"configs keys {bad} are not ops with a GemmConfig; valid keys: "
                             f"{', '.join(OPS)}")
        if name != "triton":
            raise ValueError(f"configs= applies to the Triton backend only; this call resolved "
                             f"backend={name!r}")
    if name == "reference":
        return reference_grouped_gemm(x_MK, w_EKN, offs_E)
    return _GroupedGemm.apply(x_MK, w_EKN, offs_E, name, configs)
