"""Per-step collection: tokens per expert and router entropy (forward hooks), EP imbalance, the
time spent in MoE exchanges, memory; summed over the ranks that share them.

`StepStats` owns the hooks and the buffers; the step calls `begin()` before its forward and the
collectors after its backward. What leaves the rank (rows, sinks, the console) is
`trainer.observe.console`'s and `trainer.observe.metrics`' business.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from balance.replicas import replica_loads

from ..checkpoint import named_moe_layers
from ..distributed.mesh import Mesh
from .memory import SavedTensorMeter
from .metrics import LayerGather

__all__ = ["StepStats", "node_exchange_imbalance"]


def node_exchange_imbalance(per_layer_node_rows: list[list[float]]) -> float | None:
    """Rows the busiest node sends to other nodes / the mean node's, over a step's exchanges
    (`per_layer_node_rows[layer][node]`, one exchange per layer, each bound by its busiest
    node): sum over layers of the max / sum of the means. With 2 nodes one node's sent rows
    are the other's received ones, so this is the busiest NIC's load in both directions;
    with more nodes it is the send side only. None where nothing crossed."""
    total = sum(sum(r) / len(r) for r in per_layer_node_rows if r)
    if total <= 0:
        return None
    return sum(max(r) for r in per_layer_node_rows if r) / total


class StepStats:
    def __init__(self, model, mesh: Mesh, mcfg: Any, moe_ids: list[int], device: torch.device,
                 per_layer: bool):
        self.model, self.mesh, self.device = model, mesh, device
        self.E = mcfg.n_routed_experts
        self._counts: dict[int, torch.Tensor] = {}
        self._entropy: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.moe_layers()):
            layer.register_forward_hook(self._count_hook(i))
            layer.router.track_entropy = per_layer
        self.layer_names = list(named_moe_layers(model))
        local_ids = [i for i, b in enumerate(model.layers) if getattr(b, "is_moe", False)]
        self.gather = LayerGather(moe_ids, local_ids, self.E, mcfg.top_k, mesh.pp, mesh.pp_idx,
                                  mesh.pp_group, device, per_layer)
        self.meter = SavedTensorMeter(model)
        self.state_bytes = 0
        self.last_counts: list[torch.Tensor] = []
        self.last_entropy: list[float] = []

    def _count_hook(self, i: int):
        from model import is_recomputing

        def hook(module, args, output):
            if is_recomputing():  # a checkpointed block's second forward: already counted
                return
            c = module.last_counts.detach().to(torch.float64)
            self._counts[i] = self._counts[i] + c if i in self._counts else c
            if module.router.track_entropy:
                h = module.router.last_entropy_sum.to(torch.float64)
                self._entropy[i] = self._entropy[i] + h if i in self._entropy else h
        return hook

    def begin(self, per_layer: bool) -> None:
        """Before a step's forward: empty the buffers, choose whether layers are logged."""
        self._counts, self._entropy = {}, {}
        self.gather.per_layer = per_layer
        for layer in self.model.moe_layers():
            layer.router.track_entropy = per_layer
            layer.dispatcher.take_stats()  # exclude eval-time exchanges

    def expert_counts(self) -> list[torch.Tensor]:
        """Tokens per logical expert of this step (all micro-batches), summed over the stage's
        data shards; one tensor per MoE layer this rank holds."""
        n = len(self.model.moe_layers())
        if n == 0:
            self.last_entropy, self.last_counts = [], []
            return []
        flat = torch.stack([self._counts[i] for i in range(n)])
        if self._entropy:  # the router entropy sums ride along as one more column
            ent = torch.stack([self._entropy[i] for i in range(n)]).to(flat.device)
            flat = torch.cat([flat, ent[:, None]], 1)
        flat = flat.to(self.device)
        if self.mesh.stage_group is not None:
            dist.all_reduce(flat, group=self.mesh.stage_group)
        self.last_entropy = flat[:, self.E].tolist() if self._entropy else [0.0] * n
        self.last_counts = list(flat[:, :self.E])
        return self.last_counts

    def imbalance(self, counts: list[torch.Tensor]) -> list[float]:
        """max EP-rank load / mean EP-rank load of each of this rank's MoE layers (1.0 when
        ep == 1); `LayerGather` averages them over the whole model's layers."""
        vals = []
        for layer, c in zip(self.model.moe_layers(), counts, strict=True):
            # each rank's tokens; an expert's are shared evenly by its replicas (if any)
            load = replica_loads(c.cpu().numpy(), layer.slot_map().numpy(), self.mesh.ep)
            vals.append(float(load.max() / max(load.mean(), 1e-9)))
        return vals

    def exchange_time(self) -> dict[str, float]:
        """Seconds this step's forward MoE exchanges took, max and min over the EP group (the
        dispatchers' `take_stats()`, comm.ep.ExchangeStats; none without EP)."""
        got = [layer.dispatcher.take_stats() for layer in self.model.moe_layers()]
        stats = [st for st in got if st is not None]
        if not stats:
            return {}
        mine = sum(st.exchange_s for st in stats)
        # forward dispatch rows and bytes sent to other nodes this step, summed over the EP
        # group, and the rows flat would have sent (they differ under comm.alltoall=dedup)
        sent = [float(sum(st.remote_rows for st in stats)),
                float(sum(st.remote_bytes for st in stats)),
                float(sum(st.flat_remote_rows for st in stats))]
        t = torch.tensor([mine, -mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.mesh.ep_group)
        out = {"ep_exchange_max_s": float(t[0]), "ep_exchange_min_s": float(-t[1])}
        if stats[0].spans_nodes:  # the EP group spans nodes: rows counted
            # one sum over the EP group: the three counts, then each layer's rows sent off
            # each node (what the busiest NIC carries), layer-major
            n = stats[0].num_nodes
            v = torch.zeros(3 + len(stats) * n, dtype=torch.float64, device=self.device)
            v[:3] = torch.tensor(sent, dtype=torch.float64)
            for i, st in enumerate(stats):
                v[3 + i * n + st.node] = float(st.remote_rows)
            dist.all_reduce(v, group=self.mesh.ep_group)
            out.update(ep_remote_rows=float(v[0]), ep_remote_bytes=float(v[1]),
                       ep_flat_remote_rows=float(v[2]))
            imb = node_exchange_imbalance(v[3:].view(len(stats), n).cpu().tolist())
            if imb is not None:
                out["ep_node_imbalance"] = imb
        return out

    def memory(self) -> dict[str, float]:
        """Max over ranks of state bytes and of peak saved-activation bytes this step."""
        t = torch.tensor([float(self.state_bytes), float(self.meter.peak)], dtype=torch.float64,
                         device=self.device)
        if self.mesh.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"mem_state_bytes_max": float(t[0]), "mem_act_peak_bytes_max": float(t[1])}
