"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (as the reference models do).

Shape legend: [..., D] in, [..., D] out.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel gain (init 1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"RMSNorm dim={dim} must be >= 1")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Upcast so bf16 activations do not lose the small mean; cast back before the gain,
        # the same order as the transformers implementations (bit-compatible in fp32).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
