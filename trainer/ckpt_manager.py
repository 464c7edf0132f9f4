"""The checkpoint manager: what a run saves (model, optimizer, migration state, the meta that
resume and `trainer.export` read), resuming, and the message a failed step ends with (which
names the last complete checkpoint to restart from). The format: trainer/checkpoint.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import find_latest, load_checkpoint, named_moe_layers, read_meta, save_checkpoint
from .common import TrainingError, log
from .elastic import LoadRecord, remap_placement
from .step import StepParts, StepState

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves and resumes the run the step works on: `parts` (model, optimizer, balancer, ...),
    `state` (the step count it restores, the phase a failure names); `hf` the opened
    `model.HFCheckpoint` of --model.hf_path (or None), `elastic` the record
    `trainer.elastic.resolve` leaves for checkpoints."""

    def __init__(self, parts: StepParts, state: StepState, hf: Any = None,
                 elastic: dict[str, Any] | None = None):
        self.parts, self.state, self.hf = parts, state, hf
        self.elastic = elastic if elastic is not None else {}
        self.root = Path(parts.cfg.train.out_dir) / "checkpoints"
        self.load = LoadRecord(parts.cfg.balance.window)
        # auto's decided trial (trainer/a2a_trial.py: StepTrial.record), saved with every
        # checkpoint from then on; a resume reads the saved one back here
        self.a2a_trial: dict[str, Any] | None = None

    def after_step(self, counts) -> None:
        """The step's tokens per expert (`StepStats.last_counts`), for the recorded load."""
        self.load.add(counts)

    def save(self) -> Path:
        p, hf = self.parts, self.hf
        meta: dict[str, Any] = {
            "model": p.mcfg.to_dict(), "run": p.cfg.to_dict(),
            "mesh": {"pp": p.mesh.pp, "dp": p.mesh.dp, "ep": p.mesh.ep, "tp": p.mesh.tp}}
        if hf is not None:  # what trainer.export needs to write the same model type back
            meta["hf"] = {"model_type": hf.model_type, "source": str(hf.path.resolve()),
                          "config": hf.config}
        meta["elastic"] = self.elastic  # trainer/elastic.py: the configured world, re-planned?
        if self.a2a_trial is not None:
            meta["a2a_trial"] = self.a2a_trial
        layer_state = p.balancer.state_by_layer() if p.balancer else {}
        # the recorded expert load a run with another EP size re-balances from
        for name, load in self.load.by_layer(p.stats.layer_names).items():
            layer_state[name] = dict(layer_state.get(name, {}), load=load)
        return save_checkpoint(self.root, self.state.step, p.model, p.optim, meta,
                               keep=p.cfg.train.ckpt_keep, layer_state=layer_state)

    def resume(self, path: Path) -> None:
        p = self.parts
        meta = read_meta(path)
        placement = remap_placement(meta, named_moe_layers(p.model), p.mesh.ep)
        if placement:
            saved_ep = (meta.get("mesh") or {}).get("ep")
            log(f"elastic: EP size {saved_ep} -> {p.mesh.ep}: expert placement of "
                f"{len(placement)} MoE layer(s) on this rank re-balanced from the recorded load",
                p.mesh.rank)
        meta = load_checkpoint(path, p.model, p.optim, p.mcfg.to_dict(), placement)
        self.state.step = int(meta["step"])
        self.a2a_trial = meta.get("a2a_trial")
        if p.balancer is not None:
            p.balancer.load_state_by_layer(meta.get("layer_state", {}))

    def fault(self, e: BaseException) -> TrainingError:
        """The error a failed collective (a dead or hung peer) ends the run with."""
        st = self.state
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        last = find_latest(self.root)
        step = st.step if st.phase in ("checkpoint save", "evaluation") else st.step + 1
        return TrainingError(
            f"rank {self.parts.mesh.rank}: {st.phase} failed at step {step}: {first}. A peer "
            f"rank probably died or hung (train.timeout_s={self.parts.cfg.train.timeout_s:g}). "
            f"Last complete checkpoint: {last if last else 'none'}; restart with --resume (or "
            f"run under torchrun --max-restarts N with --train.resume=auto to do it "
            f"automatically)")
