"""The training run: validate the request, build the mesh and model, train, evaluate, checkpoint.

Everything that can be wrong with the request (preset, overrides, mesh vs world size, EP vs
expert count, data path, sequence length, resume checkpoint) is checked in `prepare()` before
any process group work or training step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from .balancing import Balancer
from .checkpoint import (
    CheckpointError,
    check_same_model,
    find_latest,
    load_checkpoint,
    named_moe_layers,
    read_meta,
    save_checkpoint,
)
from .config import ConfigError, RunConfig
from .data import Corpus, load_corpus
from .memory import SavedTensorMeter, rss_peak, rss_reset_peak, state_bytes
from .mesh import Mesh, MeshError, valid_divisors
from .metrics import LayerGather, Sinks, check_observability
from .parallel import GradSync, parallelize
from .pipe import build_stages, ce_loss, moe_aux, pp_eval_forward, split_layers
from .profiling import StepProfiler, parse_profile_steps, stage_ranges

__all__ = ["Trainer", "TrainingError", "prepare", "build_model_config", "log"]


class TrainingError(RuntimeError):
    """The run cannot continue (a peer died or hung, repeated non-finite losses); the message
    names the rank, the phase and the step."""

# bf16 dense matrix peak per device (docs/reference.md 3); unknown devices: --train.peak_tflops
_GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "MI250X": 191.5, "MI250": 191.5}


def log(msg: str, rank: int = 0) -> None:
    """Print from global rank 0 only (one helper, so output is never interleaved)."""
    if rank == 0:
        print(msg, flush=True)


def build_model_config(cfg: RunConfig, hf=None):
    """The run's ModelConfig: the preset's (or, with `hf`, an opened `model.HFCheckpoint` of
    --model.hf_path, its config.json's), then the [model] overrides."""
    from model import presets

    if hf is not None:
        mcfg = hf.model_config()
    else:
        try:
            mcfg = presets.get(cfg.model.preset)
        except KeyError as e:
            raise ConfigError(str(e.args[0]) if e.args else str(e)) from None
    if cfg.model.overrides:
        valid = {f.name for f in dataclasses.fields(mcfg)}
        bad = sorted(set(cfg.model.overrides) - valid)
        if bad:
            raise ConfigError(f"unknown model field(s) {bad}; valid ModelConfig fields: {sorted(valid)}")
        try:
            mcfg = dataclasses.replace(mcfg, **cfg.model.overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model overrides {cfg.model.overrides}: {e}") from None
    return mcfg


@dataclass
class Prepared:
    cfg: RunConfig
    mcfg: Any
    mesh: Mesh
    corpus: Corpus
    resume_path: Path | None
    hf: Any = None  # model.HFCheckpoint of --model.hf_path (headers only), or None
    hf_skipped: tuple[int, ...] = ()  # checkpoint layers a run with fewer layers does not load


def prepare(cfg: RunConfig, world_size: int, rank: int) -> Prepared:
    """All request validation, before any training work. Raises a ValueError subclass."""
    hf = hf_skipped = None
    if cfg.model.hf_path:
        from model.hf_checkpoint import HFCheckpoint

        hf = HFCheckpoint(cfg.model.hf_path)  # config.json and safetensors headers only
    mcfg = build_model_config(cfg, hf)
    if hf is not None:
        try:
            hf_skipped = hf.validate(mcfg)  # missing / extra / mis-shaped tensors, named
        except ValueError as e:
            raise ConfigError(f"--model.hf_path: {e}") from None
    par = cfg.parallel
    mesh = Mesh.plan(world_size, rank, pp=par.pp, ep=par.ep, dp=par.dp, placement=par.ep_placement)
    if mesh.pp > 1:
        _check_pipeline(cfg, mcfg, mesh)
    else:  # unused with pp=1, but a wrong value is still a mistake worth naming
        _check_schedule(cfg.parallel, 1)
        split_layers(mcfg.n_layers, cfg.parallel.n_virtual, cfg.parallel.layer_split)
    E = mcfg.n_routed_experts
    if E % mesh.ep:
        raise MeshError(f"ep={mesh.ep} does not divide {E} experts of model {_model_name(cfg)!r}; "
                        f"valid ep: {valid_divisors(E)}")
    if cfg.comm.alltoall not in ("flat", "halo", "auto"):
        raise ConfigError(f"comm.alltoall={cfg.comm.alltoall!r}; valid: flat, halo, auto")
    if cfg.comm.topology:
        from comm import Topology

        if not Path(cfg.comm.topology).is_file():
            raise ConfigError(f"comm.topology={cfg.comm.topology!r} does not exist; pass a TOML "
                              f"topology file (see comm/topology_file.py) or omit it to discover")
        topo = Topology.from_file(cfg.comm.topology)  # raises ValueError naming the bad node
        if topo.world_size != world_size:
            raise ConfigError(f"comm.topology={cfg.comm.topology!r} describes {topo.world_size} "
                              f"ranks but the run has {world_size}")
    t = cfg.train
    from model import CHECKPOINTING

    if t.checkpointing not in CHECKPOINTING:
        raise ConfigError(f"train.checkpointing={t.checkpointing!r}; valid: {', '.join(CHECKPOINTING)}")
    if t.seq_len < 1 or t.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} is outside what the model supports: "
                          f"1..{mcfg.max_seq_len} (model max_seq_len)")
    if t.global_batch < 1 or t.global_batch % mesh.n_data_shards:
        raise ConfigError(f"train.global_batch={t.global_batch} must be a positive multiple of the "
                          f"{mesh.n_data_shards} data shards (dp={mesh.dp} x ep={mesh.ep})")
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps} must be >= 1")
    o = cfg.optim
    # lr = 0 is allowed (weights stay bitwise unchanged: import/export round trips, evaluation)
    if not (math.isfinite(o.lr) and o.lr >= 0) or not (math.isfinite(o.min_lr) and o.min_lr >= 0):
        raise ConfigError(f"optim.lr={o.lr}, optim.min_lr={o.min_lr}: need a finite lr >= 0 and "
                          f"min_lr >= 0")
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} exceeds optim.lr={o.lr}: the cosine schedule "
                          f"decays from lr to min_lr; use min_lr <= lr")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    for name, b in (("beta1", o.beta1), ("beta2", o.beta2)):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optim.{name}={b} must be in [0, 1)")
    if o.weight_decay < 0 or o.grad_clip < 0 or o.eps <= 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay}, grad_clip={o.grad_clip} must be "
                          f">= 0 and optim.eps={o.eps} > 0")
    for name in ("ckpt_every", "eval_every", "stop_after", "max_nonfinite_steps"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    if t.eval_batches < 1 or t.log_every < 1 or t.ckpt_keep < 1:
        raise ConfigError(f"train.eval_batches={t.eval_batches}, log_every={t.log_every}, "
                          f"ckpt_keep={t.ckpt_keep} must be >= 1")
    if not 0 <= t.fault_rank < world_size:
        raise ConfigError(f"train.fault_rank={t.fault_rank} is not a rank of this run: "
                          f"valid 0..{world_size - 1}")
    if cfg.balance.enabled:
        from balance import METHODS, MigrationPolicy

        b = cfg.balance
        if b.method != "default" and b.method not in METHODS:
            raise ConfigError(f"balance.method={b.method!r}; valid: default, {', '.join(METHODS)}")
        MigrationPolicy(threshold=b.threshold, window=b.window, cooldown=b.cooldown,
                        max_swaps=b.max_swaps)  # raises ValueError naming a bad value
        if b.force_every < 0:
            raise ConfigError(f"balance.force_every={b.force_every} must be >= 0")
    if t.nan_policy not in ("skip", "stop"):
        raise ConfigError(f"train.nan_policy={t.nan_policy!r}; valid: skip, stop")
    if t.timeout_s <= 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be > 0 seconds")
    if t.dtype not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.dtype={t.dtype!r}; valid: auto, fp32, bf16")
    check_observability(t)
    parse_profile_steps(t.profile_steps, t.steps)
    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction)
    corpus.check(t.seq_len, mcfg.vocab_size)
    if t.export_hf:
        from .export import check_out_dir, pick_model_type

        try:  # nothing is overwritten, and the model must be a transformers model type
            check_out_dir(Path(t.export_hf), False, "train.export_hf",
                          "choose a new folder (nothing is overwritten)")
            # the meta.json entries export reads at the end of the run
            pick_model_type(mcfg, {"run": cfg.to_dict(),
                                   "hf": {"model_type": hf.model_type} if hf else None}, None)
        except ValueError as e:
            raise ConfigError(f"train.export_hf: {e}") from None
    if cfg.data.doc_mask and corpus.eos_id is None:
        raise ConfigError(f"--data.doc_mask=true needs documents that end with an EOS token: a "
                          f"tokenized .bin with its sidecar naming eos_id (python -m trainer.data "
                          f"prepare); {corpus.source} has none")
    resume_path = None
    if t.resume:
        root = Path(t.out_dir) / "checkpoints"
        if t.resume in ("latest", "auto"):
            resume_path = find_latest(root)
            if resume_path is None and t.resume == "latest":
                raise CheckpointError(f"--resume: no complete checkpoint under {str(root)!r}; "
                                      f"use --train.resume=auto to start fresh when there is none")
        else:
            resume_path = Path(t.resume)
        if resume_path is not None:
            meta = read_meta(resume_path)  # fails early on an incomplete/corrupt checkpoint
            check_same_model(resume_path, meta, mcfg.to_dict())
    if hf_skipped and rank == 0:
        print(f"warning: --model.hf_path {cfg.model.hf_path!r} has {len(hf_skipped) + mcfg.n_layers}"
              f" layers, the run builds {mcfg.n_layers} (model.n_layers): checkpoint layers "
              f"{list(hf_skipped)} are skipped", file=sys.stderr, flush=True)
    return Prepared(cfg, mcfg, mesh, corpus, resume_path, hf, tuple(hf_skipped or ()))


def _model_name(cfg: RunConfig) -> str:
    return cfg.model.hf_path or cfg.model.preset


def build_schedule(par, pp: int):
    """The pipeline schedule of the run config's parallel section (validated by the builder)."""
    import pipeline

    kw = {"n_virtual": par.n_virtual} if par.schedule == "interleaved-1f1b" else {}
    return pipeline.build(par.schedule, pp, par.microbatches, **kw)


def _check_pipeline(cfg: RunConfig, mcfg: Any, mesh: Mesh) -> None:
    par = cfg.parallel
    if mcfg.tie_embeddings:
        raise ConfigError("tie_embeddings=True with pp > 1 is not supported (the embedding and the "
                          "head would live on different stages); use pp=1 or untied embeddings")
    _check_virtual(par)
    split_layers(mcfg.n_layers, mesh.pp * par.n_virtual, par.layer_split)
    per_shard = cfg.train.global_batch // max(1, mesh.n_data_shards)
    if par.microbatches < 1 or per_shard % par.microbatches:
        raise ConfigError(
            f"parallel.microbatches={par.microbatches} must divide the {per_shard} sequences each "
            f"data shard gets per step (train.global_batch={cfg.train.global_batch} / "
            f"{mesh.n_data_shards} shards); valid: {valid_divisors(per_shard)}")
    _check_schedule(par, mesh.pp)


def _check_virtual(par) -> None:
    if par.n_virtual < 1 or (par.n_virtual > 1 and par.schedule != "interleaved-1f1b"):
        raise ConfigError(f"parallel.n_virtual={par.n_virtual}: values > 1 need "
                          f"parallel.schedule='interleaved-1f1b' (got {par.schedule!r})")


def _check_schedule(par, pp: int) -> None:
    """The schedule name and its numbers; with pp=1 too, where they are not used."""
    _check_virtual(par)
    if par.microbatches < 1:
        raise ConfigError(f"parallel.microbatches={par.microbatches} must be >= 1")
    try:
        build_schedule(par, pp)
    except ValueError as e:
        raise ConfigError(f"parallel.schedule={par.schedule!r} with pp={pp}, "
                          f"microbatches={par.microbatches}: {e}") from None


def _peak_flops(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return tf * 1e12, f"{name} bf16 peak"
        return 0.0, f"{name}: unknown peak (set --train.peak_tflops)"
    # CPU: no published peak for an arbitrary host; measure this process's fp32 matmul rate.
    # Best of several short runs, so a busy neighbour lowers the estimate as little as possible.
    n = 768
    a = torch.randn(n, n)
    a @ a
    best = 0.0
    for _ in range(8):
        t0 = time.perf_counter()
        a @ a
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best, "best measured fp32 matmul rate of this process"


class Trainer:
    def __init__(self, prep: Prepared):
        self.cfg, self.mcfg, self.mesh, self.corpus = prep.cfg, prep.mcfg, prep.mesh, prep.corpus
        self.resume_path = prep.resume_path
        self.hf = prep.hf
        self.rank = self.mesh.rank
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        dt = self.cfg.train.dtype
        self.autocast = self.device.type == "cuda" and dt in ("auto", "bf16")
        self.out = Path(self.cfg.train.out_dir)
        self.ckpt_root = self.out / "checkpoints"

        from model import MoETransformer, set_checkpointing

        torch.manual_seed(self.cfg.train.seed)
        # Built on the meta device: each rank allocates only its experts and its pipeline
        # stage's layers, then initialises them with the values a 1-process run has (each
        # tensor, each expert, from its own seeded generator: MoETransformer.reset_parameters).
        with torch.device("meta"):
            self.model = MoETransformer(self.mcfg)
        set_checkpointing(self.model, self.cfg.train.checkpointing)
        self.mesh.build_groups(timedelta(seconds=self.cfg.train.timeout_s))
        algo = self.cfg.comm.alltoall
        topo = self._ep_topology(algo)
        cost_model = self._calibrate_auto(topo) \
            if algo == "auto" and topo is not None and topo.num_nodes > 1 else None
        parallelize(self.model, self.mesh, alltoall=algo, topology=topo, cost_model=cost_model)
        moe_ids = [i for i, b in enumerate(self.model.layers) if b.is_moe]  # the whole model's
        self.stages: dict = {}
        if self.mesh.pp > 1:
            self._build_pipeline()
        self.model.materialize(self.device, seed=self.cfg.train.seed)
        if self.hf is not None and self.resume_path is None:
            self._import_hf()
        if self.cfg.balance.skew:
            for layer in self.model.moe_layers():
                E = layer.expert2slot.numel()
                layer.router.e_score_correction_bias.copy_(
                    -self.cfg.balance.skew * torch.log1p(torch.arange(E, dtype=torch.float32)))
        self._counts: dict[int, torch.Tensor] = {}
        self._entropy: dict[int, torch.Tensor] = {}
        per_layer = self.cfg.train.layer_metrics
        for i, layer in enumerate(self.model.moe_layers()):
            layer.register_forward_hook(self._count_hook(i))
            layer.router.track_entropy = per_layer
        self.layer_names = list(named_moe_layers(self.model))
        local_ids = [i for i, b in enumerate(self.model.layers) if getattr(b, "is_moe", False)]
        self.gather = LayerGather(moe_ids, local_ids, self.mcfg.n_routed_experts, self.mcfg.top_k,
                                  self.mesh.pp, self.mesh.pp_idx, self.mesh.pp_group, self.device,
                                  per_layer)
        self.profiler = StepProfiler(parse_profile_steps(self.cfg.train.profile_steps,
                                                         self.cfg.train.steps),
                                     self.out, self.rank, self.device)
        if self.profiler.window and self.stages:
            stage_ranges(self.stages)
        self._pp_idle: tuple[float, float] | None = None
        self.sync = GradSync(self.model, self.mesh)
        o = self.cfg.optim
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optim = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
        self.step = 0
        self.meter = SavedTensorMeter(self.model)
        self._state_bytes = 0
        self.phase = "setup"
        self.nonfinite_steps = 0
        self.balancer = None
        if self.cfg.balance.enabled and self.mesh.ep > 1 and self.model.moe_layers():
            self.balancer = Balancer(self.cfg.balance, named_moe_layers(self.model), self.mesh.ep,
                                     self.mesh.ep_group, self.optim)
        self.peak, self.peak_src = (self.cfg.train.peak_tflops * 1e12, "--train.peak_tflops") \
            if self.cfg.train.peak_tflops > 0 else _peak_flops(self.device)
        self.flops_per_token = self.mcfg.flops_per_token(self.cfg.train.seq_len)

    def _import_hf(self) -> None:
        """Initial weights from --model.hf_path: each rank reads only the tensors it holds
        (its stage's layers, its experts in their slots); what it read goes to
        <out_dir>/hf_import/rank_<r>.json."""
        from model.hf_checkpoint import load_hf_weights

        t0 = time.perf_counter()
        log(f"loading weights from {self.cfg.model.hf_path} ({self.hf.model_type}, "
            f"{len(self.hf.shapes):,} tensors in {len(set(self.hf.files.values()))} file(s)) ...",
            self.rank)
        rss0 = rss_reset_peak()
        got = load_hf_weights(self.model, self.hf)
        self.hf.close()
        peak = rss_peak()
        rec = self.out / "hf_import"
        rec.mkdir(parents=True, exist_ok=True)
        (rec / f"rank_{self.rank}.json").write_text(json.dumps(
            {"rank": self.rank, "bytes": got["bytes"], "rss_before": rss0, "rss_peak": peak,
             "keys": sorted({k for k, _ in self.hf.reads})}))
        total = torch.tensor([float(got["bytes"])], dtype=torch.float64, device=self.device)
        mine = float(total)
        if self.mesh.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        log(f"loaded in {time.perf_counter() - t0:.1f} s: rank 0 read {got['tensors']} tensors "
            f"({mine / 1e6:.1f} MB), the most any rank read {float(total) / 1e6:.1f} MB", self.rank)

    def _calibrate_auto(self, topo):
        """Fit the flat-vs-HALO cost model on this EP group's real links, once, so that
        `auto` decides with measured numbers (collective over every EP group at once)."""
        from comm import calibrate

        t0 = time.perf_counter()
        log("calibrating the all-to-all cost model for comm.alltoall=auto (EP group spans "
            f"{topo.num_nodes} nodes) ...", self.rank)
        model = calibrate(self.mesh.ep_group, topo, row_numel=self.mcfg.d_model)
        log(f"calibrated in {time.perf_counter() - t0:.1f} s: NIC {model.nic_bandwidth / 1e6:.1f} "
            f"MB/s (HALO), {(model.flat_nic_bandwidth or model.nic_bandwidth) / 1e6:.1f} MB/s "
            f"(flat), intra-node {model.local_bandwidth / 1e6:.0f} MB/s, per message "
            f"{1e6 * model.alpha_net:.0f} us, HALO overhead {1e6 * model.halo_overhead_s:.0f} us",
            self.rank)
        return model

    def _ep_topology(self, algo: str):
        """The EP group's topology for HALO/auto (collective: every rank calls it)."""
        if self.mesh.ep == 1 or algo == "flat" or not dist.is_initialized():
            return None
        from comm import Topology

        path = self.cfg.comm.topology
        full = Topology.from_file(path) if path else Topology.discover(dist.group.WORLD)
        if full.world_size != self.mesh.world_size:
            raise ConfigError(f"topology {path or '(discovered)'} describes {full.world_size} ranks "
                              f"but the run has {self.mesh.world_size}")
        log(full.summary(), self.rank)
        return full.for_group(self.mesh.ep_group)

    def _build_pipeline(self) -> None:
        import pipeline

        par, t = self.cfg.parallel, self.cfg.train
        n_stages = self.mesh.pp * par.n_virtual
        self.bounds = split_layers(self.mcfg.n_layers, n_stages, par.layer_split)
        self.stages = build_stages(self.model, self.mesh.pp, self.mesh.pp_idx, par.n_virtual,
                                   self.bounds, self.autocast)
        self.schedule = build_schedule(par, self.mesh.pp)
        self.n_stages = n_stages
        per_shard = t.global_batch // self.mesh.n_data_shards
        self.act_shape = (per_shard // par.microbatches, t.seq_len, self.mcfg.d_model)
        self.runtime = pipeline.PipelineRuntime(
            self.schedule, self.stages, ce_loss, self.act_shape, group=self.mesh.pp_group,
            device=self.device, aux_fn=moe_aux)

    def _count_hook(self, i: int):
        from model import is_recomputing

        def hook(module, args, output):
            if is_recomputing():  # a checkpointed block's second forward: already counted
                return
            c = module.last_counts.detach().to(torch.float64)
            self._counts[i] = self._counts[i] + c if i in self._counts else c
            if module.router.track_entropy:
                h = module.router.last_entropy_sum.to(torch.float64)
                self._entropy[i] = self._entropy[i] + h if i in self._entropy else h
        return hook

    # -- helpers -------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        o, total = self.cfg.optim, self.cfg.train.steps
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
        return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))

    def _allreduce_mean(self, values: list[float]) -> list[float]:
        """Sum over every rank, / number of data shards: the global-batch mean of per-shard
        values (ranks that do not hold a quantity, e.g. the CE off the last stage, pass 0)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.mesh.world_size > 1:
            dist.all_reduce(t)
            t /= self.mesh.n_data_shards
        return t.tolist()

    def _doc_layout(self, tokens: torch.Tensor):
        """The batch's document layout under --data.doc_mask (None otherwise)."""
        if not self.cfg.data.doc_mask:
            return None
        from model import DocLayout

        return DocLayout.from_tokens(tokens, self.corpus.eos_id)

    def _queue_docs(self, microbatches) -> None:
        """Under --data.doc_mask with pp > 1: every stage gets the layouts of its coming
        forwards, one per micro-batch (every rank holds the whole batch's tokens)."""
        if self.cfg.data.doc_mask:
            layouts = [self._doc_layout(mb) for mb in microbatches]
            for stage in self.stages.values():
                stage.docs.extend(layouts)

    def _check_docs_used(self) -> None:
        left = {s: len(st.docs) for s, st in self.stages.items() if st.docs}
        if left:
            raise RuntimeError(f"document layouts left unused after the step: {left} "
                               f"(a stage ran fewer forwards than micro-batches)")

    def _forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(tokens, doc=self._doc_layout(tokens))
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce, self.model.aux_loss()

    def _expert_counts(self) -> list[torch.Tensor]:
        """Tokens per logical expert of this step (all micro-batches), summed over the stage's
        data shards; one tensor per MoE layer this rank holds."""
        n = len(self.model.moe_layers())
        if n == 0:
            self.last_entropy = []
            return []
        flat = torch.stack([self._counts[i] for i in range(n)])
        if self._entropy:  # the router entropy sums ride along as one more column
            ent = torch.stack([self._entropy[i] for i in range(n)]).to(flat.device)
            flat = torch.cat([flat, ent[:, None]], 1)
        flat = flat.to(self.device)
        if self.mesh.stage_group is not None:
            dist.all_reduce(flat, group=self.mesh.stage_group)
        E = self.mcfg.n_routed_experts
        self.last_entropy = flat[:, E].tolist() if self._entropy else [0.0] * n
        return list(flat[:, :E])

    def _imbalance(self, counts: list[torch.Tensor]) -> list[float]:
        """max EP-rank load / mean EP-rank load of each of this rank's MoE layers (1.0 when
        ep == 1); `LayerGather` averages them over the whole model's layers."""
        vals = []
        for layer, c in zip(self.model.moe_layers(), counts, strict=True):
            E = c.numel()
            rank_of = layer.expert2slot.cpu() // (E // self.mesh.ep)
            load = torch.zeros(self.mesh.ep, dtype=torch.float64).index_add_(0, rank_of, c.cpu())
            vals.append(float(load.max() / load.mean().clamp_min(1e-9)))
        return vals

    # -- phases --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        t = self.cfg.train
        self.model.train()
        tokens, targets = self.corpus.batch(self.step, t.global_batch, t.seq_len, self.mesh.data_idx,
                                            self.mesh.n_data_shards, self.cfg.data.seed)
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        for layer in self.model.moe_layers():  # exclude eval-time exchanges from this step
            if hasattr(layer.dispatcher, "exchange_s"):
                layer.dispatcher.exchange_s = 0.0
        if t.fault_stall_step == self.step + 1 and self.rank == t.fault_rank:  # fault injection
            log(f"fault injection: rank {self.rank} stalls at step {self.step + 1}", 0)
            time.sleep(10 * t.timeout_s + 60)
        self._logging = t.layer_metrics and not (t.logging_ab and self.step % 2)
        self.gather.per_layer = self._logging
        for layer in self.model.moe_layers():
            layer.router.track_entropy = self._logging
        t0 = time.perf_counter()
        self._counts, self._entropy = {}, {}
        self.phase = "forward/backward (MoE all-to-all, pipeline P2P)"
        meter = self.meter if t.memory_report else contextlib.nullcontext()
        if t.memory_report:
            self.meter.reset_peak()
        with meter, record_function("forward_backward"):
            ce, aux = self._forward_backward(tokens, targets)
        t1 = time.perf_counter()
        if t.fault_nan_step == self.step + 1 and self.rank == t.fault_rank:  # fault injection
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
                    break
            ce = ce * float("nan")
        self.phase = "gradient all-reduce"
        with record_function("grad_sync"):
            self.sync.sync()
            norm = self.sync.clip(self.cfg.optim.grad_clip)
        t2 = time.perf_counter()
        loss, aux_v = self._allreduce_mean([float(ce.detach()), float(aux.detach())])
        lr = self.lr_at(self.step)
        events: list[dict[str, Any]] = []
        self.phase = "metrics all-reduce"
        counts = self._expert_counts()
        self.last_counts = counts
        imbalance = self._imbalance(counts)  # of the placement this step ran with
        t3 = time.perf_counter()
        if math.isfinite(loss) and math.isfinite(norm):  # global values: every rank agrees
            self.phase = "optimizer step"
            for g in self.optim.param_groups:
                g["lr"] = lr
            with record_function("optimizer.step"):
                self.optim.step()
            if t.memory_report:  # weights + grads + optimizer state, all alive right now
                self._state_bytes = state_bytes(self.model, self.optim)
            self.optim.zero_grad(set_to_none=True)
            if self.mcfg.bias_balancing:
                for layer, c in zip(self.model.moe_layers(), counts, strict=True):
                    layer.router.update_bias(c.to(self.device))
            self.phase = "expert migration"
            events = self.balancer.after_step(self.step + 1, counts) if self.balancer else []
        else:
            self.optim.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            events = [{"event": "nonfinite", "step": self.step + 1, "loss": loss,
                       "grad_norm": norm, "action": "skipped step",
                       "count": self.nonfinite_steps}]
            if t.nan_policy == "stop" or self.nonfinite_steps > t.max_nonfinite_steps:
                raise TrainingError(
                    f"non-finite loss/gradient at step {self.step + 1} (loss {loss}, grad norm "
                    f"{norm}); {self.nonfinite_steps} such step(s), policy {t.nan_policy!r} allows "
                    f"{0 if t.nan_policy == 'stop' else t.max_nonfinite_steps}; stopping. The "
                    f"weights are those of the last finite step; lower optim.lr or check the data")
        t4 = time.perf_counter()
        self.phase = "metrics all-reduce"  # every stage's layers, migrations, pipeline idle
        gathered = self.gather.reduce(counts, self.last_entropy, imbalance, events,
                                      self.layer_names, self._pp_idle)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        wait = self._exchange_time()
        if t.memory_report:
            wait.update(self._memory())
        self.step += 1
        tok_s = t.global_batch * t.seq_len / dt
        mfu = self.flops_per_token * tok_s / (self.peak * self.mesh.world_size) if self.peak else 0.0
        layers = gathered.pop("layers", None)
        row = {"step": self.step, "loss": loss, "aux_loss": aux_v, "lr": lr, "grad_norm": norm,
               "tokens_per_s": tok_s, "mfu": mfu, **gathered, "step_time_s": dt,
               "fwd_bwd_s": t1 - t0, "grad_sync_s": t2 - t1, "optim_s": t4 - t3, **wait,
               "time": time.time()}  # wall clock: row-to-row intervals include the logging
        if self.nonfinite_steps:
            row["nonfinite_steps"] = self.nonfinite_steps
        if layers is not None:
            row["layers"] = layers
        return {**row, "events": events}

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor):
        """One step's forward and backward (pipelined when pp > 1); returns (ce, aux)."""
        if self.stages:
            M = self.cfg.parallel.microbatches
            first, last = 0 in self.stages, self.n_stages - 1 in self.stages
            self._queue_docs(tokens.chunk(M))
            w0 = time.perf_counter()
            losses = self.runtime.step(list(tokens.chunk(M)) if first else None,
                                       list(targets.chunk(M)) if last else None)
            wall = time.perf_counter() - w0  # this rank's idle: wall minus its actions' spans
            self._pp_idle = (wall - sum(sp.end - sp.start for sp in self.runtime.spans), wall)
            self._check_docs_used()
            ce = torch.stack(losses).mean() if last else torch.zeros(())
            aux = torch.tensor(sum(self.runtime.last_aux.values()) / M)
        else:
            ce, aux = self._forward_loss(tokens, targets)
            (ce + aux).backward()
        return ce, aux

    def _memory(self) -> dict[str, float]:
        """Max over ranks of state bytes and of peak saved-activation bytes this step."""
        t = torch.tensor([float(self._state_bytes), float(self.meter.peak)], dtype=torch.float64,
                         device=self.device)
        if self.mesh.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"mem_state_bytes_max": float(t[0]), "mem_act_peak_bytes_max": float(t[1])}

    def _exchange_time(self) -> dict[str, float]:
        """Seconds this step's forward MoE exchanges took, max and min over the EP group."""
        disps = [layer.dispatcher for layer in self.model.moe_layers()
                 if hasattr(layer.dispatcher, "exchange_s")]
        if not disps:
            return {}
        mine = sum(d.exchange_s for d in disps)
        for d in disps:
            d.exchange_s = 0.0
        t = torch.tensor([mine, -mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.mesh.ep_group)
        return {"ep_exchange_max_s": float(t[0]), "ep_exchange_min_s": float(-t[1])}

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.train
        self.model.eval()
        total = 0.0
        for v in range(t.eval_batches):
            tokens, targets = self.corpus.batch(v, t.global_batch, t.seq_len, self.mesh.data_idx,
                                                self.mesh.n_data_shards, self.cfg.data.seed, "val")
            tokens, targets = tokens.to(self.device), targets.to(self.device)
            if self.stages:
                self._queue_docs([tokens])
                ce = pp_eval_forward(self.stages, self.mesh.pp, self.n_stages, self.mesh.pp_ranks(),
                                     tokens, targets, (tokens.shape[0], *self.act_shape[1:]),
                                     self.device)
                self._check_docs_used()
                total += ce or 0.0
            else:
                ce, _ = self._forward_loss(tokens, targets)
                total += float(ce)
        return self._allreduce_mean([total / t.eval_batches])[0]

    def _fault(self, e: BaseException) -> TrainingError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        last = find_latest(self.ckpt_root)
        step = self.step if self.phase in ("checkpoint save", "evaluation") else self.step + 1
        return TrainingError(
            f"rank {self.rank}: {self.phase} failed at step {step}: {first}. A peer rank "
            f"probably died or hung (train.timeout_s={self.cfg.train.timeout_s:g}). Last complete "
            f"checkpoint: {last if last else 'none'}; restart with --resume (or run under torchrun "
            f"--max-restarts N with --train.resume=auto to do it automatically)")

    def save(self) -> Path:
        meta = {"model": self.mcfg.to_dict(), "run": self.cfg.to_dict(),
                "mesh": {"pp": self.mesh.pp, "dp": self.mesh.dp, "ep": self.mesh.ep}}
        if self.hf is not None:  # what trainer.export needs to write the same model type back
            meta["hf"] = {"model_type": self.hf.model_type, "source": str(self.hf.path.resolve()),
                          "config": self.hf.config}
        layer_state = self.balancer.state_by_layer() if self.balancer else {}
        return save_checkpoint(self.ckpt_root, self.step, self.model, self.optim, meta,
                               keep=self.cfg.train.ckpt_keep, layer_state=layer_state)

    def resume(self, path: Path) -> None:
        meta = load_checkpoint(path, self.model, self.optim, self.mcfg.to_dict())
        self.step = int(meta["step"])
        if self.balancer is not None:
            self.balancer.load_state_by_layer(meta.get("layer_state", {}))

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t = self.cfg.train
        metrics_path = self.out / "metrics.jsonl"
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        if self.resume_path is not None:
            self.resume(self.resume_path)
            log(f"resumed from {self.resume_path} at step {self.step}", self.rank)
        if self.rank == 0:
            _truncate_metrics(metrics_path, self.step)
            _truncate_metrics(self.out / "counts.jsonl", self.step)
        log(f"{self.mesh.describe()} | model {_model_name(self.cfg)}: "
            f"{self.mcfg.num_params() / 1e6:.2f}M params ({self.mcfg.num_active_params() / 1e6:.2f}M "
            f"active) | data {self.corpus.source}: {len(self.corpus.train):,} train / "
            f"{len(self.corpus.val):,} val tokens | MFU vs {self.peak_src} "
            f"({self.peak / 1e9:.1f} GFLOP/s per process)", self.rank)
        t_start = time.perf_counter()
        start_step = self.step
        end = min(t.steps, t.stop_after) if t.stop_after > 0 else t.steps
        sinks = Sinks(t, self.out, self.cfg.to_dict(), self.step, self.rank,
                      lambda msg: log(msg, self.rank))
        try:
            history, last_val = self._loop(end, sinks, metrics_path, t_start, start_step)
        finally:
            sinks.close()
            self.profiler.close()
        ckpt = self.save()
        if self.step < t.steps:
            log(f"stopped after step {self.step} of {t.steps} (--train.stop_after); checkpoint "
                f"{ckpt}; continue with --resume", self.rank)
        else:
            log(f"done: {self.step} steps, final val loss {last_val:.4f} nats/token, checkpoint "
                f"{ckpt}", self.rank)
        if self.rank == 0 and t.plot:
            from .report import plot_loss

            plot_loss(metrics_path, self.out / "loss.png")
        if self.rank == 0 and t.export_hf:
            from .export import export_checkpoint

            log(f"exported a Hugging Face checkpoint: "
                f"{export_checkpoint(ckpt, t.export_hf, progress=False)}", self.rank)
        return {"val_loss": last_val, "history": history}

    def _loop(self, end: int, sinks: Sinks, metrics_path: Path, t_start: float,
              start_step: int) -> tuple[list[dict[str, Any]], float]:
        t = self.cfg.train
        history: list[dict[str, Any]] = []
        last_val = float("nan")
        while self.step < end:
            try:
                self.profiler.before(self.step + 1)
                m = self.train_step()
                if self.profiler.after(self.step):
                    log(f"profiler trace of steps {t.profile_steps} (one per rank; open in "
                        f"Perfetto or chrome://tracing): {self.out / 'profile'}/rank_<r>.json for "
                        f"r in 0..{self.mesh.world_size - 1}, e.g. {self.profiler.path}", self.rank)
                self.phase = "evaluation"
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                    last_val = m["val_loss"] = self.evaluate()
                if self.step == t.steps:
                    last_val = m["val_loss"] = self.evaluate()
            except RuntimeError as e:
                if isinstance(e, TrainingError):
                    raise
                raise self._fault(e) from e
            history.append(m)
            events = m.pop("events")
            if self.rank == 0 and t.trace_counts and self.last_counts:
                # routing trace, for benchmarks/bench_balance.py --trace: every stage's MoE
                # layers with --train.layer_metrics (the default), else rank 0's
                all_layers = self.gather.last_counts is not None
                counts = self.gather.last_counts if all_layers else self.last_counts
                ids = self.gather.moe_ids if all_layers else self.gather.local_ids
                with open(self.out / "counts.jsonl", "a") as f:
                    f.write(json.dumps({"step": self.step, "layers": ids, "counts": [
                        [int(v) for v in c.tolist()] for c in counts]}) + "\n")
            if self.rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                    for ev in events:
                        f.write(json.dumps(ev) + "\n")
                if self._logging or not t.logging_ab:
                    sinks.write(m)
                for ev in events:
                    log(_format_event(ev), self.rank)
                if self.step % t.log_every == 0 or "val_loss" in m or self.step == t.steps:
                    elapsed = time.perf_counter() - t_start
                    eta = elapsed / (self.step - start_step) * (t.steps - self.step)
                    log(_format(m, t.steps, eta), self.rank)
            if t.ckpt_every and self.step % t.ckpt_every == 0 and self.step < t.steps:
                self.phase = "checkpoint save"
                try:
                    self.save()
                except RuntimeError as e:
                    raise self._fault(e) from e
        return history, last_val


def _format(m: dict[str, Any], total: int, eta: float) -> str:
    width = 20
    done = int(width * m["step"] / total)
    bar = "#" * done + "-" * (width - done)
    s = (f"[{bar}] {m['step']:>5}/{total} | loss {m['loss']:.4f} | aux {m['aux_loss']:.4f} | "
         f"lr {m['lr']:.2e} | {m['tokens_per_s'] / 1e3:.1f}k tok/s | MFU {100 * m['mfu']:.1f}% | "
         f"imbalance {m['imbalance']:.2f} | eta {eta:.0f}s")
    if "val_loss" in m:
        s += f" | val {m['val_loss']:.4f}"
    return s


def _format_event(ev: dict[str, Any]) -> str:
    if ev["event"] == "nonfinite":
        return (f"  non-finite loss/gradient at step {ev['step']} (loss {ev['loss']}, grad norm "
                f"{ev['grad_norm']}): {ev['action']} ({ev['count']} so far)")
    s = (f"  migration at step {ev['step']}: {ev['layer']} {ev['swaps']} swap(s), "
         f"{ev['moved_experts']} experts moved, {ev['bytes_sent'] / 1e6:.2f} MB sent by rank 0, "
         f"{1e3 * ev['seconds']:.1f} ms")
    if "imbalance_before" in ev:
        s += f", imbalance {ev['imbalance_before']:.2f} -> {ev['imbalance_after_planned']:.2f} (window)"
    return s


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric rows of steps the resumed run will redo."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))
