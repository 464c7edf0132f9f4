"""Redundant expert slots in training (--balance.redundant=r, issue 20).

Each EP rank hosts S = E / ep + r slots per MoE layer; a slot map (`MoELayer.slot_map()`) says
which logical expert each holds, and a token for an expert with c replicas goes to one of them
(`model.moe.replica_slots`). What that asks of a training step:

- Gradients: every replica computes a partial gradient from its share of the tokens. After the
  data-parallel reduction (`GradSync.finish`) the replicas' gradients are summed over the EP
  group (`sum_replica_grads`: one all-reduce per bucket of replicated experts' rows; a rank
  adds zeros for replicas it does not hold), so every replica holds the expert's full gradient,
  applies the same AdamW update and stays identical to the others. Sums and means commute, so
  the order against the data-parallel average does not matter.
- The gradient norm counts each logical expert once: each slot's squared norm is weighted by
  1 / (its expert's replica count) (`replica_row_weights`, read by `GradSync.clip`).
- Initial map (`initial_slot_map`): rank q holds experts q*E/ep .. (q+1)*E/ep - 1 in its first
  E/ep slots (the placement without replicas) and, in its r redundant slots, replicas of the next
  rank's first r experts; re-planning (trainer/balancing.py) moves replicas to hot experts.

Checkpoints keep one copy per logical expert (replicas write the same key; DCP writes it once)
and load under any r: every slot reads its expert's row (trainer/checkpoint.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["initial_slot_map", "sum_replica_grads", "replica_row_weights", "REPLICA_BUCKET_BYTES"]

REPLICA_BUCKET_BYTES = 64 << 20  # rows of replicated experts summed per all-reduce, at most


def initial_slot_map(E: int, ep: int, r: int) -> list[int]:
    """slot2expert [ep * (E / ep + r)]: the plain placement plus r replicas of the next rank's
    first experts in each rank's redundant slots (no expert twice on a rank while r <= E - E/ep)."""
    El = E // ep
    out: list[int] = []
    for q in range(ep):
        out += list(range(q * El, (q + 1) * El))
        out += [((q + 1) * El + j) % E for j in range(r)]
    return out


def _local(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts of this rank's slots [S], their replica counts [S]), on the CPU."""
    S, lo = layer.experts.w1.shape[0], layer.experts.first_slot
    experts = layer.slot_map()[lo:lo + S].cpu()
    return experts, layer.n_rep.cpu()[experts]


def replica_row_weights(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """{expert parameter: [S] weight 1 / replica count of each local slot's expert}, for the
    layers with replicas (a plain layer's slots all weigh 1 and are left out)."""
    out: dict[nn.Parameter, torch.Tensor] = {}
    for layer in model.moe_layers():
        if layer.replicated:
            _, n = _local(layer)
            w = (1.0 / n.to(torch.float64)).to(layer.experts.w1.device)
            for p in layer.experts.parameters():
                out[p] = w
    return out


@torch.no_grad()
def sum_replica_grads(model: nn.Module, group) -> None:
    """Sum each replicated expert's gradient over its replicas (collective over the EP group;
    every rank of the group calls it with the same slot maps)."""
    for layer in model.moe_layers():
        if not layer.replicated:
            continue
        params = [p for p in layer.experts.parameters() if p.grad is not None]
        if not params:  # ZeRO-2: this dp index does not own them, on every rank of the group
            continue
        experts, _ = _local(layer)
        hot = torch.nonzero(layer.n_rep.cpu() > 1).flatten()  # replicated experts, ascending
        if hot.numel() == 0:
            continue
        row = sum(p[0].numel() for p in params)
        per = max(1, REPLICA_BUCKET_BYTES // (row * params[0].grad.element_size()))
        for b0 in range(0, hot.numel(), per):
            chunk = hot[b0:b0 + per]
            pos = torch.full((layer.num_experts,), -1, dtype=torch.long)
            pos[chunk] = torch.arange(chunk.numel())
            mine = [(j, int(pos[e])) for j, e in enumerate(experts.tolist()) if pos[e] >= 0]
            buf = params[0].grad.new_zeros(chunk.numel(), row)
            for j, k in mine:  # (+=: one rank may hold two replicas when it is the only one)
                buf[k] += torch.cat([p.grad[j].reshape(-1) for p in params])
            if group is not None:
                dist.all_reduce(buf, group=group)
            for j, k in mine:
                o = 0
                for p in params:
                    n = p[0].numel()
                    p.grad[j].copy_(buf[k, o:o + n].view_as(p.grad[j]))
                    o += n
