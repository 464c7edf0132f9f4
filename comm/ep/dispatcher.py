"""`EPDispatcher`: a MoE layer's rows to the EP ranks holding their slots and back (the
`comm.ep.Dispatcher` of a layer whose experts are sharded over an EP group; installed by
`trainer.distributed.parallel.parallelize`). Slot g holds logical expert slot_map()[g] (model.MoELayer); rank
r holds slots [r*E_l, (r+1)*E_l).

Shape legend: T tokens, D model, E experts (global slots), E_l = E / ep local slots, R = ep ranks.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from comm.collectives.alltoall import all_to_all, plan_all_to_all
from comm.collectives.overlap import Baton
from comm.ep.protocol import ExchangeStats, ExpertLayer
from comm.topology import Topology

__all__ = ["EPDispatcher"]


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
            valid = [d for d in range(1, num_slots + 1) if num_slots % d == 0]
            raise ValueError(f"ep={ep} does not divide {num_slots} experts; valid ep: {valid}")
        if overlap not in ("none", "layer", "fb"):
            raise ValueError(f"overlap={overlap!r}; valid: none, layer, fb")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be an int >= 1")
        self.group, self.ep, self.num_slots = group, ep, num_slots
        self.local = num_slots // ep
        self.algorithm, self.topology = algorithm, topology
        if algorithm == "dedup" and topology is None:  # one node: nothing crosses, no relay
            self.topology = Topology.uniform(1, ep)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        # comm.CostModel for "auto"; None only where auto runs on one node (it is flat there):
        # across nodes comm refuses auto without a model (calibrate / from_platform / emulator)
        self.cost_model = cost_model
        # --comm.a2a_overlap / a2a_chunks: "layer" runs comm.ep.pipeline's chunk pipeline;
        # "fb" runs it too (a2a_chunks chunks, 1 by default), its exchanges handing the
        # `baton` to another micro-batch's work right after they start (set by the step loop
        # or the pipeline runtime for the span of a step; None: nothing to hand over to)
        self.overlap, self.chunks = overlap, chunks if overlap in ("layer", "fb") else 1
        self.baton: Baton | None = None
        # this step's forward exchanges so far (returned and restarted by take_stats)
        self.stats = self._fresh_stats()

    def _fresh_stats(self) -> ExchangeStats:
        if self.topology is None:
            return ExchangeStats()
        return ExchangeStats(spans_nodes=self.topology.num_nodes > 1,
                             node=self.topology.rank2node[self.rank],
                             num_nodes=self.topology.num_nodes)

    def take_stats(self) -> ExchangeStats:
        """The forward exchanges since the last call (`comm.ep.ExchangeStats`); counting
        starts afresh."""
        out, self.stats = self.stats, self._fresh_stats()
        return out

    @property
    def pipelined(self) -> bool:
        """Whether `model.moe.MoELayer` hands its whole expert path to `moe_forward`."""
        return self.overlap != "none" or self.algorithm == "dedup"

    def moe_forward(self, layer: ExpertLayer, x_TD: torch.Tensor, slot_idx: torch.Tensor,
                    topk_w: torch.Tensor) -> torch.Tensor:
        """Routed (+ shared) experts' output [T, D]: comm.ep.pipeline."""
        from comm.ep.pipeline import moe_forward

        handles: list = []  # this call's exchanges (a local list: under fb another
        try:                # micro-batch's work may run this layer between its stages)
            with record_function("ep.pipeline"):
                return moe_forward(self, layer, x_TD, slot_idx, topk_w, handles)
        finally:
            self.stats.exchange_s += sum(h.waited_s for h in handles)

    def remote_pair_rows(self, counts: list[int]) -> int:
        """Rows of per-slot `counts` that go to ranks on other nodes (0 without a topology)."""
        if self.topology is None:
            return 0
        node, El = self.topology.rank2node, self.local
        me = node[self.rank]
        return sum(sum(counts[r * El:(r + 1) * El]) for r in range(self.ep) if node[r] != me)

    def dispatch(self, x_sorted: torch.Tensor, counts_E: torch.Tensor):
        R, El = self.ep, self.local
        counts_RE = counts_E.to(torch.int64).reshape(R, El)
        in_splits = counts_RE.sum(1).tolist()
        # One small exchange carries the per-slot counts (recv_SE[s, j]: rows source rank s
        # sends to my local slot j) and settles the all-to-all of both directions: sizes,
        # and for halo / auto the split matrix and the algorithm.
        row_bytes = x_sorted.element_size() * math.prod(x_sorted.shape[1:])
        with record_function("ep.plan_all_to_all"):
            plan, recv = plan_all_to_all(in_splits, self.group, self.algorithm,
                                              self.topology, self.cost_model, row_bytes,
                                              counts_RE.tolist(), x_sorted.device)
        recv_SE = torch.tensor(recv, dtype=torch.int64)
        if self.topology is not None:
            node = self.topology.rank2node
            remote = sum(n for r, n in enumerate(in_splits) if node[r] != node[self.rank])
            self.stats.remote_rows += remote
            self.stats.remote_bytes += remote * row_bytes
            self.stats.flat_remote_rows += remote
        t0 = time.perf_counter()
        with record_function("ep.dispatch_all_to_all"):  # named range in profiler traces
            y, _ = all_to_all(x_sorted, in_splits, self.group, plan=plan)
        self.stats.exchange_s += time.perf_counter() - t0
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
        order, plan = ctx
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        y_src = y_loc.index_select(0, inv)
        t0 = time.perf_counter()
        with record_function("ep.combine_all_to_all"):
            back, _ = all_to_all(y_src, plan.out_splits, self.group, plan=plan.reverse())
        self.stats.exchange_s += time.perf_counter() - t0
        return back
