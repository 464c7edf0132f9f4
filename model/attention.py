"""Causal self-attention: GQA/MHA (Mixtral, Qwen3, Llama-4) and MLA (DeepSeek-V2/V3, Kimi-K2).

GQA:  q = x Wq, k = x Wk, v = x Wv (G kv heads shared by H/G query heads each), optional
      per-head RMSNorm on q and k (Qwen3) before RoPE.
MLA:  q = x Wq  or  q = norm(x Wq_a) Wq_b  (low-rank q, q_lora_rank)
      [c_kv, k_rope] = x Wkv_a;  [k_nope, v] = norm(c_kv) Wkv_b  (per head)
      k = [k_nope, rope(k_rope) shared by all heads],  q = [q_nope, rope(q_rope)].
Both use torch's scaled_dot_product_attention with is_causal=True; with a `DocLayout`
(documents packed into one training window, `--data.doc_mask`) the mask is block-causal (no
attention across a document boundary) and RoPE positions restart at 0 in every document, so
each document is computed as if it were alone in the window.

Shape legend: B batch, S sequence, D model, H heads, G kv heads, hd head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rope, deinterleave, softmax_scale


class DocLayout:
    """Where the documents of a packed window begin: `positions` [B, S] (position of each
    token within its document) and the block-causal `mask` [B, 1, S, S] (True = may attend).
    Built once per batch from per-token document ids [B, S] (non-decreasing along S)."""

    def __init__(self, doc_ids: torch.Tensor) -> None:
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [B, S], got shape {tuple(doc_ids.shape)}")
        B, S = doc_ids.shape
        idx = torch.arange(S, device=doc_ids.device).expand(B, S)
        first = torch.ones(B, 1, dtype=torch.bool, device=doc_ids.device)
        starts = torch.cat((first, doc_ids[:, 1:] != doc_ids[:, :-1]), dim=1)
        start_of = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
        self.positions = idx - start_of
        causal = torch.ones(S, S, dtype=torch.bool, device=doc_ids.device).tril()
        self.mask = (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]

    @staticmethod
    def from_tokens(tokens: torch.Tensor, eos_id: int) -> DocLayout:
        """Documents end with `eos_id` (the EOS token belongs to the document it ends)."""
        is_eos = (tokens == eos_id).to(torch.int64)
        return DocLayout(torch.cumsum(is_eos, dim=1) - is_eos)


def _sdpa(q, k, v, scale: float, doc: DocLayout | None, gqa: bool = False) -> torch.Tensor:
    if doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=doc.mask.to(q.device), scale=scale,
                                          enable_gqa=gqa)


# DeepSeek's latent norms use the RMSNorm default eps, not config.rms_norm_eps (both the
# original modeling code and transformers do), so the value is fixed here.
_LATENT_EPS = 1e-6


class GQAttention(nn.Module):
    """Grouped-query attention (multi-head when n_kv_heads == n_heads)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H, G, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.qk_head_dim  # GQA: = head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, G, hd
        self.wq = nn.Linear(D, H * hd, bias=cfg.attn_qkv_bias)
        self.wk = nn.Linear(D, G * hd, bias=cfg.attn_qkv_bias)
        self.wv = nn.Linear(D, G * hd, bias=cfg.attn_qkv_bias)
        self.wo = nn.Linear(H * hd, D, bias=cfg.attn_out_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = RotaryEmbedding(cfg, hd)
        self.scale = softmax_scale(cfg)

    def forward(self, x_BSD: torch.Tensor, doc: DocLayout | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        v = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rope(S, q.dtype, None if doc is None else doc.positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = _sdpa(q, k, v, self.scale, doc, gqa=self.n_heads != self.n_kv_heads)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention with decoupled RoPE and optional low-rank queries."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H = cfg.d_model, cfg.n_heads
        self.n_heads = H
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        qk = cfg.qk_head_dim
        b = cfg.attn_qkv_bias
        self.wq: nn.Linear | None  # full-rank queries, or
        self.wq_a: nn.Linear | None  # low-rank: wq_b(q_norm(wq_a(x)))
        self.q_norm: RMSNorm | None
        self.wq_b: nn.Linear | None
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(D, H * qk, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=b)
            self.q_norm = RMSNorm(cfg.q_lora_rank, _LATENT_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        self.wkv_a = nn.Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=b)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, _LATENT_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, D, bias=cfg.attn_out_bias)
        self.rope = RotaryEmbedding(cfg, cfg.qk_rope_head_dim)
        self.scale = softmax_scale(cfg)
        # None, or (tensor parallel, set from outside) a function applied to the shared RoPE
        # key k_rope: identity forward; its backward sums the gradients of the processes that
        # hold the other heads (k_rope feeds every head)
        self.rope_key_grad: Any = None

    def forward(self, x_BSD: torch.Tensor, doc: DocLayout | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H = self.n_heads
        if self.wq is not None:
            q = self.wq(x_BSD)
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q = q.view(B, S, H, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.rope_key_grad is not None:
            k_rope = self.rope_key_grad(k_rope)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(B, S, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.view(B, 1, S, self.rope_dim)
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        cos, sin = self.rope(S, q.dtype, None if doc is None else doc.positions)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, H, S, self.rope_dim)), dim=-1)
        o = _sdpa(q, k, v, self.scale, doc)
        return self.wo(o.transpose(1, 2).reshape(B, S, H * self.v_dim))


def build_attention(cfg: ModelConfig) -> nn.Module:
    return GQAttention(cfg) if cfg.attention == "gqa" else MLAttention(cfg)
