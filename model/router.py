"""Top-k token router: softmax or sigmoid scoring, group-limited selection, load balancing.

For token t with router logits l = x_t W^T (fp32):
    s = softmax(l) (Mixtral, Qwen, DeepSeek-V2)  or  s = sigmoid(l) (DeepSeek-V3, Kimi-K2)
    choice = s + b  (b = e_score_correction_bias, aux-loss-free balancing; only steers choice)
    group-limited: experts split in n_group groups; a group scores max(choice) ("max") or the
    sum of its two best (“top2_sum”); only the topk_group best groups stay eligible
    idx = top_k(choice),  w = s[idx]  (/ sum(w) if norm_topk_prob)  * routed_scaling_factor

Load-balancing loss (Switch-style, computed PER SEQUENCE and averaged over sequences):
    f_be = (copies of sequence b routed to e) / (S * K),  P_be = mean_t p_bte
    aux = coef * E * mean_b sum_e f_be * P_be
with p = softmax probabilities (sigmoid router: scores normalised to sum 1 per token, as
DeepSeek-V3's sequence-wise loss). Perfectly uniform routing gives aux = coef. Because it is a
mean of per-sequence terms, splitting a batch evenly over data-parallel ranks and averaging
their losses gives exactly the single-process value.

Router entropy (a diagnostic, only while `track_entropy` is set, e.g. by the trainer):
`last_entropy_sum` = sum over this forward's tokens of H(p_t) = -sum_e p_te ln p_te (nats),
p as in the aux loss; detached, so it costs one elementwise pass over [T, E] and no graph.
Divided by the number of tokens it is the mean entropy: ln E for uniform routing, 0 when
every token puts all its probability on one expert.

fp32 guard: logits, softmax / sigmoid, top-k weights and the aux loss are computed with
autocast disabled (`fp32_region`) on fp32 inputs, so a bf16 autocast region around the model
(the trainer's GPU and CPU bf16 runs) cannot turn the logits' GEMM into bf16. The router
weight stays an fp32 parameter under bf16 weights (trainer/distributed/precision.py), so `weight.float()`
is the tensor itself, not a per-forward cast; only the activations are upcast.

Shape legend: B batch, S sequence, T = B*S tokens, D model, E experts, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def fp32_region(device_type: str):
    """Autocast off on `device_type`: what runs inside computes in its inputs' dtype (fp32)."""
    return torch.autocast(device_type, enabled=False)


class Router(nn.Module):
    """Linear router weight [E, D] plus the aux-free balancing bias buffer [E]."""

    e_score_correction_bias: torch.Tensor  # [E] fp32 buffer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts, self.top_k = E, cfg.top_k
        self.kind = cfg.router
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.n_group, self.topk_group, self.group_score = (
            cfg.n_group,
            cfg.topk_group,
            cfg.group_score,
        )
        self.aux_loss_coef = cfg.aux_loss_coef
        self.bias_update_rate = cfg.bias_update_rate
        self.weight = nn.Parameter(torch.empty(E, cfg.d_model))
        # fp32 buffer: the sign updates of size ~1e-3 would vanish in bf16.
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        # None, or (tensor parallel) the processes that share each sequence: `parts` of them,
        # `sum(t)` sums over them (model.moe.MoELayer.seq_split); the loss stays per sequence
        self.seq_split: Any = None
        self.track_entropy = False  # compute last_entropy_sum in route() (see module docstring)
        self.last_entropy_sum = torch.zeros(())

    def scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Router scores s [T, E] in fp32 (softmax probabilities or sigmoids), autocast off."""
        with fp32_region(x_TD.device.type):
            logits = F.linear(x_TD.float(), self.weight.float())
            return logits.softmax(dim=-1) if self.kind == "softmax" else logits.sigmoid()

    def select(self, s_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx [T, K] int64, topk_w [T, K] fp32) from scores s [T, E]."""
        choice = s_TE.detach() + self.e_score_correction_bias
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            if self.group_score == "max":
                g_score = grouped.max(dim=-1).values
            else:
                g_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = g_score.topk(self.topk_group, dim=-1).indices
            g_mask = torch.zeros_like(g_score, dtype=torch.bool).scatter_(1, keep, True)
            e_mask = g_mask.unsqueeze(-1).expand_as(grouped).reshape(T, E)
            choice = choice.masked_fill(~e_mask, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        w = s_TE.gather(1, idx)
        if self.norm_topk_prob:
            # +1e-20 guards all-zero sigmoid rows; it is below fp32 resolution of any real sum.
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.routed_scaling_factor

    def aux_loss(self, s_BSE: torch.Tensor, idx_BSK: torch.Tensor) -> torch.Tensor:
        """Per-sequence load-balancing loss averaged over sequences (see module docstring)."""
        B, S, E = s_BSE.shape
        if self.aux_loss_coef == 0:
            return s_BSE.new_zeros(())
        p = s_BSE if self.kind == "softmax" else s_BSE / (s_BSE.sum(-1, keepdim=True) + 1e-20)
        counts_BE = torch.zeros(B, E, device=s_BSE.device, dtype=torch.float32)
        counts_BE.scatter_add_(
            1, idx_BSK.reshape(B, -1), torch.ones_like(counts_BE[:, :1]).expand(B, S * self.top_k)
        )
        sp = self.seq_split
        if sp is None:
            f_BE = counts_BE / (S * self.top_k)
            P_BE = p.mean(dim=1)
        else:  # the sequence is split over sp.parts processes: sum their partial statistics
            n = S * sp.parts
            both = sp.sum(torch.cat((counts_BE, p.sum(dim=1)), dim=1))
            f_BE, P_BE = both[:, :E] / (n * self.top_k), both[:, E:] / n
        return self.aux_loss_coef * E * (f_BE * P_BE).sum(dim=-1).mean()

    def route(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(topk_idx [T, K], topk_w [T, K] in x's dtype, aux_loss 0-dim) for x [B, S, D]."""
        B, S, D = x_BSD.shape
        with fp32_region(x_BSD.device.type):
            s = self.scores(x_BSD.reshape(B * S, D))
            idx, w = self.select(s)
            if self.track_entropy:
                with torch.no_grad():
                    p = s if self.kind == "softmax" else s / (s.sum(-1, keepdim=True) + 1e-20)
                    self.last_entropy_sum = torch.special.entr(p).sum()
            aux = self.aux_loss(s.view(B, S, -1), idx.view(B, S, -1))
        return idx, w.to(x_BSD.dtype), aux

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx, w, _ = self.route(x_BSD)
        return idx, w

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3): raise the bias of under-loaded experts,
        lower it for over-loaded ones, by bias_update_rate * sign(mean - count).

        counts_E: per-logical-expert token counts, already summed over every rank that routes
        with this router (the caller all-reduces them)."""
        if counts_E.shape != (self.num_experts,):
            raise ValueError(
                f"counts_E has shape {tuple(counts_E.shape)}, expected ({self.num_experts},)"
            )
        c = counts_E.to(self.e_score_correction_bias.device, torch.float32)
        self.e_score_correction_bias += self.bias_update_rate * torch.sign(c.mean() - c)
