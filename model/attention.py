"""Causal self-attention: GQA/MHA (Mixtral, Qwen3, Llama-4) and MLA (DeepSeek-V2/V3, Kimi-K2).

GQA:  q = x Wq, k = x Wk, v = x Wv (G kv heads shared by H/G query heads each), optional
      per-head RMSNorm on q and k (Qwen3) before RoPE.
MLA:  q = x Wq  or  q = norm(x Wq_a) Wq_b  (low-rank q, q_lora_rank)
      [c_kv, k_rope] = x Wkv_a;  [k_nope, v] = norm(c_kv) Wkv_b  (per head)
      k = [k_nope, rope(k_rope) shared by all heads],  q = [q_nope, rope(q_rope)].
Both use torch's scaled_dot_product_attention with is_causal=True; with a `DocLayout`
(documents packed into one training window, `--data.doc_mask`) attention is block-causal (no
attention across a document boundary; kernel per DOC_ATTENTION: a flex block mask, one causal
SDPA per document, or a dense [B, 1, S, S] mask) and RoPE positions restart at 0 in every
document, so each document is computed as if it were alone in the window.

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

# kernels for a DocLayout (--data.doc_attention): "flex" = torch's flex_attention with a block
# mask (tiles wholly outside every document are skipped; compiled on GPUs, the unfused eager
# reference elsewhere), "varlen" = one causal SDPA call per document of each row (no [S, S]
# tensor; the kernel SDPA picks, flash where the platform has it), "dense" = SDPA with the
# [B, 1, S, S] boolean mask, "auto" = flex on CUDA, varlen elsewhere (eager flex on CPU is
# ~70x slower than dense at S = 1024 and compiling it takes minutes: docs/data.md)
DOC_ATTENTION = ("auto", "flex", "varlen", "dense")


class DocLayout:
    """Where the documents of a packed window begin: `positions` [B, S] (position of each
    token within its document), and on demand the block-causal `mask` [B, 1, S, S] (True = may
    attend), the per-row document `segments`, or a flex `block_mask`. Built once per batch
    from per-token document ids [B, S] (non-decreasing along S); `kernel` is one of
    DOC_ATTENTION."""

    def __init__(self, doc_ids: torch.Tensor, kernel: str = "dense") -> None:
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [B, S], got shape {tuple(doc_ids.shape)}")
        if kernel not in DOC_ATTENTION:
            raise ValueError(f"doc attention kernel {kernel!r}; valid: {', '.join(DOC_ATTENTION)}")
        B, S = doc_ids.shape
        self.doc_ids, self.kernel = doc_ids, kernel
        idx = torch.arange(S, device=doc_ids.device).expand(B, S)
        first = torch.ones(B, 1, dtype=torch.bool, device=doc_ids.device)
        starts = torch.cat((first, doc_ids[:, 1:] != doc_ids[:, :-1]), dim=1)
        start_of = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
        self.positions = idx - start_of
        self._starts = starts
        self._mask: torch.Tensor | None = None
        self._segments: list[list[tuple[int, int]]] | None = None
        self._block: dict[str, object] = {}

    @property
    def mask(self) -> torch.Tensor:
        """The dense block-causal mask [B, 1, S, S] (built on first use)."""
        if self._mask is None:
            S = self.doc_ids.shape[1]
            causal = torch.ones(S, S, dtype=torch.bool, device=self.doc_ids.device).tril()
            ids = self.doc_ids
            self._mask = (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]
        return self._mask

    @property
    def segments(self) -> list[list[tuple[int, int]]]:
        """Per row, the [start, end) token ranges of its documents."""
        if self._segments is None:
            S = self.doc_ids.shape[1]
            self._segments = []
            for row in self._starts.cpu():
                b = [int(i) for i in torch.nonzero(row).flatten()] + [S]
                self._segments.append(list(zip(b[:-1], b[1:], strict=True)))
        return self._segments

    def block_mask(self, device: torch.device):
        """flex_attention's BlockMask of the layout (built once per device)."""
        key = str(device)
        if key not in self._block:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.doc_ids.to(device)
            B, S = ids.shape

            def doc_causal(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

            self._block[key] = create_block_mask(doc_causal, B, None, S, S, device=key)
        return self._block[key]

    @staticmethod
    def from_tokens(tokens: torch.Tensor, eos_id: int, kernel: str = "dense") -> DocLayout:
        """Documents end with `eos_id` (the EOS token belongs to the document it ends)."""
        is_eos = (tokens == eos_id).to(torch.int64)
        return DocLayout(torch.cumsum(is_eos, dim=1) - is_eos, kernel)


_FLEX: dict[str, object] = {}  # the compiled flex_attention, compiled once per process


def _flex(q, k, v, scale: float, doc: DocLayout, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:  # eager flex materialises the scores: compiled is the point on a GPU
        if "fn" not in _FLEX:
            _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        fn = _FLEX["fn"]  # type: ignore[assignment]
    return fn(q, k, v, block_mask=doc.block_mask(q.device), scale=scale, enable_gqa=gqa)


def _varlen(q, k, v, scale: float, doc: DocLayout, gqa: bool) -> torch.Tensor:
    rows = []
    for b, segs in enumerate(doc.segments):
        rows.append(torch.cat([
            F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                           v[b:b + 1, :, s:e], is_causal=True, scale=scale,
                                           enable_gqa=gqa)
            for s, e in segs], dim=2))
    return torch.cat(rows, dim=0)


def sdpa(q, k, v, scale: float, doc: DocLayout | None, gqa: bool = False) -> torch.Tensor:
    """Causal attention of q, k, v [B, H, T, D], inside documents when `doc` is given (by
    `doc.kernel`), else plain causal SDPA; `gqa`: fewer kv heads than query heads."""
    if doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    kernel = doc.kernel
    if kernel == "auto":
        kernel = "flex" if q.is_cuda else "varlen"
    if kernel == "flex":
        return _flex(q, k, v, scale, doc, gqa)
    if kernel == "varlen":
        return _varlen(q, k, v, scale, doc, gqa)
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
        o = sdpa(q, k, v, self.scale, doc, gqa=self.n_heads != self.n_kv_heads)
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
        o = sdpa(q, k, v, self.scale, doc)
        return self.wo(o.transpose(1, 2).reshape(B, S, H * self.v_dim))


def build_attention(cfg: ModelConfig) -> nn.Module:
    return GQAttention(cfg) if cfg.attention == "gqa" else MLAttention(cfg)
