"""The checkpoint manager: what a run saves (model, optimizer, migration state, the meta that
resume and `trainer.export` read), resuming, and the message a failed step ends with (which
names the last complete checkpoint to restart from). The format: trainer/checkpoint.py."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import find_latest, load_checkpoint, named_moe_layers, read_meta, save_checkpoint
from .common import TrainingError, log
from .elastic import LoadRecord, remap_placement

__all__ = ["CheckpointManager"]


class CheckpointManager:
    def __init__(self, tr):
        self.tr = tr
        self.root = Path(tr.cfg.train.out_dir) / "checkpoints"
        self.load = LoadRecord(tr.cfg.balance.window)

    def after_step(self, counts) -> None:
        """The step's tokens per expert (`StepStats.last_counts`), for the recorded load."""
        self.load.add(counts)

    def save(self) -> Path:
        tr = self.tr
        meta = {"model": tr.mcfg.to_dict(), "run": tr.cfg.to_dict(),
                "mesh": {"pp": tr.mesh.pp, "dp": tr.mesh.dp, "ep": tr.mesh.ep, "tp": tr.mesh.tp}}
        if tr.hf is not None:  # what trainer.export needs to write the same model type back
            meta["hf"] = {"model_type": tr.hf.model_type, "source": str(tr.hf.path.resolve()),
                          "config": tr.hf.config}
        meta["elastic"] = tr.elastic  # trainer/elastic.py: the configured world, re-planned?
        layer_state = tr.balancer.state_by_layer() if tr.balancer else {}
        # the recorded expert load a run with another EP size re-balances from
        for name, load in self.load.by_layer(tr.stats.layer_names).items():
            layer_state[name] = dict(layer_state.get(name, {}), load=load)
        return save_checkpoint(self.root, tr.step, tr.model, tr.optim, meta,
                               keep=tr.cfg.train.ckpt_keep, layer_state=layer_state)

    def resume(self, path: Path) -> None:
        tr = self.tr
        meta = read_meta(path)
        placement = remap_placement(meta, named_moe_layers(tr.model), tr.mesh.ep)
        if placement:
            saved_ep = (meta.get("mesh") or {}).get("ep")
            log(f"elastic: EP size {saved_ep} -> {tr.mesh.ep}: expert placement of "
                f"{len(placement)} MoE layer(s) on this rank re-balanced from the recorded load",
                tr.rank)
        meta = load_checkpoint(path, tr.model, tr.optim, tr.mcfg.to_dict(), placement)
        tr.step = int(meta["step"])
        if tr.balancer is not None:
            tr.balancer.load_state_by_layer(meta.get("layer_state", {}))

    def fault(self, e: BaseException) -> TrainingError:
        """The error a failed collective (a dead or hung peer) ends the run with."""
        tr = self.tr
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        last = find_latest(self.root)
        step = tr.step if tr.phase in ("checkpoint save", "evaluation") else tr.step + 1
        return TrainingError(
            f"rank {tr.rank}: {tr.phase} failed at step {step}: {first}. A peer rank probably "
            f"died or hung (train.timeout_s={tr.cfg.train.timeout_s:g}). Last complete "
            f"checkpoint: {last if last else 'none'}; restart with --resume (or run under "
            f"torchrun --max-restarts N with --train.resume=auto to do it automatically)")
