"""What a run reports beyond its progress line: per-MoE-layer statistics gathered from every
pipeline stage, and the sinks that receive each step's row (TensorBoard, Weights & Biases).

Per MoE layer and step (tokens of the whole global batch, every data shard and micro-batch):
    load_max_over_mean  max_e c_e / mean_e c_e  (c_e = token copies routed to logical expert e)
    load_cv             std_e c_e / mean_e c_e  (population std; 0 = perfectly even)
    empty_experts       number of experts that received no token
    router_entropy      mean over tokens of H(p_t) = -sum_e p_te ln p_te in nats (ln E = uniform;
                        p = the router's softmax, or its sigmoid scores normalised per token)
    tokens_max          max_e c_e
Each rank knows its own stage's layers (their counts are already summed over the stage's data
shards); one all-reduce over the PP group per step (`LayerGather`, which replaces the one the
EP-imbalance metric needed before) brings every layer, its migrations and each PP rank's
pipeline idle time to every rank of the PP group, so rank 0 writes all of them.

Tags (TensorBoard and W&B use the same names; `tags_of(row)`): see docs/observability.md.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError

__all__ = ["LayerGather", "Sinks", "layer_stats", "tags_of", "check_observability",
           "tensorboard_wanted", "LAYER_KEYS", "ROW_TAGS"]

# the per-layer keys of a metrics.jsonl row's "layers" entries that become tags
LAYER_KEYS = ("load_max_over_mean", "load_cv", "empty_experts", "router_entropy")
_MIG = ("swaps", "moved_experts", "bytes_sent", "seconds")  # migration event fields, summed

# metrics.jsonl row key -> tag (every key a StepResult field: trainer/step.py)
ROW_TAGS = {
    "loss": "train/loss",
    "aux_loss": "train/aux_loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "imbalance": "train/ep_imbalance",
    "val_loss": "val/loss",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "time/step_s",
    "fwd_bwd_s": "time/forward_backward_s",
    "grad_sync_s": "time/grad_sync_s",
    "optim_s": "time/optimizer_s",
    "ep_exchange_max_s": "time/ep_exchange_max_s",
    "ep_exchange_min_s": "time/ep_exchange_min_s",
    "ep_remote_rows": "comm/ep_remote_rows",
    "ep_remote_bytes": "comm/ep_remote_bytes",
    "ep_flat_remote_rows": "comm/ep_flat_remote_rows",
    "ep_node_imbalance": "comm/ep_node_imbalance",
    "pp_idle_max_s": "time/pp_bubble_max_s",
    "pp_idle_frac_max": "time/pp_bubble_frac_max",
    "mem_state_bytes_max": "memory/state_bytes_max",
    "mem_act_peak_bytes_max": "memory/act_peak_bytes_max",
    "migration_swaps": "migration/swaps",
    "migration_moved_experts": "migration/moved_experts",
    "migration_bytes_sent": "migration/bytes_sent",
    "migration_seconds": "migration/seconds",
    "nonfinite_steps": "train/nonfinite_steps",
    "epoch": "data/epoch",
    "tokens_seen": "data/tokens_seen",
}


def layer_stats(layers: list[int], counts_LE: torch.Tensor, entropy_L: torch.Tensor,
                top_k: int) -> list[dict[str, Any]]:
    """The per-layer numbers of one step (see module docstring) from the per-expert counts
    [layers, E] and the router entropy sums [layers] of the global batch."""
    c = counts_LE.to(torch.float64)
    mean, mx = c.mean(1), c.max(1).values
    ok = mean > 0
    nan = torch.full_like(mean, float("nan"))
    cols = zip(layers, (c.sum(1) / top_k).tolist(), mx.tolist(),
               torch.where(ok, mx / mean, nan).tolist(),
               torch.where(ok, c.std(1, unbiased=False) / mean, nan).tolist(),
               (c == 0).sum(1).tolist(), entropy_L.to(torch.float64).tolist(), strict=True)
    return [{"layer": i, "tokens": int(round(n)), "tokens_max": int(m), "load_max_over_mean": r,
             "load_cv": cv, "empty_experts": int(z), "router_entropy": h / n if n > 0 else float("nan")}
            for i, n, m, r, cv, z, h in cols]


class LayerGather:
    """One step's per-layer values from every PP stage, in one all-reduce over the PP group.

    Row g of the buffer belongs to the g-th MoE layer of the whole model (`moe_ids[g]` is its
    layer index); the rank holding it fills [counts (E) | entropy sum | EP imbalance | the four
    migration sums], every other rank zeros, so the sum over the PP group is the full table.
    The tail holds (idle seconds, wall seconds) of the pipeline runtime per PP rank."""

    def __init__(self, moe_ids: list[int], local_ids: list[int], n_experts: int, top_k: int,
                 pp: int, pp_idx: int, pp_group, device: torch.device, per_layer: bool):
        self.moe_ids, self.local_ids, self.E, self.top_k = moe_ids, local_ids, n_experts, top_k
        self.last_counts: torch.Tensor | None = None  # [layers, E] of the last step (per_layer)
        self.rows = [moe_ids.index(i) for i in local_ids]
        self.pp, self.pp_idx, self.group, self.device = pp, pp_idx, pp_group, device
        self.per_layer = per_layer  # may change between steps (the same on every rank)

    def reduce(self, counts: list[torch.Tensor], entropy: list[float], imbalance: list[float],
               events: list[dict], layer_names: list[str], idle_wall: tuple[float, float] | None
               ) -> dict[str, Any]:
        L, W = len(self.moe_ids), (self.E + 2 if self.per_layer else 1) + len(_MIG)
        buf = torch.zeros(L * W + 2 * self.pp, dtype=torch.float64)
        tab = buf[:L * W].view(L, W)
        for j, g in enumerate(self.rows):
            if self.per_layer:
                tab[g, :self.E] = counts[j].to(torch.float64).cpu()
                tab[g, self.E] = entropy[j]
            tab[g, W - len(_MIG) - 1] = imbalance[j]
        for ev in events:
            if ev.get("event") == "migration" and ev.get("layer") in layer_names:
                g = self.rows[layer_names.index(ev["layer"])]
                for k, key in enumerate(_MIG):
                    tab[g, W - len(_MIG) + k] += float(ev[key])
        if idle_wall is not None:
            buf[L * W + 2 * self.pp_idx:L * W + 2 * self.pp_idx + 2] = torch.tensor(idle_wall)
        if self.group is not None:
            dev = buf.to(self.device)
            dist.all_reduce(dev, group=self.group)
            buf = dev.cpu()
            tab = buf[:L * W].view(L, W)
        out: dict[str, Any] = {}
        out["imbalance"] = float(tab[:, W - len(_MIG) - 1].mean()) if L else 1.0
        mig = tab[:, W - len(_MIG):].sum(0)
        if float(mig[0]) > 0:
            out.update({f"migration_{k}": float(v) for k, v in zip(_MIG, mig.tolist(), strict=True)})
        pp_t = buf[L * W:].view(self.pp, 2)
        if idle_wall is not None and float(pp_t[:, 1].min()) > 0:
            out["pp_idle_max_s"] = float(pp_t[:, 0].max())
            out["pp_idle_frac_max"] = float((pp_t[:, 0] / pp_t[:, 1]).max())
        if self.per_layer:
            self.last_counts = tab[:, :self.E].clone()
            out["layers"] = layer_stats(self.moe_ids, tab[:, :self.E], tab[:, self.E], self.top_k)
        return out


def tags_of(row: dict[str, Any]) -> dict[str, float]:
    """{tag: value} of one metrics.jsonl row (the step row, with its "layers")."""
    out = {tag: float(row[k]) for k, tag in ROW_TAGS.items() if k in row}
    for name, v in row.get("source_epochs", {}).items():  # a blend: each source's epochs
        out[f"data/epoch/{Path(name).name}"] = float(v)
    for st in row.get("layers", ()):
        for k in LAYER_KEYS:
            v = float(st[k])
            if math.isfinite(v):
                out[f"moe/layer_{st['layer']:02d}/{k}"] = v
    return out


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tensorboard_wanted(value: Any) -> str:
    """--train.tensorboard as one of "true", "false", "auto" (TOML booleans too)."""
    s = str(value).strip().lower()
    s = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(s, s)
    if s not in ("true", "false", "auto"):
        raise ConfigError(f"train.tensorboard={value!r}; valid: true, false, auto (= on when the "
                          f"tensorboard package is installed)")
    return s


def check_observability(t) -> None:
    """Validate the logging options of a TrainConfig (before any work)."""
    if tensorboard_wanted(t.tensorboard) == "true" and not _installed("tensorboard"):
        raise ConfigError("train.tensorboard=true but the tensorboard package is not installed; "
                          "pip install tensorboard (or pip install -e '.[tensorboard]'), or use "
                          "--train.tensorboard=auto|false")
    if t.wandb_mode not in ("offline", "online"):
        raise ConfigError(f"train.wandb_mode={t.wandb_mode!r}; valid: offline, online")
    if t.wandb_project and not _installed("wandb"):
        raise ConfigError(f"train.wandb_project={t.wandb_project!r} asks for Weights & Biases but "
                          f"the wandb package is not installed; pip install wandb (or pip install "
                          f"-e '.[wandb]'), or drop --train.wandb_project")


class Sinks:
    """Rank 0's TensorBoard writer and W&B run (each optional); `write(row)` per step."""

    def __init__(self, t, out: Path, run_config: dict[str, Any], start_step: int, rank: int,
                 log=print):
        self.tb = self.wandb = None
        self.tb_dir = out / "tensorboard"
        if rank != 0:
            return
        mode = tensorboard_wanted(t.tensorboard)
        if mode == "auto" and not _installed("tensorboard"):
            log("TensorBoard logging is off (package not installed): pip install tensorboard, or "
                "pip install -e '.[tensorboard]', to get <out_dir>/tensorboard")
        elif mode != "false":
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: on resume, TensorBoard drops the old run's events from that step on
            self.tb = SummaryWriter(log_dir=str(self.tb_dir),
                                    purge_step=start_step + 1 if start_step else None)
            log(f"TensorBoard: tensorboard --logdir {self.tb_dir}")
        if t.wandb_project:
            import wandb

            self.wandb = wandb.init(project=t.wandb_project, mode=t.wandb_mode, dir=str(out),
                                    name=out.name, config=run_config, resume="allow")
            log(f"Weights & Biases ({t.wandb_mode}): project {t.wandb_project}, run files under "
                f"{out / 'wandb'}" + ("; upload later with `wandb sync`" if t.wandb_mode ==
                                      "offline" else ""))

    def write(self, row: dict[str, Any]) -> None:
        if self.tb is None and self.wandb is None:
            return
        tags = tags_of(row)
        step = int(row["step"])
        if self.tb is not None:  # one event with every tag: add_scalar costs ~0.2 ms per tag
            from tensorboard.compat.proto.summary_pb2 import Summary

            summ = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in tags.items()])
            self.tb._get_file_writer().add_summary(summ, step)
        if self.wandb is not None:
            self.wandb.log(tags, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tb = self.wandb = None

