"""The training run: build from a validated request (`trainer.setup.prepare`), train, evaluate,
checkpoint, report.

Where each concern lives:
    trainer/setup.py         request validation (`prepare`), model config, schedule
    trainer/build.py         device, model + EP sharding, pipeline stages, HF import, optimizer
    trainer/step.py          the training step (the hot loop)
    trainer/evaluate.py      validation loss
    trainer/observe/stats.py         per-step collection (expert counts, imbalance, exchange time, memory)
    trainer/observe/console.py       metrics.jsonl / counts.jsonl / progress line; trainer/observe/metrics.py sinks
    trainer/ckpt_manager.py  save, resume, the failure message; trainer/checkpoint.py the format
    trainer/faults.py        fault injection hooks for the chaos harness
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .a2a_trial import StepTrial, label, resume_pick
from .balancing import Balancer
from .build import (
    apply_tp,
    build_grad_sync,
    build_model,
    build_optimizer,
    build_pipeline,
    import_hf,
    pick_device,
)
from .checkpoint import named_moe_layers
from .ckpt_manager import CheckpointManager
from .common import TrainingError, log
from .compile import compile_blocks, graph_count
from .distributed.precision import resolve_precision, to_working_dtype
from .distributed.zero import effective_zero
from .evaluate import evaluate
from .faults import install_faults
from .observe.console import StepWriter, truncate_jsonl
from .observe.metrics import Sinks
from .observe.profiling import StepProfiler, parse_profile_steps, stage_ranges
from .observe.stats import StepStats
from .setup import Prepared, build_model_config, model_name, peak_flops, prepare
from .step import StepParts, StepResult, StepState, lr_at, train_step

__all__ = ["Trainer", "TrainingError", "prepare", "build_model_config", "log"]


class Trainer:
    def __init__(self, prep: Prepared):
        self.cfg, self.mcfg, self.mesh, self.corpus = prep.cfg, prep.mcfg, prep.mesh, prep.corpus
        self.resume_path, self.hf, self.rank = prep.resume_path, prep.hf, prep.mesh.rank
        self.elastic = prep.elastic  # the record checkpoints carry (trainer/elastic.py)
        self.cpu_cores = prep.cpu_cores
        t = self.cfg.train
        self.device = pick_device()
        # compute / weight / reduction dtypes (trainer/distributed/precision.py); never silently fp32
        self.precision = resolve_precision(t, self.device.type)
        self.autocast = self.precision.autocast
        self.out = Path(t.out_dir)
        self.model, overlap, trial = build_model(self.cfg, self.mcfg, self.mesh, prep.fb_memory)
        self.fb = overlap == "fb"  # resolve_a2a's: none with ep = 1
        moe_ids = [i for i, b in enumerate(self.model.layers) if b.is_moe]  # the whole model's
        self.pipe = build_pipeline(self.cfg, self.mcfg, self.mesh, self.model, self.precision,
                                   self.device, self.fb) if self.mesh.pp > 1 else None
        self.model.materialize(self.device, seed=t.seed)
        apply_tp(self.cfg, self.model, self.mesh, self.device)  # slices the whole weights
        if self.hf is not None and self.resume_path is None:
            import_hf(self.model, self.hf, self.cfg.model.hf_path, self.out, self.mesh,
                      self.device)
        if self.cfg.debug.skew:  # benchmark knob: a skewed router from step 0
            for layer in self.model.moe_layers():
                E = layer.num_experts
                layer.router.e_score_correction_bias.copy_(
                    -self.cfg.debug.skew * torch.log1p(torch.arange(E, dtype=torch.float32)))
        # the fp32 values above become the optimizer's masters (trainer/distributed/zero.py); the model
        # keeps bf16 working weights from here on (ZeRO-3: FSDP2 casts its fp32 shards)
        self.compiled = compile_blocks(self.model) if t.compile else 0  # lazily, on 1st use
        fp32_values: dict = {}
        self.fsdp: list = []  # ZeRO-3's FSDP2 modules (trainer/distributed/zero3.py)
        if effective_zero(self.cfg.parallel.zero, self.mesh) == 3:
            from .distributed.zero3 import shard_model

            self.fsdp = shard_model(self.model, self.mesh, self.precision, self.device.type,
                                    list(self.pipe.stages.values()) if self.pipe else None)
        else:
            fp32_values = to_working_dtype(self.model, self.precision.param)
        self.stats = StepStats(self.model, self.mesh, self.mcfg, moe_ids, self.device,
                               t.layer_metrics)
        self.profiler = StepProfiler(parse_profile_steps(t.profile_steps, t.steps), self.out,
                                     self.rank, self.device)
        if self.profiler.window and self.pipe is not None:
            stage_ranges(self.pipe.stages)
        self.sync = build_grad_sync(self.cfg, self.model, self.mesh, self.device)
        self.optim = build_optimizer(self.cfg, self.model, self.sync, fp32_values)
        del fp32_values  # the masters the optimizer did not take are freed
        self.hooks = install_faults(self.cfg.debug, self.rank, t.timeout_s)
        self.state = StepState()
        self.balancer = None
        if self.cfg.balance.enabled and self.mesh.ep > 1 and self.model.moe_layers():
            blocks = None
            if self.cfg.comm.route_groups == "node":  # experts stay on their group's node
                from .build import node_blocks

                topo = self.model.moe_layers()[0].dispatcher.topology
                blocks = node_blocks(self.mcfg, self.mesh, topo)
            self.balancer = Balancer(self.cfg.balance, named_moe_layers(self.model), self.mesh.ep,
                                     self.mesh.ep_group, self.optim, blocks,
                                     force_every=self.cfg.debug.force_every)
        self.peak, self.peak_src = (t.peak_tflops * 1e12, "--train.peak_tflops") \
            if t.peak_tflops > 0 else peak_flops(self.device)
        self.flops_per_token = self.mcfg.flops_per_token(t.seq_len)
        self.parts = StepParts(self.cfg, self.mcfg, self.mesh, self.corpus, self.device,
                               self.precision, self.model, self.pipe, self.sync, self.optim,
                               self.stats, self.hooks, self.balancer, self.flops_per_token,
                               self.peak, self.fb)
        self.ckpt = CheckpointManager(self.parts, self.state, self.hf, self.elastic)
        self.trial_candidates = trial  # auto's trial starts in run(), after a resume
        self.trial: StepTrial | None = None

    def _trial(self, candidates: list, resumed: bool) -> StepTrial | None:
        """auto's trial over the next steps (trainer/a2a_trial.py), or None: no choices left;
        a resumed run whose checkpoint recorded a trial it can keep (`resume_pick`: the pick
        is set on the dispatchers); fewer steps left than the trial takes."""
        if not candidates:
            return None
        dispatchers = [layer.dispatcher for layer in self.model.moe_layers()]
        if resumed:
            picked, why = resume_pick(self.ckpt.a2a_trial, candidates, self._trial_mesh())
            if picked is not None:
                for d in dispatchers:
                    d.algorithm, d.overlap, d.chunks = picked
                log(why, self.rank)
                return None
            self.ckpt.a2a_trial = None
            log(f"comm.alltoall / a2a_overlap=auto: a new trial ({why})", self.rank)
        trial = StepTrial(dispatchers, candidates, self.cfg.comm.auto_trial, self.device)
        left = self.cfg.train.steps - self.state.step
        if trial.steps > left:
            log(f"comm.alltoall / a2a_overlap=auto: no trial (its {trial.steps} steps for "
                f"{len(candidates)} choices x {self.cfg.comm.auto_trial} rounds exceed the "
                f"run's {left} left); the rules' choice runs", self.rank)
            return None
        log(f"comm.alltoall / a2a_overlap=auto: the next {trial.steps} steps try "
            f"{', '.join(label(c) for c in candidates)} ({self.cfg.comm.auto_trial} rounds "
            f"after one uncounted step; --comm.auto_trial)", self.rank)
        return trial

    def _trial_mesh(self) -> dict[str, int]:
        """What a recorded trial must have run on to be kept: the mesh and the EP nodes."""
        layers = self.model.moe_layers()
        topo = layers[0].dispatcher.topology if layers else None
        return {"world": self.mesh.world_size, "pp": self.mesh.pp, "dp": self.mesh.dp,
                "ep": self.mesh.ep, "tp": self.mesh.tp,
                "ep_nodes": topo.num_nodes if topo is not None else 1}

    # -- the public surface ------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        return lr_at(self.cfg.optim, step, self.cfg.train.steps)

    def train_step(self) -> StepResult:
        return train_step(self.parts, self.state)

    def evaluate(self) -> float:
        val = evaluate(self.parts)
        for m in self.fsdp:  # FSDP2 keeps a root gathered after a forward without backward
            m.reshard()
        return val

    def save(self) -> Path:
        return self.ckpt.save()

    def resume(self, path: Path) -> None:
        self.ckpt.resume(path)

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t, st = self.cfg.train, self.state
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        if self.resume_path is not None:
            self.resume(self.resume_path)
            log(f"resumed from {self.resume_path} at step {st.step}", self.rank)
        self.trial = self._trial(self.trial_candidates, self.resume_path is not None)
        if self.rank == 0:
            truncate_jsonl(self.out / "metrics.jsonl", st.step)
            truncate_jsonl(self.out / "counts.jsonl", st.step)
        if self.cfg.debug.trace_data:  # each rank its own file of windows read
            truncate_jsonl(self.out / f"data_order.rank{self.rank}.jsonl", st.step)
        log(f"{self.mesh.describe()} | model {model_name(self.cfg)}: "
            f"{self.mcfg.num_params() / 1e6:.2f}M params ({self.mcfg.num_active_params() / 1e6:.2f}M "
            f"active) | data {self.corpus.source}: {self.corpus.n_train:,} train / "
            f"{self.corpus.n_val:,} val tokens | MFU vs {self.peak_src} "
            f"({self.peak / 1e9:.1f} GFLOP/s per process)", self.rank)
        zero = effective_zero(self.cfg.parallel.zero, self.mesh)
        log(f"precision: {self.precision.describe()} | ZeRO-{zero}"
            f"{' (FSDP2)' if zero == 3 else ''}"
            f"{f' | {self.compiled} regions compiled (torch.compile)' if self.compiled else ''}"
            + (f" | CPU affinity: each rank pinned to {len(self.cpu_cores)} core(s) of its own "
               f"(rank 0: {self.cpu_cores})" if self.cpu_cores else ""), self.rank)
        end = min(t.steps, t.stop_after) if t.stop_after > 0 else t.steps
        sinks = Sinks(t, self.out, self.cfg.to_dict(), st.step, self.rank,
                      lambda msg: log(msg, self.rank))
        writer = StepWriter(t, self.out, sinks, st.step, self.cfg.debug.logging_ab)
        try:
            history, last_val = self._loop(end, writer)
        finally:
            sinks.close()
            self.profiler.close()
        ckpt = self.save()
        if st.step < t.steps:
            log(f"stopped after step {st.step} of {t.steps} (--train.stop_after); checkpoint "
                f"{ckpt}; continue with --resume", self.rank)
        else:
            log(f"done: {st.step} steps, final val loss {last_val:.4f} nats/token, checkpoint "
                f"{ckpt}", self.rank)
        if self.rank == 0 and t.plot:
            from .observe.report import plot_loss

            plot_loss(writer.metrics_path, self.out / "loss.png")
        if self.rank == 0 and t.export_hf:
            from .export import export_checkpoint

            log(f"exported a Hugging Face checkpoint: "
                f"{export_checkpoint(ckpt, t.export_hf, progress=False)}", self.rank)
        return {"val_loss": last_val, "history": history}

    def _loop(self, end: int, writer: StepWriter) -> tuple[list[StepResult], float]:
        t, st = self.cfg.train, self.state
        history: list[StepResult] = []
        last_val = float("nan")
        t_start = time.perf_counter()
        graphs_warm = None
        while st.step < end:
            try:
                self.profiler.before(st.step + 1)
                if self.trial is not None:
                    self.trial.before_step()
                m = self.train_step()
                if self.trial is not None:
                    decided = self.trial.after_step(m.step_time_s)
                    if decided:  # the pick stays set on the dispatchers; the loop is done
                        log(decided, self.rank)  # with the trial; checkpoints carry the pick
                        self.ckpt.a2a_trial = self.trial.record(self._trial_mesh(), st.step)
                        self.trial = None
                if self.compiled:  # graphs compiled so far; after warm-up it must not grow
                    m.compiled_graphs = graph_count()
                if self.profiler.after(st.step):
                    log(f"profiler trace of steps {t.profile_steps} (one per rank; open in "
                        f"Perfetto or chrome://tracing): {self.out / 'profile'}/rank_<r>.json for "
                        f"r in 0..{self.mesh.world_size - 1}, e.g. {self.profiler.path}", self.rank)
                st.phase = "evaluation"
                if (t.eval_every and st.step % t.eval_every == 0 and st.step < t.steps) \
                        or st.step == t.steps:
                    last_val = m.val_loss = self.evaluate()
            except RuntimeError as e:
                if isinstance(e, TrainingError):
                    raise
                raise self.ckpt.fault(e) from e
            if self.compiled:
                if graphs_warm is None and (t.eval_every == 0 or st.step >= t.eval_every
                                            or st.step == t.steps):
                    graphs_warm = graph_count()  # warm-up: first step (and first evaluation)
                elif graphs_warm is not None:
                    m.recompilations = graph_count() - graphs_warm
            history.append(m)
            self.ckpt.after_step(self.stats.last_counts)
            if self.rank == 0:
                writer.write(m.row(), m.events, self.stats, m.logged,
                             time.perf_counter() - t_start)
            if t.ckpt_every and st.step % t.ckpt_every == 0 and st.step < t.steps:
                st.phase = "checkpoint save"
                try:
                    self.save()
                except RuntimeError as e:
                    raise self.ckpt.fault(e) from e
        return history, last_val
