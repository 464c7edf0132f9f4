"""Fault injection for the chaos harness (benchmarks/chaos.py), installed as step hooks.

The step knows only `StepHooks`: `before_step(step)` runs before the forward, and
`after_backward(step, model, ce)` may change the loss after the backward. A run without
--debug.fault_* options gets the no-op hooks; with them, `install_faults` returns hooks that
stall one rank (a hung peer) or poison its gradients and loss with NaN (a non-finite step).
"""

from __future__ import annotations

import time

import torch

from .common import log
from .distributed.precision import grad_of

__all__ = ["StepHooks", "FaultHooks", "install_faults"]


class StepHooks:
    """What the step calls around its work; the defaults do nothing."""

    def before_step(self, step: int) -> None:
        pass

    def after_backward(self, step: int, model: torch.nn.Module,
                       ce: torch.Tensor) -> torch.Tensor:
        return ce


class FaultHooks(StepHooks):
    """Rank `rank` stalls at step `stall_step` or gets NaN gradients and loss at `nan_step`
    (1-based steps; 0 = never)."""

    def __init__(self, rank: int, my_rank: int, stall_step: int, nan_step: int,
                 stall_s: float):
        self.rank, self.my_rank = rank, my_rank
        self.stall_step, self.nan_step, self.stall_s = stall_step, nan_step, stall_s

    def before_step(self, step: int) -> None:
        if self.stall_step == step and self.my_rank == self.rank:
            log(f"fault injection: rank {self.my_rank} stalls at step {step}", 0)
            time.sleep(self.stall_s)

    def after_backward(self, step: int, model: torch.nn.Module,
                       ce: torch.Tensor) -> torch.Tensor:
        if self.nan_step == step and self.my_rank == self.rank:
            for p in model.parameters():
                if (g := grad_of(p)) is not None:
                    g.fill_(float("nan"))
                    break
            return ce * float("nan")
        return ce


def install_faults(d, my_rank: int, timeout_s: float) -> StepHooks:
    """The hooks the run config asks for (`d` = its [debug] section; `timeout_s` =
    train.timeout_s)."""
    if not (d.fault_stall_step or d.fault_nan_step):
        return StepHooks()
    # a stall longer than the collective timeout, so the peers' watchdog fires first
    return FaultHooks(d.fault_rank, my_rank, d.fault_stall_step, d.fault_nan_step,
                      stall_s=10 * timeout_s + 60)
