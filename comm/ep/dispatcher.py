"""Apply expert parallelism to a rank-agnostic `model.MoETransformer` (gradient averaging over
the replica groups: trainer/grad_sync.py).

Order of application (fixed):
  1. every rank builds the full model from the same seed (so initial weights equal a 1-process run),
  2. each MoE layer keeps only the expert slots of its EP rank: slots [ep_idx*E_l, (ep_idx+1)*E_l)
     of the global slot space (logical expert e lives in slot expert2slot[e]),
  3. its dispatcher is replaced by an `EPDispatcher` over the mesh's EP group.

Shape legend: T tokens, D model, E experts (global slots), E_l = E / ep local slots, R = ep ranks.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from model import MoETransformer

from .mesh import Mesh, MeshError, valid_divisors

__all__ = ["EPDispatcher", "parallelize", "is_expert_param"]


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
                 cost_model=None, overlap: str = "none", chunks: int = 1):
        if num_slots % ep:
            raise MeshError(f"ep={ep} does not divide {num_slots} experts; valid ep: "
                            f"{valid_divisors(num_slots)}")
        if overlap not in ("none", "layer"):
            raise ValueError(f"overlap={overlap!r}; valid: none, layer")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be an int >= 1")
        self.group, self.ep, self.num_slots = group, ep, num_slots
        self.local = num_slots // ep
        self.algorithm, self.topology = algorithm, topology
        if algorithm == "dedup" and topology is None:  # one node: nothing crosses, no relay
            from comm import Topology

            self.topology = Topology.uniform(1, ep)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        # comm.CostModel for "auto"; None only where auto runs on one node (it is flat there):
        # across nodes comm refuses auto without a model (calibrate / from_platform / emulator)
        self.cost_model = cost_model
        # --comm.a2a_overlap / a2a_chunks: "layer" runs trainer.ep_pipeline's chunk pipeline
        self.overlap, self.chunks = overlap, chunks if overlap == "layer" else 1
        # wall seconds this rank spent inside forward exchanges since the last reset: with
        # uneven expert loads it is dominated by waiting for the most-loaded rank. In the
        # pipeline: the seconds the forward blocked waiting for rows (the exposed part).
        self.exchange_s = 0.0
        # forward dispatch rows (and bytes) this rank sent to ranks on other nodes since the
        # last reset, and the rows a flat dispatch would have sent (one per (token, slot))
        self.remote_rows = 0
        self.remote_bytes = 0
        self.flat_remote_rows = 0
        self.handles: list = []  # the pipeline's exchanges of the running forward

    @property
    def pipelined(self) -> bool:
        """Whether `model.moe.MoELayer` hands its whole expert path to `moe_forward`."""
        return self.overlap != "none" or self.algorithm == "dedup"

    def moe_forward(self, layer, x_TD: torch.Tensor, slot_idx: torch.Tensor,
                    topk_w: torch.Tensor) -> torch.Tensor:
        """Routed (+ shared) experts' output [T, D]: trainer.ep_pipeline."""
        from .ep_pipeline import moe_forward

        self.handles = []
        try:
            with record_function("ep.pipeline"):
                return moe_forward(self, layer, x_TD, slot_idx, topk_w)
        finally:
            self.exchange_s += sum(h.waited_s for h in self.handles)
            self.handles = []

    def remote_pair_rows(self, counts: list[int]) -> int:
        """Rows of per-slot `counts` that go to ranks on other nodes (0 without a topology)."""
        if self.topology is None:
            return 0
        node, El = self.topology.rank2node, self.local
        me = node[self.rank]
        return sum(sum(counts[r * El:(r + 1) * El]) for r in range(self.ep) if node[r] != me)

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
        if self.topology is not None:
            node = self.topology.rank2node
            remote = sum(n for r, n in enumerate(in_splits) if node[r] != node[self.rank])
            self.remote_rows += remote
            self.remote_bytes += remote * row_bytes
            self.flat_remote_rows += remote
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


def parallelize(model: MoETransformer, mesh: Mesh, alltoall: str = "flat", topology=None,
                cost_model=None, redundant: int = 0, overlap: str = "none",
                chunks: int = 1) -> MoETransformer:
    """Shard the experts of every MoE layer over the mesh's EP group (in place); with
    `redundant` = r > 0 every EP rank hosts E / ep + r slots (trainer/replicas.py)."""
    if mesh.ep == 1:
        return model
    from .replicas import initial_slot_map

    for layer in model.moe_layers():
        if redundant:
            layer.resize_slots(initial_slot_map(layer.num_experts, mesh.ep, redundant))
        disp = EPDispatcher(mesh.ep_group, mesh.ep, layer.n_slots, alltoall, topology,
                            cost_model, overlap, chunks)
        lo, hi = mesh.ep_idx * disp.local, (mesh.ep_idx + 1) * disp.local
        ex = layer.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(ex, name)
            setattr(ex, name, nn.Parameter(full.detach()[lo:hi].clone()))
        ex.first_slot = lo
        layer.dispatcher = disp
    return model
