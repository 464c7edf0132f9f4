"""Rotary position embedding (RoPE) with the YaRN (DeepSeek, Kimi) and Llama-3 (Llama-4)
frequency scalings.

For a pair of channels (x1, x2) at frequency w and position p:
    (x1, x2) -> (x1 cos(p w) - x2 sin(p w), x2 cos(p w) + x1 sin(p w)).
Pairs are (i, i + d/2) ("rotate half" layout). Checkpoints with interleaved pairs (2i, 2i + 1)
(DeepSeek) are first de-interleaved by `deinterleave`; q.k is invariant to that permutation
because q and k get the same one.

Shape legend: S sequence, d rotary dim, [B, H, S, d] per-head tensors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d/2] (fp32) and the cos/sin magnitude factor for `cfg`."""
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if cfg.rope_scaling == "none":
        return inv_freq, 1.0
    factor, orig = cfg.rope_factor, cfg.rope_original_max_seq_len
    if cfg.rope_scaling == "llama3":
        lo_wl = orig / cfg.rope_low_freq_factor
        hi_wl = orig / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > lo_wl, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp between the
    # dims that complete beta_fast and beta_slow rotations over the original context.
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        attn_factor = _yarn_mscale(factor, cfg.rope_mscale) / _yarn_mscale(
            factor, cfg.rope_mscale_all_dim
        )
    else:
        attn_factor = _yarn_mscale(factor)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(cfg.rope_beta_fast)), 0)
    high: float = min(math.ceil(corr_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, attn_factor


def softmax_scale(cfg: ModelConfig) -> float:
    """Attention logit scale: qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim
    (DeepSeek's MLA compensates the rotary magnitude change in the softmax temperature)."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        m = _yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
        scale *= m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Produces cos/sin tables [S, d] for positions 0..S-1 (recomputed per call: cheap)."""

    inv_freq: torch.Tensor  # [d / 2] buffer (non-persistent)

    def __init__(self, cfg: ModelConfig, dim: int) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dim={dim} must be even")
        self.cfg, self.dim = cfg, dim
        inv_freq, self.attn_factor = rope_frequencies(cfg, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the frequencies in place (after `to_empty` from the meta device)."""
        inv_freq, _ = rope_frequencies(self.cfg, self.dim)
        self.inv_freq.copy_(inv_freq.to(self.inv_freq.device))

    def forward(self, seq_len: int, dtype: torch.dtype, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [S, d] for positions 0..S-1, or [B, 1, S, d] for explicit `positions`
        [B, S] (documents packed in one window restart at 0; model.attention.DocLayout)."""
        if positions is None:
            pos = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        else:
            pos = positions.to(self.inv_freq.device, torch.float32)[:, None, :]  # [B, 1, S]
        freqs = pos[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attn_factor).to(dtype), (emb.sin() * self.attn_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, d] rotated by cos/sin [S, d] (or [B, 1, S, d])."""
    return x * cos + rotate_half(x) * sin


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved pairs to rotate-half."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
