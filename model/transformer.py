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

import hashlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DocLayout, build_attention
from .config import ModelConfig
from .moe import MoELayer, SwiGLU
from .norm import RMSNorm
from .recompute import recompute
from .rope import RotaryEmbedding


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats/token) in fp32 over the targets that count: -100
    marks a token the data's loss mask excludes (--data.loss_mask); a batch with no counted
    token gives 0, not 0 / 0. Without -100 it is the plain mean. The one cross-entropy of the
    project: the model's `forward(tokens, targets)`, the trainer's step, evaluation and every
    pipeline stage's loss use it. logits [..., V], targets [...] (the same leading shape)."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} != tokens shape {tuple(logits.shape[:-1])}"
        )
    flat, t = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if not bool((t == -100).any()):
        return F.cross_entropy(flat, t)
    return (F.cross_entropy(flat, t, ignore_index=-100, reduction="sum")
            / (t != -100).sum().clamp(min=1))


def _normal(t: torch.Tensor, std: float, seed: int, *key: object) -> None:
    """Fill `t` with normal(0, std) from a generator seeded by hash(seed, *key)."""
    digest = hashlib.blake2b("/".join(map(str, (seed, *key))).encode(), digest_size=8).digest()
    gen = torch.Generator(device=t.device).manual_seed(int.from_bytes(digest, "little") >> 1)
    t.normal_(0.0, std, generator=gen)


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

    def forward(self, h_BSD: torch.Tensor, doc: DocLayout | None = None) -> torch.Tensor:
        if self.recompute_block:
            return recompute(self._forward, h_BSD, doc)
        return self._forward(h_BSD, doc)

    def _forward(self, h_BSD: torch.Tensor, doc: DocLayout | None = None) -> torch.Tensor:
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), doc)
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
        if self.embed.weight.device.type != "meta":  # on meta: to_empty + reset_parameters later
            self.reset_parameters()

    def materialize(self, device: torch.device | str, seed: int | None = None) -> MoETransformer:
        """Allocate a model built on the meta device (after any expert slicing or pipeline
        stripping) on `device`, re-tie the embeddings and initialise it (`reset_parameters`)."""
        self.to_empty(device=device)
        if self.cfg.tie_embeddings and self.embed is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed.weight  # to_empty allocates tied tensors apart
        self.reset_parameters(seed)
        return self

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """normal(0, init_std) for every weight matrix, zeros for biases, ones for norm gains,
        and the buffers' initial values (identity expert placement, zero router bias, RoPE
        frequencies).

        Every tensor draws from its own generator, seeded by (seed, parameter name), and every
        routed expert from one seeded by (seed, name, logical expert id). So a rank that holds
        only some experts or some layers (expert / pipeline parallel, built on the meta device
        and materialised with `to_empty`) fills them with exactly the values a 1-process model
        gets, and no rank ever has to build the whole model. `seed=None` draws the seed from
        torch's global RNG, so the model stays a pure function of `torch.manual_seed`."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu"))
        std = self.cfg.init_std
        tied = self.cfg.tie_embeddings
        for mname, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, RotaryEmbedding):
                module.reset_buffers()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and tied:
                    continue
                _normal(module.weight, std, seed, f"{mname}.weight")
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MoELayer):
                module.reset_state()
                _normal(module.router.weight, std, seed, f"{mname}.router.weight")
                experts = module.experts
                slot_map = module.slot_map().cpu()
                for wname in ("w1", "w3", "w2"):
                    w = getattr(experts, wname)
                    for s in range(w.shape[0]):
                        # reset_state restored the initial placement: slot g holds expert
                        # slot_map()[g] (g itself without replicas); replicas start identical
                        e = int(slot_map[experts.first_slot + s])
                        _normal(w[s], std, seed, f"{mname}.experts.{wname}", e)

    # ---------------------------------------------------------------- forward
    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
        doc: DocLayout | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] -> logits [B, S, V]; with targets [B, S]: (ce_loss, aux_loss).
        `doc`: documents packed in the window attend only within themselves (DocLayout)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, doc)
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return logits
        return cross_entropy(logits, targets), self.aux_loss()

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
