"""The MoE feed-forward layer and its seam for expert parallelism.

    topk_idx, topk_w = router(x)                    logical expert ids [T, K], weights [T, K]
    slot_idx = slot of each choice                  from the slot map (migration changes it)
    x_sorted, counts, meta = permute(x, slot_idx)   rows grouped by slot, counts over E slots
    x_loc, counts_loc, ctx = dispatcher.dispatch(x_sorted, counts)    (all-to-all under EP)
    h = silu(x_loc W1[e]) * (x_loc W3[e]);  y_loc = h W2[e]           (grouped GEMMs)
    y_sorted = dispatcher.combine(y_loc, ctx)
    y = unpermute(y_sorted, topk_w, meta) (+ shared_experts(x))

Single process: `LocalDispatcher` is the identity and this process holds all E slots. The
trainer swaps `dispatcher` for an all-to-all one (`comm.ep.EPDispatcher`) and shrinks `experts`
to its E_local slots. Both implement the `comm.ep.Dispatcher` Protocol (this package does not
import comm: LocalDispatcher satisfies it by shape; tests/test_model_moe.py checks it).

Shape legend: B batch, S sequence, T = B*S tokens, D model, F expert ffn, E experts (slots),
K top-k, M rows after dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from piper_kernels import grouped_gemm, permute, unpermute

from .config import ModelConfig
from .recompute import recompute
from .router import Router


def replica_slots(topk_idx: torch.Tensor, rep_slots: torch.Tensor,
                  n_rep: torch.Tensor) -> torch.Tensor:
    """Physical slot of every (token, choice) when experts have replicas: the j-th assignment
    to expert e (in token order within this process's batch) goes to replica j mod n_rep[e].
    Deterministic, and each replica gets an even share (counts differ by at most one).
    topk_idx [T, K] logical ids; rep_slots [E, max_rep]; n_rep [E] -> slots [T, K]."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_rep.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return rep_slots[flat, rank % n_rep[flat]].view_as(topk_idx)


class SwiGLU(nn.Module):
    """Dense gated FFN: w2(silu(w1 x) * w3 x). Used for dense layers and shared experts."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(d_model, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, d_model, bias=False)  # down
        self.recompute_inner = False  # activation checkpointing "selective" (model.checkpointing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_inner:
            return recompute(self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """E_local SwiGLU experts stacked for the grouped GEMM: w1, w3 [E, D, F], w2 [E, F, D]
    (input dim first, so `grouped_gemm(x, w, offs)` takes them as they are)."""

    def __init__(self, n_experts: int, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model))
        self.recompute_inner = False  # activation checkpointing "selective" (model.checkpointing)
        self.first_slot = 0  # global slot of local expert 0 (set when experts are sharded over EP)

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows of x grouped by local expert, counts_E rows each -> [M, D]."""
        if counts_E.shape != (self.num_experts,):
            raise ValueError(
                f"counts has shape {tuple(counts_E.shape)}, expected ({self.num_experts},) "
                "(one entry per local expert)"
            )
        offs = torch.cumsum(counts_E, dim=0).to(torch.int32)
        # autocast does not reach inside custom autograd ops: cast to its dtype here so the
        # expert GEMMs run in bf16 under the trainer's GPU autocast like every nn.Linear.
        dev = x_MD.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_MD.dtype
        x_MD = x_MD.to(dtype)
        if self.recompute_inner:
            return recompute(self._swiglu, x_MD, offs, dtype)
        return self._swiglu(x_MD, offs, dtype)

    def _swiglu(self, x_MD: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # a named range in torch.profiler traces (--train.profile_steps); ~free when not profiling
        with record_function("moe.grouped_gemm"):
            # bf16 working weights (trainer/distributed/precision.py) are used as they are: no per-call
            # copy; fp32 weights under bf16 autocast are cast here (autocast's own rule)
            w1, w3, w2 = (w if w.dtype == dtype else w.to(dtype)
                          for w in (self.w1, self.w3, self.w2))
            h = F.silu(grouped_gemm(x_MD, w1, offs)) * grouped_gemm(x_MD, w3, offs)
            return grouped_gemm(h, w2, offs)


class LocalDispatcher:
    """Single-process dispatcher (`comm.ep.Dispatcher`): every slot is local, so dispatch and
    combine are identities and there are no exchanges to report."""

    pipelined = False
    ep, group, topology = 1, None, None  # every slot on this process

    def dispatch(
        self, x_sorted: torch.Tensor, counts_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return x_sorted, counts_E, None

    def combine(self, y_loc: torch.Tensor, ctx: Any) -> torch.Tensor:
        return y_loc

    def moe_forward(self, layer: Any, x_TD: torch.Tensor, slot_idx: torch.Tensor,
                    topk_w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LocalDispatcher is not pipelined: MoELayer runs dispatch/combine")

    def take_stats(self) -> None:
        return None


class MoELayer(nn.Module):
    """Routed SwiGLU experts + optional shared expert(s); see the module docstring.

    After each forward: `last_counts` [E] (detached tokens per LOGICAL expert, this process's
    tokens only) and `last_aux_loss` (0-dim, differentiable; see `model.router`).
    """

    # buffers (register_buffer in __init__), declared for the type checker; all three are
    # derived from the slot map by set_slots (write the map, never them)
    expert2slot: torch.Tensor  # [E] logical expert -> its first slot
    rep_slots: torch.Tensor  # [E, max replicas]
    n_rep: torch.Tensor  # [E]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts = E
        self.router = Router(cfg)
        self.experts = GroupedExperts(E, cfg.d_model, cfg.moe_ffn_dim)
        self.shared_experts = (
            SwiGLU(cfg.d_model, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
        )
        # Qwen2-MoE gates the shared expert per token with sigmoid(x . g).
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_expert_gate else None
        # The placement is one slot map: slot2expert [n_slots] (n_slots >= E physical slots,
        # each holding a logical expert; on the host: the trainer reads it every step without a
        # device sync), every expert at least once, with redundant slots (balance.plan_replicas)
        # hot experts several times. Migration and replica re-placement both change it
        # (set_slots). Derived from it: the replica counts n_rep [E], the replicas' slots
        # rep_slots [E, max replicas] (a token for expert e goes to one of them,
        # `replica_slots`), and expert2slot [E], each expert's first slot (a state_dict key
        # since before the slot map; a load_state_dict re-derives the map from it).
        self.n_slots = E
        self.initial_slots: list[int] = list(range(E))  # what reset_state restores
        self.slot2expert = torch.arange(E, dtype=torch.long)
        self.register_buffer("expert2slot", torch.arange(E, dtype=torch.long))
        self.register_buffer("rep_slots", torch.arange(E, dtype=torch.long)[:, None],
                             persistent=False)  # [E, max replicas], padded with the first
        self.register_buffer("n_rep", torch.ones(E, dtype=torch.long), persistent=False)
        self.register_load_state_dict_post_hook(MoELayer._slots_from_state_dict)
        self.dispatcher: Any = LocalDispatcher()
        # None: this process holds whole sequences. Set from outside (tensor parallel,
        # trainer/distributed/tensor_parallel.SeqShards) when each sequence is split over processes:
        # `split_input` (the input is whole here; route a share), scatter / gather, sum, parts
        self.seq_split: Any = None
        self.last_counts = torch.zeros(E, dtype=torch.long)
        self.last_aux_loss = torch.zeros(())

    def resize_slots(self, slot2expert: list[int]) -> None:
        """Give the layer len(slot2expert) >= E expert slots with this initial map (before
        `materialize`: the expert weights are re-created with one row per slot; every slot is
        initialised as its logical expert, so replicas start identical)."""
        n = len(slot2expert)
        ex = self.experts
        for name in ("w1", "w3", "w2"):
            w = getattr(ex, name)
            setattr(ex, name, nn.Parameter(torch.empty(n, *w.shape[1:], dtype=w.dtype,
                                                       device=w.device)))
        self.n_slots = n
        self.initial_slots = [int(e) for e in slot2expert]
        self.set_slots(self.initial_slots)

    @torch.no_grad()
    def set_slots(self, slot2expert: Sequence[int] | torch.Tensor) -> None:
        """Install a slot map (length n_slots; every expert at least once): the replica tables
        and `expert2slot` (each expert's first slot, which checkpoints save)."""
        E, dev = self.num_experts, self.expert2slot.device
        m = torch.as_tensor(slot2expert, dtype=torch.long).reshape(-1).cpu()
        if m.numel() != self.n_slots:
            raise ValueError(f"slot map has {m.numel()} slots; this layer has {self.n_slots}")
        if m.numel() and (int(m.min()) < 0 or int(m.max()) >= E):
            raise ValueError(f"slot map names expert {int(m.max()) if int(m.max()) >= E else int(m.min())}; "
                             f"valid ids are 0..{E - 1}")
        n_rep = torch.bincount(m, minlength=E)
        if int(n_rep.min()) == 0:
            raise ValueError(f"slot map misses expert(s) {torch.nonzero(n_rep == 0).flatten().tolist()[:8]}")
        order = torch.argsort(m, stable=True)  # slots grouped by expert, in slot order
        starts = torch.cumsum(n_rep, 0) - n_rep
        reps = torch.empty(E, int(n_rep.max()), dtype=torch.long)
        reps[:] = order[starts][:, None]  # pad with the first replica
        within = torch.arange(m.numel()) - starts[m[order]]
        reps[m[order], within] = order
        self.slot2expert = m
        self.rep_slots, self.n_rep = reps.to(dev), n_rep.to(dev)
        self.expert2slot.copy_(order[starts].to(dev))

    @property
    def replicated(self) -> bool:
        """Whether the layer has redundant slots (n_slots > E: some expert holds several)."""
        return self.n_slots > self.num_experts

    @staticmethod
    def _slots_from_state_dict(module: nn.Module, incompatible: Any) -> None:
        """After load_state_dict: the loaded expert2slot is the placement of a layer without
        redundant slots (each expert's only slot); with them it names first slots only, and
        the map stays (checkpoints keep it in meta.json: trainer/checkpoint.py)."""
        assert isinstance(module, MoELayer)
        if not module.replicated:
            e2s = module.expert2slot.cpu()
            if sorted(e2s.tolist()) != list(range(module.num_experts)):
                raise ValueError(f"loaded expert2slot {e2s.tolist()} is not a permutation of "
                                 f"0..{module.num_experts - 1}")
            m = torch.empty_like(e2s)
            m[e2s] = torch.arange(module.num_experts)
            module.set_slots(m)

    def slot_map(self) -> torch.Tensor:
        """slot -> logical expert for every slot ([n_slots], on the host): the placement."""
        return self.slot2expert

    def replica_counts(self) -> torch.Tensor:
        """Replicas of each logical expert ([E], on the host)."""
        return torch.bincount(self.slot_map(), minlength=self.num_experts)

    @torch.no_grad()
    def reset_state(self) -> None:
        """Initial buffers and per-forward outputs: identity placement (or the initial slot map
        of `resize_slots`), zero router bias."""
        dev = self.expert2slot.device
        self.set_slots(self.initial_slots)
        self.router.e_score_correction_bias.zero_()
        self.last_counts = torch.zeros(self.num_experts, dtype=torch.long, device=dev)
        self.last_aux_loss = torch.zeros((), device=dev)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        sp = self.seq_split
        split = sp is not None and sp.split_input
        # a whole sequence held by several processes (tensor parallel without SP): each
        # routes its share, so every token is routed once, and the outputs are gathered
        y = self._routed(sp.scatter(x_BSD) if split else x_BSD)
        if split:
            y = sp.gather(y)
        # a pipelined dispatcher (comm/ep/pipeline.py) ran the shared experts itself, beside
        # its exchanges (it is refused with tensor parallel: trainer/setup.py)
        if self.shared_experts is not None and not self.dispatcher.pipelined:  # on [B, S, D]: the sequence
            shared = self.shared_experts(x_BSD)  # dim stays visible to tensor parallel
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_BSD)) * shared
            y = y + shared
        return y

    def _routed(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [B, S, D] (weighted by the router) for x [B, S, D]."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        topk_idx, topk_w, aux = self.router.route(x_BSD)
        self.last_aux_loss = aux
        self.last_counts = torch.bincount(topk_idx.flatten(), minlength=self.num_experts).detach()
        if self.replicated:
            slot_idx = replica_slots(topk_idx, self.rep_slots, self.n_rep)
        else:
            slot_idx = self.expert2slot[topk_idx]
        if self.dispatcher.pipelined:
            # the dispatcher runs the whole expert path, shared experts included: chunked and
            # overlapped with its exchanges, or deduplicated (comm/ep/pipeline.py)
            return self.dispatcher.moe_forward(self, x_TD, slot_idx, topk_w).view(B, S, D)
        x_sorted, counts, meta = self.sort_rows(x_TD, slot_idx)
        x_loc, counts_loc, ctx = self.dispatcher.dispatch(x_sorted, counts)
        y_loc = self.experts(x_loc, counts_loc)
        y_sorted = self.dispatcher.combine(y_loc, ctx)
        y = self.unsort_rows(y_sorted, topk_w.to(y_sorted.dtype), meta)
        return y.view(B, S, D)

    def sort_rows(self, x_TD: torch.Tensor, slot_idx: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One row per (token, choice) grouped by slot [T*K, D], the counts per slot [n_slots],
        and what `unsort_rows` needs (piper_kernels.permute)."""
        return permute(x_TD, slot_idx, self.n_slots)

    def unsort_rows(self, y_sorted: torch.Tensor, topk_w: torch.Tensor, meta: Any
                    ) -> torch.Tensor:
        """The weighted sum per token [T, D] of its choices' rows (piper_kernels.unpermute)."""
        return unpermute(y_sorted, topk_w, meta)

    def shared_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, D] (gated per token when the model has the gate)."""
        assert self.shared_experts is not None
        shared = self.shared_experts(x_TD)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x_TD)) * shared
        return shared
