"""Expert migration during training: `balance.Monitor`, the swap and replica planners and the
one placement executor `balance.move_slots`, wired to the model.

After every optimizer step the trainer hands this object the step's per-layer, per-logical-expert
token counts (already summed over the stage's data shards, so every rank of an EP group and every
DP replica sees the same numbers and plans the same swaps). When the policy fires for a layer,
the experts move inside the EP group with their weights and AdamW moments (`exp_avg`,
`exp_avg_sq`; grads are already released at that point), and the layer's slot map, which the
dispatcher reads, is updated. Swaps (without redundant slots) and replica re-placement (with
them) are both a new slot map (`balance.swap_slots` turns swaps into one), carried out by
`_move` (balance.move_slots, then MoELayer.set_slots). The model's function is unchanged: a logical expert computes
the same thing in any slot.

Under ZeRO-1/2 (trainer/distributed/zero.py) the optimizer keeps AdamW state for the parameters this rank
owns only; ownership is decided by parameter shape and index, so the EP ranks of one dp index
(the ranks that swap rows) own the same expert parameters: both move their rows' moments, or
neither has any (their replica's owner keeps the whole parameter's state and moves it).

`force_every` (--debug.force_every, tests and demos) swaps one expert pair per rank pair every N steps regardless of
load, so migration is exercised on every step it is asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from model import MoELayer

from .config import BalanceConfig

__all__ = ["Balancer"]


class Balancer:
    def __init__(self, cfg: BalanceConfig, layers: dict[str, MoELayer], ep: int, ep_group,
                 optim: torch.optim.Optimizer, blocks: list[list[int]] | None = None,
                 force_every: int = 0) -> None:
        from balance import MigrationPolicy, Monitor

        self.cfg, self.layers, self.ep, self.group, self.optim = cfg, layers, ep, ep_group, optim
        self.force_every = force_every
        self.names = list(layers)
        E = next(iter(layers.values())).num_experts
        self.E, self.El = E, E // ep
        method = "minmax" if cfg.method == "default" else cfg.method
        self.policy = MigrationPolicy(threshold=cfg.threshold, window=cfg.window,
                                      cooldown=cfg.cooldown, max_swaps=cfg.max_swaps, method=method)
        # --comm.route_groups=node: the nodes' EP ranks; no expert leaves its node
        self.blocks = blocks
        self.monitor = Monitor(len(layers), E, ep, self.policy, blocks=blocks)
        self.events: list[dict[str, Any]] = []
        owns = getattr(optim, "owns", None)
        if owns is not None and ep_group is not None:  # ZeRO: the swap partners must agree
            ps = [p for layer in layers.values() for p in layer.experts.parameters()]
            mine = torch.tensor([float(owns(p)) for p in ps], dtype=torch.float64,
                                device=ps[0].device)  # NCCL reduces device tensors only
            lo, hi = mine.clone(), mine.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=ep_group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=ep_group)
            if not torch.equal(lo, hi):
                raise RuntimeError("ZeRO ownership of expert parameters differs across the EP "
                                   "group; migration would pair rows with missing AdamW state")

    def _e2r(self) -> np.ndarray:
        from balance import expert_ranks

        return np.stack([np.asarray(expert_ranks(layer.slot_map(), self.ep))
                         for layer in self.layers.values()])

    def _move(self, layer: MoELayer, new: Any) -> dict[str, Any]:
        """Carry out a placement change of `layer` to slot map `new` (the same on every rank
        of the EP group): rows of weights and AdamW moments move, then the map is set."""
        from balance import expert_state_tensors, move_slots

        ex = layer.experts
        res = move_slots(layer.slot_map().numpy(), new,
                         expert_state_tensors([ex.w1, ex.w2, ex.w3], self.optim), self.group,
                         self.ep, n_experts=self.E)
        layer.set_slots([int(e) for e in new])
        return res

    def _forced(self, step: int) -> dict[int, list]:
        from balance import Swap

        k = step // self.force_every
        plans = {}
        for i, layer in enumerate(self.layers.values()):
            slot2expert = layer.slot_map()
            # neighbouring ranks swap (inside each node's block when routing is node-bound)
            pairs = [(b[j], b[j + 1]) for b in self.blocks for j in range(0, len(b) - 1, 2)] \
                if self.blocks else [(r, r + 1) for r in range(0, self.ep - 1, 2)]
            swaps = [Swap(int(slot2expert[r * self.El + k % self.El]),
                          int(slot2expert[q * self.El + (k + 1) % self.El]))
                     for r, q in pairs]
            plans[i] = swaps
        return plans

    # -- redundant slots (--balance.redundant > 0): re-place replicas instead of swapping ------
    def _slot_maps(self) -> list[np.ndarray]:
        return [layer.slot_map().numpy() for layer in self.layers.values()]

    def _replica_plans(self, step: int) -> dict[int, tuple[np.ndarray, dict[str, float]]]:
        """{layer: (new slot map, planned imbalance)} of the layers due: forced every N steps
        (each rank's redundant slots take the next experts it does not hold), else when the
        window is full, the cooldown passed and the replica-aware imbalance exceeds the
        threshold (balance.plan_replicas, at most 2 * max_swaps slot changes, the policy's
        tolerance), and only when the plan lowers the maximum rank load by >= min_gain."""
        from balance.replicas import plan_replicas, replica_loads

        maps, R = self._slot_maps(), self.ep
        S = maps[0].size // R if maps else 0
        out: dict[int, tuple[np.ndarray, dict[str, float]]] = {}
        if self.force_every:
            if step % self.force_every:
                return {}
            for i, m in enumerate(maps):
                new = m.reshape(R, S).copy()
                for q in range(R):
                    for j in range(self.El, S):
                        held = set(new[q].tolist())
                        e = int(new[q, j])
                        for _ in range(self.E):
                            e = (e + 1) % self.E
                            if e not in held:
                                break
                        new[q, j] = e
                out[i] = (new.reshape(-1), {})
            return out
        if not self.monitor.window_full:
            return {}
        w = self.monitor.load()
        for i, m in enumerate(maps):
            if step - self.monitor.last_event(i) < self.policy.cooldown:
                continue
            loads = replica_loads(w[i], m, R)
            mean = loads.mean()
            if mean <= 0 or loads.max() / mean <= self.policy.threshold:
                continue
            new = plan_replicas(w[i], R, S, current=m, max_moves=2 * self.cfg.max_swaps,
                                tolerance=self.policy.tolerance)
            self.monitor.mark(i, step)
            after = replica_loads(w[i], new, R).max() / mean
            gain = 1.0 - after / (loads.max() / mean)
            if (new != m).any() and gain >= self.policy.min_gain:  # as swaps: >= min_gain
                out[i] = (np.asarray(new), {"imbalance_before": float(loads.max() / mean),
                                            "imbalance_after_planned": float(after)})
        return out

    def _replace(self, step: int) -> list[dict[str, Any]]:
        events = []
        for i, (new, info) in self._replica_plans(step).items():
            name = self.names[i]
            res = self._move(self.layers[name], new)
            events.append({"event": "migration", "step": step, "layer": name, "replicas": True,
                           "swaps": res["moved_slots"], "moved_experts": res["moved_slots"],
                           "bytes_sent": res["bytes_sent"], "seconds": res["seconds"], **info})
        return events

    def after_step(self, step: int, counts: list[torch.Tensor]) -> list[dict[str, Any]]:
        """Record the step's counts; plan and carry out migrations when due. Returns events."""
        from balance import swap_slots

        self.monitor.record(torch.stack([c.cpu() for c in counts]))
        if self.cfg.redundant:
            events = self._replace(step)
            self.events += events
            return events
        if self.force_every:
            plans = self._forced(step) if step % self.force_every == 0 else {}
            planned = {}
        else:
            plans = self.monitor.plan(step, self._e2r())
            planned = {e["layer"]: e for e in self.monitor.events if e["step"] == step}
        events = []
        for i, swaps in plans.items():
            name = self.names[i]
            layer = self.layers[name]
            res = self._move(layer, swap_slots(layer.slot_map(), swaps, self.ep))
            # a permutation: the experts that moved are the slots that changed
            ev = {"event": "migration", "step": step, "layer": name, "swaps": len(swaps),
                  "moved_experts": res["moved_slots"], "bytes_sent": res["bytes_sent"],
                  "seconds": res["seconds"]}
            if i in planned:
                ev["imbalance_before"] = planned[i]["imbalance_before"]
                ev["imbalance_after_planned"] = planned[i]["imbalance_after"]
            events.append(ev)
        self.events += events
        return events

    # -- checkpoint state, keyed by layer name so it survives a change of PP layout ----------
    def state_by_layer(self) -> dict[str, Any]:
        st = self.monitor.state_dict()
        return {name: {"ring": st["ring"][:, i, :].tolist(), "last_event": int(st["last_event"][i]),
                       "steps_recorded": int(st["steps_recorded"])}
                for i, name in enumerate(self.names)}

    def load_state_by_layer(self, saved: dict[str, Any]) -> None:
        if not all("ring" in saved.get(n, {}) for n in self.names):
            return  # checkpoint written without migration: start the window afresh
        ring = np.stack([np.asarray(saved[n]["ring"], dtype=np.float64) for n in self.names], axis=1)
        if ring.shape[0] != self.policy.window:
            return  # the window length changed: the old counts do not fit, start afresh
        self.monitor.load_state_dict({
            "ring": ring, "steps_recorded": saved[self.names[0]]["steps_recorded"],
            "last_event": [saved[n]["last_event"] for n in self.names]})
