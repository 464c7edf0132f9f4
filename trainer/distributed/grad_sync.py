"""Gradient averaging over each parameter's replica group, ZeRO-2 reduction to owners, the global
norm and clipping (`GradSync`); the sharded optimizer is trainer/distributed/zero.py.

Every rank's loss is the mean over its data shard's sequences (B / n sequences, n = the
stage's data shards: dp*ep, or dp*ep/tp under tensor parallel, whose TP ranks share a shard),
so the global loss is the mean over the n shards:
  non-expert grads ("dense"): sum over the dense group (the stage's ranks with this rank's TP
                    index: every rank of the stage at tp = 1), / n. A TP-sharded weight's
                    gradient is its shard's (DP only); a TP-replicated weight's is equal on
                    the TP ranks
  "partial":        replicated weights whose gradient is a partial sum over the TP ranks'
                    tokens (trainer/distributed/tensor_parallel.py): sum over the whole stage, / n
  expert grads:     sum over the dp group, / n  (the EP all-to-all already summed the
                    contributions of the whole EP group into the owner's grad; each token is
                    routed once, also under TP)
DTensor (TP) parameters are reduced through their local shards.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .mesh import Mesh
from .parallel import is_expert_param
from .precision import accumulate_main_grad, grad_of, has_main_grad, set_grad
from .tensor_parallel import grad_kind, local

__all__ = ["GradSync"]


class _Bucket:
    """Gradients of a few parameters reduced by one collective.

    kind: "dense" (replicated over the stage group) or "expert" (over the dp group); owner:
    the group rank the bucket is reduced to under ZeRO-2 (None: all-reduced to every rank)."""

    __slots__ = ("idx", "params", "kind", "owner", "pending", "buf", "wire", "work")

    def __init__(self, idx: int, kind: str, owner: int | None) -> None:
        self.idx, self.kind, self.owner = idx, kind, owner
        self.params: list[nn.Parameter] = []
        self.pending = 0
        self.buf: torch.Tensor | None = None
        self.wire: torch.Tensor | None = None  # the buffer in reduce_dtype, when it differs
        self.work = None


class GradSync:
    """Averages gradients over each parameter's replica group, in buckets, and clips them.

    Two ways to drive it:
      start_step(m); m x (forward; backward); finish()   reduction overlapped with backward:
          each parameter's post-accumulate-grad hook counts its accumulations; after the m-th
          its gradient is final, and a bucket whose parameters are all final is launched as an
          async collective (async_op=True) while backward goes on.
      sync()   after the whole backward: today's single flat all-reduce per group (zero=0 only;
          kept for callers that do not drive the hooks).

    Buckets are fixed at construction and launched strictly in id order on every rank, also
    when they become ready out of order (a later bucket waits for the earlier ones): NCCL (and
    gloo) match collectives on a group by issue order, so every rank must issue them in one
    global order. Ids follow reverse parameter order (roughly the order backward produces the
    gradients). A parameter whose hook does not fire m times (an expert that received no token
    in a micro-batch, a zero-bubble W step that accumulates `.grad` by hand) leaves its bucket
    and every later one for `finish()`, which launches them in the same id order: correct,
    only less overlap. overlap=False builds one bucket per group (per owner under ZeRO-2) in
    forward parameter order, launched by `finish()`: with zero=0 that is exactly the flat
    all-reduce of earlier versions (bitwise the same losses; gloo's sums depend on an
    element's position in the buffer, so another bucketing can differ in the last bit).

    No full extra copy of the gradients: a launched bucket's flat buffer becomes the
    parameters' `.grad` (views into it), and the separate gradient tensors are dropped; under
    ZeRO-2 the non-owners drop them without a view (freed once the reduce completed).

    bf16 weights (trainer/distributed/precision.py): each backward's bf16 gradient is added into the
    parameter's fp32 `main_grad` by its post-accumulate-grad hook (registered with or without
    overlap), and everything here reads and writes `main_grad` for those parameters
    (`grad_of` / `set_grad`). `reduce_dtype` bf16 sends a bf16 copy of each bucket and adds
    the result back into the fp32 buffer.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, zero: int = 0, bucket_bytes: int = 25 << 20,
                 overlap: bool = True, reduce_dtype: torch.dtype = torch.float32):
        from .zero import ZERO_LEVELS, assign_owners

        if zero not in ZERO_LEVELS or zero == 3:
            raise ValueError(f"zero={zero!r}; valid: 0, 1, 2 (ZeRO-3: trainer.distributed.zero3.Zero3Sync)")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.mesh, self.zero, self.overlap = mesh, zero, overlap
        self.reduce_dtype = reduce_dtype
        # {expert param: [S] row weights} for the norm under redundant slots (trainer/distributed/replicas)
        self.row_weights: dict[nn.Parameter, torch.Tensor] = {}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dense = [p for n, p in named if not is_expert_param(n)]
        self.expert = [p for n, p in named if is_expert_param(n)]
        self.scale = 1.0 / mesh.n_data_shards
        tp = mesh.tp
        self.groups = {"dense": mesh.dense_group, "partial": mesh.stage_group,
                       "expert": mesh.dp_group}
        # gradient kind of each parameter, and its weight in the global norm: a TP-replicated
        # gradient is held by every TP rank and counts 1/tp on each (trainer/distributed/tensor_parallel)
        tpk = {id(p): grad_kind(model, n, p) for n, p in named if not is_expert_param(n)}
        self._kind = {id(p): "expert" for p in self.expert}
        self._kind.update({i: "partial" if k == "partial" and tp > 1 else "dense"
                           for i, k in tpk.items()})
        self.norm_w = {i: (1.0 if k == "sharded" or tp == 1 else 1.0 / tp)
                       for i, k in tpk.items()}
        self.group_size = {k: (dist.get_world_size(g) if g is not None else 1)
                           for k, g in self.groups.items()}
        self.group_rank = {k: (dist.get_rank(g) if g is not None else 0)
                           for k, g in self.groups.items()}
        # owner (group rank) of every parameter; ZeRO-0 keeps it too (unused there)
        self._owner: dict[int, tuple[str, int]] = {}
        for kind in ("dense", "partial", "expert"):
            ps = [p for p in self.dense + self.expert if self._kind[id(p)] == kind]
            for p, o in zip(ps, assign_owners([local(p).numel() for p in ps],
                                              self.group_size[kind]), strict=True):
                self._owner[id(p)] = (kind, o)
        order = [p for _, p in named]
        self.buckets = self._make_buckets(order[::-1] if overlap else order,
                                          bucket_bytes if overlap else None, zero == 2, True)
        # broadcast buckets of updated parameters (ZeRO-1/2): one owner each, forward order
        self.bcast = self._make_buckets(order, bucket_bytes, True, False) if zero else []
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._m = 0  # accumulations per step; 0: hooks idle (no start_step)
        self._count: dict[int, int] = {}
        self._next = 0  # id of the next bucket to launch
        self.launched_in_backward = 0  # buckets the hooks launched in the last step (overlap)
        for p in order:  # bf16 weights need the hook for their fp32 main_grad in any case
            if overlap or has_main_grad(p):
                p.register_post_accumulate_grad_hook(self._hook)

    def _make_buckets(self, params: list[nn.Parameter], cap: int | None,
                      by_owner: bool, grads: bool) -> list[_Bucket]:
        """grads: buckets of gradients (fp32 for bf16 weights), else of the weights."""
        buckets: list[_Bucket] = []
        open_: dict[tuple, tuple[_Bucket, int]] = {}
        for p in params:
            kind, owner = self._owner[id(p)]
            dtype = torch.float32 if grads and has_main_grad(p) else p.dtype
            nbytes = local(p).numel() * dtype.itemsize  # this rank's shard under TP
            key = (kind, owner if by_owner else None, dtype, p.device)
            b, size = open_.get(key, (None, 0))
            if b is None or (cap is not None and size + nbytes > cap and b.params):
                b, size = _Bucket(len(buckets), kind, key[1]), 0
                buckets.append(b)
            b.params.append(p)
            open_[key] = (b, size + nbytes)
        return buckets

    def _wire(self, flat: torch.Tensor) -> torch.Tensor:
        """The buffer as the collective sends it: a bf16 copy of fp32 gradients under
        reduce_dtype=bf16, else the buffer itself (fp64 stays fp64)."""
        if flat.dtype == torch.float32 and self.reduce_dtype != torch.float32:
            return flat.to(self.reduce_dtype)
        return flat

    def owns(self, p: nn.Parameter) -> bool:
        """Whether this rank keeps p's optimizer state (always at zero=0)."""
        if self.zero == 0 or id(p) not in self._owner:
            return True
        kind, o = self._owner[id(p)]
        return o == self.group_rank[kind]

    # -- reduction --------------------------------------------------------------------------
    def start_step(self, m: int = 1) -> None:
        """Arm the hooks for a step of m micro-batches (m backward passes per parameter)."""
        if m < 1:
            raise ValueError(f"m={m} micro-batches; need >= 1")
        self._m, self._count, self._next = m, {}, 0
        self.launched_in_backward = 0
        for b in self.buckets:
            b.pending, b.buf, b.work = len(b.params), None, None

    def _hook(self, p: nn.Parameter) -> None:
        accumulate_main_grad(p)  # bf16 weights: into the fp32 main_grad (else a no-op)
        if not self._m or not self.overlap:
            return
        c = self._count.get(id(p), 0) + 1
        self._count[id(p)] = c
        if c > self._m:
            raise RuntimeError(f"a parameter of shape {list(p.shape)} accumulated a gradient "
                               f"{c} times in a step armed for {self._m} micro-batches "
                               f"(GradSync.start_step(m) must get the number of backward passes)")
        if c < self._m:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self.launched_in_backward += 1

    def _launch(self, b: _Bucket) -> None:
        assert b.idx == self._next, (b.idx, self._next)
        self._next += 1
        for p in b.params:  # a bf16 gradient a hook did not see (e.g. a hand-accumulated W)
            accumulate_main_grad(p)
        grads = [_local_grad(p) for p in b.params]
        # one parameter: its own gradient is the buffer (a view, no copy)
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 \
            else grads[0].reshape(-1)
        group = self.groups[b.kind]
        mine = b.owner is None or b.owner == self.group_rank[b.kind]
        if group is not None:
            wire = self._wire(flat)
            b.wire = wire if wire is not flat else None
            if b.owner is None:
                b.work = dist.all_reduce(wire, group=group, async_op=True)
            else:
                b.work = dist.reduce(wire, dist.get_global_rank(group, b.owner), group=group,
                                     async_op=True)
        b.buf = flat
        i = 0
        for p in b.params:  # the flat buffer becomes the gradient storage (owners)
            n = local(p).numel()
            set_grad(p, _as_grad(p, flat[i:i + n]) if mine else None)
            i += n

    def finish(self) -> None:
        """Launch the buckets not launched yet (in id order), wait for all, average."""
        if not self._m:  # not armed: a plain backward without hooks counting
            self.start_step(1)
        for b in self.buckets[self._next:]:
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            assert b.buf is not None, "every bucket was launched (by a hook or above)"
            if b.owner is None or b.owner == self.group_rank[b.kind]:
                if b.wire is not None:  # reduced in bf16: back into the fp32 gradients
                    b.buf.copy_(b.wire)
                b.buf.mul_(self.scale)
            b.buf, b.wire, b.work = None, None, None
        self._m = 0

    def _allreduce(self, params: list[nn.Parameter], group, scale: float) -> None:
        grads = [_local_grad(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if group is not None:
            wire = self._wire(flat)
            dist.all_reduce(wire, group=group)
            if wire is not flat:
                flat.copy_(wire)
        flat.mul_(scale)
        i = 0
        for p in params:
            n = local(p).numel()
            set_grad(p, _as_grad(p, flat[i:i + n].clone()))
            i += n

    def sync(self) -> None:
        """The reduction of earlier versions, after the whole backward (zero=0 only)."""
        if self.zero:
            raise RuntimeError(f"GradSync.sync() reduces for zero=0; with zero={self.zero} "
                               f"use start_step(m) / finish()")
        for p in self.dense + self.expert:
            accumulate_main_grad(p)  # every parameter gets a gradient: _local_grad's zeros
        for kind in ("dense", "partial", "expert"):  # (e.g. an expert that received no token)
            self._allreduce([p for p in self.dense + self.expert if self._kind[id(p)] == kind],
                            self.groups[kind], self.scale)

    # -- after the reduction ------------------------------------------------------------------
    @staticmethod
    def _grad(p: nn.Parameter) -> torch.Tensor:
        g = grad_of(p)
        if g is None:  # finish() / sync() give every reduced parameter one
            raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient after "
                               "the reduction")
        return g

    def _sq(self, p: nn.Parameter) -> torch.Tensor:
        """Squared norm of p's gradient; expert slots of replicated experts weigh 1 / replicas
        (`row_weights`, set per step with redundant slots), so each expert counts once."""
        g = local(self._grad(p)).double()
        w = self.row_weights.get(p)
        if w is None:
            sq = g.pow(2).sum()
            nw = self.norm_w.get(id(p), 1.0)
            if self.zero == 2 and self._kind[id(p)] == "partial":
                nw = 1.0  # one owner over the whole stage
            return sq if nw == 1.0 else sq * nw
        return (g.pow(2).reshape(g.shape[0], -1).sum(1) * w).sum()

    def clip(self, max_norm: float) -> float:
        """Scale all grads so the global L2 norm is <= max_norm; returns the norm before clipping.

        ZeRO-2: each rank holds only its owned grads; every grad of a stage has exactly one
        owner in the stage group (dense: one per dense group, i.e. per TP index, each holding
        its shard or, for a TP-replicated weight, counting 1/tp; partial: one per stage;
        experts: one per dp group, and the EP ranks of a dp index hold different experts),
        so one sum over the stage group gives the stage's squared norm. Otherwise the dense
        squares are summed over the TP group (shards differ; replicas count 1/tp each)."""
        if self.zero == 2:
            sq = sum((self._sq(p) for p in self.dense + self.expert
                      if grad_of(p) is not None), torch.zeros((), dtype=torch.float64))
            if self.mesh.stage_group is not None:
                dist.all_reduce(sq, group=self.mesh.stage_group)
            total = sq
        else:
            dense_sq = sum((self._sq(p) for p in self.dense),
                           torch.zeros((), dtype=torch.float64))
            if self.mesh.tp_group is not None:
                dist.all_reduce(dense_sq, group=self.mesh.tp_group)
            expert_sq = sum((self._sq(p) for p in self.expert),
                            torch.zeros((), dtype=torch.float64))
            if self.mesh.ep_group is not None:  # expert shards differ across the EP group
                dist.all_reduce(expert_sq, group=self.mesh.ep_group)
            total = dense_sq + expert_sq
        if self.mesh.pp_group is not None:  # every stage holds different layers
            dist.all_reduce(total, group=self.mesh.pp_group)
        norm = math.sqrt(float(total))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for p in self.dense + self.expert:
                if (g := grad_of(p)) is not None:
                    g.mul_(coef)
        return norm

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """ZeRO-1/2, after the owners stepped: every parameter from its owner to its replicas
        (async broadcasts launched in bucket order, then waited)."""
        pending = []
        for b in self.bcast:
            group = self.groups[b.kind]
            if group is None:
                continue
            assert b.owner is not None, "broadcast buckets have one owner each (by_owner)"
            mine = b.owner == self.group_rank[b.kind]
            single = len(b.params) == 1 and local(b.params[0].data).is_contiguous()
            if single:
                flat = local(b.params[0].data)
            elif mine:
                flat = self.pack_bucket(b)
            else:
                flat = torch.empty(sum(local(p).numel() for p in b.params),
                                   dtype=b.params[0].dtype, device=b.params[0].device)
            work = dist.broadcast(flat, dist.get_global_rank(group, b.owner), group=group,
                                  async_op=True)
            pending.append((b, flat, work, mine or single))
        for b, flat, work, done in pending:
            work.wait()
            if not done:  # else the owner's own values, or broadcast in place
                self.unpack_bucket(b, flat)

    @staticmethod
    def pack_bucket(b) -> torch.Tensor:
        """A broadcast bucket's parameters (local shards) as one flat tensor (the owner's
        copy that `broadcast_params` sends)."""
        return torch.cat([local(p.data).reshape(-1) for p in b.params])

    @staticmethod
    def unpack_bucket(b, flat: torch.Tensor) -> None:
        """Copy a received flat bucket back into its parameters' local shards."""
        i = 0
        for p in b.params:
            d = local(p.data)
            n = d.numel()
            d.copy_(flat[i:i + n].view_as(d))
            i += n


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    """p's gradient as the optimizer sees it (`precision.grad_of`: the fp32 main_grad of a
    bf16 weight) as a plain tensor shaped like p's local shard (zeros without one). A
    DTensor gradient placed otherwise than its parameter (a Replicate gradient of a sharded
    weight, or a Partial one outside the "partial" kind) is redistributed to it first."""
    g, pd = grad_of(p), p.data
    if g is None:
        return torch.zeros(local(pd).shape, device=p.device,
                           dtype=torch.float32 if has_main_grad(p) else p.dtype)
    if isinstance(g, DTensor) and isinstance(pd, DTensor):
        if g.placements != pd.placements and not any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(pd.device_mesh, pd.placements)
        return g._local_tensor
    return g


def _as_grad(p: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
    """The gradient for p from its flat local values (a DTensor like p for a DTensor p)."""
    if isinstance(p, DTensor):
        return DTensor.from_local(flat.view(p._local_tensor.shape), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())
    return flat.view_as(p)
