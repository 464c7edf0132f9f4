"""Which implementation runs an op: decided per call from the tensor's device, settings read once.

Legend: none (no tensors here).

Rules (docs/architecture.md, "piper_kernels"):
- CUDA/ROCm tensors (ROCm builds of torch also report ``device.type == "cuda"``) -> Triton.
- CPU tensors -> the measured-fastest torch path (``piper_kernels/cpu.py``), unless the process was
  started with ``TRITON_INTERPRET=1``: then the Triton kernels run on CPU tensors through the
  interpreter (how the kernels are tested without a GPU).
- ``PIPER_KERNELS_PIN_CONFIG=1`` pins one known-good launch config (fast interpreter runs, an
  escape hatch when tuning misbehaves).

The environment is read once, the first time an op runs, and kept in one ``KernelSettings``
object; nothing is swapped at import time. Triton itself decides interpretation when a kernel
is decorated, so the variable must be set before ``piper_kernels`` first launches a kernel (tests do
this in a subprocess).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

BACKENDS = ("triton", "torch", "reference")


@dataclass(frozen=True)
class KernelSettings:
    """Process-wide kernel settings, read from the environment exactly once."""

    interpret: bool  # TRITON_INTERPRET=1: Triton kernels on CPU tensors
    pin_config: bool  # PIPER_KERNELS_PIN_CONFIG=1: one fixed config, no tuned winners
    cache_path: str | None  # PIPER_KERNELS_CACHE: autotune JSON cache (default under ~/.cache)

    @classmethod
    def from_env(cls) -> KernelSettings:
        return cls(
            interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
            pin_config=os.environ.get("PIPER_KERNELS_PIN_CONFIG", "0") == "1",
            cache_path=os.environ.get("PIPER_KERNELS_CACHE") or None,
        )


@functools.cache
def settings() -> KernelSettings:
    """The one settings object of this process."""
    return KernelSettings.from_env()


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """Backend for tensors on ``device``; ``backend`` overrides (benchmarks, tests)."""
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; valid: {', '.join(BACKENDS)}")
        if backend == "triton" and device.type == "cpu" and not settings().interpret:
            raise ValueError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the process "
                "starts; valid on CPU without it: 'torch', 'reference'"
            )
        return backend
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton" if settings().interpret else "torch"
    # Other devices (mps, xpu, ...) get the plain torch path: correct everywhere, tuned nowhere.
    return "torch"
