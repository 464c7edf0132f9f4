"""Load monitor and trigger policy: when to plan a migration, and with which budget.

The trainer calls :meth:`Monitor.record` once per step with the token count of every logical
expert of every MoE layer (``counts_LE``), either already summed over the EP group or with
``group`` given so the monitor sums it. Counts are indexed by *logical* expert, so they stay
valid across a migration and the window is not reset by one. The imbalance of a layer is
``max rank load / mean rank load`` of the windowed counts under the current placement.

A layer migrates when (all of): the window is full, ``cooldown`` steps have passed since its
last planning event, its imbalance exceeds ``threshold``, and the plan lowers its max rank
load by at least ``min_gain`` (a move that buys < 2 % is not worth copying weights for).

Shape legend: L MoE layers, E experts per layer, R ranks in the EP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from balance.placement import Swap, apply_swaps, as_placement
from balance.planner import METHODS, plan_swaps, plan_swaps_within

__all__ = ["MigrationPolicy", "Monitor"]


@dataclass(frozen=True)
class MigrationPolicy:
    """Trigger policy (one section of the run config).

    The defaults are this project's choices, not published values: the Piper preprint gives
    the algorithm (threshold + at most T hill-climbing swaps) but not its settings.
    """

    threshold: float = 1.2  # imbalance (max/mean rank load) above which a layer is planned
    window: int = 16  # steps of counts summed into the load estimate
    cooldown: int = 50  # steps between two planning events of the same layer
    max_swaps: int = 8  # T: most swaps per layer per event
    method: str = "minmax"  # a balance.METHODS entry
    min_gain: float = 0.02  # minimum relative drop of the max rank load to execute a plan
    tolerance: float = 0.01  # minmax: accept a max this much above the best for fewer moves

    def __post_init__(self) -> None:
        if not self.threshold >= 1.0:
            raise ValueError(f"threshold must be >= 1.0 (max/mean load), got {self.threshold}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 step, got {self.window}")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be >= 0 steps, got {self.cooldown}")
        if self.max_swaps < 0:
            raise ValueError(f"max_swaps must be >= 0, got {self.max_swaps}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; valid: {', '.join(METHODS)}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not self.tolerance >= 0.0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")


class Monitor:
    """Sliding-window per-layer, per-expert token counts and the migration trigger.

    Args:
        n_layers: L, MoE layers watched (each with its own placement).
        n_experts: E, logical experts per layer.
        n_ranks: R, EP group size; E must be a multiple of R.
        policy: trigger settings; defaults to ``MigrationPolicy()``.
        group: if given, :meth:`record` sums the counts over this process group itself.
        blocks: if given, rank lists (nodes) that experts never leave: each is planned on
            its own (:func:`balance.plan_swaps_within`).
    """

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        n_ranks: int,
        policy: MigrationPolicy | None = None,
        group: Any = None,
        blocks: list[list[int]] | None = None,
    ) -> None:
        if n_layers < 1 or n_experts < 1 or n_ranks < 1:
            raise ValueError(
                f"n_layers, n_experts, n_ranks must be >= 1, got {n_layers}, {n_experts}, {n_ranks}"
            )
        if n_experts % n_ranks != 0:
            raise ValueError(f"n_experts={n_experts} is not a multiple of n_ranks={n_ranks}")
        self.n_layers, self.n_experts, self.n_ranks = n_layers, n_experts, n_ranks
        self.policy = policy if policy is not None else MigrationPolicy()
        self.group = group
        # rank blocks no expert leaves (routing bound to nodes: the nodes' ranks), or None
        self.blocks = blocks
        self._ring = np.zeros((self.policy.window, n_layers, n_experts), dtype=np.float64)
        self.steps_recorded = 0
        # Last step each layer was planned; cooldown counts from here.
        self._last_event = [-(10**18)] * n_layers
        self.events: list[dict[str, Any]] = []

    def record(self, counts: Any) -> None:
        """Add one step's counts ``[L, E]`` (or ``[E]`` when L == 1); all-reduced if group set."""
        if self.group is not None:
            t = torch.as_tensor(counts).detach().to(torch.float64).clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            counts = t
        if isinstance(counts, torch.Tensor):
            counts = counts.detach().cpu().to(torch.float64).numpy()
        arr = np.asarray(counts, dtype=np.float64)
        if arr.ndim == 1 and self.n_layers == 1:
            arr = arr[None, :]
        if arr.shape != (self.n_layers, self.n_experts):
            raise ValueError(
                f"counts must have shape [L, E] = [{self.n_layers}, {self.n_experts}], "
                f"got {list(arr.shape)}"
            )
        if np.any(arr < 0):
            raise ValueError("counts must be >= 0")
        self._ring[self.steps_recorded % self.policy.window] = arr
        self.steps_recorded += 1

    @property
    def window_full(self) -> bool:
        return self.steps_recorded >= self.policy.window

    def load(self) -> np.ndarray:
        """``[L, E]`` counts summed over the last ``window`` steps (fewer before it fills)."""
        return self._ring.sum(axis=0)

    def _placements(self, expert2rank: Any) -> list[np.ndarray]:
        if isinstance(expert2rank, torch.Tensor):
            expert2rank = expert2rank.detach().cpu().numpy()
        arr = np.asarray(expert2rank)
        if arr.ndim == 1 and self.n_layers == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[0] != self.n_layers:
            raise ValueError(
                f"expert2rank must have shape [L, E] = [{self.n_layers}, {self.n_experts}], "
                f"got {list(arr.shape)}"
            )
        return [as_placement(row, self.n_ranks, self.n_experts) for row in arr]

    def rank_loads(self, expert2rank: Any) -> np.ndarray:
        """``[L, R]`` windowed load of each rank under the placement ``expert2rank [L, E]``."""
        w = self.load()
        return np.stack(
            [
                np.bincount(p, weights=w[i], minlength=self.n_ranks)
                for i, p in enumerate(self._placements(expert2rank))
            ]
        )

    def imbalance(self, expert2rank: Any) -> list[float]:
        """Per-layer max rank load / mean rank load (1.0 for a layer with no tokens yet)."""
        rl = self.rank_loads(expert2rank)
        mean = rl.mean(axis=1)
        return [float(m / a) if a > 0 else 1.0 for m, a in zip(rl.max(axis=1), mean, strict=True)]

    def due(self, step: int, expert2rank: Any) -> list[int]:
        """Layers whose window is full, cooldown has passed and imbalance exceeds threshold."""
        if not self.window_full:
            return []
        pol = self.policy
        imb = self.imbalance(expert2rank)
        return [
            i
            for i in range(self.n_layers)
            if step - self._last_event[i] >= pol.cooldown and imb[i] > pol.threshold
        ]

    def plan(self, step: int, expert2rank: Any) -> dict[int, list[Swap]]:
        """Plan swaps for every due layer; returns ``{layer: swaps}`` for plans worth running.

        Each planned layer starts its cooldown, whether or not its plan passed ``min_gain``
        (re-planning the same counts every step would find the same nothing). Every planned
        layer is appended to :attr:`events` so the trainer can log it.
        """
        pol = self.policy
        placements = self._placements(expert2rank)
        w = self.load()
        out: dict[int, list[Swap]] = {}
        for i in self.due(step, expert2rank):
            p = placements[i]
            if self.blocks is not None:
                swaps = plan_swaps_within(w[i], p, self.n_ranks, self.blocks, pol.max_swaps,
                                          pol.method, tolerance=pol.tolerance)
            else:
                swaps = plan_swaps(
                    w[i], p, self.n_ranks, pol.max_swaps, pol.method, tolerance=pol.tolerance
                )
            before = np.bincount(p, weights=w[i], minlength=self.n_ranks).max()
            q = np.asarray(apply_swaps(p, swaps))
            after = np.bincount(q, weights=w[i], minlength=self.n_ranks).max()
            mean = w[i].sum() / self.n_ranks
            gain = 1.0 - after / before if before > 0 else 0.0
            run = bool(swaps) and gain >= pol.min_gain
            self._last_event[i] = step
            self.events.append(
                {
                    "step": step,
                    "layer": i,
                    "imbalance_before": float(before / mean),
                    "imbalance_after": float((after if run else before) / mean),
                    "swaps": len(swaps) if run else 0,
                    "executed": run,
                }
            )
            if run:
                out[i] = swaps
        return out

    def last_event(self, layer: int) -> int:
        """The step of `layer`'s last planned event (its cooldown starts there)."""
        return int(self._last_event[layer])

    def mark(self, layer: int, step: int) -> None:
        """Start `layer`'s cooldown at `step` (a re-placement planned outside `plan`)."""
        self._last_event[layer] = step

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the trigger exactly after a checkpoint."""
        return {
            "ring": self._ring.copy(),
            "steps_recorded": self.steps_recorded,
            "last_event": list(self._last_event),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ring = np.asarray(state["ring"], dtype=np.float64)
        if ring.shape != self._ring.shape:
            raise ValueError(
                f"checkpointed window has shape {list(ring.shape)}, this monitor expects "
                f"{list(self._ring.shape)} ([window, L, E])"
            )
        self._ring = ring.copy()
        self.steps_recorded = int(state["steps_recorded"])
        self._last_event = [int(x) for x in state["last_event"]]
