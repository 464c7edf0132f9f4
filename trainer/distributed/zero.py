"""Sharded optimizer state (ZeRO-1) and sharded gradients (ZeRO-2) over each parameter's replicas.

Every parameter has a replica group (trainer/distributed/mesh.py): non-expert ("dense") parameters are
replicated over the stage group (dp x ep ranks of a pipeline stage), expert parameters over the
dp group (the EP ranks hold different experts). Under ZeRO each parameter is OWNED by exactly
one rank of its replica group, whole (per-parameter ownership, as `ZeroRedundancyOptimizer`):

  zero=0  every rank keeps AdamW state for every parameter it holds (plain torch.optim.AdamW)
  zero=1  the owner alone keeps the parameter's AdamW state and steps it; the updated
          parameter is broadcast from the owner to its replica group (`GradSync.broadcast_params`)
  zero=2  as zero=1, and gradients are reduced to the owner only (`dist.reduce` per bucket of
          one owner's parameters); the other ranks free them as soon as their bucket launched

Ownership (`assign_owners`) is greedy by size: parameters sorted by (-numel, index), each to
the least-loaded rank (ties: the lower rank). It depends only on the parameter shapes, so it is
the same on every rank of a replica group and, for expert parameters, on every EP rank of the
same dp index: an expert migration (balance/migrate.py) swaps rows between EP ranks that both
own, or both do not own, that parameter's state, and moves the AdamW rows with the weights
exactly as without ZeRO. Checkpoints (trainer/checkpoint.py) stay layout-free: each owner
writes its parameters' state under the same logical keys a ZeRO-0 run writes (DCP takes each
key from the rank that has it), and a load fills the state of the parameters the rank owns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..layout import TRAINER_ZERO_LEVELS as ZERO_LEVELS  # the levels the trainer runs
from .precision import grad_of, has_main_grad, set_grad

__all__ = ["ZERO_LEVELS", "ZeroOptimizer", "assign_owners", "build_optimizer", "check_zero",
           "effective_zero"]


def check_zero(cfg, mesh) -> str | None:
    """Validate --parallel.zero against the mesh before any work; returns a note to log, or None.

    A replica group of one rank has nothing to shard: ZeRO is accepted there and has no effect
    on that group (dense state is still sharded over the EP ranks of a stage when dp=1 and
    ep > 1, which is why dp=1 is not refused)."""
    z = cfg.parallel.zero
    if isinstance(z, bool) or not isinstance(z, int) or z not in ZERO_LEVELS:
        raise ConfigError(f"parallel.zero={z!r}; valid: 0 (replicated state), 1 (optimizer "
                          f"state sharded), 2 (optimizer state and gradients sharded), 3 "
                          f"(parameters sharded too, gathered per layer)")
    if z == 0:
        return None
    if z == 3:
        if mesh.pp > 1 and cfg.parallel.schedule == "zb-h1":
            raise ConfigError("parallel.zero=3 with parallel.schedule='zb-h1': the split "
                              "backward computes weight gradients outside the autograd pass "
                              "FSDP2 reduce-scatters from; use gpipe, 1f1b or "
                              "interleaved-1f1b, or zero<=2")
        if cfg.balance.redundant:
            raise ConfigError(f"parallel.zero=3 with balance.redundant={cfg.balance.redundant}: "
                              f"the replica gradient sum works on whole expert rows; use "
                              f"zero<=2 with redundant slots")
    if mesh.dp * mesh.ep == 1:
        return (f"parallel.zero={z} has no effect: every replica group has one rank "
                f"(dp={mesh.dp} x ep={mesh.ep} per stage); optimizer state stays whole")
    if mesh.dp == 1:
        return (f"parallel.zero={z}: dense parameters' state is sharded over the {mesh.ep} EP "
                f"ranks of a stage; expert state stays whole (dp=1: one replica per expert)")
    return None


def effective_zero(zero: int, mesh) -> int:
    """The level the trainer runs: ZeRO-3 with every replica group of one rank (dp x ep = 1)
    has nothing to shard and runs as ZeRO-0 (check_zero's note says so)."""
    return 0 if zero == 3 and mesh.dp * mesh.ep == 1 else zero


def assign_owners(numels: list[int], n: int) -> list[int]:
    """owner [P] in 0..n-1 for parameters of the given sizes: greedy by size, deterministic."""
    load = [0] * n
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


class _StateView(Mapping):
    """`optim.state` keyed by the model's parameters: for a bf16 weight, the state of its
    fp32 master in the inner AdamW, which also holds the master itself under "master" (so the
    checkpoint, the migration's per-row moves and the memory report see it as state)."""

    def __init__(self, opt: ZeroOptimizer) -> None:
        self.opt = opt

    def _key(self, p):
        return self.opt.master.get(p, p)

    def __getitem__(self, p):
        if self.opt.inner is None or not self.opt.owns(p):
            raise KeyError(p)
        return self.opt.inner.state[self._key(p)]

    def __iter__(self):
        return iter(p for g in self.opt.param_groups for p in g["params"] if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, p) -> bool:
        return (self.opt.inner is not None and self.opt.owns(p)
                and self._key(p) in self.opt.inner.state)


class ZeroOptimizer:
    """AdamW over the parameters this rank owns, with the interface the trainer uses.

    `param_groups` lists every parameter (as the plain optimizer would); the trainer sets
    g["lr"] there and `step()` hands the hyperparameters to the inner AdamW, steps the owned
    parameters, then broadcasts every parameter from its owner. `state` is the inner AdamW's
    state (owned parameters only): the checkpoint, the migration and the memory report read it.

    bf16 weights (trainer/distributed/precision.py): the inner AdamW steps an fp32 master of each owned
    bf16 parameter (created from the fp32 values before the cast, `masters_from`), with the
    fp32 `main_grad` as its gradient, and the result is written back rounded to bf16; the
    broadcast then sends bf16. Their AdamW state is created at construction (step 0, zero
    moments: what AdamW's first step would create), so it can hold the master beside it.
    At zero=0 every rank owns everything (this class then serves bf16 weights only).
    """

    def __init__(self, groups: list[dict[str, Any]], sync, masters_from=None,
                 **defaults: Any) -> None:
        self.sync = sync
        self.defaults = defaults
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.master: dict[nn.Parameter, torch.Tensor] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if has_main_grad(p) and sync.owns(p):
                    src = masters_from.get(p) if masters_from else None
                    self.master[p] = src if src is not None and src.dtype == torch.float32 \
                        else p.detach().float().clone()
        owned = [{**g, "params": [self.master.get(p, p) for p in g["params"] if sync.owns(p)]}
                 for g in self.param_groups]
        # torch.optim refuses an optimizer without parameters (a rank may own none)
        self.inner = (torch.optim.AdamW(owned, **defaults)
                      if any(g["params"] for g in owned) else None)
        if self.inner is not None:
            for m in self.master.values():
                self.inner.state[m].update(
                    step=torch.zeros((), dtype=torch.float32),
                    exp_avg=torch.zeros_like(m, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(m, memory_format=torch.preserve_format),
                    master=m)
        self._state = _StateView(self)

    @property
    def state(self):
        return self._state

    def owns(self, p: nn.Parameter) -> bool:
        return self.sync.owns(p)

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            for og, ig in zip(self.param_groups, self.inner.param_groups, strict=True):
                for k, v in og.items():
                    if k != "params":
                        ig[k] = v
            for p, m in self.master.items():
                m.grad = grad_of(p)
            self.inner.step()
            for p, m in self.master.items():
                p.copy_(m)  # round the updated master to the bf16 working weight
                m.grad = None
        self.sync.broadcast_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                    set_grad(p, None)  # the fp32 main_grad of a bf16 weight
                else:
                    for gr in {id(t): t for t in (p.grad, grad_of(p)) if t is not None}.values():
                        gr.zero_()


def build_optimizer(model: nn.Module, sync, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float, masters_from=None):
    """The trainer's AdamW: decay for matrices (dim >= 2), none for vectors; plain
    torch.optim.AdamW at zero=0 with fp32 weights (exactly the optimizer of earlier
    versions), else `ZeroOptimizer` (sharded and/or with fp32 masters of bf16 weights).
    `masters_from`: {parameter: its fp32 value} to start the masters from (else the weight)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if sync.zero == 3:  # FSDP2's fp32 shards are the masters: AdamW over the DTensors
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
    if sync.zero == 0 and not any(has_main_grad(p) for p in model.parameters()):
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
    return ZeroOptimizer(groups, sync, masters_from, lr=lr, betas=betas, eps=eps,
                         foreach=False)
