"""Apply expert parallelism to a rank-agnostic `model.MoETransformer`, and sync its gradients.

Order of application (fixed):
  1. every rank builds the full model from the same seed (so initial weights equal a 1-process run),
  2. each MoE layer keeps only the expert slots of its EP rank: slots [ep_idx*E_l, (ep_idx+1)*E_l)
     of the global slot space (logical expert e lives in slot expert2slot[e]),
  3. its dispatcher is replaced by an `EPDispatcher` over the mesh's EP group.

Shape legend: T tokens, D model, E experts (global slots), E_l = E / ep local slots, R = ep ranks.

Gradient averaging (every rank's loss is the mean over its own B/(dp*ep) sequences, so the global
loss is the mean of the rank losses over the dp*ep ranks of a stage):
  non-expert grads: sum over the stage group (dp x ep), / (dp*ep)
  expert grads:     sum over the dp group, / (dp*ep)  (the EP all-to-all already summed the
                    contributions of the whole EP group into the owner's grad)
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from .mesh import Mesh, MeshError, valid_divisors

__all__ = ["EPDispatcher", "parallelize", "is_expert_param", "GradSync"]


def is_expert_param(name: str) -> bool:
    return ".experts." in name or name.startswith("experts.")


class EPDispatcher:
    """Sends each token row to the EP rank owning its slot and brings the results back.

    dispatch: x_sorted [T*k, D] grouped by global slot (rank-major), counts [E]
      -> x_loc [N, D] grouped by local slot, counts_loc [E_l]
    The received rows come grouped by source rank, each source's block sorted by local slot; a
    fixed index (`order`) regroups them slot-major for the grouped GEMM, and combine undoes it
    before the mirrored all-to-all.
    """

    def __init__(self, group, ep: int, num_slots: int, algorithm: str = "flat", topology=None,
                 cost_model=None):
        if num_slots % ep:
            raise MeshError(f"ep={ep} does not divide {num_slots} experts; valid ep: "
                            f"{valid_divisors(num_slots)}")
        self.group, self.ep, self.num_slots = group, ep, num_slots
        self.local = num_slots // ep
        self.algorithm, self.topology = algorithm, topology
        # comm.CostModel for "auto"; None only where auto runs on one node (it is flat there):
        # across nodes comm refuses auto without a model (calibrate / from_platform / emulator)
        self.cost_model = cost_model
        # wall seconds this rank spent inside forward exchanges since the last reset: with
        # uneven expert loads it is dominated by waiting for the most-loaded rank
        self.exchange_s = 0.0

    def dispatch(self, x_sorted: torch.Tensor, counts_E: torch.Tensor):
        import comm  # the trainer wires packages together; model/ never imports comm

        R, El = self.ep, self.local
        counts_RE = counts_E.to(torch.int64).reshape(R, El)
        in_splits = counts_RE.sum(1).tolist()
        # One small exchange carries the per-slot counts (recv_SE[s, j]: rows source rank s
        # sends to my local slot j) and settles the all-to-all of both directions: sizes,
        # and for halo / auto the split matrix and the algorithm.
        row_bytes = x_sorted.element_size() * math.prod(x_sorted.shape[1:])
        with record_function("ep.plan_all_to_all"):
            plan, recv = comm.plan_all_to_all(in_splits, self.group, self.algorithm,
                                              self.topology, self.cost_model, row_bytes,
                                              counts_RE.tolist(), x_sorted.device)
        recv_SE = torch.tensor(recv, dtype=torch.int64)
        t0 = time.perf_counter()
        with record_function("ep.dispatch_all_to_all"):  # named range in profiler traces
            y, _ = comm.all_to_all(x_sorted, in_splits, self.group, plan=plan)
        self.exchange_s += time.perf_counter() - t0
        # rows arrive source-major: block (s, j) starts at starts_SE[s, j]. Output is slot-major:
        # blocks in (j, s) order; position p of output block b reads starts[b] + (p - out_start[b]).
        lens = recv_SE.flatten()
        starts_SE = (torch.cumsum(lens, 0) - lens).reshape(R, El)
        lens_T = recv_SE.t().flatten()
        out_start = torch.cumsum(lens_T, 0) - lens_T
        shift = torch.repeat_interleave(starts_SE.t().flatten() - out_start, lens_T)
        order = torch.arange(shift.numel(), dtype=torch.int64) + shift
        order = order.to(y.device)
        x_loc = y.index_select(0, order)
        counts_loc = recv_SE.sum(0)
        return x_loc, counts_loc.to(counts_E.device), (order, plan)

    def combine(self, y_loc: torch.Tensor, ctx):
        import comm

        order, plan = ctx
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        y_src = y_loc.index_select(0, inv)
        t0 = time.perf_counter()
        with record_function("ep.combine_all_to_all"):
            back, _ = comm.all_to_all(y_src, plan.out_splits, self.group, plan=plan.reverse())
        self.exchange_s += time.perf_counter() - t0
        return back


def parallelize(model: nn.Module, mesh: Mesh, alltoall: str = "flat", topology=None,
                cost_model=None) -> nn.Module:
    """Shard the experts of every MoE layer over the mesh's EP group (in place)."""
    if mesh.ep == 1:
        return model
    for layer in model.moe_layers():
        disp = EPDispatcher(mesh.ep_group, mesh.ep, layer.expert2slot.numel(), alltoall, topology,
                            cost_model)
        lo, hi = mesh.ep_idx * disp.local, (mesh.ep_idx + 1) * disp.local
        ex = layer.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(ex, name)
            setattr(ex, name, nn.Parameter(full.detach()[lo:hi].clone()))
        ex.first_slot = lo
        layer.dispatcher = disp
    return model


class GradSync:
    """Averages gradients over the right groups and computes the global gradient norm."""

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.mesh = mesh
        self.dense = [p for n, p in model.named_parameters() if p.requires_grad and not is_expert_param(n)]
        self.expert = [p for n, p in model.named_parameters() if p.requires_grad and is_expert_param(n)]
        self.scale = 1.0 / (mesh.dp * mesh.ep)

    @staticmethod
    def _allreduce(params: list[nn.Parameter], group, scale: float) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat.mul_(scale)
        i = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[i:i + n].view_as(g))
            i += n

    def sync(self) -> None:
        for p in self.dense + self.expert:
            if p.grad is None:  # e.g. an expert that received no token: its grad is zero
                p.grad = torch.zeros_like(p)
        self._allreduce(self.dense, self.mesh.stage_group, self.scale)
        self._allreduce(self.expert, self.mesh.dp_group, self.scale)

    def clip(self, max_norm: float) -> float:
        """Scale all grads so the global L2 norm is <= max_norm; returns the norm before clipping."""
        dense_sq = sum((p.grad.double().pow(2).sum() for p in self.dense), torch.zeros((), dtype=torch.float64))
        expert_sq = sum((p.grad.double().pow(2).sum() for p in self.expert), torch.zeros((), dtype=torch.float64))
        if self.mesh.ep_group is not None:  # expert shards differ across the EP group
            dist.all_reduce(expert_sq, group=self.mesh.ep_group)
        total = dense_sq + expert_sq
        if self.mesh.pp_group is not None:  # every stage holds different layers
            dist.all_reduce(total, group=self.mesh.pp_group)
        norm = math.sqrt(float(total))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for p in self.dense + self.expert:
                p.grad.mul_(coef)
        return norm
