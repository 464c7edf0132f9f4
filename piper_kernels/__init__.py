"""Grouped GEMM and token permutation for MoE experts: Triton on GPUs, a fast torch path on CPU.

Public ops (contracts in ``docs/architecture.md``):
- ``grouped_gemm(x [M, K], w [E, K, N], offs [E] int32) -> [M, N]`` (torch._grouped_mm contract;
  rows past offs[-1] are zero).
- ``permute(x [T, D], topk_idx [T, k], num_experts) -> (x_sorted [T*k, D], counts [E], meta)``
- ``unpermute(y_sorted [T*k, D], topk_w [T, k], meta) -> [T, D]``
and their plain-torch references, which tests and benchmarks import.

Backends (``piper_kernels/backend.py``): Triton on CUDA/ROCm tensors; the per-expert ``torch.mm``
loop on CPU (chosen by measurement, numbers in ``piper_kernels/cpu.py``); the Triton kernels on CPU
tensors when the process starts with ``TRITON_INTERPRET=1``. ``PIPER_KERNELS_PIN_CONFIG=1`` pins
one launch config; ``python -m model.autotune --model PRESET`` stores tuned ones in
``~/.cache/piper-moe/kernels-autotune.json`` (or ``PIPER_KERNELS_CACHE``).
"""

from __future__ import annotations

from piper_kernels.grouped_gemm import grouped_gemm, offsets_from_counts, reference_grouped_gemm
from piper_kernels.permute import (
    PermuteMeta,
    permute,
    reference_permute,
    reference_unpermute,
    unpermute,
)

__all__ = [
    "PermuteMeta",
    "grouped_gemm",
    "offsets_from_counts",
    "permute",
    "reference_grouped_gemm",
    "reference_permute",
    "reference_unpermute",
    "unpermute",
]
