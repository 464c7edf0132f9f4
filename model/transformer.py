"""MoETransformer: token embedding, pre-norm decoder blocks (attention + dense or MoE FFN),
final RMSNorm and the lm_head.

    h = embed(tokens)
    for each layer:  h = h + attn(attn_norm(h));  h = h + ffn(ffn_norm(h))
    logits = lm_head(norm(h))

Model code is rank-agnostic: expert parallelism replaces each MoELayer's `dispatcher` and
`experts` from outside; pipeline parallelism may run `embed`, slices of `layers`, `norm` and
`lm_head` separately (all public attributes).

Llama-4 configs build with Llama-4's exact parameter shapes, but not its numerics (no NoPE
layers, chunked attention, temperature tuning, L2 q/k norm or input-side router weights).

Shape legend: B batch, S sequence, D model, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .attention import build_attention
from .checkpointing import recompute
from .config import ModelConfig
from .moe import GroupedExperts, MoELayer, SwiGLU
from .norm import RMSNorm


class Block(nn.Module):
    """One decoder layer: attention and feed-forward sublayers, each pre-normed and residual."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.attn = build_attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.ffn: nn.Module = (
            MoELayer(cfg) if self.is_moe else SwiGLU(cfg.d_model, cfg.dense_ffn_dim)
        )
        self.recompute_block = False  # activation checkpointing "full" (model.checkpointing)

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        if self.recompute_block:
            return recompute(self._forward, h_BSD)
        return self._forward(h_BSD)

    def _forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD))
        return h_BSD + self.ffn(self.ffn_norm(h_BSD))


class MoETransformer(nn.Module):
    """Decoder-only MoE language model built from a ModelConfig."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, init_std) for every weight matrix, zeros for biases, ones for norm gains.

        Parameters are visited in registration order, so the result is a pure function of
        torch's RNG state (deterministic under torch.manual_seed)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.cfg.tie_embeddings:
                    continue
                nn.init.normal_(module.weight, 0.0, std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                for w in (module.w1, module.w3, module.w2):
                    nn.init.normal_(w, 0.0, std)
            elif isinstance(module, MoELayer):
                nn.init.normal_(module.router.weight, 0.0, std)
                module.router.e_score_correction_bias.zero_()

    # ---------------------------------------------------------------- forward
    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] -> logits [B, S, V]; with targets [B, S]: (ce_loss, aux_loss)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return logits
        return self.ce_loss(logits, targets), self.aux_loss()

    @staticmethod
    def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy (nats/token) in fp32; targets == -100 are ignored."""
        if targets.shape != logits.shape[:-1]:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} != tokens shape {tuple(logits.shape[:-1])}"
            )
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ce_loss, aux_loss) for one batch; the training objective is their sum."""
        ce, aux = self(tokens, targets)
        return ce, aux

    # ---------------------------------------------------------------- MoE access
    def moe_layers(self) -> list[MoELayer]:
        return [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoELayer)]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' last_aux_loss (0-dim; zero when no MoE layer ran)."""
        total = torch.zeros((), device=self.embed.weight.device)
        for moe in self.moe_layers():
            total = total + moe.last_aux_loss.to(total.device)
        return total

    # ---------------------------------------------------------------- interop
    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a transformers-format state dict (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3,
        Kimi-K2): per-expert checkpoint keys or transformers' fused 3D expert tensors."""
        from .hf_weights import convert_hf_state_dict

        self.load_state_dict(convert_hf_state_dict(sd, self.cfg), strict=strict)
