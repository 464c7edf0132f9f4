"""Redundant expert slots in training (--balance.redundant=r, issue 20).

Each EP rank hosts S = E / ep + r slots per MoE layer; a slot map (`MoELayer.slot_map()`) says
which logical expert each holds, and a token for an expert with c replicas goes to one of them
(`model.moe.replica_slots`). What that asks of a training step:

- Gradients: every replica computes a partial gradient from its share of the tokens. After the
  data-parallel reduction (`GradSync.finish`) the holders of an expert swap their partials
  (`sum_replica_grads`: one all_to_all_single per layer, each rank sending (replicas - 1) rows
  per replica slot it holds) and add them in global slot order, so every replica holds the
  expert's full gradient, bit for bit the same, applies the same AdamW update and stays
  identical to the others. Sums and means commute, so the order against the data-parallel
  average does not matter.
- The gradient norm counts each logical expert once: each slot's squared norm is weighted by
  1 / (its expert's replica count) (`replica_row_weights`, read by `GradSync.clip`).
- Initial map (`initial_slot_map`): rank q holds experts q*E/ep .. (q+1)*E/ep - 1 in its first
  E/ep slots (the placement without replicas) and, in its r redundant slots, replicas of the next
  rank's first r experts; re-planning (trainer/balancing.py) moves replicas to hot experts.

Checkpoints keep one copy per logical expert (replicas write the same key; DCP writes it once)
and load under any r: every slot reads its expert's row (trainer/checkpoint.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from model import MoELayer

from .precision import grad_of

__all__ = ["initial_slot_map", "sum_replica_grads", "replica_row_weights", "replica_exchange"]


def initial_slot_map(E: int, ep: int, r: int) -> list[int]:
    """slot2expert [ep * (E / ep + r)]: the plain placement plus r replicas of the next rank's
    first experts in each rank's redundant slots (no expert twice on a rank while r <= E - E/ep)."""
    El = E // ep
    out: list[int] = []
    for q in range(ep):
        out += list(range(q * El, (q + 1) * El))
        out += [((q + 1) * El + j) % E for j in range(r)]
    return out


class MoEHolder(Protocol):
    """What these functions read of a model: its MoE layers (`MoETransformer`)."""

    def moe_layers(self) -> list[MoELayer]: ...


def _local(layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts of this rank's slots [S], their replica counts [S]), on the host."""
    S, lo = layer.experts.w1.shape[0], layer.experts.first_slot
    experts = layer.slot_map()[lo:lo + S]
    return experts, layer.replica_counts()[experts]


def replica_row_weights(model: MoEHolder) -> dict[nn.Parameter, torch.Tensor]:
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


def replica_exchange(slot2expert: list[int], n_ranks: int, rank: int
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """Which rows rank `rank` sends to and receives from every rank when replicas swap partial
    gradients: send[q] = its local rows whose expert rank q also holds, recv[q] = the global
    slots of q whose rows arrive from q; both ordered by global slot, so sender and receiver
    derive the same order from the slot map alone."""
    S = len(slot2expert) // n_ranks
    held = [set(slot2expert[q * S:(q + 1) * S]) for q in range(n_ranks)]
    send: list[list[int]] = [[] for _ in range(n_ranks)]
    recv: list[list[int]] = [[] for _ in range(n_ranks)]
    for q in range(n_ranks):
        if q == rank:
            continue
        send[q] = [j for j in range(S) if slot2expert[rank * S + j] in held[q]]
        recv[q] = [q * S + j for j in range(S) if slot2expert[q * S + j] in held[rank]]
    return send, recv


@torch.no_grad()
def sum_replica_grads(model: MoEHolder, group: dist.ProcessGroup | None) -> None:
    """Sum each replicated expert's gradient over its replicas (collective over the EP group;
    every rank of the group calls it with the same slot maps).

    Point to point, not an all-reduce: every rank sends each local replica's partial gradient
    to the other ranks holding that expert (one all_to_all_single per layer), so a rank moves
    (replicas - 1) rows per replica slot it holds, whatever the group size. Each replica then
    adds the partials in global slot order, the same order on every holder, so replicas stay
    identical to the bit."""
    R = dist.get_world_size(group) if group is not None else 1
    me = dist.get_rank(group) if group is not None else 0
    for layer in model.moe_layers():
        if not layer.replicated:
            continue
        grads = [gr for p in layer.experts.parameters() if (gr := grad_of(p)) is not None]
        if not grads:  # ZeRO-2: this dp index does not own them, on every rank of the group
            continue
        m = layer.slot_map().tolist()
        S, lo = grads[0].shape[0], layer.experts.first_slot
        n_rep = layer.replica_counts().tolist()
        local = [j for j in range(S) if n_rep[m[lo + j]] > 1]  # this rank's replica slots
        pos = {j: i for i, j in enumerate(local)}
        rows = torch.cat([grad[local].reshape(len(local), grad[0].numel()) for grad in grads], 1)
        partial = {lo + j: rows[pos[j]] for j in local}  # own partials [row]
        if R > 1:  # (a rank holding no replica still takes part in the collective)
            send, recv = replica_exchange(m, R, me)
            out = rows[[pos[j] for q in range(R) for j in send[q]]]
            back = rows.new_empty(sum(len(r) for r in recv), rows.shape[1])
            dist.all_to_all_single(back, out, [len(r) for r in recv], [len(s) for s in send],
                                   group=group)
            got = [g for q in range(R) for g in recv[q]]
            partial.update({g: back[i] for i, g in enumerate(got)})
        total: dict[int, torch.Tensor] = {}
        for g in sorted(partial):  # every holder adds in global slot order
            e = m[g]
            total[e] = partial[g].clone() if e not in total else total[e].add_(partial[g])
        for j in local:
            o = 0
            for grad in grads:
                n = grad[0].numel()
                grad[j].copy_(total[m[lo + j]][o:o + n].view_as(grad[j]))
                o += n
