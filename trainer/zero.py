"""Sharded optimizer state (ZeRO-1) and sharded gradients (ZeRO-2) over each parameter's replicas.

Every parameter has a replica group (trainer/mesh.py): non-expert ("dense") parameters are
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

from typing import Any

import torch
from torch import nn

from .config import ConfigError
from .layout import TRAINER_ZERO_LEVELS as ZERO_LEVELS  # the levels the trainer runs

__all__ = ["ZERO_LEVELS", "ZeroOptimizer", "assign_owners", "build_optimizer", "check_zero"]


def check_zero(cfg, mesh) -> str | None:
    """Validate --parallel.zero against the mesh before any work; returns a note to log, or None.

    A replica group of one rank has nothing to shard: ZeRO is accepted there and has no effect
    on that group (dense state is still sharded over the EP ranks of a stage when dp=1 and
    ep > 1, which is why dp=1 is not refused)."""
    z = cfg.parallel.zero
    if isinstance(z, bool) or not isinstance(z, int) or z not in ZERO_LEVELS:
        raise ConfigError(f"parallel.zero={z!r}; valid: 0 (replicated state), 1 (optimizer "
                          f"state sharded), 2 (optimizer state and gradients sharded)")
    if z == 0:
        return None
    if mesh.dp * mesh.ep == 1:
        return (f"parallel.zero={z} has no effect: every replica group has one rank "
                f"(dp={mesh.dp} x ep={mesh.ep} per stage); optimizer state stays whole")
    if mesh.dp == 1:
        return (f"parallel.zero={z}: dense parameters' state is sharded over the {mesh.ep} EP "
                f"ranks of a stage; expert state stays whole (dp=1: one replica per expert)")
    return None


def assign_owners(numels: list[int], n: int) -> list[int]:
    """owner [P] in 0..n-1 for parameters of the given sizes: greedy by size, deterministic."""
    load = [0] * n
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


class ZeroOptimizer:
    """AdamW over the parameters this rank owns, with the interface the trainer uses.

    `param_groups` lists every parameter (as the plain optimizer would); the trainer sets
    g["lr"] there and `step()` hands the hyperparameters to the inner AdamW, steps the owned
    parameters, then broadcasts every parameter from its owner. `state` is the inner AdamW's
    state (owned parameters only): the checkpoint, the migration and the memory report read it.
    """

    def __init__(self, groups: list[dict[str, Any]], sync, **defaults: Any) -> None:
        self.sync = sync
        self.defaults = defaults
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        owned = [{**g, "params": [p for p in g["params"] if sync.owns(p)]}
                 for g in self.param_groups]
        # torch.optim refuses an optimizer without parameters (a rank may own none)
        self.inner = (torch.optim.AdamW(owned, **defaults)
                      if any(g["params"] for g in owned) else None)

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    def owns(self, p: nn.Parameter) -> bool:
        return self.sync.owns(p)

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            for og, ig in zip(self.param_groups, self.inner.param_groups, strict=True):
                for k, v in og.items():
                    if k != "params":
                        ig[k] = v
            self.inner.step()
        self.sync.broadcast_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()


def build_optimizer(model: nn.Module, sync, lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float):
    """The trainer's AdamW: decay for matrices (dim >= 2), none for vectors; plain
    torch.optim.AdamW at zero=0 (exactly the optimizer of earlier versions), else sharded."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if sync.zero == 0:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
    return ZeroOptimizer(groups, sync, lr=lr, betas=betas, eps=eps, foreach=False)
